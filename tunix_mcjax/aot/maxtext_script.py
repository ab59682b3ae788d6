"""MaxText's RL script compiled for a TPU slice, every program a run of it holds
(`python -m tunix_mcjax.aot run_gptoss_20b_rl --topology v5p:2x4x4`): the maxtext engine's
loop and its session's slice (`aot.maxtext_programs`), and MaxText's train step under our
trainer (`aot.maxtext_train`).
"""

from __future__ import annotations

from tunix_mcjax.aot import MAXTEXT_PROGRAMS, maxtext_train, report
from tunix_mcjax.aot.maxtext_programs import engine_loop, engine_slice, script_configs
from tunix_mcjax.aot.target import target


def run(name: str, overrides: list[str], topology: str, save=lambda result: None,
        which: tuple[str, ...] = MAXTEXT_PROGRAMS) -> dict:
    """Compiles the programs `which` (the maxtext engine's loop and slice, MaxText's train step:
    `aot.maxtext_train`) of MaxText's RL script `name` for `topology`: compile seconds (wall
    and this process's CPU), XLA's memory analysis, whether it fits a device."""
    tgt = target(topology)
    config, cfg = script_configs(name, overrides, tgt.hosts)
    result = {"topology": topology, "device_kind": tgt.device_kind, "hosts": tgt.hosts,
              "devices_per_host": tgt.devices_per_host, "hbm_bytes": tgt.chip.hbm_bytes,
              "script": name, "model": config.model_name, "overrides": overrides,
              "programs": list(which), "compiled": []}
    if "engine" in which:
        report.progress(f"{name} ({config.model_name}) on {topology}: building the maxtext "
                        "engine")
        program, result["engine"] = engine_loop(config, cfg, tgt)
        row, _ = report.compile_program(program, tgt, None)
        result["compiled"].append(row)
        save(result)
    if "slice" in which:
        report.progress(f"{name} ({config.model_name}) on {topology}: building the maxtext "
                        "engine's session slice")
        row, _ = report.compile_program(engine_slice(config, cfg, tgt), tgt, None)
        result["compiled"].append(row)
        save(result)
    if "train" in which:
        row, result["train"] = maxtext_train.compile_train(config, cfg, tgt)
        result["compiled"].append(row)
        save(result)
    return result
