"""Tunix's Qwen3 decoder layer as pure functions over its param tree (per-head q/k RMSNorm,
RoPE, GQA, fp32 softmax and logits): the one definition the trainer's packed forward
(`packed_qwen3`) and the engine's paged forward (`engine.qwen3_forward`) both compute, each
with its own attention (`decoder_layer`'s `attend`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from tunix.models.qwen3.model import K_MASK, ModelConfig

from tunix_mcjax.train import lora

Params = dict[str, Any]
# Tunix 0.1.7's attention calls `apply_rope` without `config.rope_theta`, so its Qwen3 always
# rotates with the default 1e6. The trainer scores with Tunix's model; we match it, not the config.
TUNIX_ROPE_THETA = 1_000_000


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


def matmul(x: jax.Array, w: jax.Array, spec: str, dtype: Any) -> jax.Array:
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype))


def project(cfg: ModelConfig, x: jax.Array, module: Params, weight: str, spec: str
             ) -> jax.Array:
    """One projection; with LoRA adapters beside its weight, plus their term (qwix's)."""
    out = matmul(x, module[weight], spec, cfg.dtype)
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
    q = rms_norm(project(cfg, h, a["q_proj"], "w", "BTD,DNH->BTNH"), a["q_norm"]["w"], eps, dt)
    k = rms_norm(project(cfg, h, a["k_proj"], "w", "BSD,DKH->BSKH"), a["k_norm"]["w"], eps, dt)
    v = project(cfg, h, a["v_proj"], "w", "BSD,DKH->BSKH")
    q = apply_rope(q, positions, TUNIX_ROPE_THETA)
    k = apply_rope(k, positions, TUNIX_ROPE_THETA)
    out, layer_cache = attend(q, k, v)
    x = x + project(cfg, out, a["o_proj"], "w", "BTNH,NHD->BTD")
    m = lp["mlp"]
    h = rms_norm(x, lp["post_attention_layernorm"]["w"], eps, dt)
    gate = project(cfg, h, m["gate_proj"], "kernel", "BTD,DF->BTF")
    up = project(cfg, h, m["up_proj"], "kernel", "BTD,DF->BTF")
    x = x + project(cfg, jax.nn.silu(gate) * up, m["down_proj"], "kernel", "BTF,FD->BTD")
    return x, layer_cache


def embed_tokens(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings [..., D] in the compute dtype."""
    return params["embedder"]["input_embedding"][tokens].astype(cfg.dtype)


def logits_of(cfg: ModelConfig, params: Params, x: jax.Array) -> jax.Array:
    """fp32 logits [B, V] from final hidden states [B, D]."""
    x = rms_norm(x, params["final_norm"]["w"], cfg.norm_eps, cfg.dtype)
    if cfg.use_tied_embedding:
        logits = matmul(x, params["embedder"]["input_embedding"], "BD,VD->BV", cfg.dtype)
    else:
        logits = matmul(x, params["lm_head"]["w"], "BD,DV->BV", cfg.dtype)
    return logits.astype(jnp.float32)
