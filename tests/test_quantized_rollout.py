"""Quantized rollout weights (`quantization`: int8, fp8) in the jax engine, on the tiny model."""

import math

from tests.mp import force_cpu_devices

force_cpu_devices(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tests.test_engine import PAD, VOCAB, full_logits, params_of  # noqa: E402
from tunix_mcjax import config, engine_plan, models  # noqa: E402
from tunix_mcjax.activations import model_shape  # noqa: E402
from tunix_mcjax.aot.programs import engine_params  # noqa: E402
from tunix_mcjax.config import ConfigError  # noqa: E402
from tunix_mcjax.engine import quantize  # noqa: E402
from tunix_mcjax.engine.base import SamplingParams  # noqa: E402
from tunix_mcjax.engine.jax_engine import JaxEngine  # noqa: E402
from tunix_mcjax.engine.options import EngineOptions  # noqa: E402
from tunix_mcjax.engine.trees import flatten_tree, unflatten_tree  # noqa: E402
from tunix_mcjax.train import layer_runs, lora  # noqa: E402

MAX_NEW = 16
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True)
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(1, VOCAB, size=_rng.integers(2, 10)).tolist() for _ in range(32)]
# qwix's symmetric bound of each stored dtype: int8 127 + 0.5 (the top bucket used whole).
QMAX = {"int8": 127.5, "fp8": 448.0}


@pytest.fixture(scope="module")
def bf16_config():
    cfg = config.load_config(None, ["rollout_weight_dtype=bfloat16"])
    return models.model_config(cfg, vocab_size=VOCAB, for_sampling=True)


@pytest.fixture(scope="module")
def fp32_model():
    """Tunix's Qwen3 in float32: the reference forward any weights are scored with."""
    cfg = config.load_config(None)
    return models.create_model(models.model_config(cfg, vocab_size=VOCAB), 0)


@pytest.fixture(scope="module")
def params(fp32_model):
    return params_of(fp32_model)


def engine_of(mc, params, mode=""):
    engine = JaxEngine(mc, jax.devices()[:1], pad_id=PAD, eos_ids=(VOCAB - 1,),
                       max_prompt_length=16, max_new_tokens=MAX_NEW, quantization=mode)
    engine.load_weights(params)
    return engine


@pytest.fixture(scope="module")
def decoded(bf16_config, params):
    """mode -> (the engine with `quantization=mode` over bf16 weights, its greedy PROMPTS)."""
    cache = {}

    def get(mode):
        if mode not in cache:
            engine = engine_of(bf16_config, params, mode)
            cache[mode] = engine, engine.generate(PROMPTS, GREEDY, 0)
        return cache[mode]

    return get


def greedy_choices(model, weights, prompt, tokens) -> tuple[np.ndarray, np.ndarray]:
    """Tunix's forward with `weights` (float32) over prompt + tokens: (its greedy choice, pad
    excluded, and its log-softmax of `tokens`) at each of the tokens' positions."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda w: jnp.asarray(w, jnp.float32),
                                                 weights))
    nnx.update(model, state)
    logits = full_logits(model, prompt + tokens.tolist())[len(prompt) - 1: -1]
    logprobs = np.asarray(jax.nn.log_softmax(logits))[np.arange(len(tokens)), tokens]
    logits[:, PAD] = -np.inf
    return logits.argmax(-1), logprobs


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_a_projection_is_quantized_per_output_channel(mode):
    """o_proj [N, H, D] contracts N and H: one scale per (layer, output channel d), the
    channel's absmax over the largest stored value, and every value rounds within its step."""
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tp"))
    w = jax.random.normal(jax.random.key(0), (3, 4, 8, 16), jnp.float32)
    w = jax.device_put(w, NamedSharding(mesh, P(None, "tp", None, None)))
    q = quantize.quantize_leaf(("layers", "from_0", "attn", "o_proj", "w"), w, mode)
    assert q.qvalue.dtype == quantize.MODES[mode] and q.scale.shape == (3, 1, 1, 16)
    absmax = np.abs(np.asarray(w)).max(axis=(1, 2), keepdims=True)
    np.testing.assert_allclose(q.scale, absmax / QMAX[mode], rtol=1e-6)
    error = np.abs(np.asarray(quantize.dequantize(q, jnp.float32)) - np.asarray(w))
    if mode == "int8":  # a uniform grid: half a step
        assert (error <= np.asarray(q.scale) / 2 * (1 + 1e-4)).all()
    else:  # 3 mantissa bits: half an ulp, 2**-4 of the value (subnormals: a fixed step)
        assert (error <= np.abs(np.asarray(w)) / 16 + np.asarray(q.scale) * 2.0**-10).all()


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_quantized_decode_equals_the_dequantized_reference(mode, decoded, fp32_model, params):
    """Decoding from quantized weights is Tunix's float32 forward over those weights
    dequantized: the same greedy tokens, logprobs within 1e-4 (as tests/test_engine.py holds
    the float engine to)."""
    engine, completions = decoded(mode)
    weights = quantize.dequantize_tree(engine.weights(0), jnp.float32)
    up = weights["layers"]["0"]["mlp"]["up_proj"]["kernel"]
    assert not np.array_equal(up, params["layers"][0]["mlp"]["up_proj"]["kernel"])
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        choices, logprobs = greedy_choices(fp32_model, weights, prompt, completion.tokens)
        np.testing.assert_array_equal(completion.tokens, choices)
        np.testing.assert_allclose(completion.logprobs, logprobs, atol=1e-4)


@pytest.mark.parametrize("mode, least", [("int8", 0.95), ("fp8", 0.80)])
def test_greedy_with_quantized_weights_agrees_with_bf16(mode, least, decoded, fp32_model,
                                                        params):
    """Each greedy choice of the quantized engine is the bf16 engine's (Tunix's forward over
    the bf16 weights) after the same prefix on >= 95% of tokens (int8; 97.7% measured here) and
    >= 80% (fp8: 85.2%). Free-running decodes part at the first flip, and the random tiny
    model's logits are near ties: position by position they agree on 81% (int8) and 38%
    (fp8) of tokens (docs/engines.md)."""
    bf16 = jax.tree.map(lambda w: jnp.asarray(w, jnp.bfloat16), params)
    _, completions = decoded(mode)
    agree = [greedy_choices(fp32_model, bf16, prompt, c.tokens)[0] == c.tokens
             for prompt, c in zip(PROMPTS, completions, strict=True)]
    assert np.mean(agree) >= least


def test_weight_bytes_are_a_byte_a_value_plus_scales(bf16_config, params, decoded):
    """The pool budget's weight bytes are what the engine holds: int8 projections take half
    the bf16 bytes plus a float32 scale an output channel; the embedding and norms stay bf16."""
    int8, _ = decoded("int8")
    bf16_engine = engine_of(bf16_config, params)
    held = sum(leaf.nbytes for leaf in jax.tree.leaves(int8.weights(0)))
    assert int8._weight_bytes(1) == held
    assert bf16_engine._weight_bytes(1) == sum(x.nbytes for x in jax.tree.leaves(
        bf16_engine.weights(0)))
    layer = int8.weights(0)["layers"]["0"]
    gate = layer["mlp"]["gate_proj"]["kernel"]  # [D, F]
    d, f = gate.shape
    assert (gate.qvalue.nbytes, gate.scale.nbytes) == (d * f, 4 * f)
    embedding = int8.weights(0)["embedder"]["input_embedding"]
    assert embedding.dtype == jnp.bfloat16 and not quantize.is_quantized(embedding)


def test_the_trainers_stacked_runs_quantize_as_its_layers_do():
    """A publish hands the trainer's layer runs (`layers/from_<s>`, LoRA on layer 1 splits
    them in three): the engine holds the same values and scales as from per-layer leaves, the
    adapters unquantized, and a later per-layer load replaces one layer of a whole run."""
    cfg = config.load_config(None, ["base_num_decoder_layers=3", "lora_rank=4", "lora_alpha=8",
                                    "lora_module_path=layers/1/.*q_proj"])
    mc = models.model_config(cfg, vocab_size=VOCAB, for_sampling=True)
    model = lora.add_adapters(models.create_model(mc, 0))
    per_layer = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    stacks = nnx.to_pure_dict(layer_runs.stack(nnx.state(model, nnx.Param)))
    engines = [engine_of(mc, tree, "int8") for tree in (per_layer, stacks)]
    want, got = (flatten_tree(e.weights(0)) for e in engines)
    assert got.keys() == want.keys()
    for path, leaf in want.items():
        assert quantize.is_quantized(leaf) == (quantize.contracted_axes(path) is not None)
        jax.tree.map(np.testing.assert_array_equal, got[path], leaf)
    assert not quantize.is_quantized(got["layers", "1", "attn", "q_proj", "w_lora_a"])
    base = {p: x for p, x in flatten_tree(per_layer).items() if "lora" not in p[-1]}
    whole = layer_runs.stack(unflatten_tree(base))
    engines[1].load_weights(whole)
    w = per_layer["layers"][2]["mlp"]["up_proj"]["kernel"]
    engines[1].load_weights({"layers": {"2": {"mlp": {"up_proj": {"kernel": 2 * w}}}}})
    up = engines[1].weights(0)["layers"]
    np.testing.assert_array_equal(up["2"]["mlp"]["up_proj"]["kernel"].qvalue,
                                  want["layers", "2", "mlp", "up_proj", "kernel"].qvalue)
    np.testing.assert_allclose(up["2"]["mlp"]["up_proj"]["kernel"].scale,
                               2 * want["layers", "2", "mlp", "up_proj", "kernel"].scale)
    jax.tree.map(np.testing.assert_array_equal, up["0"]["mlp"]["up_proj"]["kernel"],
                 want["layers", "0", "mlp", "up_proj", "kernel"])


def test_qwen3_8b_int8_engine_weights_are_at_most_55_percent_of_bf16():
    """The planner's engine-weight term (the pool budget's) at Qwen3-8B's shape, equal to the
    bytes of the param tree the AOT command compiles the engine over (`aot.programs`)."""
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tp"))

    def engine_bytes(mode):
        cfg = config.load_config(None, ["model_name=qwen3-8b", "rollout_weight_dtype=bfloat16",
                                        f"quantization={mode}"])
        mc = models.model_config(cfg, vocab_size=0, for_sampling=True)
        planned = engine_plan.engine_weight_bytes(cfg, model_shape(mc, 1))
        tree = engine_params(mc, mesh, mode)
        assert planned == sum(math.prod(x.shape) * x.dtype.itemsize
                              for x in jax.tree.leaves(tree))
        return planned

    assert engine_bytes("int8") / engine_bytes("") <= 0.55  # 53.8%
    assert engine_bytes("fp8") == engine_bytes("int8")


def test_refusals_name_the_key():
    """The engines of our decode loop quantize (the maxtext engine refuses families it does not
    cover by name: tests/test_maxtext_quantized.py); vLLM does not."""
    assert config.load_config(None, ["quantization=int8", "rollout_engine=maxtext"]
                              ).quantization == "int8"
    with pytest.raises(ConfigError, match="quantization=fp8: rollout_engine=vllm"):
        config.load_config(None, ["quantization=fp8", "rollout_engine=vllm",
                                  "rl_publish_weights_single_call=true"])
    with pytest.raises(ConfigError, match="quantization"):
        config.load_config(None, ["quantization=int4"])
    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineOptions(pad_id=0, eos_ids=(1,), max_prompt_length=4, max_new_tokens=4,
                      quantization="int4")
