"""Masked scatters: index updates that leave an entry alone where a mask is False (the index
is sent past the end of the array, where a `mode="drop"` update writes nothing)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def set_where(array: jax.Array, index: jax.Array, value: Any, where: jax.Array,
              column: jax.Array | None = None) -> jax.Array:
    """`array` with `array[index[i]]` (at `column[i]` when given) set to `value[i]` where
    `where[i]`; entries elsewhere are unchanged."""
    rows = jnp.where(where, index, array.shape[0])  # past the end: dropped
    at = array.at[rows] if column is None else array.at[rows, column]
    return at.set(value, mode="drop")


def add_where(array: jax.Array, index: jax.Array, value: Any, where: jax.Array) -> jax.Array:
    """`array` with `value[i]` added to `array[index[i]]` where `where[i]`."""
    return array.at[jnp.where(where, index, array.shape[0])].add(value, mode="drop")
