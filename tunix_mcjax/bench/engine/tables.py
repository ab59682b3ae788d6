"""What the engine benchmark prints: a launch's table, the ratios across launches, progress."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import numpy as np

from tunix_mcjax.bench.engine.arms import ENGINE_ARMS
from tunix_mcjax.bench.engine.results import column, spread, tokens_per_s
from tunix_mcjax.bench.engine.workload import EngineProfile


def arm_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, arm) of every row the table may print, in its order."""
    info = result["arm_info"]
    return [
        (f"engine {info['engine']['layout']}"[:16], "engine"),
        ("engine XLA path", "engine_xla"),
        (f"cap {result['profile']['short_cap']}", "engine_short_cap"),
        (f"rev {info.get('rev', {}).get('rev', '')}"[:16], "rev"),
        ("engine, a worker", "engine_worker"),
        ("no CB, waves", "engine_waves"),
        ("no CB, 1 batch", "engine_one_batch"),
        *((f"{name} engine", name) for name in ENGINE_ARMS),
        (f"maxtext {info.get('maxtext_rev', {}).get('rev', '')}"[:16], "maxtext_rev"),
        ("maxtext, worker", "maxtext_worker"),
        ("tunix Sampler", "tunix"),
    ]


def print_arms(result: dict[str, Any]) -> None:
    """One row per arm that ran: tokens/s (median, IQR), wall, tokens, compiles."""
    records, info = result["records"], result["arm_info"]
    print(f"profile {result['profile']['name']}  model {result['model']}  {result['device']}")
    print(f"{'arm':<16}{'tokens/s':>10}{'IQR':>8}{'wall s':>9}{'tokens':>8}{'compiles':>10}")
    for label, name in arm_rows(result):
        if name not in records:
            continue
        tps = spread(tokens_per_s(records[name]))
        print(
            f"{label:<16}{tps['median']:>10.0f}{tps['iqr']:>8.0f}"
            f"{np.median(column(records[name], 'wall_s')):>9.3f}"
            f"{np.median(column(records[name], 'tokens')):>8.0f}{info[name]['compile_count']:>10}"
        )


def print_engine_figures(result: dict[str, Any]) -> None:
    """The engine arm against Tunix, its XLA path, the HBM floor, the bare step, the cap."""
    records, info = result["records"], result["arm_info"]
    if "tokens_per_s_ratio_vs_tunix" in result:
        low, high = result["tokens_per_s_ratio_vs_tunix_ci95"]
        ratio = result["tokens_per_s_ratio_vs_tunix"]
        print(f"tokens/s ratio vs tunix {ratio:.2f} [95% CI {low:.2f}, {high:.2f}]")
    if "engine_xla" in records:
        ratio, low, high = result["tokens_per_s"]["engine_xla"]["vs_engine_ci95"]
        print(f"XLA path tokens/s vs {info['engine']['layout']}: {ratio:.2f} [95% CI {low:.2f}, "
              f"{high:.2f}], same outputs {result['same_outputs_as_engine']['engine_xla']:.0%}; "
              f"its iteration {result['xla_iteration_ms']:.2f} ms, floor step "
              f"{result['xla_floor_iteration_ms']:.2f} ms")
    for name, floor in result.get("hbm_floor", {}).get("arms", {}).items():
        print(f"{name}: iteration {floor['iteration_ms']:.2f} ms over {floor['iterations']:.0f}, "
              f"HBM floor {floor['floor_iteration_ms']:.2f} ms (mean live length "
              f"{floor['mean_live_length']:.0f}): {floor['iteration_vs_hbm_floor']:.2f}x")
    print(
        f"iteration {result['iteration_ms']:.2f} ms over {result['engine_decode_iterations']:.0f} "
        f"iterations; floor step {result['floor_iteration_ms']:.2f} ms "
        f"(IQR {result['floor_iteration_ms_spread']['iqr']:.2f}, batch {info['floor']['batch']}); "
        f"ratio {result['iteration_vs_floor_ratio']:.2f}; "
        f"prefill floor {result['prefill_ms']:.1f} ms"
    )
    if "cap_wall_ratio" in result:
        ratio, low, high = result["cap_wall_ratio"]
        print(f"generate wall at cap {result['profile']['max_new_tokens']} over cap "
              f"{result['profile']['short_cap']}: {ratio:.2f} [95% CI {low:.2f}, {high:.2f}], "
              f"same outputs {result['same_outputs_as_engine']['engine_short_cap']:.0%}")


def print_comparisons(result: dict[str, Any]) -> None:
    """A revision, the `--engine` arms and the maxtext revision against theirs; CB's speedup."""
    info = result["arm_info"]
    if "tokens_per_s_ratio_vs_rev" in result:
        ratio, low, high = result["tokens_per_s_ratio_vs_rev"]
        print(f"engine tokens/s vs rev {info['rev']['rev']}, both in workers: {ratio:.2f} "
              f"[95% CI {low:.2f}, {high:.2f}], same outputs "
              f"{result['same_outputs_as_engine']['rev']:.0%}")
    for name in ENGINE_ARMS:
        for other in ("engine", "tunix"):
            if f"{name}_tokens_per_s_ratio_vs_{other}" in result:
                ratio, low, high = result[f"{name}_tokens_per_s_ratio_vs_{other}"]
                print(f"{name} engine tokens/s vs {other}: {ratio:.2f} "
                      f"[95% CI {low:.2f}, {high:.2f}]")
    if "maxtext_tokens_per_s_ratio_vs_maxtext_rev" in result:
        ratio, low, high = result["maxtext_tokens_per_s_ratio_vs_maxtext_rev"]
        print(f"maxtext engine ({result['maxtext_model']}) tokens/s vs rev "
              f"{info['maxtext_rev']['rev']}'s, both in workers: {ratio:.2f} "
              f"[95% CI {low:.2f}, {high:.2f}], "
              f"same outputs {result['same_outputs_as_engine']['maxtext_rev_vs_maxtext']:.0%}")
    for variant in ("waves", "one_batch"):
        if f"cb_speedup_vs_engine_{variant}" in result:
            speedup, low, high = result[f"cb_speedup_vs_engine_{variant}"]
            print(
                f"continuous batching vs {variant.replace('_', ' ')}: {speedup:.2f}x "
                f"[95% CI {low:.2f}, {high:.2f}] ({result['engine_decode_iterations']:.0f} vs "
                f"{result[f'engine_{variant}_decode_iterations']:.0f} iterations)"
            )




def print_table(result: dict[str, Any]) -> None:
    """A launch's result (`runner.run`) as a table of its arms and a line per comparison."""
    print_arms(result)
    print_engine_figures(result)
    print_comparisons(result)


@dataclasses.dataclass(frozen=True)
class ProgressPrinter:
    """`run`'s progress on stderr; with `json_path`, what has run so far (no completions) in
    `json_path`.partial, in case the run is cut short. A dataclass, so a launch can take it."""

    profile: EngineProfile
    json_path: str | None = None

    def __call__(self, what: str, state: dict) -> None:
        print(f"[{state['elapsed_s']:7.1f} s] {what} (XLA compiles so far "
              f"{state['compile_s']:.1f} s)", file=sys.stderr, flush=True)
        if self.json_path:
            records = {name: [{k: v for k, v in r.items() if k != "completions"} for r in rs]
                       for name, rs in state["records"].items()}
            with open(f"{self.json_path}.partial", "w") as f:
                json.dump({"profile": dataclasses.asdict(self.profile), "done": what, **state,
                           "records": records}, f, indent=1)


def print_launches(combined: dict[str, Any]) -> None:
    results = combined["launches"]
    print(f"across {len(results)} launches, engine tokens/s over each arm's (cap_wall_ratio: "
          "generate wall at the cap over the short cap):")
    for name, ratios in combined["across_launches"].items():
        pooled, welch = ratios["pooled_ci95"], ratios["welch_ci95"]
        each = " ".join(f"{r:.2f}" for r in ratios["per_launch"])
        print(f"  {name:<16} per launch {each}; pooled {pooled['median']:.2f} [95% CI "
              f"{pooled['ci_low']:.2f}, {pooled['ci_high']:.2f}]; over launch medians "
              f"{welch['median']:.2f} [Welch {welch['ci_low']:.2f}, {welch['ci_high']:.2f}]")
