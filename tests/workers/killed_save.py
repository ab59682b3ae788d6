"""A run whose host 1 is SIGKILLed in the middle of saving checkpoint step `KILL_AT_STEP`: its
Orbax save has started writing (temporary directory) but not finished."""

from __future__ import annotations

import os
import signal

import orbax.checkpoint as ocp

from tests.workers.common import start
from tunix_mcjax.runtime import recovery
from tunix_mcjax.runtime.colocated import ColocatedRuntime
from tunix_mcjax.train import checkpoint

KILL_AT_STEP = 3


class KilledMidSave(checkpoint.Checkpointer):
    def save(self, step, state, cfg=None):
        if step != KILL_AT_STEP or os.environ["TUNIX_MCJAX_PROCESS_ID"] != "1":
            return super().save(step, state, cfg)
        self.manager.save(step, args=ocp.args.StandardSave(state))  # dispatched, not finished
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    cfg, topo = start()
    recovery.Checkpointer = KilledMidSave  # what the runtime's RunState builds
    ColocatedRuntime(cfg, topo).run()


if __name__ == "__main__":
    main()
