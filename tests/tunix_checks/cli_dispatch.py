"""Check for patch 0001: `grpo_main` hands `rl_runtime=mcjax` to the registered runtime.

Run with a tunix copy first on PYTHONPATH; argv[1] is a minimal Tunix CLI config, argv[2] the
same with `rl_runtime: mcjax`. Prints one "REPORT <json>" line.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys

from absl import flags
from jax._src import xla_bridge
from tunix.cli import config, grpo_main

GROUP = "tunix.rl_runtimes"
CONFIG = sys.argv[1]
report: dict = {"grpo_main": grpo_main.__file__, "runtime_calls": []}
real_entry_points = md.entry_points


def fake_runtime(argv, kwargs) -> None:
    report["runtime_calls"].append({"argv": list(argv), "kwargs": kwargs,
                                    "backends_initialized": xla_bridge.backends_are_initialized()})


def registered(names: list[str]):
    def entry_points(**selection):
        if selection.get("group") != GROUP:
            return real_entry_points(**selection)
        return md.EntryPoints([md.EntryPoint(name, "__main__:fake_runtime", GROUP)
                               for name in names if name == selection.get("name")])
    return entry_points


def error_of(fn) -> str | None:
    """What `fn()` raised, as "Type: message", or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the check reports whatever was raised
        return f"{type(e).__name__}: {e}"
    return None


def value_or_error(fn) -> dict:
    try:
        return {"value": fn()}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def key_of(argv: list[str], **env: str) -> str | None:
    """`rl_runtime` as the full CLI config reads it."""
    os.environ.update(env)
    try:
        return config.initialize(argv).config.get("rl_runtime")
    finally:
        for key in env:
            del os.environ[key]


flags.FLAGS(["grpo_main"])
md.entry_points = registered(["mcjax"])
report["cli"] = error_of(lambda: grpo_main.main(["grpo_main", CONFIG, "rl_runtime=mcjax"],
                                                extra=1))
report["yaml"] = error_of(lambda: grpo_main.main(["grpo_main", sys.argv[2]]))
report["override_file"] = error_of(lambda: grpo_main.main(
    ["grpo_main", CONFIG, f"override_config_file={sys.argv[2]}"]))
os.environ["T_RL_RUNTIME"] = "mcjax"
report["env"] = error_of(lambda: grpo_main.main(["grpo_main", CONFIG]))
del os.environ["T_RL_RUNTIME"]
md.entry_points = registered([])
report["missing_runtime"] = error_of(
    lambda: grpo_main.main(["grpo_main", CONFIG, "rl_runtime=mcjax"]))
report["unknown_runtime"] = error_of(
    lambda: grpo_main.main(["grpo_main", CONFIG, "rl_runtime=foo"]))
md.entry_points = real_entry_points
report["backends_initialized_by_dispatch"] = xla_bridge.backends_are_initialized()
report["key_default"] = value_or_error(lambda: key_of(["grpo_main", CONFIG]))
report["key_cli"] = value_or_error(lambda: key_of(["grpo_main", CONFIG, "rl_runtime=mcjax"]))
report["key_env"] = value_or_error(lambda: key_of(["grpo_main", CONFIG], T_RL_RUNTIME="mcjax"))
print("REPORT " + json.dumps(report))
