"""Finished conversations -> our packed sequences (with model masks) and per-step metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from tunix_mcjax.agentic.conversation import Conversation
from tunix_mcjax.train import packing


def sequences(conversations: Sequence[Conversation], advantages: np.ndarray
              ) -> list[packing.Sequence]:
    """Trajectory j as prompt + conversation: loss only on the model's tokens, the engine's
    logprobs there as the behaviour policy (0 on tool tokens, which are masked)."""
    return [packing.Sequence(c.prompt, np.asarray(c.tokens, np.int32), float(a),
                             np.asarray(c.logprobs, np.float32),
                             np.asarray(c.mask, np.float32))
            for c, a in zip(conversations, advantages, strict=True)]


def turn_metrics(conversations: Sequence[Conversation]) -> dict[str, float]:
    """Turn counts and end statuses of a host's trajectories (for the step record)."""
    turns = np.array([c.turns for c in conversations], np.float64)
    statuses = Counter(c.status for c in conversations)
    out = {"turns/mean": float(turns.mean()), "turns/max": float(turns.max()),
           "tool_calls/mean": float(np.mean([c.tool_calls for c in conversations])),
           "tool_errors": float(sum(c.tool_errors for c in conversations))}
    out.update({f"status/{s}": float(statuses.get(s, 0))
                for s in ("done", "max_turns", "context_exceeded", "tool_timeout")})
    return out
