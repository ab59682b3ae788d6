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

The rollout-trainer mismatch (`mismatch_sums`) and its corrections (`Corrections`: TIS and MIS,
token or sequence level; docs/mismatch.md) compare the trainer's logprobs, before the update,
with the engine's behaviour logprobs that the rows carry (`old_logps`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

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


def segment_totals(x: jax.Array, mask: jax.Array, segment_ids: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """At each position of rows [B, T], (the sum of `x`, the count) over the masked positions of
    its own segment (packed sequence)."""
    num_segments = segment_ids.shape[-1] + 1  # segment ids are 0 (padding) .. T

    def row(x, mask, seg):
        total = jax.ops.segment_sum(x * mask, seg, num_segments=num_segments)
        count = jax.ops.segment_sum(mask, seg, num_segments=num_segments)
        return total[seg], count[seg]

    return jax.vmap(row)(x, mask, segment_ids)


def segment_mean(x: jax.Array, mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """At each position of rows [B, T], the mean of `x` over the masked positions of its own
    segment (packed sequence); 0 for a segment with none."""
    total, count = segment_totals(x, mask, segment_ids)
    return total / jnp.maximum(count, 1.0)


def num_sequences(mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Segments of rows [B, T] with at least one masked position (padding has none)."""
    num_segments = segment_ids.shape[-1] + 1

    def row(mask, seg):
        count = jax.ops.segment_sum(mask, seg, num_segments=num_segments)
        return jnp.sum((count > 0).astype(jnp.float32))

    return jnp.sum(jax.vmap(row)(mask, segment_ids))


Level = Literal["none", "token", "sequence"]


@dataclasses.dataclass(frozen=True)
class Corrections:
    """The rollout-trainer corrections of the policy term: TIS (`sampler_is`, Tunix main's
    keys; "sequence" is verl's rollout_is level) and MIS (`rollout_rs`, verl's keys)."""

    sampler_is: Level = "none"
    sampler_is_threshold: float = 2.0
    rollout_rs: Level = "none"
    rollout_rs_lower: float = 0.5
    rollout_rs_upper: float = 2.0

    @classmethod
    def of(cls, cfg) -> Corrections:
        upper = cfg.rollout_rs_threshold
        lower = 1.0 / upper if cfg.rollout_rs_threshold_lower == -1 \
            else cfg.rollout_rs_threshold_lower
        return cls(cfg.sampler_is, cfg.sampler_is_threshold, cfg.rollout_rs, lower, upper)

    @property
    def active(self) -> bool:
        return self.sampler_is != "none" or self.rollout_rs != "none"


def mismatch_log_ratio(logps: jax.Array, batch: dict) -> jax.Array:
    """log p_trainer - log p_rollout per token, detached, clipped to [-20, 20] as Tunix clips
    its ratios; 0 off the loss mask."""
    delta = jax.lax.stop_gradient(logps) - batch["old_logps"]
    return jnp.clip(delta, -20.0, 20.0) * batch["loss_mask"]


def correction_weights(logps: jax.Array, batch: dict, corr: Corrections) -> jax.Array:
    """Per-token detached weight of the policy term: the TIS weight min(ratio, threshold)
    times the MIS mask 1[lower <= ratio <= upper], the ratio p_trainer / p_rollout of the
    token or of its whole sequence (the product over its loss-masked tokens)."""
    token = mismatch_log_ratio(logps, batch)
    mask, seg = batch["loss_mask"], batch["segment_ids"]
    sequence = jnp.clip(segment_totals(token, mask, seg)[0], -20.0, 20.0)
    weights = jnp.ones_like(token)
    if corr.sampler_is != "none":
        log_ratio = token if corr.sampler_is == "token" else sequence
        weights = jnp.minimum(jnp.exp(log_ratio), corr.sampler_is_threshold)
    if corr.rollout_rs != "none":
        ratio = jnp.exp(token if corr.rollout_rs == "token" else sequence)
        weights = weights * ((ratio >= corr.rollout_rs_lower)
                             & (ratio <= corr.rollout_rs_upper)).astype(weights.dtype)
    return weights


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
                     loss_algo: str = "grpo", epsilon_high: float | None = None,
                     corrections: Corrections | None = None) -> jax.Array:
    """Per-token GRPO loss (clipped surrogate + beta * KL); the ratio is clipped to
    [1 - epsilon, 1 + epsilon_high] (None: epsilon). Masking and weights come later.

    With `corrections` active, the ratio is taken against the trainer's own logprobs before the
    update (Tunix's sampler_is: old = stop_gradient(current)) and the surrogate is weighted by
    `correction_weights`, which carry the whole p_trainer / p_rollout ratio (DA's staleness
    included): the two ratios multiply, neither is applied twice."""
    on = corrections is not None and corrections.active
    ratio = jnp.exp(importance_log_ratio(logps, batch, off_policy=off_policy and not on,
                                         loss_algo=loss_algo))
    adv = batch["advantages"]
    high = epsilon if epsilon_high is None else epsilon_high
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + high))
    if on:
        per_token = per_token * correction_weights(logps, batch, corrections)
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


def mismatch_sum_keys(corrections: Corrections | None) -> tuple[str, ...]:
    """The keys of `mismatch_sums` under `corrections`."""
    keys = ("mm_abs_sum", "mm_abs_max", "mm_log_ratio_sum", "mm_k3_sum", "mm_out_sum",
            "mm_sequences")
    if corrections is not None and corrections.sampler_is != "none":
        keys += ("is_weight_sum",)
    if corrections is not None and corrections.rollout_rs != "none":
        keys += ("rs_rejected_sum",)
    return keys


def mismatch_sums(logps: jax.Array, batch: dict, corrections: Corrections | None = None
                  ) -> dict[str, jax.Array]:
    """The additive parts of the rollout-trainer mismatch over a (micro-)batch's loss-masked
    tokens, r = log p_trainer - log p_rollout (detached): sum |r|, max |r| (`mm_abs_max`, which
    combines by max), sum r, the k3 sum of exp(r) - 1 - r (estimates KL(rollout || trainer)),
    tokens whose ratio leaves [0.5, 2], and the sequences; with active `corrections`, the sums
    of the TIS weight and of the MIS rejections over the same tokens."""
    mask = batch["loss_mask"]
    r = mismatch_log_ratio(logps, batch)
    abs_r = jnp.abs(r)
    out = {"mm_abs_sum": jnp.sum(abs_r), "mm_abs_max": jnp.max(abs_r),
           "mm_log_ratio_sum": jnp.sum(r),
           "mm_k3_sum": jnp.sum((jnp.exp(r) - 1.0 - r) * mask),
           "mm_out_sum": jnp.sum((abs_r > jnp.log(2.0)) * mask),
           "mm_sequences": num_sequences(mask, batch["segment_ids"])}
    if corrections is not None and corrections.sampler_is != "none":
        only_is = dataclasses.replace(corrections, rollout_rs="none")
        out["is_weight_sum"] = jnp.sum(correction_weights(logps, batch, only_is) * mask)
    if corrections is not None and corrections.rollout_rs != "none":
        only_rs = dataclasses.replace(corrections, sampler_is="none")
        out["rs_rejected_sum"] = jnp.sum((1.0 - correction_weights(logps, batch, only_rs))
                                         * mask)
    return out


def mismatch_metrics(sums: dict[str, jax.Array], tokens: jax.Array) -> dict[str, jax.Array]:
    """The step's mismatch metrics from its global `mismatch_sums` and loss-masked tokens."""
    per_token = jnp.maximum(tokens, 1.0)
    out = {"mismatch_abs_mean": sums["mm_abs_sum"] / per_token,
           "mismatch_abs_max": sums["mm_abs_max"],
           "mismatch_seq_log_ratio": sums["mm_log_ratio_sum"]
           / jnp.maximum(sums["mm_sequences"], 1.0),
           "mismatch_k3": sums["mm_k3_sum"] / per_token,
           "mismatch_out_frac": sums["mm_out_sum"] / per_token}
    if "is_weight_sum" in sums:
        out["sampler_is_weight_mean"] = sums["is_weight_sum"] / per_token
    if "rs_rejected_sum" in sums:
        out["rollout_rs_rejected_frac"] = sums["rs_rejected_sum"] / per_token
    return out
