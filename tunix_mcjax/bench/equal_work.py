"""Run logs and the equal-work rule: a pair of runs counts only if both did the same work.

Rule (paper §3.3): the same prompts in the same order on every step (and per-step mean prompt
length within 0.5 tokens), mean and longest output lengths within a factor of [0.8, 1.25], and
truncation shares within 10 points. Lengths are compared over the scored steps.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

PROMPT_TOKENS_TOL = 0.5
LENGTH_RATIO = (0.8, 1.25)
TRUNCATION_POINTS = 0.10


@dataclasses.dataclass(frozen=True)
class RunLog:
    """One run's `steps.jsonl`: one dict per step, in step order."""

    name: str
    records: tuple[dict, ...]

    @classmethod
    def load(cls, path: str | Path, name: str) -> RunLog:
        lines = Path(path).read_text().splitlines()
        records = sorted((json.loads(line) for line in lines if line.strip()),
                         key=lambda r: r["step"])
        if not records:
            raise ValueError(f"{path}: no steps logged")
        return cls(name, tuple(records))

    def scored(self, first_scored: int) -> list[dict]:
        """Steady steps: from `first_scored` on, compile steps excluded."""
        return [r for r in self.records if r["step"] >= first_scored and not r["compiled"]]

    def column(self, key: str, first_scored: int = 0, steady: bool = True) -> np.ndarray:
        records = self.scored(first_scored) if steady else self.records
        return np.array([r[key] for r in records], dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class EqualWork:
    ok: bool
    problems: tuple[str, ...]
    summary: dict[str, dict[str, float]]

    def as_dict(self) -> dict:
        return {"ok": self.ok, "problems": list(self.problems), "summary": self.summary}


def _work_summary(run: RunLog, first_scored: int) -> dict[str, float]:
    scored = [r for r in run.records if r["step"] >= first_scored]
    return {
        "completion_len_mean": float(np.mean([r["completion_len_mean"] for r in scored])),
        "completion_len_max": float(max(r["completion_len_max"] for r in scored)),
        "truncated_frac": float(np.mean([r["truncated_frac"] for r in scored])),
    }


def _prompt_problems(ref: RunLog, other: RunLog) -> list[str]:
    ref_steps = {r["step"]: r for r in ref.records}
    other_steps = {r["step"]: r for r in other.records}
    if ref_steps.keys() != other_steps.keys():
        return [f"different steps: {ref.name} logged {len(ref_steps)}, "
                f"{other.name} logged {len(other_steps)}"]
    problems = []
    for step in sorted(ref_steps):
        a, b = ref_steps[step], other_steps[step]
        if list(a["prompt_indices"]) != list(b["prompt_indices"]):
            problems.append(f"step {step}: different prompts or prompt order")
        elif abs(a["prompt_tokens_mean"] - b["prompt_tokens_mean"]) > PROMPT_TOKENS_TOL:
            problems.append(f"step {step}: mean prompt length {a['prompt_tokens_mean']:.2f} vs "
                            f"{b['prompt_tokens_mean']:.2f} tokens (tolerance "
                            f"{PROMPT_TOKENS_TOL})")
    return problems


def check_equal_work(ref: RunLog, other: RunLog, first_scored: int) -> EqualWork:
    """Checks `other` against `ref`; each problem names the rule it breaks."""
    problems = _prompt_problems(ref, other)
    a, b = _work_summary(ref, first_scored), _work_summary(other, first_scored)
    low, high = LENGTH_RATIO
    for key, what in (("completion_len_mean", "mean"), ("completion_len_max", "longest")):
        ratio = b[key] / a[key] if a[key] > 0 else float("inf")
        if not low <= ratio <= high:
            problems.append(f"{what} output length {b[key]:.1f} ({other.name}) vs {a[key]:.1f} "
                            f"({ref.name}): ratio {ratio:.3f} outside [{low}, {high}]")
    gap = abs(a["truncated_frac"] - b["truncated_frac"])
    if gap > TRUNCATION_POINTS + 1e-12:
        problems.append(f"truncation share {b['truncated_frac']:.0%} ({other.name}) vs "
                        f"{a['truncated_frac']:.0%} ({ref.name}): {gap * 100:.1f} points apart, "
                        f"more than {TRUNCATION_POINTS * 100:.0f}")
    return EqualWork(not problems, tuple(problems), {ref.name: a, other.name: b})
