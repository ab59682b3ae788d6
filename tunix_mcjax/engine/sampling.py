"""Token sampling on device: greedy, temperature, top-k, top-p, with one id masked out.

The masked id is pad when pad is not a stop id (a char tokenizer's `<pad>`); when pad is one of
the model's EOS ids (Qwen3's `<|endoftext|>`) nothing is masked, so a base model can stop.

Logprobs are of the sampled token under the model's full distribution at the sampling
temperature, `log_softmax(logits / T)`, taken before masking and top-k/top-p truncation
(greedy uses T=1). That is what a trainer recomputes from the same logits, so importance ratios
start at exactly 1 for an unchanged policy.

Draws use inverse-CDF sampling: one uniform per row against the fp32 cumulative distribution.
That is exact up to the rounding of the cumulative sum and needs B random numbers per step
instead of the B x V Gumbel draws of `jax.random.categorical` (most of a CPU step's sampling).
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


def inverse_cdf(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """Per row, the first index whose cumulative probability exceeds a uniform draw.

    Zero-probability entries (-inf logits) are never chosen: the cumulative sum does not rise
    at them. A draw that rounding puts at the very top takes the last entry with mass.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    threshold = jax.vmap(jax.random.uniform)(keys) * cdf[:, -1]
    index = jnp.sum(cdf <= threshold[:, None], axis=-1)
    last_with_mass = logits.shape[-1] - 1 - jnp.argmax(probs[:, ::-1] > 0, axis=-1)
    return jnp.minimum(index, last_with_mass)


def sample(
    spec: SamplerSpec,
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    masked_id: int | None,
) -> tuple[jax.Array, jax.Array]:
    """logits [B, V] fp32, keys [B] -> (tokens [B] int32, logprobs [B] fp32). `masked_id`
    (None: none) is never sampled."""

    def masked(x: jax.Array) -> jax.Array:
        return x if masked_id is None else x.at[:, masked_id].set(-jnp.inf)

    if spec.greedy:
        scaled = logits
        tokens = jnp.argmax(masked(logits), axis=-1)
    else:
        scaled = logits / temperature
        candidates = masked(scaled)
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
        choice = inverse_cdf(keys, candidates)
        if vocab_ids is None:
            tokens = choice
        else:
            tokens = jnp.take_along_axis(vocab_ids, choice[:, None], axis=-1)[:, 0]
    tokens = tokens.astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)
    return tokens, logprobs[:, 0]
