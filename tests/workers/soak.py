"""A long run (the soak test): each host records its resident memory after every step."""

from __future__ import annotations

import json

import psutil

from tests.workers.common import start
from tunix_mcjax.runtime.colocated import ColocatedRuntime


def main() -> None:
    cfg, topo = start()
    rt = ColocatedRuntime(cfg, topo)
    rss: list[int] = []
    step = rt.step

    def measured_step(i: int) -> None:
        step(i)
        rss.append(psutil.Process().memory_info().rss)

    rt.step = measured_step
    rt.run()
    (cfg.run_dir / f"rss_{topo.host}.json").write_text(json.dumps(rss))


if __name__ == "__main__":
    main()
