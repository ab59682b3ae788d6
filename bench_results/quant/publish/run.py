"""Publish under rl_runtime=mcjax_da with `quantization=int8`, engine side against trainer side.

Engine side is the tree before trainer-side quantization (it puts the full-precision copy and
the rollout engine quantizes as it loads); trainer side is the tree after (it puts the int8
values and float32 scales). One trainer host and one rollout host, one device each.

    python bench_results/quant/publish/run.py measure --recipe demo --side engine \
        --code-dir <export of the engine-side commit> --commit <its hash> --launches 3
    python bench_results/quant/publish/run.py report

Each launch writes runs/<recipe>-<side>-l<i>/ (steps.jsonl, meta.json: command, commit, wall
time, load average before and after). A launch's figure is the median over its steps that
compiled nothing (from step 2 on); an arm's is the median over its launches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECIPES = {
    "demo": ("recipes/cpu/demo.yml", ["steps=10"]),
    "qwen3-0.6b-cpu": ("recipes/cpu/qwen3_0p6b.yml", ["steps=5", "rl_ray_object_store_mb=3000"]),
}
COMMON = ["rl_runtime=mcjax_da", "rl_trainer_hosts_fraction=0.5", "quantization=int8"]
FIGURES = ("publish_bytes", "publish_s", "weight_load_s", "publish_plus_load_s", "step_s")


def measure(recipe: str, side: str, code_dir: Path, commit: str, launches: range) -> None:
    path, keys = RECIPES[recipe]
    for i in launches:
        name = f"{recipe}-{side}-l{i}"
        args = ["-m", "tunix_mcjax.launch", "--hosts", "2", "--devices-per-host", "1", path,
                *COMMON, *keys, f"run_name={name}"]
        before, t0 = os.getloadavg()[0], time.time()
        proc = subprocess.run([sys.executable, *args, f"base_output_directory={HERE / 'runs'}"],
                              cwd=code_dir, env={**os.environ, "PYTHONPATH": str(code_dir)},
                              capture_output=True, text=True)
        meta = {"command": " ".join([*args, "base_output_directory=runs"]), "code": commit,
                "side": side, "rc": proc.returncode, "wall_s": round(time.time() - t0),
                "loadavg_1m_before": before, "loadavg_1m_after": os.getloadavg()[0]}
        (HERE / "runs" / name).mkdir(parents=True, exist_ok=True)
        (HERE / "runs" / f"{name}.meta.json").write_text(json.dumps(meta) + "\n")
        print(name, meta, (proc.stdout + proc.stderr)[-3000:] if proc.returncode else "",
              flush=True)


def launch_figures(run: Path) -> dict:
    """Medians over a launch's steps that compiled nothing, from step 2 on."""
    records = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] >= 2 and not r["compiled"]]
    rows = [{"publish_bytes": r["publish_bytes"], "publish_s": r["phase_s"]["publish"],
             "weight_load_s": r["weight_load_s"], "step_s": r["step_s"],
             "publish_plus_load_s": r["phase_s"]["publish"] + r["weight_load_s"]}
            for r in steady]
    return {"steps": len(rows), **{k: statistics.median(r[k] for r in rows) for k in FIGURES}}


def report() -> dict:
    arms: dict[str, dict] = {}
    for meta_file in sorted((HERE / "runs").glob("*.meta.json")):
        meta = json.loads(meta_file.read_text())
        name = meta_file.name.removesuffix(".meta.json")
        arm = arms.setdefault(name.rsplit("-l", 1)[0], {"code": meta["code"], "launches": []})
        figures = launch_figures(HERE / "runs" / name) if meta["rc"] == 0 else {}
        arm["launches"].append({"run": name, "rc": meta["rc"], "wall_s": meta["wall_s"],
                                "loadavg_1m": [meta["loadavg_1m_before"],
                                               meta["loadavg_1m_after"]], **figures})
    for arm in arms.values():
        done = [launch for launch in arm["launches"] if launch["rc"] == 0]
        arm["median"] = {k: statistics.median(launch[k] for launch in done) for k in FIGURES}
    (HERE / "report.json").write_text(json.dumps(arms, indent=1) + "\n")
    for name, arm in arms.items():
        print(name, arm["code"], {k: round(v, 4) for k, v in arm["median"].items()})
    return arms


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["measure", "report"])
    parser.add_argument("--recipe", choices=list(RECIPES))
    parser.add_argument("--side", choices=["engine", "trainer"])
    parser.add_argument("--code-dir", type=Path)
    parser.add_argument("--commit")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--first", type=int, default=0, help="index of the first launch")
    a = parser.parse_args()
    if a.what == "measure":
        measure(a.recipe, a.side, a.code_dir.resolve(), a.commit,
                range(a.first, a.first + a.launches))
    else:
        report()
