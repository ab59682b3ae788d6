"""Kept pages (`DecodeSession.join(keep=True, continue_from=...)`): a conversation's second
turn starts from the pages its first turn left, prefills only its new tokens (the loop's
`prefill_tokens`) and samples what a full re-prefill samples (`generate`); under page pressure
kept pages are evicted and re-prefilled, the samples unchanged. A GRPO group's kept
conversations prefill their prompt once and share its full pages, each page freed when its last
holder lets go. One engine for the module (tiny Qwen3, CPU), its pool small enough that filler
requests evict kept conversations."""

import jax
import numpy as np
import pytest

from tests.test_engine import PAD, VOCAB, params_of
from tunix_mcjax import config, models
from tunix_mcjax.agentic.conversation import Conversation
from tunix_mcjax.agentic.demo import lookup_conversation
from tunix_mcjax.agentic.loop import TurnLimits, run_turns_counted
from tunix_mcjax.agentic.parsers import PLAIN, ChatParser
from tunix_mcjax.engine.base import SamplingParams
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.tokenizer import char_tokenizer

EOS = 1
MAX_NEW = 8
PROMPT_LEN = 32
STOPS = tuple(range(2, 6))
SAMPLE = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=STOPS)
_rng = np.random.default_rng(5)
FIRST = [_rng.integers(10, 90, n).tolist() for n in (3, 6, 9, 13)]
OBSERVED = [_rng.integers(10, 90, n).tolist() for n in (2, 5, 3, 4)]  # the tools' tokens
FILLER = [_rng.integers(10, 90, 28).tolist() for _ in range(4)]  # unrelated requests
CAPACITY = dict(max_requests=8, max_prompts=8, max_prompt_length=PROMPT_LEN)
GROUP = 4
GROUPS = [_rng.integers(10, 90, n).tolist() for n in (10, 7)]  # two GRPO groups' prompts


@pytest.fixture(scope="module")
def engine() -> JaxEngine:
    """8 slots, a pool of 40 pages of 4 tokens: the four conversations kept after their first
    turn hold up to 4 x 6 of them, four filler requests of 28 tokens want 4 x 9."""
    mc = models.model_config(config.load_config(None), vocab_size=VOCAB, for_sampling=True)
    engine = JaxEngine(mc, jax.devices()[:1], pad_id=PAD, eos_ids=(EOS,),
                       max_prompt_length=PROMPT_LEN, max_new_tokens=MAX_NEW, page_size=4,
                       max_batch_size=8, num_pages=40)
    engine.load_weights(params_of(models.create_model(mc, 0)))
    return engine


def second_prompts(first_turn: dict) -> list[list[int]]:
    """Each conversation so far (prompt, the model's turn) and its tool's tokens."""
    return [p + first_turn[i].tokens.tolist() + o
            for i, (p, o) in enumerate(zip(FIRST, OBSERVED, strict=True))]


def two_turns(session, filler=None):
    """The first turn kept, `filler` requests (if any) run in between, the second turn
    continued: (the first turn, the second, the prefill tokens of the second turn)."""
    ids = session.join(FIRST, seed=1, keep=True)
    first = session.step()
    assert sorted(first) == ids and session.kept == ids
    if filler:
        session.join(filler, seed=7)
        session.step()
    before = session.last_stats[0]["prefill_tokens"]
    second_ids = session.join(second_prompts(first), seed=2, continue_from=ids)
    second = session.step()
    assert session.kept == []  # the second turn did not keep its pages
    return first, [second[i] for i in second_ids], \
        session.last_stats[0]["prefill_tokens"] - before


@pytest.fixture(scope="module")
def reference(engine):
    """Both turns by `generate`: the second re-prefills each conversation in full."""
    first = engine.generate(FIRST, SAMPLE, seed=1)
    again = second_prompts(dict(enumerate(first)))
    second = engine.generate(again, SAMPLE, seed=2)
    assert engine.last_stats[0]["prefill_tokens"] >= sum(map(len, again))
    return first, second, sum(map(len, again))


def assert_same_samples(got, want):
    """The same tokens; logprobs to float32's last bits. A kept completion's keys/values were
    computed by decode steps (a row of one token), a re-prefill's by chunks: the prompt's are
    bitwise equal, the completion's differ by ~1.5e-6 (the matmuls' shapes round differently),
    and the session's 8 rows against generate's 4 round the first turn's logprobs apart too."""
    for g, w in zip(got, want, strict=True):
        assert g.tokens.tolist() == w.tokens.tolist()
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6, rtol=0)
        assert g.finish_reason == w.finish_reason


def test_second_turn_prefills_only_its_new_tokens(engine, reference):
    want_first, want_second, full_prefill = reference
    with engine.session(SAMPLE, **CAPACITY) as session:
        first, second, prefilled = two_turns(session)
    assert_same_samples([first[i] for i in sorted(first)], want_first)
    assert_same_samples(second, want_second)
    # The observation's tokens and the first turn's last token (sampled, never run).
    assert prefilled == sum(len(o) + 1 for o in OBSERVED)
    assert prefilled < full_prefill / 3


def test_evicted_conversations_are_re_prefilled_with_the_same_samples(engine, reference):
    want_first, want_second, full_prefill = reference
    with engine.session(SAMPLE, **CAPACITY) as session:
        first, second, prefilled = two_turns(session, FILLER)
    assert_same_samples([first[i] for i in sorted(first)], want_first)
    assert_same_samples(second, want_second)
    new_only = sum(len(o) + 1 for o in OBSERVED)
    assert new_only < prefilled <= full_prefill  # some were evicted and re-prefilled


def test_release_frees_a_kept_conversation_and_bad_continuations_are_refused(engine):
    with engine.session(SAMPLE, **CAPACITY) as session:
        ids = session.join(FIRST[:2], seed=1, keep=True)
        first = session.step()
        with pytest.raises(ValueError, match="does not extend"):
            session.join([[11] + FIRST[0]], seed=2, continue_from=[ids[0]])
        with pytest.raises(ValueError, match="no kept pages"):
            session.join([FIRST[0]], seed=2, continue_from=[99])
        with pytest.raises(ValueError, match="group_size=1"):
            session.join([FIRST[0]] * 2, seed=2, group_size=2, continue_from=[ids[0], None])
        session.release(ids[0])
        assert session.kept == [ids[1]]
        with pytest.raises(ValueError, match="no kept pages"):
            session.join([FIRST[0] + first[ids[0]].tokens.tolist() + [7]], seed=2,
                         continue_from=[ids[0]])
        with pytest.raises(ValueError, match="no kept pages to release"):
            session.release(ids[0])
        with pytest.raises(ValueError, match="twice"):
            session.release([ids[1], ids[1]])
        session.release([ids[1]])
        assert session.kept == [] and pool_pages(session) == (engine.num_pages, 0)


def pool_pages(session) -> tuple[int, int]:
    """(free pages, pages with a holder) of the session's replica; no page held below zero."""
    state = session._replicas[0].state
    refs = np.asarray(state.refs)
    assert refs.min() >= 0
    return int(state.free.count), int(np.sum(refs > 0))


def own_pages(prompt_len: int, completion) -> int:
    """Pages a kept conversation holds beyond its prompt's full pages: those of its resident
    tokens (prompt and completion but the last) past them."""
    resident = prompt_len + len(completion.tokens) - 1
    return -(-resident // 4) - prompt_len // 4


def test_a_group_prefills_its_prompt_once_and_its_kept_conversations_share_its_pages(engine):
    prompts = [p for p in GROUPS for _ in range(GROUP)]
    want_first = engine.generate(prompts, SAMPLE, seed=1)
    again = [prompts[i] + want_first[i].tokens.tolist() + OBSERVED[i % 4]
             for i in range(len(prompts))]
    # Member 0 is released; the rest of its group continues, then the other group.
    want = engine.generate(again[1:GROUP], SAMPLE, seed=2), engine.generate(again[GROUP:],
                                                                            SAMPLE, seed=3)
    with engine.session(SAMPLE, max_requests=8, max_prompts=16, max_prompt_length=PROMPT_LEN,
                        group_size=GROUP) as session:
        ids = session.join(prompts, seed=1, group_size=GROUP, keep=True)
        first = session.step()
        assert session.last_stats[0]["prefill_tokens"] == sum(map(len, GROUPS))
        assert_same_samples([first[i] for i in ids], want_first)
        own = [own_pages(len(p), first[i]) for p, i in zip(prompts, ids, strict=True)]
        # Each group's full prompt pages held once, by all its kept conversations together.
        shared = sum(len(p) // 4 for p in GROUPS)
        assert pool_pages(session) == (engine.num_pages - shared - sum(own), shared + sum(own))
        session.release(ids[0])  # its own pages go back; the group's stay with the others
        assert pool_pages(session)[1] == shared + sum(own) - own[0]
        got, prefilled = continue_turn(session, again[1:GROUP], 2, ids[1:GROUP])
        assert_same_samples(got, want[0])
        assert prefilled == sum(len(OBSERVED[i]) + 1 for i in range(1, GROUP))
        session.join(FILLER, seed=7)  # page pressure evicts the other group's conversations
        session.step()
        got, prefilled = continue_turn(session, again[GROUP:], 3, ids[GROUP:])
        assert_same_samples(got, want[1])
        assert sum(len(o) + 1 for o in OBSERVED) < prefilled <= sum(map(len, again[GROUP:]))
        assert session.kept == [] and pool_pages(session) == (engine.num_pages, 0)


def continue_turn(session, prompts, seed, kept_ids):
    """The kept conversations' next turn: (its completions, the tokens it prefilled)."""
    before = session.last_stats[0]["prefill_tokens"]
    ids = session.join(prompts, seed=seed, continue_from=kept_ids)
    done = session.step()
    return [done[i] for i in ids], session.last_stats[0]["prefill_tokens"] - before


def demo_conversations(parser):
    """The tool demo's conversations (`agentic.demo`): a turn that is not one digit calls the
    lookup tool, whose digit comes back as an observation; two turns at most."""
    return [Conversation.start(*lookup_conversation(q, {}, seed=s, system_prompt=""), parser)
            for q in ("a?", "bc?", "d?") for s in (1, 2)]


def test_the_agentic_loop_with_kept_pages_gives_the_same_trajectories(engine):
    parser = ChatParser(char_tokenizer(), PLAIN)
    limits = TurnLimits(max_total_tokens=PROMPT_LEN, max_turn_tokens=3, tool_timeout_s=10.0,
                        max_concurrency=8)
    runs = {}
    for keep in (True, False):
        convs = demo_conversations(parser)
        runs[keep] = convs, run_turns_counted(engine, convs, parser, SAMPLE, 11, limits,
                                              keep_pages=keep)
    (kept, kept_run), (full, full_run) = runs[True], runs[False]
    assert kept_run.rounds == full_run.rounds == 2 and any(c.turns == 2 for c in kept)
    for a, b in zip(kept, full, strict=True):
        assert (a.tokens, a.mask, a.status, a.reward) == (b.tokens, b.mask, b.status, b.reward)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)
    # Each second turn prefills its observation and the first turn's last token, not the whole
    # context (generate shares each prompt's prefill among its two equal prompts).
    assert kept_run.prefill_tokens_full == full_run.prefill_tokens_full
    assert kept_run.prefill_tokens_saved > 0
    assert kept_run.prefill_tokens < full_run.prefill_tokens


@pytest.mark.parametrize("keep", [False, True])
def test_agentic_keep_pages_reaches_the_turn_loop(monkeypatch, keep):
    """The key decides whether a rollout's turns keep their pages; it means nothing without
    agentic rollouts, so it is refused there."""
    from tests.mp import REPO
    from tunix_mcjax.runtime import agentic_rollouts

    cfg = config.load_config(REPO / "recipes/cpu/demo_agentic.yml",
                             [f"agentic_keep_pages={str(keep).lower()}"])
    seen = {}
    monkeypatch.setattr(agentic_rollouts, "run_turns_counted",
                        lambda *a, keep_pages: seen.setdefault("keep_pages", keep_pages))
    rollouts = agentic_rollouts.AgenticRollouts.__new__(agentic_rollouts.AgenticRollouts)
    rollouts.cfg, rollouts.host, rollouts.engine = cfg, 0, None
    rollouts.parser = rollouts.sampling = rollouts.limits = None
    monkeypatch.setattr(rollouts, "conversations", lambda adm, round_: [], raising=False)
    rollouts.generate(type("Adm", (), {"step": 0})())
    assert seen == {"keep_pages": keep}
    with pytest.raises(config.ConfigError, match="agentic_keep_pages"):
        config.load_config(REPO / "recipes/cpu/demo.yml", ["agentic_keep_pages=true"])
