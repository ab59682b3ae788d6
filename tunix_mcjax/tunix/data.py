"""The Tunix CLI's tokenizer, data and rewards, through Tunix's own code.

The dataset is `GrpoPipeline._get_dataset` (tfds, huggingface, local parquet or a data_module,
the chat template applied as Tunix applies it), the step count Tunix's `compute_params`, and the
batches Tunix's `post_init_dataset`: prompts over `max_prompt_length` dropped, `num_batches`
batches kept, split by `train_fraction`, repeated `num_train_epochs` times. The train stream is
laid out so that step s admits exactly Tunix's batch s. The held-out rows (Tunix 0.1.7's CLI
computes them but never evaluates on them) are the evaluation rows: `num_test_batches` batches.
The reward functions are Tunix's `obtain_reward_fn`'s, called unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tunix_mcjax import admission
from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.runtime.evaluation import SampledEvaluator
from tunix_mcjax.tasks import Task, _last_number

# Tunix's GSM8K answer format (tunix.examples.data.math_dataset's solution tags).
_ANSWER = re.compile(r"<answer>(.+?)</answer>", re.DOTALL)


class TunixPromptTokenizer:
    """The Hugging Face tokenizer Tunix's CLI builds, with prompts encoded as Tunix's sampler
    encodes them (`Sampler.tokenize`: BOS when the tokenizer has one, then `encode` with the
    tokenizer's own special tokens, so `tokenizer_config.add_eos=true` ends prompts with EOS).
    The runtime encodes only prompts; everything else is the Hugging Face tokenizer's."""

    bos_token_id = None  # folded into `encode`, as Tunix's sampler does it

    def __init__(self, tunix_tokenizer: Any):
        self.tunix = tunix_tokenizer
        self.hf = tunix_tokenizer.tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        del add_special_tokens  # Tunix's sampler always encodes with the tokenizer's settings
        bos = [self.tunix.bos_id()] if self.tunix.bos_id() else []
        return self.tunix.dedup_bos_ids(bos + self.tunix.encode(text))

    def __len__(self) -> int:
        return len(self.hf)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hf, name)


def load_tokenizer(pipeline: Any) -> TunixPromptTokenizer:
    """Tunix's tokenizer for the run (`GrpoPipeline._get_tokenizer`)."""
    tok = pipeline._get_tokenizer()
    if not hasattr(tok, "tokenizer") or not hasattr(tok.tokenizer, "batch_decode"):
        raise ConfigError("tokenizer_config.tokenizer_type must be huggingface: this runtime "
                          "decodes with Hugging Face tokenizers")
    return TunixPromptTokenizer(tok)


def _rows(batches: Any, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of Tunix's batched dataset, in order (at most `limit` batches)."""
    out = []
    for i, batch in enumerate(batches or ()):
        if limit is not None and i >= limit:
            break
        n = len(batch["prompts"])
        out += [{k: _scalar(v[j]) for k, v in batch.items()} for j in range(n)]
    return out


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def split_rows(pipeline: Any, tokenizer: TunixPromptTokenizer
               ) -> tuple[list[dict], list[dict], int]:
    """(the train row stream, the evaluation rows, steps) as Tunix's CLI builds them."""
    import grain
    from tunix.cli.utils import data as data_lib

    dataset = pipeline._get_dataset(tokenizer.tunix)
    if not hasattr(dataset, "__len__"):  # local parquet: an iterable (Tunix's needs a length)
        dataset = grain.MapDataset.source(list(dataset))
    try:
        pipeline.compute_params(dataset)
    except ValueError as e:  # e.g. max_steps over what the data allows
        raise ConfigError(f"Tunix's compute_params: {e}") from e
    config = pipeline.config
    train, test = data_lib.post_init_dataset(
        dataset, tokenizer.tunix, batch_size=config.get("batch_size", 1),
        num_batches=config.get("num_batches"),
        max_prompt_length=config["rollout_config"].get("max_prompt_length"),
        fraction=config.get("train_fraction", 1.0), num_epochs=config.get("num_train_epochs", 1),
        prompt_key=config.get("prompt_key", "prompts"))
    batch_size = int(config["batch_size"])
    stream = _rows(train)
    steps = min(int(config["rl_training_config"]["max_steps"]), len(stream) // batch_size)
    if steps < 1:
        raise ConfigError(f"{len(stream)} train rows make no batch of batch_size={batch_size}")
    num_test = int(config.get("num_test_batches") or 0)
    test_rows = _rows(test, num_test) if num_test else []
    if num_test and not test_rows:
        raise ConfigError(f"num_test_batches={num_test} but train_fraction="
                          f"{config.get('train_fraction')} leaves no held-out rows: set "
                          "num_test_batches=0 or train_fraction < 1")
    return stream, test_rows, steps


def answer_correct(prompts: Sequence[str], completions: Sequence[str],
                   answer: Sequence[Any] | None = None, **_) -> list[float]:
    """1.0 where the completion's <answer>...</answer> (Tunix's GSM8K format) holds the gold
    number; 0.0 everywhere for data without an `answer` column."""
    if answer is None:
        return [0.0] * len(completions)
    out = []
    for completion, gold in zip(completions, answer, strict=True):
        found = _ANSWER.search(completion)
        guess = _last_number(found.group(1)) if found else None
        out.append(float(gold is not None and guess == str(gold).strip().replace(",", "")))
    return out


def answer_formatted(completions: Sequence[str]) -> list[float]:
    return [float(_ANSWER.search(c) is not None) for c in completions]


def train_task(stream: list[dict], reward_fns: Sequence[Any], cfg: Config) -> Task:
    """The train rows as a Task whose dataset index of stream row j is where the admission
    order puts batch position j, so step s admits stream rows [s*B, (s+1)*B): Tunix's batch s.
    `steps` never passes the stream's last whole batch, so the first epoch's order is enough."""
    order = admission.global_prompt_indices(len(stream), len(stream), cfg.seed, 0)
    placed = [stream[0]] * len(stream)
    for j, index in enumerate(order):
        placed[index] = stream[j]
    fields = {k: [r[k] for r in placed] for k in placed[0] if k != "prompts"}
    return Task(name=cfg.dataset_name, prompts=[r["prompts"] for r in placed], fields=fields,
                reward_fns=tuple(reward_fns), accuracy_fn=answer_correct)


def reward_functions(pipeline: Any) -> list[Any]:
    """Tunix's `obtain_reward_fn` on the configured files. A relative path is looked up where
    Tunix looks (its project root), then in the working directory, then in the installed
    `tunix` package's parent, so `tunix/cli/reward_fn/gsm8k.py` finds the installed file."""
    import tunix
    from tunix.cli import config as tunix_config

    roots = (tunix_config.get_project_root(), Path.cwd(), Path(tunix.__file__).parents[1])
    resolved = []
    for path in pipeline.config["reward_functions"]:
        if "/" not in path:
            resolved.append(path)
            continue
        found = next((root / path for root in roots if (root / path).is_file()), None)
        if found is None:
            raise ConfigError(f"reward_functions: {path!r} not found under "
                              f"{', '.join(map(str, roots))}")
        resolved.append(str(found.absolute()))
    pipeline.config["reward_functions"] = resolved
    fns = pipeline.obtain_reward_fn()
    if not fns:
        raise ConfigError(f"reward_functions={resolved!r} define no public functions")
    return fns


class TunixEvaluator(SampledEvaluator):
    """This host's share of the evaluation rows, sampled `num_generations` times each (as Tunix's
    learner samples its eval batches) and scored by the run's reward functions; accurate:
    answer_correct, formatted: answer_formatted."""

    def __init__(self, rows: list[dict], reward_fns: Sequence[Any], tokenizer: Any, cfg: Config,
                 host: int, num_hosts: int):
        rows = rows[host::num_hosts]
        fields = {k: [r[k] for r in rows] for k in rows[0] if k != "prompts"} if rows else {}
        super().__init__(cfg, tokenizer, [r["prompts"] for r in rows], fields, reward_fns)

    def accuracy(self, prompts: list[str], texts: list[str], fields: dict[str, list]
                 ) -> Sequence[float]:
        return answer_correct(prompts, texts, **fields)

    def formatted(self, texts: list[str], reward: np.ndarray) -> Sequence[float]:
        return answer_formatted(texts)
