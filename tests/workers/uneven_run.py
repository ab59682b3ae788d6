"""Two real runtime steps where host 1's completions stop after one token and host 0's run to
the budget (so hosts decode different iteration counts and pack different row counts), then
each host compares its engine weights with the trainer's gathered params."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

from tests.workers.common import start
from tunix_mcjax.runtime import colocated, phases
from tunix_mcjax.train import layer_runs


class ShortOnHost1:
    """Wraps the real engine; on host 1 every request is cut to one new token."""

    def __init__(self, engine, host: int):
        self.engine, self.host = engine, host

    def generate(self, prompts, sampling, seed):
        if self.host == 1:
            sampling = dataclasses.replace(sampling, max_new_tokens=1)
        return self.engine.generate(prompts, sampling, seed)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def main() -> None:
    cfg, topo = start()

    def factory(*args):
        return ShortOnHost1(phases.default_engine(*args), topo.host)

    rt = colocated.ColocatedRuntime(cfg, topo, engine_factory=factory)
    rt.run()
    trainer_params = {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path):
            np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            layer_runs.unstack(rt.trainer.engine_params()))[0]
    }
    engine = rt.engine.engine
    diffs = []
    for replica in engine._params:
        for path, value in replica.items():
            diffs.append(float(np.max(np.abs(np.asarray(value) - trainer_params["/".join(path)]))))
    out = {"host": topo.host, "replicas": len(engine._params), "leaves": len(trainer_params),
           "compared": len(diffs), "max_abs_diff": max(diffs)}
    (cfg.run_dir / f"weights_{topo.host}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
