"""The mcjax_da publish path at Qwen3-0.6B's shape, in one process (a whole DA run of
recipes/cpu/qwen3_0p6b.yml was killed by Ray's memory monitor on the shared 23 GiB machine).

What a publish does under `quantization=int8`, with the actors' own functions: the trainer
leader's host copy (`ray_actors.host_copy`, engine side: bf16 as trained; trainer side:
`publish_form`, projections quantized) and `ray.put`, then a rollout actor's `ray.get` and
`JaxEngine.load_weights` (engine side quantizes as it loads; trainer side places the QArrays).
The trainer's tree is random-init Qwen3-0.6B in bf16, its layers stacked as the trainer holds
them, on one CPU device. Sides alternate; each runs once unrecorded first (it compiles).

    python bench_results/quant/publish/qwen3_publish.py REPEATS LAUNCH   (from the repo root)
    -> qwen3_0p6b_publish-l<LAUNCH>.json (each side's repeats and their medians)
    python bench_results/quant/publish/qwen3_publish.py report
    -> qwen3_0p6b_report.json (per side, the median over launches of each launch's median)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import ray
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_mcjax import config, models
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.publish import tree_bytes
from tunix_mcjax.runtime.ray_actors import host_copy, publish_form
from tunix_mcjax.train import layer_runs

HERE = Path(__file__).resolve().parent
RECIPE = "recipes/cpu/qwen3_0p6b.yml"


def trainer_tree(cfg) -> dict:
    """Random Qwen3-0.6B params, stacked, replicated over one device (the leader's gather)."""
    model = models.create_model(models.model_config(cfg, 0), cfg.seed)
    tree = nnx.to_pure_dict(layer_runs.stack(nnx.state(model, nnx.Param)))
    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    return jax.block_until_ready(jax.device_put(tree, NamedSharding(mesh, P())))


def one_publish(tree: dict, form: tuple, engine: JaxEngine) -> dict:
    t0 = time.perf_counter()
    copy = host_copy(tree, *form)
    ref = ray.put(copy)
    t1 = time.perf_counter()
    engine.load_weights(ray.get(ref))
    jax.block_until_ready(jax.tree.leaves(engine.weights(0)))
    t2 = time.perf_counter()
    return {"publish_bytes": tree_bytes(copy), "put_s": t1 - t0, "load_s": t2 - t1,
            "publish_plus_load_s": t2 - t0}


def main(repeats: int) -> dict:
    cfg = config.load_config(RECIPE, ["quantization=int8"])
    tree = trainer_tree(cfg)
    engine = JaxEngine(models.model_config(cfg, 0, for_sampling=True), jax.devices()[:1],
                       pad_id=0, eos_ids=(1,), max_prompt_length=32, max_new_tokens=64,
                       quantization="int8", num_pages=64)
    forms = {"engine": ("", None), "trainer": publish_form(cfg)}
    ray.init(num_cpus=1, object_store_memory=3 << 30, include_dashboard=False)
    runs: dict[str, list[dict]] = {side: [] for side in forms}
    for i in range(repeats + 1):
        for side, form in forms.items():
            run = one_publish(tree, form, engine)
            print(side, i, run, flush=True)
            if i:
                runs[side].append(run)
    ray.shutdown()
    return {side: {"median": {k: statistics.median(r[k] for r in rs) for k in rs[0]},
                   "runs": rs} for side, rs in runs.items()}


def report() -> dict:
    launches = [json.loads(f.read_text())
                for f in sorted(HERE.glob("qwen3_0p6b_publish-l*.json"))]
    out = {side: {k: statistics.median(launch[side]["median"][k] for launch in launches)
                  for k in launches[0][side]["median"]} for side in ("engine", "trainer")}
    out["launches"], out["loadavg_1m"] = len(launches), [x["loadavg_1m"] for x in launches]
    (HERE / "qwen3_0p6b_report.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__" and sys.argv[1] == "report":
    print(report())
elif __name__ == "__main__":
    load = os.getloadavg()[0]
    out = main(int(sys.argv[1]))
    out["loadavg_1m"] = [load, os.getloadavg()[0]]
    (HERE / f"qwen3_0p6b_publish-l{sys.argv[2]}.json").write_text(json.dumps(out, indent=1) + "\n")
