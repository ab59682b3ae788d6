"""Whole groups scored on the reward pool: the same scores as scoring the batch at once, in
order, while the caller goes on; a group past its budget, or a reward that raises on a worker,
ends the step with an error that names it. Streamed (the engine decoding in slices), a group is
scored while the rest decode, with `generate`'s samples and the batch's scores."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from tests.mp import REPO
from tests.test_engine import params_of
from tunix_mcjax import models
from tunix_mcjax.config import ConfigError, load_config
from tunix_mcjax.engine.session import DecodeSession
from tunix_mcjax.rewards import RewardError
from tunix_mcjax.runtime import phases, stepmath
from tunix_mcjax.runtime.engines import default_engine
from tunix_mcjax.runtime.reward_pool import RewardPool, seconds_within, worker_count
from tunix_mcjax.tasks import load_task
from tunix_mcjax.tokenizer import char_tokenizer

DEMO = REPO / "recipes/cpu/demo.yml"


def _rollout_phases(workers: int, engine=None, *overrides: str) -> phases.RolloutPhases:
    cfg = load_config(DEMO, ["batch_size=6", "num_generations=4",
                             f"reward_num_workers={workers}", *overrides])
    tokenizer = char_tokenizer()
    prompts = phases.Prompts.load(cfg, tokenizer, load_task(cfg), host=0)
    return phases.RolloutPhases(cfg, prompts, engine=engine, num_hosts=1, host=0)


def test_groups_scored_on_workers_equal_the_batch_scored_at_once():
    serial, pooled = _rollout_phases(0), _rollout_phases(3)
    adm = serial.admit(step=2, history=stepmath.LengthHistory(len(serial.prompts.tokens)))
    rng = np.random.default_rng(0)
    texts = [str(d) for d in rng.integers(0, 10, size=len(adm.local_indices) * 4)]
    want = serial.score_texts(adm, texts)
    got = pooled.score_texts(adm, texts)
    assert 0 < want[0].sum() < len(texts)  # some right, some wrong: the prompts matter
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(w, g)


def test_the_pool_scores_while_the_caller_goes_on_and_returns_in_order():
    pool, go = RewardPool(workers=2, timeout_s=30), threading.Event()
    finished = []

    def group(i: int, wait: bool):
        def score():
            if wait:
                assert go.wait(10), "the caller never went on"
            finished.append(i)
            return i
        return score

    pool.submit("group 0", group(0, wait=True))  # returns before its group can finish
    pool.submit("group 1", group(1, wait=False))
    deadline = time.monotonic() + 10
    while 1 not in finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished == [1]  # group 1 was scored while group 0 waited for the caller
    go.set()
    assert pool.results() == [0, 1] and finished == [1, 0]
    assert pool.results() == []


def test_a_group_past_its_budget_is_an_error_naming_it_and_the_key():
    pool, never = RewardPool(workers=1, timeout_s=0.3), threading.Event()
    pool.submit("step 3's group 1 (prompt index 17)", lambda: never.wait(60))
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"step 3's group 1 \(prompt index 17\) ran past "
                                          r"reward_worker_timeout_seconds=0.3"):
        pool.results()
    assert time.monotonic() - t0 < 5
    never.set()


def test_a_reward_error_on_a_worker_reaches_the_caller():
    pool = RewardPool(workers=2, timeout_s=30)

    def bad():
        raise RewardError("reward function m:f returned nan for completion 0")

    pool.submit("group 0", lambda: 1)
    pool.submit("group 1", bad)
    with pytest.raises(RewardError, match="returned nan"):
        pool.results()


def test_worker_counts_and_bad_values():
    assert worker_count(-1) >= 1 and worker_count(0) == 0 and worker_count(3) == 3
    with pytest.raises(ConfigError, match="reward_num_workers"):
        load_config(DEMO, ["reward_num_workers=-2"])
    with pytest.raises(ConfigError, match="reward_worker_timeout_seconds"):
        load_config(DEMO, ["reward_worker_timeout_seconds=0"])


def test_streamed_groups_are_scored_while_the_rest_decode(monkeypatch):
    """8 slots for 24 requests: the groups finish in waves. With one-iteration slices, the
    first group goes to the pool while others still decode; the samples are `generate`'s and
    the scores the batch's."""
    shape = ["max_target_length=12", "rollout_max_batch_size=8", "decode_sampling_temperature=1"]
    serial = _rollout_phases(0, None, *shape)
    cfg = serial.cfg
    mc = models.model_config(cfg, len(serial.prompts.tokenizer), for_sampling=True)
    engine = default_engine(cfg, mc, jax.devices()[:1], serial.prompts.pad_id,
                            serial.prompts.eos_ids)
    engine.load_weights(params_of(models.create_model(mc, 0)))
    serial.engine = engine
    streamed = _rollout_phases(1, engine, *shape)
    adm = serial.admit(step=1, history=stepmath.LengthHistory(len(serial.prompts.tokens)))
    want = serial.generate(adm)
    want_scores = serial.score(adm, want)

    steps, submitted_at = [0], []
    step = DecodeSession.step
    monkeypatch.setattr(DecodeSession, "step", lambda self, **kw: (
        steps.__setitem__(0, steps[0] + 1), step(self, max_iterations=1))[1])
    submit = phases.RolloutPhases.submit_group
    monkeypatch.setattr(phases.RolloutPhases, "submit_group", lambda self, *a: (
        submitted_at.append(steps[0]), submit(self, *a))[1])
    got = streamed.generate(adm)
    assert [c.tokens.tolist() for c in got] == [c.tokens.tolist() for c in want]
    assert len(submitted_at) == len(adm.local_indices) == 6
    assert submitted_at[0] < steps[0]  # a group was scored before the last slice decoded
    for w, g in zip(want_scores, streamed.score(adm, got), strict=True):
        np.testing.assert_array_equal(w, g)
    spans = streamed.reward_pool.spans
    assert 0 < streamed.reward_hidden_s <= sum(b - a for a, b in spans)  # scored while decoding
    assert serial.reward_hidden_s == 0


def test_hidden_reward_seconds_are_the_spans_inside_the_decode():
    spans = [(0.0, 1.0), (2.0, 5.0), (6.0, 7.0)]
    assert seconds_within(spans, 0.5, 3.0) == 1.5
    assert seconds_within(spans, 0.0, 10.0) == 5.0
    assert seconds_within(spans, 5.5, 5.9) == 0.0
