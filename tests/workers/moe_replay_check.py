"""Router record and replay on a patched maxtext (first on sys.path), per tiny MoE family.

    python -m tests.workers.moe_replay_check FAMILIES_JSON RL_YML \
        [test:EPS|bf16[:SCALE[:TIE]]|EPS,EPS]

`test:EPS` (the test's): the trainer's MaxText model (scanned, fp32) against an unscanned copy
of its weights with `record_routed_experts` on: the recorded indices' shape and the max |logit
difference| of the scanned forward replaying them, replaying other experts, and routing on its
own; then the maxtext engine (fp32) recording routing on routers whose experts 1 and 2 are
tied up to EPS, against the trainer's logprobs with and without replay. `bf16[:SCALE[:TIE]]`: a
bf16 engine against the trainer on the same weights, the mismatch with and without replay
(FAMILIES' lists are the test family's overrides, `dtype` among them the trainer's; SCALE the
weights' perturbation, 0.5 by default as in the tests, 0 leaves MaxText's init; TIE, when
given, ties the routers' experts 1 and 2 up to that noise, as `test:EPS` does). Prints one
"REPORT <json>" line.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning

from tunix_mcjax.maxtext import load_maxtext_config, policy

FAMILIES = json.loads(sys.argv[1])
RL_YML = sys.argv[2]


def build(args: list[str]):
    config, _ = load_maxtext_config(["", RL_YML, *args], {})
    model, mesh = policy.build_model(config, pad_id=0)
    policy.drop_rng_state(model)
    return config, model, mesh


def moe_modules(model: nnx.Module) -> list:
    from maxtext.layers.moe import RoutedMoE
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, RoutedMoE)]


def recorded(model: nnx.Module, tokens, positions) -> jax.Array:
    """[B, T, layers, k] routing of the unscanned model, from its sown intermediates."""
    for moe in moe_modules(model):
        moe.record_routed_experts = True
    model(tokens, positions, None, None, segment_ids=jnp.ones_like(tokens))
    found = sorted((tuple(map(str, p)), v.get_value())
                   for p, v in nnx.to_flat_state(nnx.pop(model, nnx.Intermediate)))
    return jnp.stack([v[0] if isinstance(v, tuple) else v for _, v in found], axis=2)


def family_report(args: list[str]) -> dict:
    config, scanned, mesh = build(args)
    _, params = nnx.split(scanned, nnx.Param)
    key = jax.random.key(1)
    for i, (_, var) in enumerate(nnx.to_flat_state(params)):
        value = var.get_value()
        var.set_value(value + 0.5 * jax.random.normal(jax.random.fold_in(key, i), value.shape))
    nnx.update(scanned, params)
    _, flat_model, _ = build([*args, "scan_layers=false"])
    from tunix_mcjax.engine.maxtext_tree import scan_plan, unstack_layers
    plan = scan_plan(config, mesh)
    scanned_flat = {tuple(str(k) for k in p)[1:]: v.get_value()  # without the adapter's "base"
                    for p, v in nnx.to_flat_state(nnx.state(scanned, nnx.Param))}
    flat = unstack_layers(scanned_flat, plan, config.param_scan_axis)
    flat_state = nnx.state(flat_model, nnx.Param)
    for p, var in nnx.to_flat_state(flat_state):
        var.set_value(flat[tuple(str(k) for k in p)[1:]])
    nnx.update(flat_model, flat_state)
    rows = mesh.devices.size
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 512, (rows, 24)), jnp.int32)
    positions = jnp.tile(jnp.arange(24, dtype=jnp.int32), (rows, 1))
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
        reference = flat_model(tokens, positions, None, None, segment_ids=jnp.ones_like(tokens))[0]
        routing = recorded(flat_model, tokens, positions)

        def scanned_logits(forced):
            return scanned(tokens, positions, None, None, segment_ids=jnp.ones_like(tokens),
                           forced_routed_experts=forced)[0]

        shifted = (routing + 1) % config.num_experts
        out = {name: float(jnp.max(jnp.abs(scanned_logits(forced) - reference)))
               for name, forced in (("own", None), ("replayed", routing), ("shifted", shifted))}
    out["shape"] = list(routing.shape)
    out["scale"] = float(jnp.max(jnp.abs(reference)))
    return out


def near_tied_routers(params: nnx.State, eps: float) -> nnx.State:
    """Each MoE router's expert 2 a copy of expert 1 (kernel and bias) plus `eps` noise on the
    kernel: where the two straddle the top-k boundary, a rounding difference between two
    forwards picks the other."""
    key = jax.random.key(7)
    for path, var in nnx.to_flat_state(params):
        names = [str(k) for k in path]
        if "gate" in names and names[-1] in ("kernel", "bias"):
            value = var.get_value()
            noise = eps * jax.random.normal(key, value[..., 1].shape, value.dtype)
            var.set_value(value.at[..., 2].set(value[..., 1] + noise * (names[-1] == "kernel")))
    return params


def trainer_logprobs(world, prompt, completion, replay: bool) -> np.ndarray:
    """The trainer's (MaxText's scanned fp32 forward) logprobs of the completion tokens."""
    sequence = np.concatenate([prompt, completion.tokens])
    rows, t = world.mesh.devices.size, len(sequence)
    tokens = jnp.asarray(np.tile(sequence, (rows, 1)), jnp.int32)
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), (rows, 1))
    forced = jnp.asarray(np.tile(completion.routing[None], (rows, 1, 1, 1))) if replay else None
    with jax.set_mesh(world.mesh), nn_partitioning.axis_rules(world.config.logical_axis_rules):
        model = nnx.merge(world.policy.graphdef, world.params)
        logits = model(tokens, positions, None, None, segment_ids=jnp.ones_like(tokens),
                       forced_routed_experts=forced)[0][0].astype(jnp.float32)
    steps = jax.nn.log_softmax(logits[len(prompt) - 1: t - 1], axis=-1)
    return np.asarray(steps)[np.arange(len(completion.tokens)), completion.tokens]


def engine_report(name: str, eps: float) -> dict:
    """The maxtext engine records routing; the trainer replays it (fp32, the same weights)."""
    from tests.test_maxtext_engine import World
    from tunix_mcjax.engine import SamplingParams

    world = World(name, record_routing=True)
    world.params = near_tied_routers(world.params, eps)
    world.engine.load_weights(policy.maxtext_tree(world.params))
    outs = world.engine.generate(world.prompts, SamplingParams(max_new_tokens=8), seed=0)
    out = {"routing_shapes": [list(o.routing.shape) for o in outs],
           "lengths": [[len(p), len(o.tokens)] for p, o in zip(world.prompts, outs, strict=True)],
           "unrun_is_minus_one": all(bool((o.routing[-1] == -1).all()) for o in outs),
           "rest_routed": all(bool((o.routing[:-1] >= 0).all()) for o in outs)}
    for replay in (False, True):
        diffs = [np.abs(trainer_logprobs(world, p, o, replay) - o.logprobs).max()
                 for p, o in zip(world.prompts, outs, strict=True)]
        out["replay" if replay else "own"] = float(max(diffs))
    return out


def bf16_report(name: str, overrides: list[str], scale: float, tie: float | None) -> dict:
    """A bf16 engine (weights and compute) against the trainer (the family's dtype) on the same
    weights, with routers near-tied up to `tie` where given: the mismatch
    |log p_trainer - log p_engine| per completion token, without and with replay."""
    from tests.test_maxtext_engine import World
    from tunix_mcjax.engine import SamplingParams
    from tunix_mcjax.engine.maxtext_engine import MaxTextEngine

    world = World(name, tuple(overrides), scale=scale)
    if tie is not None:
        world.params = near_tied_routers(world.params, tie)
    config = world.config.model_copy(update={"dtype": "bfloat16"})
    engine = MaxTextEngine(config, jax.local_devices()[:1], pad_id=0, eos_ids=(),
                           max_prompt_length=16, max_new_tokens=16, max_batch_size=8,
                           weight_dtype="bfloat16", record_routing=True)
    engine.load_weights(policy.maxtext_tree(world.params))
    prompts = [p for p in world.prompts for _ in range(4)]  # 5 prompts x 4 samples
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16), seed=0)
    out = {"tokens": int(sum(len(o.tokens) for o in outs)), "sequences": len(outs)}
    for replay in (False, True):
        delta = np.concatenate([np.abs(trainer_logprobs(world, p, o, replay) - o.logprobs)
                                for p, o in zip(prompts, outs, strict=True)])
        out["replay" if replay else "no_replay"] = {
            "mean_abs_dlogp": float(delta.mean()), "max_abs_dlogp": float(delta.max())}
    return out


MODE = sys.argv[3] if len(sys.argv) > 3 else "test:1e-5"
if MODE.startswith("bf16"):
    _, scale, tie = (*MODE.split(":"), None, None)[:3]
    report = {name: bf16_report(name, args, float(scale or 0.5), tie and float(tie))
              for name, args in FAMILIES.items()}
elif MODE.startswith("test:"):  # the patch's checks, then the engine's at one router tie
    eps = float(MODE.split(":")[1])
    report = {name: {**family_report(args), "engine": engine_report(name, eps)}
              for name, args in FAMILIES.items()}
else:  # a list of router ties to compare
    report = {f"{name}@{eps}": engine_report(name, float(eps))
              for name in FAMILIES for eps in MODE.split(",")}
print("REPORT " + json.dumps(report), flush=True)
