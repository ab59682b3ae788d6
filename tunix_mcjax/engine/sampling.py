"""Token sampling on device: greedy, temperature, top-k, top-p; pad is never sampled.

Logprobs are of the sampled token under the model's full distribution at the sampling
temperature, `log_softmax(logits / T)`, taken before pad masking and top-k/top-p truncation
(greedy uses T=1). That is what a trainer recomputes from the same logits, so importance ratios
start at exactly 1 for an unchanged policy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tunix_mcjax.engine.base import SamplingParams


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """The static (compile-time) part of SamplingParams; temperature and top_p stay dynamic."""

    greedy: bool
    top_k: int  # 0: off
    top_p: bool  # whether nucleus truncation runs

    @classmethod
    def of(cls, sampling: SamplingParams, vocab_size: int) -> SamplerSpec:
        if sampling.greedy:
            return cls(greedy=True, top_k=0, top_p=False)
        return cls(greedy=False, top_k=min(sampling.top_k, vocab_size), top_p=sampling.top_p < 1.0)


def sample(
    spec: SamplerSpec,
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    pad_id: int,
) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] fp32, keys [B] -> (tokens [B] int32, logprobs [B] fp32)."""
    if spec.greedy:
        scaled = logits
        tokens = jnp.argmax(logits.at[:, pad_id].set(-jnp.inf), axis=-1)
    else:
        scaled = logits / temperature
        candidates = scaled.at[:, pad_id].set(-jnp.inf)
        if spec.top_k:
            candidates, vocab_ids = jax.lax.top_k(candidates, spec.top_k)
        elif spec.top_p:
            vocab_ids = jnp.argsort(-candidates, axis=-1)
            candidates = jnp.take_along_axis(candidates, vocab_ids, axis=-1)
        else:
            vocab_ids = None
        if spec.top_p:  # candidates are sorted descending here
            probs = jax.nn.softmax(candidates, axis=-1)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            candidates = jnp.where(mass_before < top_p, candidates, -jnp.inf)
        choice = jax.vmap(jax.random.categorical)(keys, candidates)
        if vocab_ids is None:
            tokens = choice
        else:
            tokens = jnp.take_along_axis(vocab_ids, choice[:, None], axis=-1)[:, 0]
    tokens = tokens.astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)
    return tokens, logprobs[:, 0]
