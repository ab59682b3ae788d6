"""The agentic tool demo's step time and prefill tokens with and without kept pages, in launches.

    python bench_results/kept-pages/launches.py OUT_DIR [--launches 3] [--steps 60] [--maxtext]
        [--set KEY=VALUE ...]

Each launch is `recipes/cpu/demo_agentic.yml` on 2 hosts x 1 device (as its header runs it),
`steps=STEPS`, or with --maxtext MaxText's agentic recipe (the same tool demo under MaxText's
chat template and Qwen3's tokenizer: `recipes/maxtext/cpu/run.sh` with qwen3_tiny_agentic.args,
2 hosts x 1 device, `num_batches=STEPS`), with `agentic_keep_pages=true` (arm `kept`) or `false`
(arm `generate`: a `generate` per round), alternating kept / generate per launch so a drift of
the machine's speed falls on both; --set adds keys to both. Writes OUT_DIR/launches.jsonl (one
line a launch: host 0's records' step, generate and train seconds, both hosts' prefill tokens
per step, the steps in which a host compiled, every step's seconds, the load average before and
after) and OUT_DIR/report.json: each arm's wall seconds, compiled steps and summed step seconds
per launch, its median over steady steps (steps in which no host compiled) with a 95% interval,
and kept / generate as a launch-bootstrap interval (bench.stats) and Welch's on log step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tunix_mcjax.bench import stats

ARMS = {"kept": "agentic_keep_pages=true", "generate": "agentic_keep_pages=false"}


def command(out: str, steps: int, maxtext: bool) -> tuple[list[str], dict[str, str]]:
    if maxtext:
        return (["bash", "recipes/maxtext/cpu/run.sh", f"num_batches={steps}",
                 f"base_output_directory={out}"],
                {**os.environ, "PYTHON": sys.executable, "RECIPE_ARGS": "qwen3_tiny_agentic.args"})
    return ([sys.executable, "-m", "tunix_mcjax.launch", "--hosts", "2", "--devices-per-host",
             "1", "recipes/cpu/demo_agentic.yml", f"steps={steps}",
             f"base_output_directory={out}"], dict(os.environ))


def launch(arm: str, steps: int, maxtext: bool, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        argv, env = command(out, steps, maxtext)
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        proc = subprocess.run([*argv, *extra, ARMS[arm]], env=env, capture_output=True, text=True,
                              timeout=1800)
        wall = time.monotonic() - t0
        if proc.returncode:
            raise SystemExit(f"{arm} launch failed:\n{proc.stderr[-3000:]}")
        hosts = [[json.loads(line) for line in p.read_text().splitlines()]
                 for p in sorted(Path(out).rglob("host_*.jsonl"))]
    by_step = [{r["step"]: r for r in h} for h in hosts]
    # A step in which any host compiled is not steady: the others wait for it in the exchange.
    compiled = sorted({r["step"] for h in hosts for r in h
                       if r.get("compiled") or r.get("train_compiled")})
    steady = [r["step"] for r in hosts[0] if r["step"] not in compiled]
    return {"arm": arm, "wall_s": round(wall, 2), "compiled_steps": compiled,
            "all_step_s": [r["step_s"] for r in hosts[0]], "steady_steps": steady,
            **{f"{k}_s": [by_step[0][s][f"{k}_s"] for s in steady]
               for k in ("step", "generate", "train")},
            "prefill_tokens": [sum(h[s]["turns"]["prefill_tokens"] for h in by_step)
                               for s in steady],
            "full_reprefill_tokens": [sum(h[s]["turns"]["prefill_tokens"]
                                          + h[s]["turns"]["prefill_tokens_saved"]
                                          for h in by_step) for s in steady],
            "reward_mean": statistics.mean(r["reward_sum"] / r["completions"] for r in hosts[0]),
            "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def report(rows: list[dict]) -> dict:
    arms = {a: [r for r in rows if r["arm"] == a] for a in ARMS}
    out = {"launches": {a: len(v) for a, v in arms.items()},
           "loadavg_1m": [min(r["loadavg_1m"][0] for r in rows),
                          max(max(r["loadavg_1m"]) for r in rows)]}
    for a, runs in arms.items():
        out[f"{a}/wall_s"] = [r["wall_s"] for r in runs]
        out[f"{a}/compiled_steps"] = [r["compiled_steps"] for r in runs]
        out[f"{a}/run_s"] = [round(sum(r["all_step_s"]), 2) for r in runs]
    for key in ("step_s", "generate_s", "train_s", "prefill_tokens", "full_reprefill_tokens"):
        for a, runs in arms.items():
            pooled = [x for r in runs for x in r[key]]
            iv = stats.bootstrap_median(pooled)
            out[f"{a}/{key}"] = {"median": statistics.median(pooled), "ci95": [iv.low, iv.high],
                                 "per_launch": [statistics.median(r[key]) for r in runs]}
        ratio = stats.launch_bootstrap_ratio([r[key] for r in arms["kept"]],
                                             [r[key] for r in arms["generate"]])
        out[f"kept/generate {key}"] = {"median": ratio.point, "ci95": [ratio.low, ratio.high]}
    welch = stats.welch_log_ratio([x for r in arms["kept"] for x in r["step_s"]],
                                  [x for r in arms["generate"] for x in r["step_s"]])
    out["kept/generate step_s welch"] = {"median": welch.point, "ci95": [welch.low, welch.high]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--maxtext", action="store_true", help="MaxText's agentic recipe")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for both arms")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with (args.out / "launches.jsonl").open("w") as f:
        for _ in range(args.launches):
            for arm in ARMS:
                rows.append(launch(arm, args.steps, args.maxtext, args.set))
                f.write(json.dumps(rows[-1]) + "\n")
                f.flush()
                print(arm, rows[-1]["wall_s"], statistics.median(rows[-1]["step_s"]), flush=True)
    result = report(rows)
    (args.out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
