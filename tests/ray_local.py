"""One local Ray cluster per test module: 4 CPUs and 4 host slots, a small object store."""

from __future__ import annotations

import pytest
import ray

from tunix_mcjax.runtime.ray_cluster import HOST_RESOURCE

# Ray waits a fixed 30 s for its raylet to register (ray._private.node); on a machine loaded
# well past its cores that wait can run out before the raylet starts. One more try then.
STARTUP_TIMEOUT = "timed out during startup"


def start_local_ray(tries: int = 2) -> None:
    for attempt in range(tries):
        try:
            ray.init(address="local", num_cpus=4, resources={HOST_RESOURCE: 4},
                     object_store_memory=256 << 20, include_dashboard=False,
                     configure_logging=False)
            return
        except Exception as e:  # Ray raises a bare Exception for this
            ray.shutdown()
            if STARTUP_TIMEOUT not in str(e) or attempt == tries - 1:
                raise


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    start_local_ray()
    yield
    ray.shutdown()
