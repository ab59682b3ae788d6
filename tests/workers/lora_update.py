"""LoRA on 2 hosts: one train step per case (as tests/workers/fixed_update.py does it, plain
SGD, so (initial - final) / LR is the applied gradient; for the flat step also its compiled
collectives), then a 2-step colocated run with LoRA and a checkpoint (run `<run_name>-run`),
and on its trainer, engine and checkpoint: the AdamW state's leaves, publish sizes and
contents, a non-finite step, the checkpoint's restore. Host 0 writes `lora.npz`.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from tests.workers.common import start
from tests.workers.fixed_update import LR, VOCAB, fixed_batch, flat
from tunix_mcjax import models, topology
from tunix_mcjax.bench.hlo import collectives
from tunix_mcjax.engine import Completion
from tunix_mcjax.engine.trees import flatten_tree
from tunix_mcjax.rewards import group_advantages
from tunix_mcjax.runtime import recovery
from tunix_mcjax.runtime.colocated import ColocatedRuntime
from tunix_mcjax.runtime.phases import pack_local
from tunix_mcjax.train import layer_runs
from tunix_mcjax.train.checkpoint import Checkpointer
from tunix_mcjax.train.trainer import Trainer, qwen3_policy

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_module_path=".*_proj")
CASES = {
    "flat-seq-b01-t07": dict(fsdp_gather_params_once="true", grpo_beta=0.1,
                             loss_agg_mode="sequence-mean-token-mean",
                             decode_sampling_temperature=0.7),
    "sharded-micro-tok-b01": dict(fsdp_gather_params_once="false", grpo_beta=0.1,
                                  loss_agg_mode="token-mean", train_micro_batch_size=1),
}


def lora_model(cfg, mesh):
    """The run's LoRA policy with B drawn nonzero (as after training), so A has a gradient."""
    model = models.build_model(cfg, models.model_config(cfg, VOCAB), mesh)
    rng = np.random.default_rng(11)
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        if path[-1].endswith("_lora_b"):
            value = (0.1 * rng.standard_normal(leaf.get_value().shape)).astype(np.float32)
            sharding = leaf.get_value().sharding
            leaf.set_value(jax.make_array_from_callback(value.shape, sharding,
                                                        lambda idx, v=value: v[idx]))
    return model


def local_batch(cfg, topo):
    g, p = cfg.num_generations, cfg.batch_size
    prompts, completions, rewards = fixed_batch(p, g)
    adv = group_advantages(rewards, g)
    per_host = p // topo.num_hosts
    mine = range(topo.host * per_host * g, (topo.host + 1) * per_host * g)
    local_completions = [Completion(completions[j], np.zeros(len(completions[j]), np.float32),
                                    "stop") for j in mine]
    local, _, _ = pack_local(cfg, [prompts[j // g] for j in mine], local_completions,
                             adv[list(mine)], 0, len(topo.local_devices), np.zeros(0))
    return local


def one_case(base_cfg, topo, name: str, out: dict) -> None:
    cfg = base_cfg.replace(**LORA, **CASES[name])
    mesh = topology.trainer_mesh(topo)
    policy, params = qwen3_policy(lora_model(cfg, mesh))
    initial = flat(params)
    trainer = Trainer(cfg, policy, params, mesh, tx=optax.sgd(LR))
    if trainer.flat is not None:
        hlo = trainer.lower(trainer.global_batch(local_batch(cfg, topo))).compile().as_text()
        out[f"{name}/collectives"] = json.dumps(collectives(hlo))
        out[f"{name}/adapter_bytes"] = sum(x.nbytes for x in jax.tree.leaves(trainer.params))
    metrics = trainer.step(local_batch(cfg, topo))
    adapters, base = flat(trainer.params), flat(trainer.frozen)
    out[f"{name}/loss"] = metrics["loss"]
    out[f"{name}/flat"] = trainer.flat is not None
    out[f"{name}/micro_batches"] = trainer.micro_batch_layout(
        len(local_batch(cfg, topo)["tokens"]))[0]
    out[f"{name}/base_unchanged"] = all(np.array_equal(base[k], initial[k]) for k in base)
    out[f"{name}/base_leaves"] = len(base)
    for key, value in initial.items():
        out[f"{name}/initial/{key}"] = value
    for key, value in adapters.items():
        out[f"{name}/grad/{key}"] = (initial[key].astype(np.float64) - value) / LR


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in
            jax.tree.leaves(multihost_utils.process_allgather(tree, tiled=True))]


def _tree_equal(a, b) -> bool:
    return all(np.array_equal(x, y, equal_nan=True)
               for x, y in zip(_leaves(a), _leaves(b), strict=True))


def runtime_run(base_cfg, topo, out: dict) -> None:
    """The colocated runtime with LoRA for 2 steps, then checks on what it holds."""
    cfg = base_cfg.replace(**LORA, steps=2, grpo_beta=0.04, enable_checkpointing=True,
                           run_name=f"{base_cfg.run_name}-run")
    runtime = ColocatedRuntime(cfg, topo)
    out["run_first_publish_bytes"] = runtime.publisher.last_bytes
    runtime.run()
    trainer, engine = runtime.trainer, runtime.engine
    out["run_publish_bytes"] = runtime.publisher.last_bytes
    out["run_adapter_bytes"] = sum(x.nbytes for x in jax.tree.leaves(trainer.params))
    out["run_adapter_elements"] = sum(x.size for x in jax.tree.leaves(trainer.params))
    adapter_keys = sorted(flat(trainer.params))
    adam = [s for s in jax.tree.leaves(trainer.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
            if hasattr(s, "mu")][0]
    out["opt_moment_keys_equal_adapters"] = sorted(flat(adam.mu)) == adapter_keys == \
        sorted(flat(adam.nu))
    out["opt_state_elements"] = sum(x.size for x in jax.tree.leaves(trainer.opt_state))
    want = {"/".join(p): np.asarray(x) for p, x in flatten_tree(  # the engine reports Tunix's
        layer_runs.unstack(jax.device_get(trainer.engine_params()))).items()}  # per-layer paths
    out["engine_equals_trainer"] = all(
        np.array_equal(np.asarray(leaf), want["/".join(path)])
        for r in range(engine.num_replicas)
        for path, leaf in flatten_tree(engine.weights(r)).items()) and \
        len(flatten_tree(engine.weights(0))) == len(want)
    checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.max_num_checkpoints_to_keep)
    restored = checkpointer.restore(1, recovery.train_state(
        trainer, runtime.history, runtime.nonfinite))
    checkpointer.close()
    out["restored_equal"] = _tree_equal(restored["params"], trainer.params) and \
        _tree_equal(restored["opt_state"], trainer.opt_state)
    before = _leaves((trainer.params, trainer.opt_state))
    local = local_batch(cfg, topo)
    out["nonfinite_finite"] = trainer.step(
        {**local, "advantages": np.full_like(local["advantages"], np.nan)})["finite"]
    out["nonfinite_unchanged"] = all(np.array_equal(x, y) for x, y in zip(
        before, _leaves((trainer.params, trainer.opt_state)), strict=True))


def main() -> None:
    cfg, topo = start()
    out: dict[str, np.ndarray] = {}
    for name in CASES:
        one_case(cfg, topo, name, out)
    runtime_run(cfg, topo, out)
    if topo.is_leader:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        np.savez(cfg.run_dir / "lora.npz", **out)


if __name__ == "__main__":
    main()
