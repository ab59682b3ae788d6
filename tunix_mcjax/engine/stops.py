"""Which token ids end a generation: the tokenizer's EOS plus the checkpoint's generation config.

Qwen3's generation config lists two EOS ids, `<|im_end|>` (151645) and `<|endoftext|>` (151643),
and its tokenizers use `<|endoftext|>` as pad as well. A base checkpoint ends its text with
`<|endoftext|>`, so the engine stops on every id found here, and masks pad out of sampling only
when pad is not one of them. Padding is then told apart from a final token by lengths only.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from tunix_mcjax.engine.base import FinishReason, SamplingParams

GENERATION_CONFIG = "generation_config.json"


def generation_config_eos_ids(directory: str | Path) -> tuple[int, ...]:
    """`eos_token_id` (an int or a list) of `<directory>/generation_config.json`; () if absent."""
    path = Path(directory) / GENERATION_CONFIG
    if not directory or not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path} is not a JSON object of generation settings: {e}") from e
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def model_stop_ids(tokenizer: Any, directories: Iterable[str | Path]) -> tuple[int, ...]:
    """The tokenizer's EOS, then every EOS id of the generation configs in `directories` (the
    checkpoint dir, the tokenizer dir), each once, in that order."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    for directory in directories:
        ids += generation_config_eos_ids(directory)
    return tuple(dict.fromkeys(ids))


def stop_reason(last: int, eos_ids: Collection[int],
                sampling: SamplingParams) -> FinishReason | None:
    """Why a sequence whose last token is `last` ended on a stop token ("eos", "stop"), or None
    when that token stops nothing (it ran to its length)."""
    if last in eos_ids and not sampling.ignore_eos:
        return "eos"
    if last in sampling.stop_token_ids:
        return "stop"
    return None
