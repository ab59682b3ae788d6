"""The MaxText adapter: `rl_runtime=mcjax` on MaxText's own RL trainer, its config map, and the
weight mapping from MaxText's Qwen3 onto the engine's Tunix Qwen3."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("maxtext")

from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # noqa: E402
from tunix.models.qwen3 import model as qwen3  # noqa: E402

from tests.mp import REPO, read_jsonl  # noqa: E402
from tests.stubs import stub_gcluster
from tunix_mcjax.config import ConfigError  # noqa: E402
from tunix_mcjax.engine import SamplingParams  # noqa: E402
from tunix_mcjax.engine.jax_engine import JaxEngine  # noqa: E402
from tunix_mcjax.maxtext import checked_config, load_maxtext_config, policy  # noqa: E402
from tunix_mcjax.train.trainer import packed_attention_mask  # noqa: E402

RL_YML = f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml"
CPU_ARGS = REPO / "recipes/maxtext/cpu/qwen3_tiny.args"
TINY_MODEL = ["model_name=qwen3-0.6b", "override_model_config=true", "base_num_decoder_layers=2",
              "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16",
              "base_mlp_dim=128", "weight_dtype=float32", "dtype=float32", "hardware=cpu",
              "convert_checkpoint_if_possible=false"]


def recipe_args() -> list[str]:
    lines = CPU_ARGS.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def maxtext_argv(*overrides: str) -> list[str]:
    return ["", RL_YML, *TINY_MODEL, "log_config=false", *overrides]


# --- the MaxText command line, end to end ---------------------------------------------------

@pytest.mark.slow  # a 2-host MaxText run; the upstream Qwen3-30B-A3B run is in the slow tier too
def test_train_rl_runs_on_mcjax_two_hosts(tmp_path):
    assert "rl_runtime=mcjax" in recipe_args()
    res = subprocess.run(["bash", str(CPU_ARGS.with_name("run.sh")),
                          f"base_output_directory={tmp_path}"], cwd=REPO, capture_output=True,
                         text=True, timeout=600,
                         env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    # Readable by default: library INFO logs hidden, the progress lines and summary shown.
    lines = (res.stdout + res.stderr).splitlines()
    assert len(lines) < 100, "\n".join(lines)
    assert sum(line.startswith("[host 0] step ") for line in lines) == 3
    assert sum(line.startswith("[host 0] eval ") for line in lines) == 2  # pre, post
    assert any(line.endswith("summary") for line in lines)

    run_dir = tmp_path / "maxtext-qwen3-tiny"
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1, 2]
    for host in (0, 1):
        records = read_jsonl(run_dir / f"host_{host}.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2]
        assert all(r["prompts"] == 1 and r["completions"] == 2 for r in records)
        assert all(np.isfinite(r["loss"]) for r in records)
        facts = json.loads((run_dir / f"maxtext_adapter_host{host}.json").read_text())
        assert facts["num_hosts"] == 2
        assert facts["modules_imported"] == {"vllm": False, "tpu_inference": False}
        cfg = facts["config"]
        assert (cfg["batch_size"], cfg["num_generations"], cfg["steps"]) == (2, 2, 3)
        assert (cfg["max_prefill_predict_length"], cfg["max_target_length"]) == (128, 144)
        assert cfg["grpo_beta"] == pytest.approx(0.08)  # rl.yml's default, honoured
        assert cfg["tokenizer_path"].endswith("qwen3-tokenizer")
    # Both hosts' prompts of a step are the step's global batch, split in whole groups.
    h0, h1 = (read_jsonl(run_dir / f"host_{h}.jsonl") for h in (0, 1))
    for a, b in zip(h0, h1, strict=True):
        assert sorted(a["local_prompt_indices"] + b["local_prompt_indices"]) == \
            sorted(a["global_prompt_indices"])
    assert (run_dir / "checkpoints" / "2").is_dir()  # rl.yml's enable_checkpointing, last step


# --- weight mapping: MaxText's forward == Tunix Qwen3 / the engine on the mapped tree ---------

def perturbed(params: nnx.State, seed: int) -> nnx.State:
    """Random norm scales (MaxText initialises them to 1, which would hide a swapped norm) and an
    embedding table MaxText's bf16 copy represents exactly (its tied logits use that copy)."""
    key = jax.random.key(seed)
    for i, (path, var) in enumerate(nnx.to_flat_state(params)):
        value = var.get_value()
        if path[-1] == "scale":
            var.set_value(value + 0.2 * jax.random.normal(jax.random.fold_in(key, i), value.shape))
        elif path[-1] == "embedding":
            var.set_value(value.astype(jnp.bfloat16).astype(value.dtype))
    return params


@pytest.mark.parametrize("scan_layers,tied", [(True, True), (False, False)])
def test_weight_mapping_matches_maxtext_logits(scan_layers, tied):
    config, _ = load_maxtext_config(
        maxtext_argv("vocab_size=512", f"scan_layers={scan_layers}",
                     f"logits_via_embedding={tied}"), {})
    model, mesh = policy.build_model(config, pad_id=0)
    # Two packed sequences per row: positions restart, segment 0 is padding.
    segments = np.array([[1] * 9 + [2] * 5 + [0] * 2, [1] * 16])
    positions = np.concatenate([np.arange(9), np.arange(5), np.zeros(2)])[None].repeat(2, 0)
    positions[1] = np.arange(16)
    tokens = np.random.default_rng(0).integers(1, 512, size=(2, 16))
    args = [jnp.asarray(a, jnp.int32) for a in (tokens, positions, segments)]

    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(model)  # params and MaxText's construction-time rngs
        before = jax.jit(lambda s: policy.forward(nnx.merge(graphdef, s), *args,
                                                  rules=config.logical_axis_rules))(state)
        trainer_policy, params = policy.maxtext_policy(model, config)

        def maxtext_forward(p):
            return trainer_policy.forward(nnx.merge(trainer_policy.graphdef, p), *args)

        after = jax.jit(maxtext_forward)(params)
        np.testing.assert_array_equal(np.asarray(before), np.asarray(after))  # rngs were dead
        params = perturbed(params, seed=1)
        maxtext_logits = jax.jit(maxtext_forward)(params)
        engine_params = jax.device_get(trainer_policy.to_engine_params(params))

    mc = policy.engine_model_config(config)
    tunix_model = qwen3.Qwen3(mc, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(tunix_model)
    nnx.replace_by_pure_dict(state, engine_params)
    tunix_logits, _ = nnx.merge(graphdef, state)(*args[:2], None,
                                                 packed_attention_mask(args[2]))
    valid = segments > 0
    np.testing.assert_allclose(np.asarray(tunix_logits)[valid],
                               np.asarray(maxtext_logits)[valid], atol=2e-4, rtol=1e-4)

    # The engine loads the same tree and decodes it: greedy first token and its logprob.
    engine = JaxEngine(mc, jax.devices()[:1], pad_id=0, eos_ids=(511,), max_prompt_length=16,
                       max_new_tokens=1)
    engine.load_weights(engine_params)
    [out] = engine.generate([tokens[1]], SamplingParams(max_new_tokens=1, greedy=True), seed=0)
    last = np.asarray(jax.nn.log_softmax(maxtext_logits[1, -1]))
    assert out.tokens[0] == int(np.argmax(last))
    assert out.logprobs[0] == pytest.approx(float(last.max()), abs=1e-4)


# --- config mapping ---------------------------------------------------------------------------

def test_honoured_keys_land_in_config(tmp_path, monkeypatch):
    monkeypatch.delenv("M_JAX_CACHE_DIR", raising=False)  # set on the command line here
    _, cfg, not_applied = checked_config(maxtext_argv(
        "batch_size=4", "rl.num_generations=3", "max_prefill_predict_length=64",
        "max_target_length=96", "decode_sampling_temperature=0.7", "decode_sampling_top_k=20",
        "decode_sampling_nucleus_p=0.9", "learning_rate=1e-5", "adam_b1=0.8", "adam_b2=0.95",
        "adam_weight_decay=0.01", "gradient_clipping_threshold=0.5", "warmup_steps_fraction=0.2",
        "rl.grpo_beta=0.0", "grpo_epsilon=0.3", "loss_agg_mode=token-mean", "num_batches=5",
        "num_epoch=2", "rl_async_metrics_export=true", "rl_gc_freeze_after_warmup=true",
        "rl_balance_prompts_by_length=true", "rl_publish_weights_single_call=true",
        "rl_balance_by_expected_output=true", "loss_algo=gspo-token",
        "enable_checkpointing=false", "checkpoint_period=7",
        "max_num_checkpoints_to_keep=3",
        "run_name=r1", f"base_output_directory={tmp_path}", "hf_train_files=x.parquet",
        "rollout_data_parallelism=4", "data_shuffle_seed=5", "tokenizer_path=qwen3-tokenizer",
        "num_test_batches=0", "rl_runtime=mcjax", "train_micro_batch_size=2",
        "jax_cache_dir=~/cache-r1"), {}, num_hosts=2)
    assert not_applied == {}
    expected = {
        "batch_size": 4, "num_generations": 3, "max_prefill_predict_length": 64,
        "max_target_length": 96, "decode_sampling_temperature": 0.7, "decode_sampling_top_k": 20,
        "decode_sampling_nucleus_p": 0.9, "learning_rate": 1e-5, "adam_b1": 0.8, "adam_b2": 0.95,
        "adam_weight_decay": 0.01, "gradient_clipping_threshold": 0.5,
        "warmup_steps_fraction": 0.2, "grpo_beta": 0.0, "grpo_epsilon": 0.3,
        "loss_agg_mode": "token-mean", "loss_algo": "gspo-token", "steps": 10,
        "rl_async_metrics_export": True,
        "rl_gc_freeze_after_warmup": True, "rl_balance_prompts_by_length": True,
        "rl_publish_weights_single_call": True, "rl_balance_by_expected_output": True,
        "enable_checkpointing": False,
        "checkpoint_period": 7, "max_num_checkpoints_to_keep": 3, "run_name": "r1",
        "hf_train_files": "x.parquet", "rollout_data_parallelism": 2, "seed": 5,
        "rl_runtime": "mcjax", "base_num_decoder_layers": 2, "base_emb_dim": 64,
        "train_micro_batch_size": 2, "train_logits_chunk_tokens": 0,
        "jax_cache_dir": "~/cache-r1",
    }
    assert {k: getattr(cfg, k) for k in expected} == pytest.approx(expected)
    assert cfg.run_dir == tmp_path / "r1"
    assert cfg.tokenizer_path.endswith("assets/tokenizers/qwen3-tokenizer")


def test_num_iterations_is_updates_per_batch():
    """MaxText's train_steps counts optimizer updates (num_iterations per batch): the run has
    as many steps (batches) as with one iteration, each trained num_iterations times."""
    _, one, _ = checked_config(maxtext_argv("num_batches=6"), {}, 1)
    _, three, _ = checked_config(maxtext_argv("num_batches=6", "rl.num_iterations=3"), {}, 1)
    assert (one.num_iterations, three.num_iterations) == (1, 3)
    assert three.steps == one.steps > 0


def test_maxtexts_jax_cache_dir_is_the_runs_at_its_default(monkeypatch):
    """MaxText's own default (~/jax_cache) reaches every process of the run, as MaxText's
    pyconfig.initialize sets it for MaxText's own trainer."""
    monkeypatch.delenv("M_JAX_CACHE_DIR", raising=False)
    _, cfg, _ = checked_config(maxtext_argv(), {}, 1)
    assert cfg.jax_cache_dir == "~/jax_cache"


def test_reward_workers_keep_maxtexts_meaning(monkeypatch):
    """MaxText's default (0: the batch scored after generation) is kept; set, the two keys
    mean what they mean in Tunix, with threads for processes."""
    monkeypatch.delenv("M_JAX_CACHE_DIR", raising=False)
    _, default, _ = checked_config(maxtext_argv(), {}, 1)
    assert (default.reward_num_workers, default.reward_worker_timeout_seconds) == (0, 180.0)
    _, cfg, not_applied = checked_config(maxtext_argv(
        "reward_num_workers=2", "reward_worker_timeout_seconds=30"), {}, 1)
    assert not_applied == {}
    assert (cfg.reward_num_workers, cfg.reward_worker_timeout_seconds) == (2, 30.0)


def test_pathways_and_vllm_settings_are_reported_not_applied():
    _, _, not_applied = checked_config(maxtext_argv(
        "async_scheduling=false", "use_pathways=false", "trainer_devices_fraction=1.0"), {}, 1)
    assert not_applied == {"async_scheduling": False, "use_pathways": False,
                           "trainer_devices_fraction": 1.0}


def test_unsupported_settings_are_refused_by_name(monkeypatch):
    with pytest.raises(ConfigError) as err:
        checked_config(maxtext_argv("max_seq_token_per_tpu=4096", "dropout_rate=0.1",
                                    "max_target_length=2048"), {}, 1)
    msg = str(err.value)
    for key in ("max_seq_token_per_tpu=4096", "dropout_rate=0.1",
                "token-budget micro-batching", "without dropout"):
        assert key in msg
    assert "max_target_length" not in msg  # honoured, so not named
    # Also through MaxText's `M_<KEY>` environment overrides.
    monkeypatch.setenv("M_MAX_SEQ_TOKEN_PER_TPU", "4096")
    with pytest.raises(ConfigError, match="max_seq_token_per_tpu=4096: no token-budget"):
        checked_config(maxtext_argv(), {}, 1)


def test_quantization_on_the_command_line_quantizes_the_rollout_only(tmp_path, monkeypatch):
    """MaxText's `quantization`, `quantize_kvcache` and `kv_quant_dtype` from train_rl's command
    line set the rollout engine's weights and KV pages (jax engine; maxtext engine: dense
    Qwen3's weights, any family's pages); MaxText's config (which builds the trainer) never
    sees them. Where they cannot be honoured they are refused by name before anything is
    built: in a config file (the trainer's, MaxText's own KV cache), as `M_<KEY>` overrides
    (MaxText drops those for keys rl.yml does not set), and weights on a MoE family."""
    config, cfg, _ = checked_config(maxtext_argv("quantization=int8"), {}, 1)
    assert cfg.quantization == "int8" and cfg.rollout_engine == "jax"
    assert not getattr(config.quantization, "value", config.quantization)
    config, cfg, _ = checked_config(maxtext_argv(
        "quantization=fp8", "quantize_kvcache=true", "kv_quant_dtype=fp8",
        "rollout_engine=maxtext"), {}, 1)
    assert (cfg.rollout_engine, cfg.quantization, cfg.quantize_kvcache, cfg.kv_quant_dtype) == \
        ("maxtext", "fp8", True, "fp8")
    assert not config.quantize_kvcache
    moe = ["", RL_YML, "model_name=qwen3-30b-a3b", "log_config=false", "quantization=int8"]
    with pytest.raises(ConfigError, match="quantization=int8 with rollout_engine=maxtext: "
                                          "model_name=qwen3-30b-a3b"):
        checked_config(moe, {}, 1)
    for key, value, why in [("quantization", "int8", "quantization='int8': set in a config file"),
                            ("quantize_kvcache", "true", "quantize_kvcache=True: set in a config "
                                                         "file it is MaxText's own KV cache's")]:
        yml = tmp_path / f"{key}.yml"
        yml.write_text(f"base_config: {RL_YML}\n{key}: {value}\n")
        with pytest.raises(ConfigError, match=re.escape(why)):
            checked_config(["", str(yml), *maxtext_argv()[2:]], {}, 1)
    monkeypatch.setenv("M_QUANTIZATION", "int8")
    with pytest.raises(ConfigError, match="M_QUANTIZATION=int8: MaxText applies an M_<KEY> "
                                          "override only to a key its YAML files set"):
        checked_config(maxtext_argv(), {}, 1)


@pytest.mark.parametrize("overrides,match", [
    (["gradient_clipping_threshold=1.0", "rollout_data_parallelism=3"],
     "rollout_data_parallelism=3 does not divide by 2 hosts"),
])
def test_values_the_runtime_cannot_run_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        checked_config(maxtext_argv(*overrides), {}, 2)


@pytest.mark.parametrize("model_name", ["llama3.1-8b"])
def test_unsupported_model_family_errors_clearly(model_name):
    argv = ["", RL_YML, f"model_name={model_name}", "log_config=false"]
    with pytest.raises(ConfigError, match=rf"model_name={model_name} .*not supported by "
                                          r"rl_runtime=mcjax yet.*dense Qwen3"):
        checked_config(argv, {}, 1)


# --- the TPU v7x recipe: the one-key switch ---------------------------------------------------

V7X_RECIPE = REPO / "recipes/maxtext/tpu_v7x/run_qwen3_0p6b_rl.sh"
O1_O4 = ["rl_async_metrics_export=true", "rl_gc_freeze_after_warmup=true",
         "rl_balance_prompts_by_length=true", "rl_publish_weights_single_call=true"]


def submit_v7x(tmp_path, **env: str) -> tuple[int, list[str]]:
    """Runs the v7x recipe against a stub gcluster: (exit code, `job submit` arguments)."""
    bin_dir, log = stub_gcluster(tmp_path)
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SUBMIT_LOG": str(log), "PROJECT_ID": "p",
            "CLUSTER_NAME": "c", "ZONE": "z", "DOCKER_IMAGE": "img", "RUN_NAME": "run",
            "MAXTEXT_CKPT_PATH": "gs://ckpt/0/items", "BASE_OUTPUT_DIRECTORY": str(tmp_path)}
    rc = subprocess.run(["bash", str(V7X_RECIPE)], env={**base, **env},
                        capture_output=True).returncode
    return rc, log.read_text().split("\0")[:-1] if log.exists() else []


def maxtext_keys(submit_args: list[str]) -> list[str]:
    """The key=value arguments of the submitted train_rl command."""
    (command,) = [a.removeprefix("--command=") for a in submit_args if a.startswith("--command=")]
    words = shlex.split(command)
    return words[words.index("maxtext.trainers.post_train.rl.train_rl") + 1:]


def test_v7x_recipe_one_key_switch_is_accepted(tmp_path):
    rc, pathways = submit_v7x(tmp_path)
    assert rc == 0 and "--pathways" in pathways
    rc, mcjax = submit_v7x(tmp_path, RL_RUNTIME="mcjax", RL_FLAGS=" ".join(O1_O4))
    assert rc == 0 and not any(a.startswith("--pathways") for a in mcjax)
    keys = maxtext_keys(mcjax)
    # The MaxText command differs only by the runtime key and the optional flags.
    assert sorted(keys) == sorted(
        [k for k in maxtext_keys(pathways) if k != "rl_runtime=pathways"]
        + ["rl_runtime=mcjax", *O1_O4])

    # 64 chips = 16 hosts; every setting is honoured or reported as Pathways/vLLM-only.
    _, cfg, not_applied = checked_config(["", RL_YML, *keys], {}, num_hosts=16)
    assert (cfg.batch_size, cfg.num_generations, cfg.steps) == (128, 8, 500)
    assert cfg.train_micro_batch_size == 32  # 4 micro-batches, as in MaxText's recipe
    assert (cfg.rollout_tensor_parallelism, cfg.rollout_data_parallelism) == (1, -1)
    assert all(getattr(cfg, k.split("=")[0]) is True for k in O1_O4)
    assert {"vllm_additional_config", "enable_tunix_perf_metrics",
            "rollout_micro_batch_size", "enable_dp_attention"} <= set(not_applied)
    assert "hbm_utilization_vllm" not in not_applied  # it sizes the jax engine's page pool


@pytest.mark.parametrize("env", [{"RL_FLAGS": "rl_async_metrics_export=true"}])
def test_v7x_recipe_rejects_inconsistent_settings(tmp_path, env):
    rc, submitted = submit_v7x(tmp_path, **env)
    assert rc == 1 and not submitted
