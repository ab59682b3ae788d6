"""The shared phases' math in one process: the step's exchange, O3's history, and the
off-policy paths (Tunix's clipped ratio against the engine's logprobs, num_iterations, and
gspo-token's sequence-level ratio), each against Tunix's own grpo_loss_fn."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tunix.rl import algo_core, common

from tests.mp import REPO, TINY
from tests.workers.fixed_update import VOCAB, fixed_batch
from tunix_mcjax import models, topology
from tunix_mcjax.config import load_config
from tunix_mcjax.engine import Completion, SamplingParams
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.publish import Publisher
from tunix_mcjax.rewards import group_advantages
from tunix_mcjax.runtime import exchange, phases, stepmath
from tunix_mcjax.train import layer_runs, loss, packing
from tunix_mcjax.train.trainer import Trainer, qwen3_policy

SHAPE = [*TINY, "batch_size=4", "num_generations=4", "max_prefill_predict_length=4",
         "max_target_length=10", "grpo_beta=0.0"]


def test_exchange_keeps_counts_exact_and_splits_the_parts():
    sent = [exchange.HostMessage(3 + h, 8, 2**40 + h, np.array([0.5, h]),
                                 np.array([[7.0 + h, 2.5], [9.0, 1.0]])) for h in (0, 1)]
    got = exchange.Exchanged.decode(np.stack([m.encode() for m in sent]), num_metrics=2)
    assert got.rows.tolist() == [3, 4] and got.global_sequences == 16
    assert got.global_tokens == 2**41 + 1  # int64, exact past float32's and float64's ints
    assert got.metrics.tolist() == [[0.5, 0.0], [0.5, 1.0]]
    assert got.lengths.tolist() == [[7.0, 2.5], [9.0, 1.0], [8.0, 2.5], [9.0, 1.0]]
    assert got.rows_per_device(2) == 2  # ceil(4 / 2), a power of two
    alone = exchange.exchange(exchange.HostMessage.metrics_only(np.ones(3)), None)
    assert alone.rows.tolist() == [0] and alone.metrics.tolist() == [[1.0, 1.0, 1.0]]


def test_length_history_means_over_admissions():
    history = stepmath.LengthHistory(4)
    history.add(np.array([[1.0, 4.0], [2.0, 6.0]]))
    history.add(np.array([[1.0, 8.0]]))
    assert history.expected(np.array([0, 1, 2]), default=5.0).tolist() == [5.0, 6.0, 6.0]
    restored = stepmath.LengthHistory(4)
    restored.load(history.state())
    assert restored.expected(np.array([1]), 0.0).tolist() == [6.0]


def _cfg(**changes):
    return load_config(REPO / "recipes/cpu/demo.yml", SHAPE).replace(**changes)


def _flat(tree) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value())
            for k, v in nnx.to_flat_state(layer_runs.unstack(tree))}


def assert_applied(initial: dict, params, grads: dict, lr: float) -> None:
    """The SGD update from `initial` to `params` applied `grads` (a reference's, per leaf), each
    leaf to 1e-5 of its largest entry; no leaf's gradient is all zero."""
    final = _flat(params)
    for key, want in grads.items():
        applied = (initial[key].astype(np.float64) - final[key]) / lr
        assert np.abs(want).max() > 0, key
        np.testing.assert_allclose(applied, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                   err_msg=key)


def _padded(prompts, completions, g):
    """Tunix's layout: prompts left-padded, completions right-padded, pad id 0."""
    pl, cl = max(len(p) for p in prompts), max(len(c) for c in completions)
    prompt_ids = np.zeros((len(completions), pl), np.int32)
    completion_ids = np.zeros((len(completions), cl), np.int32)
    for j, c in enumerate(completions):
        p = prompts[j // g]
        prompt_ids[j, pl - len(p):] = p
        completion_ids[j, :len(c)] = c
    return prompt_ids, completion_ids


class TunixReference:
    """Tunix's grpo_loss_fn on the padded batch, one process, from given params."""

    def __init__(self, cfg, prompts, completions, advantages):
        self.cfg, self.model = cfg, models.create_model(models.model_config(cfg, VOCAB), 0)
        self.prompt_ids, self.completion_ids = _padded(prompts, completions,
                                                       cfg.num_generations)
        self.advantages = advantages

    def load(self, flat: dict[str, np.ndarray]) -> None:
        params = nnx.state(self.model, nnx.Param)
        for key, var in nnx.to_flat_state(params):
            var.set_value(jnp.asarray(flat["/".join(map(str, key))]))
        nnx.update(self.model, params)

    def logps(self) -> np.ndarray:
        graphdef, state = nnx.split(self.model)
        return np.asarray(common.compute_per_token_logps(
            graphdef, state, jnp.asarray(self.prompt_ids), jnp.asarray(self.completion_ids), 0,
            2, temperature=self.cfg.decode_sampling_temperature))

    def grads(self, old: np.ndarray | None) -> tuple[float, dict[str, np.ndarray]]:
        cfg = self.cfg
        example = common.TrainExample(
            prompt_ids=jnp.asarray(self.prompt_ids), prompt_mask=jnp.asarray(self.prompt_ids != 0),
            completion_ids=jnp.asarray(self.completion_ids),
            completion_mask=jnp.asarray(self.completion_ids != 0).astype(np.float32),
            advantages=jnp.asarray(self.advantages), ref_per_token_logps=None,
            old_per_token_logps=None if old is None else jnp.asarray(old))
        algo = types.SimpleNamespace(
            beta=0.0, epsilon=cfg.grpo_epsilon, loss_algo=cfg.loss_algo,
            loss_agg_mode=cfg.loss_agg_mode, kl_loss_mode="kl", kl_clamp_value=None,
            temperature=cfg.decode_sampling_temperature)

        def loss_fn(m):
            return algo_core.grpo_loss_fn(m, example, algo, pad_id=0, eos_id=2)

        (value, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(self.model)
        return float(value), _flat(nnx.state(grads, nnx.Param))


def _setup(cfg, lr: float, noise: float):
    """(trainer, packed local batch, Tunix reference, initial params, behaviour logps): the
    behaviour logps are Tunix's own at the initial params, plus `noise`."""
    g = cfg.num_generations
    prompts, completions, rewards = fixed_batch(cfg.batch_size, g)
    adv = group_advantages(rewards, g)
    mesh = topology.trainer_mesh(topology.current())
    model = models.create_model(models.model_config(cfg, VOCAB), 123, mesh)
    policy, params = qwen3_policy(model)
    initial = _flat(params)
    ref = TunixReference(cfg, prompts, completions, adv)
    ref.load(initial)
    rng = np.random.default_rng(3)
    behaviour = ref.logps() + noise * rng.standard_normal(ref.completion_ids.shape)
    behaviour = (behaviour * (ref.completion_ids != 0)).astype(np.float32)
    done = [Completion(c, behaviour[j, :len(c)], "stop") for j, c in enumerate(completions)]
    local, _, _ = phases.pack_local(cfg, [prompts[j // g] for j in range(len(done))], done, adv,
                                    0, 1, np.zeros(0))
    trainer = Trainer(cfg, policy, params, mesh, tx=optax.sgd(lr))
    return trainer, local, ref, initial, behaviour


@pytest.mark.parametrize("algo,gather", [("grpo", "auto"), ("gspo-token", "auto"),
                                         ("gspo-token", "false")])
def test_off_policy_update_equals_tunix(algo, gather):
    """Off-policy (old logps = behaviour logps that differ from the current ones, so ratios
    leave 1 and some clip): the loss and gradient equal Tunix's grpo_loss_fn with
    old_per_token_logps, leaf by leaf, to 1e-5; in the flat step and in the sharded one."""
    lr = 1e6  # (initial - final) / lr is the applied gradient, kept precise
    cfg = _cfg(loss_algo=algo, fsdp_gather_params_once=gather)
    trainer, local, ref, initial, behaviour = _setup(cfg, lr, noise=0.3)
    got = trainer.step(local, off_policy=True)
    ref_loss, ref_grads = ref.grads(behaviour)
    _, on_policy_grads = ref.grads(None)
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    assert_applied(initial, trainer.params, ref_grads, lr)
    # The ratio mattered: off-policy is not the on-policy update here.
    assert any(not np.allclose(want, on_policy_grads[key], rtol=1e-3, atol=1e-6)
               for key, want in ref_grads.items())


@pytest.mark.parametrize("algo", ["grpo", "gspo-token"])
def test_num_iterations_equals_tunix(algo):
    """num_iterations=2 with behaviour logps = the rollout weights' own (as the engine's are):
    Tunix's two updates on the same batch against those old logps (its first has ratio 1)."""
    lr = 0.5
    cfg = _cfg(loss_algo=algo, num_iterations=2)
    trainer, local, ref, initial, behaviour = _setup(cfg, lr, noise=0.0)
    watchdog = topology.Watchdog(0, 300.0)
    train = phases.TrainPhase(trainer, watchdog, cfg.num_iterations)
    result = train(local, rows_per_device=local["tokens"].shape[0])
    assert result.applied == 2 and result.metrics["finite"] == 1.0 and result.compiled

    want, on_policy = dict(initial), dict(initial)
    for i in range(2):
        ref.load(want)
        _, grads = ref.grads(behaviour)
        if i == 1:
            _, on_grads = ref.grads(None)
            on_policy = {k: want[k] - lr * on_grads[k] for k in want}
        want = {k: want[k] - lr * grads[k] for k in want}
    final = _flat(trainer.params)
    moved_apart = 0.0
    for key in want:
        np.testing.assert_allclose(final[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
        moved_apart = max(moved_apart, float(np.abs(want[key] - on_policy[key]).max()))
    assert moved_apart > 1e-4  # the second update is off-policy, not a repeat of the first


def test_importance_ratio_is_one_on_unchanged_weights():
    """The engine's logprobs of a real decode, packed as old_logps, against the trainer's
    logprobs recomputed on the same float32 weights: ratio 1 within 1e-6, token and sequence
    (gspo-token) level, at a temperature that is not 1."""
    cfg = _cfg(decode_sampling_temperature=0.7, max_target_length=16)
    mesh = topology.trainer_mesh(topology.current())
    model = models.create_model(models.model_config(cfg, VOCAB), 5, mesh)
    policy, params = qwen3_policy(model)
    engine = JaxEngine(models.model_config(cfg, VOCAB, for_sampling=True),
                       topology.current().local_devices, pad_id=0, eos_ids=(2,),
                       max_prompt_length=cfg.max_prefill_predict_length,
                       max_new_tokens=cfg.max_completion_length)
    Publisher(mesh, single_call=True).publish(policy.to_engine_params(params), engine)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, rng.integers(2, 5)).astype(np.int32) for _ in range(8)]
    done = engine.generate(prompts, SamplingParams(cfg.max_completion_length, temperature=0.7),
                           seed=11)
    seqs = stepmath.sequences(prompts, done, np.ones(len(done), np.float32))
    rows = packing.pack(seqs, cfg.max_target_length, 0)
    local = stepmath.local_batch(rows, rows.num_rows, 1, 0, cfg.loss_agg_mode, len(seqs),
                                 stepmath.completion_tokens(seqs))
    batch = {k: jnp.asarray(v) for k, v in local.items()}
    logits = policy.forward(policy.model(params), batch["tokens"],
                            batch["positions"], batch["segment_ids"])
    logps = loss.token_logps(logits, batch["targets"], cfg.decode_sampling_temperature)
    mask = local["loss_mask"] > 0
    assert mask.sum() == sum(len(c.tokens) for c in done) > len(done)  # more than one token each
    for algo in ("grpo", "gspo-token"):
        log_ratio = loss.importance_log_ratio(logps, batch, off_policy=True, loss_algo=algo)
        ratio = np.asarray(jnp.exp(log_ratio))[mask]
        assert np.abs(ratio - 1).max() < 1e-6, algo


def test_colocated_step_trains_num_iterations_times(tmp_path):
    """The colocated runtime, in this process: each step's batch gets num_iterations optimizer
    updates (AdamW's count), the on- and the off-policy program compiled once each."""
    from tunix_mcjax.runtime.colocated import ColocatedRuntime

    cfg = load_config(REPO / "recipes/cpu/demo.yml", [
        *TINY, "steps=1", "batch_size=2", "num_generations=2", "num_iterations=3",
        f"base_output_directory={tmp_path}", "run_name=mu"])
    rt = ColocatedRuntime(cfg, topology.current())
    summary = rt.run()
    counts = {int(x) for x in jax.tree.leaves(rt.trainer.opt_state) if np.ndim(x) == 0}
    assert counts == {3}  # every scalar of the optimizer state is its update count
    assert rt.trainer.compile_count == 2
    assert summary["steps"] == 1 and summary["nonfinite_steps"] == 0
