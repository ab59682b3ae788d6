"""Writes gsm8k_tiny.parquet: 64 one-step arithmetic word problems in GSM8K's format.

Columns `question` and `answer`; the answer ends with `#### <number>` as in openai/gsm8k, so
MaxText's pipeline (dataset_name=openai/gsm8k) extracts it. Deterministic; run from anywhere:
`python recipes/maxtext/cpu/make_gsm8k_tiny.py`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

NUM_ROWS = 64
OUT = Path(__file__).with_name("gsm8k_tiny.parquet")
NAMES = ("Ava", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gia", "Hal")
ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "coins")


def row(rng: random.Random) -> dict[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 9)
    kind = rng.choice(("more", "fewer", "times"))
    if kind == "more":
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?"
        work, result = f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}", a + b
    elif kind == "fewer":
        a += b
        question = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        work, result = f"{a} - {b} = <<{a}-{b}={a - b}>>{a - b}", a - b
    else:
        question = f"{name} buys {b} boxes of {a} {item}. How many {item} is that?"
        work, result = f"{b} * {a} = <<{b}*{a}={a * b}>>{a * b}", a * b
    return {"question": question, "answer": f"{name} has {work} {item}.\n#### {result}"}


def main() -> None:
    rng = random.Random(0)
    rows = [row(rng) for _ in range(NUM_ROWS)]
    table = pa.table({k: [r[k] for r in rows] for k in ("question", "answer")})
    pq.write_table(table, OUT)
    print(f"wrote {len(rows)} rows to {OUT}")


if __name__ == "__main__":
    main()
