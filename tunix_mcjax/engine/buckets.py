"""A generate call's shapes: prompt and completion lengths bucketed to powers of two, so a run
compiles a bounded number of programs, and the distinct prompts packed into rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_PROMPT_BUCKET = 8


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prompt_bucket(longest: int, cap: int) -> int:
    """The prompt length a share whose longest prompt has `longest` tokens is padded to."""
    return min(max(MIN_PROMPT_BUCKET, pow2_at_least(longest)), cap)


def pack_prompts(
    prompts: Sequence[np.ndarray], pad_id: int, prompt_len: int, multiple: int,
    share: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct prompts, right-padded: (tokens [U, prompt_len], lengths [U], request_prompts [N]).

    N and U are powers of two rounded up to `multiple`; padding requests point at prompt -1.
    Without `share`, every request has a prompt of its own (no prefix sharing).
    """
    if share:
        distinct: dict[bytes, int] = {}
        index = [distinct.setdefault(p.tobytes(), len(distinct)) for p in prompts]
    else:
        index = list(range(len(prompts)))
    num_distinct = max(index) + 1
    n = -(-pow2_at_least(len(prompts)) // multiple) * multiple
    u = -(-pow2_at_least(num_distinct) // multiple) * multiple
    request_prompts = np.full((n,), -1, np.int32)
    request_prompts[: len(index)] = index
    tokens = np.full((u, prompt_len), pad_id, np.int32)
    lengths = np.zeros((u,), np.int32)
    for prompt, i in zip(prompts, index, strict=True):
        tokens[i, : len(prompt)] = prompt
        lengths[i] = len(prompt)
    return tokens, lengths, request_prompts
