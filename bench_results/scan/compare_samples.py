"""Compare two `compile_depth.py --samples` files (the unrolled and the scanned engine, same
model, seeds and prompts): one JSON object on stdout.

    python bench_results/scan/compare_samples.py BEFORE.json AFTER.json

Per run (greedy and sampled, seeds 1-3): the share of identical completions, the share of
identical tokens position by position, and over each completion's common prefix (the tokens up
to its first difference, where both engines saw the same context) the largest logprob
difference: float rounding if it is ~1e-6, a different model if not.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def compare(before: list[dict], after: list[dict]) -> dict:
    same_tokens = total_tokens = same_completions = 0
    prefix_gap = 0.0
    first_differences = []
    for b, a in zip(before, after, strict=True):
        n = max(len(b["tokens"]), len(a["tokens"]))
        tb = np.array(b["tokens"] + [-1] * (n - len(b["tokens"])))
        ta = np.array(a["tokens"] + [-1] * (n - len(a["tokens"])))
        same = tb == ta
        same_tokens += int(same.sum())
        total_tokens += n
        same_completions += int(same.all())
        prefix = n if same.all() else int(np.argmin(same))
        if prefix < n:
            first_differences.append(prefix)
        if prefix:
            gap = np.abs(np.array(b["logprobs"][:prefix]) - np.array(a["logprobs"][:prefix]))
            prefix_gap = max(prefix_gap, float(gap.max()))
    return {"completions": len(before), "identical_completions": same_completions,
            "identical_token_share": round(same_tokens / total_tokens, 4),
            "max_logprob_diff_on_common_prefix": prefix_gap,
            "first_difference_positions": first_differences}


def main() -> None:
    with open(sys.argv[1]) as f:
        before = json.load(f)
    with open(sys.argv[2]) as f:
        after = json.load(f)
    print(json.dumps({run: compare(before[run], after[run]) for run in before}, indent=1))


if __name__ == "__main__":
    main()
