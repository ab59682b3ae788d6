"""How KV pages are quantized (`quantize_kvcache`), for the layouts of `paged_attention`, which
picks them by the engine's `kv_quantization` mode (`pages.kv_mode_of`).

- `quantize_kv` / `dequantize_kv` (`kv_quant_axis=dkv`; modes int8, fp8): one bfloat16 absmax
  scale per token and kv head (`paged_attention.QuantizedPages`).
- `StaticKvScale` (`kv_quant_axis=tensor`; mode fp8_tensor): one static scale for all keys and
  one for all values: `paged_attention.TensorScaledPages` (XLA's path) and
  `paged_attention.CombinedPages`, which passes them to JAX's TPU `ragged_paged_attention` as
  its `k_scale`/`v_scale`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tunix_mcjax.engine import pages as pages_lib

# A quantized dtype's largest magnitude: a (token, head)'s absmax maps to it.
KV_QMAX = {"int8": 127.0, "fp8": 448.0}


def quantize_kv(x: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (values [..., H] in `mode`'s dtype, bfloat16 scales [..., 1]): one absmax
    scale per vector over its last axis (a token's kv head), so x ~ values * scales."""
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / KV_QMAX[mode], 1.0).astype(jnp.bfloat16)
    scaled = jnp.clip(x.astype(jnp.float32) / scale.astype(jnp.float32), -KV_QMAX[mode],
                      KV_QMAX[mode])
    values = jnp.round(scaled) if mode == "int8" else scaled
    return values.astype(pages_lib.KV_MODES[mode]), scale


def dequantize_kv(values: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """`quantize_kv` undone: values * scales, in `dtype`."""
    return (values.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class StaticKvScale:
    """Per-tensor KV quantization (`kv_quant_axis=tensor`): pages in `dtype`, a key stored as
    k / k_scale and a value as v / v_scale, clipped to the dtype's largest magnitude (448 for
    fp8 e4m3: past it a cast would give NaN), read back as stored * scale. The scales are
    static Python floats, as JAX's TPU `ragged_paged_attention` takes them; 1.0 each is vLLM's
    `kv_cache_dtype=fp8` without calibrated scales."""

    dtype: Any = jnp.float8_e4m3fn
    k_scale: float = 1.0
    v_scale: float = 1.0

    def store(self, x: jax.Array, scale: float) -> jax.Array:
        """x / scale, clipped to the dtype's range, in `dtype`."""
        limit = float(jnp.finfo(self.dtype).max)
        return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(self.dtype)

    @staticmethod
    def load(x: jax.Array, scale: float, dtype: Any) -> jax.Array:
        """Stored values * scale in `dtype`, through float32 as the kernel converts them."""
        return (x.astype(jnp.float32) * scale).astype(dtype)

    def store_kv(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values as the pages hold them."""
        return self.store(k, self.k_scale), self.store(v, self.v_scale)


def static_kv_scale(mode: str) -> StaticKvScale | None:
    """The static scale of a per-tensor `kv_quantization` mode (`pages.KV_TENSOR_MODES`);
    None for a mode with scale arrays or none."""
    if mode not in pages_lib.KV_TENSOR_MODES:
        return None
    return StaticKvScale(pages_lib.KV_MODES[mode])


def check_tpu_kv_mode(kv_mode: str) -> None:
    """Refuses KV pages with per-token scales (`kv_quant_axis=dkv`) on TPU, naming the mode
    the kernel reads there."""
    if kv_mode and static_kv_scale(kv_mode) is None:
        raise ValueError(
            f"quantize_kvcache=true kv_quant_dtype={kv_mode} kv_quant_axis=dkv on TPU: the Pallas "
            "kernel cannot read per-token scales, and XLA's attention over such pages holds "
            "temporaries the planner does not count (Qwen3-0.6B on TPU7x: 46.76 GiB against "
            "1.56 for bf16 pages, docs/engines.md); set kv_quant_axis=tensor kv_quant_dtype=fp8 "
            "(one static scale the kernel reads), or quantize_kvcache=false")
