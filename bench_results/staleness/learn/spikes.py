"""Late gradient spikes per arm, from the runs' records: steps after step 60 (the arms reach 0.9
near it) whose gradient norm (before the 1.0 clip) exceeds 5, summed over seeds, with the
largest norm and the seeds' final accuracy (last 10 steps' mean).

    python bench_results/staleness/learn/spikes.py
"""

import json
import re
from pathlib import Path

import numpy as np

RUNS = Path(__file__).parent / "runs"
AFTER, OVER = 60, 5.0


def main() -> None:
    arms: dict[str, list[Path]] = {}
    for run in sorted(RUNS.iterdir()):  # finished runs only (the bench writes bench_meta last)
        m = re.fullmatch(r"demo-(.+)-da-tistoken-s\d+", run.name)
        if m and (run / "bench_meta.json").exists():
            arms.setdefault(m.group(1), []).append(run)
    print(f"| arm | steps after {AFTER} over grad norm {OVER:g}, per seed | total | largest "
          "| last-10-step accuracy, per seed |")
    print("|---|---|---|---|---|")
    for arm, runs in arms.items():
        counts, largest, final = [], 0.0, []
        for run in runs:
            recs = [json.loads(line) for line in (run / "steps.jsonl").open()]
            norms = np.array([r["grad_norm"] for r in recs if r["step"] > AFTER])
            counts.append(int((norms > OVER).sum()))
            largest = max(largest, float(norms.max()))
            final.append(np.mean([r["accuracy"] for r in recs[-10:]]))
        print(f"| {arm} | {', '.join(map(str, counts))} | {sum(counts)} | {largest:.1f} | "
              f"{', '.join(f'{a:.3f}' for a in final)} |")


if __name__ == "__main__":
    main()
