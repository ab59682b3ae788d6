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
# The train phase is held by the planner's TPU count of the scanned step (`activations.py`:
# its residual stacks and attention masks; `plan.py`: the flat collectives), not its CPU fit.
CHECKED_PHASES = ("generate", "train")
# Train rows are checked in today's files (`*-train.json`: the stacked, scanned step); the train
# rows of `<profile>-8chips.json` are the unrolled step over per-layer params of before, kept as
# a record of it, which the planner no longer models.
TODAYS_TRAIN_STEP = "-train"


# Where XLA's layout of the flat collectives' [devices, ...] buffers is padded to 128 lanes,
# which the planner does not count (docs/tpu.md): gsm8k at 32 devices (its leaves sharded along
# their last dimension as [32, ..., dim / 32] pieces, 4.5 GiB for 1.1 GiB of params) and at 64
# (the gradients' sum laid out [64, shard] with 64 in the lanes, 4.47 GiB for 2.22). gsm8k's
# short rows make those collectives its step's peak; numina's and swe's peak in the backward.
# Strict: a count of the padding that brings a row in makes its test pass and this must shrink.
PLANNER_UNDER_LANE_PADDING = {"gsm8k-16chips-train:train step", "gsm8k-32chips-train:train step"}


def cells() -> list:
    out = []
    for path in RESULTS:
        result = json.loads(path.read_text())
        for row in result["compiled"]:
            if not row.get("phase_peak") or row["phase"] not in CHECKED_PHASES:
                continue
            if row["phase"] == "train" and not path.stem.endswith(TODAYS_TRAIN_STEP):
                continue
            name = f"{path.stem}:{row['name']}"
            marks = [pytest.mark.xfail(strict=True, reason="lane padding not counted")] \
                if name in PLANNER_UNDER_LANE_PADDING else []
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
