"""A short run with O2 on; reports the interpreter's GC state afterwards."""

from __future__ import annotations

import gc
import json

from tests.workers.common import start
from tunix_mcjax.runtime.colocated import ColocatedRuntime


def main() -> None:
    cfg, topo = start()
    enabled_before = gc.isenabled()
    ColocatedRuntime(cfg, topo).run()
    (cfg.run_dir / "gc.json").write_text(json.dumps({
        "enabled_before": enabled_before, "enabled_after": gc.isenabled(),
        "freeze_count": gc.get_freeze_count()}))


if __name__ == "__main__":
    main()
