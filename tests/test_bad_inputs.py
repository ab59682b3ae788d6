"""The bad-input catalogue: each mistake a user can make, what they see, and how fast.

Config mistakes go through the launcher's CLI (it validates before starting any host, so each
takes about a second); failures that only show while running use real launches of 2 hosts x 1
device with the TINY model. Every test asserts the exit status, the time to exit and the message.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.mp import REPO, TINY, read_jsonl, xla_flags
from tunix_mcjax.config import ConfigError, load_config

DEMO = "recipes/cpu/demo.yml"
SMALL = [*TINY, "batch_size=2", "num_generations=4", "max_target_length=8"]


def _launch(args: list[str], timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tunix_mcjax.launch", "--hosts", "2",
                           "--devices-per-host", "1", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def _run(tmp_path, name: str, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    return _launch([DEMO, *SMALL, f"base_output_directory={tmp_path}", f"run_name={name}",
                    *overrides])


# --- config mistakes: refused by the launcher before any host starts -------------------------

CONFIG_MISTAKES = [
    ("learning_rate=-1", r"learning_rate must be a finite number > 0, got -1.0"),
    ("learning_rate=.nan", r"learning_rate must be a finite number > 0, got nan"),
    ("collective_timeout_s=0", r"collective_timeout_s must be a finite number > 0"),
    ("compile_timeout_s=-5", r"compile_timeout_s must be a finite number > 0"),
    ("grpo_epsilon=0", r"grpo_epsilon must be in \(0, 1\)"),
    ("grpo_epsilon=1.5", r"grpo_epsilon must be in \(0, 1\)"),
    ("grpo_beta=-0.1", r"grpo_beta must be a finite number >= 0"),
    ("warmup_steps_fraction=1.0", r"warmup_steps_fraction must be in \[0, 1\)"),
    ("warmup_steps_fraction=-0.1", r"warmup_steps_fraction must be in \[0, 1\)"),
    ("adam_b2=1", r"adam_b2 must be in \[0, 1\)"),
    ("adam_eps=0", r"adam_eps must be a finite number > 0"),
    ("max_nonfinite_steps=-1", r"max_nonfinite_steps must be a finite number >= 0"),
    ("rollout_data_parallelism=0", r"rollout_data_parallelism must be >= 1 replicas, or -1"),
    ("rollout_data_parallelism=2", r"rollout_data_parallelism=2 x rollout_tensor_parallelism"
                                   r"=1 needs 2 devices but a host has 1"),
    ("rl_balance_by_expected_output=true", r"also set rl_balance_prompts_by_length=true"),
    ("batch_size=3", r"batch_size=3 prompts per step does not divide by 2 hosts"),
    ("num_generations=1", r"num_generations must be >= 2"),
    ("max_target_length=4", r"completion budget .* must be > 0"),
    ("decode_sampling_temperature=0", r"decode_sampling_temperature must be > 0"),
    ("loss_agg_mode=sequence-sum", r"loss_agg_mode='sequence-sum' is not one of"),
    ("learning_rat=0.1", r"unknown config key 'learning_rat'.*learning_rate"),
    ("steps=ten", r"steps must be int, got str 'ten'"),
    ("steps=0", r"steps must be a finite number > 0"),
    ("checkpoint_period=0", r"checkpoint_period must be a finite number > 0"),
]


@pytest.mark.parametrize("override,message", CONFIG_MISTAKES, ids=[c[0] for c in CONFIG_MISTAKES])
def test_config_mistake_is_refused_before_any_host_starts(override, message, tmp_path):
    proc, elapsed = _launch([DEMO, override, f"base_output_directory={tmp_path}"], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert elapsed < 30
    assert "[host" not in proc.stdout  # no process was started
    assert proc.stderr.startswith("config error: ")
    assert re.search(message, proc.stderr), proc.stderr


def test_missing_recipe():
    proc, elapsed = _launch(["recipes/cpu/nope.yml"], timeout=60)
    assert proc.returncode == 2 and elapsed < 30
    assert "recipe recipes/cpu/nope.yml not found" in proc.stderr


# --- data mistakes: found on the host, before any device work -------------------------------

def test_over_long_prompts_are_filtered_with_a_count(capsys):
    from tunix_mcjax.runtime.phases import filter_task
    from tunix_mcjax.tasks import Task
    from tunix_mcjax.tokenizer import char_tokenizer

    task = Task("t", ["1=", "123456=", "2="], {"answer": ["2", "7", "3"]}, (), lambda **_: [])
    cfg = load_config(REPO / DEMO)  # max_prefill_predict_length=4: BOS + 3 characters
    kept, tokens = filter_task(task, char_tokenizer(), cfg, host=0)
    assert kept.prompts == ["1=", "2="] and kept.fields == {"answer": ["2", "3"]}
    assert [len(t) for t in tokens] == [3, 3]
    assert "filtered 1 of 3 prompts longer than max_prefill_predict_length=4" in \
        capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"prompt 1 has 8 tokens, over max_prefill_predict_"
                                          r"length=4.*filter_long_prompts=true"):
        filter_task(task, char_tokenizer(), cfg.replace(filter_long_prompts=False), host=0)


def test_only_over_long_prompts_is_an_error():
    from tunix_mcjax.runtime.phases import filter_task
    from tunix_mcjax.tasks import Task
    from tunix_mcjax.tokenizer import char_tokenizer

    task = Task("t", ["123456="], {}, (), lambda **_: [])
    with pytest.raises(ConfigError, match=r"all 1 prompts are longer than"):
        filter_task(task, char_tokenizer(), load_config(REPO / DEMO), host=0)


def test_unknown_characters_are_an_error_never_pad():
    from tunix_mcjax.runtime.phases import encode_prompt
    from tunix_mcjax.tokenizer import char_tokenizer

    tok = char_tokenizer()
    assert encode_prompt(tok, 0, "1=").tolist() == [1, *tok.encode("1=",
                                                                   add_special_tokens=False)]
    with pytest.raises(ConfigError, match=r"prompt 5 has characters the tokenizer cannot "
                                          r"encode \('é€'"):
        encode_prompt(tok, 5, "é=€")


def test_missing_data_file_ends_every_host(tmp_path):
    proc, elapsed = _run(tmp_path, "nodata", "dataset_name=gsm8k",
                         f"hf_train_files={tmp_path}/missing.jsonl")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert elapsed < 120
    assert "missing.jsonl" in proc.stdout


# --- reward functions that go wrong --------------------------------------------------------

@pytest.mark.parametrize("values,message", [
    ([1.0, None], r"returned None for completion 1 \(prompt index 8, prompt 'b'\)"),
    ([1.0, float("inf")], r"returned inf for completion 1"),
    ([float("nan"), 1.0], r"returned nan for completion 0 \(prompt index 7, prompt 'a'\)"),
    (["1", 1.0], r"returned '1' for completion 0"),
    ([1.0], r"returned 1 values for 2 completions"),
])
def test_bad_reward_values_name_function_prompt_and_value(values, message):
    from tunix_mcjax.rewards import RewardError, score

    def my_reward(prompts, completions, **_):
        return values

    with pytest.raises(RewardError, match=r"reward function .*my_reward " + message):
        score([my_reward], ["a", "b"], ["x", "y"], {}, [7, 8])


def test_reward_raising_on_one_host_ends_every_host_fast(tmp_path):
    proc, elapsed = _run(tmp_path, "raises", "steps=50",
                         "reward_functions=tests.workers.bad_rewards:raises_on_host_1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert elapsed < 120  # start-up (compiles) plus at most a few seconds to stop
    assert ("host 1: RewardError: reward function tests.workers.bad_rewards:raises_on_host_1 "
            "raised ZeroDivisionError: host 1's reward went wrong") in out
    # Host 0 is waiting in the exchange, or still decoding (the hosts start together now that
    # they meet before the build's first cross-host program): it names host 1's error either way.
    assert re.search(r"host 0: stopping (in phase 'pack'|between phases) because another host "
                     r"failed: host 1: RewardError", out) \
        or "stopping because another host failed first: host 1: RewardError" in out
    assert "step    0 |" not in out  # host 0 did not train on alone


def test_a_failed_hosts_peers_end_themselves_before_the_launcher_stops_them():
    """A peer that ends itself within PEER_EXIT_S keeps its own exit status (and says why
    itself); one still running then is stopped."""
    from tunix_mcjax import launch

    sleep = "import time; time.sleep({}); raise SystemExit({})"
    fails, ends, stuck = (subprocess.Popen([sys.executable, "-c", sleep.format(s, code)])
                          for s, code in ((0, 1), (1, 9), (600, 0)))
    t0 = time.monotonic()
    assert launch.supervise([fails, ends, stuck]) == 1
    assert (ends.returncode, stuck.returncode) == (9, -signal.SIGTERM)
    assert launch.PEER_EXIT_S <= time.monotonic() - t0 < launch.PEER_EXIT_S + launch.GRACE_S


@pytest.mark.slow  # a launch; a raising reward's end stays in the default suite
def test_reward_failure_ends_within_60s_of_the_failure(tmp_path):
    """Measured from the failing host's message, not from the launch (which compiles)."""
    cmd = [sys.executable, "-m", "tunix_mcjax.launch", "--hosts", "2", "--devices-per-host",
           "1", DEMO, *SMALL, "steps=50", f"base_output_directory={tmp_path}", "run_name=nan",
           "reward_functions=tests.workers.bad_rewards:nan_reward"]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    lines, t_fail = [], None
    try:
        for line in launcher.stdout:
            lines.append(line)
            if t_fail is None and "RewardError" in line:
                t_fail = time.monotonic()
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = "".join(lines)
    assert t_fail is not None, out[-3000:]
    assert time.monotonic() - t_fail < 60
    assert launcher.returncode == 1, out[-3000:]
    assert "reward function tests.workers.bad_rewards:nan_reward returned nan for " \
           "completion 0 (prompt index" in out


# --- non-finite training --------------------------------------------------------------------

OVERFLOWS = "reward_functions=tests.workers.bad_rewards:overflows_after_first_step"


@pytest.mark.slow  # a launch; the trainer's finite gate is tested in-process
def test_non_finite_step_stops_keeping_last_good_checkpoint(tmp_path):
    """From step 1 on, rewards overflow float32 in the advantage; the loss is NaN."""
    proc, elapsed = _run(tmp_path, "blowup", "steps=6", OVERFLOWS,
                         "enable_checkpointing=true", "checkpoint_period=1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert elapsed < 200
    assert "step 1: loss=nan" in out, out[-3000:]
    assert "is not finite; the update was not applied. Stopping (1 non-finite steps, " \
           "max_nonfinite_steps=0)" in out
    assert "the last good checkpoint is step 0" in out
    saved = sorted(p.name for p in (tmp_path / "blowup" / "checkpoints").iterdir())
    assert saved == ["0"]


@pytest.mark.slow  # a launch; the non-finite stop stays in the default suite
def test_max_nonfinite_steps_skips_and_counts(tmp_path):
    proc, elapsed = _run(tmp_path, "skip", "steps=3", OVERFLOWS, "max_nonfinite_steps=5")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert elapsed < 200
    assert "skipped (2 of max_nonfinite_steps=5)" in out
    summary = json.loads((tmp_path / "skip" / "summary.json").read_text())
    assert summary["nonfinite_steps"] == 2
    steps = read_jsonl(tmp_path / "skip" / "steps.jsonl")
    assert [s["finite"] for s in steps] == [1.0, 0.0, 0.0]
    assert [s["nonfinite_steps"] for s in steps] == [0, 1, 2]


# --- checkpoints ----------------------------------------------------------------------------

@pytest.mark.slow  # three launches
def test_corrupt_checkpoint_falls_back_and_changed_config_is_refused(tmp_path):
    ckpt = ["enable_checkpointing=true", "checkpoint_period=2"]
    first, _ = _run(tmp_path, "ck", "steps=4", *ckpt)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    newest = tmp_path / "ck" / "checkpoints" / "3"
    for f in newest.rglob("*"):  # truncate every file of the newest checkpoint
        if f.is_file():
            f.write_bytes(f.read_bytes()[:5])
    proc, elapsed = _run(tmp_path, "ck", "steps=6", *ckpt)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert elapsed < 200
    assert "checkpoint step 3 in" in out and "is unreadable" in out
    assert "falling back to step 1" in out and "resumed from" in out
    steps = [r["step"] for r in read_jsonl(tmp_path / "ck" / "steps.jsonl")]
    assert steps == [0, 1, 2, 3, 4, 5]  # each step once

    changed, elapsed = _run(tmp_path, "ck", "steps=8", *ckpt, "learning_rate=0.01",
                            "grpo_beta=0.1")
    out = changed.stdout + changed.stderr
    assert changed.returncode == 2, out[-3000:]
    assert elapsed < 200
    assert "was trained under a different config: grpo_beta: 0.0 -> 0.1; learning_rate: " \
           "0.003 -> 0.01" in out


def test_missing_tokenizer_dir_is_a_config_error(tmp_path):
    from tunix_mcjax.tokenizer import load_tokenizer

    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"tokenizer_path='.*nowhere' does not load as a "
                                          r"Hugging Face tokenizer"):
        load_tokenizer("huggingface", str(tmp_path / "nowhere"))
    assert time.monotonic() - t0 < 30


WATCHDOG = """
import time
from tunix_mcjax.topology import Watchdog
w = Watchdog(0, timeout_s=1.0, compile_timeout_s=8.0)
with w.guard("train", compiles=True):
    time.sleep(3)  # a compile outlasting collective_timeout_s is fine
print("compile survived", flush=True)
with w.guard("pack"):
    time.sleep(30)
"""


def test_stuck_phase_ends_by_its_own_budget():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", WATCHDOG], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 3, proc.stderr
    assert "compile survived" in proc.stdout
    assert elapsed < 20
    assert "host 0: phase 'pack' waited more than 1s on other hosts (one is dead or stuck); " \
           "aborting. Raise collective_timeout_s if this phase is just slow." in proc.stderr


@pytest.mark.slow
def test_a_host_later_than_gloos_30s_still_exchanges(tmp_path):
    """Host 1 reaches its first exchange 40 s after host 0 (as after compiling what host 0
    loaded from JAX's cache): the hosts meet on the coordination service first, so gloo's 30 s
    for a collective's first run is never spent waiting."""
    from tests.mp import launch_worker

    proc = launch_worker("tests.workers.late_host", DEMO,
                         [*SMALL, f"base_output_directory={tmp_path}", "run_name=late"],
                         devices=1, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for host in (0, 1):
        gathered = json.loads((tmp_path / "late" / f"gathered_{host}.json").read_text())
        assert gathered == [[0, 0], [1, 7]]


def test_a_closed_watchdog_has_ended_its_thread():
    """A run's watchdog is closed at exit (atexit), before JAX shuts its client down: no thread
    is left polling that client while the interpreter finalizes."""
    from tunix_mcjax.topology import Watchdog

    def watching() -> int:
        return sum(t.name == "watchdog" and t.is_alive() for t in threading.enumerate())

    before = watching()
    w = Watchdog(0, timeout_s=60.0)
    assert watching() == before + 1
    w.close()
    assert watching() == before


def test_a_watchdog_needs_a_positive_timeout():
    from tunix_mcjax.topology import Watchdog

    with pytest.raises(ValueError, match="watchdog timeout must be > 0"):
        Watchdog(0, 0.0)


ENGINE_REPLICAS = """
import jax
from tunix_mcjax import models
from tunix_mcjax.config import load_config
from tunix_mcjax.runtime.phases import default_engine
for dp, tp in ((-1, 1), (1, 1), (3, 1), (1, 2), (-1, 2)):
    cfg = load_config("recipes/cpu/demo.yml", [f"rollout_data_parallelism={dp}",
                                               f"rollout_tensor_parallelism={tp}"])
    engine = default_engine(cfg, models.model_config(cfg, 99, for_sampling=True),
                            jax.devices(), 0, (2,))
    print(dp, tp, engine.num_replicas, flush=True)
"""


@pytest.mark.slow  # a 2-host launch
def test_rollout_data_parallelism_reaches_the_engine():
    env = {**os.environ, "XLA_FLAGS": xla_flags(4),
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", ENGINE_REPLICAS], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:5] == ["-1 1 4", "1 1 1", "3 1 3", "1 2 1", "-1 2 2"]


def test_fingerprint_allows_runtime_keys_and_names_algorithm_ones():
    from tunix_mcjax.config import algorithm_fingerprint, fingerprint_mismatch

    cfg = load_config(REPO / DEMO)
    saved = algorithm_fingerprint(cfg)
    runtime_only = cfg.replace(steps=500, rl_balance_prompts_by_length=True,
                               rl_async_metrics_export=True, collective_timeout_s=60.0)
    assert fingerprint_mismatch(saved, runtime_only) == []
    assert fingerprint_mismatch(saved, cfg.replace(seed=1, grpo_epsilon=0.3)) == \
        ["grpo_epsilon: 0.2 -> 0.3", "seed: 0 -> 1"]
    warm = cfg.replace(warmup_steps_fraction=0.1)  # 15 warm-up steps of 150
    assert fingerprint_mismatch(algorithm_fingerprint(warm), warm.replace(steps=300)) == \
        ["warmup_steps: 15 -> 30"]
