"""The two kinds of actor of the disaggregated mode, each one JAX process of its own.

- `RolloutWorker`: one rollout host. Its own engine on its own devices (no jax.distributed);
  it admits its share of the step's prompts, generates with the policy version it was last
  given, scores and computes group advantages (phases 1-3). Each batch carries its version.
- `TrainerWorker`: one trainer host, one process of the trainers' jax.distributed group. It
  packs the rollout hosts' batches (rows per device agreed among the trainers), runs the same
  global FSDP train step as the colocated mode with the off-policy loss (behaviour logprobs from
  the engine), and publishes: the leader `ray.put`s one host copy of the new weights, once per
  version; every rollout actor fetches that one object.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np
import ray
from jax.sharding import NamedSharding, PartitionSpec

from tunix_mcjax import admission, metrics, models, rewards, topology
from tunix_mcjax.config import Config
from tunix_mcjax.engine import Completion, stops
from tunix_mcjax.publish import _nest
from tunix_mcjax.runtime import phases
from tunix_mcjax.runtime.colocated import default_components, freeze_gc
from tunix_mcjax.tasks import load_task
from tunix_mcjax.tokenizer import load_tokenizer
from tunix_mcjax.trainer import Trainer


def _task_and_tokens(cfg: Config, host: int):
    tokenizer = load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)
    task, prompt_tokens = phases.filter_task(load_task(cfg), tokenizer, cfg, host)
    return tokenizer, task, prompt_tokens


def host_copy(tree: Any) -> Any:
    """numpy copies of a tree of arrays replicated over this process's devices."""
    def one(x: jax.Array) -> np.ndarray:
        return np.asarray(next(s.data for s in x.addressable_shards if s.data.shape == x.shape))
    return jax.tree.map(one, tree)


class RolloutWorker:
    """One rollout host: admit, generate, score on its own engine, one step stale."""

    def __init__(self, cfg: Config, index: int, num_rollouts: int):
        self.cfg, self.index, self.num_rollouts = cfg, index, num_rollouts
        self.tokenizer, self.task, self.prompt_tokens = _task_and_tokens(cfg, index)
        self.prompt_lengths = np.array([len(t) for t in self.prompt_tokens])
        self.reward_fns = rewards.resolve_reward_fns(cfg.reward_functions, self.task)
        eos_ids = stops.model_stop_ids(self.tokenizer, (cfg.load_parameters_path,
                                                        cfg.tokenizer_path))
        model_config = models.model_config(cfg, len(self.tokenizer), for_sampling=True)
        self.engine = phases.default_engine(cfg, model_config, list(jax.local_devices()),
                                            self.tokenizer.pad_token_id, eos_ids)
        self.sampling = phases.sampling_params(cfg)
        self.version, self.weights_object = -1, ""

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return f"rollout-{self.index}"

    def pid(self) -> int:
        return os.getpid()

    def _load(self, version: int, weights: list[ray.ObjectRef]) -> None:
        """Fetches version `version` from the object store once (a no-op when it is loaded)."""
        if version == self.version:
            return
        tree = ray.get(weights[0], timeout=self.cfg.collective_timeout_s)
        if self.cfg.rl_publish_weights_single_call:
            self.engine.load_weights(tree)
        else:
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                self.engine.load_weights(_nest(path, leaf))
        self.version, self.weights_object = version, weights[0].hex()

    def generate(self, step: int, version: int, weights: list[ray.ObjectRef]
                 ) -> tuple[dict, dict]:
        """(batch for the trainer, host record) of this host's share of step `step`'s prompts,
        generated with policy `version` (`weights`: its object, in a list so that Ray does not
        fetch it for a version already loaded)."""
        cfg, timer, g = self.cfg, metrics.PhaseTimer(), self.cfg.num_generations
        programs = self.engine.compile_count
        with timer.phase("load"):
            self._load(version, weights)
        with timer.phase("admit"):
            global_idx = admission.global_prompt_indices(
                len(self.prompt_tokens), cfg.batch_size, cfg.seed, step, cfg.data_repeat_period)
            local_idx = global_idx[self._positions(self.prompt_lengths[global_idx])]
            expanded = [int(i) for i in local_idx for _ in range(g)]
        with timer.phase("generate"):
            completions = self.engine.generate(
                [self.prompt_tokens[i] for i in expanded], self.sampling,
                phases.rollout_seed(cfg.seed, step, self.index))
        with timer.phase("reward"):
            reward, correct, advantages = self._score(expanded, completions)
        if step == 0 and cfg.rl_gc_freeze_after_warmup:
            freeze_gc()
        lens = np.array([len(c.tokens) for c in completions])
        batch = {"prompts": [self.prompt_tokens[i] for i in expanded],
                 "completions": completions, "advantages": advantages, "version": version}
        record = {
            "rollout": self.index, "version": self.version, "weights_object": self.weights_object,
            "step_s": timer.total(), **{f"{p}_s": timer.seconds.get(p, 0.0)
                                        for p in ("load", "admit", "generate", "reward")},
            "reward_sum": float(reward.sum()), "correct_sum": float(correct.sum()),
            "completions": len(completions), "completion_tokens": int(lens.sum()),
            "completion_len_max": int(lens.max()), "prompts": len(local_idx),
            "truncated": sum(c.finish_reason == "length" for c in completions),
            "prompt_tokens": int(self.prompt_lengths[local_idx].sum()),
            "compiled": int(self.engine.compile_count > programs),
            "global_prompt_indices": global_idx.tolist(),
        }
        return batch, record

    def _positions(self, lengths: np.ndarray) -> np.ndarray:
        """This host's positions in the global batch: O3's or the contiguous split, which here
        may leave hosts one prompt apart (splits such as 3 rollout hosts of 4)."""
        if len(lengths) % self.num_rollouts == 0:
            return admission.host_prompt_positions(
                self.num_rollouts, self.index, lengths, self.cfg.rl_balance_prompts_by_length,
                None, self.cfg.num_generations)
        return np.array_split(np.arange(len(lengths)), self.num_rollouts)[self.index]

    def _score(self, expanded: list[int], completions: list[Completion]):
        # A completion that stopped ends with its stop token; only that one is dropped.
        texts = self.tokenizer.batch_decode(
            [c.tokens[:-1] if c.finish_reason != "length" else c.tokens for c in completions],
            skip_special_tokens=True)
        prompts = [self.task.prompts[i] for i in expanded]
        fields = {k: [v[i] for i in expanded] for k, v in self.task.fields.items()}
        reward = rewards.score(self.reward_fns, prompts, texts, fields, expanded)
        correct = np.asarray(self.task.accuracy_fn(prompts=prompts, completions=texts, **fields))
        return reward, correct, rewards.group_advantages(reward, self.cfg.num_generations)


class TrainerWorker:
    """One process of the trainers' jax.distributed group: pack, train, publish."""

    def __init__(self, cfg: Config, rank: int):
        self.cfg, self.rank = cfg, rank
        self.topo = topology.initialize_from_env()
        self.watchdog = topology.Watchdog(self.topo.host, cfg.collective_timeout_s,
                                          cfg.compile_timeout_s)
        tokenizer, task, _ = _task_and_tokens(cfg, self.topo.host)
        self.pad_id = tokenizer.pad_token_id
        with self.watchdog.guard("build", compiles=True):
            parts = default_components(cfg, self.topo, tokenizer, task)
            self.trainer = Trainer(cfg, parts.policy, parts.params, parts.mesh, off_policy=True)
        self.mesh = parts.mesh
        self._replicate = jax.jit(lambda t: t,
                                  out_shardings=NamedSharding(self.mesh, PartitionSpec()))
        self.version, self.puts = 0, 0
        self._seen_k: set[int] = set()

    def __repr__(self) -> str:
        return f"trainer-{self.rank}"

    def pid(self) -> int:
        return os.getpid()

    def publish(self) -> dict:
        """Phase 6: every trainer joins the gather of the full weights; the leader puts one host
        copy into the object store. {"version", "weights": [ref] (leader) or None, ...}."""
        t0 = time.perf_counter()
        params = self.trainer.engine_params()
        with self.watchdog.guard("publish", compiles=self.version == 0):
            if not self.trainer.engine_params_gathered:
                with jax.set_mesh(self.mesh):
                    params = jax.block_until_ready(self._replicate(params))
            weights = None
            if self.topo.is_leader:
                weights = [ray.put(host_copy(params))]
                self.puts += 1
        return {"version": self.version, "weights": weights, "puts": self.puts,
                "publish_s": time.perf_counter() - t0}

    def train(self, step: int, *batches: dict) -> dict:
        """Update `step` (version v -> v+1) on this trainer's rollout batches, then publish v+1."""
        cfg, timer = self.cfg, metrics.PhaseTimer()
        versions = [b["version"] for b in batches]
        with timer.phase("pack"):
            local, _, k = phases.pack_local(
                cfg, [p for b in batches for p in b["prompts"]],
                [c for b in batches for c in b["completions"]],
                np.concatenate([b["advantages"] for b in batches]), self.pad_id,
                len(self.topo.local_devices), np.zeros(0), self.watchdog)
        compiles = k not in self._seen_k
        self._seen_k.add(k)
        programs = self.trainer.compile_count
        with timer.phase("train"), self.watchdog.guard("train", compiles=compiles):
            train_metrics = self.trainer.step(local)
        trained_on, self.version = self.version, self.version + 1
        if step == 0 and cfg.rl_gc_freeze_after_warmup:
            freeze_gc()
        published = self.publish()
        return {**train_metrics, **published, "trained_on": trained_on,
                "batch_versions": versions, "rows_per_device": k,
                "trainer_processes": self.topo.num_hosts,
                "pack_s": timer.seconds["pack"], "train_s": timer.seconds["train"],
                "compiled": int(self.trainer.compile_count > programs)}
