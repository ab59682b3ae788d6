"""Shared start-up for test workers: config from argv, distributed init from the launcher."""

from __future__ import annotations

import sys

from tunix_mcjax import topology
from tunix_mcjax.config import Config, load_config


def start() -> tuple[Config, topology.Topology]:
    cfg = load_config(sys.argv[1], sys.argv[2:])
    return cfg, topology.initialize_from_env()
