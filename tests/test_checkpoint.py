"""Orbax checkpoints: a resumed run continues exactly where an uninterrupted one would be."""

from __future__ import annotations

from tests.mp import TINY, launch, read_jsonl

RUN = [*TINY, "batch_size=4", "num_generations=4", "enable_checkpointing=true",
       "checkpoint_period=2"]


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
    kept = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert kept == ["1", "3"]
