"""LoRA train steps on 2 hosts: the update per case (as tests/workers/fixed_update.py does it,
plain SGD, so (initial - final) / LR is the applied gradient), then, with the run's own AdamW:
the optimizer state's leaves, publishing (whole tree once, then adapters only), a non-finite
step, and an Orbax save/restore of the adapters; last, a 2-step colocated run with LoRA and a
checkpoint (run `<run_name>-run`). Host 0 writes `lora.npz`.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from tests.workers.common import start
from tests.workers.fixed_update import LR, VOCAB, fixed_batch, flat
from tunix_mcjax import models, topology
from tunix_mcjax.checkpoint import Checkpointer
from tunix_mcjax.engine import Completion
from tunix_mcjax.engine.jax_engine import JaxEngine, flatten_tree
from tunix_mcjax.publish import Publisher
from tunix_mcjax.rewards import group_advantages
from tunix_mcjax.runtime.colocated import ColocatedRuntime
from tunix_mcjax.runtime.phases import pack_local
from tunix_mcjax.trainer import Trainer, qwen3_policy

LORA = dict(lora_rank=4, lora_alpha=8.0, lora_module_path=".*_proj")
CASES = {
    "flat-seq-b01-t07": dict(fsdp_gather_params_once="true", grpo_beta=0.1,
                             loss_agg_mode="sequence-mean-token-mean",
                             decode_sampling_temperature=0.7),
    "sharded-tok-b01-t1": dict(fsdp_gather_params_once="false", grpo_beta=0.1,
                               loss_agg_mode="token-mean", decode_sampling_temperature=1.0),
    "flat-micro-tok-b0": dict(fsdp_gather_params_once="true", grpo_beta=0.0,
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
    return all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True))


def run_state(base_cfg, topo, out: dict) -> None:
    """AdamW state, publish sizes and contents, a non-finite step, save and restore."""
    cfg = base_cfg.replace(**LORA, **CASES["flat-seq-b01-t07"])
    mesh = topology.trainer_mesh(topo)
    policy, params = qwen3_policy(lora_model(cfg, mesh))
    trainer = Trainer(cfg, policy, params, mesh)
    adapter_keys = sorted(flat(trainer.params))
    mu = [s for s in jax.tree.leaves(trainer.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
          if hasattr(s, "mu")][0].mu
    out["opt_mu_keys_equal_adapters"] = sorted(flat(mu)) == adapter_keys
    out["opt_state_elements"] = sum(x.size for x in jax.tree.leaves(trainer.opt_state))
    out["adapter_elements"] = sum(x.size for x in jax.tree.leaves(trainer.params))
    engine = JaxEngine(models.model_config(cfg, VOCAB, for_sampling=True),
                       list(topo.local_devices), pad_id=0, eos_ids=(2,), max_prompt_length=4,
                       max_new_tokens=2)
    publisher = Publisher(mesh, cfg.rl_publish_weights_single_call)
    publisher.publish_trainer(trainer, engine)
    out["publish_bytes_first"] = publisher.last_bytes
    local = local_batch(cfg, topo)
    trainer.step(local)
    publisher.publish_trainer(trainer, engine)
    out["publish_bytes_after"] = publisher.last_bytes
    want = {"/".join(p): np.asarray(x) for p, x in flatten_tree(
        jax.device_get(trainer.engine_params())).items()}
    out["engine_equals_trainer"] = all(
        np.array_equal(np.asarray(leaf), want["/".join(path)])
        for r in range(engine.num_replicas)
        for path, leaf in flatten_tree(engine.weights(r)).items()) and \
        len(flatten_tree(engine.weights(0))) == len(want)
    before = _leaves((trainer.params, trainer.opt_state))
    bad = {**local, "advantages": np.full_like(local["advantages"], np.nan)}
    out["nonfinite_finite"] = trainer.step(bad)["finite"]
    out["nonfinite_unchanged"] = all(np.array_equal(x, y, equal_nan=True) for x, y in zip(
        before, _leaves((trainer.params, trainer.opt_state)), strict=True))
    ckpt = Checkpointer(cfg.run_dir / "checkpoints", max_to_keep=1)
    ckpt.save(1, {"params": trainer.params, "opt_state": trainer.opt_state}, cfg)
    fresh = Trainer(cfg, *qwen3_policy(lora_model(cfg, mesh)), mesh)
    restored = ckpt.restore(1, {"params": fresh.params, "opt_state": fresh.opt_state})
    ckpt.close()
    out["checkpoint_keys_equal_adapters"] = sorted(flat(restored["params"])) == adapter_keys
    out["restored_equal"] = _tree_equal(restored["params"], trainer.params) and \
        _tree_equal(restored["opt_state"], trainer.opt_state)


def runtime_run(base_cfg, topo, out: dict) -> None:
    cfg = base_cfg.replace(**LORA, steps=2, grpo_beta=0.04, max_target_length=16,
                           enable_checkpointing=True, run_name=f"{base_cfg.run_name}-run")
    runtime = ColocatedRuntime(cfg, topo)
    runtime.run()
    out["run_publish_bytes"] = runtime.publisher.last_bytes
    out["run_adapter_bytes"] = sum(x.nbytes for x in jax.tree.leaves(runtime.trainer.params))


def main() -> None:
    cfg, topo = start()
    out: dict[str, np.ndarray] = {}
    for name in CASES:
        one_case(cfg, topo, name, out)
    run_state(cfg, topo, out)
    runtime_run(cfg, topo, out)
    if topo.is_leader:
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        np.savez(cfg.run_dir / "lora.npz", **out)


if __name__ == "__main__":
    main()
