"""Reward functions that go wrong, for the bad-input catalogue (tests/test_bad_inputs.py)."""

from __future__ import annotations

import os


def raises_on_host_1(prompts, completions, **_) -> list[float]:
    if os.environ.get("TUNIX_MCJAX_PROCESS_ID") == "1":
        raise ZeroDivisionError("host 1's reward went wrong")
    return [0.0] * len(completions)


def nan_reward(prompts, completions, **_) -> list[float]:
    return [float("nan")] * len(completions)
