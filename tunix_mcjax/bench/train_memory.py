"""XLA's memory accounting of one compiled train step, per device, for a few layouts.

    python -m tunix_mcjax.bench.train_memory --json bench_results/train_memory.json

A Qwen3 of real width (0.6B: 1024 wide, 16/8 heads of 128, MLP 3072, vocab 151,936, tied) with
few layers, FSDP over every device of the process, compiled (not run) for K packed rows of T
tokens per device. Reported per device and layout: argument bytes (params, optimizer state,
batch), output bytes, temp bytes (activations, logits, gradients) from
`compiled.memory_analysis()`. `--layout L,K,T[,key=value...]` replaces the default layouts; with
XLA_FLAGS=--xla_force_host_platform_device_count=4, e.g. `--layout 2,2,512,fsdp_gather_params_once=
false` measures sharded compute.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from tunix_mcjax import models
from tunix_mcjax.config import load_config
from tunix_mcjax.train.trainer import BATCH_KEYS, Trainer, qwen3_policy

WIDTH_0P6B = ["model_name=qwen3-tiny", "base_emb_dim=1024", "base_mlp_dim=3072",
              "base_num_query_heads=16", "base_num_kv_heads=8", "head_dim=128",
              "vocab_size=151936"]
# (layers, rows per device K, row length T, extra config keys)
LAYOUTS = [
    (2, 2, 512, ["train_logits_chunk_tokens=0"]),
    (2, 2, 512, []),
    (2, 2, 2048, ["train_logits_chunk_tokens=0"]),
    (2, 2, 2048, []),
    (2, 4, 2048, []),
    (2, 4, 2048, ["batch_size=4", "train_micro_batch_size=1"]),
    (4, 2, 2048, []),
    (2, 2, 2048, ["remat_policy=full"]),
    (4, 2, 2048, ["remat_policy=full"]),
]


def measure(layers: int, rows: int, row_len: int, extra: list[str]) -> dict:
    cfg = load_config(None, [*WIDTH_0P6B, f"base_num_decoder_layers={layers}",
                             f"max_target_length={row_len}", "max_prefill_predict_length=8",
                             "batch_size=4", "num_generations=2", *extra])
    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(-1, 1), ("fsdp", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    policy, params = qwen3_policy(models.create_model(models.model_config(cfg, 0), 0, mesh))
    trainer = Trainer(cfg, policy, params, mesh)
    local = {k: np.zeros((rows * len(devices), row_len), np.float32 if k in (
        "loss_mask", "advantages", "old_logps", "weights") else np.int32) for k in BATCH_KEYS}
    local["segment_ids"][:] = 1
    batch = trainer.global_batch(local)
    start = time.perf_counter()
    compiled = trainer.lower(batch).compile()
    mem = compiled.memory_analysis()
    n, per = trainer.micro_batch_layout(rows * len(devices))
    return {"devices": len(devices), "gather_params_once": trainer.gather_params_once,
            "layers": layers, "rows_per_device": rows, "row_len": row_len,
            "micro_batches": n, "rows_per_micro_batch": per,
            "train_logits_chunk_tokens": cfg.train_logits_chunk_tokens,
            "remat_policy": cfg.remat_policy,
            "param_count": int(sum(x.size for x in jax.tree.leaves(params))),
            "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "compile_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--layout", action="append", default=[],
                        help="L,K,T[,key=value...]: layers, rows per device, row length, keys")
    args = parser.parse_args()
    layouts = [(int(a), int(b), int(c), rest) for a, b, c, *rest in
               (spec.split(",") for spec in args.layout)] or LAYOUTS
    results = []
    print(f"{'dev':>3} {'gather':>6} {'L':>2} {'K':>2} {'T':>5} {'micro':>5} {'chunk':>5} "
          f"{'args MiB':>9} {'temp MiB':>9}")
    for layout in layouts:
        r = measure(*layout)
        results.append(r)
        print(f"{r['devices']:>3} {r['gather_params_once']!s:>6} "
              f"{r['layers']:>2} {r['rows_per_device']:>2} {r['row_len']:>5} "
              f"{r['micro_batches']:>5} {r['train_logits_chunk_tokens']:>5} "
              f"{r['argument_bytes'] / 2**20:>9.1f} {r['temp_bytes'] / 2**20:>9.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "backend": jax.default_backend(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
