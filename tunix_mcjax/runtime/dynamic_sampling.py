"""Dynamic sampling (DAPO; Tunix's DAPO `dynamic_sampling`): a step's groups whose rewards are
all equal carry no GRPO signal, so they are dropped and the step refills from further prompts.

Refill round r of step s draws `batch_size` prompts from (seed, s, r) alone and admits them as
a step's batch is admitted (whole groups per host); rounds stop once every host's surviving
groups together reach `batch_size`, or after `dynamic_sampling_max_rounds`. Every host takes
the same decision from one all-gather of survivor counts per round. A step where no group
survives is skipped: no update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tunix_mcjax import metrics, topology
from tunix_mcjax.config import Config
from tunix_mcjax.runtime import stepmath
from tunix_mcjax.runtime.records import Admission, Rollout


def varied_groups(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """bool [groups]: the groups whose rewards are not all equal."""
    groups = np.asarray(rewards, np.float64).reshape(-1, num_generations)
    return groups.max(axis=1) > groups.min(axis=1)


def refill_prompts(num_prompts: int, batch_size: int, seed: int, step: int,
                   round_: int) -> np.ndarray:
    """Dataset indices of refill round `round_` (>= 1) of `step`: deterministic in (seed, step,
    round), whatever the host count."""
    order = np.random.default_rng([seed, step, round_, 0xDA90]).permutation(num_prompts)
    return order[:min(batch_size, num_prompts)]


def keep_groups(rollout: Rollout, keep: np.ndarray) -> Rollout:
    """`rollout` with only its groups where `keep` holds."""
    g = rollout.num_generations if rollout.prompts else 1
    rows = np.repeat(keep, g)
    pick = np.flatnonzero(rows)
    adm = rollout.admission
    return dataclasses.replace(
        rollout,
        admission=Admission(adm.step, adm.global_indices, adm.local_indices[keep]),
        prompts=tuple(p for p, k in zip(rollout.prompts, keep, strict=True) if k),
        completions=tuple(rollout.completions[j] for j in pick),
        rewards=rollout.rewards[pick], correct=rollout.correct[pick],
        advantages=rollout.advantages[pick],
        masks=None if rollout.masks is None else tuple(rollout.masks[j] for j in pick))


def concat(parts: Sequence[Rollout]) -> Rollout:
    """One rollout of the parts' groups, in round order (the first part's version and timing)."""
    first = parts[0]
    adm = Admission(first.step, np.concatenate([p.admission.global_indices for p in parts]),
                    np.concatenate([p.admission.local_indices for p in parts]))
    masks = None if first.masks is None else tuple(m for p in parts for m in p.masks)
    return dataclasses.replace(
        first, admission=adm, prompts=tuple(x for p in parts for x in p.prompts),
        completions=tuple(c for p in parts for c in p.completions),
        rewards=np.concatenate([p.rewards for p in parts]),
        correct=np.concatenate([p.correct for p in parts]),
        advantages=np.concatenate([p.advantages for p in parts]), masks=masks)


def fill(cfg: Config, rollouts, first: Rollout, history: stepmath.LengthHistory,
         timer: metrics.PhaseTimer, watchdog: topology.Watchdog | None
         ) -> tuple[Rollout, dict[str, float], list[Rollout]]:
    """The step's surviving groups over refill rounds, what was filtered (this host's groups
    dropped, the rounds run, the global survivors), and every round's rollout as drawn (the
    step's reward and accuracy are over these: a filter must not move them)."""
    g, step = cfg.num_generations, first.step
    keep = varied_groups(first.rewards, g)
    parts, dropped, drawn = [keep_groups(first, keep)], int((~keep).sum()), [first]
    rounds, total = 1, 0
    while True:
        total = _allgather_sum(sum(len(p.prompts) for p in parts), watchdog)
        if total >= cfg.batch_size or rounds >= cfg.dynamic_sampling_max_rounds:
            break
        idx = refill_prompts(len(rollouts.prompts.tokens), cfg.batch_size, cfg.seed, step,
                             rounds)
        more = rollouts.rollout(step, first.policy_version, history, timer, global_idx=idx,
                                round_=rounds)
        keep = varied_groups(more.rewards, g) if more.prompts else np.zeros(0, bool)
        drawn.append(more)
        parts.append(keep_groups(more, keep))
        dropped += int((~keep).sum())
        rounds += 1
    out = concat(parts)
    out = dataclasses.replace(out, seconds={p: timer.seconds.get(p, 0.0)
                                            for p in ("admit", "generate", "reward")})
    return out, {"filtered_groups": float(dropped), "sampling_rounds": float(rounds),
                 "surviving_groups": float(total)}, drawn


def _allgather_sum(value: int, watchdog: topology.Watchdog | None) -> int:
    if watchdog is None:
        return int(topology.allgather(np.array([value], np.int64)).sum())
    with watchdog.guard("generate"):
        return int(topology.allgather(np.array([value], np.int64)).sum())
