"""A functional Qwen3 forward over the Tunix param tree, decoding over a KV page pool.

Numerically it follows `tunix.models.qwen3.model` (per-head q/k RMSNorm, RoPE, GQA, fp32 softmax
and logits). Unlike Tunix's cache, which writes every row at one shared index, each token here
writes its key/value into the page and slot its row's block table gives (`engine.pages`), so
rows can be at different points of their sequences and share prompt pages.
Params are the nested dict of `nnx.to_pure_dict(nnx.state(model, nnx.Param))` with string keys,
except that the paged forward takes its decoder layers stacked (`layers/<name>` [L, ...] instead
of `layers/<i>/<name>`: `stack_layers`) and scans one layer body over them, whatever the depth.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from tunix.models.qwen3.model import K_MASK, ModelConfig

from tunix_mcjax.engine.paged_attention import CombinedPages, SharedPrefix, SplitPages
from tunix_mcjax.train import lora

Params = dict[str, Any]
# Tunix 0.1.7's attention calls `apply_rope` without `config.rope_theta`, so its Qwen3 always
# rotates with the default 1e6. The trainer scores with Tunix's model; we match it, not the config.
TUNIX_ROPE_THETA = 1_000_000
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


def rms_norm(x: jax.Array, w: jax.Array, eps: float, dtype: Any) -> jax.Array:
    x = x.astype(jnp.float32)
    rms = jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * (x / rms)).astype(dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """RoPE on x [B, T, N, H] at integer positions [B, T] (Tunix's half-split convention)."""
    head_dim = x.shape[-1]
    fraction = 2 * jnp.arange(0, head_dim // 2, dtype=jnp.float32) / head_dim
    angles = positions[..., None] / (theta**fraction)[None, None, :]
    sin = jnp.sin(angles)[..., None, :].astype(x.dtype)
    cos = jnp.cos(angles)[..., None, :].astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """GQA attention: q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S] (True = attend)."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k) * h**-0.5
    scores = jnp.where(mask[:, None, None, :, :], scores, K_MASK)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(k.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(b, t, n, h)


def _matmul(x: jax.Array, w: jax.Array, spec: str, dtype: Any) -> jax.Array:
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype))


def _project(cfg: ModelConfig, x: jax.Array, module: Params, weight: str, spec: str
             ) -> jax.Array:
    """One projection; with LoRA adapters beside its weight, plus their term (qwix's)."""
    out = _matmul(x, module[weight], spec, cfg.dtype)
    if lora.has_adapters(module, weight):
        spec_lora = lora.lora_of(cfg)
        if spec_lora is None:
            raise ValueError("the param tree has LoRA adapters but the model config carries no "
                             "LoRA spec (build it with lora.with_lora)")
        out = out + lora.delta(x, module, weight, spec, cfg.dtype, spec_lora.scale)
    return out


def decoder_layer(cfg: ModelConfig, lp: Params, x: jax.Array, positions: jax.Array, attend):
    """One decoder layer. `attend(q, k, v) -> (attn_out, layer_cache)` owns the cache policy."""
    dt, eps = cfg.dtype, cfg.norm_eps
    a = lp["attn"]
    h = rms_norm(x, lp["input_layernorm"]["w"], eps, dt)
    q = rms_norm(_project(cfg, h, a["q_proj"], "w", "BTD,DNH->BTNH"), a["q_norm"]["w"], eps, dt)
    k = rms_norm(_project(cfg, h, a["k_proj"], "w", "BSD,DKH->BSKH"), a["k_norm"]["w"], eps, dt)
    v = _project(cfg, h, a["v_proj"], "w", "BSD,DKH->BSKH")
    q = apply_rope(q, positions, TUNIX_ROPE_THETA)
    k = apply_rope(k, positions, TUNIX_ROPE_THETA)
    out, layer_cache = attend(q, k, v)
    x = x + _project(cfg, out, a["o_proj"], "w", "BTNH,NHD->BTD")
    m = lp["mlp"]
    h = rms_norm(x, lp["post_attention_layernorm"]["w"], eps, dt)
    gate = _project(cfg, h, m["gate_proj"], "kernel", "BTD,DF->BTF")
    up = _project(cfg, h, m["up_proj"], "kernel", "BTD,DF->BTF")
    x = x + _project(cfg, jax.nn.silu(gate) * up, m["down_proj"], "kernel", "BTF,FD->BTD")
    return x, layer_cache


def embed_tokens(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings [..., D] in the compute dtype."""
    return params["embedder"]["input_embedding"][tokens].astype(cfg.dtype)


def _logits(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """fp32 logits [B, V] from final hidden states [B, D]."""
    x = rms_norm(x, params["final_norm"]["w"], cfg.norm_eps, cfg.dtype)
    if cfg.use_tied_embedding:
        logits = _matmul(x, params["embedder"]["input_embedding"], "BD,VD->BV", cfg.dtype)
    else:
        logits = _matmul(x, params["lm_head"]["w"], "BD,DV->BV", cfg.dtype)
    return logits.astype(jnp.float32)


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

        def attend(q, k, v):
            written = layout.write(pool, rows.write_pages, rows.write_offsets, k, v, layer=index)
            return layout.attend(q, written, rows.tables, rows.kv_lens, rows.q_lens,
                                 prefix=rows.prefix, layer=index), written

        x, pool = decoder_layer(cfg, layer_params, x, rows.positions, attend)
        return (x, pool, index + 1), None

    (x, pool, _), _ = jax.lax.scan(layer_step, (x, pool, jnp.int32(0)), params["layers"])
    last = x[jnp.arange(r), rows.logit_cols]
    return _logits(cfg, params, last), pool


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
