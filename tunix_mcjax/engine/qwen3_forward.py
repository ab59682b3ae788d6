"""A functional Qwen3 forward over the Tunix param tree, decoding over a KV page pool.

Numerically it follows `tunix.models.qwen3.model` (per-head q/k RMSNorm, RoPE, GQA, fp32 softmax
and logits). Unlike Tunix's cache, which writes every row at one shared index, each token here
writes its key/value into the page and slot its row's block table gives (`engine.pages`), so
rows can be at different points of their sequences and share prompt pages.
Params are the nested dict of `nnx.to_pure_dict(nnx.state(model, nnx.Param))` with string keys,
except that the paged forward takes its decoder layers stacked (`layers/<name>` [L, ...] instead
of `layers/<i>/<name>`: `stack_layers`) and scans one layer body over them, whatever the depth.
A layer's projection matrices and an untied lm head may be held quantized (`engine.quantize`,
`qwix.QArray`): each is dequantized just before its matmul, into which XLA fuses it on TPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from tunix.models.qwen3.model import ModelConfig

from tunix_mcjax.engine.paged_attention import CombinedPages, SharedPrefix, SplitPages
from tunix_mcjax.engine.quantize import dequantize_tree
from tunix_mcjax.train.qwen3_layer import Params, decoder_layer, embed_tokens, logits_of

# How a layer's pages are laid out, written and attended (`engine.paged_attention`).
PageLayout = SplitPages | CombinedPages


@dataclasses.dataclass(frozen=True)
class PagedRows:
    """One model call over the page pool: R rows of C tokens (a prefill chunk, or one decode
    token per row), with where each token's key/value goes and what each row attends to."""

    tokens: jax.Array  # int32 [R, C]
    positions: jax.Array  # int32 [R, C]
    write_pages: jax.Array  # int32 [R, C]: page of each token; num_pages (dropped) for padding
    write_offsets: jax.Array  # int32 [R, C]: slot in that page
    tables: jax.Array  # int32 [R, S]: each row's block table
    kv_lens: jax.Array  # int32 [R]: tokens of the row's sequence after this call
    q_lens: jax.Array  # int32 [R]: real tokens of the row in this call
    logit_cols: jax.Array  # int32 [R]: the column whose logits are returned
    prefix: SharedPrefix | None = None  # decode rows' shared prompt pages, where known


jax.tree_util.register_dataclass(PagedRows)


def stack_layers(params: Params, num_layers: int) -> Params:
    """Tunix's tree (`layers/<i>/...`) with its decoder layers stacked: `layers/...` [L, ...]."""
    layers = [params["layers"][str(i)] for i in range(num_layers)]
    return {**params, "layers": jax.tree.map(lambda *x: jnp.stack(x), *layers)}


def paged_forward(
    cfg: ModelConfig,
    params: Params,
    pool: Any,
    rows: PagedRows,
    layout: PageLayout,
) -> tuple[jax.Array, Any]:
    """Rows of tokens through the model over a page pool -> (fp32 logits [R, V] at each row's
    `logit_cols`, the pool with every real token's key/value written). `params` has its layers
    stacked (`stack_layers`); the pool is the layout's stacked one (`empty(..., layers=L)`).

    One `lax.scan` over the layers carries the hidden states and the whole pool: layer l
    writes its keys/values at (l, page, slot) in place, then attends, so a row's queries see
    the tokens of the same call that precede them (a prefill chunk) as well as earlier ones."""
    r = rows.tokens.shape[0]
    x = embed_tokens(cfg, params, rows.tokens)

    def layer_step(carry, layer_params):
        x, pool, index = carry
        layer_params = dequantize_tree(layer_params, cfg.dtype)  # quantized weights, if any

        def attend(q, k, v):
            written = layout.write(pool, rows.write_pages, rows.write_offsets, k, v, layer=index)
            return layout.attend(q, written, rows.tables, rows.kv_lens, rows.q_lens,
                                 prefix=rows.prefix, layer=index), written

        x, pool = decoder_layer(cfg, layer_params, x, rows.positions, attend)
        return (x, pool, index + 1), None

    (x, pool, _), _ = jax.lax.scan(layer_step, (x, pool, jnp.int32(0)), params["layers"])
    last = x[jnp.arange(r), rows.logit_cols]
    head = dequantize_tree({k: v for k, v in params.items() if k != "layers"}, cfg.dtype)
    return logits_of(cfg, head, last), pool


class Qwen3PagedModel:
    """Tunix Qwen3 as the decode loop's model (`decode_loop.DecodeModel`), on a replica's mesh
    [data, tp]: the pool's kv heads are split over `tp`, as the attention heads are, and its
    pages over `data` (more than one replica only in lockstep, a pool slice each)."""

    def __init__(self, cfg: ModelConfig, mesh: jax.sharding.Mesh, layout: PageLayout):
        self.cfg, self.layout, self.mesh = cfg, layout, mesh
        self._pool_makers: dict[tuple[int, int], Any] = {}  # compiled once per pool shape

    def empty_pool(self, num_pages: int, page_size: int) -> Any:
        """The layout's stacked pool over every layer."""
        cfg = self.cfg
        if (num_pages, page_size) not in self._pool_makers:
            def make():
                return self.layout.empty(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                                         cfg.dtype, layers=cfg.num_layers)

            sharding = NamedSharding(self.mesh, self.layout.spec("data"))
            self._pool_makers[num_pages, page_size] = jax.jit(make, out_shardings=sharding)
        return self._pool_makers[num_pages, page_size]()

    def forward(self, params: Params, pool: Any, rows: PagedRows):
        logits, pool = paged_forward(self.cfg, params, pool, rows, self.layout)
        heads = NamedSharding(self.mesh, self.layout.spec(None))
        return logits, jax.tree.map(lambda p: jax.lax.with_sharding_constraint(p, heads), pool)

    def copy_page(self, pool: Any, source: jax.Array, target: jax.Array):
        return self.layout.copy_page(pool, source, target)
