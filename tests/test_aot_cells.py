"""The planner against XLA's TPU memory verdict at the paper's cells, from the committed result
files of `python -m tunix_mcjax.aot` (bench_results/aot/*.json): the planner's phase peak is
recomputed by today's `plan.py` (no compile) and compared with XLA's phase peak."""

from __future__ import annotations

import json

import pytest

from tests.mp import REPO
from tunix_mcjax import plan
from tunix_mcjax.aot.__main__ import load

# The paper's cells (Qwen3-0.6B profiles); maxtext-*.json are MaxText's scripts on their slices.
RESULTS = sorted(p for p in (REPO / "bench_results" / "aot").glob("*.json")
                 if not p.name.startswith("maxtext-"))
TOLERANCE = 0.15
CHIPS_WITH_TRAIN_STEP = (8, 16, 32, 64)
# The train phase is held by the planner's TPU activations (`activations.TPU_SAVED_PER_UNIT`),
# not its CPU fit, which was 12-85% above XLA at 8 chips.
CHECKED_PHASES = ("generate", "train")


# The scanned train step over stacked params (`*-train.json`) where the planner is more than 15%
# under XLA: its count was fitted to the unrolled step, and what XLA holds beyond it there is
# not itemised yet (docs/tpu.md). Strict: a refit that brings a row in makes its test pass and
# this list must shrink.
PLANNER_UNDER_SCANNED_STEP = {"gsm8k-16chips-train:train step", "gsm8k-32chips-train:train step",
                              *(f"swe-{n}chips-train:train step" for n in (8, 16, 32, 64))}


def cells() -> list:
    out = []
    for path in RESULTS:
        result = json.loads(path.read_text())
        for row in result["compiled"]:
            if not row.get("phase_peak") or row["phase"] not in CHECKED_PHASES:
                continue
            name = f"{path.stem}:{row['name']}"
            marks = [pytest.mark.xfail(strict=True, reason="planner under the scanned step")] \
                if name in PLANNER_UNDER_SCANNED_STEP else []
            out.append(pytest.param(name, result, row, id=name, marks=marks))
    return out


def test_every_paper_cell_has_its_stacked_train_step_compiled():
    results = [json.loads(p.read_text()) for p in RESULTS if p.stem.endswith("-train")]
    chips = {(r["recipe"], r["hosts"] * r["devices_per_host"] // 2) for r in results
             if all(row["compiled"] and row["fits"] for row in r["compiled"])}
    assert chips == {(profile, n) for profile in ("gsm8k", "numina", "swe")
                     for n in CHIPS_WITH_TRAIN_STEP}


def test_every_paper_cell_has_its_engine_program_compiled():
    results = [json.loads(p.read_text()) for p in RESULTS if p.stem.endswith("-engine")]
    chips = {(r["recipe"], r["hosts"] * r["devices_per_host"] // 2) for r in results}  # TPU7x
    assert chips == {(profile, n) for profile in ("gsm8k", "numina", "swe")
                     for n in (8, 16, 32, 64)}


@pytest.mark.parametrize("name,result,row", cells())
def test_the_planner_is_within_15_percent_of_xla(name: str, result: dict, row: dict):
    cfg = load(result["recipe"], result["overrides"])
    cluster = plan.Cluster(result["hosts"], result["devices_per_host"], result["hbm_bytes"],
                           tpu=True)
    planner = plan.plan(cfg, cluster, plan.model_config_for(cfg)).phases[row["phase"]]
    assert row["fits"] and row["phase_peak"] <= result["hbm_bytes"]
    assert abs(planner / row["phase_peak"] - 1) <= TOLERANCE, (
        f"{name}: planner {planner / 2**30:.2f} GiB vs XLA {row['phase_peak'] / 2**30:.2f}")
