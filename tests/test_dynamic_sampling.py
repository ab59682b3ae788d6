"""Dynamic sampling (DAPO): zero-variance groups never reach the update, refills are
deterministic in (seed, step) and the same for 1 and 2 hosts, and a step left with no group is
skipped. Rewards come from tests/workers/dynamic_rewards.py (they depend on the prompt only)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mp import TINY, launch, read_jsonl
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
    a = ds.refill_prompts(100, 8, seed=1, step=3, round_=1)
    assert a.tolist() == ds.refill_prompts(100, 8, 1, 3, 1).tolist() != \
        ds.refill_prompts(100, 8, 1, 3, 2).tolist()


def _run(tmp_path, hosts, reward, name):
    proc = launch(["--hosts", str(hosts), "--devices-per-host", "1", "recipes/cpu/demo.yml",
                   *RUN, f"reward_functions={reward}", f"run_name={name}",
                   f"base_output_directory={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [read_jsonl(tmp_path / name / f"host_{h}.jsonl") for h in range(hosts)]


def _kept(records, step):
    return sorted(i for host in records for i in host[step]["local_prompt_indices"])


@pytest.mark.slow
def test_refills_are_deterministic_and_host_count_free(tmp_path):
    vary = "tests.workers.dynamic_rewards:odd_digits_vary"
    one, again, two = (_run(tmp_path, 1, vary, "a"), _run(tmp_path, 1, vary, "b"),
                       _run(tmp_path, 2, vary, "c"))
    from tunix_mcjax.tasks import next_digit_task

    digits = [int(p[0]) for p in next_digit_task().prompts]
    for step in range(3):
        kept = _kept(one, step)
        assert kept == _kept(again, step) == _kept(two, step)
        assert kept and all(digits[i] % 2 for i in kept)  # no zero-variance group trained
        filtered = sum(h[step]["filtered_groups"] for h in two)
        assert filtered == one[0][step]["filtered_groups"] >= 0
        assert one[0][step]["surviving_groups"] == len(kept)
        assert "loss" in one[0][step]


def test_a_step_with_no_surviving_group_is_skipped(tmp_path):
    (records,) = _run(tmp_path, 1, "tests.workers.dynamic_rewards:constant", "z")
    for r in records:
        assert r["surviving_groups"] == 0 and r["sampling_rounds"] == 3
        assert "loss" not in r and r["filtered_groups"] == 3 * 4  # 3 rounds x 4 groups
