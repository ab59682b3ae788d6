"""MaxText's evaluation (`evaluate_rl`) on this host's engine: the adapter's `Evaluator`.

The prompts are MaxText's test rows (`train_rl.prepare_datasets` with `num_test_batches`,
`eval_batch_size`, `eval_dataset_name`, `eval_split`, `hf_eval_files`); this host takes every
H-th of them. Responses come from MaxText's `generate_responses` (`num_eval_passes` passes,
sampled with `generation_configs[eval_sampling_strategy]`) through a rollout that calls the
engine; each question is scored by MaxText's `score_responses` (`eval_mode`: pass, maj,
pass_at_1) and `_compute_row_reward` (the training reward stack), summed for the global result.
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import numpy as np

from tunix_mcjax.engine import Engine, SamplingParams
from tunix_mcjax.runtime import phases
from tunix_mcjax.runtime.evaluation import SUM_FIELDS


class EngineRollout:
    """What MaxText's `generate_responses` calls (`rl_cluster.rollout.generate`), on our engine.

    Each call is one pass over the same prompts: its seed is the evaluation's seed with the
    pass folded in, so passes sample independently.
    """

    def __init__(self, engine: Engine, tokenizer: Any, prompt_tokens: dict[str, np.ndarray],
                 seed: int):
        self.engine, self.tokenizer, self.prompt_tokens, self.seed = (
            engine, tokenizer, prompt_tokens, seed)
        self.calls = 0

    @property
    def rollout(self) -> EngineRollout:
        return self

    def generate(self, prompts: list[str], rollout_config: Any) -> types.SimpleNamespace:
        sampling = SamplingParams(max_new_tokens=rollout_config.max_tokens_to_generate,
                                  temperature=rollout_config.temperature,
                                  top_k=max(int(rollout_config.top_k or 0), 0),
                                  top_p=float(rollout_config.top_p or 1.0))
        seed = int(np.random.SeedSequence([self.seed, self.calls]).generate_state(1)[0] >> 1)
        self.calls += 1
        completions = self.engine.generate([self.prompt_tokens[p] for p in prompts], sampling,
                                           seed)
        # Without the stop token, as vLLM's text leaves it out.
        return types.SimpleNamespace(text=phases.completion_texts(self.tokenizer, completions))


class MaxTextEvaluator:
    """This host's share of MaxText's test rows, scored by MaxText's functions."""

    def __init__(self, config: Any, rows: dict[str, list[str]], reward_fns: Any, tokenizer: Any,
                 host: int, num_hosts: int):
        self.config, self.reward_fns, self.tokenizer = config, list(reward_fns), tokenizer
        self.mode = config.eval_mode
        tokens, keep = {}, []
        share = range(host, len(rows["prompts"]), num_hosts)
        for i in share:
            ids = phases.encode_prompt(tokenizer, i, rows["prompts"][i])
            if len(ids) <= config.max_prefill_predict_length:
                tokens[rows["prompts"][i]] = ids
                keep.append(i)
        if len(keep) < len(share):  # MaxText's filter counts tokens without the BOS
            print(f"evaluation: host {host} leaves out {len(share) - len(keep)} prompts over "
                  f"max_prefill_predict_length={config.max_prefill_predict_length} tokens",
                  file=sys.stderr, flush=True)
        self.rows = {k: [v[i] for i in keep] for k, v in rows.items()}
        self.prompt_tokens = tokens

    def local_sums(self, engine: Engine, seed: int) -> np.ndarray:
        from maxtext.trainers.post_train.rl import evaluate_rl

        sums = dict.fromkeys(SUM_FIELDS, 0.0)
        rows = self.rows
        if rows["prompts"]:
            rollout = EngineRollout(engine, self.tokenizer, self.prompt_tokens, seed)
            responses = evaluate_rl.generate_responses(
                self.config, rows["prompts"], rollout, num_passes=self.config.num_eval_passes)
            for i, (question, answer, prompt, passes) in enumerate(zip(
                    rows["question"], rows["answer"], rows["prompts"], responses, strict=True)):
                acceptable = list(dict.fromkeys(json.loads(answer)))
                corr, partial, fmt = evaluate_rl.score_responses(self.config, question, passes,
                                                                 acceptable)
                reward_sum, reward_count = evaluate_rl._compute_row_reward(
                    self.reward_fns, prompt, question, passes, answer, i)
                sums["corr"] += corr
                sums["partially_corr"] += partial
                sums["corr_format"] += fmt
                sums["total"] += 1
                sums["reward_sum"] += reward_sum
                sums["reward_count"] += reward_count
        return np.array([sums[k] for k in SUM_FIELDS], np.float64)
