"""One local Ray cluster per test module: 4 CPUs and 4 host slots, a small object store."""

from __future__ import annotations

import pytest
import ray

from tunix_mcjax.runtime.ray_cluster import HOST_RESOURCE


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(address="local", num_cpus=4, resources={HOST_RESOURCE: 4},
             object_store_memory=256 << 20, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()
