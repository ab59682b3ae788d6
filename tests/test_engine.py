"""JaxEngine against Tunix's own Qwen3 forward, on a tiny random-init model (CPU, 2 devices)."""

from tests.mp import force_cpu_devices

force_cpu_devices(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from tunix_mcjax import config, models  # noqa: E402
from tunix_mcjax.engine.base import SamplingParams  # noqa: E402
from tunix_mcjax.engine.jax_engine import JaxEngine  # noqa: E402
from tunix_mcjax.engine.keys import replica_keys  # noqa: E402
from tunix_mcjax.engine.sampling import SamplerSpec, sample  # noqa: E402

VOCAB = 99
PAD = 0
MAX_NEW = 8
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [40, 41, 42, 43], [20, 21], [60, 61, 62]]
SAMPLE = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True)

two_devices = pytest.mark.skipif(
    len(jax.devices()) < 2, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2"
)


REFERENCE_LEN = 32


@nnx.jit
def _tunix_forward(model, tokens):
    n = tokens.shape[1]
    causal = jnp.tril(jnp.ones((1, n, n), bool))
    logits, _ = model(tokens, jnp.arange(n)[None], None, causal)
    return logits[0]


def full_logits(model, seq) -> np.ndarray:
    """Tunix's full causal forward (no cache) over one sequence: fp32 logits [len, V]."""
    tokens = np.full((1, REFERENCE_LEN), PAD, np.int32)
    tokens[0, : len(seq)] = seq  # right padding does not change earlier positions
    return np.array(_tunix_forward(model, jnp.asarray(tokens)))[: len(seq)]


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def model_config():
    return models.model_config(config.load_config(None), vocab_size=VOCAB, for_sampling=True)


@pytest.fixture(scope="module")
def model(model_config):
    return models.create_model(model_config, 0)


@pytest.fixture(scope="module")
def greedy_reference(model):
    """Tunix's greedy continuation of PROMPTS[0] (excluding pad), step by step."""
    seq = list(PROMPTS[0])
    for _ in range(MAX_NEW):
        logits = full_logits(model, seq)[-1]
        logits[PAD] = -np.inf
        seq.append(int(logits.argmax()))
    return seq[len(PROMPTS[0]) :]


@pytest.fixture(scope="module")
def eos_id(greedy_reference):
    """A token greedy decoding emits at step 3 and not before, used as EOS."""
    token = greedy_reference[3]
    assert token not in greedy_reference[:3], "pick another prompt: eos would fire early"
    return token


def make_engine(mc, model, devices, eos, **kwargs):
    engine = JaxEngine(
        mc, devices, pad_id=PAD, eos_ids=(eos,), max_prompt_length=16, max_new_tokens=MAX_NEW,
        **kwargs,
    )  # fmt: skip
    engine.load_weights(params_of(model))
    return engine


@pytest.fixture(scope="module")
def engine(model_config, model, eos_id):
    return make_engine(model_config, model, jax.devices()[:1], eos_id)


def as_lists(completions):
    return [(c.tokens.tolist(), c.finish_reason) for c in completions]


def assert_greedy_matches(model, prompt, completion):
    """Tokens are Tunix's argmax (pad excluded) at every step; logprobs are its log_softmax."""
    logits = full_logits(model, prompt + completion.tokens.tolist())[len(prompt) - 1 : -1]
    want_logprobs = jax.nn.log_softmax(logits)[np.arange(len(logits)), completion.tokens]
    # Mask a copy: JAX on CPU may read `logits` in place, after this line returns.
    allowed = logits.copy()
    allowed[:, PAD] = -np.inf
    np.testing.assert_array_equal(completion.tokens, allowed.argmax(-1))
    np.testing.assert_allclose(completion.logprobs, want_logprobs, atol=1e-4)


def test_greedy_is_tunix_argmax_and_logprobs_match(engine, model):
    out = engine.generate(PROMPTS, GREEDY, seed=0)
    for prompt, completion in zip(PROMPTS, out, strict=True):
        assert len(completion.tokens) == MAX_NEW and completion.finish_reason == "length"
        assert completion.tokens.dtype == np.int32 and completion.logprobs.dtype == np.float32
        assert_greedy_matches(model, prompt, completion)


def test_sampled_logprobs_are_temperature_scaled_full_distribution(engine, model):
    out = engine.generate(PROMPTS, SAMPLE, seed=1)
    for prompt, completion in zip(PROMPTS, out, strict=True):
        seq = prompt + completion.tokens.tolist()
        logits = full_logits(model, seq)[len(prompt) - 1 : -1] / SAMPLE.temperature
        want = jax.nn.log_softmax(logits)[np.arange(len(completion.tokens)), completion.tokens]
        np.testing.assert_allclose(completion.logprobs, want, atol=1e-4)


def test_top_k_1_is_greedy(engine):
    top1 = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=1, ignore_eos=True)
    greedy = engine.generate(PROMPTS, GREEDY, seed=0)
    for a, b in zip(engine.generate(PROMPTS, top1, seed=5), greedy, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)


def test_eos_and_stop_tokens_end_the_sequence(engine, greedy_reference, eos_id):
    with_eos = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    out = engine.generate(PROMPTS, with_eos, seed=0)[0]
    assert out.tokens.tolist() == greedy_reference[:4] and out.finish_reason == "eos"
    at = next(i for i in range(1, 3) if greedy_reference[i] not in greedy_reference[:i])
    stop = SamplingParams(
        max_new_tokens=MAX_NEW, greedy=True, stop_token_ids=(greedy_reference[at],)
    )
    out = engine.generate(PROMPTS, stop, seed=0)[0]
    assert out.tokens.tolist() == greedy_reference[: at + 1] and out.finish_reason == "stop"
    out = engine.generate(PROMPTS, GREEDY, seed=0)[0]
    assert out.tokens.tolist() == greedy_reference and out.finish_reason == "length"


def test_repeated_prompts_share_prefill_but_sample_independently(engine, model):
    prompts = PROMPTS + [PROMPTS[1]] * 2  # PROMPTS[1] three times, as in a GRPO group
    out = engine.generate(prompts, SAMPLE, seed=6)
    for prompt, completion in zip(prompts, out, strict=True):
        seq = prompt + completion.tokens.tolist()
        logits = full_logits(model, seq)[len(prompt) - 1 : -1] / SAMPLE.temperature
        want = jax.nn.log_softmax(logits)[np.arange(len(completion.tokens)), completion.tokens]
        np.testing.assert_allclose(completion.logprobs, want, atol=1e-4)
    group = [out[1], out[6], out[7]]
    assert len({tuple(c.tokens.tolist()) for c in group}) == 3


def test_sampler_draws_from_the_distribution():
    probs = np.array([0.5, 0.0, 0.2, 0.3, 0.0], np.float32)
    logits = jnp.log(jnp.asarray(probs))[None].repeat(20_000, axis=0)
    keys = jax.random.split(jax.random.PRNGKey(0), 20_000)
    spec = SamplerSpec(greedy=False, top_k=0, top_p=False)
    tokens, logprobs = sample(spec, logits, keys, jnp.float32(1.0), jnp.float32(1.0), masked_id=4)
    freq = np.bincount(np.asarray(tokens), minlength=5) / 20_000
    np.testing.assert_allclose(freq, probs, atol=0.015)
    np.testing.assert_allclose(np.asarray(logprobs), np.log(probs[np.asarray(tokens)]), atol=1e-6)
    top2 = SamplerSpec(greedy=False, top_k=2, top_p=False)
    tokens, _ = sample(top2, logits, keys, jnp.float32(1.0), jnp.float32(1.0), masked_id=4)
    freq = np.bincount(np.asarray(tokens), minlength=5) / 20_000
    np.testing.assert_allclose(freq, [0.625, 0, 0, 0.375, 0], atol=0.015)
    nucleus = SamplerSpec(greedy=False, top_k=0, top_p=True)
    tokens, _ = sample(nucleus, logits, keys, jnp.float32(1.0), jnp.float32(0.6), masked_id=4)
    freq = np.bincount(np.asarray(tokens), minlength=5) / 20_000
    np.testing.assert_allclose(freq, [0.625, 0, 0, 0.375, 0], atol=0.015)


def test_seed_reproduces_and_different_seeds_differ(engine):
    a = engine.generate(PROMPTS, SAMPLE, seed=11)
    assert as_lists(a) == as_lists(engine.generate(PROMPTS, SAMPLE, seed=11))
    assert as_lists(a) != as_lists(engine.generate(PROMPTS, SAMPLE, seed=12))


def test_compiles_are_bucketed(engine):
    engine.generate(PROMPTS, SAMPLE, seed=0)
    count = engine.compile_count
    engine.generate([[1, 2], [3], [4], [5], [6, 7, 8, 9, 10]], SAMPLE, seed=3)  # 8 rows, 8 tokens
    assert engine.compile_count == count


def test_load_weights_takes_effect_and_pad_is_never_sampled(engine, model, model_config):
    """Make pad the model's favourite token: the engine must follow the new weights (logprobs
    move) and still never emit pad."""
    biased = jax.tree.map(np.array, params_of(model))
    embedding = biased["embedder"]["input_embedding"]
    embedding[PAD] = embedding[int(full_logits(model, PROMPTS[0])[-1].argmax())] * 20.0
    biased_model = models.create_model(model_config, 0)
    nnx.update(biased_model, biased)
    assert full_logits(biased_model, PROMPTS[0])[-1].argmax() == PAD  # unmasked greedy: pad
    before = engine.generate(PROMPTS, GREEDY, seed=0)
    try:
        engine.load_weights({"embedder": biased["embedder"]})  # a partial tree
        after = engine.generate(PROMPTS, GREEDY, seed=0)
        for prompt, completion in zip(PROMPTS, after, strict=True):
            assert_greedy_matches(biased_model, prompt, completion)
        assert np.abs(after[0].logprobs - before[0].logprobs).max() > 0.1
        hot = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)
        for seed in range(3):
            for completion in engine.generate(PROMPTS, hot, seed=seed):
                assert PAD not in completion.tokens.tolist()
    finally:
        engine.load_weights(params_of(model))
    restored = engine.generate(PROMPTS, GREEDY, seed=0)
    assert as_lists(restored) == as_lists(before)
    np.testing.assert_allclose(restored[0].logprobs, before[0].logprobs, atol=1e-6)


@two_devices
def test_two_replicas_streaming_equal_one_replica_run_twice(engine, model_config, model, eos_id):
    """Two replicas on two devices, each streaming its 6 requests through 2 rows (continuous
    batching), give what one replica gives running each half in one batch with that key."""
    devices = jax.devices()[:2]
    two = make_engine(model_config, model, devices, eos_id, max_batch_size=2)
    prompts = PROMPTS + PROMPTS[::-1]  # 6 per replica: the same 8-row bucket as `engine`
    stops = tuple(range(2, 9))  # with eos, ~8% of tokens end a sequence
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=stops)
    key = jax.random.PRNGKey(9)
    halves = engine.generate_share(prompts[:6], sampling, jax.random.fold_in(key, 0))
    halves += engine.generate_share(prompts[6:], sampling, jax.random.fold_in(key, 1))
    out = two.generate(prompts, sampling, seed=9)
    assert as_lists(out) == as_lists(halves)
    assert len({len(c.tokens) for c in out}) > 1  # lengths vary, so rows were refilled
    assert max(two.last_iterations) > MAX_NEW  # more steps than one sequence: rows streamed
    # a global replicated jax Array is read shard by shard
    mesh = Mesh(np.array(devices), ("x",))
    replicated = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P())), params_of(model)
    )
    two.load_weights(replicated)
    assert as_lists(two.generate(prompts, sampling, seed=9)) == as_lists(halves)


@two_devices
def test_bf16_replicas_load_the_trainers_replicated_params_under_its_mesh(model, eos_id):
    """A publish hands the trainer's replicated params in under the trainer's mesh (as
    `publish.py` does); each replica casts its own copy to `rollout_weight_dtype`."""
    bf16_config = models.model_config(config.load_config(None, ["rollout_weight_dtype=bfloat16"]),
                                      vocab_size=VOCAB, for_sampling=True)
    devices = jax.devices()[:2]
    two = make_engine(bf16_config, model, devices, eos_id)
    mesh = Mesh(np.array(devices), ("x",))
    replicated = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P())), params_of(model)
    )
    with jax.set_mesh(mesh):
        two.load_weights(replicated)
    for replica in (0, 1):
        loaded, source = jax.tree.leaves(two.weights(replica)), jax.tree.leaves(params_of(model))
        assert all(x.dtype == jnp.bfloat16 for x in loaded)
        assert all(np.array_equal(np.asarray(x), np.asarray(y).astype(jnp.bfloat16))
                   for x, y in zip(loaded, source, strict=True))


@two_devices
def test_lockstep_and_tensor_parallel_waves_match_one_replica(engine, model_config, model, eos_id):
    devices = jax.devices()[:2]
    whole = engine.generate_share(PROMPTS, SAMPLE, jax.random.fold_in(jax.random.PRNGKey(2), 0))
    lockstep = make_engine(model_config, model, devices, eos_id, lockstep=True)
    assert as_lists(lockstep.generate(PROMPTS, SAMPLE, seed=2)) == as_lists(whole)
    tp_waves = dict(tensor_parallelism=2, continuous_batching=False, max_batch_size=4)
    tp = make_engine(model_config, model, devices, eos_id, **tp_waves)
    out = tp.generate(PROMPTS, SAMPLE, seed=2)  # waves of 4 rows, heads split over 2 devices
    assert len(tp.last_iterations) == 2
    assert as_lists(out) == as_lists(whole)
    for a, b in zip(out, whole, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_clear_errors(model_config, model, eos_id):
    fresh = JaxEngine(
        model_config, jax.devices()[:1], pad_id=PAD, eos_ids=(eos_id,), max_prompt_length=4,
        max_new_tokens=MAX_NEW,
    )  # fmt: skip
    with pytest.raises(ValueError, match="load_weights"):
        fresh.generate([[1, 2]], GREEDY, seed=0)
    params = params_of(model)
    fresh.load_weights({"final_norm": params["final_norm"]})
    with pytest.raises(ValueError, match="has not set"):
        fresh.generate([[1, 2]], GREEDY, seed=0)
    with pytest.raises(ValueError, match=r"shape \(3,\), expected \(64,\)"):
        fresh.load_weights({"final_norm": {"w": np.zeros(3, np.float32)}})
    with pytest.raises(ValueError, match="unknown param"):
        fresh.load_weights({"final_norm": {"bias": np.zeros(64, np.float32)}})
    fresh.load_weights(params)
    with pytest.raises(ValueError, match="at least one prompt"):
        fresh.generate([], GREEDY, seed=0)
    with pytest.raises(ValueError, match="prompt 1 has 5 tokens; need 1..max_prompt_length=4"):
        fresh.generate([[1, 2], [1, 2, 3, 4, 5]], GREEDY, seed=0)
    with pytest.raises(ValueError, match="prompt 0 has 0 tokens"):
        fresh.generate([[], [1]], GREEDY, seed=0)
    vocab = model_config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt 2 has token ids outside \[0, {vocab}\)"):
        fresh.generate([[1, 2], [3], [4, vocab]], GREEDY, seed=0)
    with pytest.raises(ValueError, match="prompt 1 has token ids outside"):
        fresh.generate([[1], [-1, 2]], GREEDY, seed=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        fresh.generate([[1, 2]], SamplingParams(max_new_tokens=MAX_NEW + 1), seed=0)
    with pytest.raises(ValueError, match="tensor_parallelism"):
        JaxEngine(
            model_config, jax.devices()[:1], pad_id=PAD, eos_ids=(eos_id,), max_prompt_length=4,
            max_new_tokens=MAX_NEW, tensor_parallelism=3,
        )  # fmt: skip
    assert fresh.compile_count == 0


def test_replica_keys_are_fold_in_of_prng_key():
    """The engine's one-dispatch keys equal `fold_in(PRNGKey(seed), replica)`, the key every
    request's randomness folds from, for the seeds a run passes (negative and past 2**32 too)."""
    for seed in (0, 11, 2**31 + 3, 2**32 + 5, -3):
        fast = replica_keys(np.uint32(seed % 2**32), 4)
        for replica in (0, 1, 3):
            np.testing.assert_array_equal(
                fast[replica], jax.random.fold_in(jax.random.PRNGKey(seed), replica))
