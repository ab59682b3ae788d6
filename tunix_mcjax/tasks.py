"""Verifiable tasks: prompts, per-prompt fields, and Tunix-convention reward functions.

A reward function is called as `fn(prompts=..., completions=..., **fields) -> list[float]`, with
one entry per completion, exactly as Tunix and MaxText call theirs.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tunix_mcjax.config import Config, ConfigError

RewardFn = Callable[..., list[float]]


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    prompts: list[str]
    fields: dict[str, list]  # per-prompt extra columns, passed to reward fns by name
    reward_fns: tuple[RewardFn, ...]
    accuracy_fn: RewardFn  # 1.0 where the completion is right

    def __post_init__(self):
        if not self.prompts:
            raise ConfigError(f"task {self.name!r} has no prompts")


# --- next_digit: prompt "a=", the right completion starts with (a + 1) mod 10. ---------------

def next_digit_correct(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                       **_) -> list[float]:
    return [float(c[:1] == a) for c, a in zip(completions, answer, strict=True)]


def next_digit_task(num_prompts: int = 1000, seed: int = 1234) -> Task:
    digits = np.random.default_rng(seed).integers(0, 10, size=num_prompts)
    return Task(
        name="next_digit",
        prompts=[f"{d}=" for d in digits],
        fields={"answer": [str((d + 1) % 10) for d in digits]},
        reward_fns=(next_digit_correct,),
        accuracy_fn=next_digit_correct,
    )


# --- gsm8k: question/answer rows; the answer's number follows "####". ------------------------

_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def gsm8k_answer_correct(prompts: Sequence[str], completions: Sequence[str],
                         answer: Sequence[str], **_) -> list[float]:
    """1.0 when the completion's last number equals the reference answer's number."""
    out = []
    for completion, ref in zip(completions, answer, strict=True):
        target = ref.split("####")[-1].strip().replace(",", "")
        out.append(float(_last_number(completion) == target))
    return out


def read_rows(path: str) -> list[dict]:
    """Rows of a local .jsonl, .json or .parquet file (Hugging Face `datasets` for parquet)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"hf_train_files={path!r} not found")
    if p.suffix == ".jsonl":
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    if p.suffix == ".json":
        return json.loads(p.read_text())
    if p.suffix == ".parquet":
        import datasets  # heavy import, only for parquet

        return list(datasets.load_dataset("parquet", data_files=str(p), split="train"))
    raise ConfigError(f"hf_train_files={path!r}: use a .jsonl, .json or .parquet file")


def gsm8k_task(path: str) -> Task:
    rows = read_rows(path)
    missing = [k for k in ("question", "answer") if rows and k not in rows[0]]
    if missing:
        raise ConfigError(f"{path}: GSM8K rows need 'question' and 'answer' columns; "
                          f"missing {missing}")
    return Task(
        name="gsm8k",
        prompts=[r["question"] for r in rows],
        fields={"answer": [r["answer"] for r in rows]},
        reward_fns=(gsm8k_answer_correct,),
        accuracy_fn=gsm8k_answer_correct,
    )


# --- lookup: the agentic tool demo (`agentic.demo`): the digit only its tool returns. -------

def lookup_reward(prompts: Sequence[str], completions: Sequence[str],
                  trajectory_rewards: Sequence[float], tool_calls: Sequence[int],
                  **_) -> list[float]:
    """1.0 for the right digit after a tool call (the environment's reward), else 0."""
    return [float(bool(calls) and r == 1.0)
            for r, calls in zip(trajectory_rewards, tool_calls, strict=True)]


def lookup_task(num_prompts: int = 64) -> Task:
    return Task(name="lookup", prompts=["L"] * num_prompts, fields={},
                reward_fns=(lookup_reward,), accuracy_fn=lookup_reward)


HELD_OUT_SEED = 4321  # next_digit's evaluation draw: its own seed, not a training batch


def held_out_task(cfg: Config, num_prompts: int) -> Task | None:
    """`num_prompts` evaluation prompts of the config's task, drawn apart from its training
    batches (next_digit has only ten distinct prompts, so the draw holds the same ones in
    another order); None for a task without an evaluation split of its own (lookup, gsm8k)."""
    if cfg.dataset_name == "next_digit":
        return dataclasses.replace(next_digit_task(num_prompts, HELD_OUT_SEED),
                                   name="next_digit_test")
    return None


def load_task(cfg: Config) -> Task:
    if cfg.dataset_name == "next_digit":
        return next_digit_task()
    if cfg.dataset_name == "lookup":
        return lookup_task()
    if cfg.dataset_name == "gsm8k":
        if not cfg.hf_train_files:
            raise ConfigError("dataset_name=gsm8k needs hf_train_files=<local .jsonl/.parquet>")
        return gsm8k_task(cfg.hf_train_files)
    raise ConfigError(f"dataset_name={cfg.dataset_name!r} is not a known task "
                      "(next_digit, lookup, gsm8k)")
