"""The engine benchmark over launches: each in a fresh process, their ratios across them.

A process's luck (placement, its cores) lasts the launch: one gsm8k-cpu launch's main process
ran 15-20% slow throughout, and the same engine measured 5% apart in two runs whose intervals
over repeats did not overlap, so a single launch's interval is too narrow for a verdict near 1
(Appendix A).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tunix_mcjax.bench.engine.results import column, tokens_per_s
from tunix_mcjax.bench.engine.rev_arms import REV_WORKERS
from tunix_mcjax.bench.engine.runner import run
from tunix_mcjax.bench.engine.tables import print_table
from tunix_mcjax.bench.stats import launch_bootstrap_ratio, welch_log_ratio

LAUNCH_TIMEOUT_S = 4 * 3600  # one launch of the slowest profile with every arm takes < 1 h


def one_launch(run_args: dict[str, Any], out: str) -> None:
    """A launch, in a fresh process: `run(**run_args)`, its table, its result in `out`."""
    result = run(**run_args)
    print_table(result)
    with open(out, "w") as f:
        json.dump(result, f)


def run_launches(launches: int, run_args: dict[str, Any]) -> dict[str, Any]:
    """`run(**run_args)` `launches` times, one after another, each in a fresh process (its rev
    workers too): each launch's result, and `across_launches` of them."""
    spawn = multiprocessing.get_context("spawn")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(launches):
            print(f"launch {i + 1} of {launches}", file=sys.stderr, flush=True)
            out = os.path.join(folder, f"launch-{i}.json")
            proc = spawn.Process(target=one_launch, args=(run_args, out))
            proc.start()
            proc.join(LAUNCH_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                raise TimeoutError(f"launch {i + 1} ran past {LAUNCH_TIMEOUT_S} s")
            if proc.exitcode != 0:
                raise RuntimeError(f"launch {i + 1} of {launches} exited with {proc.exitcode} "
                                   "(its error is above)")
            with open(out) as f:
                results.append(json.load(f))
    return {"launches": results, "across_launches": across_launches(results)}


def across_launches(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """For each generating arm of the launches' `results`: the engine arm's tokens/s over the
    arm's (for `rev` and `maxtext_rev`, their worker's of this tree); with a short cap, also
    `cap_wall_ratio` (the engine's generate wall over the short-cap arm's). Each per launch
    (ratio of medians), pooled (`launch_bootstrap_ratio`: launches, then blocks of repeats,
    resampled) and over launch medians (`welch_log_ratio`)."""
    if len(results) < 2:
        raise ValueError(f"a comparison across launches needs >= 2 of them, got {len(results)}")

    def ratios(numerator: list[list[float]], denominator: list[list[float]]) -> dict[str, Any]:
        return {
            "per_launch": [float(np.median(n) / np.median(d))
                           for n, d in zip(numerator, denominator, strict=True)],
            "pooled_ci95": launch_bootstrap_ratio(numerator, denominator).as_dict(),
            "welch_ci95": welch_log_ratio([np.median(n) for n in numerator],
                                          [np.median(d) for d in denominator]).as_dict(),
        }

    def launches_of(arm: str, measure: Callable[[list[dict]], list[float]]) -> list[list[float]]:
        return [measure(r["records"][arm]) for r in results]

    def numerator(name: str) -> str:  # a revision's worker of this tree, where it ran
        worker = REV_WORKERS.get(name)
        return worker if worker in results[0]["records"] else "engine"

    out = {name: ratios(launches_of(numerator(name), tokens_per_s),
                        launches_of(name, tokens_per_s))
           for name in results[0]["tokens_per_s"] if name != "engine"}
    if "engine_short_cap" in results[0]["records"]:
        def walls(records: list[dict]) -> list[float]:
            return column(records, "wall_s")
        out["cap_wall_ratio"] = ratios(launches_of("engine", walls),
                                       launches_of("engine_short_cap", walls))
    return out
