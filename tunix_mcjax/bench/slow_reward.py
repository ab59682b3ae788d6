"""A reward that takes 50 ms per completion and scores nothing (`bench.step --streaming`): the
cost of a reward that runs code or calls a verifier, without its work."""

from __future__ import annotations

import time
from collections.abc import Sequence

SECONDS_PER_COMPLETION = 0.05


def sleeping_reward(prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
    """0 for every completion, after sleeping 50 ms per completion."""
    time.sleep(SECONDS_PER_COMPLETION * len(completions))
    return [0.0] * len(completions)
