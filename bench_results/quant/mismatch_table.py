"""The rollout-trainer mismatch (`mismatch_*`, docs/mismatch.md) of demo runs with bf16, int8
and fp8 rollout weights, and bf16 weights over int8, fp8 and per-tensor fp8 KV pages: per run, each metric's median over steps [95% block bootstrap] and max
(`bench.mismatch.mismatch_summary`). Writes mismatch.json beside this file and prints the
markdown table.

    PYTHONPATH=. python bench_results/quant/mismatch_table.py RUNS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tunix_mcjax.bench.mismatch import mismatch_summary

HERE = Path(__file__).parent
RUNS = ("demo-jax-bf16-co-s0", "demo-jax-bf16-int8-co-s0", "demo-jax-bf16-fp8-co-s0",
        "demo-jax-bf16-kvint8-co-s0", "demo-jax-bf16-kvfp8-co-s0",
        "demo-jax-bf16-kvfp8tensor-co-s0")


def summary(runs: Path, name: str) -> dict:
    steps = [json.loads(line) for line in (runs / name / "steps.jsonl").open()]
    meta = json.loads((runs / f"{name}.meta.json").read_text())
    return {"run": name, "steps": len(steps), "meta": meta,
            "final_accuracy": steps[-1]["accuracy"], **mismatch_summary(steps)}


def row(s: dict) -> str:
    cells = [f"{s[k]['median']:.2e} [{s[k]['ci_low']:.2e}, {s[k]['ci_high']:.2e}]"
             for k in ("mismatch_abs_mean", "mismatch_k3")]
    meta = s["meta"]
    return (f"| {s['run']} | {s['steps']} | {cells[0]} | {s['mismatch_abs_max']['max']:.2e} | "
            f"{cells[1]} | {s['mismatch_out_frac']['max']:.2e} | {s['final_accuracy']:.3f} | "
            f"{meta['loadavg_1m_before']:.1f}/{meta['loadavg_1m_after']:.1f} | {meta['code']} |")


def main(runs: Path) -> None:
    summaries = [summary(runs, name) for name in RUNS]
    (HERE / "mismatch.json").write_text(json.dumps(summaries, indent=1) + "\n")
    print("| run | steps | abs mean | abs max (max) | k3 | out of [0.5, 2] (max) | "
          "final acc | load 1m | commit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summaries:
        print(row(s))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
