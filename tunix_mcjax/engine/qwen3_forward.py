"""A functional Qwen3 forward over the Tunix param tree, with a KV cache written per row.

Numerically it follows `tunix.models.qwen3.model` (per-head q/k RMSNorm, RoPE, GQA, fp32 softmax
and logits). Unlike Tunix's cache, which writes every row at one shared index, each row here writes
its new key/value at its own position, so rows can be at different points of their sequences.
Params are the nested dict of `nnx.to_pure_dict(nnx.state(model, nnx.Param))` with string keys.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from tunix.models.qwen3.model import K_MASK, ModelConfig

from tunix_mcjax import lora

Params = dict[str, Any]
# Tunix 0.1.7's attention calls `apply_rope` without `config.rope_theta`, so its Qwen3 always
# rotates with the default 1e6. The trainer scores with Tunix's model; we match it, not the config.
TUNIX_ROPE_THETA = 1_000_000
# keys [B, K, H, S] and values [B, K, S, H] (K kv heads, H head dim, S cache length): the layouts
# the decode attention contracts without transposing the whole cache every step.
LayerCache = tuple[jax.Array, jax.Array]


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


def prefill(
    cfg: ModelConfig, params: Params, tokens: jax.Array, lengths: jax.Array
) -> tuple[jax.Array, list[LayerCache]]:
    """Left-aligned prompts tokens [B, T] (right-padded) -> (logits at lengths-1 [B, V], per-layer
    cache of length T). Token i sits at position i."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=bool)), (b, t, t))

    def attend(q, k, v):
        return attention(q, k, v, causal), (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3))

    x = embed_tokens(cfg, params, tokens)
    cache = []
    for i in range(cfg.num_layers):
        x, layer_cache = decoder_layer(cfg, params["layers"][str(i)], x, positions, attend)
        cache.append(layer_cache)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return _logits(cfg, params, last), cache


def empty_cache(cfg: ModelConfig, batch: int, cache_len: int) -> list[LayerCache]:
    kv, h = cfg.num_kv_heads, cfg.head_dim
    return [
        (
            jnp.zeros((batch, kv, h, cache_len), cfg.dtype),
            jnp.zeros((batch, kv, cache_len, h), cfg.dtype),
        )
        for _ in range(cfg.num_layers)
    ]


def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array
) -> jax.Array:
    """One query per row: q [B, N, H], k_cache [B, K, H, S], v_cache [B, K, S, H], mask [B, S]."""
    b, n, h = q.shape
    kv_heads = k_cache.shape[1]
    q = q.reshape(b, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("BKGH,BKHS->BKGS", q, k_cache) * h**-0.5
    scores = jnp.where(mask[:, None, None, :], scores, K_MASK)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v_cache.dtype)
    return jnp.einsum("BKGS,BKSH->BKGH", probs, v_cache).reshape(b, n, h)


def decode_step(
    cfg: ModelConfig,
    params: Params,
    cache: list[LayerCache],
    tokens: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, list[LayerCache]]:
    """One token per row: tokens [B] at positions [B] -> (logits [B, V], updated cache).

    Row b writes its key/value at cache index positions[b] and attends to indices <= positions[b].
    """
    b = tokens.shape[0]
    cache_len = cache[0][0].shape[-1]
    rows = jnp.arange(b)
    mask = jnp.arange(cache_len)[None, :] <= positions[:, None]
    x = embed_tokens(cfg, params, tokens[:, None])
    new_cache = []
    for i in range(cfg.num_layers):
        k_cache, v_cache = cache[i]

        def attend(q, k, v, k_cache=k_cache, v_cache=v_cache):
            k_cache = k_cache.at[rows, :, :, positions].set(k[:, 0], mode="drop")
            v_cache = v_cache.at[rows, :, positions, :].set(v[:, 0], mode="drop")
            out = decode_attention(q[:, 0], k_cache, v_cache, mask)
            return out[:, None], (k_cache, v_cache)

        x, layer_cache = decoder_layer(cfg, params["layers"][str(i)], x, positions[:, None], attend)
        new_cache.append(layer_cache)
    return _logits(cfg, params, x[:, 0]), new_cache
