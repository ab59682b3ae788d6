"""The demo learns its task on 2 hosts x 2 devices (slow: `make test-all`)."""

from __future__ import annotations

import json

import pytest

from tests.mp import launch


@pytest.mark.slow
def test_demo_learns_next_digit(tmp_path):
    proc = launch(["--hosts", "2", "--devices-per-host", "2", "recipes/cpu/demo.yml",
                   f"base_output_directory={tmp_path}"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["hosts"] == 2 and summary["devices_per_host"] == 2
    assert summary["accuracy_first10"] < 0.3
    assert summary["accuracy_last10"] >= 0.8
