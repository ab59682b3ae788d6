"""LoRA as Tunix does it: adapters built as Tunix's CLI builds them (qwix), the update equal to
Tunix's LoRA update on 2 hosts, publish, non-finite steps, checkpoints, and the keys."""

from __future__ import annotations

import json
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from tunix.cli.utils.model import apply_lora_to_model
from tunix.rl import algo_core, common

from tests.mp import REPO, TINY, launch, launch_worker, read_jsonl
from tunix_mcjax import models
from tunix_mcjax.config import Config, ConfigError, load_config
from tunix_mcjax.train import lora
from tunix_mcjax.train.checkpoint import Checkpointer

GEMMA_NAMES_MODULE_PATH = (".*q_einsum|.*kv_einsum|.*gate_proj|.*down_proj|.*up_proj"
                           "|.*attn_vec_einsum")
ALL_PROJECTIONS = ".*_proj"


def _cfg(*overrides: str):
    return load_config(REPO / "recipes/cpu/demo.yml", [*TINY, "base_num_decoder_layers=2",
                                                        *overrides])


def _without_lora(cfg: Config) -> Config:
    return cfg.replace(lora_rank=0, lora_alpha=Config.lora_alpha,
                       lora_module_path=Config.lora_module_path)


def _flat(state) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("module_path", [GEMMA_NAMES_MODULE_PATH, Config.lora_module_path])
def test_adapters_equal_tunix_cli_lora(module_path):
    """Names, shapes, sharding metadata and initial values of our adapters are those of Tunix's
    CLI path (qwix.LoraProvider + qwix.apply_lora_to_model) on the same base model."""
    cfg = _cfg("lora_rank=4", "lora_alpha=8", f"lora_module_path={module_path}")
    mc = models.model_config(cfg, 40)
    base = models.create_model(models.model_config(_without_lora(cfg), 40), seed=5)
    tunix = apply_lora_to_model(base, None, {"rank": 4, "alpha": 8.0, "module_path": module_path})
    ours = lora.add_adapters(models.create_model(mc, seed=5))
    want, got = _flat(nnx.state(tunix, nnx.LoRAParam)), _flat(nnx.state(ours, nnx.LoRAParam))
    assert want and got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    # run_qwen3.sh before 0.1.7 named Gemma's attention modules: on Qwen3 only the MLP matches.
    modules = {k.split("/")[2] for k in got}
    assert modules == ({"mlp"} if module_path == GEMMA_NAMES_MODULE_PATH else {"attn", "mlp"})
    specs = jax.tree.leaves(nnx.get_partition_spec(nnx.state(ours, nnx.LoRAParam)))
    assert specs == jax.tree.leaves(nnx.get_partition_spec(nnx.state(tunix, nnx.LoRAParam)))
    assert _flat(nnx.state(ours, nnx.Not(nnx.LoRAParam))).keys() == \
        _flat(nnx.state(tunix, nnx.Not(nnx.LoRAParam))).keys()


def test_forward_equals_tunix_lora_model():
    """Our functional forward with adapters (trainer and engine share it) equals the qwix-
    intercepted Tunix model's logits, with nonzero B so the adapters contribute."""
    from tunix_mcjax.train.trainer import qwen3_policy

    cfg = _cfg("lora_rank=4", "lora_alpha=8", f"lora_module_path={ALL_PROJECTIONS}")
    base = models.create_model(models.model_config(_without_lora(cfg), 40), seed=5)
    tunix = apply_lora_to_model(base, None, {"rank": 4, "alpha": 8.0,
                                             "module_path": ALL_PROJECTIONS})
    for i, (_, v) in enumerate(nnx.to_flat_state(nnx.state(tunix, nnx.LoRAParam))):
        v.set_value(jax.random.normal(jax.random.key(i), v.get_value().shape) * 0.1)
    ours = lora.add_adapters(models.create_model(models.model_config(cfg, 40), seed=5))
    nnx.update(ours, nnx.state(tunix, nnx.Param))
    tokens = jax.numpy.array([[1, 5, 7, 9, 3]], jax.numpy.int32)
    positions = jax.numpy.arange(5)[None]
    mask = jax.numpy.tril(jax.numpy.ones((1, 5, 5), bool))
    want, _ = tunix(tokens, positions, None, mask)
    policy, _ = qwen3_policy(ours)
    got = policy.forward(ours, tokens, positions, jax.numpy.ones_like(tokens))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    plain, _ = base(tokens, positions, None, mask)
    assert np.abs(np.asarray(want) - np.asarray(plain)).max() > 1e-3  # adapters mattered


@pytest.mark.parametrize(("overrides", "message"), [
    (["lora_rank=-1"], "lora_rank must be >= 0"),
    (["lora_alpha=16"], "lora_alpha configure LoRA, but lora_rank=0"),
    (["lora_rank=4", "lora_alpha=0"], "lora_alpha must be a finite number > 0"),
    (["lora_rank=4", "lora_module_path=(("], "is not a regex"),
    (["lora_rank=4", "rollout_engine=vllm", "rl_publish_weights_single_call=true"],
     "does not decode LoRA adapters"),
])
def test_bad_lora_keys_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)


@pytest.mark.parametrize(("module_path", "message"), [
    ("nothing", "fully matches none"),
    (".*", "matches embedder"),
])
def test_module_path_must_match_decoder_projections(module_path, message):
    cfg = _cfg("lora_rank=4", f"lora_module_path={module_path}")
    with pytest.raises(ConfigError, match=message):
        models.build_model(cfg, models.model_config(cfg, 40))


# --- one LoRA step on 2 hosts x 2 devices against Tunix's own LoRA update -------------------

UPDATE = [*TINY, "batch_size=4", "num_generations=4", "max_prefill_predict_length=4",
          "max_target_length=10"]


@pytest.fixture(scope="module")
def lora_steps(tmp_path_factory):
    """One launch runs every case and check of tests/workers/lora_update.py."""
    out = tmp_path_factory.mktemp("lora")
    proc = launch_worker("tests.workers.lora_update", "recipes/cpu/demo.yml",
                         [*UPDATE, f"base_output_directory={out}", "run_name=lora"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**np.load(out / "lora" / "lora.npz"), "run_dir": np.array(str(out / "lora-run"))}


def tunix_lora_grads(cfg, npz, case: str) -> tuple[float, dict[str, np.ndarray]]:
    """Tunix's GRPO loss (`grpo_loss_fn`) on Tunix's CLI LoRA model (apply_lora_to_model of
    the base, which is also the reference model), differentiated as Tunix's PeftTrainer does
    (`nnx.DiffState(0, nnx.LoRAParam)`), one process, on the padded batch."""
    from tests.workers.fixed_update import VOCAB, fixed_batch

    def load(model):
        state = nnx.state(model, nnx.Param)
        for key, v in nnx.to_flat_state(state):
            v.set_value(jax.numpy.asarray(npz[f"{case}/initial/{'/'.join(map(str, key))}"]))
        nnx.update(model, state)
        return model

    g = cfg.num_generations
    prompts, completions, rewards = fixed_batch(cfg.batch_size, g)
    base = load(models.create_model(models.model_config(_without_lora(cfg), VOCAB), 1))
    actor = load(apply_lora_to_model(base, None, {"rank": cfg.lora_rank,
                                                  "alpha": cfg.lora_alpha,
                                                  "module_path": cfg.lora_module_path}))
    pl, cl = max(len(p) for p in prompts), max(len(c) for c in completions)
    prompt_ids = np.zeros((len(completions), pl), np.int32)  # left-padded, pad id 0
    completion_ids = np.zeros((len(completions), cl), np.int32)  # right-padded
    for j, c in enumerate(completions):
        prompt_ids[j, pl - len(prompts[j // g]):] = prompts[j // g]
        completion_ids[j, :len(c)] = c
    prompt_ids, completion_ids = jax.numpy.asarray(prompt_ids), jax.numpy.asarray(completion_ids)
    temperature = cfg.decode_sampling_temperature
    ref = None
    if cfg.grpo_beta:
        ref = common.compute_per_token_logps(*nnx.split(base), prompt_ids, completion_ids, 0, 2,
                                             temperature=temperature)
    example = common.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != 0, completion_ids=completion_ids,
        completion_mask=(completion_ids != 0).astype(np.float32),
        advantages=jax.numpy.asarray(algo_core.compute_advantages(rewards, g)),
        ref_per_token_logps=ref, old_per_token_logps=None)
    algo = types.SimpleNamespace(beta=cfg.grpo_beta, epsilon=cfg.grpo_epsilon,
                                 loss_algo=cfg.loss_algo, loss_agg_mode=cfg.loss_agg_mode,
                                 kl_loss_mode="kl", kl_clamp_value=None, temperature=temperature)

    def loss_fn(m):
        return algo_core.grpo_loss_fn(m, example, algo, pad_id=0, eos_id=2)

    (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True,
                                          argnums=nnx.DiffState(0, nnx.LoRAParam))(actor)
    return float(loss), _flat(nnx.state(grads, nnx.LoRAParam))


def _case_names():
    from tests.workers.lora_update import CASES

    return list(CASES)


@pytest.mark.parametrize("case", _case_names())
@pytest.mark.slow  # reads the 2-host LoRA launches (lora_steps)
def test_lora_update_equals_tunix(lora_steps, case):
    """The adapters' update (packed rows over 4 devices of 2 hosts; flat, sharded and
    micro-batched steps) equals Tunix's LoRA update on the padded batch, leaf by leaf, to 1e-5;
    the base stays bit for bit."""
    from tests.workers.lora_update import CASES, LORA

    npz = lora_steps
    cfg = load_config(REPO / "recipes/cpu/demo.yml", UPDATE).replace(**LORA, **CASES[case])
    assert bool(npz[f"{case}/flat"]) == (cfg.fsdp_gather_params_once == "true")
    if cfg.train_micro_batch_size > 0:
        assert npz[f"{case}/micro_batches"] > 1
    assert npz[f"{case}/base_unchanged"] and npz[f"{case}/base_leaves"] > 0
    ref_loss, ref_grads = tunix_lora_grads(cfg, npz, case)
    assert float(npz[f"{case}/loss"]) == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    got_keys = {k.split("/grad/")[1] for k in npz if k.startswith(f"{case}/grad/")}
    assert got_keys == set(ref_grads)  # the adapters train, nothing else
    for key, want in ref_grads.items():
        got = npz[f"{case}/grad/{key}"]
        assert np.abs(want).max() > 0, key  # A and B both have gradients: the check has teeth
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=key)


@pytest.mark.slow  # reads the 2-host LoRA launches (lora_steps)
def test_flat_lora_step_has_three_collectives_of_adapters(lora_steps):
    """Under the flat data-parallel step, as without LoRA: one reduce-scatter, one all-reduce,
    one all-gather per step, and what they move is adapters (the base was gathered once)."""
    from tests.workers.lora_update import CASES

    flat_cases = [c for c in CASES if bool(lora_steps[f"{c}/flat"])]
    assert flat_cases
    for case in flat_cases:
        found = json.loads(lora_steps[f"{case}/collectives"].item())
        assert {k: v["count"] for k, v in found.items()} == {
            "reduce-scatter": 1, "all-reduce": 1, "all-gather": 1, "total": 3}
        assert found["all-gather"]["bytes"] <= lora_steps[f"{case}/adapter_bytes"]


@pytest.mark.slow  # reads the 2-host LoRA launches (lora_steps)
def test_optimizer_state_is_the_adapters_only(lora_steps):
    """The LoRA run's AdamW moments have exactly the adapters' leaves; nothing of the base."""
    assert lora_steps["opt_moment_keys_equal_adapters"]
    assert lora_steps["opt_state_elements"] < 2 * lora_steps["run_adapter_elements"] + 8


@pytest.mark.slow  # reads the 2-host LoRA launches (lora_steps)
def test_publish_moves_adapters_after_the_first(lora_steps):
    """The runtime's first publish loads base + adapters; later ones only the adapters, and every
    engine replica then holds exactly the trainer's base + adapters."""
    first, later = int(lora_steps["run_first_publish_bytes"]), int(lora_steps["run_publish_bytes"])
    assert later == lora_steps["run_adapter_bytes"] == 4 * lora_steps["run_adapter_elements"]
    assert later < first
    assert lora_steps["engine_equals_trainer"]


@pytest.mark.slow  # reads the 2-host LoRA launches (lora_steps)
def test_nonfinite_step_leaves_adapters_and_state_unchanged(lora_steps):
    assert lora_steps["nonfinite_finite"] == 0.0
    assert lora_steps["nonfinite_unchanged"]


def _checkpoint_params(run_dir, step: int) -> list[str]:
    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=2)
    tree = ckpt.manager.item_metadata(step)["params"]
    ckpt.close()
    return ["/".join(str(getattr(k, "key", k)) for k in path).removesuffix("/value")
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.slow  # reads the 2-host LoRA launches (lora_steps)
def test_lora_run_checkpoints_the_adapters(lora_steps):
    """The LoRA run applied every step; its checkpoint holds only the adapters and their
    optimizer state (the base is rebuilt from load_parameters_path or init_weights_seed), and
    restores them exactly."""
    run = Path(lora_steps["run_dir"].item())
    steps = read_jsonl(run / "steps.jsonl")
    assert [r["step"] for r in steps] == [0, 1] and all(r["finite"] == 1.0 for r in steps)
    keys = _checkpoint_params(run, 1)
    assert keys and all(k.endswith(("_lora_a", "_lora_b")) for k in keys)
    assert lora_steps["restored_equal"]


# --- resume through the launcher (python -m tunix_mcjax.launch, 2 hosts x 2 devices) --------

RUN = [*TINY, "batch_size=4", "num_generations=4", "max_target_length=16", "lora_rank=4",
       "lora_alpha=8", "lora_module_path=.*_proj", "grpo_beta=0.04", "enable_checkpointing=true",
       "checkpoint_period=2"]


def _run(tmp_path, name: str, steps: int) -> str:
    proc = launch(["--hosts", "2", "--devices-per-host", "2", "recipes/cpu/demo.yml", *RUN,
                   f"steps={steps}", f"base_output_directory={tmp_path}", f"run_name={name}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.bench  # three launches; the full-weight resume is in the slow tier
def test_lora_resume_matches_uninterrupted_run(tmp_path):
    """Resumed from a checkpoint of adapters (the base rebuilt from init_weights_seed), a LoRA
    run continues exactly as the uninterrupted one."""
    _run(tmp_path, "straight", 4)
    _run(tmp_path, "resumed", 2)
    assert "resumed from" in _run(tmp_path, "resumed", 4)
    straight = read_jsonl(tmp_path / "straight" / "steps.jsonl")
    resumed = read_jsonl(tmp_path / "resumed" / "steps.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(straight, resumed, strict=True):
        assert a["loss"] == b["loss"] and a["reward_mean"] == b["reward_mean"]


@pytest.mark.parametrize("keys", [["lora.enable_lora=true", "lora.lora_rank=8"],
                                  ["lora_rank=8"]])
def test_maxtext_adapter_refuses_lora(keys):
    """MaxText's policy trains every param: MaxText's `lora.*` keys, or ours, are refused by
    name before MaxText reads the command line."""
    pytest.importorskip("maxtext")
    from tests.test_maxtext_adapter import maxtext_argv
    from tunix_mcjax.maxtext import checked_config

    with pytest.raises(ConfigError, match=f"{', '.join(keys)}: LoRA is not supported under the "
                                          "MaxText adapter"):
        checked_config(maxtext_argv(*keys), {}, 1)
