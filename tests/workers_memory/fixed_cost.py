"""One process, several CPU devices: the train step's collectives and publish equality.

Writes `fixed_cost.json`: per layout, the compiled train step's collectives (`bench.hlo`); per
layout and publish mode, after each of two steps, whether every engine replica's weights equal
the trainer's params exactly and whether those outside the decoder layers (which the engine
stacks) are the trainer's own buffers (no copy on load).
Run with XLA_FLAGS=--xla_force_host_platform_device_count=4: argv[1] is the output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from tests.workers.fixed_update import VOCAB
from tests.workers_memory.updates import BASE, local_rows
from tunix_mcjax import models
from tunix_mcjax.bench.hlo import collectives
from tunix_mcjax.config import load_config
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.engine.trees import flatten_tree
from tunix_mcjax.publish import Publisher
from tunix_mcjax.train.trainer import Trainer, qwen3_policy

LAYOUTS = {
    "flat": ["fsdp_gather_params_once=true", "grpo_beta=0.0"],
    "flat_ref_micro_remat": ["fsdp_gather_params_once=true", "train_micro_batch_size=1",
                             "remat_policy=full"],
    "sharded": ["fsdp_gather_params_once=false", "grpo_beta=0.0"],
}


def buffers(tree) -> dict[str, set[int]]:
    return {"/".join(map(str, path)): {s.data.unsafe_buffer_pointer()
                                       for s in leaf.addressable_shards}
            for path, leaf in flatten_tree(tree).items()}


def publish_check(trainer: Trainer, engine: JaxEngine, single_call: bool) -> dict:
    publisher = Publisher(trainer.mesh, single_call)
    publisher.publish(trainer.engine_params(), engine, gathered=trainer.engine_params_gathered)
    want = {"/".join(map(str, p)): np.asarray(jax.device_get(x))
            for p, x in flatten_tree(nnx.to_pure_dict(trainer.model_params())).items()}
    equal = all(np.array_equal(np.asarray(leaf), want["/".join(map(str, path))])
                for r in range(engine.num_replicas)
                for path, leaf in flatten_tree(engine.weights(r)).items())
    # The engine holds its decoder layers stacked for its scan (a copy); the rest it shares.
    source = {k: v for k, v in buffers(trainer.engine_params()).items()
              if not k.startswith("layers/")}
    loaded: dict[str, set[int]] = {}
    for r in range(engine.num_replicas):
        for key, ptrs in buffers(engine.weights(r)).items():
            if key in source:
                loaded.setdefault(key, set()).update(ptrs)
    return {"equal": equal, "leaves": len(flatten_tree(trainer.engine_params())),
            "gather_calls": publisher.gather_calls,
            "shared_buffers": loaded == source}


def main(out: Path) -> None:
    devices = jax.devices()
    if len(devices) != 4:  # on one device every layout is the same, and the checks pass empty
        raise SystemExit(f"{len(devices)} devices: run with XLA_FLAGS="
                         "--xla_force_host_platform_device_count=4")
    mesh = Mesh(np.array(devices).reshape(-1, 1), ("fsdp", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    results = {}
    for name, overrides in LAYOUTS.items():
        cfg = load_config("recipes/cpu/demo.yml", BASE + overrides)
        policy, params = qwen3_policy(models.create_model(models.model_config(cfg, VOCAB), 3,
                                                          mesh))
        trainer = Trainer(cfg, policy, params, mesh)
        local = local_rows(cfg, len(devices))
        hlo = trainer.lower(trainer.global_batch(local)).compile().as_text()
        engine = JaxEngine(models.model_config(cfg, VOCAB, for_sampling=True), devices,
                           pad_id=0, eos_ids=(2,), max_prompt_length=4, max_new_tokens=2)
        checks = []
        for _ in range(2):
            metrics = trainer.step(local)
            checks.append({"finite": metrics["finite"],
                           **{f"single_call={s}": publish_check(trainer, engine, s)
                              for s in (True, False)}})
        results[name] = {"flat": trainer.flat is not None, "collectives": collectives(hlo),
                         "micro_batches": trainer.micro_batch_layout(len(local["tokens"]))[0],
                         "ref": trainer.ref_params is not None, "publish": checks}
    out.mkdir(parents=True, exist_ok=True)
    (out / "fixed_cost.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
