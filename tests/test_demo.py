"""The demo learns its task on 2 hosts x 2 devices, on every seed (slow: `make test-all`)."""

from __future__ import annotations

import json
import time

import pytest

from tests.mp import launch

DEMO_BUDGET_S = 600  # one `make demo` run, compilation included, on a loaded 2-core machine


@pytest.mark.bench  # five 150-step demo runs, up to 10 min each: a learning check
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_demo_learns_next_digit(tmp_path, seed):
    t0 = time.monotonic()
    proc = launch(["--hosts", "2", "--devices-per-host", "2", "recipes/cpu/demo.yml",
                   f"seed={seed}", f"base_output_directory={tmp_path}"], timeout=DEMO_BUDGET_S)
    wall_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    print(f"seed {seed}: accuracy {summary['accuracy_first10']:.3f} -> "
          f"{summary['accuracy_last10']:.3f} in {wall_s:.0f}s")
    assert summary["hosts"] == 2 and summary["devices_per_host"] == 2
    assert summary["steps"] == 150
    assert summary["accuracy_first10"] < 0.3
    assert summary["accuracy_last10"] >= 0.95
