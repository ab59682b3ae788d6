"""Writes a tiny parquet with OpenMathInstruct-2's columns (`problem`, `generated_solution`,
`expected_answer`, `problem_source`): 100 one-step arithmetic problems, deterministic.
`python recipes/maxtext/cpu/upstream/make_openmath_tiny.py OUT.parquet`.
"""

from __future__ import annotations

import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq

NUM_ROWS = 100  # MaxText holds out 5% of OpenMathInstruct-2's train split for evaluation


def row(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(2, 40), rng.randint(2, 9)
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"problem": f"What is ${a} {op} {b}$?",
            "generated_solution": f"We compute ${a} {op} {b} = {result}$. The answer is "
                                  f"$\\boxed{{{result}}}$.",
            "expected_answer": str(result), "problem_source": "augmented_math"}


def main(out: str) -> None:
    rng = random.Random(0)
    rows = [row(rng) for _ in range(NUM_ROWS)]
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), out)
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main(sys.argv[1])
