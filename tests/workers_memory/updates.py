"""One process, several CPU devices: the same fixed batch trained by differently laid-out steps.

Writes `updates.npz` with the initial params and, per variant, the params after one update and
the step's metrics. Variants: gather-once vs sharded compute, with and without micro-batches.
Run with XLA_FLAGS=--xla_force_host_platform_device_count=4: argv[1] is the output directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from tests.mp import TINY
from tests.workers.fixed_update import VOCAB, fixed_batch
from tunix_mcjax import models
from tunix_mcjax.config import load_config
from tunix_mcjax.rewards import group_advantages
from tunix_mcjax.train import layer_runs, packing
from tunix_mcjax.train.trainer import Trainer, loss_weights, qwen3_policy

VARIANTS = {
    "gather": ["fsdp_gather_params_once=true"],
    "sharded": ["fsdp_gather_params_once=false"],
    "gather_micro": ["fsdp_gather_params_once=true", "train_micro_batch_size=1"],
    "sharded_micro": ["fsdp_gather_params_once=false", "train_micro_batch_size=2"],
}
BASE = [*TINY, "batch_size=4", "num_generations=4", "max_prefill_predict_length=4",
        "max_target_length=10", "grpo_beta=0.04", "train_logits_chunk_tokens=8"]


def flat(tree) -> dict[str, np.ndarray]:
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                nnx.to_pure_dict(layer_runs.unstack(tree)))[0]}


def local_rows(cfg, num_devices: int) -> dict[str, np.ndarray]:
    g = cfg.num_generations
    prompts, completions, rewards = fixed_batch(cfg.batch_size, g)
    adv = group_advantages(rewards, g)
    seqs = [packing.Sequence(prompts[j // g], c, float(adv[j]), np.zeros(len(c), np.float32))
            for j, c in enumerate(completions)]
    rows = packing.pack(seqs, cfg.max_target_length, pad_id=0)
    k = packing.rows_per_device([rows.num_rows], num_devices)
    rows = packing.pad_rows(rows, k * num_devices, pad_id=0)
    local = {f: getattr(rows, f) for f in ("tokens", "positions", "segment_ids", "targets",
                                           "loss_mask", "advantages", "old_logps")}
    local["weights"] = loss_weights(rows, cfg.loss_agg_mode, len(seqs),
                                    sum(len(c) for c in completions)).astype(np.float32)
    return local


def main(out: Path) -> None:
    devices = jax.devices()
    if len(devices) != 4:  # on one device every layout is the same, and the checks pass empty
        raise SystemExit(f"{len(devices)} devices: run with XLA_FLAGS="
                         "--xla_force_host_platform_device_count=4")
    mesh = Mesh(np.array(devices).reshape(-1, 1), ("fsdp", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    results = {}
    for name, overrides in VARIANTS.items():
        cfg = load_config("recipes/cpu/demo.yml", BASE + overrides)
        model = models.create_model(models.model_config(cfg, VOCAB), 3, mesh)
        policy, params = qwen3_policy(model)
        if name == "gather":
            results.update({f"initial/{k}": v for k, v in flat(params).items()})
        trainer = Trainer(cfg, policy, params, mesh)
        local = local_rows(cfg, len(devices))
        metrics = trainer.step(local)
        results[f"{name}/micro_batches"] = trainer.micro_batch_layout(len(local["tokens"]))[0]
        results[f"{name}/gathered"] = trainer.gather_params_once
        results.update({f"{name}/metric/{k}": v for k, v in metrics.items()})
        results.update({f"{name}/final/{k}": v for k, v in flat(trainer.params).items()})
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "updates.npz", **results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
