"""Quantized weights published from the trainer side (rl_runtime=mcjax_da with
`quantization`): the leader's host copy carries each projection already quantized, and the
rollout engine places it as it comes. It must hold what engine-side quantization of the
full-precision copy holds, and the object put must be that much smaller."""

from tests.mp import force_cpu_devices

force_cpu_devices(2)

import pickle  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests.mp import TINY  # noqa: E402
from tests.ray_local import local_ray  # noqa: E402, F401  (the module's cluster)
from tests.test_engine import VOCAB  # noqa: E402
from tests.test_quantized_rollout import GREEDY, PROMPTS, engine_of  # noqa: E402
from tunix_mcjax import config, models  # noqa: E402
from tunix_mcjax.engine import quantize  # noqa: E402
from tunix_mcjax.engine.trees import flatten_tree  # noqa: E402
from tunix_mcjax.publish import tree_bytes  # noqa: E402
from tunix_mcjax.runtime.da_cluster import Cluster  # noqa: E402
from tunix_mcjax.runtime.disaggregated import training_steps  # noqa: E402
from tunix_mcjax.runtime.ray_actors import host_copy, publish_form  # noqa: E402
from tunix_mcjax.tokenizer import load_tokenizer  # noqa: E402
from tunix_mcjax.train import layer_runs  # noqa: E402


def trainer_params(overrides: list[str]):
    """(cfg, the engine's model config, a float32 tree with its layers stacked in runs, as the
    trainers publish it, replicated over 2 devices as their gather leaves it)."""
    cfg = config.load_config(None, ["base_num_decoder_layers=3", *overrides])
    model = models.create_model(models.model_config(cfg, vocab_size=VOCAB), 0)
    tree = nnx.to_pure_dict(layer_runs.stack(nnx.state(model, nnx.Param)))
    mesh = Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    gathered = jax.device_put(tree, NamedSharding(mesh, P()))
    return cfg, models.model_config(cfg, vocab_size=VOCAB, for_sampling=True), gathered


@pytest.mark.parametrize("mode, weights", [("int8", "bfloat16"), ("fp8", "float32")])
def test_a_quantized_publish_loads_what_engine_side_quantization_holds(mode, weights):
    """The same weights in: the engine holds the same QArrays (values and scales bit for bit,
    on the same shardings) and the same leaves otherwise, whichever side quantized; an int8
    engine decodes the same greedy tokens with the same logprobs from either."""
    cfg, mc, gathered = trainer_params([f"quantization={mode}",
                                        f"rollout_weight_dtype={weights}"])
    assert publish_form(cfg) == (mode, jnp.dtype(weights))
    engine_side = engine_of(mc, host_copy(gathered), mode)
    trainer_side = engine_of(mc, host_copy(gathered, *publish_form(cfg)), mode)
    want, got = (flatten_tree(e.weights(0)) for e in (engine_side, trainer_side))
    assert got.keys() == want.keys()
    quantized = [path for path, leaf in got.items() if quantize.is_quantized(leaf)]
    assert len(quantized) == 7 * 3 and all(quantize.is_quantized(want[p]) for p in quantized)
    for path, leaf in want.items():
        for a, b in zip(jax.tree.leaves(got[path]), jax.tree.leaves(leaf), strict=True):
            assert a.dtype == b.dtype and a.sharding == b.sharding, path
            np.testing.assert_array_equal(a, b, err_msg=str(path))
    if mode == "int8":  # one engine, so one compile: its own quantization, then the publish's
        before = engine_side.generate(PROMPTS[:8], GREEDY, 0)
        engine_side.load_weights(host_copy(gathered, *publish_form(cfg)))
        after = engine_side.generate(PROMPTS[:8], GREEDY, 0)
        for a, b in zip(before, after, strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_the_put_object_takes_a_byte_a_value_plus_scales():
    """int8 from bfloat16: each projection takes a byte a value and 4 bytes an output channel
    (about half of bf16's bytes at this width), the embedding and norms stay bf16; the pickled
    object (Ray serializes by pickle 5) is that size."""
    cfg, _, gathered = trainer_params(["quantization=int8", "rollout_weight_dtype=bfloat16"])
    as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), gathered)
    full, published = host_copy(as_bf16), host_copy(gathered, *publish_form(cfg))
    projections = [path for path, leaf in flatten_tree(published).items()
                   if quantize.is_quantized(leaf)]
    flat_full = flatten_tree(full)
    for path, leaf in flatten_tree(published).items():
        shape = flat_full[path].shape
        want = quantize.weight_bytes(path, shape, 2, "int8")
        assert tree_bytes(leaf) == want, path
        if path in projections:
            assert want < 0.54 * flat_full[path].nbytes
    ratio = tree_bytes(published) / tree_bytes(full)
    projection_bytes = sum(flat_full[p].nbytes for p in projections)
    print(f"published {tree_bytes(published)} B of bf16's {tree_bytes(full)} ({ratio:.3f}); "
          f"projections {projection_bytes} B of them")
    assert ratio < 1 - 0.46 * projection_bytes / tree_bytes(full)
    pickled = len(pickle.dumps(published, protocol=5))
    assert tree_bytes(published) <= pickled < tree_bytes(published) + 16384


def test_a_publish_casts_only_where_it_narrows():
    """bf16 trainer weights for a float32 engine: the embedding goes as bf16 (the engine's cast
    up is exact), a projection is quantized from its float32 cast, as the engine would."""
    table = jax.random.normal(jax.random.key(0), (8, 4), jnp.bfloat16)
    kept = quantize.host_leaf(("embedder", "input_embedding"), table, "int8", jnp.float32)
    assert kept.dtype == jnp.bfloat16
    np.testing.assert_array_equal(kept, table)
    path = ("layers", "0", "mlp", "up_proj", "kernel")
    got = quantize.host_leaf(path, table, "int8", jnp.float32)
    want = quantize.quantize_leaf(path, jax.device_put(table.astype(jnp.float32), NamedSharding(
        Mesh(np.array(jax.devices()[:1]), ("tp",)), P())), "int8")
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_leaf_quantized_otherwise_is_refused_by_name():
    """A QArray of another mode, or for an engine that does not quantize, is refused naming the
    param and the key (never placed as if it fitted)."""
    cfg, mc, gathered = trainer_params(["quantization=int8"])
    published = host_copy(gathered, *publish_form(cfg))
    for mode in ("fp8", ""):
        with pytest.raises(ValueError, match=rf"param layers/\S+ arrives quantized to int8.*"
                                             rf"quantization='{mode}'"):
            engine_of(mc, published, mode)


def engine_bytes(cfg) -> tuple[int, int, int]:
    """(bytes of the engine's param tree for `cfg`'s model in its weight dtype, of its
    projections, of the tree with its projections under `cfg.quantization`)."""
    from tunix.models.qwen3 import model as qwen3

    vocab = len(load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path))
    mc = models.model_config(cfg, vocab, for_sampling=True)
    state = nnx.state(nnx.eval_shape(lambda: qwen3.Qwen3(mc, rngs=nnx.Rngs(0))), nnx.Param)
    leaves = flatten_tree(nnx.to_pure_dict(state)).items()
    full = sum(leaf.size * leaf.dtype.itemsize for _, leaf in leaves)
    projections = sum(leaf.size * leaf.dtype.itemsize for path, leaf in leaves
                      if quantize.contracted_axes(path) is not None)
    return full, projections, sum(quantize.weight_bytes(
        path, leaf.shape, leaf.dtype.itemsize, cfg.quantization) for path, leaf in leaves)


def test_da_run_puts_quantized_weights_and_in_flight_updates_load_them(tmp_path):
    """rl_runtime=mcjax_da, 1 trainer + 1 rollout host, int8 from float32 weights: every
    publish puts the engine's int8 tree (the projections at a byte a value plus a float32 scale
    an output channel: 28% of their float32 bytes at this width), and with in-flight updates
    batch 1 takes v1 mid-decode through the same load: completions mixing two versions."""
    cfg = config.load_config(None, [
        *TINY, "batch_size=4", "num_generations=4", "rl_runtime=mcjax_da", "steps=2",
        "quantization=int8", "in_flight_weight_updates=true", "in_flight_update_iterations=1",
        f"base_output_directory={tmp_path}"])
    cluster = Cluster.start(cfg, hosts=2, devices_per_host=1)
    try:
        records = [r.values for r in training_steps(cfg, cluster)]
    finally:
        cluster.close()
    full, projections, quantized = engine_bytes(cfg)
    print(f"put {quantized} B a version against {full} B in float32")
    assert [r["publish_bytes"] for r in records] == [quantized] * 2
    assert quantized - (full - projections) < 0.3 * projections
    assert [r["batch_versions"] for r in records] == [[0], [0]]
    assert records[1]["mixed_completions"] > 0
    assert all(np.isfinite(r["reward_mean"]) for r in records)


def test_an_unquantized_publish_goes_in_the_engines_narrower_dtype():
    """A float32 trainer, a bf16 jax engine, no quantization: the put holds bf16 (half the
    bytes), each leaf the very bf16 the engine's load casts from float32 (so it holds the
    same); LoRA's adapters and other engines' trees go as the trainer holds them."""
    cfg, _, gathered = trainer_params(["rollout_weight_dtype=bfloat16"])
    assert publish_form(cfg) == ("", jnp.dtype(jnp.bfloat16))
    full, published = host_copy(gathered), host_copy(gathered, *publish_form(cfg))
    assert tree_bytes(published) * 2 == tree_bytes(full)
    for path, leaf in flatten_tree(published).items():
        assert leaf.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(leaf, np.asarray(flatten_tree(full)[path], jnp.bfloat16))
    for keys in (["lora_rank=4"], ["rollout_engine=maxtext"]):
        other = config.load_config(None, ["rollout_weight_dtype=bfloat16", *keys])
        assert publish_form(other) == ("", None), keys
