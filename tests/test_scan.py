"""The jax engine scans its layers: one layer body in its program whatever the depth, a stacked
pool written and read in place at (layer, page, slot), and weights held stacked."""

from tests.mp import force_cpu_devices

force_cpu_devices(2)

import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

from tests.test_paged import combined_layer, ragged_case, split_layer  # noqa: E402
from tunix_mcjax import config, models  # noqa: E402
from tunix_mcjax.engine import paged_attention as pa  # noqa: E402
from tunix_mcjax.engine.base import SamplingParams  # noqa: E402
from tunix_mcjax.engine.jax_engine import JaxEngine, flatten_tree  # noqa: E402
from tunix_mcjax.engine.qwen3_forward import PagedRows  # noqa: E402
from tunix_mcjax.train import lora  # noqa: E402

VOCAB = 64
LAYERS = 3


def stacked(layout, per_layer: list):
    """Per-layer pools stacked into the layout's engine pool."""
    axis = 1 if isinstance(layout, pa.SplitPages) else 0
    return jax.tree.map(lambda *x: jnp.stack(x, axis=axis), *per_layer)


def layer_pools(page_size: int):
    """(ragged case, each of LAYERS layers' pages: the case's pages, scaled per layer)."""
    case, (pool_k, pool_v) = ragged_case(page_size)
    return case, [(pool_k * (i + 1), pool_v * (1 - i)) for i in range(LAYERS)]


@pytest.mark.parametrize("layout", [pa.SplitPages(), pa.GpuPages(interpret=True),
                                    pa.CombinedPages()], ids=["split", "gpu", "combined"])
def test_a_layer_of_the_stacked_pool_attends_as_its_own_pages(layout):
    """Layer l of the stacked pool gives exactly what layer l's pages alone give, on ragged
    rows, decode rows with shared prefixes and (GpuPages) the kernel's decode path."""
    (q, _, _, tables, kv_lens, q_lens), layers = layer_pools(4)
    as_layer = combined_layer if isinstance(layout, pa.CombinedPages) else split_layer
    per_layer = [as_layer(*pair) for pair in layers]
    pool = stacked(layout, per_layer)
    decode_q, decode_lens = q[:, :1], jnp.minimum(q_lens, 1)
    attend = jax.jit(layout.attend)
    for index in range(LAYERS):  # the layers differ by far more than float rounding
        if not isinstance(layout, pa.CombinedPages):  # its attend needs a TPU
            want = attend(q, per_layer[index], tables, kv_lens, q_lens)
            got = attend(q, pool, tables, kv_lens, q_lens, layer=index)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
            want = attend(decode_q, per_layer[index], tables, kv_lens, decode_lens)
            got = attend(decode_q, pool, tables, kv_lens, decode_lens, layer=jnp.int32(index))
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        want = layout.sequences(per_layer[index], tables, tables.shape[1])
        got = layout.sequences(pool, tables, tables.shape[1], layer=jnp.int32(index))
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("layout", [pa.SplitPages(), pa.CombinedPages()],
                         ids=["split", "combined"])
def test_a_write_lands_in_its_layer_only_and_a_page_copies_in_every_layer(layout):
    pool = layout.empty(8, 4, 2, 16, jnp.float32, layers=LAYERS)
    k = jnp.ones((1, 1, 2, 16)) * jnp.arange(16.0)
    write = jax.jit(layout.write)
    pool = write(pool, jnp.array([[5]]), jnp.array([[2]]), k, -k, layer=jnp.int32(1))
    tables = jnp.array([[5]])
    for index in range(LAYERS):
        got_k, got_v = layout.sequences(pool, tables, 1, layer=index)
        want = k[0, 0] if index == 1 else jnp.zeros(16)
        np.testing.assert_array_equal(got_k[:, 0, 2], jnp.broadcast_to(want, (2, 16)))
        np.testing.assert_array_equal(got_v[:, 0, 2], -jnp.broadcast_to(want, (2, 16)))
    dropped = write(pool, jnp.array([[8]]), jnp.array([[0]]), k, k, layer=0)  # page 8: padding
    for before, after in zip(jax.tree.leaves(pool), jax.tree.leaves(dropped), strict=True):
        np.testing.assert_array_equal(after, before)
    pool = write(pool, jnp.array([[5]]), jnp.array([[3]]), 2 * k, k, layer=2)
    copied = layout.copy_page(pool, jnp.array([5]), jnp.array([7]))
    for index in range(LAYERS):
        for w, g in zip(layout.sequences(pool, tables, 1, layer=index),
                        layout.sequences(copied, jnp.array([[7]]), 1, layer=index), strict=True):
            np.testing.assert_array_equal(g, w)


# ----- the engine's weights and program ------------------------------------------------------


def model_config(layers: int):
    cfg = config.load_config(None, [f"base_num_decoder_layers={layers}"])
    return models.model_config(cfg, vocab_size=VOCAB, for_sampling=True)


def engine_of(layers: int, seed: int = 0):
    mc = model_config(layers)
    engine = JaxEngine(mc, jax.devices()[:1], pad_id=0, eos_ids=(1,), max_prompt_length=8,
                       max_new_tokens=4)
    engine.load_weights(nnx.to_pure_dict(nnx.state(models.create_model(mc, seed), nnx.Param)))
    return engine


def test_weights_are_held_stacked_and_read_back_per_layer():
    engine = engine_of(LAYERS)
    want = flatten_tree(nnx.to_pure_dict(nnx.state(models.create_model(model_config(LAYERS), 0),
                                                   nnx.Param)))
    program_tree = flatten_tree(engine._tree(engine._params[0]))
    q = program_tree[("layers", "attn", "q_proj", "w")]
    assert q.shape == (LAYERS, *want[("layers", "0", "attn", "q_proj", "w")].shape)
    assert not any(path[1].isdigit() for path in program_tree if path[0] == "layers")
    got = flatten_tree(engine.weights())
    assert got.keys() == want.keys()
    for path, leaf in want.items():
        np.testing.assert_array_equal(got[path], leaf)
    # A later load of one layer's leaf (a partial publish) replaces that layer only.
    engine.load_weights({"layers": {"1": {"attn": {"q_proj": {"w": 2 * want[
        ("layers", "1", "attn", "q_proj", "w")]}}}}})
    q = flatten_tree(engine._tree(engine._params[0]))[("layers", "attn", "q_proj", "w")]
    for index in range(LAYERS):
        leaf = want[("layers", str(index), "attn", "q_proj", "w")]
        np.testing.assert_array_equal(q[index], 2 * leaf if index == 1 else leaf)


def lowered_forward(layers: int) -> str:
    """The StableHLO of the engine's model call over a decode batch, at `layers` layers."""
    engine = engine_of(layers)
    model = engine._replica_model(0)
    rows, width = 4, 2
    pool = model.empty_pool(16, 4)
    call = PagedRows(tokens=jnp.ones((rows, 1), jnp.int32), positions=jnp.ones((rows, 1),
                                                                                jnp.int32),
                     write_pages=jnp.zeros((rows, 1), jnp.int32),
                     write_offsets=jnp.ones((rows, 1), jnp.int32),
                     tables=jnp.zeros((rows, width), jnp.int32),
                     kv_lens=jnp.full((rows,), 2, jnp.int32), q_lens=jnp.ones((rows,), jnp.int32),
                     logit_cols=jnp.zeros((rows,), jnp.int32))
    params = engine._tree(engine._params[0])
    return jax.jit(model.forward).lower(params, pool, call).as_text()


def test_the_program_holds_one_layer_body_whatever_the_depth():
    """At 2 and 6 layers the model call lowers to the same ops: the layers are scanned, not
    unrolled (unrolled, the matmuls and the text grow with the depth)."""
    shallow, deep = lowered_forward(2), lowered_forward(6)
    def dots(text):
        return len(re.findall(r"stablehlo\.dot_general", text))
    assert dots(shallow) == dots(deep) > 7  # q, k, v, o, gate, up, down and attention
    assert abs(len(deep) - len(shallow)) < 0.02 * len(shallow)


def test_lora_adapters_on_some_layers_decode_as_the_trainers_forward():
    """Adapters on layer 1's q and down projections only (nonzero B): the engine stacks them
    with zeros in the other layers, and its greedy tokens are the argmax of the trainer's own
    forward (`qwen3_policy`, equal to Tunix's LoRA model: test_lora) at every step."""
    from tunix_mcjax.train.trainer import qwen3_policy

    cfg = config.load_config(None, [f"base_num_decoder_layers={LAYERS}", "lora_rank=4",
                                    "lora_alpha=8", "lora_module_path=layers/1/.*(q|down)_proj"])
    mc = models.model_config(cfg, vocab_size=VOCAB, for_sampling=True)
    model = lora.add_adapters(models.create_model(mc, 0))
    for i, (_, v) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))):
        v.set_value(jax.random.normal(jax.random.key(i), v.get_value().shape) * 0.3)
    engine = JaxEngine(mc, jax.devices()[:1], pad_id=0, eos_ids=(1,), max_prompt_length=8,
                       max_new_tokens=4)
    engine.load_weights(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    greedy = SamplingParams(max_new_tokens=4, greedy=True, ignore_eos=True)
    prompt = [5, 9, 3]
    (out,) = engine.generate([prompt], greedy, seed=0)
    seq = jnp.array([prompt + out.tokens.tolist()], jnp.int32)
    policy, _ = qwen3_policy(model)
    logits = np.array(policy.forward(model, seq, jnp.arange(seq.shape[1])[None],
                                       jnp.ones_like(seq)))[0, len(prompt) - 1:-1]
    want = jax.nn.log_softmax(logits)[np.arange(len(out.tokens)), out.tokens]
    logits[:, 0] = -np.inf  # pad is never sampled
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    np.testing.assert_allclose(out.logprobs, want, atol=1e-4)


def test_the_trainers_stacks_load_as_they_are():
    """The trainer's stacked tree (LoRA on layer 1: the layers' runs 0, 1, 2..) loads into the
    engine without unstacking: every layer reads back as Tunix's tree has it, a stack of every
    layer is the trainer's own buffer, and a later per-layer load leaves the trainer's intact."""
    from tunix_mcjax.engine.trees import unflatten_tree
    from tunix_mcjax.train import layer_runs

    cfg = config.load_config(None, [f"base_num_decoder_layers={LAYERS}", "lora_rank=4",
                                    "lora_alpha=8", "lora_module_path=layers/1/.*q_proj"])
    mc = models.model_config(cfg, vocab_size=VOCAB, for_sampling=True)
    model = lora.add_adapters(models.create_model(mc, 0))
    per_layer = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    stacks = nnx.to_pure_dict(layer_runs.stack(nnx.state(model, nnx.Param)))
    assert sorted(stacks["layers"]) == ["from_0", "from_1", "from_2"]
    base = {path: x for path, x in flatten_tree(per_layer).items() if "lora" not in path[-1]}
    whole = layer_runs.stack(unflatten_tree(base))  # no adapters: one run of every layer
    assert list(whole["layers"]) == ["from_0"]
    engine = JaxEngine(mc, jax.devices()[:1], pad_id=0, eos_ids=(1,), max_prompt_length=8,
                       max_new_tokens=4)
    engine.load_weights(stacks)
    got, want = flatten_tree(engine.weights()), flatten_tree(per_layer)
    assert got.keys() == want.keys()
    for path, leaf in want.items():
        np.testing.assert_array_equal(got[path], leaf)
    engine.load_weights(whole)
    k = whole["layers"]["from_0"]["attn"]["k_proj"]["w"]
    held = engine._params[0].tree()["layers"]["attn"]["k_proj"]["w"]
    assert held.unsafe_buffer_pointer() == k.unsafe_buffer_pointer()
    before = np.asarray(k)
    engine.load_weights({"layers": {"1": {"attn": {"k_proj": {"w": 2 * before[1]}}}}})
    np.testing.assert_array_equal(np.asarray(k), before)
    np.testing.assert_array_equal(engine.weights()["layers"]["1"]["attn"]["k_proj"]["w"],
                                  2 * before[1])


# ----- the trainer's step ----------------------------------------------------------------------


def lowered_train_step(layers: int, overrides: list[str]) -> str:
    """The StableHLO of the trainer's step (`Trainer.lower`, from shapes as tunix_mcjax.aot
    builds it) on the process's CPU devices, at `layers` layers."""
    import types

    from jax.sharding import AxisType, Mesh

    from tests.mp import TINY
    from tunix_mcjax.aot.programs import AbstractTrainer, abstract_policy, train_batch

    cfg = config.load_config(None, [*TINY, f"base_num_decoder_layers={layers}",
                                    "max_target_length=16", "grpo_beta=0.04", *overrides])
    mc = models.model_config(cfg, vocab_size=VOCAB)
    mesh = Mesh(np.array(jax.devices()).reshape(-1, 1), ("fsdp", "tp"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    policy, params = abstract_policy(cfg, mc, mesh)
    trainer = AbstractTrainer(cfg, policy, params, mesh, 2**30)
    layout = types.SimpleNamespace(micro_batches=trainer.micro_batches, micro_rows=1)
    return trainer.lower(train_batch(trainer, layout, cfg.max_target_length)).as_text()


@pytest.mark.parametrize("overrides", [
    ["fsdp_gather_params_once=true"], ["fsdp_gather_params_once=false", "remat_policy=full"],
    ["fsdp_gather_params_once=true", "lora_rank=4", "lora_alpha=8",
     "lora_module_path=.*(q|down)_proj"]], ids=["flat", "sharded-remat", "lora"])
def test_the_train_step_holds_one_layer_body_whatever_the_depth(overrides):
    """At 2 and 6 layers the train step lowers to the same matmuls (the policy's and the
    reference's forward and backward): its layers are scanned, not unrolled."""
    def dots(text):
        return len(re.findall(r"stablehlo\.dot_general", text))
    shallow, deep = dots(lowered_train_step(2, overrides)), dots(lowered_train_step(6, overrides))
    assert shallow == deep > 7 * 3  # 7 projections, forward and backward


def test_layers_stack_by_runs_of_the_same_tree():
    """LoRA adapters on layer 1 of 4: three runs, each stack holding its layers' leaves, and
    unstacking gives every layer back."""
    from tunix_mcjax.train import layer_runs

    plain = {"w": jnp.ones((2, 3))}
    adapted = {"w": jnp.ones((2, 3)), "w_lora_a": jnp.ones((2, 1))}
    layers = {0: plain, "1": adapted, 2: {"w": 2 * jnp.ones((2, 3))}, 3: {"w": jnp.zeros((2, 3))}}
    stacks = layer_runs.stack_layers(layers)
    assert {k: jax.tree.map(jnp.shape, s) for k, s in stacks.items()} == {
        "from_0": {"w": (1, 2, 3)}, "from_1": {"w": (1, 2, 3), "w_lora_a": (1, 2, 1)},
        "from_2": {"w": (2, 2, 3)}}
    np.testing.assert_array_equal(stacks["from_2"]["w"][:, 0, 0], [2.0, 0.0])
    back = layer_runs.unstack_layers(stacks)
    assert sorted(back) == [0, 1, 2, 3]
    for i in range(4):
        jax.tree.map(np.testing.assert_array_equal, back[i], layers[i if i in layers else str(i)])
