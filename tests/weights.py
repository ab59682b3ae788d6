"""Test weights: a model's params with random noise of some scale added."""

from __future__ import annotations

import jax
from flax import nnx


def perturbed(params: nnx.State, seed: int, scale: float = 0.5) -> nnx.State:
    """Random weights of some scale everywhere (MaxText's init gives near-constant argmaxes
    and unit norm scales, which would hide a wrong cache or a skipped norm); scale 0: as
    initialized."""
    key = jax.random.key(seed)
    for i, (_, var) in enumerate(nnx.to_flat_state(params)):
        value = var.get_value()
        noise = jax.random.normal(jax.random.fold_in(key, i), value.shape, value.dtype)
        var.set_value(value + scale * noise)
    return params
