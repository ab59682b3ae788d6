"""Another revision's engine as an arm: a worker process over that revision's package.

`rev_arm` runs revision REV's JaxEngine (or with `maxtext`, its MaxTextEngine) in a worker
(`bench.rev_engine_worker`) over `git archive REV tunix_mcjax`, or over a folder holding that
package. A worker runs the same code slower than the main process (1.14x at demo-cpu's 3-ms
generates), so `run` adds this tree's engine in a worker too (`REV_WORKERS`) and a revision
is compared with it, like with like.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tunix_mcjax.bench.engine.arms import Measure
from tunix_mcjax.bench.engine.workload import MODEL_FIELDS, model_of
from tunix_mcjax.engine.buckets import pow2_at_least

PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the folder holding tunix_mcjax
# A revision's arm runs in a worker, so it is compared with this tree's engine in one.
REV_WORKERS = {"rev": "engine_worker", "maxtext_rev": "maxtext_worker"}


def rev_worker(rev: str, tree: str | None = None) -> Callable[[dict], dict]:
    """A worker process (`bench.rev_engine_worker`) over `git archive` of revision `rev`'s
    package, or over `tree` (a folder holding that package, `tree/tunix_mcjax`); returns the
    function that sends it one request and reads its answer."""
    if tree is None:
        tree = tempfile.mkdtemp(prefix="rev-engine-")
        atexit.register(shutil.rmtree, tree, ignore_errors=True)
        archive = subprocess.run(["git", "archive", rev, "tunix_mcjax"], check=True,
                                 capture_output=True, timeout=120).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True, timeout=120)
    elif not (Path(tree) / "tunix_mcjax" / "engine" / "jax_engine.py").is_file():
        raise ValueError(f"--rev-tree {tree} holds no tunix_mcjax package")
    worker = Path(__file__).parents[1] / "rev_engine_worker.py"
    # The revision's package first, then whatever path this process was given (where its
    # dependencies may live).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, str(worker)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    atexit.register(proc.kill)

    def ask(request: dict) -> dict:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {rev} engine worker exited with {proc.wait()}")
        return json.loads(line)

    return ask


def rev_arm(profile, prompts, sampling, rev: str, maxtext: Sequence[str] | None = None,
            tree: str | None = None) -> tuple[Measure, dict]:
    """Revision `rev`'s engine in a worker process (`rev_worker`, its package from `tree` if
    given), with the engine arm's settings: its JaxEngine over Tunix's Qwen3 of the profile's
    shape, or with `maxtext` (MaxText arguments) its MaxTextEngine over that model; asked for
    one generate per repeat."""
    ask = rev_worker(rev, tree)
    if maxtext is None:
        mc = model_of(profile)
        built = {"model": {**{k: getattr(mc, k) for k in MODEL_FIELDS},
                           "dtype": np.dtype(mc.dtype).name}}
    else:
        built = {"maxtext": list(maxtext)}
    info = ask({**built,
                "prompts": prompts, "max_prompt_length": pow2_at_least(profile.prompt_lengths[1]),
                "max_new_tokens": sampling.max_new_tokens, "max_batch_size": profile.decode_batch,
                "sampling": dataclasses.asdict(sampling)})
    info.update(rev=rev, decode_batch=min(profile.decode_batch, pow2_at_least(profile.requests)))
    return lambda rep: ask({"seed": rep + 1}), info
