"""Step times before and after a change, for the three entry points users run on CPU.

    python bench_results/before-after/measure.py BEFORE_TREE AFTER_TREE OUT.jsonl [--repeats 3]

Each tree is a checkout with its own `.venv` (or a link to one). The commands, run from the
tree's root, alternate before/after per repeat (A B A B ...), so a drift of the machine's speed
falls on both sides:
  demo     `make demo`'s launch: recipes/cpu/demo.yml on 2 hosts x 2 devices (150 steps)
  maxtext  MaxText's agentic recipe: recipes/maxtext/cpu/run.sh with qwen3_tiny_agentic.args
  tunix    Tunix's CLI: recipes/tunix/cpu/run_qwen3.sh
One line a launch: the side, commit, wall seconds, every step's seconds from host 0's progress
lines, their median over steps after the first (which compiles), and the 1-minute load average
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

STEP = re.compile(r"\[host 0\] step +(\d+) \|.*\| ([0-9.]+)s \|")


def commands(tree: Path, out: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    py = str(tree / ".venv" / "bin" / "python")
    env = {"PYTHON": py, "PATH": f"{tree / '.venv' / 'bin'}:{os.environ['PATH']}"}
    return {
        "demo": ([py, "-m", "tunix_mcjax.launch", "--hosts", "2", "--devices-per-host", "2",
                  "recipes/cpu/demo.yml", f"base_output_directory={out}"], env),
        "maxtext": (["bash", "recipes/maxtext/cpu/run.sh", f"base_output_directory={out}"],
                    {**env, "RECIPE_ARGS": "qwen3_tiny_agentic.args"}),
        "tunix": (["bash", "recipes/tunix/cpu/run_qwen3.sh",
                   f"rl_training_config.checkpoint_root_directory={out}/ckpt"], env),
    }


def launch(side: str, tree: Path, name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        argv, env = commands(tree, Path(tmp))[name]
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        proc = subprocess.run(argv, cwd=tree, env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=1800)
        wall = time.monotonic() - t0
    steps = {int(m[1]): float(m[2]) for m in STEP.finditer(proc.stdout + proc.stderr)}
    later = [s for k, s in sorted(steps.items()) if k > 0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree,
                            capture_output=True, text=True).stdout.strip()
    return {"command": name, "side": side, "commit": commit, "rc": proc.returncode,
            "wall_s": round(wall, 2), "steps_s": [steps[k] for k in sorted(steps)],
            "median_step_s_after_first": statistics.median(later) if later else None,
            "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--commands", default="demo,maxtext,tunix")
    args = p.parse_args()
    with args.out.open("a") as f:
        for name in args.commands.split(","):
            for _ in range(args.repeats):
                for side, tree in (("before", args.before), ("after", args.after)):
                    row = launch(side, tree.resolve(), name)
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
