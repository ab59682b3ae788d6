"""Recompute the planner's figures of committed AOT result files, leaving XLA's as compiled.

    python -m tunix_mcjax.aot.replan bench_results/aot/*-train.json

A result file of `python -m tunix_mcjax.aot ... --json` holds XLA's figures (compiled once, 1-6
minutes a cell) beside the planner's of that day. When `plan.py` changes, this rewrites only the
planner's fields (`plan_peak`, `plan_phases`, each row's `plan_phase_peak`) from the file's own
recipe, overrides and target, and records that it did so in `planner`. Needs no libtpu.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PLANNER_NOTE = ("plan_* fields recomputed by `python -m tunix_mcjax.aot.replan` with the plan.py "
                "of the commit that wrote them; XLA's figures are the compile's")


def replan(result: dict) -> dict:
    """`result` with the planner's fields recomputed (the file's recipe, overrides, slice)."""
    from tunix_mcjax import plan
    from tunix_mcjax.aot.__main__ import load

    if "recipe" not in result or "overrides" not in result:
        raise ValueError("not a result of `python -m tunix_mcjax.aot RECIPE ... --json` "
                         "(no recipe/overrides: a MaxText script's result has no planner)")
    cfg = load(result["recipe"], result["overrides"])
    cluster = plan.Cluster(result["hosts"], result["devices_per_host"], result["hbm_bytes"],
                           tpu=True)
    p = plan.plan(cfg, cluster, plan.model_config_for(cfg))
    rows = [{**row, "plan_phase_peak": p.phases[row["phase"]]} if "plan_phase_peak" in row
            else row for row in result["compiled"]]
    return {**result, "plan_peak": p.peak, "plan_phases": p.phases, "compiled": rows,
            "planner": PLANNER_NOTE}


def main(paths: list[str]) -> None:
    for path in paths:
        result = replan(json.loads(Path(path).read_text()))
        Path(path).write_text(json.dumps(result, indent=1) + "\n")
        train = [r["plan_phase_peak"] for r in result["compiled"] if r.get("phase") == "train"]
        print(f"{path}: planner train {train[0] / 2**30 if train else float('nan'):.2f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
