"""The two kinds of actor of the disaggregated mode, each one JAX process of its own, each
running the shared phases (`runtime.phases`) of its side of the step.

- `RolloutWorker`: one rollout host. Its own engine on its own devices (no jax.distributed);
  `RolloutPhases.rollout` (admit, generate, score) on its share of the step's prompts, with the
  policy version it last loaded, which the `Rollout` carries.
- `TrainerWorker`: one trainer host, one process of the trainers' jax.distributed group:
  `phases.pack` (rows per device agreed in the trainers' exchange) and `TrainPhase` (the
  colocated mode's FSDP update, off-policy against the engine's behaviour logprobs), then the
  publish: the leader `ray.put`s one host copy of the new weights, once per version; every
  rollout actor fetches that one object. The copy is the jax engine's form (`publish_form`): in
  its weight dtype where narrower, and under `quantization` the projections quantized, half of
  bf16's bytes. With LoRA only the
  first publish is the whole tree; later ones are the adapters, and a rollout actor without
  the base (a restarted one) fetches the first object too. An update skipped as non-finite
  changed nothing, so it publishes nothing: the version and its object stay the last
  published ones.
"""

from __future__ import annotations

import gc
import os
import pickle
import time
from typing import Any

import jax
import numpy as np
import ray
from jax.sharding import NamedSharding, PartitionSpec

from tunix_mcjax import metrics, models, topology
from tunix_mcjax.config import Config
from tunix_mcjax.engine import quantize
from tunix_mcjax.publish import nest, tree_bytes
from tunix_mcjax.runtime import components, evaluation, in_flight, phases, recovery
from tunix_mcjax.runtime.loop import freeze_gc
from tunix_mcjax.runtime.records import HostRecord, Rollout
from tunix_mcjax.runtime.stepmath import LengthHistory
from tunix_mcjax.tasks import load_task
from tunix_mcjax.tokenizer import load_tokenizer
from tunix_mcjax.train.trainer import Trainer


def node_id() -> str:
    """The Ray node this actor runs on."""
    return ray.get_runtime_context().get_node_id()


def host_copy(tree: Any, quantization: str = "", engine_dtype: Any = None) -> Any:
    """Host copies of a tree of arrays replicated over this process's devices, as a publish
    puts them: numpy as they are, or (`engine_dtype` given) in the engine's form: cast to its
    weight dtype, each projection a QArray of numpy values and scales under `quantization`,
    quantized as the engine would (`quantize.host_leaf`)."""
    def one(keys: tuple, x: jax.Array) -> Any:
        local = next(s.data for s in x.addressable_shards if s.data.shape == x.shape)
        path = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)
        return quantize.host_leaf(path, local, quantization, engine_dtype)
    return jax.tree_util.tree_map_with_path(one, tree)


def publish_form(cfg: Config) -> tuple[str, Any]:
    """(quantization, engine weight dtype) of a publish in the jax engine's form: its weight
    dtype where that is narrower (a float32 trainer's bf16 engine takes half the bytes), and
    under `quantization` its projections quantized (int8/fp8 values and a float32 scale an
    output channel: about half of bf16's bytes). ("", None) otherwise (other engines, and LoRA's
    adapters unquantized): the tree as the trainer holds it, cast by the engine as it loads."""
    if cfg.rollout_engine != "jax" or (cfg.lora_rank and not cfg.quantization):
        return "", None
    return cfg.quantization, models.model_config(cfg, 0, for_sampling=True).param_dtype


class RolloutWorker:
    """One rollout host: the rollout phases on its own engine, up to off_policy_steps stale;
    its calls run in the order the driver queued them."""

    def __init__(self, cfg: Config, index: int, num_rollouts: int):
        self.cfg, self.index = cfg, index
        topology.use_compilation_cache(cfg.jax_cache_dir)
        tokenizer = load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
        prompts = phases.Prompts.load(cfg, tokenizer, load_task(cfg), index)
        self.engine = phases.default_engine(
            cfg, models.model_config(cfg, len(tokenizer), for_sampling=True),
            list(jax.local_devices()), prompts.pad_id, prompts.eos_ids)
        kind = in_flight.InFlightPhases if cfg.in_flight_weight_updates else \
            phases.RolloutPhases
        self.phases = kind(cfg, prompts, self.engine, num_rollouts, index)
        self.history = LengthHistory(len(prompts.tokens))  # stays empty: O3x is colocated-only
        self.evaluator = evaluation.task_evaluator(cfg, tokenizer, index, num_rollouts)
        self.version, self.weights_object, self.has_base = -1, "", False
        self.warm = False  # O2 freezes GC after this actor's first rollout (a resumed run's too)

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return f"rollout-{self.index}"

    def pid(self) -> int:
        return os.getpid()

    def _load(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """Fetches version `version` from the object store once (a no-op when it is loaded):
        `weights` is [its object] or, with LoRA, [its adapters, the first (whole) publish]."""
        if version == self.version:
            return
        if len(weights) > 1 and not self.has_base:
            self._load_tree(ray.get(weights[1], timeout=self.cfg.collective_timeout_s))
        self._load_tree(ray.get(weights[0], timeout=self.cfg.collective_timeout_s))
        self.version, self.weights_object, self.has_base = version, weights[0].hex(), True

    def _load_tree(self, tree: Any) -> None:
        if self.cfg.rl_publish_weights_single_call:
            self.engine.load_weights(tree)
        else:
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                    tree, is_leaf=quantize.is_quantized)[0]:
                self.engine.load_weights(nest(path, leaf))

    def generate(self, step: int, version: int, weights: list[ray.ObjectRef],
                 update: list[ray.ObjectRef] | None = None) -> tuple[Rollout, dict]:
        """(rollout for the trainer, host record) of this host's share of step `step`,
        generated with policy `version` (`weights`: its object, in a list so that Ray does not
        fetch it for a version already loaded). With in-flight updates, `update` is [the
        trainer leader's result of the update running when the batch was issued]: the version
        it publishes is loaded after the batch's first slice (`in_flight`)."""
        timer, programs = metrics.PhaseTimer(), self.engine.compile_count
        with timer.phase("load"):
            self._load(version, weights)
        waited = [0.0]
        if self.cfg.in_flight_weight_updates:
            self.phases.begin(version, update and (lambda: self._take(update[0], waited)))
        rollout = self.phases.rollout(step, version, self.history, timer)
        if not self.warm and self.cfg.rl_gc_freeze_after_warmup:
            freeze_gc()
        self.warm = True
        record = HostRecord.of(rollout, self.index, timer.total(), timer.seconds, {},
                               compiled=self.engine.compile_count > programs, rows_per_device=0,
                               train_compiled=False).to_json()
        return rollout, {**record, "load_s": timer.seconds["load"],
                         "weights_object": self.weights_object, "node_id": node_id(),
                         "gc_frozen": gc.get_freeze_count() > 0, "in_flight_wait_s": waited[0]}

    def _take(self, update: ray.ObjectRef, waited: list[float]) -> int:
        """Waits for the trainers' update `update`, loads the version it published (the last
        one when it skipped) and returns it; the seconds it took go to `waited` (the update
        may be the trainers' first, which compiles)."""
        t0 = time.perf_counter()
        published = ray.get(update, timeout=max(self.cfg.collective_timeout_s,
                                                self.cfg.compile_timeout_s))
        self._load(published["version"], published["weights"])
        waited[0] = time.perf_counter() - t0
        return self.version

    def evaluate(self, steps_done: int, version: int, weights: list[ray.ObjectRef]
                 ) -> np.ndarray:
        """This host's evaluation sums (`evaluation.SUM_FIELDS`) with policy `version`, seeded
        as the colocated mode seeds host `index`."""
        self._load(version, weights)
        return self.evaluator.local_sums(
            self.engine, evaluation.eval_seed(self.cfg.seed, steps_done, self.index))


# A placeholder for the batches in flight at restore: numpy entries restore at their saved shape.
NO_BATCH = np.zeros(1, np.uint8)

# One batch in flight: every rollout actor's `Rollout` and host record, in actor order.
Batch = tuple[list[Rollout], list[dict]]


def encode_batches(batches: list[Batch]) -> np.ndarray:
    """The batches in flight, oldest first, as the bytes a checkpoint keeps."""
    return np.frombuffer(pickle.dumps(batches, protocol=5), np.uint8)


def decode_batches(saved: np.ndarray) -> list[Batch]:
    """`encode_batches`'s list; a checkpoint of the one-batch format (a bare `Batch`) as a list
    of it."""
    batches = pickle.loads(saved.tobytes())
    return [batches] if isinstance(batches, tuple) else batches


class TrainerWorker:
    """One process of the trainers' jax.distributed group: pack, train, publish."""

    def __init__(self, cfg: Config, rank: int):
        self.cfg, self.rank = cfg, rank
        self.topo = topology.initialize_from_env()
        self.watchdog = topology.Watchdog(self.topo.host, cfg.collective_timeout_s,
                                          cfg.compile_timeout_s)
        parts, prompts = components.build(cfg, self.topo, None, self.watchdog)
        self.pad_id = prompts.pad_id
        with self.watchdog.guard("build", compiles=True):
            self.trainer = Trainer(cfg, parts.policy, parts.params, parts.mesh, off_policy=True)
        self.train_phase = phases.TrainPhase(self.trainer, self.watchdog, cfg.num_iterations)
        self.mesh = parts.mesh
        self.publish_form = publish_form(cfg)
        self._replicate = jax.jit(lambda t: t,
                                  out_shardings=NamedSharding(self.mesh, PartitionSpec()))
        # Checkpoints: the trainers' own (one Orbax save over their group), the colocated
        # mode's state; the driver says when. A resumed policy's version is its update count.
        self.state = recovery.RunState(cfg, self.watchdog, self.topo.is_leader)
        self.history = LengthHistory(len(prompts.tokens))  # saved empty, so CO can resume it
        self.nonfinite = recovery.NonFinitePolicy(cfg.max_nonfinite_steps)
        self.start_step, kept = recovery.restore(self.state, self.trainer, self.history,
                                                 self.nonfinite, in_flight=NO_BATCH)
        self.in_flight = decode_batches(kept["in_flight"]) if "in_flight" in kept else None
        self.version, self.puts = self.start_step - self.nonfinite.count, 0
        self.base: ray.ObjectRef | None = None  # the first publish, held while the run lasts
        self.published: dict | None = None  # the last publish, what a skipped update repeats

    def __repr__(self) -> str:
        return f"trainer-{self.rank}"

    def resumed(self) -> dict:
        """Where the run starts: {"start_step", "nonfinite_steps", "checkpoint", "in_flight":
        the batches saved for the start step and the next ones, [(rollouts, records)], or
        None}."""
        return {"start_step": self.start_step, "nonfinite_steps": self.nonfinite.count,
                "checkpoint": self.state.describe_last(), "in_flight": self.in_flight}

    def save(self, step: int, nonfinite_steps: int, records: list[list[dict]],
             *rollouts: Rollout) -> str:
        """Saves the state after update `step` (every trainer joins) with the batches in flight
        for steps step + 1 on: `records[i]` are batch i's host records and `rollouts` every
        batch's rollouts in turn, as many each (none after the last step); what was last
        saved."""
        self.nonfinite.count = nonfinite_steps
        per = len(rollouts) // max(len(records), 1)
        batches = [(list(rollouts[i * per:(i + 1) * per]), batch_records)
                   for i, batch_records in enumerate(records)]
        extra = {"in_flight": encode_batches(batches)} if batches else {}
        self.state.save(step, lambda: recovery.train_state(self.trainer, self.history,
                                                           self.nonfinite, **extra))
        return self.state.describe_last()

    def close_checkpoints(self) -> None:
        """Waits for the saves in flight; the run's last call."""
        self.state.close()

    def pid(self) -> int:
        return os.getpid()

    def publish(self) -> dict:
        """Phase 6: every trainer joins the gather of the full weights (with LoRA after the first
        publish, the adapters); the leader puts one host copy into the object store.
        {"version", "weights": [ref] or [ref, first ref] (leader) or None, "publish_bytes":
        of the object put (0 on a trainer that puts none), ...}."""
        t0 = time.perf_counter()
        adapters_only = self.trainer.lora and self.version > 0
        params = self.trainer.engine_params(adapters_only=adapters_only)
        with self.watchdog.guard("publish", compiles=self.version == 0):
            if not self.trainer.engine_params_gathered:
                with jax.set_mesh(self.mesh):
                    params = jax.block_until_ready(self._replicate(params))
            weights, put_bytes = None, 0
            if self.topo.is_leader:
                copy = host_copy(params, *self.publish_form)
                weights, put_bytes = [ray.put(copy)], tree_bytes(copy)
                self.puts += 1
                if self.base is None:
                    self.base = weights[0]
                if adapters_only:
                    weights.append(self.base)
        self.published = {"version": self.version, "weights": weights, "puts": self.puts,
                          "publish_bytes": put_bytes}
        return {**self.published, "publish_s": time.perf_counter() - t0}

    def train(self, step: int, *rollouts: Rollout) -> dict:
        """Update `step` (version v -> v+1) on this trainer's rollouts, then publish v+1; a
        skipped update keeps v and publishes nothing."""
        timer, local_devices = metrics.PhaseTimer(), len(self.topo.local_devices)
        trained_on = self.version
        tokens = in_flight.token_staleness(list(rollouts), trained_on,
                                           self.cfg.off_policy_steps)
        with timer.phase("pack"):
            local, everyone = phases.pack(self.cfg, [s for r in rollouts for s in r.sequences()],
                                          self.pad_id, local_devices, self.watchdog)
        k = everyone.rows_per_device(local_devices)
        with timer.phase("train"):
            result = self.train_phase(local, k)
        if result.applied:
            self.version += 1
            published = self.publish()
        else:  # params and optimizer state are as they were: v_t is still the policy
            published = {**self.published, "publish_s": 0.0}
        if step == self.start_step and self.cfg.rl_gc_freeze_after_warmup:
            freeze_gc()
        return {**result.metrics, **published, **tokens, "trained_on": trained_on,
                "node_id": node_id(),
                "batch_versions": [r.policy_version for r in rollouts],
                "trainer_processes": self.topo.num_hosts, "rows_per_device": k,
                "pack_s": timer.seconds["pack"], "train_s": timer.seconds["train"],
                "compiled": int(result.compiled), "gc_frozen": gc.get_freeze_count() > 0}
