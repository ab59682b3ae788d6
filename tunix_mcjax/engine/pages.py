"""The KV page pool: sizes, and a free stack that hands out and takes back pages on device.

A replica's KV cache is a pool of fixed-size pages per layer, `[num_pages, page_size,
2 * kv_heads, head_dim]` with keys at even and values at odd combined heads (the layout of
JAX's TPU `ragged_paged_attention`). A sequence owns a block table: entry i is the page that
holds its positions `[i * page_size, (i + 1) * page_size)`, -1 where none is allocated yet.
Nothing is sized to a cap: pages are taken as sequences grow and given back when they end.

The arithmetic here is shared by the engine and the planner (`plan.py`), so they agree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

DEFAULT_PAGE_SIZE = 16  # tokens per page (`vllm_block_size`), vLLM's GPU default

# `kv_quantization` (`quantize_kvcache`, `kv_quant_dtype`, `kv_quant_axis`: `kv_mode_of`) -> the
# stored dtype of K/V pages. "int8", "fp8" (kv_quant_axis=dkv): each (token, kv head) with one
# bfloat16 absmax scale over head_dim. "fp8_tensor" (kv_quant_axis=tensor): one static scale
# for all keys and one for all values, no scale arrays (KV_TENSOR_MODES).
KV_MODES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "fp8_tensor": jnp.float8_e4m3fn}
KV_TENSOR_MODES = ("fp8_tensor",)
KV_SCALE_BYTES = 2


def kv_mode_of(cfg) -> str:
    """The engine's `kv_quantization` mode from a config's quantize_kvcache, kv_quant_dtype and
    kv_quant_axis ("" when off)."""
    if not cfg.quantize_kvcache:
        return ""
    axis = cfg.kv_quant_axis
    return cfg.kv_quant_dtype if axis == "dkv" else f"{cfg.kv_quant_dtype}_{axis}"


def check_kv_mode(mode: str) -> str:
    """`mode` if it is "" (off) or one of KV_MODES; else a ValueError naming the keys."""
    dtype, _, axis = mode.partition("_")
    if axis == "tensor" and mode not in KV_TENSOR_MODES:
        raise ValueError(f"kv_quant_dtype={dtype} kv_quant_axis=tensor: {dtype} pages under "
                         "one static scale need a calibrated scale, which the engine does not "
                         "have (fp8's range takes scale 1.0, vLLM's default); use "
                         "kv_quant_dtype=fp8, or kv_quant_axis=dkv")
    if mode and mode not in KV_MODES:
        raise ValueError(f"kv_quant_dtype={mode!r}: the jax engine's KV pages are int8 or fp8 "
                         "by token and head, or fp8_tensor (or \"\" for none)")
    return mode


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_bytes(num_layers: int, kv_heads: int, head_dim: int, page_size: int,
               dtype_bytes: int, tensor_parallelism: int = 1, kv_mode: str = "") -> int:
    """Bytes one page takes on one device, over all layers (keys and values); under `kv_mode`
    a byte a value, plus each (token, kv head)'s scale unless the mode's scale is per tensor."""
    if not kv_mode:
        per_head = head_dim * dtype_bytes
    else:
        per_head = head_dim + (0 if kv_mode in KV_TENSOR_MODES else KV_SCALE_BYTES)
    return num_layers * page_size * 2 * kv_heads * per_head // tensor_parallelism


def table_pages(prompt_len: int, max_new: int, page_size: int) -> int:
    """Entries of a sequence's block table: every page its positions can reach."""
    return cdiv(prompt_len + max_new, page_size)


def sequence_pages(prompt_len: int, max_new: int, page_size: int) -> int:
    """Pages one sequence can hold at once, at most: its table's, plus the prompt page whose
    partly filled copy the table holds instead."""
    return table_pages(prompt_len, max_new, page_size) + 1


def pages_needed(num_slots: int, prompt_len: int, max_new: int, page_size: int) -> int:
    """Pages that let every slot hold a sequence at the caps at once: the most a pool can use.
    Sharing a prompt between the rows of a group only lowers what the rows use."""
    return num_slots * sequence_pages(prompt_len, max_new, page_size)


def least_pool_pages(prompt_len: int, max_new: int, page_size: int) -> int:
    """The fewest pages a pool may hold: one sequence at the caps and its prompt's pages beside
    it, so a lone row never waits on a page and the loop always moves."""
    return cdiv(prompt_len, page_size) + sequence_pages(prompt_len, max_new, page_size)


def prefill_chunk(prompt_len: int, batched_tokens: int) -> tuple[int, int]:
    """(tokens per prefill row, rows per loop iteration) under a budget of `batched_tokens`:
    the largest power of two <= the budget, at most the prompt bucket."""
    chunk = min(prompt_len, 1 << (batched_tokens.bit_length() - 1))
    return chunk, batched_tokens // chunk


def pool_pages(budget_bytes: int, one_page_bytes: int, needed: int) -> int:
    """Pages a pool of `budget_bytes` holds, never more than it can use (`needed`)."""
    return max(0, min(needed, budget_bytes // max(1, one_page_bytes)))


@dataclasses.dataclass(frozen=True)
class FreeStack:
    """Free page ids `pages[:count]` (a stack; the top is `pages[count - 1]`)."""

    pages: jax.Array  # int32 [num_pages]
    count: jax.Array  # int32


jax.tree_util.register_dataclass(FreeStack)


def full_stack(num_pages: int) -> FreeStack:
    """Every page free; page 0 is handed out last."""
    return FreeStack(jnp.arange(num_pages, dtype=jnp.int32)[::-1], jnp.int32(num_pages))


def take(stack: FreeStack, want: jax.Array) -> tuple[jax.Array, FreeStack]:
    """One page for each True of `want` (any shape), in row-major order; -1 elsewhere.

    The caller checks `sum(want) <= stack.count` first."""
    flat = want.reshape(-1)
    rank = jnp.cumsum(flat) - 1
    index = jnp.clip(stack.count - 1 - rank, 0, stack.pages.shape[0] - 1)
    pages = jnp.where(flat, stack.pages[index], -1)
    return pages.reshape(want.shape), FreeStack(stack.pages, stack.count - jnp.sum(flat))


def give(stack: FreeStack, pages: jax.Array, release: jax.Array) -> FreeStack:
    """Push `pages` where `release` (same shape) is True; pages < 0 are ignored."""
    flat = (release & (pages >= 0)).reshape(-1)
    rank = jnp.cumsum(flat) - 1
    slot = jnp.where(flat, stack.count + rank, stack.pages.shape[0])  # out of bounds: dropped
    stacked = stack.pages.at[slot].set(pages.reshape(-1), mode="drop")
    return FreeStack(stacked, stack.count + jnp.sum(flat))
