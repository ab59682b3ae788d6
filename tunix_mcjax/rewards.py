"""Reward functions (Tunix's calling convention) and GRPO group advantages, host-local."""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence

import numpy as np
from tunix.rl import algo_core

from tunix_mcjax.config import ConfigError
from tunix_mcjax.tasks import RewardFn, Task


def resolve_reward_fns(names: Sequence[str], task: Task) -> tuple[RewardFn, ...]:
    """`module:function` names, or the task's own reward when none are given."""
    if not names:
        return task.reward_fns
    fns = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            fns.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"reward function {name!r} not found ({e}); "
                              "use 'package.module:function'") from e
    return tuple(fns)


class RewardError(RuntimeError):
    """A reward function raised, or returned something that is not one finite number per
    completion; the message names the function, and the prompt and value where it applies."""


def fn_name(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def score(reward_fns: Sequence[RewardFn], prompts: list[str], completions: list[str],
          fields: dict[str, list], prompt_indices: Sequence[int] | None = None) -> np.ndarray:
    """Sum of all reward functions per completion, as Tunix's reward manager sums them.

    Every value must be a finite number: None, NaN, inf, a non-number or the wrong count is a
    `RewardError` naming the function and (via `prompt_indices`, the dataset index of each
    completion's prompt) the prompt, rather than a NaN advantage that poisons the weights.
    """
    total = np.zeros(len(completions), dtype=np.float32)
    for fn in reward_fns:
        try:
            values = list(fn(prompts=prompts, completions=completions, **fields))
        except Exception as e:
            raise RewardError(f"reward function {fn_name(fn)} raised "
                              f"{type(e).__name__}: {e}") from e
        if len(values) != len(completions):
            raise RewardError(f"reward function {fn_name(fn)} returned {len(values)} values "
                              f"for {len(completions)} completions: return one per completion")
        for j, v in enumerate(values):
            ok = isinstance(v, (int, float, np.number, np.bool_)) and math.isfinite(float(v))
            if not ok:
                where = prompt_indices[j] if prompt_indices is not None else "?"
                raise RewardError(
                    f"reward function {fn_name(fn)} returned {v!r} for completion {j} "
                    f"(prompt index {where}, prompt {prompts[j]!r}): every reward must be a "
                    "finite number")
        total += np.asarray(values, dtype=np.float32)
    return total


def group_advantages(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """Tunix's GRPO estimator; every group is whole on this host, so nothing crosses hosts."""
    return np.asarray(algo_core.compute_advantages(rewards, num_generations), dtype=np.float32)
