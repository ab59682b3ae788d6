"""The memory planner: exact param counts, the trainer's own layout choices, XLA's buffer sizes
for the train step, and what fits of the paper's profiles on 8 TPU v7x chips."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from tunix_mcjax import memory, models, plan, topology
from tunix_mcjax.bench.profiles import PROFILES
from tunix_mcjax.config import load_config
from tunix_mcjax.trainer import BATCH_KEYS, Trainer, qwen3_policy

GIB = plan.GIB
RECIPE = "recipes/cpu/qwen3_0p6b.yml"
V7X_8_CHIPS = plan.Cluster(hosts=2, devices_per_host=8, device_bytes=int(94.7 * GIB))


def test_param_counts_are_the_models():
    cfg = load_config(None, ["base_num_decoder_layers=3", "base_emb_dim=48", "base_mlp_dim=80",
                             "head_dim=12", "vocab_size=50"])
    mc = models.model_config(cfg, 50)
    model = models.create_model(mc, 0)
    leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
    shape = plan.model_shape(mc, fsdp=1)
    assert shape.param_count == sum(v.get_value().size for _, v in leaves)
    assert shape.layer_param_count == sum(v.get_value().size for k, v in leaves
                                          if k[:2] == ("layers", 0))
    # Qwen3-0.6B: tied embedding, 28 layers of attention (q/k norms), MLP and two norms.
    m = plan.model_shape(models.model_config(load_config(RECIPE), 0), fsdp=2)
    d, q, kv, f = 1024, 2048, 1024, 3072
    layer = d * (2 * q + 2 * kv) + 3 * d * f + 2 * 128 + 2 * d
    assert m.param_count == 151_936 * d + 28 * layer + d == 596_049_920
    # Over 2 devices every matrix shards on its fsdp dim; norms are replicated.
    assert m.sharded_param_count == (m.param_count - 28 * (2 * 128 + 2 * d) - d) // 2 \
        + 28 * (2 * 128 + 2 * d) + d


def test_gather_once_is_decided_by_the_trainers_own_call(monkeypatch):
    calls = []
    decide = memory.gather_params_once

    def spy(setting, **kwargs):
        calls.append((setting, kwargs))
        return decide(setting, **kwargs)

    monkeypatch.setattr(memory, "gather_params_once", spy)
    cfg = load_config(None, ["base_num_decoder_layers=1", "base_emb_dim=32", "vocab_size=64",
                             "fsdp_gather_params_once=auto"])
    topo = topology.current()
    mesh = topology.trainer_mesh(topo)
    mc = models.model_config(cfg, 64)
    trainer = Trainer(cfg, *qwen3_policy(models.create_model(mc, 0, mesh)), mesh)
    device_bytes = memory.device_memory_bytes(jax.devices()[0], len(topo.local_devices))
    p = plan.plan(cfg, plan.Cluster(1, len(topo.local_devices), device_bytes), mc)
    assert calls[0] == calls[1]
    assert p.layout.gather_once == trainer.gather_params_once
    for setting in ("true", "false"):
        forced = plan.plan(cfg.replace(fsdp_gather_params_once=setting), V7X_8_CHIPS, mc)
        assert forced.layout.gather_once == (setting == "true")


def test_accumulation_splits_the_rows_and_their_activations():
    cfg = load_config(RECIPE)
    mc = plan.model_config_for(cfg)
    cluster = plan.Cluster(2, 1, 24 * GIB)
    whole = plan.plan(cfg, cluster, mc)
    split = plan.plan(cfg.replace(train_micro_batch_size=1), cluster, mc)
    assert (whole.layout.rows_per_device, whole.layout.micro_batches) == (2, 1)
    assert (split.layout.micro_batches, split.layout.micro_rows) == memory.micro_batch_rows(2, 2)
    assert split.items["activations"] * 2 == whole.items["activations"]
    assert split.activations["one batch, no remat"] == whole.items["activations"]
    assert split.activations["micro-batch, remat"] < split.items["activations"] / 10
    remat = plan.plan(cfg.replace(train_micro_batch_size=1, remat_policy="full"), cluster, mc)
    assert remat.items["activations"] == split.activations["micro-batch, remat"]


def test_cpu_host_costs_count_only_on_cpu():
    """On CPU each host adds its process baseline (split over its devices) to every phase, and a
    bf16 run the fp32 copy of the embedding to generate and train; accelerators add neither."""
    cfg = load_config(RECIPE)
    mc = plan.model_config_for(cfg)
    cpu = plan.plan(cfg, plan.Cluster(2, 1, 24 * GIB, cpu=True), mc)
    tpu = plan.plan(cfg, plan.Cluster(2, 1, 24 * GIB), mc)
    copy = 4 * 151_936 * 1024
    assert cpu.items["bf16 matmul fp32 copy"] == copy
    assert cpu.items["process baseline"] == plan.PROCESS_BASELINE
    extra = {phase: cpu.phases[phase] - tpu.phases[phase] for phase in cpu.phases}
    assert extra == {"generate": plan.PROCESS_BASELINE + copy,
                     "train": plan.PROCESS_BASELINE + copy, "publish": plan.PROCESS_BASELINE}
    fp32 = plan.plan(cfg.replace(dtype="float32"), plan.Cluster(1, 2, 12 * GIB, cpu=True), mc)
    assert fp32.items["bf16 matmul fp32 copy"] == 0
    assert fp32.items["process baseline"] == plan.PROCESS_BASELINE // 2
    assert tpu.items["process baseline"] == tpu.items["bf16 matmul fp32 copy"] == 0


def _train_step_temp_bytes(overrides: list[str], rows: int) -> int:
    """XLA's temporary buffers for the trainer's compiled step (no run)."""
    cfg = load_config(None, overrides)
    device = jax.devices()[0]  # one device, whatever other test modules gave the process
    mesh = topology.trainer_mesh(topology.Topology(0, 1, (device,), (device,)))
    mc = models.model_config(cfg, cfg.vocab_size)
    trainer = Trainer(cfg, *qwen3_policy(models.create_model(mc, 0, mesh)), mesh)
    t = cfg.max_target_length
    local = {k: np.zeros((rows, t), np.int32) for k in BATCH_KEYS}
    local["segment_ids"][:], local["positions"][:] = 1, np.arange(t)
    with jax.set_mesh(mesh):
        compiled = trainer._step.lower(trainer.params, trainer.opt_state, None,
                                       trainer.global_batch(local), off_policy=False).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_step_scratch_matches_xla(dtype):
    """A shape the coefficients were not fitted on: the planner's train-step scratch (gradients,
    saved activations and logits) against XLA's buffer assignment, one device."""
    rows = 6
    overrides = ["base_num_decoder_layers=3", "base_emb_dim=384", "base_mlp_dim=1024",
                 "base_num_query_heads=6", "base_num_kv_heads=2", "head_dim=64",
                 "vocab_size=3000", "max_prefill_predict_length=8", "max_target_length=192",
                 f"batch_size={rows}", "num_generations=2", "train_logits_chunk_tokens=0",
                 f"dtype={dtype}", "fsdp_gather_params_once=false"]
    cfg = load_config(None, overrides)
    cluster = plan.Cluster(1, 1, 64 * GIB)
    p = plan.plan(cfg, cluster, models.model_config(cfg, 3000))
    assert p.layout.rows_per_device == 16  # worst case 12 sequences -> 16 rows; measure at 6
    scale = rows / p.layout.rows_per_device
    per_token = ("activations", "logits")
    planned = p.items["gradients"] + scale * sum(p.items[k] for k in per_token)
    measured = _train_step_temp_bytes(overrides, rows)
    assert planned == pytest.approx(measured, rel=0.15)


def _profile_config(name: str, **overrides):
    keys = PROFILES[name].recipe("unused.jsonl")
    for key in ("hf_train_files", "dataset_name", "data_repeat_period"):
        keys.pop(key)
    return load_config(None, {**keys, **overrides})


def test_paper_profiles_on_eight_v7x_chips():
    """Qwen3-0.6B on 8 chips (2 hosts x 8 devices of 94.7 GiB): without gradient accumulation
    no profile's train step fits (each device trains 128 rows at once); with it GSM8K fits."""
    for name in ("gsm8k", "numina", "swe"):
        cfg = _profile_config(name)
        p = plan.plan(cfg, V7X_8_CHIPS, plan.model_config_for(cfg))
        assert p.layout.rows_per_device == 128 and not p.fits
        assert p.phases["train"] > V7X_8_CHIPS.device_bytes
    gsm8k = _profile_config("gsm8k", train_micro_batch_size=4)
    assert plan.plan(gsm8k, V7X_8_CHIPS, plan.model_config_for(gsm8k)).fits


def test_cli_reports_fit_and_refuses_bad_topology(capsys):
    assert plan.main([RECIPE, "--hosts", "2", "--devices-per-host", "1", "--hbm-gib", "16"]) == 0
    out = capsys.readouterr().out
    assert "sharded through compute" in out and ": fits" in out
    assert plan.main([RECIPE, "--hosts", "2", "--devices-per-host", "1", "--hbm-gib", "2"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    assert plan.main([RECIPE, "--hosts", "3"]) == 2
    assert "batch_size=2" in capsys.readouterr().err
