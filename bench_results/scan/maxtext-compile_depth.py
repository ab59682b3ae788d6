"""The maxtext engine's first generate (its compile) at a model depth: one JSON line on stdout.

    PYTHONPATH=<tree> python bench_results/scan/maxtext-compile_depth.py FAMILY LAYERS \
        [--samples FILE]

FAMILY is qwen3 (MaxText's dense Qwen3, a uniform layer stack) or gemma4 (Gemma4-26B's MoE,
blocks of five local layers and a global one; LAYERS a multiple of 6 scans whole blocks). A
narrow model (width 128, 4 query / 2 kv heads of 32, vocab 256, MaxText's scanned tree),
MaxText's init perturbed by seed-1 noise of scale 0.5 (as tests/test_maxtext_engine.py does, so
that tokens vary), fp32, on one CPU device; 8 prompts x 4 samples of up to 16 new tokens. The
first generate compiles the engine's program and runs it; the second runs it. Wall and process
CPU time (all threads) of each: on a shared machine the CPU time is the steadier figure.
`--samples FILE` also writes the tokens and logprobs of greedy and sampled runs at seeds 1-3
(`compare_samples.py` compares two such files).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
from flax import nnx
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

from tunix_mcjax.engine.base import SamplingParams
from tunix_mcjax.engine.maxtext_engine import MaxTextEngine
from tunix_mcjax.maxtext import load_maxtext_config, policy

PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i][: 1 + i % 3] + list(range(10 + i, 14 + 2 * i))
           for i in range(8)]
NARROW = ["override_model_config=true", "base_emb_dim=128", "base_num_query_heads=4",
          "base_num_kv_heads=2", "head_dim=32", "vocab_size=256", "weight_dtype=float32",
          "dtype=float32", "hardware=cpu", "attention=dot_product", "megablox=false",
          "sparse_matmul=false", "convert_checkpoint_if_possible=false", "log_config=false",
          "max_prefill_predict_length=32", "max_target_length=48"]
FAMILIES = {
    "qwen3": ["model_name=qwen3-0.6b", "base_mlp_dim=256"],
    "gemma4": ["model_name=gemma4-26b", "base_mlp_dim=256", "base_moe_mlp_dim=64",
               "num_experts=4", "num_experts_per_tok=2", "global_head_dim=64",
               "global_num_kv_heads=1", "sliding_window_size=8"],
}


def perturbed(params: nnx.State, seed: int = 1, scale: float = 0.5) -> nnx.State:
    key = jax.random.key(seed)
    for i, (_, var) in enumerate(nnx.to_flat_state(params)):
        value = var.get_value()
        noise = jax.random.normal(jax.random.fold_in(key, i), value.shape, value.dtype)
        var.set_value(value + scale * noise)
    return params


def build(family: str, layers: int) -> MaxTextEngine:
    args = ["", f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml", *FAMILIES[family], *NARROW,
            f"base_num_decoder_layers={layers}"]
    config, _ = load_maxtext_config(args, {})
    model, _ = policy.build_model(config, pad_id=0)
    _, params = policy.maxtext_policy(model, config)
    engine = MaxTextEngine(config, jax.devices()[:1], pad_id=0, eos_ids=(1,),
                           max_prompt_length=32, max_new_tokens=16, max_batch_size=32)
    engine.load_weights(policy.maxtext_tree(perturbed(params)))
    return engine


def samples(engine: MaxTextEngine, path: str) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("layers", type=int)
    parser.add_argument("--samples")
    args = parser.parse_args()
    engine = build(args.family, args.layers)
    prompts = [p for p in PROMPTS for _ in range(4)]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    times, cpu = [], []
    for seed in (1, 2):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.generate(prompts, sampling, seed=seed)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    (program,) = engine._programs.values()
    memory = program.memory_analysis()
    result = {"family": args.family, "layers": args.layers,
              "first_generate_s": round(times[0], 2), "second_generate_s": round(times[1], 2),
              "first_generate_cpu_s": round(cpu[0], 2), "second_generate_cpu_s": round(cpu[1], 2),
              "hlo_chars": len(program.as_text()), "temp_bytes": memory.temp_size_in_bytes,
              "argument_bytes": memory.argument_size_in_bytes,
              "alias_bytes": memory.alias_size_in_bytes, "load_average": os.getloadavg()[0]}
    if args.samples:
        samples(engine, args.samples)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
