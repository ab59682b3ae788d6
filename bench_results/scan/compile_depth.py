"""The jax engine's first generate (its compile) at a model depth, through the config-driven
builder (`runtime.engines.jax_engine`): one JSON line on stdout.

    PYTHONPATH=<tree> python bench_results/scan/compile_depth.py LAYERS [--samples FILE]

A narrow Qwen3 (width 128, 4 query / 2 kv heads of 32), random init at seed 0, fp32, on one CPU
device; 8 prompts x 4 samples of up to 16 new tokens. The first generate compiles the engine's
program and runs it; the second runs it (compile ~ first - second). Wall and process CPU time
(all threads) of each: on a shared machine the CPU time is the steadier figure. `--samples FILE`
also writes the tokens and logprobs of greedy and sampled runs at fixed seeds
(`compare_samples.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
from flax import nnx

from tunix_mcjax import models
from tunix_mcjax.config import load_config
from tunix_mcjax.engine.base import SamplingParams
from tunix_mcjax.runtime.engines import jax_engine

VOCAB = 256
PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i][: 1 + i % 3] + list(range(10 + i, 14 + 2 * i))
           for i in range(8)]


def build(layers: int, dtype: str = "float32"):
    cfg = load_config(None, [f"base_num_decoder_layers={layers}", "base_emb_dim=128",
                             "base_mlp_dim=256", "base_num_query_heads=4", "base_num_kv_heads=2",
                             "head_dim=32", "max_prefill_predict_length=32",
                             "max_target_length=48", f"dtype={dtype}",
                             f"weight_dtype={dtype}"])
    mc = models.model_config(cfg, VOCAB, for_sampling=True)
    params = nnx.to_pure_dict(nnx.state(models.create_model(mc, 0), nnx.Param))
    engine = jax_engine(cfg, mc, jax.devices()[:1], pad_id=0, eos_ids=(1,))
    engine.load_weights(params)
    return engine


def samples(engine, path: str) -> None:
    """Greedy and sampled completions at fixed seeds, as lists."""
    prompts = [p for p in PROMPTS for _ in range(4)]
    out = {}
    for name, sampling in (("greedy", SamplingParams(max_new_tokens=16, greedy=True)),
                           ("sampled", SamplingParams(max_new_tokens=16, temperature=1.0))):
        for seed in (1, 2, 3):
            got = engine.generate(prompts, sampling, seed=seed)
            out[f"{name}/{seed}"] = [{"tokens": c.tokens.tolist(),
                                      "logprobs": c.logprobs.tolist()} for c in got]
    with open(path, "w") as f:
        json.dump(out, f)


def first_generates(engine) -> tuple[list[float], list[float]]:
    """Wall and process CPU seconds of the first two sampled generates (seeds 1, 2)."""
    prompts = [p for p in PROMPTS for _ in range(4)]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    times, cpu = [], []
    for seed in (1, 2):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.generate(prompts, sampling, seed=seed)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return times, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layers", type=int)
    parser.add_argument("--samples")
    args = parser.parse_args()
    engine = build(args.layers)
    times, cpu = first_generates(engine)
    (program,) = engine._programs.values()
    memory = program.memory_analysis()
    text = program.as_text()
    pool_shapes = {"{}[{}]".format(x.dtype.name.replace("float", "f"), ",".join(map(str, x.shape)))
                   for x in jax.tree.leaves(jax.eval_shape(lambda: engine._replica_model(0)
                                                           .empty_pool(engine.num_pages,
                                                                       engine.page_size)))}
    # Copies of a whole pool array in the optimized program (0: written in place).
    pool_copies = sum(1 for line in text.splitlines() if " copy(" in line
                      and any(f"= {shape}" in line for shape in pool_shapes))
    result = {"layers": args.layers, "first_generate_s": round(times[0], 2),
              "second_generate_s": round(times[1], 2),
              "compile_s": round(times[0] - times[1], 2),
              "first_generate_cpu_s": round(cpu[0], 2), "second_generate_cpu_s": round(cpu[1], 2),
              "hlo_chars": len(text), "pool_shapes": sorted(pool_shapes),
              "pool_copies": pool_copies,
              "temp_bytes": memory.temp_size_in_bytes,
              "argument_bytes": memory.argument_size_in_bytes,
              "alias_bytes": memory.alias_size_in_bytes,
              "pool_bytes": engine.pool_bytes,
              "load_average": os.getloadavg()[0]}
    if args.samples:
        samples(engine, args.samples)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
