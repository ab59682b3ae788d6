"""`bench.engine`'s figures, within a launch and across launches, on records whose answer is
known."""

import numpy as np
import pytest

from tunix_mcjax.bench import engine as bench
from tunix_mcjax.bench import stats
from tunix_mcjax.bench.engine import results, tables


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


def arm(walls, tokens=100):
    return [{"tokens": tokens, "wall_s": w, "iterations": 10} for w in walls]


def test_ratio_figures_against_numpy():
    """Each comparison's point is what its docstring says, computed here in plain NumPy."""
    records = {"engine": arm([1.0, 2.0, 3.0]), "engine_short_cap": arm([1.0, 4.0, 1.0]),
               "rev": arm([2.0, 2.0, 3.0]), "engine_worker": arm([1.0, 1.5, 2.0]),
               "vllm": arm([0.5, 1.0, 1.0]), "engine_waves": arm([3.0, 4.0, 5.0])}
    got = results.ratio_figures(records, ["vllm"], "qwen3")
    # The cap's wall: the median of per-repeat ratios (1, 0.5, 3), not a ratio of medians (2).
    assert got["cap_wall_ratio"][0] == pytest.approx(1.0)
    assert got["cap_wall_ratio"][1] <= 1.0 <= got["cap_wall_ratio"][2]
    # A revision against this tree's worker: 100/1.5 over 100/2.
    assert got["tokens_per_s_ratio_vs_rev"][0] == pytest.approx(2.0 / 1.5)
    assert got["vllm_tokens_per_s_ratio_vs_engine"][0] == pytest.approx(2.0)
    assert got["cb_speedup_vs_engine_waves"][0] == pytest.approx(2.0)
    assert "maxtext_model" not in got and "vllm_tokens_per_s_ratio_vs_tunix" not in got


def test_tokens_per_s_intervals_are_bench_stats_bootstraps():
    records = {"engine": arm([1.0, 1.1, 0.9, 1.3, 1.2]), "tunix": arm([4.0, 5.0, 4.5, 6.0, 5.5]),
               "floor": [{"step_ms": 1.0, "prefill_ms": 1.0}]}
    got = results.tokens_per_s_figures(records, {"tunix": {"compile_count": 2}})
    engine, tunix = ([100 / r["wall_s"] for r in records[n]] for n in ("engine", "tunix"))
    assert got["tokens_per_s"]["engine"]["median_ci95"] == stats.bootstrap_median(
        engine).as_tuple()
    assert got["tokens_per_s"]["tunix"]["vs_engine_ci95"] == stats.bootstrap_ratio(
        tunix, engine).as_tuple()
    assert got["tokens_per_s_ratio_vs_tunix"] == pytest.approx(np.median(engine) / np.median(tunix))
    assert "floor" not in got["tokens_per_s"]


def test_the_table_prints_continuous_batching_against_waves(capsys):
    result = {"arm_info": {}, "engine_decode_iterations": 10.0,
              "cb_speedup_vs_engine_waves": [2.0, 1.5, 2.5], "engine_waves_decode_iterations": 20.0}
    tables.print_comparisons(result)
    assert capsys.readouterr().out == (
        "continuous batching vs waves: 2.00x [95% CI 1.50, 2.50] (10 vs 20 iterations)\n")
