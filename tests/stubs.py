"""Test doubles for tools the recipe scripts call but this machine lacks."""

from __future__ import annotations

from pathlib import Path


def stub_gcluster(tmp_path: Path) -> tuple[Path, Path]:
    """A fake `gcluster` that records `job submit` arguments (NUL-separated) to $SUBMIT_LOG.

    Returns (directory to put first on PATH, the log file, removed if present).
    """
    bin_dir, log = tmp_path / "bin", tmp_path / "submit.args"
    bin_dir.mkdir(exist_ok=True)
    log.unlink(missing_ok=True)
    stub = bin_dir / "gcluster"
    stub.write_text('#!/bin/bash\n[ "$1 $2" = "job submit" ] || exit 0\n'
                    'for a in "$@"; do printf "%s\\0" "$a"; done > "$SUBMIT_LOG"\n')
    stub.chmod(0o755)
    return bin_dir, log
