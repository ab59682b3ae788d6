"""JAX's TPU `ragged_paged_attention` sized for the chip a program is compiled for: its block
sizes and VMEM limit (`rpa_block_sizes`), and which kv heads a device's kernel call can tile
(`kernel_takes_heads`). `paged_attention.CombinedPages` and `layout_for` use them.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

# VMEM per TensorCore by TPU device kind (jax._src.tpu_info); the kernel may use 3/4 of it.
TPU_VMEM_BYTES = {"TPU v4": 16 << 20, "TPU v4 lite": 16 << 20, "TPU v5 lite": 128 << 20,
                  "TPU v5e": 128 << 20, "TPU v5": 64 << 20, "TPU v5p": 64 << 20,
                  "TPU v6 lite": 128 << 20, "TPU v6e": 128 << 20, "TPU7x": 64 << 20}


def target_device_kind() -> str:
    """The device kind a program is being lowered for: the abstract mesh's (set when
    compiling for a TPU topology from another host, `tunix_mcjax.aot`), else the default
    device's."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    return (abstract or jax.devices()[0]).device_kind


def rpa_block_sizes(device_kind: str, q: jax.Array, pages: jax.Array,
                    pages_per_seq: int) -> dict[str, int]:
    """`ragged_paged_attention`'s block sizes and VMEM limit for `device_kind`: JAX's tuned
    table, looked up for the target (the kernel's own lookup reads the default device, so a
    program compiled on a CPU host for a TPU would fail) and its defaults where untuned."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel, tuned_block_sizes

    if device_kind not in TPU_VMEM_BYTES:
        raise ValueError(f"CombinedPages runs JAX's TPU kernel, which has no block sizes for "
                         f"device kind {device_kind!r} (TPU v4 or later); use SplitPages")
    q_heads, kv_heads = kernel.get_min_heads_per_blk(q.shape[1], pages.shape[2], q.dtype,
                                                     pages.dtype)
    key = tuned_block_sizes.simplify_key((q.dtype, pages.dtype, q_heads, kv_heads // 2,
                                          q.shape[2], pages.shape[1], q.shape[0], pages_per_seq))
    generation = "TPU v" + re.search(r"TPU\s*v?(\d+)", device_kind).group(1)  # the table's
    kv_pages, queries = (32, 32) if generation == "TPU v4" else \
        tuned_block_sizes.TUNED_BLOCK_SIZES.get(generation, {}).get(key, (128, 32))
    return {"num_kv_pages_per_block": min(pages_per_seq, kv_pages),
            "num_queries_per_block": min(q.shape[0], queries),
            "vmem_limit_bytes": TPU_VMEM_BYTES[device_kind] * 3 // 4}


def kernel_takes_heads(kv_heads: int | None, devices: int, kv_dtype: Any) -> bool:
    """Whether JAX's TPU kernel takes each device's share of `kv_heads` in `kv_dtype`: whole kv
    heads a device, and their combined heads (keys and values) tiled as its
    `get_min_heads_per_blk` requires: a multiple of the dtype's packing in 32 bits (4 for fp8:
    an even number of kv heads a device), that many packed rows 1, 2, 4, 8 or a multiple of 8.
    Unknown `kv_heads`: one device only."""
    if kv_heads is None or kv_heads % devices:
        return kv_heads is None and devices == 1
    packing, combined = 4 // jnp.dtype(kv_dtype).itemsize, 2 * kv_heads // devices
    rows = combined // packing
    return combined % packing == 0 and (rows in (1, 2, 4, 8) or rows % 8 == 0)
