"""One fixed batch, one update, four train-step layouts on 4 CPU devices of one process:
params gathered once or kept sharded through compute, with and without micro-batches. Every
layout must give the one-batch gather-once update (fp32, 1e-5)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.mp import REPO, xla_flags


@pytest.fixture(scope="module")
def updates(tmp_path_factory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("layouts")
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "XLA_FLAGS": xla_flags(4)}
    proc = subprocess.run([sys.executable, "-m", "tests.workers_memory.updates", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(np.load(out / "updates.npz"))


def assert_same_update(npz, variant: str) -> None:
    keys = [k[len("initial/"):] for k in npz if k.startswith("initial/")]
    moved = 0
    for key in keys:
        want, got = npz[f"gather/final/{key}"], npz[f"{variant}/final/{key}"]
        # Adam's first step moves an element by lr * g / (|g| + eps): where the gradient is
        # near eps (1e-8) the step amplifies its rounding (another summation order; measured
        # 6e-4 of a step after the layers were scanned), so the floor is a share of the step.
        step = np.abs(want - npz[f"initial/{key}"]).max()
        np.testing.assert_allclose(got, want, rtol=1e-5,
                                   atol=max(1e-5 * np.abs(want).max(), 1e-3 * step),
                                   err_msg=f"{variant}: {key}")
        moved += int(not np.array_equal(want, npz[f"initial/{key}"]))
    assert moved == len(keys)  # every leaf moved, so the comparison has teeth
    for metric in ("loss", "grad_norm", "kl", "kl_loss", "mismatch_abs_mean", "mismatch_abs_max",
                   "mismatch_seq_log_ratio", "mismatch_k3", "mismatch_out_frac"):
        want = float(npz[f"gather/metric/{metric}"])
        assert float(npz[f"{variant}/metric/{metric}"]) == pytest.approx(want, rel=1e-5,
                                                                         abs=1e-7), metric
    assert float(npz[f"{variant}/metric/finite"]) == 1.0


def test_sharded_compute_gives_the_gather_once_update(updates):
    assert updates["gather/gathered"] and not updates["sharded/gathered"]
    assert updates["gather/micro_batches"] == updates["sharded/micro_batches"] == 1
    assert_same_update(updates, "sharded")


@pytest.mark.parametrize("variant", ["gather_micro", "sharded_micro"])
def test_accumulated_update_equals_the_one_batch_update(updates, variant):
    assert updates[f"{variant}/micro_batches"] > 1
    assert_same_update(updates, variant)


@pytest.mark.bench  # ~1 min; the 4-device layouts above cover accumulation in the default suite
def test_two_hosts_accumulating_sharded_update_equals_tunix(tmp_path):
    """2 processes x 2 devices: micro-batches over the global fsdp axis, params sharded through
    compute: each fixed-update case's loss and applied gradient against Tunix's grpo_loss_fn
    on the one padded batch (test_colocated's reference)."""
    from tests.mp import TINY, launch_worker
    from tests.test_colocated import tunix_reference_grads
    from tests.workers.fixed_update import CASES, fixed_batch
    from tunix_mcjax import memory
    from tunix_mcjax.config import load_config
    from tunix_mcjax.train import packing

    # The worker's packing: each host's 8 sequences in rows of 10; several micro-batches run.
    prompts, completions, _ = fixed_batch(4, 4)
    lengths = [len(prompts[j // 4]) + len(c) for j, c in enumerate(completions)]
    rows = [len(packing.first_fit_decreasing(lengths[h * 8:(h + 1) * 8], 10)) for h in (0, 1)]
    assert memory.micro_batch_rows(packing.rows_per_device(rows, 2), 4)[0] > 1

    overrides = [*TINY, "batch_size=4", "num_generations=4", "max_prefill_predict_length=4",
                 "max_target_length=10", "learning_rate=0.01", "grpo_beta=0.1",
                 "adam_eps=1e-4", "train_micro_batch_size=1", "fsdp_gather_params_once=false",
                 f"base_output_directory={tmp_path}", "run_name=upd"]
    proc = launch_worker("tests.workers.fixed_update", "recipes/cpu/demo.yml", overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    npz = np.load(tmp_path / "upd" / "update.npz")
    cfg = load_config(REPO / "recipes/cpu/demo.yml", overrides)
    for case, changes in CASES.items():
        ref_loss, ref_grads = tunix_reference_grads(cfg.replace(**changes), npz, case)
        assert float(npz[f"{case}/loss"]) == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        for key, want in ref_grads.items():
            np.testing.assert_allclose(npz[f"{case}/grad/{key}"], want, rtol=1e-5,
                                       atol=1e-5 * np.abs(want).max(), err_msg=f"{case} {key}")
