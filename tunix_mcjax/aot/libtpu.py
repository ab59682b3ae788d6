"""The TPU compiler on a host without a TPU: libtpu, kept out of every other process.

`make setup-tpu-compiler` installs the `tpu` extra's pinned libtpu wheel into `<venv>/libtpu`
(or `TUNIX_MCJAX_LIBTPU`), a directory no interpreter searches. Only `tunix_mcjax.aot` puts it on
`sys.path`, with `JAX_PLATFORMS=cpu`, before JAX starts: the default suite, the runtime and
`jax.devices()` never see it. With it, `jax.experimental.topologies.get_topology_desc` gives
the devices of a TPU slice to compile for.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MAKE_TARGET = "make setup-tpu-compiler"
ENV_DIR = "TUNIX_MCJAX_LIBTPU"
# Without them libtpu looks for a TPU's metadata at startup and logs errors about it, and a
# second process using libtpu (two compiles at once) fails on its lockfile.
HOST_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


class LibtpuMissing(RuntimeError):
    """libtpu is not where `make setup-tpu-compiler` puts it."""


def libtpu_dir() -> Path:
    """Where libtpu's package directory lies: `TUNIX_MCJAX_LIBTPU`, else `<venv>/libtpu`."""
    return Path(os.environ.get(ENV_DIR) or Path(sys.prefix) / "libtpu")


def activate() -> Path:
    """Puts libtpu on `sys.path` for this process (CPU as JAX's platform); call before JAX
    initialises a backend. Raises LibtpuMissing naming the make target when it is absent."""
    where = libtpu_dir()
    if not (where / "libtpu" / "libtpu.so").is_file():
        raise LibtpuMissing(
            f"no libtpu under {where}: compiling for TPU needs the TPU compiler. Install it "
            f"with `{MAKE_TARGET}` (the tpu extra's pinned wheel, into .venv/libtpu; CPU runs "
            f"do not see it), or point {ENV_DIR} at a directory holding the libtpu package")
    os.environ["JAX_PLATFORMS"] = "cpu"
    for key, value in HOST_ENV.items():
        os.environ.setdefault(key, value)
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    return where
