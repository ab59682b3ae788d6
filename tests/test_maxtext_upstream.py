"""MaxText's own four RL recipe scripts, unchanged, on CPU under rl_runtime=mcjax: each
script's MAXTEXT_COMMAND (read from the installed script, split as its shell would) with its
CPU variant's .args appended, through `python -m tunix_mcjax.maxtext.launch` on 2 hosts x 1
device. Qwen3-30B-A3B (MoE) runs in the default suite, the other three are `slow`."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("maxtext")

from tests.mp import REPO, read_jsonl  # noqa: E402
from tunix_mcjax.maxtext import recipes  # noqa: E402

PREPARE = REPO / "recipes/maxtext/cpu/upstream/prepare.sh"
# The keys the issue forbids a CPU variant to override: the algorithm stays the script's.
ALGORITHM = ("rl.num_generations", "rl.grpo_beta", "rl.grpo_epsilon", "rl.num_iterations",
             "rl.loss_algo", "decode_sampling_", "gradient_clipping_threshold")


def tensorboard_tags(directory) -> set[str]:
    """Scalar tags in the TensorBoard event files directly under `directory` (TFRecord framing:
    length, its CRC, the Event proto, its CRC)."""
    from tensorboardX.proto import event_pb2

    tags = set()
    for path in directory.glob("events.out.tfevents.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + n])
            tags |= {v.tag for v in event.summary.value}
            i += 12 + n + 4
    return tags


def unformatted_reward(name: str) -> float:
    """MaxText's reward functions (the script's config) summed on a completion without its
    reasoning and answer tags."""
    from tunix_mcjax.maxtext import checked_config, data

    _, args = recipes.cpu_command(name)
    train_rl = recipes.script_path(name).parents[1] / "train_rl.py"
    config, _, _ = checked_config([str(train_rl), *args], {}, num_hosts=2)
    return sum(float(fn(prompts=["What is 2 + 3?"], completions=["so it goes on"],
                        answer=[json.dumps(["5"])], question="What is 2 + 3?")[0])
               for fn in data.reward_fns(config))


def recipe_params():
    for name in recipes.UPSTREAM:
        # Each is a full 2-host train_rl run, 3-7 min here: Qwen3-30B-A3B's in the slow tier,
        # the other three in the bench tier (together they would fill CI's slow-tier budget).
        tier = pytest.mark.slow if name == "run_qwen3_30b_rl" else pytest.mark.bench
        yield pytest.param(name, marks=[tier], id=name)


@pytest.mark.parametrize("name", recipes.UPSTREAM)
def test_cpu_args_leave_the_algorithm_alone(name):
    env, script_args = recipes.script_command(name)
    assert script_args[-1] == "rl_runtime=mcjax"  # the one-key switch, RL_RUNTIME=mcjax
    overridden = [a.split("=", 1)[0] for a in recipes.cpu_args(name)]
    assert not [k for k in overridden if k.startswith(ALGORITHM)]
    assert "rl_runtime" not in overridden


# The model's own sliding window (0: none) at each script's own lengths.
FULL_LENGTHS = {"run_qwen3_30b_rl": (0, 8192), "run_gptoss_20b_rl": (128, 1024),
                "run_gemma4_26b_rl": (1024, 8192), "run_gemma4_e4b_rl": (512, 4096)}


@pytest.mark.parametrize("name", recipes.UPSTREAM)
def test_full_length_script_passes_the_adapters_checks(name):
    """Each script's own command, at its own lengths and its model's real window, maps onto
    the maxtext engine with nothing refused (2 hosts: every script's rollout_data_parallelism
    divides by it). Config mapping only: no model is built."""
    from tunix_mcjax.maxtext import checked_config

    _, args = recipes.script_command(name)
    train_rl = recipes.script_path(name).parents[1] / "train_rl.py"  # MaxText infers rl.yml
    config, cfg, _ = checked_config([str(train_rl), *args], {}, num_hosts=2)
    window, length = FULL_LENGTHS[name]
    assert (config.sliding_window_size, config.max_target_length) == (window, length)
    assert cfg.rollout_engine == "maxtext"
    assert cfg.max_prefill_predict_length + cfg.max_completion_length == length


@pytest.mark.parametrize("name", recipes.UPSTREAM)
def test_cpu_variant_runs_past_the_window(name):
    """The CPU variants shrink a window rather than the lengths: sequences run past it."""
    from tunix_mcjax.maxtext import checked_config

    _, args = recipes.cpu_command(name)
    train_rl = recipes.script_path(name).parents[1] / "train_rl.py"
    config, _, _ = checked_config([str(train_rl), *args], {}, num_hosts=2)
    window = FULL_LENGTHS[name][0] and 32
    assert (config.sliding_window_size, config.max_target_length) == (window, 144)


@pytest.mark.parametrize("name", recipe_params())
def test_upstream_recipe_runs_on_two_cpu_hosts(name, tmp_path):
    prep = subprocess.run(["bash", str(PREPARE), name], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)})
    assert prep.returncode == 0, prep.stdout[-3000:] + prep.stderr[-3000:]
    env, args = recipes.cpu_command(name)
    proc = subprocess.run(
        [sys.executable, "-m", "tunix_mcjax.maxtext.launch", "--hosts", "2",
         "--devices-per-host", "1", *args, f"base_output_directory={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
        env={**os.environ, **env, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]

    run_dir = tmp_path / recipes.SCRIPT_ENV["RUN_NAME"]
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    assert all(np.isfinite(s["loss"]) for s in steps)
    # MaxText's schedule: before training (on the first step's record) and after the last.
    assert set(steps[0]["eval"]) == {"pre"} and set(steps[-1]["eval"]) == {"post"}
    # The reference: the tiny random-init model never writes MaxText's answer format, so every
    # sample scores as an unformatted one: no accuracy of any kind, and the mean reward is
    # MaxText's own reward stack on an unformatted answer.
    unformatted = unformatted_reward(name)
    results = [steps[0]["eval"]["pre"], steps[-1]["eval"]["post"]]
    for result in results:
        assert result["total"] == 2 and result["corr"] == 0
        assert result["accuracy"] == result["partial_accuracy"] == result["format_accuracy"] == 0
        assert result["mean_reward"] == pytest.approx(unformatted, abs=1e-6), unformatted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["when"] for e in summary["eval"]] == ["pre", "post"]
    assert [{k: e[k] for k in results[0]} for e in summary["eval"]] == results
    for host in (0, 1):
        facts = json.loads((run_dir / f"maxtext_adapter_host{host}.json").read_text())
        assert facts["modules_imported"] == {"vllm": False, "tpu_inference": False}
        assert facts["config"]["rollout_engine"] == "maxtext"
    assert "eval post" in proc.stdout
    # MaxText's enable_tensorboard default: host 0's scalars, the evaluation's included.
    assert {"rl/reward", "rl/loss", "rl/kl", "phase/train_s", "eval/pre/accuracy",
            "eval/post/accuracy"} <= tensorboard_tags(run_dir / "tensorboard")
    if "profiler=xplane" in args:  # one trace per host of the profiled steps
        for host in (0, 1):
            assert list((run_dir / "tensorboard" / f"host_{host}").glob(
                "plugins/profile/*/*.xplane.pb"))
