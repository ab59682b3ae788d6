"""Attention over a KV page pool, for rows of queries: one definition, two backends.

A call attends R rows. Row r has `q_lens[r]` queries, the last ones of its `kv_lens[r]` tokens:
query j sits at position `kv_lens[r] - q_lens[r] + j` and sees the row's keys at positions up to
its own. Keys and values come from the pages of the row's block table (`pages.py` has the
layout). Queries j >= q_lens[r] are padding; their outputs are zero. A decode step is rows of
one query; a prefill chunk is a row of up to `chunk` queries. These are the semantics of JAX's
TPU `ragged_paged_attention`, with the tokens grouped by row.

- `reference_attention`: the definition, one row at a time over its whole table (tests).
- `xla_attention` (CPU, GPU): every row at once over the first n pages of each table, n the
  longest live row rounded up to a power of two (a `lax.switch` over those sizes), so a step
  costs what its live tokens cost, not what the caps would.
- `tpu_attention`: the Pallas kernel shipped with JAX, after packing the rows' queries into its
  token layout (`rpa_arguments`); the kernel only reads pages, the model writes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tunix.models.qwen3.model import K_MASK


def split_kv(kv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Combined heads [..., 2 * K, H] -> keys, values [..., K, H] (even and odd heads)."""
    return kv[..., 0::2, :], kv[..., 1::2, :]


def combine_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """Keys, values [..., K, H] -> combined heads [..., 2 * K, H] (keys at even heads)."""
    return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def _attend(q, k, v, kv_lens, q_lens):
    """q [R, C, N, H], k/v [R, L, K, H] (key i at position i) -> [R, C, N, H]."""
    r, c, n, h = q.shape
    kv_heads = k.shape[2]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(c)[None, :]  # [R, C]
    k_pos = jnp.arange(k.shape[1])
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :]
                                                          < kv_lens[:, None, None])
    qg = q.reshape(r, c, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("RCKGH,RLKH->RKGCL", qg, k) * h**-0.5
    scores = jnp.where(mask[:, None, None], scores, K_MASK)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    # Slots past a row's length hold whatever a page held before: keep them out of the sum.
    live = (k_pos[None, :] < kv_lens[:, None])[:, :, None, None]
    v = jnp.where(live, v, jnp.zeros_like(v))
    out = jnp.einsum("RKGCL,RLKH->RCKGH", probs, v).reshape(r, c, n, h)
    real = jnp.arange(c)[None, :] < q_lens[:, None]
    return jnp.where(real[:, :, None, None], out, jnp.zeros_like(out))


def _gather(kv_pages: jax.Array, tables: jax.Array, num_pages: int):
    """Keys and values [R, num_pages * page_size, K, H] of each row's first `num_pages`."""
    r = tables.shape[0]
    kv = kv_pages[jnp.maximum(tables[:, :num_pages], 0)]  # [R, n, page, 2K, H]
    k, v = split_kv(kv.reshape(r, -1, *kv.shape[3:]))
    return k, v


def reference_attention(q, kv_pages, tables, kv_lens, q_lens) -> jax.Array:
    """The definition: each row alone, over every page of its table."""
    rows = [
        _attend(q[i:i + 1], *_gather(kv_pages, tables[i:i + 1], tables.shape[1]),
                kv_lens[i:i + 1], q_lens[i:i + 1])
        for i in range(q.shape[0])
    ]
    return jnp.concatenate(rows, axis=0)


def page_buckets(max_pages: int) -> tuple[int, ...]:
    """Gather sizes: powers of two below `max_pages`, then `max_pages`."""
    sizes, n = [], 1
    while n < max_pages:
        sizes.append(n)
        n *= 2
    return (*sizes, max_pages)


def xla_attention(q, kv_pages, tables, kv_lens, q_lens) -> jax.Array:
    """All rows at once over the smallest bucket of pages that holds the longest live row."""
    page_size = kv_pages.shape[1]
    buckets = page_buckets(tables.shape[1])
    live = jnp.max(jnp.where(q_lens > 0, kv_lens, 0))
    needed = (live + page_size - 1) // page_size
    index = jnp.sum(jnp.asarray(buckets[:-1]) < needed)

    def branch(n):
        return lambda q, kv_pages, tables, kv_lens, q_lens: _attend(
            q, *_gather(kv_pages, tables, n), kv_lens, q_lens)

    return jax.lax.switch(index, [branch(n) for n in buckets],
                          q, kv_pages, tables, kv_lens, q_lens)


def rpa_arguments(q, tables, kv_lens, q_lens):
    """Rows -> the TPU kernel's positional arguments after `kv_pages`: queries packed token by
    token [R * C, N, H], kv_lens, page_indices (no -1), cu_q_lens [R + 1], num_seqs [1]; and
    (row, column) of each packed token, to put the outputs back."""
    r, c = q.shape[:2]
    cu_q_lens = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
    token = jnp.arange(r * c)
    row = jnp.clip(jnp.searchsorted(cu_q_lens[1:], token, side="right"), 0, r - 1)
    col = jnp.clip(token - cu_q_lens[row], 0, c - 1)
    packed = jnp.where((token < cu_q_lens[-1])[:, None, None], q[row, col], 0)
    args = (packed, kv_lens.astype(jnp.int32), jnp.maximum(tables, 0).astype(jnp.int32),
            cu_q_lens, jnp.array([r], jnp.int32))
    return args, (row, col, token < cu_q_lens[-1])


def unpack_rows(out: jax.Array, where: tuple, shape: tuple[int, ...]) -> jax.Array:
    """Packed outputs [T, N, H] (T <= R * C real tokens first) -> rows [R, C, N, H], padding
    queries zero."""
    row, col, real = where
    out = jnp.pad(out, ((0, row.shape[0] - out.shape[0]), (0, 0), (0, 0)))
    rows = jnp.zeros(shape, out.dtype)
    return rows.at[jnp.where(real, row, shape[0]), col].set(out, mode="drop")


def tpu_attention(q, kv_pages, tables, kv_lens, q_lens) -> jax.Array:
    """JAX's Pallas `ragged_paged_attention` (TPU only)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    args, where = rpa_arguments(q, tables, kv_lens, q_lens)
    packed, lens, indices, cu_q_lens, num_seqs = args
    out = ragged_paged_attention(packed, kv_pages, lens, indices, cu_q_lens, num_seqs,
                                 sm_scale=q.shape[-1]**-0.5)
    return unpack_rows(out, where, q.shape)


@functools.cache
def backend_attention(platform: str):
    """The attention a replica on `platform` runs: the Pallas kernel on TPU, XLA elsewhere."""
    return tpu_attention if platform == "tpu" else xla_attention
