"""Soak: 300 steps of the demo with O2 (GC frozen after warm-up) on 2 hosts x 2 devices.

Resident memory per host stays within 5% of its step-30 value, and compiles happen only where a
new shape appears: the update at a new rows-per-device K, the engine at a new program shape.
"""

from __future__ import annotations

import json

import pytest

from tests.mp import launch_worker, read_jsonl

STEPS = 300
WARMUP = 30


@pytest.mark.bench  # 300 steps
def test_demo_300_steps_memory_flat_and_compiles_only_at_new_shapes(tmp_path):
    overrides = [f"steps={STEPS}", "rl_gc_freeze_after_warmup=true", "log_period=50",
                 f"base_output_directory={tmp_path}", "run_name=soak"]
    proc = launch_worker("tests.workers.soak", "recipes/cpu/demo.yml", overrides, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "soak"
    for host in (0, 1):
        rss = json.loads((run / f"rss_{host}.json").read_text())
        assert len(rss) == STEPS
        settled = rss[WARMUP]
        assert max(rss[WARMUP:]) <= 1.05 * settled, (host, settled, max(rss[WARMUP:]))
        seen: set[int] = set()
        engine_compiles = 0
        for rec in read_jsonl(run / f"host_{host}.jsonl"):
            new_k = rec["rows_per_device"] not in seen
            seen.add(rec["rows_per_device"])
            # The update compiles only the first time it meets a rows-per-device K.
            assert rec["train_compiled"] == int(new_k), rec["step"]
            engine_compiles += rec["compiled"] and not rec["train_compiled"]
        # The engine compiles once per program shape; here they differ only in the number of
        # distinct prompts a replica prefills (1-4 of its 4 prompts), on each of 2 replicas.
        assert engine_compiles <= 2 * 4, engine_compiles
