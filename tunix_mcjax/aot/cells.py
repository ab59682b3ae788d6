"""The paper's Table 3 cells compiled for TPU7x: XLA's peaks beside the planner's, per phase.

    python -m tunix_mcjax.aot.cells bench_results/aot/*.json > table.md

Reads result files of `python -m tunix_mcjax.aot ... --json` (one or more per cell) and prints
one markdown row per cell and program: compile seconds, XLA's program peak, the phase's peak
(the program plus what the other programs hold), the planner's phase peak and their difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30
HEADER = ("| profile | chips | program | compile s | XLA program peak | XLA phase peak | planner "
          "| planner vs XLA | fits |\n|---|---|---|---|---|---|---|---|---|")


def chips(result: dict) -> int:
    """TPU7x: two devices a chip."""
    return result["hosts"] * result["devices_per_host"] // 2


def rows(result: dict, profile: str) -> list[str]:
    out = []
    for row in result["compiled"]:
        if not row["compiled"]:
            out.append(f"| {profile} | {chips(result)} | {row['name']} | - | XLA refused it | "
                       "| | | no |")
            continue
        if "phase_peak" not in row:
            continue
        xla, planner = row["phase_peak"], row["plan_phase_peak"]
        out.append(f"| {profile} | {chips(result)} | {row['name']} | {row['compile_s']:.0f} | "
                   f"{row['peak'] / GIB:.2f} | {xla / GIB:.2f} | {planner / GIB:.2f} | "
                   f"{100 * (planner / xla - 1):+.0f}% | {'yes' if row['fits'] else 'no'} |")
    return out


def main(paths: list[str]) -> None:
    print(HEADER)
    for path in sorted(paths, key=lambda p: (Path(p).name.split("-")[0],
                                             json.loads(Path(p).read_text())["hosts"])):
        result = json.loads(Path(path).read_text())
        print("\n".join(rows(result, result["recipe"])))


if __name__ == "__main__":
    main(sys.argv[1:])
