"""Learning-curve parity: stock Tunix and McJAX train the same GRPO from the same weights.

    python -m tunix_mcjax.bench.learn --task next_digit --seeds 5 [--hosts 2 --devices-per-host 2]

Arms, over seeds 0..N-1 (a seed fixes the prompt order and the sampling seeds of both arms):
  tunix  stock Tunix GRPOLearner + RLCluster (vanilla rollout), one process (bench.tunix_arm)
  mcjax  our colocated runtime on H hosts x D devices (tunix_mcjax.launch)
Both start from ONE checkpoint, written once as Hugging Face safetensors under <out>/init and
loaded by both through `load_parameters_path`, and run the same recipe, task and batches.

Per arm and seed: steps to a target accuracy (the first step count n at which the mean accuracy
of steps n-W+1..n reaches the target; W=10 by default) and the final reward (mean of the last W
steps). The verdict is the ratio mcjax / tunix of steps-to-target summed over seeds, with a 95%
seed bootstrap (seeds resampled with replacement, the same seeds for both arms since a seed pairs
their prompt orders), as the paper's Appendix I charges cost-to-learn. A seed that never reaches
the target is charged the full step budget (a lower bound), and the report says so.
Outputs: <out>/report.json, report.md, curves.png; each run's steps.jsonl under <out>/runs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tunix_mcjax.bench.stats import seed_bootstrap_ratio

ARMS = ("tunix", "mcjax")
PARITY_BOUND = 1.2  # acceptance: mcjax needs at most 1.2x Tunix's steps to the target


# --- statistics (pure) -----------------------------------------------------------------------

def steps_to_target(accuracy: Sequence[float], target: float, window: int) -> int | None:
    """Steps trained when the trailing `window`-step mean accuracy first reaches `target`."""
    acc = np.asarray(accuracy, dtype=np.float64)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if acc.size < window:
        return None
    means = np.convolve(acc, np.ones(window) / window, mode="valid")
    hit = np.flatnonzero(means >= target - 1e-12)
    return int(hit[0]) + window if hit.size else None


@dataclasses.dataclass(frozen=True)
class SeedResult:
    arm: str
    seed: int
    accuracy: list[float]
    reward: list[float]

    def steps_to(self, target: float, window: int) -> int | None:
        return steps_to_target(self.accuracy, target, window)

    def final(self, key: str, window: int) -> float:
        return float(np.mean(getattr(self, key)[-window:]))


def summarize(results: list[SeedResult], target: float, window: int,
              seed: int = 0) -> dict:
    """Per-arm rows and the mcjax/tunix ratio of steps-to-target (charged at the budget)."""
    seeds = sorted({r.seed for r in results})
    by = {(r.arm, r.seed): r for r in results}
    missing = [f"{a}-s{s}" for a in ARMS for s in seeds if (a, s) not in by]
    if missing:
        raise ValueError(f"runs missing: {', '.join(missing)}")
    arms: dict[str, dict] = {}
    charged: dict[str, list[float]] = {}
    for arm in ARMS:
        rows = [by[(arm, s)] for s in seeds]
        reached = [r.steps_to(target, window) for r in rows]
        charged[arm] = [float(n if n is not None else len(r.accuracy))
                        for n, r in zip(reached, rows, strict=True)]
        arms[arm] = {
            "steps_to_target": reached,
            "reached": sum(n is not None for n in reached),
            "steps_to_target_mean": float(np.mean(charged[arm])),
            "final_reward": [r.final("reward", window) for r in rows],
            "final_accuracy": [r.final("accuracy", window) for r in rows],
            "final_reward_mean": float(np.mean([r.final("reward", window) for r in rows])),
        }
    ratio = seed_bootstrap_ratio(charged["mcjax"], charged["tunix"], seed=seed)
    censored = any(arms[a]["reached"] < len(seeds) for a in ARMS)
    return {"seeds": seeds, "target": target, "window": window, "arms": arms,
            "ratio_mcjax_over_tunix": {"point": ratio.point, "ci_low": ratio.low,
                                       "ci_high": ratio.high},
            "censored": censored, "parity_bound": PARITY_BOUND,
            "within_bound": ratio.point <= PARITY_BOUND and not censored}


# --- runs ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LearnRun:
    """One launch: an arm on one seed (the interface `bench.step.execute` runs)."""

    arm: str
    seed: int
    hosts: int
    devices_per_host: int
    tunix_devices: int

    @property
    def name(self) -> str:
        return f"{self.arm}-s{self.seed}"

    def command(self, recipe: Path, out: Path, extra: list[str]) -> list[str]:
        keys = [*extra, f"seed={self.seed}", f"run_name={self.name}",
                f"base_output_directory={out / 'runs'}"]
        if self.arm == "tunix":
            layout = "fsdp" if self.tunix_devices > 1 else "one-device"
            return [sys.executable, "-m", "tunix_mcjax.bench.tunix_arm", "--devices",
                    str(self.tunix_devices), "--layout", layout, str(recipe), *keys]
        return [sys.executable, "-m", "tunix_mcjax.launch", "--hosts", str(self.hosts),
                "--devices-per-host", str(self.devices_per_host), str(recipe), *keys]


def write_initial_checkpoint(recipe: Path, overrides: list[str], path: Path) -> Path:
    """The recipe's random-init model, written once; both arms load it."""
    from tunix_mcjax import models
    from tunix_mcjax.config import load_config
    from tunix_mcjax.tokenizer import load_tokenizer

    cfg = load_config(recipe, overrides)
    mc = models.model_config(cfg, len(load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path)))
    return models.save_safetensors(models.create_model(mc, cfg.init_weights_seed), mc, path)


def load_result(run: LearnRun, out: Path) -> SeedResult:
    steps_file = out / "runs" / run.name / "steps.jsonl"
    if not steps_file.is_file():
        raise FileNotFoundError(f"{steps_file} not found: run without --report-only first")
    recs = sorted((json.loads(line) for line in steps_file.read_text().splitlines()
                   if line.strip()), key=lambda r: r["step"])
    return SeedResult(run.arm, run.seed, [float(r["accuracy"]) for r in recs],
                      [float(r["reward_mean"]) for r in recs])


# --- report ----------------------------------------------------------------------------------

def markdown(rep: dict) -> str:
    ratio = rep["ratio_mcjax_over_tunix"]
    t, w = rep["target"], rep["window"]
    lines = [f"# Learning parity: {rep['context']['task']}, {len(rep['seeds'])} seeds", "",
             f"Steps to {t:g} accuracy ({w}-step moving average); `-`: not reached in "
             f"{rep['context']['steps']} steps (charged at the budget). mcjax: "
             f"{rep['context']['hosts']} hosts x {rep['context']['devices_per_host']} devices; "
             f"tunix: stock Tunix, one process. Same initial checkpoint for both.", "",
             "| arm | " + " | ".join(f"seed {s}" for s in rep["seeds"])
             + " | mean | reached | final reward (mean) |",
             "|---|" + "---|" * len(rep["seeds"]) + "---|---|---|"]
    for arm in ARMS:
        a = rep["arms"][arm]
        cells = ["-" if n is None else str(n) for n in a["steps_to_target"]]
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {a['steps_to_target_mean']:.1f} "
                     f"| {a['reached']}/{len(rep['seeds'])} | {a['final_reward_mean']:.3f} |")
    verdict = "within" if rep["within_bound"] else "NOT within"
    lines += ["", f"mcjax / tunix steps to target: **{ratio['point']:.3f}** "
              f"[{ratio['ci_low']:.3f}, {ratio['ci_high']:.3f}] (95% seed bootstrap); "
              f"{verdict} the {rep['parity_bound']}x bound"
              + (" (censored: a seed did not reach the target)" if rep["censored"] else "")
              + ".", ""]
    return "\n".join(lines)


def plot(results: list[SeedResult], rep: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds, w = rep["seeds"], rep["window"]
    fig, axes = plt.subplots(1, len(seeds), figsize=(3.2 * len(seeds), 3.0), sharey=True,
                             squeeze=False)
    colors = {"tunix": "tab:blue", "mcjax": "tab:orange"}
    for ax, seed in zip(axes[0], seeds, strict=True):
        for r in (r for r in results if r.seed == seed):
            acc = np.asarray(r.accuracy)
            ax.plot(np.arange(1, acc.size + 1), acc, color=colors[r.arm], alpha=0.25, lw=0.8)
            ma = np.convolve(acc, np.ones(w) / w, mode="valid")
            ax.plot(np.arange(w, acc.size + 1), ma, color=colors[r.arm], lw=1.6, label=r.arm)
        ax.axhline(rep["target"], color="grey", ls="--", lw=0.8)
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("step")
    axes[0][0].set_ylabel(f"accuracy ({w}-step mean bold)")
    axes[0][0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- main ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--task", default="next_digit", help="dataset_name of the recipe's task")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1")
    p.add_argument("--recipe", type=Path, default=Path("recipes/cpu/demo.yml"))
    p.add_argument("--hosts", type=int, default=2, help="mcjax hosts")
    p.add_argument("--devices-per-host", type=int, default=2, help="mcjax devices per host")
    p.add_argument("--tunix-devices", type=int, default=1, help="devices of the Tunix process")
    p.add_argument("--target", type=float, default=0.9, help="accuracy target")
    p.add_argument("--window", type=int, default=10, help="moving-average window (steps)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="extra config overrides for both arms")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory (default bench_results/learn-<task>)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report from the runs already in --out")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if not 0 < args.target <= 1 or args.window < 1:
        p.error("need 0 < --target <= 1 and --window >= 1")
    args.out = args.out or Path("bench_results") / f"learn-{args.task}"
    return args


def main(argv: list[str] | None = None) -> None:
    from tunix_mcjax.bench.step import execute
    from tunix_mcjax.config import load_config

    args = parse_args(argv)
    out: Path = args.out
    init_dir = out / "init"
    overrides = [f"dataset_name={args.task}", *args.set]
    cfg = load_config(args.recipe, overrides)  # fails fast on a bad recipe or override
    runs = [LearnRun(arm, s, args.hosts, args.devices_per_host, args.tunix_devices)
            for s in range(args.seeds) for arm in ARMS]
    extra = [*overrides, f"load_parameters_path={init_dir}"]
    if not args.report_only:
        print(f"wrote {write_initial_checkpoint(args.recipe, overrides, init_dir)}", flush=True)
        started = time.perf_counter()
        for i, run in enumerate(runs, 1):
            print(f"[{i}/{len(runs)}] {run.name} ({time.perf_counter() - started:.0f}s "
                  "elapsed)", flush=True)
            meta = execute(run, args.recipe, out, extra, cfg.steps, args.timeout_s)
            print(f"  done in {meta['wall_s']:.0f}s", flush=True)
    results = [load_result(run, out) for run in runs]
    rep = summarize(results, args.target, args.window)
    rep["context"] = {"task": args.task, "recipe": str(args.recipe), "overrides": args.set,
                      "steps": cfg.steps, "hosts": args.hosts,
                      "devices_per_host": args.devices_per_host,
                      "tunix_devices": args.tunix_devices, "initial_checkpoint": str(init_dir)}
    out.mkdir(parents=True, exist_ok=True)
    write_report(out, rep, markdown(rep))
    print(f"wrote {plot(results, rep, out / 'curves.png')}")
    print(markdown(rep))


def write_report(out: Path, rep: dict, text: str) -> None:
    """A benchmark's report.json and report.md under `out`."""
    (out / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
    (out / "report.md").write_text(text)


if __name__ == "__main__":
    main()
