"""Orbax checkpoints: a resumed run continues exactly where an uninterrupted one would be."""

from __future__ import annotations

from tests.mp import launch, read_jsonl

TINY = ["base_num_decoder_layers=1", "base_emb_dim=32", "base_mlp_dim=64",
        "base_num_query_heads=2", "base_num_kv_heads=1", "head_dim=16", "batch_size=4",
        "num_generations=4", "enable_checkpointing=true", "checkpoint_period=2"]


def _run(tmp_path, name, steps):
    proc = launch(["--hosts", "2", "--devices-per-host", "2", "recipes/cpu/demo.yml", *TINY,
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
