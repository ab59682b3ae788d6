"""The train step's compile at a model depth: one JSON line on stdout.

    PYTHONPATH=<tree> python bench_results/scan/train_compile_depth.py LAYERS [key=value ...]

A narrow Qwen3 (width 128, MLP 256, 4 query / 2 kv heads of 32, vocab 256, rows of 48 tokens),
fp32, the trainer's own step (`Trainer.lower`) on the CPU devices of the process, built from
shapes as `tunix_mcjax.aot` builds it (`AbstractTrainer`), lowered and compiled. Reports the
lower and compile times in wall and process CPU seconds (all threads; on a shared machine the
CPU time is the steadier figure), XLA's memory analysis, the size of the optimized HLO and the
trainer's param layout (`stacked`: `train/layer_runs`; `per-layer`: a tree from before, whose
step unrolled its layers: run the script with that tree on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import types

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from tunix_mcjax import models
from tunix_mcjax.aot.programs import AbstractTrainer, abstract_policy, train_batch
from tunix_mcjax.config import load_config

VOCAB = 256
NARROW = ["base_emb_dim=128", "base_mlp_dim=256", "base_num_query_heads=4",
          "base_num_kv_heads=2", "head_dim=32", "max_prefill_predict_length=16",
          "max_target_length=48", "dtype=float32", "weight_dtype=float32"]


def layout_of(params) -> str:
    keys = [str(k) for k in params["layers"]]
    return "stacked" if all(k.startswith("from_") for k in keys) else "per-layer"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layers", type=int)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    cfg = load_config(None, [f"base_num_decoder_layers={args.layers}", *NARROW,
                             *args.overrides])
    mc = models.model_config(cfg, VOCAB)
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(-1, 1), ("fsdp", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    policy, params = abstract_policy(cfg, mc, mesh)
    trainer = AbstractTrainer(cfg, policy, params, mesh, 16 * 2**30)
    layout = types.SimpleNamespace(micro_batches=trainer.micro_batches, micro_rows=2)
    batch = train_batch(trainer, layout, cfg.max_target_length)
    start, start_cpu = time.perf_counter(), time.process_time()
    lowered = trainer.lower(batch)
    lower_s, lower_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    start, start_cpu = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    compile_s, compile_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    memory, text = compiled.memory_analysis(), compiled.as_text()
    print(json.dumps({
        "layers": args.layers, "params_layout": layout_of(trainer.params),
        "overrides": args.overrides,
        "devices": len(devices), "flat_step": trainer.flat is not None,
        "remat_policy": cfg.remat_policy, "lower_s": round(lower_s, 2),
        "lower_cpu_s": round(lower_cpu, 2), "compile_s": round(compile_s, 2),
        "compile_cpu_s": round(compile_cpu, 2), "hlo_chars": len(text),
        "dots": len(re.findall(r" dot\(", text)),
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes, "alias_bytes": memory.alias_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes, "load_average": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
