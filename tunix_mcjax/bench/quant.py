"""Quantized rollout: does the demo learn with int8 weights and fp8 KV pages, TIS on?

    python -m tunix_mcjax.bench.quant --out bench_results/quant/learn [--seeds 5]

Arms, each on seeds 0..N-1 (a seed fixes the prompt order and sampling, so seeds pair the arms),
the demo recipe (recipes/cpu/demo.yml) at its own step count, CO (rl_runtime=mcjax), the jax
engine, sampler_is=token, H hosts x D devices:
  bf16        rollout_weight_dtype=bfloat16
  int8+fp8kv  the same, plus quantization=int8 quantize_kvcache=true kv_quant_dtype=fp8
Per arm (bench.mismatch's learning statistics): steps to --target accuracy (trailing --window
mean; a seed that never reaches it is charged the budget) per seed, their seed median [95% seed
bootstrap], seeds reached, final accuracy, the load average per launch; the int8+fp8kv / bf16
ratio of summed steps over paired seeds (bench.stats.seed_bootstrap_ratio); the demo test's bar
(trailing --window mean >= --bar over the last steps) per seed.
Outputs under --out: runs/<cell>/steps.jsonl and bench_meta.json, logs/, report.json, report.md.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from tunix_mcjax.bench import learn, mismatch

BASE, QUANT = "bf16", "int8+fp8kv"
# Arm name: its keys beyond bench.mismatch.Cell's (bfloat16 rollout weights, TIS on).
ARMS = {BASE: (), QUANT: ("quantization=int8", "quantize_kvcache=true", "kv_quant_dtype=fp8")}
BAR = 0.95  # the demo test's bar: trailing accuracy over the last window steps
MARKS = (10, 25, 50, 75, 100, 125, 150)  # steps the accuracy table reads (the demo's 150)


@dataclasses.dataclass(frozen=True)
class QuantCell(mismatch.Cell):
    """A demo learning launch of one arm (bench.mismatch.Cell's keys plus the arm's)."""

    quant: str = BASE

    @property
    def arm(self) -> str:
        return self.quant

    @property
    def name(self) -> str:
        return f"demo-{self.quant.replace('+', '-')}-co-tis{self.sampler_is}-s{self.seed}"

    def overrides(self) -> list[str]:
        return [*super().overrides(), *ARMS[self.quant]]


def plan(seeds: int, hosts: int, devices_per_host: int) -> list[QuantCell]:
    """Both arms on each seed, seed by seed (a seed's pair runs at about the same load)."""
    return [QuantCell("demo", "jax", "bfloat16", "mcjax", "token", s, hosts, devices_per_host,
                      quant=arm) for s in range(seeds) for arm in ARMS]


def bar_met(result: learn.SeedResult, bar: float, window: int) -> bool:
    """The demo test's bar: the mean accuracy of the last `window` steps reaches `bar`."""
    return bool(result.final("accuracy", window) >= bar - 1e-12)


def quant_summary(arms: dict[str, list[learn.SeedResult]], target: float, window: int,
                  bar: float) -> dict:
    """bench.mismatch's learning summary of the two arms (the ratio QUANT / BASE), with each
    arm's seeds that meet the demo's bar."""
    summary = mismatch.learning_summary(arms, target, window, pair=(QUANT, BASE))
    for arm, rows in arms.items():
        met = [bar_met(r, bar, window) for r in rows]
        summary["arms"][arm].update(bar=bar, bar_met=met, bar_met_count=int(np.sum(met)))
    return summary


def learning_arms(cells: list[QuantCell], out: Path) -> dict[str, list[learn.SeedResult]]:
    """The runs as bench.learn's SeedResults, per arm, by seed."""
    arms: dict[str, list[learn.SeedResult]] = {a: [] for a in ARMS}
    for cell in sorted(cells, key=lambda c: c.seed):
        arms[cell.arm].append(learn.load_result(cell, out))
    return arms


def build_report(cells: list[QuantCell], out: Path, args: argparse.Namespace) -> dict:
    """report.json's content: each launch's row and the arms' summary."""
    rows = [mismatch.cell_row(c, out, {}) for c in cells]
    for row, cell in zip(rows, cells, strict=True):
        row["arm"] = cell.arm
    summary = quant_summary(learning_arms(cells, out), args.target, args.window, args.bar)
    for arm, block in summary["arms"].items():
        block["loadavg_1m"] = [r["loadavg_1m"] for r in rows if r["arm"] == arm]
    context = {"demo": str(mismatch.DEMO), "hosts": args.hosts,
               "devices_per_host": args.devices_per_host, "seeds": args.seeds,
               "rl_runtime": "mcjax", "sampler_is": "token",
               "arms": {a: list(keys) for a, keys in ARMS.items()}}
    return {"context": context, "cells": rows, "learning": summary}


def markdown(rep: dict) -> str:
    ctx, summary = rep["context"], rep["learning"]
    lines = ["# Learning with quantized rollout weights and KV pages", "",
             f"`{ctx['demo']}` at its step count on {ctx['hosts']} hosts x "
             f"{ctx['devices_per_host']} devices, CO, jax engine, bfloat16 rollout weights, "
             "sampler_is=token; arm keys: "
             + "; ".join(f"{a}: `{' '.join(k) or '-'}`" for a, k in ctx["arms"].items()) + ".",
             "", *mismatch.learning_markdown(summary, MARKS, label="arm"), "",
             f"The demo's bar (last {summary['window']} steps' accuracy >= "
             f"{summary['arms'][BASE]['bar']:g}), seeds met: "
             + "; ".join(f"{a} {b['bar_met_count']}/{len(b['seeds'])}"
                         for a, b in summary["arms"].items()) + ".",
             "", "Per launch (median over steps [95% block bootstrap]):", "",
             *mismatch.mismatch_markdown(rep["cells"]), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, default=Path("bench_results/quant/learn"))
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    p.add_argument("--hosts", type=int, default=2, help="hosts of every launch")
    p.add_argument("--devices-per-host", type=int, default=2)
    p.add_argument("--target", type=float, default=0.9, help="accuracy target")
    p.add_argument("--bar", type=float, default=BAR, help="the demo's final-accuracy bar")
    p.add_argument("--window", type=int, default=10, help="trailing-mean window (steps)")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per launch")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from the runs already in --out")
    args = p.parse_args(argv)
    if min(args.seeds, args.hosts, args.devices_per_host, args.window) < 1:
        p.error("--seeds, --hosts, --devices-per-host and --window must be >= 1")
    if not (0 < args.target <= 1 and 0 < args.bar <= 1):
        p.error("need 0 < --target <= 1 and 0 < --bar <= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    from tunix_mcjax.config import load_config

    args = parse_args(argv)
    steps = load_config(mismatch.DEMO, []).steps
    cells = plan(args.seeds, args.hosts, args.devices_per_host)
    if not args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        extra = {"demo": [f"steps={steps}"]}
        refused = mismatch.run_cells(cells, args.out, extra, {"demo": steps}, args.timeout_s)
        if refused:
            raise SystemExit(f"refused: {refused}")
    rep = build_report(cells, args.out, args)
    rep["context"]["steps"] = steps
    learn.write_report(args.out, rep, markdown(rep))
    print(markdown(rep))


if __name__ == "__main__":
    main()
