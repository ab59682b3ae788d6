"""The engine benchmark's figures, from its arms' records: spreads, iterations, ratios.

Engine `iteration_ms` = (median generate wall - prefill floor) / decode iterations, so it
charges sampling, stop checks and loop bookkeeping to the iteration; `iteration_vs_floor_ratio`
compares it with the bare step. Spreads are IQRs over repeats. Every interval is `bench.stats`'
95% percentile bootstrap, held in a result as [point, low, high]: a median's
(`bootstrap_median`), a ratio of medians' (`bootstrap_ratio`, each arm resampled on its own),
and for the short cap the median of per-repeat wall ratios (`paired_ratio`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tunix_mcjax.bench import stats
from tunix_mcjax.bench.engine.floor import HBM_BANDWIDTH, HBM_FLOOR_FORMULA, hbm_floor
from tunix_mcjax.bench.engine.rev_arms import REV_WORKERS
from tunix_mcjax.bench.engine.workload import EngineProfile

Records = dict[str, list[dict[str, Any]]]  # arm -> one dict of measurements per repeat


def spread(values: Sequence[float]) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {"median": float(med), "iqr": float(q3 - q1), "n": int(v.size)}


def tokens_per_s(records: list[dict[str, float]]) -> list[float]:
    return [r["tokens"] / r["wall_s"] for r in records]


def column(records: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in records]


def median_of(records: list[dict[str, float]], key: str) -> float:
    return float(np.median(column(records, key)))


def ratio_ci(numerator: Sequence[float], denominator: Sequence[float]) -> tuple[float, ...]:
    """median(numerator) / median(denominator) and its interval, as (point, low, high)."""
    return stats.bootstrap_ratio(numerator, denominator).as_tuple()


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> tuple[float, ...]:
    """Median of per-repeat ratios numerator[i] / denominator[i] (the arms ran repeat i on the
    same seed, so the seed's own spread cancels) and its interval, as (point, low, high)."""
    return stats.bootstrap_median(np.asarray(numerator) / np.asarray(denominator)).as_tuple()


def same_outputs(records: list[dict], reference: list[dict]) -> float:
    """Share of requests, over all repeats, whose completion equals the reference arm's."""
    pairs = [(a, b) for r, q in zip(records, reference, strict=True)
             for a, b in zip(r["completions"], q["completions"], strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def take_completions(records: Records) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Drops the completions from `records`, first reading from them which arms' outputs equal
    the engine arm's (`same_outputs`), and each paged arm's completion lengths (first repeat)."""
    same = {name: same_outputs(records[name], records["engine"])
            for name in ("engine_short_cap", "engine_xla", "rev", "engine_worker")
            if name in records}
    if "maxtext_rev" in records:
        same["maxtext_rev_vs_maxtext"] = same_outputs(records["maxtext_rev"], records["maxtext"])
    lengths = {name: [len(c) for c in records[name][0]["completions"]]
               for name in ("engine", "engine_xla", "rev") if name in records}
    for arm_records in records.values():
        for record in arm_records:
            record.pop("completions", None)
    return same, lengths


def iteration_figures(records: Records, arm_info: dict[str, dict]) -> dict[str, Any]:
    """The engine arm's tokens/s, and its iteration against the floor's bare step."""
    engine, floor = records["engine"], records["floor"]
    prefill_ms = median_of(floor, "prefill_ms")
    iterations = median_of(engine, "iterations")
    engine_iteration = (np.median(column(engine, "wall_s")) * 1e3 - prefill_ms) / iterations
    floor_iteration = median_of(floor, "step_ms")
    return {
        "engine_tokens_per_s": spread(tokens_per_s(engine))["median"],
        "engine_tokens_per_s_spread": spread(tokens_per_s(engine)),
        "iteration_ms": float(engine_iteration),
        "floor_iteration_ms": floor_iteration,
        "floor_iteration_ms_spread": spread(column(floor, "step_ms")),
        "iteration_vs_floor_ratio": float(engine_iteration / floor_iteration),
        "prefill_ms": prefill_ms,
        "engine_decode_iterations": iterations,
        "engine_compile_count": arm_info["engine"]["compile_count"],
    }


def tokens_per_s_figures(records: Records, arm_info: dict[str, dict]) -> dict[str, Any]:
    """Every generating arm's tokens/s (median with its interval) and its ratio to the engine
    arm's; the engine's against Tunix's Sampler's where it ran."""
    engine = tokens_per_s(records["engine"])
    out: dict[str, Any] = {"tokens_per_s": {
        name: {"median_ci95": stats.bootstrap_median(tokens_per_s(arm)).as_tuple(),
               "vs_engine_ci95": ratio_ci(tokens_per_s(arm), engine)}
        for name, arm in records.items() if not name.startswith("floor")}}
    if "tunix" in records:
        tunix = tokens_per_s(records["tunix"])
        ratio, low, high = ratio_ci(engine, tunix)
        out.update({
            "tunix_sampler_tokens_per_s": spread(tunix)["median"],
            "tunix_sampler_tokens_per_s_spread": spread(tunix),
            "tokens_per_s_ratio_vs_tunix": ratio,
            "tokens_per_s_ratio_vs_tunix_ci95": [low, high],
            "tunix_compile_count": arm_info["tunix"]["compile_count"],
        })
    return out


def xla_figures(records: Records) -> dict[str, Any]:
    """The engine's iteration with its pages on the XLA path, against that path's floor."""
    if "floor_xla" not in records:
        return {}
    xla_floor = records["floor_xla"]
    xla_iterations = median_of(records["engine_xla"], "iterations")
    xla_prefill = median_of(xla_floor, "prefill_ms")
    xla_iteration = (np.median(column(records["engine_xla"], "wall_s")) * 1e3
                     - xla_prefill) / xla_iterations
    return {
        "xla_iteration_ms": float(xla_iteration),
        "xla_floor_iteration_ms": median_of(xla_floor, "step_ms"),
        "xla_floor_iteration_ms_spread": spread(column(xla_floor, "step_ms")),
        "xla_prefill_ms": xla_prefill,
        "xla_decode_iterations": xla_iterations,
    }


def hbm_figures(profile: EngineProfile, params, prompts: Sequence[Sequence[int]],
                records: Records, lengths: dict[str, list[int]], prefill_ms: float,
                bandwidth: float | None) -> dict[str, Any]:
    """Each paged arm's iteration (wall less our prefill floor, over its iterations) against
    the HBM floor of the same work; `bandwidth` None: an H200's on a GPU, none elsewhere."""
    if bandwidth is None and jax.devices()[0].platform == "gpu":
        bandwidth = HBM_BANDWIDTH
    floors = {}
    for name, arm_lengths in (lengths if bandwidth else {}).items():
        arm_iterations = median_of(records[name], "iterations")
        floor = hbm_floor(profile, params, prompts, arm_lengths, arm_iterations, bandwidth)
        floor["iteration_ms"] = (median_of(records[name], "wall_s") * 1e3
                                 - prefill_ms) / arm_iterations
        floor["iteration_vs_hbm_floor"] = floor["iteration_ms"] / floor["floor_iteration_ms"]
        floors[name] = floor
    if not floors:
        return {}
    return {"hbm_floor": {"bandwidth_bytes_per_s": bandwidth, "formula": HBM_FLOOR_FORMULA,
                          "arms": floors}}


def rev_figures(records: Records, rev: str, ratio_key: str) -> dict[str, Any]:
    """Revision arm `rev`'s tokens/s, and this tree's worker's over it (`REV_WORKERS`)."""
    return {f"{rev}_tokens_per_s_spread": spread(tokens_per_s(records[rev])),
            ratio_key: ratio_ci(tokens_per_s(records[REV_WORKERS[rev]]),
                                tokens_per_s(records[rev]))}


def ratio_figures(records: Records, engines: Sequence[str], maxtext_model: str
                  ) -> dict[str, Any]:
    """The comparisons beside the engine arm: the cap's wall, a revision against this tree in
    a worker, the `--engine` arms against the engine and Tunix, CB against waves."""
    engine, out = records["engine"], {}
    if "engine_short_cap" in records:
        out["cap_wall_ratio"] = paired_ratio(column(engine, "wall_s"),
                                             column(records["engine_short_cap"], "wall_s"))
    if "rev" in records:
        out.update(rev_figures(records, "rev", "tokens_per_s_ratio_vs_rev"))
    if "maxtext" in records:
        out["maxtext_model"] = maxtext_model
    if "maxtext_rev" in records:
        out.update(rev_figures(records, "maxtext_rev",
                               "maxtext_tokens_per_s_ratio_vs_maxtext_rev"))
    for name in engines:
        out[f"{name}_tokens_per_s_spread"] = spread(tokens_per_s(records[name]))
        for other in ("engine", "tunix"):
            if other in records:
                out[f"{name}_tokens_per_s_ratio_vs_{other}"] = ratio_ci(
                    tokens_per_s(records[name]), tokens_per_s(records[other]))
    for variant in ("engine_waves", "engine_one_batch"):
        if variant in records:
            out[f"{variant}_tokens_per_s"] = spread(tokens_per_s(records[variant]))["median"]
            out[f"{variant}_decode_iterations"] = median_of(records[variant], "iterations")
            out[f"cb_speedup_vs_{variant}"] = ratio_ci(tokens_per_s(engine),
                                                       tokens_per_s(records[variant]))
    return out
