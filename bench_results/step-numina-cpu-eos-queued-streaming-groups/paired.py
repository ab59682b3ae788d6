"""Streaming's cut against the reward it hid, step by step: both arms decode the same prompts
with the same seeds at each step (the samples are equal), so each scored step of launch i of
`mcjax` pairs with the same step of launch i of `mcjax+streaming` (one host: its record,
`runs/*/host_0.jsonl`). Prints, per launch and over
all, medians of the cut in generate + reward and in the step, and of the reward hidden, with
95% bootstrap intervals of the median (10000 resamples of steps).

    python paired.py > paired.md
"""

import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
FIRST_SCORED = 20


def steps(run: str) -> dict[int, dict]:
    records = [json.loads(line) for line in (HERE / "runs" / run / "host_0.jsonl").open()]
    return {r["step"]: r for r in records if r["step"] >= FIRST_SCORED and not r["compiled"]}


def interval(x: np.ndarray, rng: np.random.Generator) -> str:
    medians = np.median(rng.choice(x, (10000, len(x))), axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return f"{np.median(x):.3f} [{lo:.3f}, {hi:.3f}]"


def main() -> None:
    rng = np.random.default_rng(0)
    rows, every = [], {"gr": [], "step": [], "hidden": []}
    for launch in range(3):
        base, stream = steps(f"mcjax-h1-l{launch}"), steps(f"mcjax+streaming-h1-l{launch}")
        common = sorted(set(base) & set(stream))
        gr = np.array([sum(base[s][p] - stream[s][p] for p in ("generate_s", "reward_s"))
                       for s in common])
        step = np.array([base[s]["step_s"] - stream[s]["step_s"] for s in common])
        hidden = np.array([stream[s]["reward_hidden_s"] for s in common])
        for key, x in (("gr", gr), ("step", step), ("hidden", hidden)):
            every[key].append(x)
        rows.append((f"l{launch}", len(common), gr, step, hidden))
    rows.append(("all", sum(r[1] for r in rows),
                 *(np.concatenate(every[k]) for k in ("gr", "step", "hidden"))))
    print("| launch | paired steps | generate + reward cut s | step cut s | reward hidden s "
          "| cut - hidden (generate + reward) s |")
    print("|---|---|---|---|---|---|")
    for name, n, gr, step, hidden in rows:
        print(f"| {name} | {n} | {interval(gr, rng)} | {interval(step, rng)} | "
              f"{interval(hidden, rng)} | {interval(gr - hidden, rng)} |")


if __name__ == "__main__":
    main()
