"""Reading a program's outputs (`loop_state.Outputs`, fetched to the host) back into each
request's `Completion`, and the loop's counters."""

from __future__ import annotations

from typing import Any

import numpy as np

from tunix_mcjax.engine.base import Completion, SamplingParams
from tunix_mcjax.engine.stops import stop_reason

# Loop statistics an `Outputs` carries, per program: `JaxEngine.last_stats`.
STAT_NAMES = ("iterations", "prefill_steps", "preemptions", "shared_pages", "peak_pages",
              "packed_steps", "prefill_tokens")


def stats_of(out: Any) -> dict[str, int]:
    """One program's counters from its (host) outputs."""
    return {name: int(getattr(out, name)) for name in STAT_NAMES}


def completion_of(out: Any, row: int, sampling: SamplingParams,
                  eos_ids: tuple[int, ...]) -> Completion:
    """Request `row` of one program's (host) outputs, as `generate` returns it."""
    n = int(out.lengths[row])
    seq = out.tokens[row, :n].copy()
    return Completion(
        tokens=seq,
        logprobs=out.logprobs[row, :n].copy(),
        finish_reason=stop_reason(int(seq[-1]), eos_ids, sampling) or "length",
        routing=routing_of(out, row, n),
    )


def routing_of(out: Any, row: int, n: int) -> np.ndarray | None:
    """A request's recorded experts, its prompt tokens' then its `n` completion tokens'
    (`Completion.routing`); None when the program recorded none."""
    if out.routing is None:
        return None
    prompt_len = int(out.prompt_lens[row])
    return np.concatenate([out.prompt_routing[row, :prompt_len], out.routing[row, :n]])
