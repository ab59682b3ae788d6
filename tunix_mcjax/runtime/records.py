"""Typed records of a step: what admission picked, what one host's rollout produced (the unit
a trainer packs, in either mode), the per-host step record that is written and sent, and the
global step record both modes produce."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tunix_mcjax import metrics
from tunix_mcjax.engine import Completion
from tunix_mcjax.runtime import stepmath
from tunix_mcjax.train import packing


@dataclasses.dataclass(frozen=True)
class Admission:
    """One host's share of a step's global batch: whole GRPO groups."""

    step: int
    global_indices: np.ndarray  # dataset indices of the step's global batch, in order
    local_indices: np.ndarray  # dataset indices of the prompts this host admits


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One host's scored generations of one step: G completions per admitted prompt, in prompt
    order, with the behaviour logprobs (`Completion.logprobs`) and the version of the policy
    that generated them: its count of train steps (colocated: the step's own number; one step
    stale: one less)."""

    admission: Admission
    prompts: tuple[np.ndarray, ...]  # token ids of each admitted prompt
    completions: tuple[Completion, ...]
    rewards: np.ndarray  # float32 [completions]
    correct: np.ndarray  # the task's accuracy per completion
    advantages: np.ndarray  # float32 [completions]: group advantages
    policy_version: int
    seconds: dict[str, float]  # wall time of its phases (admit, generate, reward)
    # Agentic rollouts: each completion's model mask (0 on tool tokens) and the turn metrics.
    masks: tuple[np.ndarray, ...] | None = None
    turns: dict[str, float] | None = None
    # In-flight weight updates (DA): each completion's per-token policy version, int32 [n].
    token_versions: tuple[np.ndarray, ...] | None = None

    @property
    def step(self) -> int:
        return self.admission.step

    @property
    def num_generations(self) -> int:
        return len(self.completions) // len(self.prompts) if self.prompts else 0

    def sequences(self) -> list[packing.Sequence]:
        g = self.num_generations
        return stepmath.sequences([p for p in self.prompts for _ in range(g)],
                                  self.completions, self.advantages, self.masks)

    def lengths_by_prompt(self) -> np.ndarray:
        return stepmath.mean_length_by_prompt(self.completions, len(self.prompts))

    def length_pairs(self) -> np.ndarray:
        """[prompts, 2]: (dataset index, mean completion length), for O3's history."""
        return np.stack([self.admission.local_indices.astype(np.float64),
                         self.lengths_by_prompt()], axis=1)


@dataclasses.dataclass
class HostRecord:
    """One host's record of one step (a line of host_<h>.jsonl); `vector()` is what it sends
    for host 0's global record (`metrics.HOST_FIELDS`)."""

    step: int
    host: int
    step_s: float
    phase_s: dict[str, float]
    reward_sum: float
    correct_sum: float
    completions: int
    completion_tokens: int
    completion_len_max: int
    prompts: int
    truncated: int
    prompt_tokens: int
    compiled: int
    # Every completion the step drew, before dynamic sampling dropped any group (without it,
    # the same as the fields above): what the policy scored on each prompt it was given.
    drawn_reward_sum: float
    drawn_correct_sum: float
    drawn_completions: int
    local_prompt_indices: list[int]
    completion_len_by_prompt: list[float]
    global_prompt_indices: list[int]
    train: dict[str, float]  # the trainer's metrics, plus nonfinite_steps
    rows_per_device: int
    train_compiled: int
    eval: dict[str, Any] | None = None
    turns: dict[str, float] | None = None  # agentic rollouts' turn metrics
    reward_hidden_s: float = 0.0  # reward seconds scored while the host still decoded

    @classmethod
    def of(cls, rollout: Rollout, host: int, step_s: float, phase_s: dict[str, float],
           train: dict[str, float], *, compiled: bool, rows_per_device: int,
           train_compiled: bool, drawn: Sequence[Rollout] = ()) -> HostRecord:
        """`phase_s`: seconds by phase (absent: 0), and `reward_hidden` (`RolloutPhases.stream`'s
        reward seconds while it decoded); `train`: the trainer's metrics; `drawn`:
        every rollout the step drew, when dynamic sampling kept only part of them."""
        drawn = drawn or (rollout,)
        lens = np.array([len(c.tokens) for c in rollout.completions])
        adm = rollout.admission
        return cls(
            step=rollout.step, host=host, step_s=step_s,
            phase_s={p: phase_s.get(p, 0.0) for p in metrics.PHASES},
            reward_sum=float(rollout.rewards.sum()), correct_sum=float(rollout.correct.sum()),
            completions=len(rollout.completions), completion_tokens=int(lens.sum()),
            completion_len_max=int(lens.max()) if len(lens) else 0, prompts=len(rollout.prompts),
            truncated=sum(c.finish_reason == "length" for c in rollout.completions),
            prompt_tokens=sum(len(p) for p in rollout.prompts), compiled=int(compiled),
            drawn_reward_sum=float(sum(r.rewards.sum() for r in drawn)),
            drawn_correct_sum=float(sum(r.correct.sum() for r in drawn)),
            drawn_completions=sum(len(r.completions) for r in drawn),
            local_prompt_indices=adm.local_indices.tolist(),
            completion_len_by_prompt=rollout.lengths_by_prompt().round(2).tolist(),
            global_prompt_indices=adm.global_indices.tolist(), train=dict(train),
            rows_per_device=rows_per_device, train_compiled=int(train_compiled),
            turns=rollout.turns, reward_hidden_s=phase_s.get("reward_hidden", 0.0))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("phase_s"), out.pop("train"), out.pop("eval"), out.pop("turns")
        phases = {f"{p}_s": s for p, s in self.phase_s.items()}
        head = {k: out.pop(k) for k in ("step", "host", "step_s")}
        tail = {k: out.pop(k) for k in ("rows_per_device", "train_compiled")}
        return {**head, **phases, **out, **self.train, **tail,
                **({"eval": self.eval} if self.eval else {}),
                **({"turns": self.turns} if self.turns else {})}

    def vector(self) -> np.ndarray:
        return metrics.host_vector(self.to_json())


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step's global record, in either mode: `values` is the line of steps.jsonl."""

    step: int
    values: dict[str, Any]
