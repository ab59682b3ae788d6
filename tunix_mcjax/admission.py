"""Which prompts a step trains on, and which host admits each (whole GRPO groups, O3).

All functions are pure and deterministic in (seed, step): every host computes the same global
batch and the same assignment, so no cross-host traffic is needed to agree on them.
"""

from __future__ import annotations

import numpy as np


def global_prompt_indices(num_prompts: int, batch_size: int, seed: int, step: int,
                          repeat_period: int = 0) -> np.ndarray:
    """Dataset indices of step `step`'s global batch, in order (epoch-wise permutations).

    With `repeat_period > 0` the batches of steps 0..period-1 repeat (benchmark protocol).
    """
    if batch_size > num_prompts:
        raise ValueError(f"batch_size={batch_size} exceeds the dataset's {num_prompts} prompts")
    if repeat_period > 0:
        step %= repeat_period
    per_epoch = num_prompts // batch_size
    epoch, pos = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_prompts)
    return order[pos * batch_size:(pos + 1) * batch_size]


def split_contiguous(num_prompts: int, num_hosts: int) -> list[np.ndarray]:
    """Host h gets batch positions [h*P/H, (h+1)*P/H): the base layout. When H does not divide
    P (the rollout hosts of some disaggregated splits), shares differ by at most one prompt."""
    return np.array_split(np.arange(num_prompts), num_hosts)


def split_balanced(work: np.ndarray, num_hosts: int) -> list[np.ndarray]:
    """Longest-processing-time-first greedy with equal prompt counts per host (O3).

    `work[i]` is prompt i's expected token work. Ties break by position, so it is deterministic.
    Returns each host's batch positions, sorted.
    """
    per_host = len(work) // num_hosts
    load = np.zeros(num_hosts)
    members: list[list[int]] = [[] for _ in range(num_hosts)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        open_hosts = [h for h in range(num_hosts) if len(members[h]) < per_host]
        h = min(open_hosts, key=lambda h: (load[h], h))
        members[h].append(i)
        load[h] += work[i]
    return [np.array(sorted(m), dtype=np.int64) for m in members]


def prompt_work(prompt_lengths: np.ndarray, expected_output: np.ndarray | None,
                num_generations: int) -> np.ndarray:
    """Expected tokens a prompt's group costs: G x (prompt + expected completion)."""
    out = np.zeros_like(prompt_lengths, dtype=np.float64) if expected_output is None \
        else expected_output.astype(np.float64)
    return num_generations * (prompt_lengths + out)


def host_prompt_positions(num_hosts: int, host: int, prompt_lengths: np.ndarray,
                          balance: bool, expected_output: np.ndarray | None = None,
                          num_generations: int = 1) -> np.ndarray:
    """Positions (into the global batch) of the prompts that `host` admits; O3's balance needs
    equal shares."""
    if not balance:
        return split_contiguous(len(prompt_lengths), num_hosts)[host]
    if len(prompt_lengths) % num_hosts:
        raise ValueError(f"{len(prompt_lengths)} prompts do not divide over {num_hosts} hosts")
    work = prompt_work(prompt_lengths, expected_output, num_generations)
    return split_balanced(work, num_hosts)[host]
