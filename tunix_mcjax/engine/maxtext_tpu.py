"""The maxtext engine's weights on TPU: MoE expert kernels padded to whole 128-lanes where TPU's
default layout would have XLA copy them (`tpu_config`, `padded_kernels`), and the expert-major
and expert-minor orders the engine holds them in.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

# On TPU an array's default layout keeps a dimension that is a multiple of the 128 lanes minor
# rather than pad one that is not: Gemma4-26B's expert up-kernels [128, 2816, 704] lie
# embed-minor, MaxText's grouped matmul (megablox) takes them mlp-minor, and XLA copied every
# layer's wi_0 and wi_1 before the decode loop (31 GiB at 30 layers). The engine's copy on TPU is
# padded with zeros to a multiple of 128 along mlp (MaxText's `padded_base_moe_mlp_dim`, as its
# vLLM rollout pads them), whose default layout is mlp-minor; the zeros add nothing.
TPU_LANES = 128
MOE_MLP_AXIS = {"wi_0": 2, "wi_1": 2, "wo": 1}  # each expert kernel's mlp axis


def tpu_moe_mlp_dim(config: Any) -> int | None:
    """The MoE mlp width the engine pads expert kernels to on TPU, or None: no MoE, an mlp
    width of whole lanes, an embed width that is not (no layout prefers it minor), or MoE
    biases or fused kernels (MaxText pads neither)."""
    mlp = config.moe_mlp_dim
    if (config.num_experts <= 1 or mlp % TPU_LANES == 0 or config.emb_dim % TPU_LANES
            or config.mlp_bias or config.prefuse_moe_weights):
        return None
    return -(-mlp // TPU_LANES) * TPU_LANES


def tpu_config(config: Any) -> Any:
    """The engine's MaxText config on TPU: its MoE kernels padded (`tpu_moe_mlp_dim`)."""
    padded = tpu_moe_mlp_dim(config)
    return config if padded is None else config.model_copy(
        update={"padded_base_moe_mlp_dim": padded})


def padded_kernels(specs: dict, config: Any,
                   stacked: dict[tuple, int] | None = None) -> dict[tuple, tuple[int, int]]:
    """{path: (mlp axis, padded width)} of the expert kernels in `specs` (`param_specs` of
    MaxText's unpadded `config`) that the engine pads on TPU; the axis is the engine's, whose
    leaves have their `stacked[path]` stacked axes in front (`maxtext_scan.layer_major`)."""
    padded = tpu_moe_mlp_dim(config)
    if padded is None:
        return {}
    stacked = stacked or {}
    return {path: (stacked.get(path, 0) + MOE_MLP_AXIS[path[-1]], padded)
            for path, (_, shape, *_) in specs.items()
            if path[-1] in MOE_MLP_AXIS and len(shape) - stacked.get(path, 0) == 3}


@functools.partial(jax.jit, static_argnums=(1, 2))
def pad_axis(kernel: jax.Array, axis: int, width: int) -> jax.Array:
    """`kernel` with zeros after its entries along `axis`, to `width`."""
    widths = [(0, 0)] * kernel.ndim
    widths[axis] = (0, width - kernel.shape[axis])
    return jnp.pad(kernel, widths)


# MoE up-projections [experts, embed, mlp]: MaxText's decode einsum "BSM,EMH->BSEH" contracts
# the middle axis, so XLA's CPU dot copies the whole kernel to [embed, experts * mlp] at every
# step. On CPU the engine stores them expert-minor ([embed, experts, mlp]) and the forward hands
# MaxText a transposed view of them, which the dot reads as it lies.
MOE_UP_KERNELS = ("wi_0", "wi_1")


@functools.partial(jax.jit, static_argnums=1)
def expert_minor(kernel: jax.Array, stacked: int = 0) -> jax.Array:
    """[(stacked axes,) experts, embed, mlp] -> [(stacked axes,) embed, experts, mlp]."""
    return jnp.moveaxis(kernel, stacked + 1, stacked)


@functools.partial(jax.jit, static_argnums=1)
def expert_major_leaf(kernel: jax.Array, stacked: int = 0) -> jax.Array:
    """`expert_minor` undone."""
    return jnp.moveaxis(kernel, stacked, stacked + 1)


def expert_major(params: dict, paths: set[tuple], prefix: tuple = ()) -> dict:
    """`params` (the subtree at `prefix`) with the leaves at `paths` (stored [embed, experts,
    mlp]) viewed in MaxText's [experts, embed, mlp]: inside the decode program the transpose is
    the dot's operand layout, not a copy. Paths compare as strings."""
    if not paths:
        return params
    paths = {tuple(map(str, path)) for path in paths}

    def view(node: Any, at: tuple) -> Any:
        if not isinstance(node, dict):
            return jnp.moveaxis(node, 0, 1) if at in paths else node
        return {k: view(v, (*at, str(k))) for k, v in node.items()}

    return view(params, tuple(map(str, prefix)))
