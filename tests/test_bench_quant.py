"""The quantized-rollout benches' pure parts against plain references (no launches, no engine):
bench.quant (learning with int8 weights and fp8 KV against bf16, on bench.learn_arms) and
bench.engine.quant (tokens/s per mode)."""

from __future__ import annotations

import pytest

from tunix_mcjax.bench import learn_arms, quant
from tunix_mcjax.bench.engine import quant as engine_quant
from tunix_mcjax.bench.learn import SeedResult
from tunix_mcjax.bench.mismatch import config_refusal
from tunix_mcjax.engine.options import EngineOptions


def _result(arm: str, seed: int, accuracy: list[float]) -> SeedResult:
    return SeedResult(arm, seed, accuracy, [2 * a for a in accuracy])


def test_plan_pairs_the_arms_seed_by_seed_and_their_keys_load():
    cells = learn_arms.plan(quant.BENCH, 2, hosts=2, devices_per_host=2)
    assert [c.name for c in cells] == [
        "demo-bf16-co-tistoken-s0", "demo-int8-fp8kv-co-tistoken-s0",
        "demo-bf16-co-tistoken-s1", "demo-int8-fp8kv-co-tistoken-s1"]
    base, quantized = cells[:2]
    assert "rollout_weight_dtype=bfloat16" in base.overrides()
    assert "sampler_is=token" in base.overrides() and "seed=0" in base.overrides()
    assert quantized.overrides() == [*base.overrides(), "quantization=int8",
                                     "quantize_kvcache=true", "kv_quant_dtype=fp8"]
    assert quantized.arm == quant.QUANT and base.arm == quant.BASE == quant.BENCH.base
    for cell in cells:  # the demo config takes every arm's keys
        assert config_refusal(cell, ["steps=150"]) == ""


def test_quant_summary_takes_the_ratio_quantized_over_bf16_and_counts_the_bar():
    ramp = [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]  # trailing 2-step mean reaches 0.9 at step 4
    slow = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0]  # ... at step 6
    sags = [0.0, 0.5, 1.0, 1.0, 1.0, 0.8]  # reaches 0.9 at step 4, ends at 0.9 (< bar 0.95)
    arms = {quant.BASE: [_result(quant.BASE, 0, ramp), _result(quant.BASE, 1, ramp)],
            quant.QUANT: [_result(quant.QUANT, 0, slow), _result(quant.QUANT, 1, sags)]}
    rep = learn_arms.summary(arms, quant.BASE, target=0.9, window=2, bar=0.95)
    assert rep["pairs"] == [[quant.QUANT, quant.BASE]]
    assert rep[f"ratio_{quant.QUANT}_over_{quant.BASE}"]["median"] == pytest.approx(10 / 8)
    q = rep["arms"][quant.QUANT]
    assert q["steps_to_target"] == [6, 4]
    assert q["bar_met"] == [True, False] and q["bar_met_count"] == 1
    assert rep["arms"][quant.BASE]["bar_met_count"] == 2
    assert not rep["censored"]
    for block in rep["arms"].values():
        block["loadavg_1m"] = [[1.0, 2.0], [2.0, 3.0]]
    context = {"demo": "recipes/cpu/demo.yml", "steps": 6, "hosts": 2, "devices_per_host": 2,
               "arms": {a: list(k) for a, k in quant.BENCH.arms.items()}}
    text = learn_arms.markdown(quant.BENCH, {"context": context, "cells": [], "learning": rep})
    assert f"| {quant.QUANT} | 6, 4 | 5 [4, 6] | 2/2 |" in text
    assert f"{quant.QUANT} / {quant.BASE}, summed steps to target over paired seeds: 1.250" in text
    assert f"seeds met: {quant.BASE} 2/2; {quant.QUANT} 1/2." in text


def test_bar_is_the_trailing_mean_of_the_last_window():
    assert learn_arms.bar_met(_result("a", 0, [0.0, 0.9, 1.0]), bar=0.95, window=2)
    assert not learn_arms.bar_met(_result("a", 0, [1.0, 1.0, 0.8]), bar=0.95, window=2)


def _records(walls: dict[str, list[float]], tokens: int = 64) -> dict[str, list[dict]]:
    out = {}
    for mode, ws in walls.items():
        out[mode] = [{"wall_s": w, "tokens": tokens, "iterations": 8, "position": i % 3,
                      "loadavg_1m_before": 1.0 + i, "loadavg_1m_after": 1.5 + i,
                      "completions": [[1, 2], [3, 4 if mode == "bf16" else 5]]}
                     for i, w in enumerate(ws)]
    return out


def test_mode_figures_are_the_tokens_per_s_median_and_ratios_to_bf16():
    walls = {"bf16": [1.0, 2.0, 4.0], "int8": [0.5, 1.0, 2.0], "fp8": [2.0, 4.0, 8.0]}
    figs = engine_quant.mode_figures(_records(walls))
    assert figs["bf16"]["tokens_per_s_ci95"][0] == pytest.approx(32.0)
    assert figs["int8"]["vs_bf16_ci95"][0] == pytest.approx(2.0)
    assert figs["fp8"]["vs_bf16_ci95"][0] == pytest.approx(0.5)
    # Paired: every repeat's ratio is 2 (int8), so its interval has no width.
    assert figs["int8"]["vs_bf16_paired_ci95"] == pytest.approx((2.0, 2.0, 2.0))
    assert figs["bf16"]["same_outputs_as_bf16"] == 1.0
    assert figs["int8"]["same_outputs_as_bf16"] == 0.5  # the second completion differs


def test_repeat_loads_take_the_first_and_last_generate_of_each_repeat():
    recs = _records({"bf16": [1.0, 1.0], "int8": [1.0, 1.0]})
    recs["bf16"][0].update(position=1, loadavg_1m_before=9.0, loadavg_1m_after=9.5)
    recs["int8"][0].update(position=0, loadavg_1m_before=3.0, loadavg_1m_after=4.0)
    recs["int8"][1].update(position=0, loadavg_1m_before=2.2)
    assert engine_quant.repeat_loads(recs) == [[3.0, 9.5], [2.2, 2.5]]


def test_every_mode_is_an_engine_setting():
    assert list(engine_quant.MODES)[0] == engine_quant.BASE == "bf16"
    for weights, kv in engine_quant.MODES.values():
        opts = EngineOptions(pad_id=0, eos_ids=(1,), max_prompt_length=4, max_new_tokens=2,
                             quantization=weights, kv_quantization=kv)
        assert (opts.quantization, opts.kv_quantization) == (weights, kv)


def test_parse_args_runs_bf16_first_and_refuses_what_it_cannot_measure():
    args = engine_quant.parse_args(["--modes", "kv-fp8,int8", "--repeats", "3"])
    assert args.modes == ["bf16", "kv-fp8", "int8"]
    assert str(args.out) == "bench_results/quant/tokens-qwen3-0.6b-cpu"
    assert engine_quant.bf16_profiles() == ["qwen3-0.6b-cpu", "qwen3-0.6b-gpu"]
    for bad in (["--modes", "int4"], ["--repeats", "1"], ["--profile", "gsm8k-cpu"]):
        with pytest.raises(SystemExit):
            engine_quant.parse_args(bad)
