"""The memory planner against measured peaks: one run, its per-host peak RSS beside the plan.

    python -m tunix_mcjax.bench.memory_check --name NAME --out bench_results/memory_check.jsonl \\
        --hosts H --devices-per-host D RECIPE [key=value ...]

Plans the run (`tunix_mcjax.plan`, with this machine's RAM as the trainer assumes on CPU),
launches it with `bench.memory_worker` on every host, and appends one JSON line: the plan's
per-host peak and phases, each host's peak RSS over the steps after the first (what the plan
covers), over the whole run (step 0 adds XLA's compiles, which run in host memory) and before
the run was built (imports and JAX alone), the step-time summary, and the engine-vs-trainer
weight check. Errors are `(measured - planned) / planned`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tunix_mcjax import plan
from tunix_mcjax.config import load_config
from tunix_mcjax.launch import launch

GIB = plan.GIB


def measure(name: str, recipe: str, overrides: list[str], hosts: int, devices: int) -> dict:
    cfg = load_config(recipe, overrides)
    cluster = plan.Cluster(hosts, devices, plan.host_memory_bytes() // devices, cpu=True)
    p = plan.plan(cfg, cluster, plan.model_config_for(cfg))
    start = time.perf_counter()
    code = launch(recipe, overrides, hosts, devices, module="tunix_mcjax.bench.memory_worker")
    wall = time.perf_counter() - start
    if code:
        raise SystemExit(f"{name}: the run failed with exit code {code}")
    per_host = [json.loads((cfg.run_dir / f"memory_host{h}.json").read_text())
                for h in range(hosts)]
    planned = p.peak * devices
    return {
        "name": name, "recipe": recipe, "overrides": overrides, "hosts": hosts,
        "devices_per_host": devices, "wall_s": wall, "code_version": _git_head(),
        "plan": {"peak_per_host": planned, "phases_per_device": p.phases,
                 "items_per_device": p.items, "gather_once": p.layout.gather_once,
                 "micro_batches": p.layout.micro_batches,
                 "rows_per_device": p.layout.rows_per_device},
        "hosts_measured": [
            {"host": r["host"], "peak_rss": r["peak_rss"], "baseline_rss": r["baseline_rss"],
             "steady_peak_rss": r["steady_peak_rss"], "step_peak_rss": r["step_peak_rss"],
             "error_rss": (r["peak_rss"] - planned) / planned,
             "error_steady": (r["steady_peak_rss"] - planned) / planned,
             "error_steady_above_baseline":
                 (r["steady_peak_rss"] - r["baseline_rss"] - planned) / planned,
             "engine_vs_trainer_max_abs": r["engine_vs_trainer_max_abs"],
             "leaves_compared": r["leaves_compared"]}
            for r in per_host],
        "summary": per_host[0].get("summary"),
    }


def _git_head() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip()


def line(r: dict) -> str:
    hosts = ", ".join(
        f"host {h['host']} steady steps {h['steady_peak_rss'] / GIB:.2f} GiB "
        f"({h['error_steady']:+.0%}), whole run {h['peak_rss'] / GIB:.2f} GiB "
        f"({h['error_rss']:+.0%})" for h in r["hosts_measured"])
    return f"{r['name']}: planned {r['plan']['peak_per_host'] / GIB:.2f} GiB per host; {hosts}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_mcjax.bench.memory_check",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", required=True, help="JSONL file to append the result to")
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--devices-per-host", type=int, default=1)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    result = measure(args.name, args.recipe, args.overrides, args.hosts, args.devices_per_host)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(result) + "\n")
    print(line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
