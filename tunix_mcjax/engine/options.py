"""The settings of an engine over our decode loop (the jax and maxtext engines), in one place:
`runtime.engines.engine_options` builds them from the config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tunix_mcjax.engine import pages
from tunix_mcjax.engine.quantize import check_mode

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # prefill tokens per loop iteration
DEFAULT_HBM_UTILIZATION = 0.72  # MaxText's rl.yml default for hbm_utilization_vllm


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """`eos_ids` are the model's end-of-sequence ids (`engine.stops.model_stop_ids`); each ends
    a sequence unless `ignore_eos`. `max_batch_size` caps the rows one replica decodes at once
    (rounded up to a power of two): with continuous batching a larger share streams through
    that many rows; without it the share runs in waves. `lockstep` decodes each replica's share
    in one batch, all replicas iterating together. `data_parallelism` replicas (-1: as many as
    the devices hold) use the first data_parallelism x tensor_parallelism devices.

    The KV pool of a replica: `page_size` tokens a page; `num_pages` pages, or (0) as many as
    `hbm_utilization` of a device holds beside the engine's weights, never more than every row
    at the caps could use. `max_num_batched_tokens` bounds the prompt tokens one loop iteration
    prefills. `prefix_caching` lets the requests of one prompt share its pages. The pool is made
    on first use and kept, unless `free_pool_after_generate` (a colocated trainer wants the
    memory between rollouts). `quantization` (int8, fp8; "" none) is the dtype the jax engine
    holds its projection weights in (`engine.quantize`); `kv_quantization` its KV pages' ("" none;
    `pages.KV_MODES`: int8, fp8 with per-token scales, or fp8_tensor with one static scale)."""

    pad_id: int
    eos_ids: tuple[int, ...]
    max_prompt_length: int
    max_new_tokens: int
    tensor_parallelism: int = 1
    continuous_batching: bool = True
    lockstep: bool = False
    max_batch_size: int = 64
    data_parallelism: int = -1
    page_size: int = pages.DEFAULT_PAGE_SIZE
    num_pages: int = 0
    hbm_utilization: float = DEFAULT_HBM_UTILIZATION
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    prefix_caching: bool = True
    free_pool_after_generate: bool = False
    quantization: str = ""
    kv_quantization: str = ""

    def __post_init__(self):
        if self.max_prompt_length < 1 or self.max_new_tokens < 1 or self.max_batch_size < 1:
            raise ValueError("max_prompt_length, max_new_tokens and max_batch_size must be >= 1")
        if self.page_size < 1 or self.max_num_batched_tokens < 1 \
                or not 0 < self.hbm_utilization <= 1:
            raise ValueError("page_size (vllm_block_size) and max_num_batched_tokens must be >= "
                             "1, and hbm_utilization (hbm_utilization_vllm) in (0, 1]")
        check_mode(self.quantization)
        pages.check_kv_mode(self.kv_quantization)
        # One id once, in order.
        object.__setattr__(self, "eos_ids", tuple(dict.fromkeys(int(i) for i in self.eos_ids)))


def options_of(options: EngineOptions | None, fields: Mapping[str, Any]) -> EngineOptions:
    """`options`, or `EngineOptions(**fields)`: one of the two."""
    if options is not None and fields:
        raise TypeError(f"pass the engine's options or their fields ({', '.join(fields)}), "
                        "not both")
    return options if options is not None else EngineOptions(**fields)
