"""Demo learning benches over named arms (bench.quant, bench.staleness): an arm is config keys
on top of bench.mismatch.Cell's (the jax engine, bfloat16 rollout weights, sampler_is=token),
every arm runs on the same seeds 0..N-1 (a seed fixes the prompt order and sampling, so seeds
pair the arms) at the demo recipe's step count, and the first arm is the base of the ratios.

Per arm (bench.mismatch's learning statistics): steps to --target accuracy (trailing --window
mean; a seed that never reaches it is charged the budget) per seed, their seed median [95% seed
bootstrap], seeds reached, final accuracy, the load average per launch; each other arm's ratio
of summed steps over the base's on paired seeds (bench.stats.seed_bootstrap_ratio); the demo
test's bar (trailing --window mean >= --bar over the last steps) per seed; under DA, the
staleness the runs record. Outputs under --out: runs/<cell>/steps.jsonl and bench_meta.json,
logs/, report.json, report.md.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tunix_mcjax.bench import learn, mismatch

BAR = 0.95  # the demo test's bar: trailing accuracy over the last window steps
MARKS = (10, 25, 50, 75, 100, 125, 150)  # steps the accuracy table reads (the demo's 150)
MODES = {"mcjax": "CO", "mcjax_da": "DA"}


@dataclasses.dataclass(frozen=True)
class Bench:
    """One bench: its title, the runtime of every launch, its arms (name: keys beyond the
    cell's, in launch order; the first is the base) and its default output directory."""

    title: str
    runtime: str  # rl_runtime
    arms: Mapping[str, tuple[str, ...]]
    out: Path

    @property
    def base(self) -> str:
        return next(iter(self.arms))


@dataclasses.dataclass(frozen=True)
class ArmCell(mismatch.Cell):
    """A demo learning launch of one arm (bench.mismatch.Cell's keys plus the arm's)."""

    label: str = ""
    keys: tuple[str, ...] = ()

    @property
    def arm(self) -> str:
        return self.label

    @property
    def name(self) -> str:
        mode = MODES[self.runtime].lower()
        return f"demo-{self.label.replace('+', '-')}-{mode}-tis{self.sampler_is}-s{self.seed}"

    def overrides(self) -> list[str]:
        return [*super().overrides(), *self.keys]


def plan(bench: Bench, seeds: int, hosts: int, devices_per_host: int,
         arms: Sequence[str] = ()) -> list[ArmCell]:
    """The arms (`arms`, else all) on each seed, seed by seed (a seed's arms run at about the
    same load)."""
    chosen = [a for a in bench.arms if not arms or a in arms]
    return [ArmCell("demo", "jax", "bfloat16", bench.runtime, "token", s, hosts,
                    devices_per_host, label=a, keys=tuple(bench.arms[a]))
            for s in range(seeds) for a in chosen]


def bar_met(result: learn.SeedResult, bar: float, window: int) -> bool:
    """The demo test's bar: the mean accuracy of the last `window` steps reaches `bar`."""
    return bool(result.final("accuracy", window) >= bar - 1e-12)


def summary(arms: dict[str, list[learn.SeedResult]], base: str, target: float, window: int,
            bar: float) -> dict:
    """bench.mismatch's learning summary of the arms (each other arm over `base`, when it ran),
    with each arm's seeds that meet the demo's bar."""
    pairs = [(a, base) for a in arms if a != base] if base in arms else []
    out = mismatch.learning_summary(arms, target, window, pairs)
    out["bar"] = bar
    for arm, rows in arms.items():
        met = [bar_met(r, bar, window) for r in rows]
        out["arms"][arm].update(bar_met=met, bar_met_count=int(np.sum(met)))
    return out


def staleness(records: Sequence[dict]) -> dict:
    """What a DA run records of its staleness: its batches (steps) by staleness 0, 1, .. (a
    batch's oldest version), and with in-flight updates its completion tokens by staleness and
    the completions spanning two versions; {} where nothing is recorded (CO)."""
    out: dict = {}
    if records and all("staleness" in r for r in records):
        out["batches"] = np.bincount([max(r["staleness"]) for r in records]).tolist()
    tokens = [r["token_staleness"] for r in records if "token_staleness" in r]
    if tokens:
        width = max(map(len, tokens))
        out["tokens"] = np.sum([np.pad(t, (0, width - len(t))) for t in tokens], 0).tolist()
        out["mixed_completions"] = int(sum(r.get("mixed_completions", 0) for r in records))
    return out


def add_counts(total: dict, more: dict) -> dict:
    """Two `staleness` dicts summed (count lists padded to the longer)."""
    out = dict(total)
    for key, value in more.items():
        if key == "mixed_completions":
            out[key] = out.get(key, 0) + value
            continue
        have = out.get(key, [])
        width = max(len(have), len(value))
        out[key] = (np.pad(have, (0, width - len(have)))
                    + np.pad(value, (0, width - len(value)))).astype(int).tolist()
    return out


def build_report(bench: Bench, cells: list[ArmCell], out: Path, args: argparse.Namespace,
                 steps: int) -> dict:
    """report.json's content: each launch's row and the arms' summary."""
    rows = [mismatch.cell_row(c, out, {}) for c in cells]
    results: dict[str, list[learn.SeedResult]] = {}
    for cell in sorted(cells, key=lambda c: c.seed):
        results.setdefault(cell.arm, []).append(learn.load_result(cell, out))
    rep = summary(results, bench.base, args.target, args.window, args.bar)
    for row, cell in zip(rows, cells, strict=True):
        row["arm"] = cell.arm
        block = rep["arms"][cell.arm]
        block.setdefault("loadavg_1m", []).append(row["loadavg_1m"])
        recorded = staleness(mismatch.load_run(cell, out)[0])
        if recorded:
            block["staleness"] = add_counts(block.get("staleness", {}), recorded)
    context = {"demo": str(mismatch.DEMO), "steps": steps, "hosts": args.hosts,
               "devices_per_host": args.devices_per_host, "seeds": args.seeds,
               "rl_runtime": bench.runtime, "sampler_is": "token",
               "arms": {a: list(bench.arms[a]) for a in results}}
    if bench.runtime == "mcjax_da":
        context["trainer_hosts"], context["rollout_hosts"] = da_split(cells[0])
    return {"context": context, "cells": rows, "learning": rep}


def da_split(cell: ArmCell) -> tuple[int, int]:
    """(trainer hosts, rollout hosts) the config makes of `cell`'s hosts under DA."""
    from tunix_mcjax.config import load_config
    from tunix_mcjax.config.rules import disaggregated_split

    return disaggregated_split(load_config(mismatch.DEMO, cell.overrides()), cell.hosts)


def staleness_markdown(arms: dict) -> list[str]:
    """The recorded staleness per arm ([] when no arm records it)."""
    lines = []
    for arm, block in arms.items():
        counts, parts = block.get("staleness", {}), []
        for key, what in (("batches", "batches"), ("tokens", "completion tokens")):
            if key in counts:
                total = sum(counts[key])
                parts.append(f"{what} by staleness " + ", ".join(
                    f"{k}: {n} ({n / total:.1%})" for k, n in enumerate(counts[key]) if n))
        if "mixed_completions" in counts:
            parts.append(f"{counts['mixed_completions']} completions span two versions")
        if parts:
            lines.append(f"- {arm}: " + "; ".join(parts))
    if not lines:
        return []
    return ["Staleness as the runs record it, over all steps and seeds (a batch's: the lag of "
            "its oldest version behind the update it feeds):", "", *lines, ""]


def markdown(bench: Bench, rep: dict) -> str:
    ctx, learning = rep["context"], rep["learning"]
    mode = MODES[bench.runtime]
    if "rollout_hosts" in ctx:
        mode += f" ({ctx['trainer_hosts']} trainer host, {ctx['rollout_hosts']} rollout host)"
    lines = [f"# {bench.title}", "",
             f"`{ctx['demo']}` for {ctx['steps']} steps on {ctx['hosts']} hosts x "
             f"{ctx['devices_per_host']} devices, {mode}, jax engine, bfloat16 rollout weights, "
             "sampler_is=token; arm keys: "
             + "; ".join(f"{a}: `{' '.join(k) or '-'}`" for a, k in ctx["arms"].items()) + ".",
             "", *mismatch.learning_markdown(learning, MARKS, label="arm"), "",
             f"The demo's bar (last {learning['window']} steps' accuracy >= "
             f"{learning['bar']:g}), seeds met: "
             + "; ".join(f"{a} {b['bar_met_count']}/{len(b['seeds'])}"
                         for a, b in learning["arms"].items()) + ".", "",
             *staleness_markdown(learning["arms"]),
             "Per launch (median over steps [95% block bootstrap]):", "",
             *mismatch.mismatch_markdown(rep["cells"]), ""]
    return "\n".join(lines)


def parse_args(bench: Bench, doc: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, default=bench.out)
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    p.add_argument("--arms", default="", help=f"comma-separated, of {', '.join(bench.arms)} "
                   "(default: all; the ratios need the first)")
    p.add_argument("--steps", type=int, default=0,
                   help="steps of each launch (default: the demo recipe's)")
    p.add_argument("--hosts", type=int, default=2, help="hosts of every launch")
    p.add_argument("--devices-per-host", type=int, default=2)
    p.add_argument("--target", type=float, default=0.9, help="accuracy target")
    p.add_argument("--bar", type=float, default=BAR, help="the demo's final-accuracy bar")
    p.add_argument("--window", type=int, default=10, help="trailing-mean window (steps)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per launch")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from the runs already in --out")
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    if bad := sorted(set(args.arms) - set(bench.arms)):
        p.error(f"--arms: unknown {', '.join(bad)}; choose from {', '.join(bench.arms)}")
    if min(args.seeds, args.hosts, args.devices_per_host, args.window) < 1 or args.steps < 0:
        p.error("--seeds, --hosts, --devices-per-host and --window must be >= 1, --steps >= 0")
    if not (0 < args.target <= 1 and 0 < args.bar <= 1):
        p.error("need 0 < --target <= 1 and 0 < --bar <= 1")
    return args


def main(bench: Bench, doc: str, argv: list[str] | None = None) -> None:
    from tunix_mcjax.config import load_config

    args = parse_args(bench, doc, argv)
    steps = args.steps or load_config(mismatch.DEMO, []).steps
    cells = plan(bench, args.seeds, args.hosts, args.devices_per_host, args.arms)
    if not args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        extra = {"demo": [f"steps={steps}"]}
        refused = mismatch.run_cells(cells, args.out, extra, {"demo": steps}, args.timeout_s)
        if refused:
            raise SystemExit(f"refused: {refused}")
    rep = build_report(bench, cells, args.out, args, steps)
    learn.write_report(args.out, rep, markdown(bench, rep))
    print(markdown(bench, rep))
