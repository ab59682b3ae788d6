"""The global FSDP train step: Tunix's GRPO loss on packed rows, one optax update.

`grpo_token_terms` is the pure step math. It equals Tunix's `grpo_loss_fn` (tunix.rl.algo_core)
for `kl_loss_mode="kl"`, no dual clip, one iteration per batch (old logps =
stop_gradient(current)); a test checks the update against Tunix's to 1e-5. On-policy, Tunix's
`loss_algo="gspo-token"` is the same update as "grpo": each token's ratio is
exp(logp - sg(logp) + sg(sequence mean of log-ratios = 0)), GRPO's exactly, in value and
gradient; the same test checks it. Off-policy they differ, so that combination is refused.
Tunix's aggregation modes are linear in per-token terms, so they become fixed per-token weights
computed on the host from global counts (`loss_weights`), which makes the loss exact across hosts
and packed rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tunix_mcjax.config import Config
from tunix_mcjax.packing import Rows

BATCH_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "advantages",
              "old_logps", "weights")

# (model, tokens [B,T], positions [B,T], segment_ids [B,T]) -> logits [B,T,V] (fp32)
ForwardFn = Callable[[nnx.Module, jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Policy:
    """What the trainer needs from a model family."""

    graphdef: nnx.GraphDef
    forward: ForwardFn
    # Trainer params -> the engine's Tunix-Qwen3 param tree (a nested dict of arrays).
    to_engine_params: Callable[[nnx.State], dict]


def packed_attention_mask(segment_ids: jax.Array) -> jax.Array:
    """Causal attention within a segment only; padding (segment 0) attends to nothing."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same & causal[None] & (segment_ids[:, :, None] > 0)


def qwen3_forward(model: nnx.Module, tokens, positions, segment_ids) -> jax.Array:
    logits, _ = model(tokens, positions, None, packed_attention_mask(segment_ids))
    return logits


def qwen3_policy(model: nnx.Module) -> tuple[Policy, nnx.State]:
    """A Tunix Qwen3 model as a Policy, plus its params. The engine runs the same tree."""
    graphdef, params = nnx.split(model, nnx.Param)
    return Policy(graphdef, qwen3_forward, nnx.to_pure_dict), params


def token_logps(logits: jax.Array, targets: jax.Array, temperature: float) -> jax.Array:
    """log p(target) per position, with the rollout temperature applied as Tunix does."""
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def grpo_token_terms(logps: jax.Array, batch: dict, ref_logps: jax.Array | None, *,
                     beta: float, epsilon: float, off_policy: bool) -> jax.Array:
    """Per-token GRPO loss (clipped surrogate + beta * KL). Masking and weights come later."""
    old = batch["old_logps"] if off_policy else jax.lax.stop_gradient(logps)
    ratio = jnp.exp(jnp.clip(logps - old, -20.0, 20.0))
    adv = batch["advantages"]
    per_token = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - epsilon, 1 + epsilon))
    if ref_logps is not None and beta != 0.0:
        per_token = per_token + beta * (logps - ref_logps)
    return per_token


def loss_weights(rows: Rows, mode: str, global_sequences: int, global_tokens: int) -> np.ndarray:
    """Per-token weights whose weighted sum is Tunix's aggregate over the GLOBAL batch."""
    if mode == "sequence-mean-token-mean":
        return rows.seq_weight / max(global_sequences, 1)
    if mode == "token-mean":
        return rows.loss_mask / max(global_tokens, 1)
    raise ValueError(f"loss_agg_mode={mode!r} is not supported")


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """MaxText's RL optimizer: global-norm clipping, AdamW, linear warm-up then constant."""
    warmup = int(cfg.warmup_steps_fraction * cfg.steps)
    lr = optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, warmup), optax.constant_schedule(
            cfg.learning_rate)], [warmup]) if warmup else cfg.learning_rate
    chain = [optax.clip_by_global_norm(cfg.gradient_clipping_threshold)] \
        if cfg.gradient_clipping_threshold > 0 else []
    chain.append(optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                             weight_decay=cfg.adam_weight_decay))
    return optax.chain(*chain)


class Trainer:
    """Holds the global (FSDP) params and optimizer state; one jitted update per step."""

    def __init__(self, cfg: Config, policy: Policy, params: nnx.State, mesh: jax.sharding.Mesh,
                 *, off_policy: bool = False, tx: optax.GradientTransformation | None = None):
        if off_policy and cfg.loss_algo != "grpo":
            raise ValueError(f"loss_algo={cfg.loss_algo} is only implemented on-policy (old logps "
                             "= stop_gradient(current)), where it equals grpo")
        self.cfg, self.policy, self.mesh = cfg, policy, mesh
        self.tx = tx or make_optimizer(cfg)
        self.params = params
        self.param_shardings = jax.tree.map(lambda x: x.sharding, params)
        # Gathering every FSDP shard once per step makes the compute plain data parallel: one
        # all-gather per leaf and one combined gradient all-reduce, instead of the per-op
        # activation collectives XLA's partitioner otherwise inserts (~70 -> 16 on Qwen3-tiny).
        replicated = jax.NamedSharding(mesh, jax.P())
        self.gathered = jax.tree.map(lambda _: replicated, params)
        # Optimizer moments shard like their params (replicated scalars otherwise), and keep
        # that sharding across updates so the step compiles once.
        self.opt_shardings = optax.tree_utils.tree_map_params(
            self.tx, lambda _, sharding: sharding, jax.eval_shape(self.tx.init, params),
            self.param_shardings, transform_non_params=lambda _: replicated)
        with jax.set_mesh(mesh):
            self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        self.ref_params = jax.tree.map(jnp.copy, params) if cfg.grpo_beta else None
        self.row_sharding = jax.NamedSharding(mesh, jax.P("fsdp"))
        self._step = jax.jit(self._update, static_argnames=("off_policy",), donate_argnums=(0, 1))
        self.off_policy = off_policy

    def _loss(self, params, ref_params, batch, off_policy):
        cfg = self.cfg
        if cfg.fsdp_gather_params_once:
            params = jax.lax.with_sharding_constraint(params, self.gathered)
        fwd = self.policy.forward
        args = (batch["tokens"], batch["positions"], batch["segment_ids"])
        logits = fwd(nnx.merge(self.policy.graphdef, params), *args)
        logps = token_logps(logits, batch["targets"], cfg.decode_sampling_temperature)
        ref_logps = None
        if ref_params is not None:
            ref_logits = fwd(nnx.merge(self.policy.graphdef, ref_params), *args)
            ref_logps = jax.lax.stop_gradient(
                token_logps(ref_logits, batch["targets"], cfg.decode_sampling_temperature))
        per_token = grpo_token_terms(logps, batch, ref_logps, beta=cfg.grpo_beta,
                                     epsilon=cfg.grpo_epsilon, off_policy=off_policy)
        loss = jnp.sum(per_token * batch["weights"] * batch["loss_mask"])
        kl = 0.0 if ref_logps is None else jnp.sum(
            (logps - ref_logps) * batch["weights"] * batch["loss_mask"])
        return loss, {"kl": kl}

    def _update(self, params, opt_state, ref_params, batch, off_policy):
        (loss, aux), grads = jax.value_and_grad(self._loss, has_aux=True)(
            params, ref_params, batch, off_policy)
        grad_norm = optax.global_norm(grads)
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # A non-finite loss or gradient is never applied: params and optimizer state stay.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_params, params)
        opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_opt_state, opt_state)
        params = jax.lax.with_sharding_constraint(params, self.param_shardings)
        opt_state = jax.lax.with_sharding_constraint(opt_state, self.opt_shardings)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm,
                                   "finite": finite.astype(jnp.float32), **aux}

    def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global row-sharded arrays from every host's equally sized local rows."""
        n_hosts = jax.process_count()
        out = {}
        for key in BATCH_KEYS:
            x = local[key]
            shape = (x.shape[0] * n_hosts, *x.shape[1:])
            out[key] = jax.make_array_from_process_local_data(self.row_sharding, x, shape)
        return out

    def step(self, local: dict[str, np.ndarray]) -> dict[str, float]:
        batch = self.global_batch(local)
        with jax.set_mesh(self.mesh):
            self.params, self.opt_state, metrics = self._step(
                self.params, self.opt_state, self.ref_params, batch, off_policy=self.off_policy)
        return {k: float(v) for k, v in metrics.items()}

    @property
    def compile_count(self) -> int:
        return self._step._cache_size()

    def engine_params(self) -> Any:
        return self.policy.to_engine_params(self.params)
