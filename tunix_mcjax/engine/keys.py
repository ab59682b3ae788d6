"""Each request's sampling key. Token j of a request uses `fold_in(request_key, j)`; a request's
key is `fold_in(replica_key, i)` for request i of its replica's share, and replica r's key is
`fold_in(PRNGKey(seed), r)`. So a sample depends on its seed, replica and index only: not on
its batch, its row, when it was admitted or whether it was preempted, and a request joining a
running session (`engine.session`) keeps the key `generate` would have given it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tunix_mcjax.engine.buckets import pow2_at_least


@functools.partial(jax.jit, static_argnums=1)
def replica_keys(seed: jax.Array, replicas: int) -> jax.Array:
    """[replicas, 2]: `fold_in(PRNGKey(seed), r)` for each replica r, in one dispatch (op by op
    it costs a millisecond); with JAX's default 32-bit types PRNGKey keeps a seed modulo 2**32,
    as the caller passes it."""
    key = jax.random.PRNGKey(seed)
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(replicas, dtype=jnp.uint32))


@jax.jit
def _fold(keys: jax.Array, index: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.fold_in)(keys, index)


def request_keys(base_keys: np.ndarray, index: np.ndarray) -> np.ndarray:
    """uint32 [M, 2]: `fold_in(base_keys[m], index[m])`, in one dispatch (M padded to a power
    of two, so a run compiles this a bounded number of times)."""
    m = len(index)
    size = pow2_at_least(max(m, 1))
    keys = np.zeros((size, 2), np.uint32)
    keys[:m] = base_keys
    padded = np.zeros((size,), np.uint32)
    padded[:m] = index
    return np.asarray(_fold(keys, padded))[:m]


def generate_keys(seed: int, num_requests: int, replicas: int) -> list[np.ndarray]:
    """The keys `generate(prompts, sampling, seed)` gives its `num_requests` requests: the
    shares of `np.array_split` over `replicas`, request i of a share at index i. One array
    [share, 2] per replica."""
    shares = [len(s) for s in np.array_split(np.arange(num_requests), replicas)]
    base = np.asarray(replica_keys(np.uint32(seed % 2**32), replicas))
    replica = np.repeat(np.arange(replicas), shares)
    index = np.concatenate([np.arange(n) for n in shares])
    keys = request_keys(base[replica], index)
    return np.split(keys, np.cumsum(shares)[:-1])
