"""Admission: whole groups, every prompt somewhere, deterministic; O3 balances token work."""

from __future__ import annotations

import numpy as np

from tunix_mcjax import admission


def test_global_batches_are_deterministic_and_cover_an_epoch():
    a = [admission.global_prompt_indices(64, 16, seed=3, step=s) for s in range(4)]
    b = [admission.global_prompt_indices(64, 16, seed=3, step=s) for s in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert sorted(np.concatenate(a).tolist()) == list(range(64))  # one epoch, no repeats
    other = admission.global_prompt_indices(64, 16, seed=4, step=0)
    assert not np.array_equal(a[0], other)


def test_repeat_period_repeats_batches():
    first = admission.global_prompt_indices(100, 10, seed=0, step=2, repeat_period=20)
    again = admission.global_prompt_indices(100, 10, seed=0, step=22, repeat_period=20)
    assert np.array_equal(first, again)


def _split(lengths, hosts, balance):
    return [admission.host_prompt_positions(hosts, h, np.asarray(lengths), balance)
            for h in range(hosts)]


def test_each_prompt_on_exactly_one_host():
    lengths = np.random.default_rng(0).integers(1, 50, 32)
    for balance in (False, True):
        parts = _split(lengths, 4, balance)
        assert sorted(np.concatenate(parts).tolist()) == list(range(32))
        assert all(len(p) == 8 for p in parts)
        assert all(np.array_equal(p, q) for p, q in zip(parts, _split(lengths, 4, balance),
                                                        strict=True))


def test_balancing_by_length_on_skewed_prompts():
    lengths = np.array([400] * 8 + [10] * 24)  # long prompts first: round blocks overload host 0

    def max_over_mean(parts):
        load = np.array([lengths[p].sum() for p in parts])
        return load.max() / load.mean()

    assert max_over_mean(_split(lengths, 4, balance=False)) > 1.1
    assert max_over_mean(_split(lengths, 4, balance=True)) <= 1.1


def test_expected_output_changes_the_balance():
    lengths = np.full(8, 10)
    expected = np.array([100, 100, 0, 0, 0, 0, 0, 0])
    parts = [admission.host_prompt_positions(2, h, lengths, True, expected, 4) for h in (0, 1)]
    assert {0, 1} & set(parts[0].tolist()) and {0, 1} & set(parts[1].tolist())
