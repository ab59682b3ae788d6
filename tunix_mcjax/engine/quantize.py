"""Rollout weights quantized per output channel (int8, fp8 e4m3) with qwix, as the jax engine
holds them (`quantization`).

The engine quantizes each projection matrix of a decoder layer (attention q/k/v/o, MLP
gate/up/down) and an untied lm head when its weights are loaded (a publish; under the
disaggregated mode the trainer leader quantizes them before its put, `host_leaf`, and the
engine places them as they come, `place_quantized`), into a `qwix.QArray`: the values in
int8 or float8_e4m3fn and one float32 absmax scale per output channel (every axis the einsum
does not contract, the layer axis of a stacked leaf included).
The lm head is read whole every decode step, as the layers are; it is 8% of Qwen3-8B's
weights, and Qwen3-8B's int8 engine copy is 58% of bf16's without it, 54% with it. The rest
stays in the engine's weight dtype: the embedding table (a gather reads a few rows per token, so
quantizing it would save memory but no bandwidth; with tied embeddings, as Qwen3-0.6B to 4B
tie them, it is also the lm head, kept whole: not quantized yet) and the norms (vectors).

The forward dequantizes a layer's matrices inside the scanned layer body (`dequantize_tree`),
so XLA can fuse the int8/fp8 -> compute-dtype convert and the scale multiply into the matmul's
operand; qwix's own `einsum` on a float activation and a QArray weight takes that same path
(its `dot_general` dequantizes first whenever an operand is bf16/fp32).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_mcjax.engine.layer_stack import LeafPath, layer_of, run_of

if TYPE_CHECKING:
    from tunix_mcjax.activations import ModelShape

# `quantization` -> the stored dtype of a quantized weight.
MODES: dict[str, Any] = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
VALUE_BYTES = 1  # of each mode's stored values
SCALE_DTYPE = jnp.float32
SCALE_BYTES = 4

# A decoder layer's projections (path below `layers/<i>`) -> leading axes their einsum
# contracts (`train.qwen3_layer.decoder_layer`: q/k/v "BTD,DNH", o "BTNH,NHD", MLP "BTD,DF").
PROJECTIONS: dict[LeafPath, int] = {
    ("attn", "q_proj", "w"): 1,
    ("attn", "k_proj", "w"): 1,
    ("attn", "v_proj", "w"): 1,
    ("attn", "o_proj", "w"): 2,
    ("mlp", "gate_proj", "kernel"): 1,
    ("mlp", "up_proj", "kernel"): 1,
    ("mlp", "down_proj", "kernel"): 1,
}
# Outside the layers: an untied lm head ("BD,DV").
TOP_LEVEL: dict[LeafPath, int] = {("lm_head", "w"): 1}


def check_mode(mode: str) -> str:
    """`mode` if it is "" (off) or one of MODES; else a ValueError naming the key."""
    if mode and mode not in MODES:
        raise ValueError(f"quantization={mode!r}: the jax engine quantizes its weights to "
                         f"{' or '.join(MODES)} (or \"\" for none)")
    return mode


def contracted_axes(path: LeafPath) -> tuple[int, ...] | None:
    """The axes a quantized leaf's einsum contracts (after a stacked leaf's layer axis); None
    for a leaf the engine keeps unquantized."""
    if path in TOP_LEVEL:
        return tuple(range(TOP_LEVEL[path]))
    found = layer_of(path) or run_of(path)
    if found is None or found[1][1:] not in PROJECTIONS:
        return None
    lead = 0 if layer_of(path) else 1  # a trainer's run stacks its layers in front
    return tuple(range(lead, lead + PROJECTIONS[found[1][1:]]))


def quantized_sizes(m: ModelShape) -> tuple[int, int]:
    """(values, output channels) of the matrices the engine quantizes, over the model: every
    layer's `PROJECTIONS`, and an untied lm head (what the params hold past the layers, the
    embedding table and the final norm)."""
    d, q, kv, f = m.embed, m.q_width, m.kv_width, m.mlp
    values = m.layers * d * (2 * q + 2 * kv + 3 * f)
    channels = m.layers * (q + 2 * kv + 2 * d + 2 * f)
    if m.param_count - m.layers * m.layer_param_count - d > m.vocab * d:  # an untied lm head
        values, channels = values + m.vocab * d, channels + m.vocab
    return values, channels


def _scale_sharding(sharding: Any, contracted: tuple[int, ...], ndim: int) -> Any:
    """The leaf's sharding with its contracted axes whole: a scale holds size 1 there."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*(None if i in contracted else axis
                                           for i, axis in enumerate(spec))))


@functools.lru_cache
def _quantizer(mode: str, contracted: tuple[int, ...], ndim: int, sharding: Any):
    channels = tuple(i for i in range(ndim) if i not in contracted)
    qtype = MODES[mode]
    out = qwix.QArray(qvalue=sharding, scale=_scale_sharding(sharding, contracted, ndim),
                      qtype=qtype)

    def quantize(w: jax.Array) -> qwix.QArray:
        return qwix.quantize(w.astype(SCALE_DTYPE), qtype, channelwise_axes=channels,
                             scale_dtype=SCALE_DTYPE)

    return jax.jit(quantize, out_shardings=out)


def quantize_leaf(path: LeafPath, leaf: jax.Array, mode: str) -> jax.Array | qwix.QArray:
    """`leaf` as the engine holds it under `quantization=mode`: a QArray for a projection
    matrix, the leaf itself for anything else or with mode ""."""
    contracted = contracted_axes(path)
    if not check_mode(mode) or contracted is None:
        return leaf
    with jax.set_mesh(leaf.sharding.mesh):
        return _quantizer(mode, contracted, leaf.ndim, leaf.sharding)(leaf)


def abstract_leaf(path: LeafPath, leaf: jax.ShapeDtypeStruct, mode: str) -> Any:
    """`quantize_leaf`'s result as sharded ShapeDtypeStructs (for compiling ahead of time)."""
    contracted = contracted_axes(path)
    if not check_mode(mode) or contracted is None:
        return leaf
    return jax.eval_shape(_quantizer(mode, contracted, len(leaf.shape), leaf.sharding), leaf)


def dequantize(w: qwix.QArray, dtype: Any) -> jax.Array:
    """A QArray's values times its scales (in float32), in `dtype`."""
    return (w.qvalue.astype(SCALE_DTYPE) * w.scale).astype(dtype)


def is_quantized(leaf: Any) -> bool:
    return isinstance(leaf, qwix.QArray)


def dequantize_tree(tree: Any, dtype: Any) -> Any:
    """`tree` with every QArray leaf dequantized to `dtype`."""
    return jax.tree.map(lambda w: dequantize(w, dtype) if is_quantized(w) else w, tree,
                        is_leaf=is_quantized)


def weight_bytes(path: LeafPath, shape: tuple[int, ...], itemsize: int, mode: str) -> int:
    """Bytes the engine holds for one leaf of `shape` (itemsize: its unquantized dtype's):
    a projection under `mode` takes a byte a value plus a float32 scale per output channel."""
    values = math.prod(shape)
    contracted = contracted_axes(path)
    if not mode or contracted is None:
        return values * itemsize
    scales = math.prod(1 if i in contracted else dim for i, dim in enumerate(shape))
    return values * VALUE_BYTES + scales * SCALE_BYTES


def host_leaf(path: LeafPath, leaf: jax.Array, mode: str, dtype: Any) -> Any:
    """One leaf of a publish's host copy in the form an engine holding its weights in `dtype`
    under `quantization=mode` keeps it (`leaf`: a full copy on one device; dtype None: as it
    is). A projection is cast to `dtype` and quantized on that device as the engine's load
    would cast and quantize it (`quantize_leaf`), a QArray of numpy values and scales; any
    other leaf is numpy, cast to `dtype` only where that narrows it (the engine casts alike)."""
    contracted = contracted_axes(path) if check_mode(mode) and dtype is not None else None
    if contracted is not None:
        quantized = _quantizer(mode, contracted, leaf.ndim, leaf.sharding)(leaf.astype(dtype))
        return jax.tree.map(np.asarray, quantized)
    if dtype is not None and jnp.issubdtype(leaf.dtype, jnp.floating) and \
            jnp.dtype(dtype).itemsize < leaf.dtype.itemsize:
        leaf = leaf.astype(dtype)
    return np.asarray(leaf)


def place_quantized(path: LeafPath, leaf: qwix.QArray, sharding: Any, mode: str) -> qwix.QArray:
    """A QArray quantized before the load (`host_leaf`) placed as `quantize_leaf` would hold
    it: values on `sharding`, scales whole along the contracted axes. A ValueError when the
    engine would not have quantized the leaf so (another mode, or a leaf it keeps whole)."""
    contracted = contracted_axes(path)
    want = MODES.get(check_mode(mode)) if contracted is not None else None
    scale_shape = tuple(1 if i in (contracted or ()) else d for i, d in enumerate(leaf.shape))
    if want is None or jnp.dtype(leaf.qtype) != jnp.dtype(want) or \
            tuple(leaf.scale.shape) != scale_shape:
        held = f"in {jnp.dtype(want).name} with scales {scale_shape}" if want else "unquantized"
        raise ValueError(
            f"param {'/'.join(path)} arrives quantized to {jnp.dtype(leaf.qtype).name} with "
            f"scales {tuple(leaf.scale.shape)}, but this engine (quantization={mode!r}) holds "
            f"it {held}: publish with the engine's quantization")
    return qwix.QArray(qvalue=jax.device_put(leaf.qvalue, sharding),
                       scale=jax.device_put(leaf.scale, _scale_sharding(sharding, contracted,
                                                                         leaf.ndim)),
                       qtype=leaf.qtype)


def quantize_axes(leaf: jax.Array, contracted: tuple[int, ...], mode: str) -> qwix.QArray:
    """`leaf` (placed with a NamedSharding) as a QArray under `quantization=mode`: a scale per
    output channel, every axis but `contracted` (for engines whose param paths are not
    `PROJECTIONS`', e.g. the maxtext engine's)."""
    with jax.set_mesh(leaf.sharding.mesh):
        return _quantizer(check_mode(mode), contracted, leaf.ndim, leaf.sharding)(leaf)


def axes_bytes(shape: tuple[int, ...], itemsize: int, contracted: tuple[int, ...] | None,
               mode: str) -> int:
    """`weight_bytes` of a leaf whose contracted axes are given (None: kept unquantized)."""
    values = math.prod(shape)
    if not mode or contracted is None:
        return values * itemsize
    scales = math.prod(1 if i in contracted else dim for i, dim in enumerate(shape))
    return values * VALUE_BYTES + scales * SCALE_BYTES
