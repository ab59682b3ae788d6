"""The Tunix adapter: Tunix's own `grpo_main` with `rl_runtime=mcjax`, end to end on the CPU
variant of Tunix's run_qwen3.sh (2 hosts x 1 device), its config map and refusals, and Tunix's
data, tokenizer and rewards as the runtime receives them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.mp import REPO, read_jsonl
from tunix_mcjax import admission
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.tunix import config_map, make_checkpoint

CPU_RECIPE = REPO / "recipes/tunix/cpu/run_qwen3.sh"
TPU_RECIPE = REPO / "recipes/tunix/tpu/run_qwen3.sh"
# What the CPU recipe may change from Tunix's run_qwen3.sh: model size, mesh, batch and step
# counts, and the local stand-ins for downloads (checkpoint, tokenizer, data, run paths).
CPU_CHANGES = {
    "model_config.model_name", "model_config.model_id", "model_config.model_download_path",
    "model_config.intermediate_ckpt_dir", "model_config.mesh.shape",
    "actor_model_config.mesh.shape", "tokenizer_config.tokenizer_path", "data_source",
    "dataset_name", "batch_size", "num_test_batches", "rl_training_config.max_steps",
    "rl_training_config.mini_batch_size", "rl_training_config.train_micro_batch_size",
    "rollout_config.total_generation_steps", "rl_training_config.checkpoint_root_directory",
    "rl_training_config.metrics_logging_options.log_dir"}


def recipe_argv(script: Path, tmp: Path, *extra: str, **env: str) -> list[str]:
    """grpo_main's argv as `script` builds it: run with a stand-in python that records it."""
    for name in ("python", "python3"):
        fake = tmp / name
        fake.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" >> {tmp}/calls\nprintf "\\n" >> '
                        f'{tmp}/calls\n')
        fake.chmod(0o755)
    subprocess.run(["bash", str(script), *extra], check=True, capture_output=True,
                   env={**os.environ, "PYTHON": str(fake), "PATH": f"{tmp}:{os.environ['PATH']}",
                        **env})
    calls = [c.strip("\n").split("\0") for c in (tmp / "calls").read_text().split("\0\n")]
    main = next(c for c in calls if c[:2] == ["-m", "tunix.cli.grpo_main"])
    return ["grpo_main", *[a for a in main[2:] if a]]


def keyvals(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv[2:])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-tiny")
    make_checkpoint.main(out)
    return out


@pytest.fixture(scope="module")
def cpu_argv(tmp_path_factory, checkpoint) -> list[str]:
    tmp = tmp_path_factory.mktemp("argv")
    return recipe_argv(CPU_RECIPE, tmp, model_dir=str(checkpoint))


@pytest.fixture(scope="module")
def run(tmp_path_factory, checkpoint) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The CPU recipe once for the module: grpo_main, rl_runtime=mcjax, 2 hosts x 1 device."""
    tmp = tmp_path_factory.mktemp("run")
    log_dir, ckpt_dir = tmp / "tensorboard", tmp / "checkpoints"
    res = subprocess.run(
        ["bash", str(CPU_RECIPE), f"rl_training_config.metrics_logging_options.log_dir={log_dir}",
         f"rl_training_config.checkpoint_root_directory={ckpt_dir}"],
        cwd=tmp, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO),
             "model_dir": str(checkpoint), "HF_DATASETS_CACHE": str(tmp / "hf")})
    return res, log_dir, ckpt_dir


# --- Tunix's command line, end to end --------------------------------------------------------

@pytest.mark.slow  # a 2-host grpo_main run
def test_grpo_main_runs_run_qwen3_on_mcjax_two_hosts(run):
    res, run_dir, ckpt_dir = run
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "handing the run to the runtime registered" in out  # Tunix's dispatch, patch 0001
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(np.isfinite(s["loss"]) and s["tokens_generated"] > 0 for s in steps)
    # Tunix's gsm8k.py rewards a format-less completion -2 (match_format_approximately).
    assert all(s["reward_mean"] <= 0 for s in steps)
    # eval_every_n_steps=10 over 3 steps: Tunix's learner evaluates once, before training.
    evals = [(s["step"], label, e) for s in steps for label, e in s.get("eval", {}).items()]
    assert [(step, label) for step, label, _ in evals] == [(0, "pre")]
    assert evals[0][2]["total"] == 2 and evals[0][2]["steps_done"] == 0  # 1 batch of 2
    for host in (0, 1):
        records = read_jsonl(run_dir / f"host_{host}.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2]
        assert all(r["prompts"] == 1 and r["completions"] == 4 for r in records)
        facts = json.loads((run_dir / f"tunix_adapter_host{host}.json").read_text())
        assert facts["num_hosts"] == 2 and facts["eval_rows"] == 2
        assert facts["modules_imported"] == {"vllm": False, "tpu_inference": False,
                                             "sglang_jax": False}
        assert facts["reward_functions"] == [f"gsm8k:{f}" for f in (
            "check_answer", "check_numbers", "match_format_approximately",
            "match_format_exactly")]
        cfg = facts["config"]
        assert (cfg["batch_size"], cfg["num_generations"], cfg["steps"]) == (2, 4, 3)
        assert (cfg["max_prefill_predict_length"], cfg["max_target_length"]) == (128, 144)
        assert cfg["grpo_beta"] == pytest.approx(0.08) and cfg["remat_policy"] == "full"
        assert "rl_training_config.actor_optimizer_config.max_grad_norm" in facts["not_applied"]
        assert (cfg["lora_rank"], cfg["lora_alpha"]) == (64, 64.0)
    # checkpoint_root_directory, after the last step. LoRA on: the trained params are the
    # adapters of all 7 projections (the recipe's module_path), nothing else, stacked over both
    # layers as the trainer holds them (one run, `layers/from_0`: train/layer_runs).
    meta = json.loads((ckpt_dir / "2" / "default" / "_METADATA").read_text())
    params = [k for k in meta["tree_metadata"] if k.startswith("('params'")]
    assert len(params) == 7 * 2 and all("_lora_a'" in k or "_lora_b'" in k for k in params)
    assert all("'from_0'" in k for k in params)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


# --- the recipes -----------------------------------------------------------------------------

def test_cpu_recipe_changes_only_size_mesh_batch_steps(tmp_path, cpu_argv):
    tpu = keyvals(recipe_argv(TPU_RECIPE, tmp_path))
    cpu = keyvals(cpu_argv)
    assert tpu["rl_runtime"] == cpu["rl_runtime"] == "mcjax"
    changed = {k for k in tpu.keys() | cpu.keys() if tpu.get(k) != cpu.get(k)}
    assert changed <= CPU_CHANGES, changed - CPU_CHANGES
    assert cpu["actor_model_config.lora_config.rank"] == "64"
    assert cpu["reward_functions"] == "['tunix/cli/reward_fn/gsm8k.py']"


def test_tpu_recipe_is_tunix_run_qwen3_plus_one_key():
    lines = TPU_RECIPE.read_text().splitlines()
    assert sum("rl_runtime" in line for line in lines) == 1
    assert "  rl_runtime=mcjax \\" in lines
    assert "  base_config.yaml \\" in lines and "python3 -m tunix.cli.grpo_main \\" in lines


# --- the config map --------------------------------------------------------------------------

def pipeline(argv: list[str], *extra: str):
    from tunix_mcjax.tunix import pipeline as tunix_pipeline

    return tunix_pipeline([*argv, *extra], {})


def test_cpu_recipe_maps_onto_config(cpu_argv, checkpoint):
    from tunix_mcjax.tunix import model

    config = config_map.plain(pipeline(cpu_argv).config)
    not_applied = config_map.check(config)
    keys = model.model_keys(config["actor_model_config"], str(checkpoint))
    cfg = config_map.to_config(config, keys, steps=3)
    assert (cfg.model_name, cfg.base_emb_dim, cfg.vocab_size) == ("qwen3-tiny", 64, 151936)
    assert cfg.load_parameters_path == str(checkpoint)
    assert (cfg.decode_sampling_temperature, cfg.decode_sampling_top_k,
            cfg.decode_sampling_nucleus_p) == (0.9, 50, 1.0)
    assert (cfg.grpo_epsilon, cfg.learning_rate, cfg.adam_b2) == (0.2, 3e-6, 0.99)
    assert (cfg.eval_interval, cfg.eval_schedule, cfg.num_test_batches) == (10, "tunix", 1)
    assert (cfg.log_period, cfg.checkpoint_period, cfg.max_num_checkpoints_to_keep) == (20, 500, 4)
    assert cfg.seed == cfg.init_weights_seed == 42
    assert (cfg.lora_rank, cfg.lora_alpha) == (64, 64.0)
    assert cfg.lora_module_path == ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj" \
        "|.*up_proj"
    assert str(cfg.run_dir) == "/tmp/tensorboard/qwen3-tiny"
    assert str(cfg.checkpoint_dir) == cfg.checkpoint_directory and cfg.enable_checkpointing
    # Tunix's CLI never reads these; they are listed, with why.
    assert "optax" in not_applied["rl_training_config.actor_optimizer_config.warmup_ratio"]
    assert "optimizer_config" in not_applied and "vllm_config" in not_applied


def test_num_iterations_counts_updates_as_tunix_does(cpu_argv, checkpoint):
    """Tunix's max_steps and eval_every_n_steps count actor updates, num_iterations per batch."""
    from tunix_mcjax.tunix import model

    config = config_map.plain(pipeline(cpu_argv, "grpo_config.num_iterations=2",
                                       "rl_training_config.eval_every_n_steps=4").config)
    config_map.check(config)
    keys = model.model_keys(config["actor_model_config"], str(checkpoint))
    cfg = config_map.to_config(config, keys, steps=3)
    # Tunix stops at the first batch whose updates reach max_steps: 2 batches of 2 updates.
    assert (cfg.num_iterations, cfg.steps, cfg.eval_interval) == (2, 2, 2)
    config["rl_training_config"]["eval_every_n_steps"] = 3
    with pytest.raises(ConfigError, match="multiple of 2"):
        config_map.to_config(config, keys, steps=3)


@pytest.mark.parametrize("override,named", [
    ("rollout_engine=vllm", "rollout_engine='vllm'"),
    ("offload_to_cpu=true", "offload_to_cpu=True"),
    ("rollout_config.seed=3", "rollout_config.seed=3"),
    ("rl_training_config.mini_batch_size=1", "rl_training_config.mini_batch_size=1"),
    ("reference_model_config.model_id=Qwen/Qwen3-8B", "reference_model_config.model_id"),
    ("actor_model_config.lora_config.weight_qtype=nf4", "lora_config.weight_qtype='nf4'"),
    ("grpo_config.kl_loss_mode=mse", "grpo_config.kl_loss_mode='mse'"),
    ("rl_training_config.perf_metrics_options.enable_perf_v1=true", "perf_metrics_options"),
    # Tunix has no rollout quantization key; vLLM's, through its engine arguments.
    ("rollout_config.rollout_vllm_kwargs.kv_cache_dtype=fp8",
     "rollout_vllm_kwargs.kv_cache_dtype='fp8': vLLM's engine arguments (its quantization"),
])
def test_refused_by_name(cpu_argv, override, named):
    config = config_map.plain(pipeline(cpu_argv, override).config)
    with pytest.raises(ConfigError, match="cannot honour") as e:
        config_map.check(config)
    assert named in str(e.value)


def test_rollout_quantization_keys_are_refused_by_name(cpu_argv):
    """Tunix's RL config has no rollout quantization key to map: MaxText's names are refused
    by Tunix's CLI on its command line, and by name with the way to a quantized rollout where
    a config file carries them."""
    with pytest.raises(ConfigError, match="Key quantization was passed at the command line"):
        pipeline(cpu_argv, "quantization=int8")
    for key, value in [("quantization", "int8"), ("quantize_kvcache", True),
                       ("kv_quant_dtype", "fp8")]:
        config = config_map.plain(pipeline(cpu_argv).config)
        config[key] = value
        with pytest.raises(ConfigError, match=f"{key}={value!r}: Tunix's RL config has no "
                                              "rollout quantization key"):
            config_map.check(config)


def test_mesh_must_cover_the_run_devices(cpu_argv):
    config = config_map.plain(pipeline(cpu_argv).config)
    config_map.check_devices(config, 2)
    with pytest.raises(ConfigError, match=r"mesh.shape asks for 2 devices but the run has 4"):
        config_map.check_devices(config, 4)
    config["actor_model_config"]["mesh"]["axis_names"] = "('data',)"
    with pytest.raises(ConfigError, match="axis_names"):
        config_map.mesh_devices(config)


def test_remat_block_refused(cpu_argv):
    config = config_map.plain(pipeline(cpu_argv, "model_config.remat_config=2").config)
    with pytest.raises(ConfigError, match="BLOCK is not implemented"):
        config_map.to_config(config, {}, steps=3)


# --- Tunix's data, tokenizer and rewards as the runtime gets them ------------------------------

def test_steps_admit_tunix_batches_and_prompts_encode_as_tunix_sampler(cpu_argv, tmp_path,
                                                                         monkeypatch):
    from tunix.generate import sampler

    from tunix_mcjax.tunix import data

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    tunix = pipeline(cpu_argv)
    tokenizer = data.load_tokenizer(tunix)
    stream, test_rows, steps = data.split_rows(tunix, tokenizer)
    assert steps == 3 and len(stream) == 51 and len(test_rows) == 2  # 64 rows, 0.8 train
    assert stream[0]["prompts"].startswith("<|im_start|>system\nYou are given a problem.")
    assert not {r["question"] for r in test_rows} & {r["question"] for r in stream}
    cfg = types.SimpleNamespace(seed=42, batch_size=2, dataset_name="gsm8k")
    task = data.train_task(stream, (), cfg)
    for step in range(steps):
        idx = admission.global_prompt_indices(len(task.prompts), 2, 42, step)
        assert [task.prompts[i] for i in idx] == [r["prompts"] for r in stream[2 * step:][:2]]
        assert [task.fields["answer"][i] for i in idx] == [r["answer"]
                                                          for r in stream[2 * step:][:2]]
    ids = tokenizer.encode(stream[0]["prompts"], add_special_tokens=False)
    expected = sampler.Sampler.tokenize(types.SimpleNamespace(tokenizer=tokenizer.tunix),
                                        stream[0]["prompts"])
    assert ids == expected.tolist() and ids[-1] == tokenizer.eos_token_id  # add_eos=true
    fns = data.reward_functions(tunix)
    assert [f.__name__ for f in fns] == ["check_answer", "check_numbers",
                                         "match_format_approximately", "match_format_exactly"]
    # data_source=local: Tunix's parquet reader gives an iterable, made a dataset here.
    local = pipeline(cpu_argv, "data_source=local",
                     f"data_directory={REPO}/recipes/maxtext/cpu/gsm8k_tiny.parquet")
    stream_local, _, steps_local = data.split_rows(local, tokenizer)
    assert steps_local == 3 and len(stream_local) == 51
    questions = pq.read_table(REPO / "recipes/maxtext/cpu/gsm8k_tiny.parquet")["question"]
    assert [r["question"] for r in stream_local] == questions.to_pylist()[:51]  # not shuffled
    good = "<reasoning>2+3</reasoning><answer>5</answer>"
    assert data.answer_correct(["p"] * 2, [good, "5"], answer=["5", "5"]) == [1.0, 0.0]


def test_eval_schedule_tunix_evaluates_at_multiples_but_not_after_the_last():
    from tunix_mcjax import topology
    from tunix_mcjax.runtime.evaluation import SUM_FIELDS, EvalSchedule

    class Counting:
        mode = "pass_at_1"

        def local_sums(self, engine, seed):
            return np.ones(len(SUM_FIELDS))

    topo = topology.current()
    for schedule, steps, expected in (("tunix", 6, [0, 3]), ("tunix", 7, [0, 3, 6]),
                                      ("maxtext", 6, [0, 3, 6, 6])):
        cfg = load_config(None, {"steps": steps, "num_test_batches": 1, "eval_interval": 3,
                                 "eval_schedule": schedule})
        evals = EvalSchedule.on_hosts(cfg, Counting(), topo, topology.Watchdog(0, 60))
        evals.before_training(None, 0)
        done = [r["steps_done"] for step in range(steps)
                for r in evals.after_step(step, None).get("eval", {}).values()]
        assert done == expected, (schedule, steps)
    with pytest.raises(ConfigError, match="eval_schedule=tunix"):
        load_config(None, {"num_test_batches": 1, "eval_schedule": "tunix"})


def test_local_hosts_env_is_checked(monkeypatch):
    from tunix_mcjax import tunix

    monkeypatch.setenv(tunix.HOSTS_ENV, "two")
    with pytest.raises(ConfigError, match="must be integers"):
        tunix.local_topology()
    monkeypatch.setenv(tunix.HOSTS_ENV, "2")
    assert tunix.local_topology() == (2, 1)


def test_refusal_stops_grpo_main_before_any_host_starts(cpu_argv, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "tunix.cli.grpo_main", *cpu_argv[1:], "rollout_engine=vllm"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "TUNIX_MCJAX_HOSTS": "2"})
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "config error: rl_runtime=mcjax cannot honour" in res.stderr
    assert "rollout_engine='vllm'" in res.stderr and "[host 0]" not in res.stdout


def test_model_keys_from_tunix_names_or_config_json(tmp_path):
    from tunix_mcjax.tunix import model

    named = model.model_keys({"model_name": "qwen3-1.7b-base"}, str(tmp_path))
    assert named["model_name"] == "qwen3-1.7b" and named["load_parameters_path"] == str(tmp_path)
    with pytest.raises(ConfigError, match="not a model Tunix names"):
        model.model_keys({"model_name": "qwen3-tiny"}, str(tmp_path))
    with pytest.raises(ConfigError, match="Qwen3 models"):
        model.model_keys({"model_name": "llama-3.1-8b"}, str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(make_checkpoint.hf_config()))
    tiny = model.model_keys({"model_name": "qwen3-tiny"}, str(tmp_path))
    assert (tiny["base_num_decoder_layers"], tiny["head_dim"]) == (2, 16)
    with pytest.raises(ConfigError, match="model_source=huggingface"):
        model.checkpoint_dir({"model_source": "kaggle"})


def test_tpu_recipe_config_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "unused")  # Tunix's check for a Hub tokenizer path
    argv = recipe_argv(TPU_RECIPE, tmp_path)
    argv[1] = str(REPO / "recipes/tunix/base_config.yaml")  # the wheel ships none
    config = config_map.plain(pipeline(argv).config)
    not_applied = config_map.check(config)
    assert config_map.mesh_devices(config) == 8  # mesh (2,4): a host of 8 chips, or 2 of 4
    assert "model_config.use_flash_attention" in not_applied
    assert config_map.lora_values(config)["lora_rank"] == 64


def test_launch_runs_grpo_main_with_rl_runtime_mcjax(monkeypatch):
    from tunix_mcjax.tunix import launch

    calls = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: calls.append((a, k)) or 0)
    assert launch.main(["--hosts", "2", "base.yaml", "batch_size=2"]) == 0
    assert calls == [(("base.yaml", ["batch_size=2", "rl_runtime=mcjax"], 2, 1),
                      {"module": "tunix.cli.grpo_main"})]


class ScriptedEngine:
    """Answers the k-th request of a prompt with `answers[prompt text][k]` (then EOS)."""

    def __init__(self, tokenizer, answers: dict[str, list[str]]):
        self.tokenizer, self.answers = tokenizer, answers

    def generate(self, prompts, sampling, seed):
        from collections import Counter

        from tunix_mcjax.engine import Completion

        seen, out = Counter(), []
        for ids in prompts:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            answer = self.answers[text][seen[text]]
            seen[text] += 1
            tokens = np.array([*self.tokenizer.encode(answer, add_special_tokens=False),
                               self.tokenizer.eos_token_id], np.int32)
            out.append(Completion(tokens, np.zeros(len(tokens), np.float32), "stop"))
        return out


def test_both_evaluators_sum_pass_at_1_over_their_share():
    """The built-in task's and the Tunix CLI's evaluators share one `local_sums`: each prompt
    sampled num_generations times, corr the mean accuracy of its samples, partially_corr any
    right, formatted their own way, this host's share only. Sums against hand-computed ones."""
    from tunix_mcjax.runtime.evaluation import SUM_FIELDS, TaskEvaluator
    from tunix_mcjax.tasks import Task, next_digit_correct
    from tunix_mcjax.tokenizer import char_tokenizer
    from tunix_mcjax.tunix.data import TunixEvaluator

    tok, cfg = char_tokenizer(), load_config(None, {"num_generations": 2})
    task = Task("t", ["1=", "2=", "3="], {"answer": ["2", "3", "4"]}, (next_digit_correct,),
                next_digit_correct)
    engine = ScriptedEngine(tok, {"1=": ["2", "5"], "2=": ["3", "3"], "3=": ["0", "0"]})

    def sums(evaluator):
        return dict(zip(SUM_FIELDS, evaluator.local_sums(engine, seed=0).tolist(), strict=True))

    # corr 1/2 + 1 + 0; rewards (next_digit_correct) 1, 0, 1, 1, 0, 0; formatted: reward > 0.
    assert sums(TaskEvaluator(cfg, tok, task, 0, 1)) == dict(
        corr=1.5, partially_corr=2, corr_format=1.5, total=3, reward_sum=3, reward_count=6)
    assert sums(TaskEvaluator(cfg, tok, task, 1, 2)) == dict(  # host 1 of 2: prompt "2=" only
        corr=1, partially_corr=1, corr_format=1, total=1, reward_sum=2, reward_count=2)

    rows = [{"prompts": "a", "answer": 7}, {"prompts": "b", "answer": 8}]
    engine.answers = {"a": ["<answer>7</answer>", "<answer>1</answer>"], "b": ["8", "x"]}
    evaluator = TunixEvaluator(rows, [lambda prompts, completions, **_: [len(c) for c in
                                                                         completions]],
                               tok, cfg, 0, 1)
    # answer_correct needs the <answer> tags: a's first sample only; formatted: a's two.
    assert sums(evaluator) == dict(corr=0.5, partially_corr=1, corr_format=1, total=2,
                                   reward_sum=18 + 18 + 1 + 1, reward_count=4)


def test_global_result_is_maxtexts_percentages_of_every_hosts_sums():
    from tunix_mcjax.runtime.evaluation import global_result

    # SUM_FIELDS per host: corr, partially_corr, corr_format, total, reward_sum, reward_count.
    per_host = np.array([[1.5, 2, 1, 3, 3.0, 6], [0.5, 1, 2, 1, -1.0, 2]])
    assert global_result(per_host) == {
        "corr": 2.0, "total": 4, "accuracy": 50.0, "partial_accuracy": 75.0,
        "format_accuracy": 75.0, "mean_reward": 0.25}
    assert global_result(np.zeros((2, 6)))["accuracy"] == 0.0  # no prompts: no division
