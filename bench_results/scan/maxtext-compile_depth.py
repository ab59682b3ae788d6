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

import jax
from compile_depth import first_generates, samples  # this directory's, on sys.path
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

from tests.weights import perturbed
from tunix_mcjax.engine.maxtext_engine import MaxTextEngine
from tunix_mcjax.maxtext import load_maxtext_config, policy

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


def build(family: str, layers: int) -> MaxTextEngine:
    args = ["", f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml", *FAMILIES[family], *NARROW,
            f"base_num_decoder_layers={layers}"]
    config, _ = load_maxtext_config(args, {})
    model, _ = policy.build_model(config, pad_id=0)
    _, params = policy.maxtext_policy(model, config)
    engine = MaxTextEngine(config, jax.devices()[:1], pad_id=0, eos_ids=(1,),
                           max_prompt_length=32, max_new_tokens=16, max_batch_size=32)
    engine.load_weights(policy.maxtext_tree(perturbed(params, seed=1)))
    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("layers", type=int)
    parser.add_argument("--samples")
    args = parser.parse_args()
    engine = build(args.family, args.layers)
    times, cpu = first_generates(engine)
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
