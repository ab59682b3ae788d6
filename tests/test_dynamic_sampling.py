"""Dynamic sampling (DAPO): zero-variance groups never reach the update, refills are
deterministic in (seed, step) and the same for 1 and 2 hosts, and a step left with no group is
skipped. Rewards come from tests/workers/dynamic_rewards.py (they depend on the prompt only)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mp import TINY, launch, read_jsonl
from tunix_mcjax import admission
from tunix_mcjax.engine import Completion
from tunix_mcjax.runtime import dynamic_sampling as ds
from tunix_mcjax.runtime.records import Admission, Rollout

G = 4
RUN = [*TINY, "batch_size=4", f"num_generations={G}", "steps=3", "dynamic_sampling=true",
       "dynamic_sampling_max_rounds=3"]


def fake_rollout(step, indices, varied):
    rewards = np.concatenate([np.array([1, 0, 1, 0] if v else [1, 1, 1, 1], np.float32)
                              for v in varied])
    done = tuple(Completion(np.array([3 + j], np.int32), np.zeros(1, np.float32), "eos")
                 for j in range(len(rewards)))
    return Rollout(Admission(step, np.asarray(indices), np.asarray(indices)),
                   tuple(np.array([1, i], np.int32) for i in indices), done, rewards,
                   rewards.copy(), rewards - rewards.mean(), step, {})


def test_pure_parts_keep_whole_varied_groups():
    r = fake_rollout(0, [5, 6, 7], [True, False, True])
    keep = ds.varied_groups(r.rewards, G)
    assert keep.tolist() == [True, False, True]
    kept = ds.keep_groups(r, keep)
    assert kept.admission.local_indices.tolist() == [5, 7] and len(kept.completions) == 2 * G
    both = ds.concat([kept, fake_rollout(0, [9], [True])])
    assert both.admission.local_indices.tolist() == [5, 7, 9]
    assert [int(c.tokens[0]) for c in both.completions] == [3, 4, 5, 6, 11, 12, 13, 14, 3, 4,
                                                            5, 6]


def test_refill_prompts_depend_on_seed_step_and_round_only():
    base = ds.refill_prompts(100, 8, seed=1, step=3, round_=1)
    assert base.tolist() == ds.refill_prompts(100, 8, 1, 3, 1).tolist()  # same key, same draw
    assert len(set(base.tolist())) == 8 and base.min() >= 0 and base.max() < 100
    others = [ds.refill_prompts(100, 8, 2, 3, 1), ds.refill_prompts(100, 8, 1, 4, 1),
              ds.refill_prompts(100, 8, 1, 3, 2)]  # another seed, step, round
    assert all(o.tolist() != base.tolist() for o in others)
    assert sorted(ds.refill_prompts(5, 8, 1, 3, 1).tolist()) == [0, 1, 2, 3, 4]  # capped


def _run(tmp_path, hosts, reward, name):
    proc = launch(["--hosts", str(hosts), "--devices-per-host", "1", "recipes/cpu/demo.yml",
                   *RUN, f"reward_functions={reward}", f"run_name={name}",
                   f"base_output_directory={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [read_jsonl(tmp_path / name / f"host_{h}.jsonl") for h in range(hosts)]


def _kept(records, step):
    return sorted(i for host in records for i in host[step]["local_prompt_indices"])


def _expected(step, digits):
    """What `ds.fill` must do at `step` of RUN (seed 0, odd_digits_vary): the step's batch,
    then refill rounds until 4 odd-digit (varied) groups survive or 3 rounds ran. Returns
    (the surviving prompts, sorted; the groups dropped; the rounds)."""
    drawn = [admission.global_prompt_indices(len(digits), 4, 0, step).tolist()]
    while sum(digits[i] % 2 for i in sum(drawn, [])) < 4 and len(drawn) < 3:
        drawn.append(ds.refill_prompts(len(digits), 4, 0, step, len(drawn)).tolist())
    flat = sum(drawn, [])
    return sorted(i for i in flat if digits[i] % 2), sum(digits[i] % 2 == 0 for i in flat), \
        len(drawn)


@pytest.mark.slow
def test_refills_are_deterministic_and_host_count_free(tmp_path):
    vary = "tests.workers.dynamic_rewards:odd_digits_vary"
    one, again, two = (_run(tmp_path, 1, vary, "a"), _run(tmp_path, 1, vary, "b"),
                       _run(tmp_path, 2, vary, "c"))
    from tunix_mcjax.tasks import next_digit_task

    digits = [int(p[0]) for p in next_digit_task().prompts]
    rounds_run = []
    for step in range(3):
        kept, dropped, rounds = _expected(step, digits)
        rounds_run.append(rounds)
        assert _kept(one, step) == _kept(again, step) == _kept(two, step) == kept
        assert sum(h[step]["filtered_groups"] for h in two) == dropped
        assert one[0][step]["filtered_groups"] == dropped
        for rec in (one[0][step], *(h[step] for h in two)):
            assert (rec["sampling_rounds"], rec["surviving_groups"]) == (rounds, len(kept))
        # odd_digits_vary gives each surviving group two 1.0s: the kept groups' rewards alone.
        assert sum(h[step]["reward_sum"] for h in two) == one[0][step]["reward_sum"] \
            == 2 * len(kept)
        # One host twice: the same samples and the same update.
        for key in ("completion_len_by_prompt", "completion_tokens", "loss"):
            assert one[0][step][key] == again[0][step][key], key
        assert np.isfinite(one[0][step]["loss"]) and np.isfinite(two[0][step]["loss"])
    assert max(rounds_run) > 1  # the run refilled (RUN's seed makes every step refill)

def test_a_step_with_no_surviving_group_is_skipped(tmp_path):
    (records,) = _run(tmp_path, 1, "tests.workers.dynamic_rewards:constant", "z")
    for r in records:
        assert r["surviving_groups"] == 0 and r["sampling_rounds"] == 3
        assert "loss" not in r and r["filtered_groups"] == 3 * 4  # 3 rounds x 4 groups
        # Nothing trained, but the step's reward is over every completion it drew.
        assert r["completions"] == 0 and r["drawn_completions"] == 3 * 4 * G
        assert r["drawn_reward_sum"] == 0.5 * 3 * 4 * G
    for rec in read_jsonl(tmp_path / "z" / "steps.jsonl"):
        assert rec["reward_mean"] == 0.5
