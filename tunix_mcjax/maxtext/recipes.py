"""MaxText's own RL recipe scripts (`maxtext/trainers/post_train/rl/scripts/run_*_rl.sh`): the
command each one submits, and their CPU variants (`recipes/maxtext/cpu/upstream/<script>.args`).

A script builds `MAXTEXT_COMMAND` in bash and hands it to `gcluster job submit --command=...`.
`script_command` runs the installed script against a stand-in `gcluster` that records what it
is asked to submit, then splits the command as the job's shell would (`shlex`): the command is
the script's own, never retyped.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from pathlib import Path

UPSTREAM = ("run_qwen3_30b_rl", "run_gptoss_20b_rl", "run_gemma4_26b_rl", "run_gemma4_e4b_rl")
ARGS_DIR = Path(__file__).resolve().parents[2] / "recipes" / "maxtext" / "cpu" / "upstream"
TRAIN_RL = "maxtext.trainers.post_train.rl.train_rl"
# What the scripts insist on before they submit (their own values never reach the command that
# the .args then override, except where the .args say so).
SCRIPT_ENV = {"PROJECT_ID": "cpu", "CLUSTER_NAME": "cpu", "ZONE": "cpu", "DOCKER_IMAGE": "cpu",
              "RUN_NAME": "run", "BASE_OUTPUT_DIRECTORY": "runs", "MAXTEXT_CKPT_PATH": "unset",
              "RL_RUNTIME": "mcjax"}
_STAND_IN = '#!/bin/bash\n[ "$1 $2" = "job submit" ] || exit 0\nfor a in "$@"; do\n' \
            '  case "$a" in --command=*) printf "%s" "${a#--command=}" > "$SUBMITTED";; esac\n' \
            'done\n'


def script_path(name: str) -> Path:
    import maxtext

    return Path(maxtext.__file__).parent / "trainers" / "post_train" / "rl" / "scripts" / \
        f"{name}.sh"


def script_command(name: str) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, train_rl's arguments) of the command script `name` submits
    with RL_RUNTIME=mcjax."""
    with tempfile.TemporaryDirectory() as tmp:
        stand_in, submitted = Path(tmp) / "gcluster", Path(tmp) / "command"
        stand_in.write_text(_STAND_IN)
        stand_in.chmod(0o755)
        env = {**os.environ, **SCRIPT_ENV, "PATH": f"{tmp}:{os.environ['PATH']}",
               "SUBMITTED": str(submitted)}
        proc = subprocess.run(["bash", str(script_path(name))], env=env, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode or not submitted.exists():
            raise RuntimeError(f"{name}.sh submitted nothing (exit {proc.returncode}): "
                               f"{proc.stdout[-500:]}{proc.stderr[-500:]}")
        words = shlex.split(submitted.read_text())
    i = words.index(TRAIN_RL)
    assignments = dict(w.split("=", 1) for w in words[:i - 2])  # before `python3 -m`
    return assignments, words[i + 1:]


def cpu_args(name: str) -> list[str]:
    """The key=value lines of `<name>.args` (comments and blank lines left out)."""
    lines = (ARGS_DIR / f"{name}.args").read_text().splitlines()
    return [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]


def cpu_command(name: str) -> tuple[dict[str, str], list[str]]:
    """The script's command with its CPU variant's .args appended (later keys win)."""
    env, args = script_command(name)
    return env, [*args, *cpu_args(name)]
