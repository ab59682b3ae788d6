"""Sliced decode (`engine.session`): the loop run a slice at a time, its state kept on the
device, gives `generate`'s samples exactly; joined requests keep their own samples; GRPO groups
come back whole and as soon as they are whole. One engine for the module (tiny Qwen3, CPU):
continuous batching, a pool small enough to preempt, 32 slots so the tail decodes packed."""

from tests.mp import force_cpu_devices

force_cpu_devices(2)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.test_engine import PAD, VOCAB, params_of  # noqa: E402
from tunix_mcjax import config, models  # noqa: E402
from tunix_mcjax.engine.base import SamplingParams  # noqa: E402
from tunix_mcjax.engine.jax_engine import JaxEngine  # noqa: E402

EOS = 1
MAX_NEW = 8
GROUP = 3
_rng = np.random.default_rng(0)
GROUPS = [_rng.integers(10, 90, _rng.integers(1, 8)).tolist() for _ in range(12)]
PROMPTS = [p for p in GROUPS for _ in range(GROUP)]  # 36 requests through 32 rows
STOPS = tuple(range(2, 9))  # with eos, ~8% of tokens end a sequence: lengths vary
SAMPLE = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=STOPS)
# generate's shape for PROMPTS: 64 request slots (28 spare), 16 prompt slots (4 spare).
CAPACITY = dict(max_requests=len(PROMPTS), max_prompts=len(GROUPS), max_prompt_length=8,
                group_size=GROUP)


def tiny_engine(devices=1, **kwargs) -> JaxEngine:
    mc = models.model_config(config.load_config(None), vocab_size=VOCAB, for_sampling=True)
    engine = JaxEngine(mc, jax.devices()[:devices], pad_id=PAD, eos_ids=(EOS,), max_prompt_length=8,
                       max_new_tokens=MAX_NEW, page_size=4, **kwargs)
    engine.load_weights(params_of(models.create_model(mc, 0)))
    return engine


@pytest.fixture(scope="module")
def engine() -> JaxEngine:
    """32 slots, a pool of 40 pages of 4 tokens (the rows at the caps would want 96)."""
    return tiny_engine(max_batch_size=32, num_pages=40)


@pytest.fixture(scope="module")
def reference(engine):
    """One generate of PROMPTS at seed 3, and its loop's counters."""
    out = engine.generate(PROMPTS, SAMPLE, seed=3)
    return out, engine.last_stats[0]


def run_session(engine, max_iterations):
    """PROMPTS in one session, stepped `max_iterations` at a time until all return: (the
    completions by request id, the ids each step returned, the session's counters)."""
    with engine.session(SAMPLE, **CAPACITY) as session:
        ids = session.join(PROMPTS, seed=3, group_size=GROUP)
        assert ids == list(range(len(PROMPTS)))
        got, returned = {}, []
        while session.unfinished:
            out = session.step(max_iterations)
            returned.append(list(out))
            got.update(out)
        return got, returned, session.last_stats[0]


@pytest.mark.parametrize("max_iterations", [1, 7, None])
def test_slices_give_generates_samples_exactly(engine, reference, max_iterations):
    want, stats = reference
    assert stats["preemptions"] > 0 and stats["packed_steps"] > 0  # the hard paths ran
    programs = engine.compile_count
    got, returned, session_stats = run_session(engine, max_iterations)
    for i, completion in enumerate(want):
        assert got[i].tokens.tolist() == completion.tokens.tolist(), i
        np.testing.assert_array_equal(got[i].logprobs, completion.logprobs)
        assert got[i].finish_reason == completion.finish_reason
    assert session_stats == stats  # the same iterations, preemptions and packed steps
    steps = -(-stats["iterations"] // max_iterations) if max_iterations else 1
    assert len(returned) == steps
    if max_iterations == 1:
        assert engine.compile_count == programs + 3  # start, join, advance: for any slice
    else:
        assert engine.compile_count == programs


def test_groups_come_back_whole_and_as_soon_as_they_are_whole(engine):
    with engine.session(SAMPLE, **CAPACITY) as session:
        session.join(PROMPTS, seed=3, group_size=GROUP)
        when, held_back = {}, False
        step = 0
        while session.unfinished:
            for request_id in session.step(1):
                when[request_id] = step
            step += 1
            done = session._replicas[0].done
            for group in session._groups:  # not yet returned: never all done
                assert not done[list(group.slots)].all()
                held_back |= bool(done[list(group.slots)].any())
    assert held_back  # a group waited on its slowest request
    groups = [[when[g * GROUP + k] for k in range(GROUP)] for g in range(len(GROUPS))]
    assert all(len(set(g)) == 1 for g in groups)  # each group in one step
    first, last = min(g[0] for g in groups), max(g[0] for g in groups)
    assert first < last  # an early group came back before the slowest one


def group_timeline(engine, **step) -> tuple[list[tuple[list[int], int]], dict, int]:
    """PROMPTS in one session stepped with `step`'s arguments: per call that returned groups,
    (the request ids, the loop's iterations when the slice it read ended); the completions by
    request id; and the number of calls."""
    timeline, got, calls = [], {}, 0
    with engine.session(SAMPLE, **CAPACITY) as session:
        session.join(PROMPTS, seed=3, group_size=GROUP)
        while session.unfinished:
            out = session.step(**step)
            calls += 1
            if out:
                timeline.append((sorted(out), session.last_stats[0]["iterations"]))
            got.update(out)
    return timeline, got, calls


def test_until_group_slices_end_as_a_group_becomes_whole(engine, reference):
    """`step(until_group=True)` returns each group at the iteration it became whole (as slices
    of one iteration find it), pipelined, and only then: no call comes back empty."""
    want, stats = reference
    every_iteration = group_timeline(engine, max_iterations=1)[0]
    programs = engine.compile_count
    timeline, got, calls = group_timeline(engine, until_group=True)
    assert calls == len(timeline), "an until_group step came back with no group"
    assert timeline == every_iteration
    assert calls == len(every_iteration) < len(GROUPS)  # some groups end together
    assert engine.compile_count == programs  # the same advance program
    for i, completion in enumerate(want):
        assert got[i].tokens.tolist() == completion.tokens.tolist(), i
        np.testing.assert_array_equal(got[i].logprobs, completion.logprobs)


def samples_alone(engine, prompts, seed):
    """`prompts` decoded on a session of their own, by request id."""
    with engine.session(SAMPLE, **CAPACITY) as session:
        session.join(prompts, seed=seed)
        alone = {}
        while session.unfinished:
            alone.update(session.step())
    return alone


def test_a_joined_request_gets_the_sample_it_would_get_alone(engine):
    joiner = [[77, 12, 5, 40, 33], [77, 12, 5, 40, 33], [61]]
    alone = samples_alone(engine, joiner, seed=9)
    with engine.session(SAMPLE, **CAPACITY) as session:
        session.join(PROMPTS, seed=3, group_size=GROUP)
        got = session.step(5)
        ids = session.join(joiner, seed=9)  # into the running loop, mid-batch
        assert ids == list(range(len(PROMPTS), len(PROMPTS) + 3))
        while session.unfinished:
            got.update(session.step(3))
    # Alone, its rows decode packed (4 rows of the program's 32), beside PROMPTS not always:
    # the model at another row count rounds a logprob differently in float32's last bit.
    for request_id, completion in zip(ids, alone.values(), strict=True):
        assert got[request_id].tokens.tolist() == completion.tokens.tolist()
        np.testing.assert_allclose(got[request_id].logprobs, completion.logprobs, atol=1e-6)
    assert got[ids[0]].tokens.tolist() != got[ids[1]].tokens.tolist()  # keys differ


def test_bad_input_is_refused_with_the_key_to_change(engine):
    with engine.session(SAMPLE, max_requests=2, max_prompts=4, max_prompt_length=8) as session:
        with pytest.raises(ValueError, match="max_iterations=0"):
            session.step(0)
        with pytest.raises(ValueError, match="time_budget_s"):
            session.step(time_budget_s=0)
        with pytest.raises(ValueError, match="max_prompt_length=8"):
            session.join([[5] * 9], seed=0)
        with pytest.raises(ValueError, match="group_size=2"):
            session.join([[4]] * 3, seed=0, group_size=2)
        with pytest.raises(ValueError, match="larger max_requests"):
            session.join([[4], [5], [6]], seed=0)  # two request slots
        with pytest.raises(RuntimeError, match="held by an open DecodeSession"):
            engine.generate([[4]], SAMPLE, seed=0)
    assert engine._pools[0] is not None and engine._pool_holders[0] is None  # closed: back
    with engine.session(SAMPLE, max_requests=4, max_prompts=2, max_prompt_length=8) as session:
        with pytest.raises(ValueError, match="larger max_prompts"):
            session.join([[4], [5], [6]], seed=0)  # two prompt slots
    with pytest.raises(RuntimeError, match="session is closed"):
        session.step()
    with engine.session(SAMPLE, **CAPACITY) as session:  # compiled by the tests above
        session.join(PROMPTS[:4], seed=0)
        assert len(session.step(time_budget_s=60.0)) == 4  # the budget outlasts them


def test_lockstep_and_waves_are_refused_by_name():
    mc = models.model_config(config.load_config(None), vocab_size=VOCAB, for_sampling=True)
    for fields, reason in (({"lockstep": True}, "all-reduce"),
                           ({"continuous_batching": False}, "waves")):
        engine = JaxEngine(mc, jax.devices()[:1], pad_id=PAD, eos_ids=(EOS,), page_size=4,
                           max_prompt_length=8, max_new_tokens=MAX_NEW, **fields)
        with pytest.raises(NotImplementedError, match=f"JaxEngine with .*{reason}"):
            engine.session(SAMPLE, max_requests=4)


@pytest.mark.slow
def test_the_maxtext_engine_slices_to_generates_samples():
    """MaxText's Qwen3 (tiny) in our loop: five requests through two rows on the smallest pool
    the engine takes, slices of 3 against one generate."""
    pytest.importorskip("maxtext")
    from tests.test_maxtext_engine import MAX_NEW as MAXTEXT_NEW
    from tests.test_maxtext_engine import World
    from tunix_mcjax.engine import pages

    world = World("qwen3", page_size=4, num_pages=pages.least_pool_pages(16, MAXTEXT_NEW, 4))
    sampling = SamplingParams(max_new_tokens=MAXTEXT_NEW, temperature=1.0,
                              stop_token_ids=tuple(range(1, 33)))
    want = world.engine.generate(world.prompts, sampling, seed=2)
    with world.engine.session(sampling, max_requests=len(world.prompts),
                              max_prompt_length=16) as session:
        session.join(world.prompts, seed=2)
        got = {}
        while session.unfinished:
            got.update(session.step(3))
        assert session.last_stats[0] == world.engine.last_stats[0]
    for i, completion in enumerate(want):
        assert got[i].tokens.tolist() == completion.tokens.tolist(), i
        np.testing.assert_array_equal(got[i].logprobs, completion.logprobs)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs two CPU devices")
def test_two_replicas_slice_to_generates_samples():
    """Two replicas, each its own loop: groups are placed on the one with more room, and every
    request keeps the key generate gives it, in slices of 4, until a group is whole (each
    replica's slice ending on its own groups) and the same on a clock."""
    engine = tiny_engine(devices=2, max_batch_size=8, num_pages=20)
    assert engine.num_replicas == 2
    want = engine.generate(PROMPTS, SAMPLE, seed=4)
    for step in ({"max_iterations": 4}, {"until_group": True},
                 {"until_group": True, "time_budget_s": 1e-3}):
        with engine.session(SAMPLE, **CAPACITY) as session:
            session.join(PROMPTS, seed=4, group_size=GROUP)
            got = {}
            while session.unfinished:
                out = session.step(**step)
                assert out or "until_group" not in step or "time_budget_s" in step
                got.update(out)
            assert all(stats["iterations"] > 0 for stats in session.last_stats)
        for i, completion in enumerate(want):
            assert got[i].tokens.tolist() == completion.tokens.tolist(), (step, i)
            np.testing.assert_allclose(got[i].logprobs, completion.logprobs, atol=1e-6)
    # 36 groups of one over two replicas of 32 request slots: each replica's slice is told its
    # own groups, numbered below its slot count (the program counts no group past it).
    with engine.session(SAMPLE, **(CAPACITY | {"max_prompts": len(PROMPTS)})) as session:
        session.join(PROMPTS, seed=4)
        tables, advance = [], session._programs.advance
        session._programs.advance = lambda *args: tables.append(args[-1]) or advance(*args)
        while session.unfinished:
            assert session.step(until_group=True)
    assert max(int(t.max()) for t in tables) < session.shape.num_requests
    assert max(np.count_nonzero(t >= 0) for t in tables) > 1


def test_timed_steps_pipeline_slices_and_give_generates_samples(engine, reference):
    """Timed steps dispatch the next slice before reading the last and return with it still
    running: the samples and counters are still generate's."""
    want, stats = reference
    with engine.session(SAMPLE, **CAPACITY) as session:
        session.join(PROMPTS, seed=3, group_size=GROUP)
        got, left_running = {}, 0
        while session.unfinished:
            got.update(session.step(time_budget_s=1e-3))
            left_running += session._running is not None
        assert session.last_stats[0] == stats
    assert left_running > 0  # a call returned with its next slice on the device
    for i, completion in enumerate(want):
        assert got[i].tokens.tolist() == completion.tokens.tolist(), i
        np.testing.assert_array_equal(got[i].logprobs, completion.logprobs)


def test_a_request_joined_while_a_slice_runs_waits_for_its_own_done(engine):
    """A slice dispatched before a join reports the slot's previous request as done; the
    joined request must still come back only when its own decoding ends, with its sample."""
    joiner = [[77, 12, 5, 40, 33], [61]]
    alone = samples_alone(engine, joiner, seed=9)
    with engine.session(SAMPLE, **CAPACITY) as session:
        got = {}
        session.join(PROMPTS[:GROUP], seed=3, group_size=GROUP)
        while session.unfinished or session._running is None:  # drained, a slice running
            got.update(session.step(time_budget_s=1e-3))
        ids = session.join(joiner, seed=9)  # into slots whose last slice said done
        returned = session.step(time_budget_s=1e-3)  # reads the slice from before the join
        assert not set(ids) & set(returned)
        while session.unfinished:
            returned.update(session.step(time_budget_s=1e-3))
    for request_id, completion in zip(ids, alone.values(), strict=True):
        assert returned[request_id].tokens.tolist() == completion.tokens.tolist()
        np.testing.assert_allclose(returned[request_id].logprobs, completion.logprobs,
                                   atol=1e-6)


def test_a_slice_bound_no_session_can_run_is_refused():
    """Both sessions (the jax engine's, vLLM's) refuse a slice of no step or no time by name."""
    from tunix_mcjax.engine.session import check_slice

    with pytest.raises(ValueError, match="max_iterations=0: a slice runs at least one engine"):
        check_slice(0, None, "engine step")
    with pytest.raises(ValueError, match=r"time_budget_s=0.0 must be > 0"):
        check_slice(None, 0.0, "loop iteration")
    check_slice(1, 0.5, "loop iteration")
