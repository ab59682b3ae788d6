"""MaxText's tokenizer, training rows and reward functions, as our `Task`.

Rows come from MaxText's own pipeline (`train_rl.prepare_datasets`: dataset or local parquet
`hf_train_files`, shuffled by `data_shuffle_seed`, MaxText's prompt template and chat template,
prompts over `max_prefill_predict_length` dropped, the first `num_batches * batch_size *
train_fraction` kept); its test rows are the evaluation's. Rewards are MaxText's
(`train_rl.build_reward_fns`, honouring `reward_functions_path`), called in Tunix's convention
`fn(prompts=, completions=, **fields)`.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from tunix_mcjax.config import ConfigError
from tunix_mcjax.tasks import Task
from tunix_mcjax.tokenizer import resolve_tokenizer_path

ROW_FIELDS = ("question", "answer")  # per-prompt columns MaxText's reward functions read


def load_tokenizer(config: Any) -> Any:
    """The Hugging Face tokenizer train_rl uses, with its chat template configured."""
    from maxtext.trainers.post_train.rl import train_rl
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer_path(config.tokenizer_path),
                                              token=config.hf_access_token or None)
    train_rl.configure_tokenizer_chat_template(tokenizer, config)
    return tokenizer


def _columns(batches: Any) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {"prompts": [], **{k: [] for k in ROW_FIELDS}}
    for batch in batches:
        for key, column in rows.items():
            column.extend(str(v) for v in np.asarray(batch[key]).reshape(-1))
    return rows


def dataset_rows(config: Any, tokenizer: Any) -> tuple[dict[str, list[str]],
                                                       dict[str, list[str]] | None]:
    """One epoch of MaxText's training rows, and its test rows when `num_test_batches > 0`:
    each {"prompts": [...], "question": [...], "answer": [...]}."""
    from maxtext.trainers.post_train.rl import train_rl

    train, test = train_rl.prepare_datasets(config.model_copy(update={"num_epoch": 1}),
                                            tokenizer)
    rows = _columns(train)
    if not rows["prompts"]:
        raise ConfigError(
            f"no training rows from dataset_name={config.dataset_name} hf_train_files="
            f"{config.hf_train_files}: each step needs batch_size={config.batch_size} prompts of "
            f"at most max_prefill_predict_length={config.max_prefill_predict_length} tokens.")
    if test is None:
        return rows, None
    test_rows = _columns(test)
    if not test_rows["prompts"]:
        raise ConfigError(
            f"num_test_batches={config.num_test_batches}: no evaluation rows from "
            f"eval_dataset_name={config.eval_dataset_name} (eval_split={config.eval_split}, "
            f"hf_eval_files={config.hf_eval_files}); a batch needs eval_batch_size (or "
            "batch_size) prompts. Give a larger evaluation set or set num_test_batches=0.")
    return rows, test_rows


def answer_accuracy(prompts: list[str], completions: list[str], answer: list[str], *,
                    config: Any, **_: Any) -> list[float]:
    """1.0 where the completion's extracted answer (MaxText's `extract_answer`) is one of the
    row's acceptable answers exactly, up to surrounding whitespace."""
    from maxtext.trainers.post_train.rl import utils_rl

    out = []
    for completion, acceptable in zip(completions, answer, strict=True):
        guess = utils_rl.extract_answer(completion, config).strip()
        out.append(float(guess in {a.strip() for a in json.loads(acceptable)}))
    return out


def reward_fns(config: Any) -> tuple[Any, ...]:
    """MaxText's reward stack, each fn bound to the config as train_rl binds it."""
    from maxtext.trainers.post_train.rl import train_rl

    return tuple(train_rl.build_reward_fns(config, lambda fn: train_rl._RewardFn(fn, config)))


def maxtext_task(config: Any, rows: dict[str, list[str]]) -> Task:
    return Task(
        name=config.dataset_name,
        prompts=rows["prompts"],
        fields={k: rows[k] for k in ROW_FIELDS},
        reward_fns=reward_fns(config),
        accuracy_fn=functools.partial(answer_accuracy, config=config),
    )
