"""Rollout/trainer mismatch study: the mismatch per step, and learning with and without TIS.

    python -m tunix_mcjax.bench.mismatch --out bench_results/mismatch [--steps 200 --seeds 3]

Cells, one launch each, run one at a time (--parts picks which):
  mismatch  the CPU demo recipe on H hosts x D devices, seed 0, --steps steps: engine (jax,
            maxtext) x rollout weights (rollout_weight_dtype float32, bfloat16) x runtime
            (rl_runtime=mcjax: CO; mcjax_da: DA, rl_trainer_hosts_fraction's default split).
            A combination the config refuses (at load, or when the launch builds its engine) is
            recorded with the refusal (refusals.json), not measured.
  maxtext   MaxText's CPU recipe (recipes/maxtext/cpu/qwen3_tiny.args through the MaxText
            adapter, where rollout_engine=maxtext runs): engine (jax, maxtext) x rollout weights,
            CO, seed 0, --maxtext-steps steps (num_batches), 2 hosts x 1 device. MaxText has no
            rollout_weight_dtype key: those cells record its refusal.
  learn     the demo in CO with bfloat16 rollout weights, sampler_is none against token (TIS),
            seeds 0..N-1 (a seed fixes the prompt order and sampling); `none` seed 0 is the
            mismatch part's CO bfloat16 jax cell.
  learn_da  the same under DA (rl_runtime=mcjax_da), where the engine is one update stale.
Statistics (pure functions, tests/test_bench_mismatch.py): per cell and metric, the median over
steps with a 95% bootstrap interval resampling blocks of bench.stats.BLOCK_STEPS consecutive steps
(consecutive steps are not independent), and the max over steps. Learning, per arm: steps to a
target accuracy (bench.learn.steps_to_target, trailing --window mean; a seed that never reaches
it is charged the step budget), its median over seeds with a seed-bootstrap interval, the
TIS/none ratio of summed steps (bench.stats.seed_bootstrap_ratio, seeds paired), and per step the
seed median of the window-mean accuracy with its seed-bootstrap band.
Outputs under --out: runs/<cell>/steps.jsonl and bench_meta.json (command, commit, load average),
logs/, refusals.json, report.json, report.md, curves.png. Parts may run in separate calls; a
final --report-only over all parts rebuilds the report from what is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tunix_mcjax.bench import learn, stats

METRICS = ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_seq_log_ratio", "mismatch_k3",
           "mismatch_out_frac")
PARTS = ("mismatch", "maxtext", "learn", "learn_da")
MODES = {"mcjax": "learn", "mcjax_da": "learn_da"}  # rl_runtime: its learning part
DEMO = Path("recipes/cpu/demo.yml")
MAXTEXT_ARGS = Path("recipes/maxtext/cpu/qwen3_tiny.args")
MAXTEXT_RL_YML = "src/maxtext/configs/post_train/rl.yml"
# Keys of MAXTEXT_ARGS that the study sets itself.
MAXTEXT_OWN = ("num_batches=", "num_test_batches=", "run_name=", "base_output_directory=")


# --- statistics (pure) -----------------------------------------------------------------------

def _interval(draws: np.ndarray, point: float, confidence: float) -> stats.Interval:
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return stats.Interval(float(point), float(low), float(high))


def step_median(values: Sequence[float], *, block: int = stats.BLOCK_STEPS,
                resamples: int = stats.RESAMPLES, confidence: float = stats.CONFIDENCE,
                seed: int = 0) -> stats.Interval:
    """Median over a run's steps, with a circular block bootstrap interval (blocks of `block`
    consecutive steps). Values may be signed or zero; they must be finite."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"need a non-empty 1-D finite sample, got shape {x.shape}")
    if resamples < 1 or block < 1 or not 0 < confidence < 1:
        raise ValueError("need resamples >= 1, block >= 1 and 0 < confidence < 1")
    rng = np.random.default_rng(seed)
    draws = stats.resampled_medians([x], min(block, x.size), resamples, rng)
    return _interval(draws, float(np.median(x)), confidence)


def mismatch_summary(records: Sequence[dict], seed: int = 0) -> dict:
    """Per metric: the median over steps [interval] and the max over steps."""
    out = {}
    for key in METRICS:
        values = [float(r[key]) for r in records]
        med = step_median(values, seed=seed)
        out[key] = {**med.as_dict(), "max": float(np.max(values))}
    return out


def seed_band(curves: Sequence[Sequence[float]], *, resamples: int = stats.RESAMPLES,
              confidence: float = stats.CONFIDENCE, seed: int = 0) -> tuple[np.ndarray, ...]:
    """(median, low, high) per column of a seeds x steps array: the median over seeds, and a
    percentile bootstrap that resamples whole seeds (rows) with replacement."""
    x = np.asarray(curves, dtype=np.float64)
    if x.ndim != 2 or 0 in x.shape:
        raise ValueError(f"need a non-empty seeds x steps array, got shape {x.shape}")
    idx = np.random.default_rng(seed).integers(0, x.shape[0], size=(resamples, x.shape[0]))
    draws = np.median(x[idx], axis=1)  # resamples x steps
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail], axis=0)
    return np.median(x, axis=0), low, high


def moving_mean(values: Sequence[float], window: int) -> np.ndarray:
    """The trailing `window`-step mean, from step `window` on (as steps_to_target reads it)."""
    return np.convolve(np.asarray(values, dtype=np.float64), np.ones(window) / window, "valid")


def arm_summary(results: Sequence[learn.SeedResult], target: float, window: int) -> dict:
    """One learning arm over its seeds: steps to target (charged at the budget when missed),
    their seed median [interval], final accuracy and reward (last `window` steps)."""
    reached = [r.steps_to(target, window) for r in results]
    charged = [float(n if n is not None else len(r.accuracy))
               for n, r in zip(reached, results, strict=True)]
    med, low, high = (float(v[0]) for v in seed_band(np.asarray(charged)[:, None]))
    finals = {k: [r.final(k, window) for r in results] for k in ("accuracy", "reward")}
    return {"seeds": [r.seed for r in results], "steps_to_target": reached,
            "charged": charged, "reached": sum(n is not None for n in reached),
            "steps_to_target_median": {"median": med, "ci_low": low, "ci_high": high},
            "final_accuracy": finals["accuracy"], "final_reward": finals["reward"],
            "final_accuracy_median": float(np.median(finals["accuracy"])),
            "final_reward_median": float(np.median(finals["reward"]))}


def learning_summary(arms: dict[str, Sequence[learn.SeedResult]], target: float,
                     window: int, pairs: Sequence[tuple[str, str]] = (("token", "none"),)
                     ) -> dict:
    """Each arm's summary and per-step band of the window-mean accuracy, and for each
    (numerator, denominator) of `pairs` their ratio of summed charged steps over paired seeds
    (under `ratio_<numerator>_over_<denominator>`). Every arm must have the same seeds."""
    needed = {a for pair in pairs for a in pair}
    if not arms:
        raise ValueError("need at least one arm's runs")
    if needed - set(arms):
        raise ValueError(f"need arms {' and '.join(map(repr, sorted(needed)))}, got "
                         f"{sorted(arms)}")
    seeds = {a: [r.seed for r in rs] for a, rs in arms.items()}
    if len({tuple(s) for s in seeds.values()}) > 1:
        raise ValueError(f"arms must have the same seeds in order: {seeds}")
    rows = {a: arm_summary(rs, target, window) for a, rs in arms.items()}
    ratios = {f"ratio_{num}_over_{den}": stats.seed_bootstrap_ratio(
        rows[num]["charged"], rows[den]["charged"]).as_dict() for num, den in pairs}
    bands = {}
    for a, rs in arms.items():
        steps = min(len(r.accuracy) for r in rs)
        med, low, high = seed_band([moving_mean(r.accuracy[:steps], window) for r in rs])
        bands[a] = {"first_step": window, "median": med.tolist(), "ci_low": low.tolist(),
                    "ci_high": high.tolist()}
    return {"target": target, "window": window, "arms": rows, "curves": bands,
            "pairs": [list(pair) for pair in pairs], **ratios,
            "censored": any(r["reached"] < len(r["seeds"]) for r in rows.values())}


# --- the matrix ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
    """One launch (the interface `bench.step.execute` runs; `arm` and `seed` as bench.learn's)."""

    recipe: str  # "demo" or "maxtext"
    engine: str
    weights: str  # rollout_weight_dtype
    runtime: str  # rl_runtime
    sampler_is: str = "none"
    seed: int = 0
    hosts: int = 2
    devices_per_host: int = 2

    @property
    def arm(self) -> str:
        return self.sampler_is

    @property
    def name(self) -> str:
        dtype = {"float32": "fp32", "bfloat16": "bf16"}[self.weights]
        mode = {"mcjax": "co", "mcjax_da": "da"}[self.runtime]
        tis = "" if self.sampler_is == "none" else f"-tis{self.sampler_is}"
        return f"{self.recipe}-{self.engine}-{dtype}-{mode}{tis}-s{self.seed}"

    def overrides(self) -> list[str]:
        """The cell's keys. MaxText's recipe trains in float32 (weight_dtype) and has no
        rollout_weight_dtype key: its float32 cells leave the key out."""
        keys = [f"rollout_engine={self.engine}", f"rl_runtime={self.runtime}"]
        if self.recipe == "demo" or self.weights != "float32":
            keys.append(f"rollout_weight_dtype={self.weights}")
        if self.recipe == "demo":
            keys += [f"sampler_is={self.sampler_is}", f"seed={self.seed}"]
        return keys

    def command(self, recipe: Path, out: Path, extra: list[str]) -> list[str]:
        keys = [*extra, *self.overrides(), f"run_name={self.name}",
                f"base_output_directory={out / 'runs'}"]
        hosts = ["--hosts", str(self.hosts), "--devices-per-host", str(self.devices_per_host)]
        if self.recipe == "maxtext":
            return [sys.executable, "-m", "tunix_mcjax.maxtext.launch", *hosts, MAXTEXT_RL_YML,
                    *maxtext_args(), *keys]
        return [sys.executable, "-m", "tunix_mcjax.launch", *hosts, str(recipe), *keys]


def maxtext_args() -> list[str]:
    """MaxText's CPU recipe's key=value lines, less the ones the study sets."""
    lines = [s.strip() for s in MAXTEXT_ARGS.read_text().splitlines()]
    return [s for s in lines if s and not s.startswith("#") and not s.startswith(MAXTEXT_OWN)]


def plan(parts: Sequence[str], seeds: int, hosts: int, devices_per_host: int,
         da_seeds: int | None = None) -> list[Cell]:
    """The cells of `parts`, each once, in launch order (learn_da: `da_seeds`, else `seeds`)."""
    layout = {"hosts": hosts, "devices_per_host": devices_per_host}
    cells: list[Cell] = []
    if "mismatch" in parts:
        cells += [Cell("demo", e, w, r, **layout) for r in ("mcjax", "mcjax_da")
                  for e in ("jax", "maxtext") for w in ("float32", "bfloat16")]
    for runtime, part in MODES.items():
        if part in parts:
            n = da_seeds if runtime == "mcjax_da" and da_seeds else seeds
            cells += [Cell("demo", "jax", "bfloat16", runtime, tis, s, **layout)
                      for s in range(n) for tis in ("none", "token")]
    if "maxtext" in parts:
        cells += [Cell("maxtext", e, w, "mcjax", hosts=hosts, devices_per_host=1)
                  for e in ("jax", "maxtext") for w in ("float32", "bfloat16")]
    return list(dict.fromkeys(cells))


def config_refusal(cell: Cell, extra: list[str]) -> str:
    """The demo config's refusal of `cell` ('' when it loads)."""
    from tunix_mcjax.config import ConfigError, load_config

    if cell.recipe != "demo":
        return ""
    try:
        load_config(DEMO, [*extra, *cell.overrides()])
    except ConfigError as e:
        return str(e)
    return ""


def launch_refusal(log_text: str) -> str:
    """The config error a failed launch's log names, as the launch reports a host's ConfigError
    (`host N: config error: ...`); '' when it failed otherwise."""
    found = re.findall(r"host \d+: config error: (.+)", log_text)
    return found[0].strip() if found else ""


def maxtext_refusal(cell: Cell, extra: list[str]) -> str:
    """MaxText's adapter's refusal of `cell`'s keys ('' when they load), as its launch would
    check them; MaxText's own 'not in <its keys>' error is cut after the key's name."""
    from tunix_mcjax.config import ConfigError
    from tunix_mcjax.maxtext import checked_config

    argv = ["", MAXTEXT_RL_YML, *maxtext_args(), *extra, *cell.overrides()]
    try:
        checked_config(argv, {}, cell.hosts)
    except (ConfigError, ValueError) as e:
        text = str(e).splitlines()[0]
        return (f"MaxText's config: {text.split(' not in ')[0]} is not among its keys"
                if " not in " in text else text)
    return ""


# --- runs ------------------------------------------------------------------------------------

def run_cells(cells: list[Cell], out: Path, extra: dict[str, list[str]],
              steps: dict[str, int], timeout_s: float) -> dict[str, str]:
    """Launches each cell not measured yet in turn; returns {cell name: refusal} for those
    refused."""
    from tunix_mcjax.bench.step import execute

    refusals: dict[str, str] = {}
    for i, cell in enumerate(cells, 1):
        if (out / "runs" / cell.name / "bench_meta.json").is_file():
            print(f"[{i}/{len(cells)}] {cell.name}: measured already (remove its run to redo)")
            continue
        keys = extra[cell.recipe]
        why = (maxtext_refusal if cell.recipe == "maxtext" else config_refusal)(cell, keys)
        print(f"[{i}/{len(cells)}] {cell.name}" + (f": refused ({why})" if why else ""),
              flush=True)
        if why:
            refusals[cell.name] = why
            continue
        try:
            meta = execute(cell, DEMO, out, keys, steps[cell.recipe], timeout_s)
        except RuntimeError:
            why = launch_refusal((out / "logs" / f"{cell.name}.log").read_text())
            if not why:
                raise
            refusals[cell.name] = f"at launch: {why}"
            print(f"  refused at launch: {why}", flush=True)
            continue
        print(f"  done in {meta['wall_s']:.0f}s", flush=True)
    return refusals


def load_run(cell: Cell, out: Path) -> tuple[list[dict], dict]:
    """A measured cell's step records (in step order) and its bench_meta.json."""
    run_dir = out / "runs" / cell.name
    steps_file = run_dir / "steps.jsonl"
    if not steps_file.is_file():
        raise FileNotFoundError(f"{steps_file} not found: run without --report-only first")
    records = sorted((json.loads(s) for s in steps_file.read_text().splitlines() if s.strip()),
                     key=lambda r: r["step"])
    return records, json.loads((run_dir / "bench_meta.json").read_text())


def cell_row(cell: Cell, out: Path, refusals: dict[str, str]) -> dict:
    """One cell of report.json: its refusal, or its mismatch summary with provenance."""
    row = {"cell": cell.name, "recipe": cell.recipe, "engine": cell.engine,
           "rollout_weight_dtype": cell.weights, "rl_runtime": cell.runtime,
           "sampler_is": cell.sampler_is, "seed": cell.seed}
    if cell.name in refusals:
        return {**row, "refused": refusals[cell.name]}
    records, meta = load_run(cell, out)
    if cell.sampler_is != "none":
        row["sampler_is_weight_mean"] = step_median(
            [r["sampler_is_weight_mean"] for r in records]).as_dict()
    return {**row, "steps": len(records), "mismatch": mismatch_summary(records),
            "final_accuracy": float(np.mean([r["accuracy"] for r in records[-10:]])),
            "steps_file": f"runs/{cell.name}/steps.jsonl", "commit": meta["code"],
            "wall_s": meta["wall_s"], "loadavg_1m": [meta["loadavg_1m_before"],
                                                    meta["loadavg_1m_after"]]}


def learning_arms(cells: list[Cell], out: Path, runtime: str
                  ) -> dict[str, list[learn.SeedResult]]:
    """A learning part's runs as bench.learn's SeedResults, per sampler_is arm, by seed."""
    arms: dict[str, list[learn.SeedResult]] = {}
    for cell in sorted((c for c in cells if c.recipe == "demo" and c.runtime == runtime
                        and c.engine == "jax" and c.weights == "bfloat16"),
                       key=lambda c: c.seed):
        arms.setdefault(cell.arm, []).append(learn.load_result(cell, out))
    return arms


def build_report(cells: list[Cell], out: Path, refusals: dict[str, str], target: float,
                 window: int, context: dict) -> dict:
    """report.json's content: every cell's row and, per learning part, its summary (under
    `learning`, by rl_runtime)."""
    rows = [cell_row(c, out, refusals) for c in cells]
    rep = {"context": context, "cells": rows, "learning": {}}
    for runtime in MODES:
        if not any(c.runtime == runtime and c.sampler_is == "token" for c in cells):
            continue
        summary = learning_summary(learning_arms(cells, out, runtime), target, window)
        for arm, block in summary["arms"].items():
            block["loadavg_1m"] = [r["loadavg_1m"] for r in rows if "refused" not in r
                                   and r["sampler_is"] == arm and r["engine"] == "jax"
                                   and r["rl_runtime"] == runtime and r["recipe"] == "demo"
                                   and r["rollout_weight_dtype"] == "bfloat16"]
        rep["learning"][runtime] = summary
    return rep


# --- report ----------------------------------------------------------------------------------

def _ci(block: dict, fmt: str = ".2e") -> str:
    return f"{block['median']:{fmt}} [{block['ci_low']:{fmt}}, {block['ci_high']:{fmt}}]"


def _load(row: dict) -> str:
    return "/".join(f"{v:.1f}" for v in row["loadavg_1m"])


def mismatch_markdown(rows: list[dict]) -> list[str]:
    lines = ["| cell | mode | engine | rollout weights | steps | abs mean | abs max (max) "
             "| seq log-ratio | k3 | out of [0.5, 2] (max) | final acc | load 1m | commit "
             "| result file |", "|---" * 14 + "|"]
    for r in rows:
        head = (f"| {r['cell']} | {'CO' if r['rl_runtime'] == 'mcjax' else 'DA'} "
                f"| {r['engine']} | {r['rollout_weight_dtype']} |")
        if "refused" in r:
            lines.append(head + f" refused: {r['refused']} |" + " |" * 9)
            continue
        m = r["mismatch"]
        lines.append(
            head + f" {r['steps']} | {_ci(m['mismatch_abs_mean'])} "
            f"| {m['mismatch_abs_max']['max']:.2e} | {_ci(m['mismatch_seq_log_ratio'])} "
            f"| {_ci(m['mismatch_k3'])} | {m['mismatch_out_frac']['median']:.2e} "
            f"({m['mismatch_out_frac']['max']:.2e}) | {r['final_accuracy']:.3f} "
            f"| {_load(r)} | {r['commit']} | `{r['steps_file']}` |")
    return lines


def learning_markdown(summary: dict, marks: Sequence[int] = (10, 25, 50, 75, 100, 150, 200),
                      label: str = "sampler_is") -> list[str]:
    """A learning summary's tables; `label` heads the arm column."""
    t, w = summary["target"], summary["window"]
    lines = [f"Steps to {t:g} accuracy ({w}-step trailing mean; `-`: not reached, charged at "
             "the budget): per seed, and the seed median [95% seed bootstrap].", "",
             f"| {label} | per seed | median [95%] | reached | final accuracy (median) "
             "| final reward (median) | load 1m per run |", "|---" * 7 + "|"]
    for arm, a in summary["arms"].items():
        per_seed = ", ".join("-" if n is None else str(n) for n in a["steps_to_target"])
        loads = "; ".join("/".join(f"{v:.1f}" for v in pair) for pair in a["loadavg_1m"])
        lines.append(f"| {arm} | {per_seed} | {_ci(a['steps_to_target_median'], '.0f')} "
                     f"| {a['reached']}/{len(a['seeds'])} | {a['final_accuracy_median']:.3f} "
                     f"| {a['final_reward_median']:.3f} | {loads} |")
    arms = summary["arms"]
    for num, den in summary["pairs"]:
        censored = any(arms[a]["reached"] < len(arms[a]["seeds"]) for a in (num, den))
        lines += ["", f"{num} / {den}, summed steps to target over paired seeds: "
                  f"{_ci(summary[f'ratio_{num}_over_{den}'], '.3f')}"
                  f"{' (censored)' if censored else ''}."]
    lines += ["", f"Accuracy ({w}-step trailing mean), seed median [95% seed bootstrap] at step:",
              "", f"| {label} | " + " | ".join(str(s) for s in marks) + " |",
              "|---" * (len(marks) + 1) + "|"]
    for arm, band in summary["curves"].items():
        cells = []
        for s in marks:
            i = s - band["first_step"]
            cells.append("" if not 0 <= i < len(band["median"]) else
                         f"{band['median'][i]:.2f} [{band['ci_low'][i]:.2f}, "
                         f"{band['ci_high'][i]:.2f}]")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def markdown(rep: dict) -> str:
    ctx = rep["context"]
    lines = ["# Rollout/trainer mismatch study", "",
             f"Demo: `{ctx['demo']}` on {ctx['hosts']} hosts x {ctx['devices_per_host']} "
             f"devices, {ctx['steps']} steps; MaxText: `{ctx['maxtext_args']}`, "
             f"{ctx['maxtext_steps']} steps. Per step metric: median over steps [95% block "
             "bootstrap]; abs max and out-of-bounds share also their max over steps. Load 1m: "
             "the machine's 1-minute load average before/after the launch.", "",
             *mismatch_markdown(rep["cells"]), ""]
    for runtime, summary in rep["learning"].items():
        mode = "CO" if runtime == "mcjax" else "DA"
        lines += [f"## Learning with and without TIS ({mode}, bfloat16 rollout weights)", "",
                  *learning_markdown(summary), ""]
    return "\n".join(lines)


def plot(rep: dict, out: Path) -> Path:
    """curves.png: the mismatch per step of each measured cell; the learning bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    for row in (r for r in rep["cells"] if "refused" not in r and r["seed"] == 0
                and r["sampler_is"] == "none"):
        records, _ = load_run(Cell(row["recipe"], row["engine"], row["rollout_weight_dtype"],
                                   row["rl_runtime"]), out)
        left.semilogy([r["step"] + 1 for r in records],
                      [max(r["mismatch_abs_mean"], 1e-9) for r in records], lw=0.9,
                      label=row["cell"].removesuffix("-s0"))
    left.set_xlabel("step")
    left.set_ylabel("mismatch_abs_mean")
    left.legend(fontsize=7)
    for runtime, summary in rep["learning"].items():
        for arm, band in summary["curves"].items():
            x = np.arange(len(band["median"])) + band["first_step"]
            right.plot(x, band["median"], ls="-" if runtime == "mcjax" else "--",
                       label=f"{'CO' if runtime == 'mcjax' else 'DA'} sampler_is={arm}")
            right.fill_between(x, band["ci_low"], band["ci_high"], alpha=0.2)
        right.axhline(summary["target"], color="grey", ls=":", lw=0.8)
    if rep["learning"]:
        right.set_xlabel("step")
        right.set_ylabel("accuracy (trailing mean), seed median")
        right.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
    return out / "curves.png"


# --- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, default=Path("bench_results/mismatch"),
                   help="output directory")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--steps", type=int, default=200, help="steps of each demo launch")
    p.add_argument("--maxtext-steps", type=int, default=30,
                   help="steps (num_batches) of each MaxText launch; its recipe's parquet holds "
                   "32 batches")
    p.add_argument("--seeds", type=int, default=3, help="learning parts: seeds 0..N-1")
    p.add_argument("--da-seeds", type=int, default=0, help="learn_da's seeds (0: --seeds)")
    p.add_argument("--hosts", type=int, default=2, help="hosts of every launch")
    p.add_argument("--devices-per-host", type=int, default=2, help="demo launches' (MaxText's: 1)")
    p.add_argument("--target", type=float, default=0.9, help="accuracy target")
    p.add_argument("--window", type=int, default=10, help="trailing-mean window (steps)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per launch")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from the runs already in --out")
    args = p.parse_args(argv)
    args.parts = [s for s in args.parts.split(",") if s]
    if bad := sorted(set(args.parts) - set(PARTS)):
        p.error(f"--parts: unknown {', '.join(bad)}; choose from {', '.join(PARTS)}")
    if min(args.steps, args.maxtext_steps, args.seeds, args.window) < 1 or args.da_seeds < 0:
        p.error("--steps, --maxtext-steps, --seeds and --window must be >= 1, --da-seeds >= 0")
    if not 0 < args.target <= 1:
        p.error("need 0 < --target <= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out: Path = args.out
    cells = plan(args.parts, args.seeds, args.hosts, args.devices_per_host, args.da_seeds)
    extra = {"demo": [f"steps={args.steps}"],
             "maxtext": [f"num_batches={args.maxtext_steps}", "num_test_batches=0"]}
    refusals_file = out / "refusals.json"
    refusals = json.loads(refusals_file.read_text()) if refusals_file.is_file() else {}
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        refusals = {k: v for k, v in refusals.items() if k not in {c.name for c in cells}}
        refusals.update(run_cells(cells, out, extra,
                                  {"demo": args.steps, "maxtext": args.maxtext_steps},
                                  args.timeout_s))
        refusals_file.write_text(json.dumps(refusals, indent=2) + "\n")
    context = {"demo": str(DEMO), "maxtext_args": str(MAXTEXT_ARGS), "steps": args.steps,
               "maxtext_steps": args.maxtext_steps, "hosts": args.hosts,
               "devices_per_host": args.devices_per_host, "seeds": args.seeds,
               "da_seeds": args.da_seeds or args.seeds,
               "parts": args.parts}
    rep = build_report(cells, out, refusals, args.target, args.window, context)
    learn.write_report(out, rep, markdown(rep))
    print(f"wrote {plot(rep, out)}")
    print(markdown(rep))


if __name__ == "__main__":
    main()
