"""The rollout-trainer mismatch each step reports: equal to a NumPy recomputation from the logprobs
of the step's own weights (Tunix's compute_per_token_logps on them) and the behaviour logprobs
its rows carry, in the flat and the sharded step, over micro-batches; and where it shows (the
progress line, TensorBoard's tags). tests/test_colocated.py checks the same over 2 hosts x 2
devices with `reference_mismatch`."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_phases import _cfg, _setup
from tunix_mcjax import metrics

FIELDS = ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_seq_log_ratio", "mismatch_k3",
          "mismatch_out_frac")


def numpy_mismatch(trainer_logps: np.ndarray, rollout_logps: np.ndarray, mask: np.ndarray
                   ) -> dict[str, float]:
    """The formulas on a padded layout (one sequence per row): r = log p_trainer -
    log p_rollout per loss-masked token; mean and max |r|, the mean over sequences of the sum
    of r, the k3 mean of exp(r) - 1 - r, the share of tokens with exp(r) outside [0.5, 2]."""
    mask = mask.astype(bool)
    r = np.where(mask, trainer_logps.astype(np.float64) - rollout_logps, 0.0)
    tokens = mask.sum()
    return {"mismatch_abs_mean": np.abs(r).sum() / tokens,
            "mismatch_abs_max": np.abs(r).max(),
            "mismatch_seq_log_ratio": r.sum(1)[mask.any(1)].mean(),
            "mismatch_k3": ((np.exp(r) - 1 - r) * mask).sum() / tokens,
            "mismatch_out_frac": ((np.exp(r) < 0.5) | (np.exp(r) > 2))[mask].mean()}


def assert_mismatch_equal(got: dict, want: dict) -> None:
    assert 0 < want["mismatch_out_frac"] < 1  # some ratios leave [0.5, 2], not all
    for key in FIELDS:
        # The trainer's and Tunix's logprobs agree to ~1e-6; the share of tokens is a count
        # (exact up to float32's division).
        tol = 1e-6 if key == "mismatch_out_frac" else 1e-4 * max(abs(want[key]), 1e-2)
        assert got[key] == pytest.approx(want[key], abs=tol), key


@pytest.mark.parametrize("gather,micro", [("auto", -1), ("auto", 1), ("false", 2)])
def test_step_reports_the_mismatch_of_its_own_logprobs(gather, micro):
    """The step's metrics against NumPy from Tunix's logprobs at the step's starting weights
    and the behaviour logprobs (Tunix's own plus noise) that the packed rows carry."""
    cfg = _cfg(fsdp_gather_params_once=gather, train_micro_batch_size=micro)
    trainer, local, ref, _, behaviour = _setup(cfg, lr=0.1, noise=0.5)
    got = trainer.step(local)
    want = numpy_mismatch(ref.logps(), behaviour, ref.completion_ids != 0)
    assert_mismatch_equal(got, want)
    assert "sampler_is_weight_mean" not in got and "rollout_rs_rejected_frac" not in got


def test_progress_line_and_tensorboard_show_it():
    rec = {"step": 3, "reward_mean": 0.5, "accuracy": 0.25, "step_s": 1.0,
           "phase_s": dict.fromkeys(metrics.PHASES, 0.1),
           "mismatch_abs_mean": 1.234e-3, "mismatch_k3": 4.5e-7}
    line = metrics.progress_line(rec)
    assert "| mismatch 1.2e-03 k3 4.5e-07 |" in line
    del rec["mismatch_abs_mean"]
    assert "mismatch" not in metrics.progress_line(rec)  # a step that did not train
    tags = {metrics.TB_SCALARS[k] for k in metrics.MISMATCH_FIELDS}
    assert {"mismatch/abs_mean", "mismatch/k3", "mismatch/out_frac"} <= tags


def reference_mismatch(cfg, initial: dict[str, np.ndarray], prompts, completions,
                       behaviour: list[np.ndarray]) -> dict[str, float]:
    """`numpy_mismatch` from Tunix's logprobs of `completions` (completion j answers prompt
    j // G) under the params `initial` (flat path -> array), against `behaviour`."""
    from tests.test_phases import TunixReference

    ref = TunixReference(cfg, prompts, completions, np.zeros(len(completions), np.float32))
    ref.load(initial)
    padded = np.zeros(ref.completion_ids.shape, np.float32)
    for j, b in enumerate(behaviour):
        padded[j, :len(b)] = b
    return numpy_mismatch(ref.logps(), padded, ref.completion_ids != 0)
