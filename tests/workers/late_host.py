"""Host 1 reaches the exchange 40 s after host 0: past the 30 s gloo gives a collective's first
run for every process to arrive. Each host writes what the exchange gathered."""

from __future__ import annotations

import json
import time

import numpy as np

from tests.workers.common import start
from tunix_mcjax import topology

LATE_S = 40.0


def main() -> None:
    cfg, topo = start()
    if topo.host == 1:
        time.sleep(LATE_S)
    gathered = topology.allgather(np.array([topo.host, 7 * topo.host], np.int64))
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / f"gathered_{topo.host}.json").write_text(json.dumps(gathered.tolist()))


if __name__ == "__main__":
    main()
