"""The colocated runtime on 2 real JAX processes x 2 CPU devices (gloo collectives)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import psutil
import pytest
from flax import nnx
from tunix.rl import algo_core, common

from tests.mp import REPO, TINY, launch_worker, read_jsonl
from tunix_mcjax import models
from tunix_mcjax.config import load_config


def tunix_reference_grads(cfg, npz, case: str) -> tuple[float, dict[str, np.ndarray]]:
    """Tunix's grpo_loss_fn and its gradient, one process, on the padded (unpacked) batch."""
    from tests.workers.fixed_update import VOCAB, fixed_batch

    g = cfg.num_generations
    prompts, completions, rewards = fixed_batch(cfg.batch_size, g)
    adv = algo_core.compute_advantages(rewards, g)
    model = models.create_model(models.model_config(cfg, VOCAB), seed=123)
    params = nnx.state(model, nnx.Param)
    flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(params)}
    for key in flat:
        flat[key].set_value(jax.numpy.asarray(npz[f"{case}/initial/{key}"]))
    nnx.update(model, params)

    pl = max(len(p) for p in prompts)
    cl = max(len(c) for c in completions)
    prompt_ids = np.zeros((len(completions), pl), np.int32)  # left-padded, pad id 0
    completion_ids = np.zeros((len(completions), cl), np.int32)  # right-padded
    for j, c in enumerate(completions):
        p = prompts[j // g]
        prompt_ids[j, pl - len(p):] = p
        completion_ids[j, :len(c)] = c
    temperature = cfg.decode_sampling_temperature
    ref = None
    if cfg.grpo_beta:
        graphdef, state = nnx.split(model)
        ref = common.compute_per_token_logps(graphdef, state, jax.numpy.asarray(prompt_ids),
                                             jax.numpy.asarray(completion_ids), 0, 2,
                                             temperature=temperature)
    example = common.TrainExample(
        prompt_ids=jax.numpy.asarray(prompt_ids), prompt_mask=jax.numpy.asarray(prompt_ids != 0),
        completion_ids=jax.numpy.asarray(completion_ids),
        completion_mask=jax.numpy.asarray(completion_ids != 0).astype(np.float32),
        advantages=jax.numpy.asarray(adv), ref_per_token_logps=ref, old_per_token_logps=None)
    algo = types.SimpleNamespace(beta=cfg.grpo_beta, epsilon=cfg.grpo_epsilon,
                                 loss_algo=cfg.loss_algo,
                                 loss_agg_mode=cfg.loss_agg_mode, kl_loss_mode="kl",
                                 kl_clamp_value=None, temperature=temperature)

    def loss_fn(m):
        return algo_core.grpo_loss_fn(m, example, algo, pad_id=0, eos_id=2)

    (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return float(loss), {"/".join(map(str, k)): np.asarray(v.get_value())
                         for k, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))}


UPDATE = [*TINY, "batch_size=4", "num_generations=4", "max_prefill_predict_length=4",
          "max_target_length=10"]


@pytest.fixture(scope="module")
def mcjax_updates(tmp_path_factory):
    """One launch (2 hosts x 2 devices) runs every case of tests/workers/fixed_update.py."""
    out = tmp_path_factory.mktemp("update")
    proc = launch_worker("tests.workers.fixed_update", "recipes/cpu/demo.yml",
                         [*UPDATE, f"base_output_directory={out}", "run_name=upd"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return np.load(out / "upd" / "update.npz")


def _case_names():
    from tests.workers.fixed_update import CASES

    return list(CASES)


@pytest.mark.parametrize("case", _case_names())
def test_gradient_equals_tunix(mcjax_updates, case):
    """The gradient the mcjax trainer applied (packed rows over 4 devices of 2 hosts) equals
    the gradient of Tunix's grpo_loss_fn on the padded batch, leaf by leaf, to 1e-5."""
    from tests.workers.fixed_update import CASES

    npz = mcjax_updates
    cfg = load_config(REPO / "recipes/cpu/demo.yml", UPDATE).replace(**CASES[case])
    ref_loss, ref_grads = tunix_reference_grads(cfg, npz, case)
    assert float(npz[f"{case}/loss"]) == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    for key, want in ref_grads.items():
        got = npz[f"{case}/grad/{key}"]
        assert np.abs(want).max() > 0, key  # every leaf has a gradient: the check has teeth
        # 1e-5 relative to each element, or to the leaf's scale for entries near zero.
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=key)


@pytest.mark.parametrize("case", ["seq-b0-t1", "seq-b01-t07"])
def test_mismatch_is_global_over_hosts(mcjax_updates, case):
    """The mismatch the step reports over 4 devices of 2 hosts equals NumPy's over the whole
    batch, from Tunix's logprobs at the step's starting weights (tests/test_mismatch.py)."""
    from tests.test_mismatch import FIELDS, assert_mismatch_equal, reference_mismatch
    from tests.workers.fixed_update import CASES, behaviour_logps, fixed_batch

    npz = mcjax_updates
    cfg = load_config(REPO / "recipes/cpu/demo.yml", UPDATE).replace(**CASES[case])
    prompts, completions, _ = fixed_batch(cfg.batch_size, cfg.num_generations)
    initial = {k.removeprefix(f"{case}/initial/"): npz[k] for k in npz.files
               if k.startswith(f"{case}/initial/")}
    want = reference_mismatch(cfg, initial, prompts, completions, behaviour_logps(completions))
    assert_mismatch_equal({k: float(npz[f"{case}/metrics/{k}"]) for k in FIELDS}, want)


def test_allgather_keeps_8_byte_values_exact(mcjax_updates):
    """JAX with x64 off would round these through float32/int32."""
    assert mcjax_updates["allgather_int64"].dtype == np.int64
    assert mcjax_updates["allgather_int64"].ravel().tolist() == [2**40 + 1, 2**40 + 2]
    assert mcjax_updates["allgather_float64"].ravel().tolist() == [16777217.0, 16777218.0]


@pytest.mark.slow  # a 3-host launch
def test_uneven_hosts_publish_and_assignment(tmp_path):
    """Hosts stop at different lengths (no deadlock); engines equal trainer params; groups whole;
    O3 with expected output rebalances the repeated batch by the lengths it observed."""
    overrides = [*TINY, "steps=2", "batch_size=4", "num_generations=4",
                 "max_prefill_predict_length=4", "max_target_length=12", "ignore_eos=true",
                 "data_repeat_period=1", "rl_balance_prompts_by_length=true",
                 "rl_balance_by_expected_output=true",
                 f"base_output_directory={tmp_path}", "run_name=uneven"]
    proc = launch_worker("tests.workers.uneven_run", "recipes/cpu/demo.yml", overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "uneven"
    for host in (0, 1):
        w = json.loads((run / f"weights_{host}.json").read_text())
        assert w["replicas"] == 2 and w["compared"] == 2 * w["leaves"]
        assert w["max_abs_diff"] == 0.0
    host_logs = {h: read_jsonl(run / f"host_{h}.jsonl") for h in (0, 1)}
    for step in (0, 1):
        recs = [host_logs[h][step] for h in (0, 1)]
        # ignore_eos: every host-0 completion runs to the budget; host 1 is cut to one token.
        assert recs[0]["completion_tokens"] == 8 * recs[0]["completions"]
        assert recs[1]["completion_tokens"] == recs[1]["completions"]
        assert recs[0]["truncated"] == recs[0]["completions"]
        local = [r["local_prompt_indices"] for r in recs]
        assert not set(local[0]) & set(local[1])
        assert sorted(local[0] + local[1]) == sorted(recs[0]["global_prompt_indices"])
        assert all(r["completions"] == 4 * len(r["local_prompt_indices"]) for r in recs)
        assert [r["completion_len_by_prompt"] for r in recs] == [[8.0, 8.0], [1.0, 1.0]]
    # Step 0: equal prompt lengths, no history, so positions alternate. Step 1 repeats the
    # batch; host 0's prompts decoded 8 tokens and host 1's 1, so each host now gets one of each.
    long_prompts = set(host_logs[0][0]["local_prompt_indices"])
    for h in (0, 1):
        assert len(long_prompts & set(host_logs[h][1]["local_prompt_indices"])) == 1
    steps = read_jsonl(run / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    # fp32 engine and trainer on the same weights: the step's mismatch is rounding only.
    assert all(0 <= s["mismatch_abs_max"] < 1e-3 for s in steps)
    assert (run / "summary.json").is_file()


@pytest.mark.slow  # two launches; a raising reward ending every host stays in the default
@pytest.mark.parametrize("victim", ["host", "launcher"])
def test_a_killed_process_ends_the_whole_launch(tmp_path, victim):
    """SIGKILL of one host stops the others; SIGTERM of the launcher (a scheduler, a benchmark
    timeout) stops every host rather than orphaning them. Either way within 60 s."""
    cmd = [sys.executable, "-m", "tunix_mcjax.launch", "--hosts", "2", "--devices-per-host",
           "2", "recipes/cpu/demo.yml", *TINY, "steps=100000",
           f"base_output_directory={tmp_path}", "run_name=kill"]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        for line in launcher.stdout:  # wait until training is under way
            if "step    2 |" in line:
                break
        hosts = psutil.Process(launcher.pid).children()
        if victim == "host":
            next(h for h in hosts if h.environ().get("TUNIX_MCJAX_PROCESS_ID") == "1").kill()
        else:
            launcher.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, _ = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - t0
        _, alive = psutil.wait_procs(hosts, timeout=5)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert elapsed < 60
    assert not alive, f"hosts left running: {[h.pid for h in alive]}"
    if victim == "host":
        assert launcher.returncode != 0
        assert "host 1 exited with code -9" in out
    else:
        assert launcher.returncode == 128 + signal.SIGTERM
        assert "launch: SIGTERM; stopping all hosts" in out
