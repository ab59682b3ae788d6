"""The pure GRPO step math on packed rows: token logprobs, per-token terms, global weights.

`grpo_token_terms` equals Tunix's `grpo_loss_fn` (tunix.rl.algo_core) for `kl_loss_mode="kl"`,
no dual clip, `loss_algo` "grpo" or "gspo-token", `epsilon_high` (clip-higher) set or not,
on-policy (old logps = stop_gradient(current)) or off-policy (old logps = the packed behaviour
logprobs); the agentic learner's loss is the same function. gspo-token's ratio is sequence-level:
exp(min(logp - sg(logp) + sg(the sequence's mean log-ratio), 10)); on-policy that mean is 0 and
the update is GRPO's, in value and gradient. Sequences are packed segments here, so the mean is
over each segment's loss-masked tokens (`segment_mean`).
Tunix's aggregation modes are linear in per-token terms, so they become fixed per-token weights
computed on the host from global counts (`loss_weights`), which makes the loss exact across hosts,
packed rows and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tunix_mcjax.train.packing import Rows


def token_logps(logits: jax.Array, targets: jax.Array, temperature: float) -> jax.Array:
    """log p(target) per position, with the rollout temperature applied as Tunix does."""
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def chunked_token_logps(hidden: jax.Array, targets: jax.Array,
                        unembed: Callable[[jax.Array], jax.Array], temperature: float, *,
                        chunk_tokens: int, rows_per_device: int) -> jax.Array:
    """`token_logps(unembed(hidden), ...)` for hidden [B, T, D], computed over sequence chunks.

    Each chunk holds every row and about `chunk_tokens / rows_per_device` positions, so a
    device's fp32 logits are at most ~`chunk_tokens` x vocab at once; the backward recomputes a
    chunk's logits instead of keeping them. `chunk_tokens <= 0`, or one chunk, is one pass.
    """
    b, t, d = hidden.shape
    width = max(1, min(t, chunk_tokens // max(rows_per_device, 1)))
    if chunk_tokens <= 0 or width >= t:
        return token_logps(unembed(hidden), targets, temperature)
    num_chunks = -(-t // width)
    pad = num_chunks * width - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))

    @jax.checkpoint
    def chunk(args):
        h, tg = args
        return token_logps(unembed(h), tg, temperature)

    hs = jnp.moveaxis(hidden.reshape(b, num_chunks, width, d), 1, 0)
    ts = jnp.moveaxis(targets.reshape(b, num_chunks, width), 1, 0)
    out = jax.lax.map(chunk, (hs, ts))  # [num_chunks, B, width]
    return jnp.moveaxis(out, 0, 1).reshape(b, num_chunks * width)[:, :t]


def segment_mean(x: jax.Array, mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """At each position of rows [B, T], the mean of `x` over the masked positions of its own
    segment (packed sequence); 0 for a segment with none."""
    num_segments = segment_ids.shape[-1] + 1  # segment ids are 0 (padding) .. T

    def row(x, mask, seg):
        total = jax.ops.segment_sum(x * mask, seg, num_segments=num_segments)
        count = jax.ops.segment_sum(mask, seg, num_segments=num_segments)
        return (total / jnp.maximum(count, 1.0))[seg]

    return jax.vmap(row)(x, mask, segment_ids)


def importance_log_ratio(logps: jax.Array, batch: dict, *, off_policy: bool,
                         loss_algo: str = "grpo") -> jax.Array:
    """Per-token log importance ratio, built as Tunix's grpo_loss_fn builds it."""
    old = batch["old_logps"] if off_policy else jax.lax.stop_gradient(logps)
    log_ratio = jnp.clip(logps - old, -20.0, 20.0)
    if loss_algo == "gspo-token":
        seq = segment_mean(log_ratio, batch["loss_mask"], batch["segment_ids"])
        log_ratio = jnp.minimum(logps - jax.lax.stop_gradient(logps)
                                + jax.lax.stop_gradient(seq), 10.0)
    return log_ratio


def grpo_token_terms(logps: jax.Array, batch: dict, ref_logps: jax.Array | None, *,
                     beta: float, epsilon: float, off_policy: bool,
                     loss_algo: str = "grpo", epsilon_high: float | None = None) -> jax.Array:
    """Per-token GRPO loss (clipped surrogate + beta * KL); the ratio is clipped to
    [1 - epsilon, 1 + epsilon_high] (None: epsilon). Masking and weights come later."""
    ratio = jnp.exp(importance_log_ratio(logps, batch, off_policy=off_policy,
                                         loss_algo=loss_algo))
    adv = batch["advantages"]
    high = epsilon if epsilon_high is None else epsilon_high
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + high))
    if ref_logps is not None and beta != 0.0:
        per_token = per_token + beta * (logps - ref_logps)
    return per_token


def upper_epsilon(grpo_epsilon: float, epsilon_high: float) -> float:
    """The upper clip of the ratio: `epsilon_high`, or `grpo_epsilon` where it is -1 (unset)."""
    return grpo_epsilon if epsilon_high == -1 else epsilon_high


def first_update_off_policy(use_agentic_rollout: bool, use_rollout_logps: bool,
                            force_on_policy_ratio: bool) -> bool:
    """Whether the first update of a batch takes its ratio against the engine's logprobs:
    Tunix's agentic learner does with use_rollout_logps, unless force_on_policy_ratio pins the
    ratio to 1; its single-turn GRPO learner never does."""
    return use_agentic_rollout and use_rollout_logps and not force_on_policy_ratio


def loss_weights(rows: Rows, mode: str, global_sequences: int, global_tokens: int) -> np.ndarray:
    """Per-token weights whose weighted sum is Tunix's aggregate over the GLOBAL batch."""
    if mode == "sequence-mean-token-mean":
        return rows.seq_weight / max(global_sequences, 1)
    if mode == "token-mean":
        return rows.loss_mask / max(global_tokens, 1)
    raise ValueError(f"loss_agg_mode={mode!r} is not supported")


def step_sums(logps: jax.Array, ref_logps: jax.Array | None, per_token: jax.Array,
              batch: dict) -> dict[str, jax.Array]:
    """The additive parts of a (micro-)batch's loss and metrics; sums over micro-batches are the
    batch's. With weights from `loss_weights`, `loss` and `kl_loss` are Tunix's aggregates;
    `kl_sum / tokens` is Tunix's logged `kl`, the token mean over completion tokens."""
    mask, weights = batch["loss_mask"], batch["weights"]
    out = {"loss": jnp.sum(per_token * weights * mask), "tokens": jnp.sum(mask)}
    kl = jnp.zeros_like(logps) if ref_logps is None else logps - ref_logps
    out["kl_loss"] = jnp.sum(kl * weights * mask)
    out["kl_sum"] = jnp.sum(kl * mask)
    return out
