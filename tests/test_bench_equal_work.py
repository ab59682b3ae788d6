"""The equal-work rule: equal runs pass, and each kind of unequal run fails with its reason."""

import json

import pytest

from tunix_mcjax.bench.equal_work import RunLog, check_equal_work

STEPS, FIRST_SCORED = 6, 3


def _records(**change):
    out = []
    for step in range(STEPS):
        rec = {
            "step": step, "step_s": 1.0, "compiled": step == 0,
            "prompt_indices": [step, step + 10], "prompt_tokens_mean": 20.0,
            "completion_len_mean": 50.0, "completion_len_max": 64,
            "truncated_frac": 0.2, "tokens_generated": 6400,
        }
        for key, value in change.items():
            rec[key] = value(step) if callable(value) else value
        out.append(rec)
    return out


def _check(**change):
    return check_equal_work(RunLog("mcjax", tuple(_records())),
                            RunLog("tunix", tuple(_records(**change))), FIRST_SCORED)


def test_equal_runs_pass_with_summary():
    got = _check(completion_len_mean=45.0, truncated_frac=0.25)
    assert got.ok and got.problems == ()
    assert got.summary["tunix"] == {"completion_len_mean": 45.0, "completion_len_max": 64.0,
                                    "truncated_frac": 0.25}


def test_different_prompt_order_is_named():
    got = _check(prompt_indices=lambda s: [s + 10, s] if s == 4 else [s, s + 10])
    assert not got.ok
    assert got.problems == ("step 4: different prompts or prompt order",)


def test_different_prompt_length_is_named():
    got = _check(prompt_tokens_mean=lambda s: 20.6 if s == 1 else 20.0)
    assert got.problems == ("step 1: mean prompt length 20.00 vs 20.60 tokens (tolerance 0.5)",)


def test_missing_steps_are_named():
    short = check_equal_work(RunLog("mcjax", tuple(_records())),
                             RunLog("tunix", tuple(_records()[:-1])), FIRST_SCORED)
    assert not short.ok and "different steps" in short.problems[0]


@pytest.mark.parametrize("key,value,word", [
    ("completion_len_mean", 39.0, "mean output length"),   # ratio 0.78
    ("completion_len_mean", 63.0, "mean output length"),   # ratio 1.26
    ("completion_len_max", 50, "longest output length"),   # ratio 0.78
])
def test_output_length_outside_band_is_named(key, value, word):
    got = _check(**{key: value})
    assert not got.ok and len(got.problems) == 1
    assert got.problems[0].startswith(word) and "outside [0.8, 1.25]" in got.problems[0]


def test_length_band_edges_are_inclusive():
    assert _check(completion_len_mean=40.0).ok
    assert _check(completion_len_mean=62.5).ok


def test_truncation_gap_is_named():
    assert _check(truncated_frac=0.3).ok  # exactly 10 points
    got = _check(truncated_frac=0.31)
    assert got.problems == ("truncation share 31% (tunix) vs 20% (mcjax): 11.0 points apart, "
                            "more than 10",)


def test_only_scored_steps_count_for_lengths():
    early_long = _check(completion_len_max=lambda s: 500 if s < FIRST_SCORED else 64)
    assert early_long.ok


def test_load_sorts_steps_and_scored_drops_compile_steps(tmp_path):
    path = tmp_path / "steps.jsonl"
    recs = _records(compiled=lambda s: s in (0, 4))
    path.write_text("\n".join(json.dumps(r) for r in reversed(recs)) + "\n")
    run = RunLog.load(path, "mcjax")
    assert [r["step"] for r in run.records] == list(range(STEPS))
    assert [r["step"] for r in run.scored(FIRST_SCORED)] == [3, 5]
    assert run.column("step_s", FIRST_SCORED).tolist() == [1.0, 1.0]
