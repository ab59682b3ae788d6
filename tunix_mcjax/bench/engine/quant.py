"""The JAX engine's tokens/s per quantization mode, against bf16 weights and KV pages.

    python -m tunix_mcjax.bench.engine.quant [--profile qwen3-0.6b-cpu] [--repeats N]
        [--max-new-tokens N] [--modes bf16,int8,...] [--out STEM]

One process, one device: the profile's random-init model (qwen3-0.6b-cpu: Qwen3-0.6B's shape in
bfloat16, the model of recipes/cpu/qwen3_0p6b.yml), prompts and sampling (bench.engine.workload),
and one JaxEngine per mode, `generate` alone (no trainer), each compiled by a warm-up first.
Modes (MODES): bf16 weights and pages; int8 or fp8 weights (`quantization`); bf16 weights with
int8 or fp8 KV pages (`quantize_kvcache` with `kv_quant_dtype`, a scale per token and head), fp8
pages under one static scale (`kv_quant_axis=tensor`); int8 weights with fp8 pages.
Each repeat runs every mode once, in a fresh shuffled order (bench.engine.runner.ArmSet), with
seed repeat + 1, and records the 1-minute load average before and after each generate.
Per mode: tokens/s, median over repeats [95% bootstrap] (bench.stats.bootstrap_median); its
ratio to bf16's, a ratio of medians [95% bootstrap, each mode resampled on its own]; the median
of per-repeat ratios (paired by repeat: same seed, same load) [95% bootstrap]; and the share of
completions equal to bf16's (same seed: how far the mode moves the samples). Writes STEM.json
(every record) and STEM.md (default STEM: bench_results/quant/tokens-<profile>).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tunix_mcjax.bench import stats
from tunix_mcjax.bench.engine import results
from tunix_mcjax.bench.engine.arms import Measure, engine_arm
from tunix_mcjax.bench.engine.workload import PROFILES, model_of

BASE = "bf16"
# Mode -> (quantization, kv_quantization): EngineOptions' fields ("" keeps bf16).
MODES = {
    BASE: ("", ""),
    "int8": ("int8", ""),
    "fp8": ("fp8", ""),
    "kv-int8": ("", "int8"),
    "kv-fp8": ("", "fp8"),
    "kv-fp8-tensor": ("", "fp8_tensor"),
    "int8+kv-fp8": ("int8", "fp8"),
}


def profile_dtype(profile) -> str:
    """The dtype a profile's model holds its weights in (the unquantized base's)."""
    return np.dtype(model_of(profile).param_dtype).name


def bf16_profiles() -> list[str]:
    """The profiles whose model holds bfloat16 weights: the base the modes are measured against."""
    return sorted(n for n, p in PROFILES.items() if profile_dtype(p) == "bfloat16")


def with_load(measure: Measure) -> Measure:
    """`measure`, its record also holding the 1-minute load average before and after it."""
    def measured(rep: int) -> dict[str, Any]:
        before = os.getloadavg()[0]
        record = measure(rep)
        return {**record, "loadavg_1m_before": before, "loadavg_1m_after": os.getloadavg()[0]}

    return measured


def mode_arm(mode: str, profile, params, prompts, sampling) -> tuple[Measure, dict]:
    """A warmed-up engine arm of `mode` (MODES), its records carrying the load average."""
    weights, kv = MODES[mode]
    measure, info = engine_arm(profile, params, prompts, sampling, continuous=True,
                               batch=profile.decode_batch, quantization=weights,
                               kv_quantization=kv)
    return with_load(measure), {**info, "quantization": weights, "kv_quantization": kv}


def repeat_loads(records: results.Records) -> list[list[float]]:
    """Per repeat, [load before its first generate, load after its last] (by `position`)."""
    rounds = zip(*records.values(), strict=True)
    return [[min(rs, key=lambda r: r["position"])["loadavg_1m_before"],
             max(rs, key=lambda r: r["position"])["loadavg_1m_after"]] for rs in rounds]


def mode_figures(records: results.Records) -> dict[str, dict[str, Any]]:
    """Per mode: tokens/s [95%], its ratio to BASE's (of medians, and paired by repeat), and
    the share of completions equal to BASE's. Reads `completions`; does not drop them."""
    base = results.tokens_per_s(records[BASE])
    out = {}
    for mode, recs in records.items():
        tps = results.tokens_per_s(recs)
        out[mode] = {"tokens_per_s_ci95": stats.bootstrap_median(tps).as_tuple(),
                     "vs_bf16_ci95": results.ratio_ci(tps, base),
                     "vs_bf16_paired_ci95": results.paired_ratio(tps, base),
                     "same_outputs_as_bf16": results.same_outputs(recs, records[BASE]),
                     "tokens": results.median_of(recs, "tokens"),
                     "iterations": results.median_of(recs, "iterations")}
    return out


def _ci(t: Sequence[float], fmt: str) -> str:
    return f"{t[0]:{fmt}} [{t[1]:{fmt}}, {t[2]:{fmt}}]"


def markdown(rep: dict) -> str:
    p, loads = rep["profile"], rep["repeat_loadavg_1m"]
    lines = [f"# Tokens/s per quantization mode: {p['name']}", "",
             f"JaxEngine.generate alone on {rep['device']} (jax {rep['jax_version']}): "
             f"{p['prompts']} prompts x {p['generations']} generations, prompts of "
             f"{p['prompt_lengths'][0]}-{p['prompt_lengths'][1]} tokens, {p['max_new_tokens']} "
             f"new tokens each, {p['decode_batch']} rows, {p['repeats']} interleaved repeats. "
             "Median over repeats [95% bootstrap]; vs bf16: ratio of medians, and median of "
             "per-repeat ratios (paired).", "",
             "| mode | weights | KV pages | tokens/s | vs bf16 | vs bf16, paired "
             "| outputs equal to bf16 | warm-up s |", "|---" * 8 + "|"]
    for mode, f in rep["modes"].items():
        info = rep["arm_info"][mode]
        dtypes = " | ".join(info[k] or "bf16" for k in ("quantization", "kv_quantization"))
        lines.append(f"| {mode} | {dtypes} | {_ci(f['tokens_per_s_ci95'], '.1f')} "
                     f"| {_ci(f['vs_bf16_ci95'], '.3f')} | {_ci(f['vs_bf16_paired_ci95'], '.3f')} "
                     f"| {f['same_outputs_as_bf16']:.3f} | {info['warmup_s']:.0f} |")
    lines += ["", "Load 1m before/after each repeat: "
              + "; ".join(f"{a:.1f}/{b:.1f}" for a, b in loads)
              + f". Commit {rep['code']}.", ""]
    return "\n".join(lines)


def run(profile, modes: Sequence[str], progress=None) -> dict[str, Any]:
    """Warm every mode up, run them interleaved, and return the result (records included)."""
    import jax

    from tunix_mcjax.bench.engine.runner import ArmSet, Workload
    from tunix_mcjax.bench.step import code_version

    arms, work = ArmSet(progress), Workload.of(profile)
    for mode in modes:
        arms.add(mode, mode_arm, mode, *work.args)
    arms.repeat(profile.repeats)
    figures = mode_figures(arms.records)
    for recs in arms.records.values():
        for r in recs:
            r.pop("completions")
    return {"profile": dataclasses.asdict(profile), "device": str(jax.devices()[0]),
            "jax_version": jax.__version__, "code": code_version(),
            "modes": figures, "arm_info": arms.info(),
            "repeat_loadavg_1m": repeat_loads(arms.records), "records": arms.records}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tunix_mcjax.bench.engine.quant",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--profile", choices=bf16_profiles(), default="qwen3-0.6b-cpu",
                   help="a profile whose model is in bfloat16 (the modes' base)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of {', '.join(MODES)}; bf16 always runs")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="new tokens a request (default: the profile's)")
    p.add_argument("--out", type=Path, help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if bad := sorted(set(modes) - set(MODES)):
        p.error(f"--modes: unknown {', '.join(bad)}; choose from {', '.join(MODES)}")
    args.modes = list(dict.fromkeys([BASE, *modes]))
    if args.repeats < 2 or args.max_new_tokens < 0:
        p.error("need --repeats >= 2 (an interval) and --max-new-tokens >= 0")
    args.out = args.out or Path("bench_results/quant") / f"tokens-{args.profile}"
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    profile = dataclasses.replace(PROFILES[args.profile], repeats=args.repeats)
    if args.max_new_tokens:
        profile = dataclasses.replace(profile, max_new_tokens=args.max_new_tokens)
    rep = run(profile, args.modes, progress=lambda what, _: print(what, flush=True))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(rep, indent=1) + "\n")
    text = markdown(rep)
    Path(f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
