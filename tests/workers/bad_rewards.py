"""Reward functions that go wrong, for the bad-input catalogue (tests/test_bad_inputs.py)."""

from __future__ import annotations

import os


def raises_on_host_1(prompts, completions, **_) -> list[float]:
    if os.environ.get("TUNIX_MCJAX_PROCESS_ID") == "1":
        raise ZeroDivisionError("host 1's reward went wrong")
    return [0.0] * len(completions)


def nan_reward(prompts, completions, **_) -> list[float]:
    return [float("nan")] * len(completions)


_calls = {"n": 0}


def overflows_after_first_step(prompts, completions, **_) -> list[float]:
    """Finite rewards whose group sums overflow float32 from the second call on, so advantages
    and then the loss are NaN: the trainer's non-finite gate has to catch it."""
    _calls["n"] += 1
    if _calls["n"] == 1:
        return [float(j % 2) for j in range(len(completions))]
    return [3e38 if j % 2 == 0 else 0.0 for j in range(len(completions))]
