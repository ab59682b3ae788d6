"""The global FSDP train step: Tunix's GRPO loss on packed rows, one optax update.

The step math is in `loss.py` (equal to Tunix's `grpo_loss_fn`; a test checks the update against
Tunix's to 1e-5). Memory: attention is blockwise over segments (`segment_attention.py`),
logprobs are scored in sequence chunks (`train_logits_chunk_tokens`), params are gathered once
or stay sharded (`fsdp_gather_params_once`, `memory.gather_params_once`), and
`train_micro_batch_size` splits the step's rows into micro-batches whose gradients accumulate
into one update. A non-finite loss or gradient norm leaves params and optimizer state exactly as
they were (`finite` = 0). Every step also reports the rollout-trainer mismatch of its logprobs
before the update, and applies the TIS/MIS corrections when they are on (`loss.Corrections`,
docs/mismatch.md).

Gathered once, a policy that runs per device (`Policy.per_device`) trains data parallel inside
`shard_map` with flat collectives (`fsdp_flat`): the step takes the full params it gathered at
the end of the previous step, reduce-scatters every gradient in one buffer, updates the shards
with the same optax transformation, and all-gathers the new shards in one buffer; those full
params feed the next step and the engine (`engine_params`), so publishing gathers nothing.

Qwen3's params are held with their decoder layers stacked (`layer_runs`; `qwen3_policy` stacks
Tunix's tree once), so params, gradients, optimizer moments and the flat buffers hold one leaf
per stacked weight and the forward scans them: the step's program does not grow with depth.
`model_params()` is Tunix's per-layer tree; the engines take the stacks (`engine_params`).

With LoRA adapters in the tree (`nnx.LoRAParam`, `lora.py`), only they train, as in Tunix's
`PeftTrainer` (`wrt=nnx.LoRAParam`): `params` and the optimizer state are the adapters', the base
is `frozen` (gathered once for the flat step, whose collectives then carry adapters only), and
the reference model is the base without adapters. `engine_params(adapters_only=True)` is what a
publish after the first moves.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tunix_mcjax import memory
from tunix_mcjax.config import Config, warmup_updates
from tunix_mcjax.train import fsdp_flat, layer_runs, packed_qwen3
from tunix_mcjax.train.loss import (
    Corrections,
    chunked_token_logps,
    first_update_off_policy,
    grpo_token_terms,
    loss_weights,
    mismatch_metrics,
    mismatch_sum_keys,
    mismatch_sums,
    step_sums,
    token_logps,
    upper_epsilon,
)

__all__ = ["BATCH_KEYS", "Policy", "Trainer", "grpo_token_terms", "loss_weights",
           "make_optimizer", "packed_attention_mask", "qwen3_policy", "token_logps"]

BATCH_KEYS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "advantages",
              "old_logps", "weights")
# With moe_router_replay: int32 [rows, T, MoE layers, k], the engine's experts per token, which
# the forward (keyword `routing`) routes with.
ROUTING_KEY = "routing"

# (model, tokens [B,T], positions [B,T], segment_ids [B,T]) -> logits [B,T,V] (fp32)
ForwardFn = Callable[[nnx.Module, jax.Array, jax.Array, jax.Array], jax.Array]
# The same, up to final-normed hidden states [B,T,D] (keyword `remat`: recompute each layer in
# the backward); and (model, hidden [...,D]) -> fp32 logits.
HiddenFn = Callable[..., jax.Array]
UnembedFn = Callable[[nnx.Module, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Policy:
    """What the trainer needs from a model family. With `hidden` and `unembed` the trainer
    scores logprobs in chunks; without them it takes `forward`'s whole logits."""

    graphdef: nnx.GraphDef
    forward: ForwardFn
    # Trainer params -> the engine's param tree (a nested dict of arrays): Tunix Qwen3's for
    # the jax engine, MaxText's own for the maxtext engine.
    to_engine_params: Callable[[nnx.State], dict]
    hidden: HiddenFn | None = None
    unembed: UnembedFn | None = None
    # The forward holds no sharding constraints of its own, so it can run on one device's rows
    # inside shard_map (the flat data-parallel step).
    per_device: bool = False
    # (graphdef, *states) -> the model the forward takes; None: `nnx.merge` (a tree the
    # graphdef describes). Qwen3's trainer params are stacked, which no nnx graphdef describes.
    merge: Callable[..., Any] | None = None
    # Trainer params -> the model's own layout (Tunix's per-layer tree); None: the same.
    per_layer: Callable[[Any], Any] | None = None

    def model(self, *states: Any) -> Any:
        return (self.merge or nnx.merge)(self.graphdef, *states)

    def to_model_layout(self, params: Any) -> Any:
        return params if self.per_layer is None else self.per_layer(params)


def packed_attention_mask(segment_ids: jax.Array) -> jax.Array:
    """Dense [B, T, T] mask: causal within a segment; padding (segment 0) attends to nothing.
    The reference that `segment_attention.segment_attention` equals, without building it."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same & causal[None] & (segment_ids[:, :, None] > 0)


@dataclasses.dataclass(frozen=True)
class StackedQwen3:
    """The trainer's Qwen3 as its forward takes it: the config and the param tree (pure arrays,
    layers stacked by `layer_runs`)."""

    config: Any
    params: dict


def _tree(model: Any) -> dict:
    if isinstance(model, StackedQwen3):
        return model.params
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _stacked_model(config: Any, graphdef: nnx.GraphDef, *states: nnx.State) -> StackedQwen3:
    del graphdef  # describes the per-layer tree; the forward reads the stacks directly
    state = states[0] if len(states) == 1 else nnx.merge_state(*states)
    return StackedQwen3(config, nnx.to_pure_dict(state))


def _qwen3_hidden(model, tokens, positions, segment_ids, *, remat: bool = False):
    return packed_qwen3.hidden_states(model.config, _tree(model), tokens, positions, segment_ids,
                                      remat=remat)


def _qwen3_unembed(model, hidden):
    return packed_qwen3.unembed(model.config, _tree(model), hidden)


def _qwen3_forward(model, tokens, positions, segment_ids):
    return _qwen3_unembed(model, _qwen3_hidden(model, tokens, positions, segment_ids))


def qwen3_policy(model: nnx.Module) -> tuple[Policy, nnx.State]:
    """A Tunix Qwen3 model as a Policy, plus its params with the layers stacked
    (`layer_runs.stack`, the trainer's layout). The engine gets the stacks as they are: the
    jax engine scans them (`layer_stack.StackedParams`), the vLLM engine unstacks them."""
    graphdef, params = nnx.split(model, nnx.Param)
    policy = Policy(graphdef, _qwen3_forward, nnx.to_pure_dict, _qwen3_hidden,
                    _qwen3_unembed, per_device=True,
                    merge=functools.partial(_stacked_model, model.config),
                    per_layer=layer_runs.unstack)
    return policy, layer_runs.stack(params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """MaxText's RL optimizer: global-norm clipping, AdamW, linear warm-up then constant."""
    warmup = warmup_updates(cfg)
    lr = optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, warmup), optax.constant_schedule(
            cfg.learning_rate)], [warmup]) if warmup else cfg.learning_rate
    chain = [optax.clip_by_global_norm(cfg.gradient_clipping_threshold)] \
        if cfg.gradient_clipping_threshold > 0 else []
    chain.append(optax.adamw(lr, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                             weight_decay=cfg.adam_weight_decay))
    return optax.chain(*chain)


def split_trainable(params: Any) -> tuple[nnx.State | None, Any]:
    """(frozen base, trained adapters) of a tree with LoRA adapters; (None, params) without."""
    if not isinstance(params, nnx.State):
        return None, params
    adapters, base = nnx.split_state(params, nnx.LoRAParam, ...)
    if not jax.tree.leaves(adapters):
        return None, params
    return base, adapters


def param_bytes_each(params: Any) -> tuple[int, int]:
    """(parameter count, bytes per parameter of the widest leaf dtype)."""
    leaves = jax.tree.leaves(params)
    return sum(x.size for x in leaves), max(x.dtype.itemsize for x in leaves)


SUM_KEYS = ("loss", "tokens", "kl_loss", "kl_sum")
# Step sums that combine by max (over micro-batches and devices), not by sum.
MAX_KEYS = ("mm_abs_max",)


class Trainer:
    """Holds the global (FSDP) params and optimizer state; one jitted update per step."""

    def __init__(self, cfg: Config, policy: Policy, params: nnx.State, mesh: jax.sharding.Mesh,
                 *, off_policy: bool = False, tx: optax.GradientTransformation | None = None):
        if policy.hidden is None and (cfg.train_logits_chunk_tokens
                                      or cfg.remat_policy != "none"):
            raise ValueError(
                f"train_logits_chunk_tokens={cfg.train_logits_chunk_tokens}, remat_policy="
                f"{cfg.remat_policy}: this policy computes whole logits with its own model; set "
                "train_logits_chunk_tokens=0 and remat_policy=none (its model's remat applies)")
        self.cfg, self.policy, self.mesh = cfg, policy, mesh
        self.tx = tx or make_optimizer(cfg)
        count, width = param_bytes_each(params)
        frozen, params = split_trainable(params)
        self.param_shardings = jax.tree.map(lambda x: x.sharding, params)
        devices = mesh.devices.size
        # Gathering every FSDP shard once per forward makes the compute plain data parallel:
        # with a per-device policy, one flat all-gather and one flat reduce-scatter per step
        # (`fsdp_flat`); otherwise one all-gather per leaf and one combined gradient reduction
        # instead of the per-op collectives XLA's partitioner inserts. It costs a full replica of
        # params and gradients per device.
        self.gather_params_once = memory.gather_params_once(
            cfg.fsdp_gather_params_once, param_count=count, bytes_per_param=width,
            num_devices=devices, device_memory_bytes=self.device_memory_bytes())
        self.flat = fsdp_flat.layout(params, mesh) \
            if self.gather_params_once and policy.per_device else None
        replicated = jax.NamedSharding(mesh, jax.P())
        self.gathered = jax.tree.map(lambda _: replicated, params)
        self.frozen_gathered = jax.tree.map(lambda _: replicated, frozen)
        # The base as the step reads it: in full on every device for the flat step (gathered
        # once here), FSDP-sharded otherwise. None: no LoRA, everything trains.
        self.frozen = frozen
        if frozen is not None and self.flat is not None:
            with jax.set_mesh(mesh):
                gather = jax.jit(lambda t: t, out_shardings=self.frozen_gathered)
                self.frozen = self._make_state(gather, self.frozen_gathered, frozen)
        # Optimizer moments shard like their params (replicated scalars otherwise), and keep
        # that sharding across updates so the step compiles once.
        self.opt_shardings = optax.tree_utils.tree_map_params(
            self.tx, lambda _, sharding: sharding, jax.eval_shape(self.tx.init, params),
            self.param_shardings, transform_non_params=lambda _: replicated)
        with jax.set_mesh(mesh):
            init = jax.jit(self.tx.init, out_shardings=self.opt_shardings)
            self.opt_state = self._make_state(init, self.opt_shardings, params)
        self.params = params
        # LoRA's reference is the base itself (no copy); see `_loss`.
        self.ref_params = self._make_state(lambda p: jax.tree.map(jnp.copy, p),
                                           self.param_shardings, params) \
            if cfg.grpo_beta and frozen is None else None
        self.micro_batches = memory.num_micro_batches(cfg.batch_size, cfg.train_micro_batch_size)
        self.corrections = Corrections.of(cfg)
        # The step's additive sums (loss, mismatch) in a fixed order; then the max ones.
        self.sum_keys = SUM_KEYS + tuple(k for k in mismatch_sum_keys(self.corrections)
                                         if k not in MAX_KEYS)
        self.batch_sharding = jax.NamedSharding(mesh, jax.P(None, "fsdp"))
        self._step = jax.jit(self._update, static_argnames=("off_policy",), donate_argnums=(0, 1))
        if self.flat is not None:
            self._flat_step = jax.jit(self._flat_update, static_argnames=("off_policy",),
                                      donate_argnums=(0, 1))
            self._gather = jax.jit(self._all_gather, out_shardings=self.gathered)
        # Agentic runs with use_rollout_logps: every update against the engine's logprobs.
        self.off_policy = off_policy or first_update_off_policy(
            cfg.use_agentic_rollout, cfg.use_rollout_logps, cfg.force_on_policy_ratio)

    def device_memory_bytes(self) -> int:
        """One device's memory, which decides gather-once under `fsdp_gather_params_once=auto`."""
        local = self.mesh.local_devices
        return memory.device_memory_bytes(local[0], len(local))

    def _make_state(self, fn: Callable, shardings: Any, *args: Any) -> Any:
        """`fn(*args)`: state the trainer builds, laid out as `shardings` (an abstract trainer,
        `tunix_mcjax.aot`, keeps only its shapes)."""
        return fn(*args)

    # Full params of the flat step: computed from `params` when it is set (start, restore),
    # then the step's own output.
    @property
    def params(self) -> nnx.State:
        return self._params

    @params.setter
    def params(self, value: nnx.State) -> None:
        self._params, self._full = value, None

    @property
    def ref_params(self) -> nnx.State | None:
        return self._ref_params

    @ref_params.setter
    def ref_params(self, value: nnx.State | None) -> None:
        self._ref_params, self._ref_full = value, None

    def full_params(self) -> nnx.State:
        """The params gathered in full on every device (flat step only)."""
        if self._full is None:
            with jax.set_mesh(self.mesh):
                self._full = self._gather(self._params)
        return self._full

    def _ref_full_params(self) -> nnx.State | None:
        if self._ref_params is not None and self._ref_full is None:
            with jax.set_mesh(self.mesh):
                self._ref_full = self._gather(self._ref_params)
        return self._ref_full

    def _logps(self, params, frozen, batch, row_shards: int):
        """Token logprobs of `batch` under `params` (plus the `frozen` base, with LoRA); its
        rows are split over `row_shards` devices."""
        cfg, policy = self.cfg, self.policy
        if self.gather_params_once and self.flat is None:
            params = jax.lax.with_sharding_constraint(params, self.gathered)
            if frozen is not None:
                frozen = jax.lax.with_sharding_constraint(frozen, self.frozen_gathered)
        model = policy.model(params) if frozen is None else policy.model(frozen, params)
        args = (batch["tokens"], batch["positions"], batch["segment_ids"])
        temperature = cfg.decode_sampling_temperature
        if policy.hidden is None:
            routed = {"routing": batch[ROUTING_KEY]} if ROUTING_KEY in batch else {}
            return token_logps(policy.forward(model, *args, **routed), batch["targets"],
                               temperature)
        return chunked_token_logps(
            policy.hidden(model, *args, remat=cfg.remat_policy == "full"), batch["targets"],
            functools.partial(policy.unembed, model), temperature,
            chunk_tokens=cfg.train_logits_chunk_tokens,
            rows_per_device=batch["tokens"].shape[0] // row_shards)

    def _loss(self, params, ref_params, batch, off_policy, row_shards, frozen=None):
        logps = self._logps(params, frozen, batch, row_shards)
        ref_logps = None
        if ref_params is not None:
            ref_logps = jax.lax.stop_gradient(self._logps(ref_params, None, batch, row_shards))
        elif frozen is not None and self.cfg.grpo_beta:
            # LoRA: Tunix's reference model is the base; zero adapters add exactly nothing.
            no_adapters = jax.tree.map(jnp.zeros_like, params)
            ref_logps = jax.lax.stop_gradient(self._logps(no_adapters, frozen, batch,
                                                          row_shards))
        cfg = self.cfg
        per_token = grpo_token_terms(
            logps, batch, ref_logps, beta=cfg.grpo_beta, epsilon=cfg.grpo_epsilon,
            off_policy=off_policy, loss_algo=cfg.loss_algo,
            epsilon_high=upper_epsilon(cfg.grpo_epsilon, cfg.epsilon_high),
            corrections=self.corrections)
        sums = step_sums(logps, ref_logps, per_token, batch)
        sums.update(mismatch_sums(logps, batch, self.corrections))
        return sums["loss"], sums

    def _grads(self, params, ref_params, batch, off_policy, *, row_shards: int,
               grad_shardings: Any = None, frozen: Any = None):
        """(sums, grads of `params`) over the step's micro-batches (leading axis of every
        batch array); with `grad_shardings`, each micro-batch's gradient is reduced to them."""
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        if batch["tokens"].shape[0] == 1:
            (_, sums), grads = grad_fn(params, ref_params, jax.tree.map(lambda x: x[0], batch),
                                       off_policy, row_shards, frozen)
            return sums, grads

        def micro(acc, mb):
            (_, sums), grads = grad_fn(params, ref_params, mb, off_policy, row_shards, frozen)
            if grad_shardings is not None:
                grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            acc_sums, acc_grads = acc
            sums = {k: (jnp.maximum if k in MAX_KEYS else jnp.add)(acc_sums[k], v)
                    for k, v in sums.items()}
            return (sums, jax.tree.map(jnp.add, acc_grads, grads)), None

        zero_sums = {k: jnp.zeros((), jnp.float32) for k in self.sum_keys + MAX_KEYS}
        zero_grads = jax.tree.map(jnp.zeros_like, params)
        (sums, grads), _ = jax.lax.scan(micro, (zero_sums, zero_grads), batch)
        return sums, grads

    def _apply(self, params, opt_state, grads, sums):
        """The optax update, kept only where loss and gradient norm are finite."""
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)

        def keep_if_not_finite(new, old):
            return jnp.where(finite, new, old)

        params = jax.tree.map(keep_if_not_finite, new_params, params)
        opt_state = jax.tree.map(keep_if_not_finite, new_opt_state, opt_state)
        params = jax.lax.with_sharding_constraint(params, self.param_shardings)
        opt_state = jax.lax.with_sharding_constraint(opt_state, self.opt_shardings)
        metrics = {"loss": sums["loss"], "grad_norm": grad_norm,
                   "kl": sums["kl_sum"] / jnp.maximum(sums["tokens"], 1.0),
                   "kl_loss": sums["kl_loss"], "finite": finite.astype(jnp.float32),
                   **mismatch_metrics(sums, sums["tokens"])}
        return params, opt_state, metrics

    def _update(self, params, opt_state, ref_params, batch, off_policy, frozen=None):
        sums, grads = self._grads(params, ref_params, batch, off_policy,
                                  row_shards=self.mesh.shape["fsdp"],
                                  grad_shardings=self.param_shardings, frozen=frozen)
        return self._apply(params, opt_state, grads, sums)

    def _all_gather(self, params):
        return jax.shard_map(functools.partial(fsdp_flat.all_gather, self.flat), mesh=self.mesh,
                             in_specs=(fsdp_flat.specs(self.flat),), out_specs=jax.P(),
                             check_vma=False)(params)

    def _flat_update(self, params, opt_state, full, ref_full, batch, off_policy, frozen=None):
        """Data parallel on full params: one reduce-scatter of every gradient and the loss
        sums, the update on shards, one all-gather of the new shards (the next step's `full`).
        With LoRA, `frozen` is the base in full; the collectives carry the adapters only."""
        def local_grads(full, ref_full, batch, frozen):
            sums, grads = self._grads(full, ref_full, batch, off_policy, row_shards=1,
                                      frozen=frozen)
            # Each device's max rides the same reduce-scatter as the sums, in its own slot
            # (zeros elsewhere: summing is exact), so the step keeps its three collectives.
            slot = jax.nn.one_hot(jax.lax.axis_index(self.flat.axis), self.flat.size)
            scalars = jnp.concatenate([jnp.stack([sums[k] for k in self.sum_keys]),
                                       *[slot * sums[k] for k in MAX_KEYS]])
            shards, summed = fsdp_flat.reduce_scatter(self.flat, grads, scalars)
            n = len(self.sum_keys)
            maxed = {k: jnp.max(summed[n + i * self.flat.size:n + (i + 1) * self.flat.size])
                     for i, k in enumerate(MAX_KEYS)}
            return shards, dict(zip(self.sum_keys, summed[:n], strict=True)) | maxed

        grads, sums = jax.shard_map(
            local_grads, mesh=self.mesh,
            in_specs=(jax.P(), jax.P(), jax.P(None, "fsdp"), jax.P()),
            out_specs=(fsdp_flat.specs(self.flat), jax.P()), check_vma=False)(
                full, ref_full, batch, frozen)
        params, opt_state, metrics = self._apply(params, opt_state, grads, sums)
        return params, opt_state, self._all_gather(params), metrics

    def micro_batch_layout(self, local_rows: int) -> tuple[int, int]:
        """(micro-batches, rows per device in each) for this host's `local_rows` packed rows."""
        local_devices = len(self.mesh.local_devices)
        if local_rows % local_devices:
            raise ValueError(f"{local_rows} local rows do not divide over {local_devices} local "
                             "devices; pad them to K rows per device (packing.pad_rows)")
        return memory.micro_batch_rows(local_rows // local_devices, self.micro_batches)

    def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Global arrays [micro-batches, rows, T], rows sharded over fsdp, from every host's
        equally sized local rows. Device d's K rows are split into consecutive micro-batches
        (empty rows pad K to a multiple), so each micro-batch has the same rows on every device.
        A host's rows go to its devices wherever they sit along fsdp: MaxText's TPU meshes
        interleave hosts (rows are independent, and every sum of the step is global)."""
        devices = self.mesh.local_devices
        n, per = self.micro_batch_layout(local["tokens"].shape[0])
        out = {}
        for key in (*BATCH_KEYS, *([ROUTING_KEY] if ROUTING_KEY in local else [])):
            x = local[key]
            x = x.reshape(len(devices), -1, *x.shape[1:])
            if n * per > x.shape[1]:
                x = np.concatenate([x, np.zeros((len(devices), n * per - x.shape[1],
                                                 *x.shape[2:]), x.dtype)], axis=1)
            x = x.reshape(len(devices), n, per, *x.shape[2:])
            shape = (n, len(devices) * per * jax.process_count(), *x.shape[3:])
            shards = [jax.device_put(rows, device) for rows, device in zip(x, devices, strict=True)]
            out[key] = jax.make_array_from_single_device_arrays(shape, self.batch_sharding, shards)
        return out

    def lower(self, batch: dict[str, jax.Array]) -> jax.stages.Lowered:
        """The train step this trainer runs, lowered for `batch` (no run)."""
        with jax.set_mesh(self.mesh):
            if self.flat is None:
                return self._step.lower(self.params, self.opt_state, self.ref_params, batch,
                                        off_policy=self.off_policy, frozen=self.frozen)
            return self._flat_step.lower(self.params, self.opt_state, self.full_params(),
                                         self._ref_full_params(), batch,
                                         off_policy=self.off_policy, frozen=self.frozen)

    def step(self, local: dict[str, np.ndarray], off_policy: bool | None = None
             ) -> dict[str, float]:
        """One update; `loss`, `grad_norm`, `kl` (token mean), `kl_loss`, `finite` (0: skipped),
        and the rollout-trainer mismatch before it (`mismatch_*`, `loss.mismatch_metrics`).
        `off_policy`: the ratio against `old_logps` (None: as the trainer was built)."""
        off_policy = self.off_policy if off_policy is None else off_policy
        batch = self.global_batch(local)
        with jax.set_mesh(self.mesh):
            if self.flat is None:
                self.params, self.opt_state, metrics = self._step(
                    self.params, self.opt_state, self.ref_params, batch,
                    off_policy=off_policy, frozen=self.frozen)
            else:
                full, ref_full = self.full_params(), self._ref_full_params()
                self._params, self.opt_state, self._full, metrics = self._flat_step(
                    self._params, self.opt_state, full, ref_full, batch,
                    off_policy=off_policy, frozen=self.frozen)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    @property
    def compile_count(self) -> int:
        return (self._step if self.flat is None else self._flat_step)._cache_size()

    @property
    def engine_params_gathered(self) -> bool:
        """Whether `engine_params()` is already in full on every device (nothing to gather)."""
        return self.flat is not None

    @property
    def lora(self) -> bool:
        """Whether only LoRA adapters train (the base is frozen)."""
        return self.frozen is not None

    def model_params(self) -> Any:
        """The trained params in the model's own layout (Tunix's per-layer tree for Qwen3)."""
        return self.policy.to_model_layout(self.params)

    def engine_params(self, adapters_only: bool = False) -> Any:
        """The engine's param tree; with the flat step, built from its gathered full params.
        `adapters_only` (LoRA): just the adapters, for an engine that holds the base already."""
        trained = self.params if self.flat is None else self.full_params()
        if self.frozen is None or adapters_only:
            return self.policy.to_engine_params(trained)
        return self.policy.to_engine_params(nnx.merge_state(self.frozen, trained))
