"""The maxtext engine: MaxText's own model over our page pool, under our paged decode loop.

Per family (tiny shapes, CPU kernels), the engine decodes the trainer's own param tree; its
greedy tokens are the argmax of MaxText's full forward (the trainer's policy forward) at every
step, and its logprobs are that forward's log-softmax of the sampled token."""

from __future__ import annotations

import collections
import functools
import json
import re

from tests.mp import force_cpu_devices

force_cpu_devices(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

pytest.importorskip("maxtext")

from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # noqa: E402

from tests.mp import REPO, launch_worker, read_jsonl  # noqa: E402
from tests.weights import perturbed  # noqa: E402
from tunix_mcjax.config import ConfigError, load_config  # noqa: E402
from tunix_mcjax.engine import SamplingParams, maxtext_engine, maxtext_model, maxtext_tpu  # noqa: E402
from tunix_mcjax.engine import paged_attention as pa  # noqa: E402
from tunix_mcjax.engine.maxtext_engine import MaxTextEngine  # noqa: E402
from tunix_mcjax.engine.maxtext_tpu import MOE_MLP_AXIS, MOE_UP_KERNELS  # noqa: E402
from tunix_mcjax.engine.trees import flatten_tree  # noqa: E402
from tunix_mcjax.maxtext import config_map, load_maxtext_config, policy  # noqa: E402
from tunix_mcjax.publish import Publisher  # noqa: E402
from tunix_mcjax.runtime import phases  # noqa: E402

RL_YML = f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml"
CPU = ["weight_dtype=float32", "dtype=float32", "hardware=cpu", "attention=dot_product",
       "megablox=false", "sparse_matmul=false", "convert_checkpoint_if_possible=false",
       "vocab_size=512", "log_config=false", "max_prefill_predict_length=16",
       "max_target_length=64"]
SMALL = ["override_model_config=true", "base_emb_dim=64", "base_num_query_heads=4",
         "base_num_kv_heads=2", "head_dim=16"]
MOE = ["base_mlp_dim=64", "base_moe_mlp_dim=32", "num_experts=4", "num_experts_per_tok=2"]
# Every windowed family at a window of 8 tokens, so every test decodes past it.
WINDOW = 8
FAMILIES = {
    "qwen3": ["model_name=qwen3-0.6b", *SMALL, "base_num_decoder_layers=2", "base_mlp_dim=128"],
    "qwen3_moe": ["model_name=qwen3-30b-a3b", *SMALL, *MOE, "base_num_decoder_layers=2"],
    "gpt_oss": ["model_name=gpt-oss-20b", *SMALL, *MOE, "base_num_decoder_layers=2",
                f"sliding_window_size={WINDOW}"],
    # Gemma4's layer pattern puts a global layer after five local ones.
    "gemma4": ["model_name=gemma4-26b", *SMALL, *MOE, "base_num_decoder_layers=6",
               "global_head_dim=32", "global_num_kv_heads=1", f"sliding_window_size={WINDOW}"],
    # As MaxText's gemma4-26b RL recipe runs it.
    "gemma4_unscanned": ["model_name=gemma4-26b", *SMALL, *MOE, "base_num_decoder_layers=6",
                         "global_head_dim=32", "global_num_kv_heads=1",
                         f"sliding_window_size={WINDOW}", "scan_layers=false"],
    # E4B: per-layer inputs and a KV-shared last layer (its donor is layer 4); no scan.
    "gemma4_small": ["model_name=gemma4-e4b", *SMALL, "base_num_decoder_layers=7",
                     "global_head_dim=32", "base_mlp_dim=64", f"sliding_window_size={WINDOW}",
                     "hidden_size_per_layer_input=16", "vocab_size_per_layer_input=512",
                     "num_kv_shared_layers=1", "scan_layers=false"],
}
FAST = ("qwen3", "qwen3_moe")
PROMPT_LENS = (3, 9, 5, 16, 4)  # five requests through two rows: continuous batching
MAX_NEW = 8


def family_params(name: str) -> list:
    marks = [] if name in FAST else [pytest.mark.bench]  # minutes each on CPU
    return [pytest.param(name, marks=marks, id=name)]


ALL = [p for name in FAMILIES for p in family_params(name)]


class World:
    """One family: the trainer's MaxText model and params, and an engine on one local device."""

    def __init__(self, name: str, overrides: tuple[str, ...] = (), scale: float = 0.5,
                 **engine_kwargs):
        self.name = name
        keys = {o.split("=")[0] for o in overrides}
        args = [a for a in (*FAMILIES[name], *CPU) if a.split("=")[0] not in keys]
        self.config, _ = load_maxtext_config(["", RL_YML, *args, *overrides], {})
        model, self.mesh = policy.build_model(self.config, pad_id=0)
        self.policy, params = policy.maxtext_policy(model, self.config)
        self.params = perturbed(params, seed=1, scale=scale)
        engine_kwargs = {"max_prompt_length": 16, "max_new_tokens": MAX_NEW,
                         "max_batch_size": 2, **engine_kwargs}
        self.engine = MaxTextEngine(self.config, jax.local_devices()[:1], pad_id=0,
                                    eos_ids=(), **engine_kwargs)
        self.engine.load_weights(policy.maxtext_tree(self.params))
        rng = np.random.default_rng(0)
        self.prompts = [rng.integers(1, 512, n).astype(np.int32) for n in PROMPT_LENS]

    def logits(self, sequence: np.ndarray, params: nnx.State | None = None) -> np.ndarray:
        """MaxText's full forward (the trainer's) on one sequence: fp32 logits [T, V]."""
        rows = len(self.mesh.devices.flat)  # one row per fsdp device
        t = len(sequence)
        tokens = jnp.asarray(np.tile(sequence, (rows, 1)), jnp.int32)
        positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), (rows, 1))
        with jax.set_mesh(self.mesh):
            model = nnx.merge(self.policy.graphdef, params or self.params)
            out = self.policy.forward(model, tokens, positions, jnp.ones_like(tokens))
        return np.asarray(out[0])

    def check_against_forward(self, prompt, completion, temperature=1.0, params=None):
        """Returns the full forward's per-step logits; asserts the logprobs match them."""
        n = len(completion.tokens)
        logits = self.logits(np.concatenate([prompt, completion.tokens]), params)
        steps = logits[len(prompt) - 1: len(prompt) - 1 + n]
        logprobs = jax.nn.log_softmax(steps / temperature, axis=-1)
        np.testing.assert_allclose(completion.logprobs,
                                   np.asarray(logprobs)[np.arange(n), completion.tokens],
                                   atol=1e-4, rtol=0)
        return steps


def assert_greedy(tokens: np.ndarray, steps: np.ndarray) -> None:
    """Each greedy token is the forward's argmax over the tokens the engine may sample: pad
    (id 0 here, not an EOS id) never is."""
    allowed = np.asarray(steps).copy()
    allowed[:, 0] = -np.inf
    np.testing.assert_array_equal(tokens, np.argmax(allowed, axis=-1))


_WORLDS: dict[str, World] = {}


@pytest.fixture
def world(request) -> World:
    """One World per family, built once: the default suite's (FAST) stay, a slow family's
    programs are dropped when another family is built."""
    name = request.param
    if name not in _WORLDS:
        for other in [n for n in _WORLDS if n not in FAST]:
            del _WORLDS[other]
        _WORLDS[name] = World(name)
    return _WORLDS[name]


GREEDY = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)


@pytest.mark.parametrize("world", ALL, indirect=True)
def test_greedy_decode_is_the_full_forwards_argmax(world):
    outs = world.engine.generate(world.prompts, GREEDY, seed=0)
    for prompt, out in zip(world.prompts, outs, strict=True):
        assert len(out.tokens) == MAX_NEW and out.finish_reason == "length"
        steps = world.check_against_forward(prompt, out)
        assert_greedy(out.tokens, steps)
    # Every request took a row of two: five requests, so rows were refilled mid-loop.
    assert world.engine.compile_count == 1
    # A scanned tree (a uniform stack, gpt-oss's blocks of two layer kinds, Gemma4's blocks of
    # five local and one global layer) decodes by one scan over all its layers.
    scanned = world.name in ("qwen3", "qwen3_moe", "gpt_oss", "gemma4")
    assert world.engine.scanned_layers == world.config.num_decoder_layers * scanned


# Decode well past the sliding window of 8, across pages of 4 tokens, through a pool that holds
# one sequence at the caps but not two: the second row is preempted and recomputed. The first two
# requests are two samples of one prompt: they share its full pages and attend them once.
LONG_NEW, PAGE = 48, 4
WINDOWED = {"gpt_oss", "gemma4", "gemma4_unscanned", "gemma4_small"}


@pytest.mark.parametrize("world", ALL, indirect=True)
def test_long_decode_past_the_window_across_pages_and_preemption(world):
    engine = MaxTextEngine(world.config, jax.local_devices()[:1], pad_id=0, eos_ids=(),
                           max_prompt_length=16, max_new_tokens=LONG_NEW, max_batch_size=2,
                           page_size=PAGE, num_pages=24)
    engine.load_weights(policy.maxtext_tree(world.params))
    prompts = [world.prompts[1], world.prompts[1], world.prompts[0]]  # 9 tokens: 2 full pages
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=LONG_NEW, greedy=True), seed=0)
    assert sum(stats["preemptions"] for stats in engine.last_stats) > 0
    assert sum(stats["shared_pages"] for stats in engine.last_stats) > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.tokens) == LONG_NEW  # 6x the window, 12 pages and more
        steps = world.check_against_forward(prompt, out)
        assert_greedy(out.tokens, steps)
    # The windowed families decode 6x past their window (Qwen3 has none).
    assert world.config.sliding_window_size == (WINDOW if world.name in WINDOWED else 0)


@pytest.mark.parametrize("world", family_params("qwen3_moe"), indirect=True)
def test_sampled_logprobs_and_per_request_seeds(world):
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7)
    engine = world.engine
    first = engine.generate(world.prompts, sampling, seed=3)
    again = engine.generate(world.prompts, sampling, seed=3)
    other = engine.generate(world.prompts, sampling, seed=4)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert any(not np.array_equal(a.tokens, c.tokens) for a, c in zip(first, other, strict=True))
    # A request's sample depends on its index and the seed, not on the batch around it.
    [alone] = engine.generate(world.prompts[:1], sampling, seed=3)
    np.testing.assert_array_equal(alone.tokens, first[0].tokens)
    for prompt, out in zip(world.prompts, first, strict=True):
        world.check_against_forward(prompt, out, temperature=0.7)


@pytest.mark.parametrize("world", family_params("qwen3_moe"), indirect=True)
def test_moe_up_kernels_reach_the_dot_without_a_copy(world):
    """On CPU the MoE up-kernels are stored [layers, embed, experts, mlp] (layer-major, as the
    scan slices them): the decode program reads each layer's slice as its dot's [embed,
    experts * mlp] operand (a bitcast), where MaxText's [experts, embed, mlp] took a copy of
    every kernel at every step. `weights()` is MaxText's layout."""
    engine = world.engine
    engine.generate(world.prompts[:1], GREEDY, seed=0)
    moved = sorted(engine._minor_paths)
    assert [p[-1] for p in moved] == ["wi_0", "wi_1"]  # one stack each
    experts, layers, embed, mlp = engine._leaf_specs[moved[0]].shape  # MaxText's stack
    assert engine._params[0][moved[0]].shape == (layers, embed, experts, mlp)
    stored, operand = f"[{layers},{embed},{experts},{mlp}]", f"[{embed},{experts * mlp}]"
    layer, maxtext = f"[1,{embed},{experts},{mlp}]", f"[{experts},{embed},{mlp}]"
    kernel_shapes = {operand, stored, layer, maxtext}
    assert engine._programs
    for program in engine._programs.values():
        ops = collections.Counter()
        for line in program.as_text().splitlines():
            made = re.search(r"%(\S+) = \w+(\[[\d,]+\])\S* ([\w-]+)\(", line)
            if made and made[2] in kernel_shapes:
                name, op = made[1], made[3]
                moves = op in ("copy", "transpose") or (
                    op == "fusion" and ("copy" in name or "transpose" in name))
                assert not moves, line
                ops[made[2], op] += 1
        # Every up-kernel stack enters in its stored layout, and each layer's slice reaches its
        # dot as a bitcast: the scan above saw them (a format it cannot read finds none).
        assert ops[stored, "parameter"] >= len(moved), ops
        assert ops[layer, "dynamic-slice"] + ops[operand, "fusion"] >= len(moved), ops
        assert ops[operand, "bitcast"] + ops[operand, "fusion"] >= len(moved), ops
    trainer = policy.maxtext_tree(world.params)["decoder"]
    served = engine.weights()["decoder"]
    for name in MOE_UP_KERNELS:
        np.testing.assert_array_equal(served["layers"]["moe_block"][name],
                                      np.asarray(trainer["layers"]["moe_block"][name]))


@pytest.mark.parametrize("world", family_params("qwen3"), indirect=True)
def test_stop_ids_end_a_completion(world):
    [greedy] = world.engine.generate(world.prompts[:1], GREEDY, seed=0)
    stop = int(greedy.tokens[2])
    cut = int(np.argmax(greedy.tokens == stop))  # its first occurrence
    sampling = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, stop_token_ids=(stop,))
    [out] = world.engine.generate(world.prompts[:1], sampling, seed=0)
    np.testing.assert_array_equal(out.tokens, greedy.tokens[:cut + 1])
    assert out.finish_reason == "stop"
    eos_engine = MaxTextEngine(world.config, jax.local_devices()[:1], pad_id=0, eos_ids=(stop,),
                               max_prompt_length=16, max_new_tokens=MAX_NEW, max_batch_size=2)
    eos_engine.load_weights(policy.maxtext_tree(world.params))
    [out] = eos_engine.generate(world.prompts[:1], GREEDY, seed=0)
    assert out.finish_reason == "eos" and len(out.tokens) == cut + 1


@pytest.mark.parametrize("world", family_params("qwen3"), indirect=True)
def test_load_weights_changes_the_output(world):
    before = world.engine.generate(world.prompts, GREEDY, seed=0)
    compiled = world.engine.compile_count
    model, _ = policy.build_model(world.config, pad_id=0)
    _, fresh = policy.maxtext_policy(model, world.config)
    new_params = perturbed(fresh, seed=2)
    engine = world.engine
    try:
        engine.load_weights(policy.maxtext_tree(new_params))
        after = engine.generate(world.prompts, GREEDY, seed=0)
        assert any(not np.array_equal(a.tokens, b.tokens)
                   for a, b in zip(before, after, strict=True))
        for prompt, out in zip(world.prompts, after, strict=True):
            steps = world.check_against_forward(prompt, out, params=new_params)
            assert_greedy(out.tokens, steps)
        # A partial tree replaces just its leaves: the old final norm brings back other logits.
        old_norm = policy.maxtext_tree(world.params)["decoder"]["decoder_norm"]
        engine.load_weights({"decoder": {"decoder_norm": old_norm}})
        partial = engine.generate(world.prompts, GREEDY, seed=0)
        assert any(not np.array_equal(a.logprobs, p.logprobs)
                   for a, p in zip(after, partial, strict=True))
    finally:
        engine.load_weights(policy.maxtext_tree(world.params))
    assert engine.compile_count == compiled  # new weights, same programs


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 local devices")
@pytest.mark.parametrize("world", family_params("qwen3"), indirect=True)
def test_publish_loads_the_trainers_replicated_params_in_place(world):
    """As the runtime publishes: FSDP params resharded to replicated over the trainer's mesh,
    loaded under that mesh, in one call (O4) or one leaf at a time; each local device's copy
    is held layer-major on that device."""
    expected = world.engine.generate(world.prompts, GREEDY, seed=0)
    engine = MaxTextEngine(world.config, jax.local_devices()[:2], pad_id=0, eos_ids=(),
                           max_prompt_length=16, max_new_tokens=MAX_NEW, max_batch_size=2)
    assert engine.scanned_layers == 2 and engine.num_replicas == 2
    for single_call in (True, False):
        publisher = Publisher(world.mesh, single_call)
        publisher.publish(policy.maxtext_tree(world.params), engine)
        got = engine.generate(world.prompts, GREEDY, seed=0)
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
        layer = engine.weights(1)["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
        assert layer.devices() == {jax.local_devices()[1]}


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 local devices")
@pytest.mark.parametrize("world", family_params("qwen3"), indirect=True)
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)], ids=["dp2", "tp2"])
def test_replicas_and_tensor_parallelism_give_the_same_greedy_decode(world, dp, tp):
    engine = MaxTextEngine(world.config, jax.local_devices()[:2], pad_id=0, eos_ids=(),
                           max_prompt_length=16, max_new_tokens=MAX_NEW, max_batch_size=2,
                           tensor_parallelism=tp)
    assert engine.num_replicas == dp and engine.meshes[0].shape["tensor"] == tp
    engine.load_weights(policy.maxtext_tree(world.params))
    parallel = engine.generate(world.prompts, GREEDY, seed=0)
    single = world.engine.generate(world.prompts, GREEDY, seed=0)
    for a, b in zip(parallel, single, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


# --- the TPU page layout, on CPU ------------------------------------------------------------

class XlaCombinedPages(pa.CombinedPages):
    """CombinedPages' pool (its writes, page copies and page ids) attended by XLA by the
    definition that JAX's TPU kernel computes (`test_paged` checks the kernel's reference
    against it): the TPU layout on CPU. As the kernel, it has no sinks."""

    def attend(self, q, pool, tables, kv_lens, q_lens, *, prefix=None, sinks=None, layer=None,
               **options):
        if sinks is not None:
            raise NotImplementedError("no attention sinks in the TPU kernel")
        keys, values = self.sequences(pool, tables, tables.shape[1], layer)
        return pa.attend_rows(q, keys, values, kv_lens, q_lens, **options)


def engine_with_layouts(world, monkeypatch, layouts=None):
    """The world's engine on CPU with the TPU layout (`XlaCombinedPages`), as `layout_for`
    gives it on a TPU; `layouts`: {slot: layout} instead."""
    monkeypatch.setattr(maxtext_engine, "layout_for", lambda *_, **__: XlaCombinedPages())
    monkeypatch.setattr(maxtext_engine, "MaxTextPagedModel",
                        functools.partial(maxtext_model.MaxTextPagedModel, layouts=layouts))
    engine = MaxTextEngine(world.config, jax.local_devices()[:1], pad_id=0, eos_ids=(),
                           max_prompt_length=16, max_new_tokens=MAX_NEW, max_batch_size=2,
                           page_size=PAGE)
    engine.load_weights(policy.maxtext_tree(world.params))
    return engine


def assert_same_samples(world, engine, seed: int = 5):
    """Sampled completions (temperature 0.8) equal the world's all-SplitPages engine's, the
    same seed: tokens exactly, logprobs to float rounding (attention sums in another order)."""
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8)
    split = MaxTextEngine(world.config, jax.local_devices()[:1], pad_id=0, eos_ids=(),
                          max_prompt_length=16, max_new_tokens=MAX_NEW, max_batch_size=2,
                          page_size=PAGE)
    split.load_weights(policy.maxtext_tree(world.params))
    want = split.generate(world.prompts, sampling, seed=seed)
    got = engine.generate(world.prompts, sampling, seed=seed)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    for prompt, out in zip(world.prompts, got, strict=True):
        world.check_against_forward(prompt, out, temperature=0.8)


@pytest.mark.parametrize("world", family_params("qwen3"), indirect=True)
def test_a_pool_of_mixed_page_layouts_samples_as_split_pages(world, monkeypatch):
    """Unscanned, layer 0's pages in the TPU layout, layer 1's in SplitPages: the samples are
    those of an all-SplitPages pool. Scanned, one layer body writes every layer's pages, so
    their layouts must agree: mixed ones are refused."""
    mixed = {0: XlaCombinedPages(), 1: pa.SplitPages()}
    with pytest.raises(ValueError, match="give a block position's layers one layout"):
        engine_with_layouts(world, monkeypatch, mixed)
    unscanned = World("qwen3", ("scan_layers=false",))
    engine = engine_with_layouts(unscanned, monkeypatch, mixed)
    [model] = engine._models.values()
    assert [type(model.layouts[s]) for s in (0, 1)] == [XlaCombinedPages, pa.SplitPages]
    pool = engine._pool(0)
    assert pool[0].ndim == 5 and isinstance(pool[1], tuple)  # [1, P, page, 2K, H]; (k, v)
    assert_same_samples(unscanned, engine)


@pytest.mark.parametrize("world", family_params("gpt_oss"), indirect=True)
def test_gpt_oss_decodes_its_sink_layers_by_xla_on_the_tpu_layout(world, monkeypatch):
    """The TPU kernel has no attention sinks: with the TPU layout, gpt-oss's layers (each with
    sinks) keep the kernel's pages, attended by XLA (CombinedXlaPages), and sample as the
    all-SplitPages engine."""
    engine = engine_with_layouts(world, monkeypatch)
    [model] = engine._models.values()
    assert all(a.sinks for a in model.layers)
    assert all(type(layout) is maxtext_model.CombinedXlaPages
               for layout in model.layouts.values())
    assert_same_samples(world, engine)


@pytest.mark.parametrize("world", family_params("gemma4"), indirect=True)
def test_gemma4_keeps_the_tpu_layout_where_the_kernel_takes_its_heads(world, monkeypatch):
    """Layers without sinks stay on the TPU kernel's layout where their heads are the one
    width it compiles for (KERNEL_HEAD_DIM), its pages attended by XLA elsewhere
    (CombinedXlaPages), and sample as SplitPages."""
    engine = engine_with_layouts(world, monkeypatch)
    [model] = engine._models.values()
    assert not any(a.sinks for a in model.layers)
    for slot, (_, head_dim) in model.slot_shapes.items():
        fits = head_dim == pa.KERNEL_HEAD_DIM
        assert type(model.layouts[slot]) is (XlaCombinedPages if fits
                                             else maxtext_model.CombinedXlaPages)
    assert_same_samples(world, engine)


@pytest.mark.parametrize("world", family_params("qwen3_moe"), indirect=True)
def test_moe_kernels_padded_as_on_tpu_sample_as_unpadded(world, monkeypatch):
    """The expert kernels padded with zeros along mlp, as the engine holds them on TPU (here
    to lanes of 64, from 32): the samples are the unpadded engine's; `weights` gives MaxText's
    shapes back."""
    monkeypatch.setattr(maxtext_tpu, "TPU_LANES", 64)
    monkeypatch.setattr(MaxTextEngine, "PAD_MOE_PLATFORMS", ("cpu",))
    engine = MaxTextEngine(world.config, jax.local_devices()[:1], pad_id=0, eos_ids=(),
                           max_prompt_length=16, max_new_tokens=MAX_NEW, max_batch_size=2,
                           page_size=PAGE)
    engine.load_weights(policy.maxtext_tree(world.params))
    held = {path: leaf.shape for path, leaf in engine._params[0].items()
            if path[-1] in MOE_MLP_AXIS and leaf.ndim == 4}  # [layers, ...]
    assert held and all(64 in shape and 32 not in shape for shape in held.values()), held
    given = flatten_tree(engine.weights())
    assert all(given[path].shape == engine._leaf_specs[path].shape for path in held)
    assert_same_samples(world, engine)


# --- the runtime on 2 hosts with the maxtext engine --------------------------------------------

@pytest.mark.bench  # a 2-host MaxText run
def test_maxtext_components_run_on_two_hosts_with_the_maxtext_engine(tmp_path):
    """MaxText's tiny Qwen3 MoE, its data and rewards: 2 steps on 2 hosts, weights published
    into each host's maxtext engine after every update (one call, O4)."""
    lines = (REPO / "recipes/maxtext/cpu/qwen3_tiny.args").read_text().splitlines()
    recipe = [a.strip() for a in lines if a.strip() and not a.startswith("#")]
    recipe = [a for a in recipe if not a.startswith(("model_name=", "base_mlp_dim=", "num_"))]
    overrides = [*recipe, "model_name=qwen3-30b-a3b", *MOE, "megablox=false",
                 "sparse_matmul=false", "attention=dot_product", "num_batches=2",
                 "num_test_batches=0", "enable_checkpointing=false",
                 "rl_publish_weights_single_call=true", f"base_output_directory={tmp_path}"]
    res = launch_worker("tests.workers.maxtext_engine_run", RL_YML, overrides, hosts=2,
                        devices=1, timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    run_dir = tmp_path / "maxtext-qwen3-tiny"
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [0, 1]
    assert all(np.isfinite(s["loss"]) for s in steps)
    for host in (0, 1):
        facts = json.loads((run_dir / f"maxtext_adapter_host{host}.json").read_text())
        assert facts["config"]["rollout_engine"] == "maxtext"
        assert facts["modules_imported"] == {"vllm": False, "tpu_inference": False}


# --- which engine decodes which family ------------------------------------------------------

def maxtext_config(name: str, *extra: str):
    return load_maxtext_config(["", RL_YML, *FAMILIES[name], *CPU, *extra], {})[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_is_accepted_with_the_maxtext_engine(name):
    config = maxtext_config(name)
    expected = "jax" if name == "qwen3" else "maxtext"
    assert config_map.rollout_engine_for(config) == expected
    config_map.check_model(config)
    config_map.check_model(config, "maxtext")
    assert (policy.engine_model_config(config) is config) == (expected == "maxtext")


def test_what_cannot_run_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"qwen3-30b-a3b cannot run with rollout_engine=jax.*"
                                          r"decoder_block=qwen3_moe.*rollout_engine=maxtext"):
        config_map.check_model(maxtext_config("qwen3_moe"), "jax")
    llama = load_maxtext_config(["", RL_YML, "model_name=llama3.1-8b", "log_config=false"], {})[0]
    with pytest.raises(ConfigError, match=r"decoder_block=llama2\) is not supported"):
        config_map.check_model(llama)
    # Sliding windows apply by token position over pages: sequences longer than the window run.
    longer = maxtext_config("gpt_oss").model_copy(update={"max_target_length": 1024})
    config_map.check_model(longer)


def test_rollout_engine_key():
    assert set(phases.ENGINES) >= {"jax", "maxtext"}
    with pytest.raises(ConfigError, match="rl_runtime=single's lockstep baseline"):
        load_config(None, {"rollout_engine": "maxtext", "rl_runtime": "single"})
    cfg = load_config(None, {"rollout_engine": "maxtext"})
    with pytest.raises(ConfigError, match="runs under the MaxText adapter"):
        phases.default_engine(cfg, object(), jax.local_devices()[:1], 0, ())


def test_bench_maxtext_models_have_the_jax_engines_shape():
    """`bench.engine --maxtext-model`: dense Qwen3, or a MoE whose active experts have the
    dense model's MLP width between them; `--maxtext-rev` needs the maxtext arm."""
    from tunix_mcjax.bench import engine as bench

    configs = {name: load_maxtext_config(["", RL_YML, *args], {})[0]
               for name, args in bench.MAXTEXT_MODELS.items()}
    dense, moe = configs["qwen3"], configs["qwen3-moe"]
    assert (dense.num_experts, dense.mlp_dim) == (1, bench.MODEL.hidden_dim)
    assert moe.num_experts_per_tok * moe.moe_mlp_dim == bench.MODEL.hidden_dim
    assert config_map.rollout_engine_for(moe) == "maxtext"
    for config in configs.values():
        assert (config.num_decoder_layers, config.emb_dim, config.vocab_size) == (
            bench.MODEL.num_layers, bench.MODEL.embed_dim, bench.MODEL.vocab_size)
    with pytest.raises(ValueError, match="add --engine maxtext"):
        bench.run(bench.PROFILES["gsm8k-cpu"], (), maxtext_rev="HEAD")


# --- which layers the scan runs ---------------------------------------------------------------

def test_scan_layout_repeats_the_trees_block_and_leaves_the_rest_unrolled():
    """`scan_layout` of MaxText's stacked trees (`scan_plan`'s layouts): the block is the
    period of the layers' places, the blocks the layers whose first index counts them; Gemma4's
    remainder layers and an unscanned tree's layers are left to run unrolled."""
    from tunix_mcjax.engine.maxtext_scan import scan_layout

    uniform = scan_layout({i: (("decoder", "layers"), (i,)) for i in range(5)}, 5)
    assert (uniform.block, uniform.blocks, uniform.stacked) == (1, 5, {("decoder", "layers"): 1})
    kinds = scan_layout({i: (("decoder", "layers", f"layers_{i % 2}"), (i // 2,))
                         for i in range(6)}, 6)
    assert (kinds.block, kinds.blocks, kinds.scanned) == (2, 3, 6)
    local, glob, rest = (("decoder", "scanned_blocks", "local_layers"),
                         ("decoder", "scanned_blocks", "global_layer"),
                         ("decoder", "layers_remainder", "local_layers"))
    gemma4 = {i: ((local, (i // 6, i % 6)) if i % 6 < 5 else (glob, (i // 6,)))
              for i in range(12)}
    gemma4.update({12: (rest, (0,)), 13: (rest, (1,))})
    layout = scan_layout(gemma4, 14)
    assert (layout.block, layout.blocks, layout.scanned) == (6, 2, 12)
    assert layout.stacked == {local: 2, glob: 1, rest: 1}
    assert scan_layout(None, 3).blocks == 0
    shuffled = {0: (("decoder", "layers"), (1,)), 1: (("decoder", "layers"), (0,))}
    with pytest.raises(ValueError, match="is not position 0 of block 0"):
        scan_layout(shuffled, 2)


def test_a_tensor_parallel_tpu_replica_runs_the_kernel_where_its_kv_heads_split():
    """On a TPU replica of 2 devices the kernel runs on each device's kv heads: a slot of 4 kv
    heads keeps CombinedPages over the replica's "tensor" axis, one of 3 is attended by XLA."""
    from jax.sharding import Mesh

    from tunix_mcjax.engine.paged_attention import CombinedPages

    mesh = Mesh(np.array(jax.devices()[:2]), (maxtext_model.TENSOR_AXIS,))
    kernel = CombinedPages(mesh, maxtext_model.TENSOR_AXIS)
    layers = [maxtext_model._LayerAttention(slot, True, None, None, kv_heads, 128, False)
              for slot, kv_heads in ((0, 4), (1, 3))]
    layouts = maxtext_model.slot_layouts(kernel, layers)
    assert layouts[0] is kernel
    assert type(layouts[1]) is maxtext_model.CombinedXlaPages
