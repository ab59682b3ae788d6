"""`python -m tunix_mcjax.bench.engine`: its flags, and one launch or several."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
from collections.abc import Sequence

from tunix_mcjax.bench.engine.arms import ENGINE_ARMS, LAYOUTS
from tunix_mcjax.bench.engine.launches import run_launches
from tunix_mcjax.bench.engine.runner import run
from tunix_mcjax.bench.engine.tables import ProgressPrinter, print_launches, print_table
from tunix_mcjax.bench.engine.workload import MAXTEXT_MODELS, PROFILES, EngineProfile


def build_parser() -> argparse.ArgumentParser:
    described = importlib.import_module(__package__).__doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m tunix_mcjax.bench.engine",
                                     description=described)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="gsm8k-cpu")
    parser.add_argument("--json", help="write the full result here")
    parser.add_argument("--engine", action="append", choices=sorted(ENGINE_ARMS), default=[],
                        help="also run this engine beside the JAX engine (repeatable)")
    parser.add_argument("--rev", help="also run this git revision's JAX engine (e.g. the "
                        "commit before the paged engine), in a worker process")
    parser.add_argument("--maxtext-model", choices=sorted(MAXTEXT_MODELS), default="qwen3",
                        help="the maxtext engine's model: MaxText's dense Qwen3 or a tiny Qwen3 "
                        "MoE, of the JAX engine's shape (default: qwen3)")
    parser.add_argument("--maxtext-rev", help="also run this git revision's maxtext engine on "
                        "the same model (e.g. 360faf4, before it was paged), in a worker "
                        "process; needs --engine maxtext")
    parser.add_argument("--rev-tree", help="--rev's package from this folder (holding "
                        "tunix_mcjax, as `git archive REV tunix_mcjax` unpacks) instead of git")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="auto",
                        help="the engine arm's page layout (default: its platform's)")
    parser.add_argument("--xla-arm", action=argparse.BooleanOptionalAction, help="also run "
                        "the engine with its pages on the XLA path, SplitPages (default: the "
                        "profile's xla_arm)")
    parser.add_argument("--no-tunix", action="store_true", help="leave Tunix's Sampler out")
    parser.add_argument("--hbm-bandwidth", type=float, help="bytes/s of the HBM floor "
                        "(default: an H200's 4.8e12 on a GPU, none elsewhere)")
    parser.add_argument("--repeats", type=int, help="timed repeats per arm (default: the "
                        "profile's); more narrow the intervals on a loaded machine")
    parser.add_argument("--launches", type=int, default=1, help="run the comparison this many "
                        "times, each in fresh processes, and report the ratios across them "
                        "(default 1; 3 or more for a verdict near 1)")
    return parser


def profile_of(args: argparse.Namespace) -> EngineProfile:
    """`--profile`, with `--repeats` and `--xla-arm` where given."""
    profile = PROFILES[args.profile]
    if args.repeats:
        profile = dataclasses.replace(profile, repeats=args.repeats)
    if args.xla_arm is not None:
        profile = dataclasses.replace(profile, xla_arm=args.xla_arm)
    return profile


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.launches < 1:
        parser.error(f"--launches must be >= 1, got {args.launches}")
    if args.rev_tree and not args.rev:
        parser.error("--rev-tree needs --rev (the revision it holds)")
    profile = profile_of(args)
    run_args = {"profile": profile, "engines": args.engine, "rev": args.rev,
                "maxtext_model": args.maxtext_model, "maxtext_rev": args.maxtext_rev,
                "rev_tree": args.rev_tree, "layout": args.layout, "tunix": not args.no_tunix,
                "hbm_bandwidth": args.hbm_bandwidth}
    if args.launches > 1:
        result = run_launches(args.launches, {**run_args, "progress": ProgressPrinter(profile)})
        print_launches(result)
    else:
        result = run(**run_args, progress=ProgressPrinter(profile, args.json))
        print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        if os.path.exists(f"{args.json}.partial"):
            os.remove(f"{args.json}.partial")
