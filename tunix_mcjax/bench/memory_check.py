"""The memory planner against measured peaks: one run, its per-host peak RSS beside the plan.

    python -m tunix_mcjax.bench.memory_check --name NAME --out bench_results/memory_check.jsonl \\
        --hosts H --devices-per-host D RECIPE [key=value ...]
    python -m tunix_mcjax.bench.memory_check --paged --out bench_results/memory_check_paged.jsonl

Plans the run (`tunix_mcjax.plan`, with this machine's RAM as the trainer assumes on CPU),
launches it with `bench.memory_worker` on every host, and appends one JSON line: the plan's
per-host peak and phases, each host's peak RSS over the steps after the first (what the plan
covers), over the whole run (step 0 adds XLA's compiles, which run in host memory) and before
the run was built (imports and JAX alone), the step-time summary, and the engine-vs-trainer
weight check. Errors are `(measured - planned) / planned`. Each line notes the machine's load
average (`/proc/loadavg`) before and after the run.

`--paged` runs the three configurations of `PAGED_CHECKS` (the paged jax engine: the demo,
gsm8k-cpu, and long caps whose page pool is most of the run's memory), each on its workload
(`bench.profiles`), and also records the engine's pool pages beside the plan's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from tunix_mcjax import plan
from tunix_mcjax.bench import profiles
from tunix_mcjax.config import load_config
from tunix_mcjax.launch import launch

GIB = plan.GIB
# Long caps on an 8-layer Qwen3 with as many KV heads as query heads, in fp32: 2,048-token
# prompts filled to the cap and 64 new tokens, so that the KV page pool (every row of 64 at the
# caps: 2.1 GiB per device) is the largest thing the run holds.
LONG_CAPS = profiles.Profile(
    "long-caps-cpu", "prefill-heavy, long caps", 2, 4, 2048, 64, (1800, 2047),
    {"base_num_decoder_layers": 8, "base_emb_dim": 256, "base_mlp_dim": 512,
     "base_num_query_heads": 4, "base_num_kv_heads": 4, "head_dim": 64})


@dataclasses.dataclass(frozen=True)
class Check:
    """One measured configuration: a workload, key overrides and a topology."""

    profile: profiles.Profile
    overrides: tuple[str, ...]
    hosts: int
    devices_per_host: int


PAGED_CHECKS = (
    Check(profiles.PROFILES["demo-cpu"], ("steps=3",), 2, 2),
    Check(profiles.PROFILES["gsm8k-cpu"], ("steps=3",), 1, 2),
    Check(LONG_CAPS, ("steps=3", "train_micro_batch_size=1"), 1, 2),
)


def measure(name: str, recipe: str, overrides: list[str], hosts: int, devices: int) -> dict:
    cfg = load_config(recipe, overrides)
    cluster = plan.Cluster(hosts, devices, plan.host_memory_bytes() // devices, cpu=True)
    p = plan.plan(cfg, cluster, plan.model_config_for(cfg))
    load_before = load_average()
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
        "load_average": {"before": load_before, "after": load_average()},
        "plan": {"peak_per_host": planned, "phases_per_device": p.phases,
                 "pool_pages": p.engine.pool_pages,
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
             "engine_pool_pages": r.get("engine_pool_pages"),
             "engine_vs_trainer_max_abs": r["engine_vs_trainer_max_abs"],
             "leaves_compared": r["leaves_compared"]}
            for r in per_host],
        "summary": per_host[0].get("summary"),
    }


def load_average() -> str:
    """The first three fields of /proc/loadavg (1, 5 and 15 minutes)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def measure_check(check: Check, workloads: Path) -> dict:
    """`measure` on the check's workload, written under `workloads/<profile>`."""
    recipe = profiles.write_workload(check.profile, workloads / check.profile.name)
    overrides = [*check.overrides, f"run_name=memcheck-{check.profile.name}"]
    return measure(check.profile.name, str(recipe), overrides, check.hosts,
                   check.devices_per_host)


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
    parser.add_argument("--name", help="the result's name (one recipe)")
    parser.add_argument("--paged", action="store_true", help="measure PAGED_CHECKS instead")
    parser.add_argument("--workloads", type=Path, default=Path("runs/memory_check"),
                        help="where --paged writes its workloads (relative to here)")
    parser.add_argument("--out", required=True, help="JSONL file to append the results to")
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--devices-per-host", type=int, default=1)
    parser.add_argument("recipe", nargs="?")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.paged == bool(args.recipe or args.name):
        parser.error("give --name and a RECIPE, or --paged")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.paged:
        results = (measure_check(check, args.workloads) for check in PAGED_CHECKS)
    else:
        results = iter([measure(args.name, args.recipe, args.overrides, args.hosts,
                                args.devices_per_host)])
    for result in results:
        with out.open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
