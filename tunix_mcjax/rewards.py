"""Reward functions (Tunix's calling convention) and GRPO group advantages, host-local."""

from __future__ import annotations

import importlib
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


def score(reward_fns: Sequence[RewardFn], prompts: list[str], completions: list[str],
          fields: dict[str, list]) -> np.ndarray:
    """Sum of all reward functions per completion, as Tunix's reward manager sums them."""
    total = np.zeros(len(completions), dtype=np.float32)
    for fn in reward_fns:
        values = fn(prompts=prompts, completions=completions, **fields)
        if len(values) != len(completions):
            raise ValueError(f"reward fn {fn.__name__} returned {len(values)} values for "
                             f"{len(completions)} completions")
        total += np.asarray([0.0 if v is None else v for v in values], dtype=np.float32)
    return total


def group_advantages(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """Tunix's GRPO estimator; every group is whole on this host, so nothing crosses hosts."""
    return np.asarray(algo_core.compute_advantages(rewards, num_generations), dtype=np.float32)
