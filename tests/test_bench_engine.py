"""`bench.engine`'s comparison across launches, on records whose answer is known."""

import numpy as np
import pytest

from tunix_mcjax.bench import engine as bench


def launch(engine_walls, arm_walls, tokens=100):
    """One launch's result as `bench.engine.run` writes it: the engine arm and one other."""
    records = {name: [{"tokens": tokens, "wall_s": w} for w in walls]
               for name, walls in (("engine", engine_walls), ("rev", arm_walls))}
    return {"records": records, "tokens_per_s": {"engine": {}, "rev": {}}}


def test_across_launches_ratios_per_launch_pooled_and_over_launch_medians():
    """The engine's tokens/s over the arm's: 2x in one launch, 1x in another (a launch effect
    on the engine arm alone)."""
    results = [launch([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]), launch([2.0, 2.0, 2.0], [2.0, 2.0, 2.0])]
    rev = bench.across_launches(results)["rev"]
    assert rev["per_launch"] == pytest.approx([2.0, 1.0])
    # Pooled: median tokens/s of the engine's 6 repeats (100 and 50: 75) over the arm's (50).
    assert rev["pooled_ci95"]["median"] == pytest.approx(1.5)
    assert rev["pooled_ci95"]["ci_low"] <= 1.0 and rev["pooled_ci95"]["ci_high"] >= 2.0
    # Over launch medians: the geometric mean of 2 and 1, and a Welch interval that spans them.
    welch = rev["welch_ci95"]
    assert welch["median"] == pytest.approx(np.sqrt(2.0))
    assert welch["ci_low"] < 1.0 < 2.0 < welch["ci_high"]


def test_across_launches_needs_two():
    with pytest.raises(ValueError, match=">= 2 of them"):
        bench.across_launches([launch([1.0], [1.0])])


def test_launches_must_be_positive():
    with pytest.raises(SystemExit):
        bench.main(["--launches", "0"])


def test_across_launches_cap_wall_ratio():
    """With a short-cap arm: the engine's generate wall over it, launch by launch."""
    results = [launch([3.0, 3.0], [1.0, 1.0]), launch([2.0, 2.0], [2.0, 2.0])]
    for result in results:
        result["records"]["engine_short_cap"] = result["records"].pop("rev")
        result["tokens_per_s"] = {"engine": {}, "engine_short_cap": {}}
    got = bench.across_launches(results)
    assert got["cap_wall_ratio"]["per_launch"] == pytest.approx([3.0, 1.0])
    assert got["engine_short_cap"]["per_launch"] == pytest.approx([1 / 3, 1.0])


@pytest.mark.parametrize("rev, worker", [("rev", "engine_worker"),
                                         ("maxtext_rev", "maxtext_worker")])
def test_across_launches_compares_a_revision_with_this_trees_worker(rev, worker):
    """A revision runs in a worker, so its ratio is this tree's worker's tokens/s over its own;
    the worker's row is the main process against a worker of the same code."""
    results = [launch([1.0, 1.0], [2.0, 2.0]), launch([1.0, 1.0], [2.0, 2.0])]
    for result in results:
        result["records"][rev] = result["records"].pop("rev")
        result["records"][worker] = [{"tokens": 100, "wall_s": 1.5}] * 2
        result["tokens_per_s"] = {"engine": {}, rev: {}, worker: {}}
    got = bench.across_launches(results)
    assert got[rev]["per_launch"] == pytest.approx([2.0 / 1.5, 2.0 / 1.5])
    assert got[worker]["per_launch"] == pytest.approx([1.5, 1.5])
