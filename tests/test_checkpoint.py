"""Orbax checkpoints: a resumed run continues exactly where an uninterrupted one would be."""

from __future__ import annotations

from tests.mp import TINY, launch, read_jsonl

# Batches repeat every 2 steps and O3 weighs observed output lengths (which vary: up to 36
# tokens, EOS honoured), so steps 2-3 are admitted by what steps 0-1 decoded: a resume must
# bring that history back too.
RUN = [*TINY, "batch_size=4", "num_generations=4", "max_target_length=40",
       "enable_checkpointing=true", "checkpoint_period=2", "data_repeat_period=2",
       "rl_balance_prompts_by_length=true", "rl_balance_by_expected_output=true"]


def _run(tmp_path, name, steps):
    proc = launch(["--hosts", "2", "--devices-per-host", "2", "recipes/cpu/demo.yml", *RUN,
                   f"steps={steps}", f"base_output_directory={tmp_path}", f"run_name={name}"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_resume_matches_uninterrupted_run(tmp_path):
    _run(tmp_path, "straight", 4)
    _run(tmp_path, "resumed", 2)
    out = _run(tmp_path, "resumed", 4)
    assert "resumed from" in out and "step 1" in out
    straight = read_jsonl(tmp_path / "straight" / "steps.jsonl")
    resumed = read_jsonl(tmp_path / "resumed" / "steps.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    for a, b in zip(straight, resumed, strict=True):
        assert a["prompt_indices"] == b["prompt_indices"]
        assert a["loss"] == b["loss"] and a["reward_mean"] == b["reward_mean"]
    for host in (0, 1):
        assert [r["local_prompt_indices"] for r in read_jsonl(tmp_path / "straight"
                                                              / f"host_{host}.jsonl")] == \
            [r["local_prompt_indices"] for r in read_jsonl(tmp_path / "resumed"
                                                           / f"host_{host}.jsonl")]
    kept = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert kept == ["1", "3"]
