"""Compiling for TPU without a TPU (`tunix_mcjax.aot`): libtpu stays out of CPU processes, the
page layout's kernel takes its block sizes from the target's device kind, and the tiny model's
engine program (Pallas ragged paged attention on CombinedPages) and train step compile for a
TPU7x slice with a sane memory verdict from XLA."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

from tests.conftest import SUITE_XLA_FLAG
from tunix_mcjax.aot import libtpu
from tunix_mcjax.engine.paged_attention import rpa_block_sizes

ROOT = Path(__file__).resolve().parents[1]
HAVE_LIBTPU = (libtpu.libtpu_dir() / "libtpu" / "libtpu.so").is_file()
needs_libtpu = pytest.mark.skipif(
    not HAVE_LIBTPU, reason=f"libtpu is not installed under {libtpu.libtpu_dir()}: "
    f"`{libtpu.MAKE_TARGET}` installs it (make test does)")
# The tiny model at a head size the TPU kernel takes (a multiple of 128 lanes), one layer.
TINY = ["head_dim=128", "base_num_decoder_layers=1"]
TPU7X_DEVICE_BYTES = int(94.7 * 2**30)


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python ARGS` as a user's process: no suite cache, and XLA's optimisations on."""
    environ = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    environ["XLA_FLAGS"] = " ".join(f for f in environ.get("XLA_FLAGS", "").split()
                                    if f != SUITE_XLA_FLAG)
    environ.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=300)


def test_tpu_compiles_run_with_the_users_xla_flags_not_the_suites():
    """The suite compiles CPU programs at -O0 (tests/conftest.py); a TPU compile's memory
    verdict must be the one a user's process gets."""
    suite = os.environ.get("XLA_FLAGS", "").split()  # holds the flag unless yours set a level
    out = run(["-c", "import os; print(os.environ.get('XLA_FLAGS', ''))"]).stdout
    assert out.split() == [f for f in suite if f != SUITE_XLA_FLAG]


@needs_libtpu
def test_cpu_processes_do_not_see_libtpu():
    probe = ("import importlib.util, jax; print(importlib.util.find_spec('libtpu'), "
             "sorted({d.platform for d in jax.devices()}))")  # XLA_FLAGS may give several
    for out in (run(["-c", probe]).stdout, run(["-c", probe], JAX_PLATFORMS="").stdout):
        assert out.split() == ["None", "['cpu']"], out
    assert importlib.util.find_spec("libtpu") is None  # nor this (the suite's) process
    assert {d.platform for d in jax.devices()} == {"cpu"}


def test_without_libtpu_the_entry_point_names_the_make_target(tmp_path):
    out = run(["-m", "tunix_mcjax.aot", "recipes/cpu/demo.yml", "--topology", "tpu7x:2x2x1"],
              TUNIX_MCJAX_LIBTPU=str(tmp_path))
    assert out.returncode == 3
    assert "make setup-tpu-compiler" in out.stderr


@pytest.mark.parametrize("kind,name,version", [("TPU v5 lite", "TPU v5", 5),
                                               ("TPU v6 lite", "TPU v6", 6),
                                               ("TPU7x", "TPU v7", 7)])
@pytest.mark.parametrize("tokens,pages_per_seq,page_size", [(64, 160, 16), (2048, 64, 32),
                                                            (128, 32, 128)])
def test_block_sizes_are_the_kernels_own_for_the_target(monkeypatch, kind, name, version,
                                                        tokens, pages_per_seq, page_size):
    """What JAX's lookup gives on a device of that kind, from this CPU process."""
    monkeypatch.setattr(tuned_block_sizes, "get_tpu_version", lambda: version)
    monkeypatch.setattr(tuned_block_sizes, "get_device_name", lambda num_devices=None: name)
    q = jax.ShapeDtypeStruct((tokens, 16, 128), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((4096, page_size, 16, 128), jnp.bfloat16)
    sizes = rpa_block_sizes(kind, q, pages, pages_per_seq)
    expected = tuned_block_sizes.get_tuned_block_sizes(jnp.bfloat16, jnp.bfloat16, 16, 8, 128,
                                                       page_size, tokens, pages_per_seq)
    assert (sizes["num_kv_pages_per_block"], sizes["num_queries_per_block"]) == expected
    assert 0 < sizes["vmem_limit_bytes"] <= 96 << 20
    with pytest.raises(ValueError, match="SplitPages"):
        rpa_block_sizes("cpu", q, pages, pages_per_seq)


@needs_libtpu
def test_tiny_model_programs_compile_for_tpu7x(tmp_path):
    out = run(["-m", "tunix_mcjax.aot", "recipes/cpu/demo.yml", *TINY, "--topology",
               "tpu7x:2x2x1", "--json", str(tmp_path / "aot.json")])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads((tmp_path / "aot.json").read_text())
    assert (result["device_kind"], result["hosts"], result["devices_per_host"]) == ("TPU7x", 1, 8)
    programs = {row["name"]: row for row in result["compiled"]}
    assert {"engine decode loop", "engine slice", "train step", "engine decode step"} <= set(
        programs)
    for row in programs.values():
        assert row["compiled"] and row["temporaries"] > 0 and row["code"] > 0, row
        # XLA's argument bytes are the shards we passed (tiled padding aside).
        assert abs(row["arguments"] / row["argument_shapes_bytes"] - 1) < 0.25, row
        assert 0 < row["peak"] < TPU7X_DEVICE_BYTES
        assert 0 < row["compile_cpu_s"] and row["load_1m"] >= 0, row
    loop = programs["engine decode loop"]
    assert loop["aliased"] > 0  # the donated page pool is updated in place
    # A session's slice gives its whole donated state back in place: the pool and the rest.
    assert programs["engine slice"]["aliased"] > loop["aliased"]
    assert loop["fits"] and programs["train step"]["fits"]
    cost = result["decode_cost"]
    assert cost["flops"] > 0 and cost["xla_bytes_accessed"] > 0 and cost["roofline_ms"] > 0


@needs_libtpu
def test_agentic_session_with_kept_pages_compiles_for_tpu7x_at_its_planned_slots(tmp_path):
    """The tool demo's turn loop keeps pages on a session: its slice compiles at the planner's
    turn shapes (a prompt slot a conversation and one a group's first prompt)."""
    out = run(["-m", "tunix_mcjax.aot", "recipes/cpu/demo_agentic.yml", *TINY,
               "agentic_keep_pages=true", "--topology", "tpu7x:2x2x1", "--programs", "slice",
               "--json", str(tmp_path / "aot.json")])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    [row] = json.loads((tmp_path / "aot.json").read_text())["compiled"]
    assert row["name"] == "engine slice" and row["compiled"] and row["fits"], row
    assert row["aliased"] > 0, row


@needs_libtpu
def test_tensor_parallel_replica_runs_the_kernel_on_each_devices_heads(tmp_path):
    """Two devices a replica: Mosaic refuses to partition a Pallas call, so the engine's loop
    compiles only with the kernel inside a shard_map over the heads (`CombinedPages(mesh)`)."""
    out = run(["-m", "tunix_mcjax.aot", "recipes/cpu/demo.yml", *TINY,
               "rollout_tensor_parallelism=2", "--topology", "tpu7x:2x2x1", "--programs",
               "engine", "--json", str(tmp_path / "aot.json")])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    [row] = json.loads((tmp_path / "aot.json").read_text())["compiled"]
    assert row["compiled"] and row["fits"] and row["aliased"] > 0, row


# MaxText's Qwen3-30B-A3B script at a tiny width and two layers, head size 128 for the kernel;
# one device a replica (XLA does not partition the Pallas call over a replica's devices).
TINY_MAXTEXT = ["override_model_config=true", "base_emb_dim=256", "base_num_query_heads=8",
                "base_num_kv_heads=4", "head_dim=128", "base_num_decoder_layers=2",
                "base_moe_mlp_dim=128", "num_experts=4", "num_experts_per_tok=2",
                "vocab_size=1024", "max_target_length=1024", "max_prefill_predict_length=256",
                "rollout_data_parallelism=8", "rollout_tensor_parallelism=1"]


@needs_libtpu
@pytest.mark.skipif(importlib.util.find_spec("maxtext") is None, reason="needs maxtext")
@pytest.mark.slow  # a MaxText script's engine through Mosaic; the tiny model's stays in the default
@pytest.mark.parametrize("tp", [1, 2])
def test_maxtext_scripts_engine_compiles_for_tpu7x(tmp_path, tp):
    """`python -m tunix_mcjax.aot run_qwen3_30b_rl ...`: the script's keys, shrunk; the maxtext
    engine's loop and its session's slice on CombinedPages (JAX's Pallas kernel, through Mosaic)
    for a TPU7x host, on one device a replica and on two (the kernel inside a shard_map over
    the kv heads)."""
    keys = [k for k in TINY_MAXTEXT if not k.startswith("rollout_")]
    out = run(["-m", "tunix_mcjax.aot", "run_qwen3_30b_rl", *keys,
               f"rollout_data_parallelism={8 // tp}", f"rollout_tensor_parallelism={tp}",
               "--topology", "tpu7x:2x2x1", "--programs", "engine,slice", "--json",
               str(tmp_path / "aot.json")])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads((tmp_path / "aot.json").read_text())
    assert (result["script"], result["model"]) == ("run_qwen3_30b_rl", "qwen3-30b-a3b-base")
    facts = result["engine"]
    assert facts["page_layouts"] == ["CombinedPages"] and facts["tensor_parallelism"] == tp
    assert facts["max_new"] == 1024 - 256 and facts["layers"] == 2
    loop, slice_ = result["compiled"]
    assert (loop["name"], slice_["name"]) == ("maxtext engine decode loop",
                                              "maxtext engine slice")
    for row in (loop, slice_):
        assert row["compiled"] and row["fits"] and row["aliased"] > 0, row
        assert abs(row["arguments"] / row["argument_shapes_bytes"] - 1) < 0.25, row
        assert 0 < row["peak"] < TPU7X_DEVICE_BYTES and row["compile_cpu_s"] > 0
    assert slice_["aliased"] > loop["aliased"]  # the whole loop state, in place


# The same script shrunk further for its train step: 16 sequences (8 prompts x 2) of 256 tokens,
# 2 micro-batches (train_micro_batch_size=4 of 8 prompts) of one row a device.
TINY_MAXTEXT_TRAIN = [*(k for k in TINY_MAXTEXT if not k.startswith("max_")),
                      "max_target_length=256", "max_prefill_predict_length=128", "batch_size=8",
                      "rl.num_generations=2", "train_micro_batch_size=4"]


@needs_libtpu
@pytest.mark.skipif(importlib.util.find_spec("maxtext") is None, reason="needs maxtext")
def test_maxtext_scripts_train_step_compiles_for_tpu7x(tmp_path):
    """`--programs train`: MaxText's model (scanned, its own remat) under our Trainer, FSDP over
    the host's 8 devices, with MaxText's optimizer and the reference model; XLA's memory verdict
    holds the step's own state, and the phase adds the maxtext engine's whole bf16 weights."""
    out = run(["-m", "tunix_mcjax.aot", "run_qwen3_30b_rl", *TINY_MAXTEXT_TRAIN, "--topology",
               "tpu7x:2x2x1", "--programs", "train", "--json", str(tmp_path / "aot.json")])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads((tmp_path / "aot.json").read_text())
    assert result["programs"] == ["train"] and "engine" not in result
    facts = result["train"]
    assert facts["mesh"]["fsdp"] == 8 and facts["scan_layers"] and facts["reference_model"]
    assert (facts["micro_batches"], facts["rows_per_device"], facts["row_len"]) == (2, 1, 256)
    assert facts["mesh_hosts_interleaved"] is False  # one host
    [row] = result["compiled"]
    assert row["name"] == "maxtext train step" and row["compiled"] and row["fits"], row
    # Its arguments: params and the reference (bf16 shards), Adam's two moments, the batch.
    params = facts["param_bytes_per_device"]
    assert row["argument_shapes_bytes"] >= 2 * params + facts["optimizer_bytes_per_device"]
    assert abs(row["arguments"] / row["argument_shapes_bytes"] - 1) < 0.25, row
    assert row["peak"] >= row["arguments"] > 0 and row["temporaries"] > 0
    # The engine's weights, whole on its one device (tensor parallelism 1), in bf16.
    assert row["resident"] == 2 * facts["param_count"]
    assert row["phase_peak"] == row["peak"] + row["resident"] < TPU7X_DEVICE_BYTES
    assert row["plan_phase_peak"] is None and row["compile_cpu_s"] > 0


@pytest.mark.parametrize("keys,named", [
    ({"free_kv_cache_during_weight_sync": False}, "free_kv_cache_during_weight_sync=true"),
    ({"rollout_engine": "vllm", "rl_publish_weights_single_call": True}, "rollout_engine=vllm")])
def test_maxtext_train_step_refuses_what_its_phase_does_not_count(keys, named):
    """A kept page pool or vLLM's weights would sit beside the step uncounted: refused, named."""
    from tunix_mcjax.aot import maxtext_train
    from tunix_mcjax.config import Config

    with pytest.raises(ValueError, match=named):
        maxtext_train.engine_weights(None, Config().replace(**keys), None)
