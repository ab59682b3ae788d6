"""Quantized rollout: does the demo learn with int8 weights and fp8 KV pages, TIS on?

    python -m tunix_mcjax.bench.quant --out bench_results/quant/learn [--seeds 5]

Arms, each on seeds 0..N-1 (a seed fixes the prompt order and sampling, so seeds pair the arms),
the demo recipe (recipes/cpu/demo.yml) at its own step count, CO (rl_runtime=mcjax), the jax
engine, sampler_is=token, H hosts x D devices:
  bf16        rollout_weight_dtype=bfloat16
  int8+fp8kv  the same, plus quantization=int8 quantize_kvcache=true kv_quant_dtype=fp8
Reported as bench.learn_arms reports an arm table: per arm, steps to --target (seed median
[95% seed bootstrap]), seeds reached, final accuracy, the demo's bar met per seed; the
int8+fp8kv / bf16 ratio of summed steps over paired seeds. Outputs under --out:
runs/<cell>/steps.jsonl and bench_meta.json, logs/, report.json, report.md.
"""

from __future__ import annotations

from pathlib import Path

from tunix_mcjax.bench import learn_arms

BASE, QUANT = "bf16", "int8+fp8kv"
BENCH = learn_arms.Bench(
    "Learning with quantized rollout weights and KV pages", "mcjax",
    {BASE: (), QUANT: ("quantization=int8", "quantize_kvcache=true", "kv_quant_dtype=fp8")},
    Path("bench_results/quant/learn"))


def main(argv: list[str] | None = None) -> None:
    learn_arms.main(BENCH, __doc__, argv)


if __name__ == "__main__":
    main()
