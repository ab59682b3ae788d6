"""Compile every program of a step for a TPU slice, on any host: XLA's memory verdict.

    python -m tunix_mcjax.aot RECIPE [key=value ...] --topology NAME [--json PATH]
                              [--programs engine,slice,train,publish,decode]

RECIPE is a YAML recipe or a benchmark profile's name (`bench.profiles`, e.g. gsm8k), or one
of MaxText's RL scripts (`maxtext.recipes.UPSTREAM`: its maxtext engine's loop and slice, and
MaxText's train step under our trainer, `--programs engine,slice,train`;
`aot.maxtext_script`). NAME is libtpu's topology name (v5e:2x2, v6e:2x2, v5p:2x2x1,
tpu7x:2x2x1 .. tpu7x:4x4x4). Needs libtpu (`make setup-tpu-compiler`). Prints, per program,
the compile seconds and XLA's memory analysis per device, the phase's peak beside the
planner's (where it has one), and whether it fits the device's HBM; and the decode step's
cost against the HBM roofline. Exits 1 naming the keys to change when a phase does not fit,
2 on a config error, 3 without libtpu.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tunix_mcjax.aot import MAXTEXT_PROGRAMS, PROGRAMS, libtpu


def load(recipe: str, overrides: list[str]):
    """A recipe file, or a benchmark profile's keys (as the planner's tables build them)."""
    from tunix_mcjax.bench.plan_tables import profile_config
    from tunix_mcjax.bench.profiles import PROFILES
    from tunix_mcjax.config import ConfigError, load_config, parse_overrides

    if Path(recipe).is_file():
        return load_config(recipe, overrides)
    if recipe in PROFILES:
        return profile_config(recipe, **parse_overrides(overrides))
    raise ConfigError(f"{recipe!r} is neither a recipe file nor a benchmark profile "
                      f"({', '.join(PROFILES)})")


def run(cfg, topology: str, which: tuple[str, ...], save=lambda result: None) -> dict:
    """Compiles the programs `which` of a step for `topology`; `save` gets the result after
    each program (a long run leaves what it compiled)."""
    from tunix_mcjax import plan
    from tunix_mcjax.aot import programs, report
    from tunix_mcjax.aot.target import target

    tgt = target(topology)
    cfg.validate_topology(tgt.hosts, tgt.devices_per_host)
    mc = plan.model_config_for(cfg)
    p = plan.plan(cfg, tgt.cluster(), mc)
    report.progress(f"{cfg.model_name} on {topology}: {tgt.hosts} hosts x "
                    f"{tgt.devices_per_host} {tgt.device_kind} devices; building programs")
    built, kv = programs.step_programs(cfg, tgt, mc, p, which)
    result = {"topology": topology, "device_kind": tgt.device_kind, "hosts": tgt.hosts,
              "devices_per_host": tgt.devices_per_host, "hbm_bytes": tgt.chip.hbm_bytes,
              "model": cfg.model_name, "programs": list(which), "plan_peak": p.peak,
              "plan_phases": p.phases, "compiled": [], "decode_cost": None}
    for program in built:
        row, compiled = report.compile_program(program, tgt, p)
        result["compiled"].append(row)
        if program.name == "engine decode step" and compiled is not None:
            result["decode_cost"] = report.decode_cost(compiled, tgt, kv)
        save(result)
    return result


def print_result(result: dict) -> int:
    from tunix_mcjax.aot import report

    print(f"{result['model']} on {result['topology']} ({result['hosts']} hosts x "
          f"{result['devices_per_host']} {result['device_kind']} devices of "
          f"{result['hbm_bytes'] / 2**30:.1f} GiB)")
    for row in result["compiled"]:
        print("\n".join(report.program_lines(row)))
    if result["decode_cost"]:
        print("\n".join(report.cost_lines(result["decode_cost"])))
    failing = [row for row in result["compiled"] if row.get("fits") is False]
    for row in failing:
        print(f"{row['name']} does not fit: change {report.FIX_KEYS[row['phase']]}")
    print("every program fits" if not failing else "does NOT fit")
    return 1 if failing else 0


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_mcjax.aot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="YAML recipe, a benchmark profile's name, or a MaxText "
                        "RL script's (run_qwen3_30b_rl ...)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--topology", required=True, help="libtpu topology, e.g. tpu7x:2x2x1")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--programs", help=f"which to compile, of {','.join(PROGRAMS)}; of "
                        f"{','.join(MAXTEXT_PROGRAMS)} for a MaxText script (default: all)")
    args = parser.parse_args(argv)
    try:
        libtpu.activate()
    except libtpu.LibtpuMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    from tunix_mcjax.config import ConfigError
    from tunix_mcjax.maxtext.recipes import UPSTREAM

    if args.recipe in UPSTREAM:  # MaxText's RL script: its programs (aot.maxtext_script)
        return maxtext_main(args)
    try:
        cfg = load(args.recipe, args.overrides)
        which = chosen(args.programs, PROGRAMS)
        result = run(cfg, args.topology, which,
                     lambda r: write_json(args.json, {**r, "recipe": args.recipe,
                                                      "overrides": args.overrides}))
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return print_result(result)


def chosen(programs: str | None, known: tuple[str, ...]) -> tuple[str, ...]:
    """The programs `--programs` names (None: all `known`); ConfigError on others."""
    from tunix_mcjax.config import ConfigError

    which = tuple(programs.split(",")) if programs else known
    if unknown := set(which) - set(known):
        raise ConfigError(f"--programs: {', '.join(sorted(unknown))} not among "
                          f"{', '.join(known)}")
    return which


def maxtext_main(args) -> int:
    from tunix_mcjax.aot import maxtext_script, report
    from tunix_mcjax.config import ConfigError

    try:
        result = maxtext_script.run(
            args.recipe, args.overrides, args.topology,
            lambda r: write_json(args.json, {**r, "recipe": args.recipe}),
            chosen(args.programs, MAXTEXT_PROGRAMS))
    except (ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    for row in result["compiled"]:
        print("\n".join(report.program_lines(row)))
    fits = all(row.get("fits") for row in result["compiled"])
    print("every program fits" if fits else "does NOT fit")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
