"""Attention over a KV page pool, for rows of queries: one definition, two page layouts.

A call attends R rows. Row r has `q_lens[r]` queries, the last ones of its `kv_lens[r]` tokens:
query j sits at position `kv_lens[r] - q_lens[r] + j` and sees the row's keys at positions up to
its own. Keys and values come from the pages of the row's block table (entry i holds positions
`[i * page_size, (i + 1) * page_size)`). Queries j >= q_lens[r] are padding; their outputs are
zero. A decode step is rows of one query; a prefill chunk is a row of up to `chunk` queries.
These are the semantics of JAX's TPU `ragged_paged_attention`, with the tokens grouped by row.

Optional, per call (defaults: today's plain causal attention): `window` (a query at position p
sees keys at positions p - window < k <= p, by token position, MaxText's LOCAL_SLIDING mask),
`sinks` (per query head, a logit that joins each softmax's denominator with no value, gpt-oss's),
`scale` (of the scores; default head_dim ** -0.5; MaxText scales queries itself: 1.0) and
`soft_cap` (scores -> soft_cap * tanh(scores / soft_cap)).

- `reference_attention`: the definition, one row at a time over its keys and values (tests).
- `SplitPages` (CPU, GPU): keys and values in two arrays `[kv_heads, pages, page_size,
  head_dim]`; every decode row at once over the first n pages of each table, n the longest live
  row rounded up to the next of a few sizes (a `lax.switch` over them, at most 25% past it), so
  a step costs what its live tokens cost, not what the caps would; a prefill chunk over its
  prompt's table (the prompt bucket's pages).
- `QuantizedPages` (CPU, GPU; `quantize_kvcache`, `kv_quant_axis=dkv`): SplitPages' arrays in
  int8 or fp8 with a scale per token and kv head, dequantized as gathered (`kv_quant`).
- `TensorScaledPages` (CPU, GPU; `kv_quant_axis=tensor`): SplitPages' arrays in fp8 under one
  static scale for all keys and one for all values (`kv_quant.StaticKvScale`), no scale arrays.
- `GpuPages` (GPU): SplitPages' arrays; decode rows (one query each, no window or sinks) go
  through JAX's Pallas GPU `paged_attention` kernel, everything else through SplitPages' path.
- `CombinedPages` (TPU): one array `[pages, page_size, 2 * kv_heads, head_dim]`, keys at even and
  values at odd heads, read by the Pallas kernel shipped with JAX after packing the rows'
  queries into its token layout (`rpa_arguments`). The kernel only reads; the model writes.
  On a replica of several devices it runs on each device's heads (`shard_map` over the heads
  axis: XLA does not partition a Pallas call). With a `kv_quant.StaticKvScale` its pages are
  fp8 and the kernel dequantizes them with the scale's `k_scale`/`v_scale`.

A model that scans its layers keeps one stacked pool (`empty(..., layers=L)`) in the scan's carry
and passes each method the layer's index (`layer`): writes and reads index the pool at (layer,
page, slot) directly, so XLA updates it in place and never copies a layer's pages out of it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from tunix.models.qwen3.model import K_MASK

from tunix_mcjax.engine import pages as pages_lib
from tunix_mcjax.engine.kv_quant import (
    StaticKvScale,
    dequantize_kv,
    quantize_kv,
    static_kv_scale,
)
from tunix_mcjax.engine.rpa_tuning import kernel_takes_heads, rpa_block_sizes, target_device_kind


def attend_keys(qg, k, v, q_pos, k_pos, k_live, *, window: int | None = None,
                scale: float | None = None, soft_cap: float | None = None):
    """Queries qg [K, X, C, G, H] at positions q_pos [X, C] over the keys and values k/v
    [K, X, L, H] at positions k_pos [X, L], those where k_live: (outputs [K, X, C, G, H],
    log-sum-exp of each query's scores [K, X, C, G]), which `combine` merges across key sets.

    Keys and values come kv-head-major, so both contractions are batched over (K, X) with no
    transpose of the gathered pages."""
    scores = jnp.einsum("KXCGH,KXLH->KXCGL", qg, k) * (qg.shape[-1]**-0.5 if scale is None
                                                        else scale)
    if soft_cap:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = k_live[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    # Slots past a row's length hold whatever a page held before: their scores are masked
    # here (a select, so even NaN keys drop out) and their probabilities are exactly 0; values
    # are finite there because `finite_values` is all a layout ever writes.
    scores = jnp.where(mask[None, :, :, None], scores, K_MASK).astype(jnp.float32)
    top = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - top)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("KXCGL,KXLH->KXCGH", (weights / total).astype(v.dtype), v)
    return out, (top + jnp.log(total))[..., 0]


def combine(parts, sinks, kv_heads: int) -> jax.Array:
    """(outputs, log-sum-exp) of attention over disjoint key sets -> attention over their union;
    with `sinks` [K * G] each head's sink logit joins the denominator (gpt-oss's), with no
    value. A set with no live key (log-sum-exp near K_MASK) gets weight 0."""
    lses = [lse for _, lse in parts]
    if sinks is not None:
        shape = (kv_heads, *[1] * (lses[0].ndim - 2), -1)  # per head, the last axis
        lses.append(jnp.broadcast_to(jnp.asarray(sinks, jnp.float32).reshape(shape),
                                     lses[0].shape))
    if len(lses) == 1:
        return parts[0][0]
    top = functools.reduce(jnp.maximum, lses)
    weights = [jnp.exp(lse - top) for lse in lses]
    total = sum(weights)
    return sum(out * (w / total)[..., None].astype(out.dtype)
               for (out, _), w in zip(parts, weights, strict=False))


def head_groups(q: jax.Array, kv_heads: int) -> jax.Array:
    """q [R, C, N, H] -> [K, R, C, N / K, H]: each kv head's query heads."""
    r, c, n, h = q.shape
    return jnp.moveaxis(q.reshape(r, c, kv_heads, n // kv_heads, h), 2, 0)


def rows_of(out: jax.Array, q_lens: jax.Array) -> jax.Array:
    """Outputs [K, R, C, G, H] -> [R, C, K * G, H], zero at padding queries."""
    out = jnp.moveaxis(out, 0, 2)
    out = out.reshape(*out.shape[:2], -1, out.shape[-1])
    real = jnp.arange(out.shape[1])[None, :] < q_lens[:, None]
    return jnp.where(real[:, :, None, None], out, jnp.zeros_like(out))


def attend_rows(q, k, v, kv_lens, q_lens, *, window: int | None = None, sinks=None,
                scale: float | None = None, soft_cap: float | None = None) -> jax.Array:
    """q [R, C, N, H], k/v [K, R, L, H] (key i of row r at [:, r, i]) -> [R, C, N, H]."""
    r, c = q.shape[:2]
    kv_heads = k.shape[0]
    q_pos = (kv_lens - q_lens)[:, None] + jnp.arange(c)[None, :]  # [R, C]
    k_pos = jnp.broadcast_to(jnp.arange(k.shape[2]), (r, k.shape[2]))
    part = attend_keys(head_groups(q, kv_heads), k, v, q_pos, k_pos, k_pos < kv_lens[:, None],
                       window=window, scale=scale, soft_cap=soft_cap)
    return rows_of(combine([part], sinks, kv_heads), q_lens)


def finite_values(v: jax.Array) -> jax.Array:
    """Values as a page keeps them: non-finite entries (a diverged row's) become 0, so a page
    reused by another row never puts NaN into its sums (0 x NaN is NaN)."""
    return jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v))


def reference_attention(q, k_seq, v_seq, kv_lens, q_lens, **options) -> jax.Array:
    """The definition, one row at a time: k_seq/v_seq [R, L, K, H] are each row's keys and
    values by position (what its pages hold). `options`: `attend_rows`' window, sinks, scale
    and soft_cap."""
    def head_major(x):
        return jnp.moveaxis(x, 2, 0)

    rows = [attend_rows(q[i:i + 1], head_major(k_seq[i:i + 1]), head_major(v_seq[i:i + 1]),
                        kv_lens[i:i + 1], q_lens[i:i + 1], **options)
            for i in range(q.shape[0])]
    return jnp.concatenate(rows, axis=0)


@dataclasses.dataclass(frozen=True)
class SharedPrefix:
    """Decode rows that begin with a prompt's pages (a GRPO group's samples): row r's first
    `pages[row_prompt[r]]` table entries are `tables[row_prompt[r]]`'s. A layout may attend
    such a prefix once per prompt for all of its rows (cascade attention) instead of once per
    row; the result is the same."""

    tables: jax.Array  # int32 [U, P]: each prompt's full pages
    pages: jax.Array  # int32 [U]: how many of them the prompt has
    row_prompt: jax.Array  # int32 [R]: each row's prompt (anything for padding rows)
    group: int  # static: the most rows of one prompt in a call


jax.tree_util.register_dataclass(SharedPrefix, data_fields=["tables", "pages", "row_prompt"],
                                 meta_fields=["group"])


BUCKETS_PER_OCTAVE = 4  # gather sizes between powers of two: at most 25% past the live pages


def page_buckets(max_pages: int) -> tuple[int, ...]:
    """Gather sizes up to `max_pages`: 1 to 4, then each a quarter past the one before (5, 6,
    7, 8, 10, 12, 15, 18, ...), then `max_pages` itself: about 4 sizes per doubling."""
    sizes, n = [], 1
    while n < max_pages:
        sizes.append(n)
        step = max(1, n // BUCKETS_PER_OCTAVE)
        n += step
    return (*sizes, max_pages)


class SplitPages:
    """Keys and values `[kv_heads, pages, page_size, head_dim]` each; XLA attention over the
    live pages. A layer's pages are the pair (keys, values). The engine's pool stacks every
    layer's, `[kv_heads, layers, pages, page_size, head_dim]` each (`empty(..., layers=L)`):
    given `layer` (an index, traced or not), a method writes and reads that layer's pages in
    the stacked pool in place, one scatter or gather with the layer as an index, never a
    slice of the pool; `layer=None` takes a single layer's pages."""

    def empty(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
              dtype: Any, layers: int | None = None) -> tuple[jax.Array, jax.Array]:
        shape = (kv_heads, *([layers] if layers else []), num_pages, page_size, head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    @staticmethod
    def kv_heads_of(pool) -> int:
        return pool[0].shape[0]

    @staticmethod
    def page_size_of(pool) -> int:
        return pool[0].shape[-2]

    def spec(self, pages_axis: str | None) -> P:
        """The partition of one array of the stacked pool: kv heads over `tp` (and pages over
        `pages_axis`)."""
        return P("tp", None, pages_axis, None, None)

    def write(self, pool, pages, offsets, k, v, layer=None):
        """Token (r, c)'s k/v [R, C, K, H] at `pages[r, c]` (out of range: dropped), slot
        `offsets[r, c]`, of layer `layer`."""
        return tuple(self.put(x, new, pages, offsets, layer)
                     for x, new in zip(pool, (k, finite_values(v)), strict=True))

    @staticmethod
    def put(x, new, pages, offsets, layer=None):
        """`x` [K, (L,) pages, page, W] with new [R, C, K, W] at (layer, pages, offsets)."""
        at = (slice(None),) if layer is None else (slice(None), layer)
        # The index dims sit where pages were: [K, R, C, W].
        return x.at[(*at, pages, offsets)].set(jnp.moveaxis(new, 2, 0).astype(x.dtype),
                                               mode="drop")

    def copy_page(self, pool, source, target):
        """Pages `target` hold pages `source` (ids; a target past the pool is dropped), in
        every layer at once."""
        return tuple(x.at[..., target, :, :].set(x[..., source, :, :], mode="drop")
                     for x in pool)

    def sequences(self, pool, tables, num_pages: int, layer=None):
        """Each row's keys and values [K, R, num_pages * page_size, H] from its first
        `num_pages` table entries, in layer `layer`."""
        return tuple(self.gather(x, tables, num_pages, layer) for x in pool[:2])

    @staticmethod
    def gather(x, tables, num_pages: int, layer=None):
        """One array of the pool [K, (L,) pages, page, W] -> each row's first `num_pages`
        pages [K, R, num_pages * page, W]."""
        kv_heads, *stack, pool_pages, page_size, head_dim = x.shape
        layers, index_of_layer = (stack[0], layer) if stack else (1, 0)
        # One index per (kv head, row, entry) into the pool seen as [K * L * pages, page * H]:
        # each gathered slice is one contiguous page, and the result is already
        # [K, R, n, page * H], so no transpose follows (XLA's CPU gather of [K, 1, page, H]
        # slices is ~3x slower).
        entries = jnp.maximum(tables[:, :num_pages], 0)
        index = ((jnp.arange(kv_heads)[:, None, None] * layers + index_of_layer) * pool_pages
                 + entries[None])

        g = x.reshape(-1, page_size * head_dim)[index]
        # The barrier keeps the reshape out of the gather's loop: fused, XLA's CPU gather
        # copies head_dim floats at a time, not a page, and gather + dots run ~1.4x longer.
        g = jax.lax.optimization_barrier(g)
        return g.reshape(kv_heads, tables.shape[0], num_pages * page_size, head_dim)

    def attend(self, q, pool, tables, kv_lens, q_lens, *, prefix: SharedPrefix | None = None,
               sinks=None, layer=None, **options) -> jax.Array:
        """`options`: `attend_rows`' window, sinks, scale and soft_cap.

        Decode rows (one query each) read their own pages up to the longest live row
        (`attend_own`); with a `prefix`, their prompts' pages first, once per prompt
        (`attend_shared`), the two merged by log-sum-exp (`combine`). Prefill chunks read
        their whole tables: a prompt's table is bounded by the prompt bucket, and one branch
        per layer instead of one per gather size keeps the program small (a 28-layer model's
        compiles for minutes on GPU with a switch in every layer's prefill)."""
        if q.shape[1] > 1:
            return attend_rows(q, *self.sequences(pool, tables, tables.shape[1], layer),
                               kv_lens, q_lens, sinks=sinks, **options)
        kv_heads = self.kv_heads_of(pool)
        qg = head_groups(q, kv_heads)[:, :, 0]  # [K, R, G, H]: one query a row
        own = functools.partial(self.attend_own, qg, pool, tables, kv_lens, q_lens, layer=layer,
                                **options)
        if prefix is None:
            parts = [own(jnp.zeros_like(kv_lens))]
        else:
            shared, first = self.attend_shared(qg, pool, kv_lens, q_lens, prefix, layer=layer,
                                               **options)
            parts = [shared, own(first)]
        return rows_of(combine(parts, sinks, kv_heads)[:, :, None], q_lens)

    def attend_shared(self, qg, pool, kv_lens, q_lens, prefix: SharedPrefix, *, layer=None,
                      **options):
        """Decode queries qg [K, R, G, H] over their prompts' full pages, gathered once per
        prompt and attended by that prompt's rows together: a group of G samples reads its
        prompt's keys once, not G times. Returns ((outputs, log-sum-exp) per row, each row's
        first own table entry)."""
        page_size = self.page_size_of(pool)
        num_prompts, width = prefix.tables.shape
        live = q_lens > 0
        q_pos = kv_lens - 1
        # Each live row's place among its prompt's live rows: their queries form one block.
        prompt = jnp.where(live, prefix.row_prompt, num_prompts)  # padding: dropped
        rank = jnp.sum(jnp.tril(prompt[:, None] == prompt[None, :], k=-1), axis=1)
        block_q = jnp.zeros((qg.shape[0], num_prompts, prefix.group, *qg.shape[2:]), qg.dtype)
        block_q = block_q.at[:, prompt, rank].set(qg, mode="drop")
        block_pos = jnp.zeros((num_prompts, prefix.group), jnp.int32).at[prompt, rank].set(
            q_pos, mode="drop")
        k_pos = jnp.broadcast_to(jnp.arange(width * page_size), (num_prompts, width * page_size))
        out, lse = attend_keys(block_q, *self.sequences(pool, prefix.tables, width, layer),
                               block_pos, k_pos, k_pos < (prefix.pages * page_size)[:, None],
                               **options)
        back = (jnp.minimum(prompt, num_prompts - 1), rank)
        first = jnp.where(live, prefix.pages[back[0]], 0)
        return (out[:, back[0], back[1]], lse[:, back[0], back[1]]), first

    def attend_own(self, qg, pool, tables, kv_lens, q_lens, first, *, layer=None, **options):
        """Decode queries qg [K, R, G, H] over their tables from entry `first` [R] on, up to
        the longest live row's pages (n from `page_buckets`, a `lax.switch` over them):
        (outputs, log-sum-exp) per row."""
        page_size = self.page_size_of(pool)
        own_pages = jnp.where(q_lens > 0, (kv_lens + page_size - 1) // page_size - first, 0)
        buckets = page_buckets(tables.shape[1])
        index = jnp.sum(jnp.asarray(buckets[:-1]) < jnp.max(own_pages))

        def branch(n):
            def attend_n(qg, pool, tables, kv_lens, first):
                columns = jnp.minimum(first[:, None] + jnp.arange(n)[None], tables.shape[1] - 1)
                own = jnp.take_along_axis(tables, columns, axis=1)
                k_pos = first[:, None] * page_size + jnp.arange(n * page_size)[None]
                out, lse = attend_keys(qg[:, :, None], *self.sequences(pool, own, n, layer),
                                       (kv_lens - 1)[:, None], k_pos, k_pos < kv_lens[:, None],
                                       **options)
                return out[:, :, 0], lse[:, :, 0]
            return attend_n

        return jax.lax.switch(index, [branch(n) for n in buckets], qg, pool, tables, kv_lens,
                              first)


class QuantizedPages(SplitPages):
    """SplitPages' layout with int8 or fp8 (e4m3) pages (`mode`): the pool is (keys, values,
    key scales, value scales), the scales bfloat16 `[kv_heads, (layers,) pages, page_size, 1]`,
    one absmax scale per token and kv head (over head_dim). Per token, not per page: a decode
    step writes one token of a page, and a page-wide scale would have to grow and requantize
    the tokens already there. A write quantizes; a read dequantizes the gathered pages to
    `dtype` before XLA's attention, so the arithmetic is SplitPages' on the dequantized keys
    and values. Not the TPU kernel: its `k_scale`/`v_scale` are one static float for the
    whole pool, not per-token scales (`TensorScaledPages` and `paged_attention.CombinedPages`
    take those; the engine refuses this layout on TPU, `kv_quant.check_tpu_kv_mode`)."""

    def __init__(self, mode: str, dtype: Any = jnp.bfloat16):
        self.mode, self.dtype = pages_lib.check_kv_mode(mode), dtype
        if not mode:
            raise ValueError("QuantizedPages needs kv_quant_dtype int8 or fp8; use SplitPages")

    def empty(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
              dtype: Any, layers: int | None = None) -> tuple[jax.Array, ...]:
        values = super().empty(num_pages, page_size, kv_heads, head_dim,
                               pages_lib.KV_MODES[self.mode], layers)
        return (*values, *super().empty(num_pages, page_size, kv_heads, 1, jnp.bfloat16,
                                        layers))

    def write(self, pool, pages, offsets, k, v, layer=None):
        (k_values, k_scale), (v_values, v_scale) = (quantize_kv(k, self.mode),
                                                    quantize_kv(finite_values(v), self.mode))
        return tuple(self.put(x, new, pages, offsets, layer)
                     for x, new in zip(pool, (k_values, v_values, k_scale, v_scale),
                                       strict=True))

    def sequences(self, pool, tables, num_pages: int, layer=None):
        """Each row's dequantized keys and values [K, R, num_pages * page_size, H]."""
        k, v, k_scale, v_scale = (self.gather(x, tables, num_pages, layer) for x in pool)
        return dequantize_kv(k, k_scale, self.dtype), dequantize_kv(v, v_scale, self.dtype)


class TensorScaledPages(SplitPages):
    """SplitPages' layout with fp8 pages under one static scale for all keys and one for all
    values (`StaticKvScale`): no scale arrays, so a page is head_dim bytes a token and kv head.
    A write stores, a read dequantizes the gathered pages to `dtype` with the same constants
    the TPU kernel takes, and XLA attends them as SplitPages does (CPU, GPU)."""

    def __init__(self, kv_scale: StaticKvScale, dtype: Any = jnp.bfloat16):
        self.kv_scale, self.dtype = kv_scale, dtype

    def empty(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
              dtype: Any, layers: int | None = None) -> tuple[jax.Array, jax.Array]:
        return super().empty(num_pages, page_size, kv_heads, head_dim, self.kv_scale.dtype,
                             layers)

    def write(self, pool, pages, offsets, k, v, layer=None):
        return tuple(self.put(x, new, pages, offsets, layer)
                     for x, new in zip(pool, self.kv_scale.store_kv(k, finite_values(v)),
                                       strict=True))

    def sequences(self, pool, tables, num_pages: int, layer=None):
        """Each row's dequantized keys and values [K, R, num_pages * page_size, H]."""
        k, v = (self.gather(x, tables, num_pages, layer) for x in pool)
        scale = self.kv_scale
        return scale.load(k, scale.k_scale, self.dtype), scale.load(v, scale.v_scale, self.dtype)


class GpuPages(SplitPages):
    """SplitPages' layout, with decode steps on JAX's Pallas GPU `paged_attention` kernel: its
    pages are SplitPages' `[kv_heads, pages, page_size, head_dim]` and its loop stops at each
    row's length. Prefill chunks, sliding windows and sinks (which it lacks) take the XLA path.
    `interpret`: run the kernel in Pallas' interpreter (CPU tests)."""

    def __init__(self, interpret: bool = False):
        self.interpret = interpret

    def attend(self, q, pool, tables, kv_lens, q_lens, *, prefix: SharedPrefix | None = None,
               window: int | None = None, sinks=None, scale: float | None = None,
               soft_cap: float | None = None, layer=None) -> jax.Array:
        """The kernel reads each row's pages by its table (layer `layer`'s pages of a stacked
        pool by their ids in the pool seen as [K, L * pages, ...]); `prefix` is for the XLA
        path."""
        if q.shape[1] != 1 or window or sinks is not None:
            return super().attend(q, pool, tables, kv_lens, q_lens, prefix=prefix,
                                  window=window, sinks=sinks, scale=scale, soft_cap=soft_cap,
                                  layer=layer)
        with warnings.catch_warnings():  # JAX marks the module deprecated; it ships in 0.12
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        width = tables.shape[1]
        splits = largest_divisor(width, 16)  # the kernel splits a table into equal partitions
        per_block = largest_divisor(width // splits, 8)
        scaled = q[:, 0] * (q.shape[-1]**-0.5 if scale is None else scale)
        k_pages, v_pages = (x.reshape(x.shape[0], -1, *x.shape[-2:]) for x in pool)
        first_page = 0 if layer is None else layer * pool[0].shape[-3]
        out = paged_attention(scaled, k_pages, v_pages, jnp.maximum(tables, 0) + first_page,
                              jnp.where(q_lens > 0, kv_lens, 0).astype(jnp.int32),
                              k_splits=splits, pages_per_compute_block=per_block,
                              attn_logits_soft_cap=soft_cap or None, interpret=self.interpret)
        return jnp.where((q_lens > 0)[:, None, None], out, 0)[:, None]


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of `n` that is at most `at_most`."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


class CombinedPages:
    """One array `[pages, page_size, 2 * kv_heads, head_dim]`, keys at even and values at odd
    combined heads: the layout of JAX's TPU `ragged_paged_attention`, which attends. The
    engine's pool stacks every layer's, `[layers, pages, page_size, 2 * kv_heads, head_dim]`:
    `layer` as in SplitPages; the kernel reads the stacked pool as `[layers * pages, ...]`.

    With `mesh`, a replica whose `heads_axis` spans several devices (tensor parallelism), the
    kernel runs on each device's query heads and combined heads: the pool is split by combined
    heads over that axis (`spec`), so a device holds whole kv heads, keys and values, with the
    query heads of their groups when the kv heads divide by the devices (`layout_for`).

    With `kv_scale` (`kv_quant_axis=tensor`) the pool is in its dtype (fp8): a write stores
    keys and values by its scales, and the kernel reads them with its `k_scale`/`v_scale`."""

    def __init__(self, mesh: Mesh | None = None, heads_axis: str = "tp",
                 kv_scale: StaticKvScale | None = None):
        self.mesh, self.heads_axis, self.kv_scale = mesh, heads_axis, kv_scale

    def empty(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
              dtype: Any, layers: int | None = None) -> jax.Array:
        return jnp.zeros((*([layers] if layers else []), num_pages, page_size, 2 * kv_heads,
                          head_dim), dtype if self.kv_scale is None else self.kv_scale.dtype)

    def spec(self, pages_axis: str | None) -> P:
        """The partition of the stacked pool: combined heads over the heads axis (and pages over
        `pages_axis`)."""
        return P(None, pages_axis, None, self.heads_axis, None)

    def write(self, pool, pages, offsets, k, v, layer=None):
        k, v = k, finite_values(v)
        if self.kv_scale is not None:
            k, v = self.kv_scale.store_kv(k, v)
        kv = jnp.stack([k, v], axis=-2)  # [..., K, 2, H]: k, v alternate
        kv = kv.reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])
        at = () if layer is None else (layer,)
        return pool.at[(*at, pages, offsets)].set(kv.astype(pool.dtype), mode="drop")

    def copy_page(self, pool, source, target):
        """Pages `target` hold pages `source`, in every layer at once."""
        return pool.at[..., target, :, :, :].set(pool[..., source, :, :, :], mode="drop")

    @staticmethod
    def pages_of(pool, tables, layer=None):
        """(The pool as one run of pages [(L *) pages, page, 2K, H], `tables` as ids in it;
        a -1 entry, past a row's pages, as the layer's first page)."""
        first_page = 0 if layer is None else layer * pool.shape[-4]
        return pool.reshape(-1, *pool.shape[-3:]), jnp.maximum(tables, 0) + first_page

    def sequences(self, pool, tables, num_pages: int, layer=None):
        """Each row's keys and values [K, R, num_pages * page_size, H] (as SplitPages'),
        dequantized to float32 under a `kv_scale` (XLA's attention promotes the queries)."""
        flat, tables = self.pages_of(pool, tables, layer)
        g = flat[tables[:, :num_pages]]  # [R, n, page, 2K, H]
        g = jnp.moveaxis(g.reshape(tables.shape[0], -1, *g.shape[3:]), 2, 0)  # [2K, R, L, H]
        if self.kv_scale is None:
            return g[0::2], g[1::2]
        load, scale = self.kv_scale.load, self.kv_scale
        return (load(g[0::2], scale.k_scale, jnp.float32),
                load(g[1::2], scale.v_scale, jnp.float32))

    def attend(self, q, pool, tables, kv_lens, q_lens, *, prefix: SharedPrefix | None = None,
               window: int | None = None, sinks=None, scale: float | None = None,
               soft_cap: float | None = None, layer=None) -> jax.Array:
        """The kernel reads each row's pages by its table; `prefix` is not needed."""
        if sinks is not None:
            raise NotImplementedError("JAX's TPU ragged_paged_attention has no attention sinks "
                                      "(gpt-oss): decode it with SplitPages")
        kv_pages, tables = self.pages_of(pool, tables, layer)
        (packed, *rest), where = rpa_arguments(q, tables, kv_lens, q_lens)
        kernel = functools.partial(self.kernel, sm_scale=q.shape[-1]**-0.5 if scale is None
                                   else scale, sliding_window=window or None,
                                   soft_cap=soft_cap or None, **self.kernel_scales())
        if self.mesh is not None and self.mesh.shape[self.heads_axis] > 1:
            heads = P(None, self.heads_axis, None)
            kernel = jax.shard_map(kernel, mesh=self.mesh, check_vma=False,
                                   in_specs=(heads, P(None, None, self.heads_axis, None),
                                             *[P()] * len(rest)), out_specs=heads)
        return unpack_rows(kernel(packed, kv_pages, *rest), where, q.shape)

    def kernel_scales(self) -> dict[str, float]:
        """The kernel's `k_scale`/`v_scale` (static floats) under a `kv_scale`; none else."""
        if self.kv_scale is None:
            return {}
        return {"k_scale": self.kv_scale.k_scale, "v_scale": self.kv_scale.v_scale}

    @staticmethod
    def kernel(packed, kv_pages, lens, indices, cu_q_lens, num_seqs, **options) -> jax.Array:
        """JAX's TPU `ragged_paged_attention` on one device's heads, with the target's block
        sizes."""
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
            ragged_paged_attention,
        )

        return ragged_paged_attention(packed, kv_pages, lens, indices, cu_q_lens, num_seqs,
                                      **options, **rpa_block_sizes(
                                          target_device_kind(), packed, kv_pages,
                                          indices.shape[1]))


def rpa_arguments(q, tables, kv_lens, q_lens):
    """Rows -> the TPU kernel's positional arguments after `kv_pages`: queries packed token by
    token [R * C, N, H], kv_lens, page_indices (no -1), cu_q_lens [R + 1], num_seqs [1]; and
    (row, column, real) of each packed token, to put the outputs back."""
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
    """Packed outputs [T, N, H] (T <= R * C, real tokens first) -> rows [R, C, N, H], padding
    queries zero."""
    row, col, real = where
    out = jnp.pad(out, ((0, row.shape[0] - out.shape[0]), (0, 0), (0, 0)))
    rows = jnp.zeros(shape, out.dtype)
    return rows.at[jnp.where(real, row, shape[0]), col].set(out, mode="drop")


# The one head dim JAX's TPU ragged_paged_attention compiles for (libtpu 0.0.50.1's Mosaic,
# cross-compiled for TPU7x: 64 fails an assertion, 256 and 512 "The last dim size is not 128").
KERNEL_HEAD_DIM = 128


def layout_for(platform: str, devices: int = 1, head_dim: int = KERNEL_HEAD_DIM, *,
               mesh: Mesh | None = None, kv_heads: int | None = None, heads_axis: str = "tp",
               kv_mode: str = "", dtype: Any = jnp.bfloat16) -> SplitPages | CombinedPages:
    """The page layout of a replica mesh of `devices` devices on `platform`, for heads
    `head_dim` wide, computing in `dtype`. With `kv_mode` int8 or fp8 (`kv_quant_axis=dkv`)
    `QuantizedPages` on every platform (neither Pallas kernel takes per-token scales; the
    engine refuses it on TPU, `kv_quant.check_tpu_kv_mode`). On TPU the Pallas
    `ragged_paged_attention` for KERNEL_HEAD_DIM heads (in fp8 with `k_scale`/`v_scale` under
    a per-tensor mode, fp8_tensor): on one device, or on each device's heads of a replica
    `mesh` (split over `heads_axis`) whose devices divide the `kv_heads` as the kernel tiles
    them (`kernel_takes_heads`). On GPU the Pallas decode kernel on a one-device replica (XLA
    does not partition a Pallas call over a mesh). XLA's attention otherwise
    (`TensorScaledPages` under a per-tensor mode)."""
    kv_scale = static_kv_scale(kv_mode)
    if kv_mode and kv_scale is None:
        return QuantizedPages(kv_mode, dtype)
    kv_dtype = dtype if kv_scale is None else kv_scale.dtype
    if platform == "tpu" and head_dim == KERNEL_HEAD_DIM \
            and kernel_takes_heads(kv_heads, devices, kv_dtype):
        if devices == 1:
            return CombinedPages(kv_scale=kv_scale)
        if mesh is not None:
            return CombinedPages(mesh, heads_axis, kv_scale)
    if kv_scale is not None:
        return TensorScaledPages(kv_scale, dtype)
    return GpuPages() if platform == "gpu" and devices == 1 else SplitPages()
