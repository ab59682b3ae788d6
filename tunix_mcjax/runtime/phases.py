"""Phase functions shared by the step schedules: sampling, prompt tokens, the default engine,
and packing a host's rows to the agreed rows-per-device K (phase 4)."""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from tunix_mcjax import packing, topology
from tunix_mcjax.config import Config, ConfigError
from tunix_mcjax.engine import Completion, Engine, SamplingParams
from tunix_mcjax.tasks import Task
from tunix_mcjax.tokenizer import unknown_characters
from tunix_mcjax.trainer import loss_weights

ROW_FIELDS = ("tokens", "positions", "segment_ids", "targets", "loss_mask", "advantages",
              "old_logps")


def sampling_params(cfg: Config) -> SamplingParams:
    """EOS is the engine's own stop (unless `ignore_eos`), so it is not repeated here."""
    return SamplingParams(
        max_new_tokens=cfg.max_completion_length,
        temperature=cfg.decode_sampling_temperature,
        top_k=cfg.decode_sampling_top_k,
        top_p=cfg.decode_sampling_nucleus_p,
        greedy=cfg.decode_sampling_strategy == "greedy",
        ignore_eos=cfg.ignore_eos,
    )


def rollout_seed(seed: int, step: int, host: int) -> int:
    """A distinct sampling seed per (run seed, step, host); the engine folds in the replica."""
    return int(np.random.SeedSequence([seed, step, host]).generate_state(1)[0] >> 1)


def encode_prompt(tokenizer, index: int, text: str) -> np.ndarray:
    """Token ids (BOS first when the tokenizer has one); unknown characters are an error."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception as e:
        raise ConfigError(
            f"prompt {index} has characters the tokenizer cannot encode "
            f"({unknown_characters(tokenizer, text)!r}: {e}). Clean the dataset, or use "
            "tokenizer_type=huggingface with a tokenizer that covers them.") from e
    return np.asarray(bos + ids, np.int32)


def tokenize_prompts(tokenizer, prompts: list[str], max_len: int,
                     filter_long: bool = False) -> tuple[list[np.ndarray], np.ndarray]:
    """(token ids of the kept prompts, their dataset indices). A prompt over `max_len` tokens
    is dropped when `filter_long` (as MaxText filters its dataset), else an error."""
    out, kept = [], []
    for i, text in enumerate(prompts):
        ids = encode_prompt(tokenizer, i, text)
        if len(ids) > max_len:
            if filter_long:
                continue
            raise ConfigError(
                f"prompt {i} has {len(ids)} tokens, over max_prefill_predict_length={max_len}. "
                "Raise max_prefill_predict_length, or set filter_long_prompts=true to drop "
                "such prompts.")
        out.append(ids)
        kept.append(i)
    return out, np.asarray(kept, np.int64)


def filter_task(task: Task, tokenizer, cfg: Config, host: int) -> tuple[Task, list[np.ndarray]]:
    """The task without prompts over the prompt budget (count printed), and their tokens."""
    tokens, kept = tokenize_prompts(tokenizer, task.prompts, cfg.max_prefill_predict_length,
                                    cfg.filter_long_prompts)
    dropped = len(task.prompts) - len(kept)
    if not dropped:
        return task, tokens
    if not tokens:
        raise ConfigError(f"all {dropped} prompts are longer than max_prefill_predict_length="
                          f"{cfg.max_prefill_predict_length} tokens: raise it")
    if host == 0:
        print(f"filtered {dropped} of {len(task.prompts)} prompts longer than "
              f"max_prefill_predict_length={cfg.max_prefill_predict_length} tokens",
              file=sys.stderr, flush=True)
    fields = {k: [v[i] for i in kept] for k, v in task.fields.items()}
    return dataclasses.replace(task, prompts=[task.prompts[i] for i in kept],
                               fields=fields), tokens


def _engine_options(cfg: Config) -> dict:
    """The engine settings every engine of our decode loop takes."""
    return dict(
        max_prompt_length=cfg.max_prefill_predict_length,
        max_new_tokens=cfg.max_completion_length,
        tensor_parallelism=cfg.rollout_tensor_parallelism,
        data_parallelism=cfg.rollout_data_parallelism,
        continuous_batching=cfg.rollout_continuous_batching,
        max_batch_size=cfg.rollout_max_batch_size,
    )


def jax_engine(cfg: Config, model_config, devices, pad_id: int,
               eos_ids: tuple[int, ...]) -> Engine:
    """Our decode loop over Tunix Qwen3 (`rollout_engine=jax`)."""
    from tunix_mcjax.engine.jax_engine import JaxEngine

    return JaxEngine(model_config, devices, pad_id=pad_id, eos_ids=eos_ids,
                     lockstep=cfg.rl_runtime == "single", **_engine_options(cfg))


def maxtext_engine(cfg: Config, model_config, devices, pad_id: int,
                   eos_ids: tuple[int, ...]) -> Engine:
    """Our decode loop over MaxText's own model (`rollout_engine=maxtext`); `model_config` is
    the trainer's MaxText config."""
    from tunix_mcjax.engine.maxtext_engine import MaxTextEngine

    if not hasattr(model_config, "decoder_block"):
        raise ConfigError(
            "rollout_engine=maxtext decodes MaxText's own model, so it runs under the MaxText "
            "adapter (rl_runtime=mcjax on MaxText's train_rl); this run's model is Tunix Qwen3: "
            "use rollout_engine=jax")
    return MaxTextEngine(model_config, devices, pad_id=pad_id, eos_ids=eos_ids,
                         weight_dtype=cfg.rollout_weight_dtype or None, **_engine_options(cfg))


# `rollout_engine` -> the builder of that engine on this host's devices.
ENGINES = {"jax": jax_engine, "maxtext": maxtext_engine}


def default_engine(cfg: Config, model_config, devices, pad_id: int,
                   eos_ids: tuple[int, ...]) -> Engine:
    """The engine `rollout_engine` names, on this host's `devices` only."""
    return ENGINES[cfg.rollout_engine](cfg, model_config, devices, pad_id, eos_ids)


def pack_local(cfg: Config, prompts: list[np.ndarray], completions: list[Completion],
               advantages: np.ndarray, pad_id: int, num_local_devices: int,
               sync_payload: np.ndarray, watchdog: topology.Watchdog | None = None
               ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Phase 4: this host's rows padded to the agreed K, with global loss weights.

    `prompts[j]` is completion j's prompt. One all-gather carries every host's row, sequence
    and token counts (int64, exact) and `sync_payload` (float64: O1's previous-step metrics).
    Returns (local batch, the other hosts' payloads [num_hosts, n], K per device).
    """
    seqs = [packing.Sequence(p, c.tokens, float(a), c.logprobs)
            for p, c, a in zip(prompts, completions, advantages, strict=True)]
    rows = packing.pack(seqs, cfg.max_target_length, pad_id)
    counts = np.array([rows.num_rows, len(seqs), sum(len(c.tokens) for c in completions)],
                      np.int64)
    message = np.concatenate([counts.view(np.float64), np.asarray(sync_payload, np.float64)])
    if watchdog is None:
        gathered = topology.allgather(message)
    else:
        with watchdog.guard("pack"):
            gathered = topology.allgather(message)
    all_counts = np.ascontiguousarray(gathered[:, :3]).view(np.int64)
    k = packing.rows_per_device(all_counts[:, 0].tolist(), num_local_devices)
    rows = packing.pad_rows(rows, k * num_local_devices, pad_id)
    local = {f: getattr(rows, f) for f in ROW_FIELDS}
    local["weights"] = loss_weights(rows, cfg.loss_agg_mode, int(all_counts[:, 1].sum()),
                                    int(all_counts[:, 2].sum())).astype(np.float32)
    return local, gathered[:, 3:], k
