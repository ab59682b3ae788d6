"""MaxText's evaluation two ways on scripted responses: our evaluator over two host shares
(summed as the all-gather sums them) and MaxText's own `evaluate_rl.evaluate`. argv[1]: the
JSON file to write ({"ours": ..., "maxtext": ...})."""

from __future__ import annotations

import json
import multiprocessing.pool  # noqa: F401  MaxText's math_verify_pool uses it without importing it
import sys
import types
from pathlib import Path

import numpy as np

from tests.test_maxtext_adapter import maxtext_argv, recipe_args
from tunix_mcjax.engine import Completion, Engine
from tunix_mcjax.maxtext import checked_config, data
from tunix_mcjax.maxtext.evaluation import MaxTextEvaluator
from tunix_mcjax.runtime import phases
from tunix_mcjax.runtime.evaluation import global_result


class ScriptedEngine(Engine):
    """Answers prompt i's pass p with `texts[i][p]` (its tokens, then EOS)."""

    def __init__(self, tokenizer, prompt_tokens: list[np.ndarray], texts: list[list[str]]):
        self.tokenizer, self.texts = tokenizer, texts
        self.index = {tuple(t.tolist()): i for i, t in enumerate(prompt_tokens)}
        self.passes: dict[int, int] = {}

    def generate(self, prompt_token_ids, sampling, seed):
        out = []
        for prompt in prompt_token_ids:
            i = self.index[tuple(np.asarray(prompt).tolist())]
            p = self.passes.get(i, 0)
            self.passes[i] = p + 1
            ids = self.tokenizer.encode(self.texts[i][p], add_special_tokens=False)
            tokens = np.array([*ids, self.tokenizer.eos_token_id], np.int32)
            out.append(Completion(tokens, np.zeros(len(tokens), np.float32), "eos"))
        return out

    def load_weights(self, params):
        raise NotImplementedError

    @property
    def compile_count(self) -> int:
        return 0


EVAL = [*recipe_args(), "batch_size=4", "num_test_batches=1", "eval_mode=pass_at_1",
        "num_eval_passes=2", "hf_eval_files=recipes/maxtext/cpu/gsm8k_tiny.parquet"]


class ScriptedCluster:
    """What MaxText's evaluate calls (`rl_cluster.rollout.generate`), answering from `texts`."""

    def __init__(self, prompts: list[str], texts: list[list[str]]):
        self.rollout, self.prompts, self.texts, self.calls = self, prompts, texts, 0

    def generate(self, prompts, rollout_config):
        p, self.calls = self.calls, self.calls + 1
        return types.SimpleNamespace(text=[self.texts[self.prompts.index(q)][p] for q in prompts])


def scripted_texts(rows: dict[str, list[str]], passes: int) -> list[list[str]]:
    """The right answer on alternate passes, no answer on the others; the first prompt's right
    answers lack the reasoning block (wrong format). No answer is a near miss, so MaxText's
    math-verify process pool (slow to spawn here) is never needed."""
    texts = []
    for j, answer in enumerate(rows["answer"]):
        right = json.loads(answer)[0]
        reasoning = "" if j == 0 else "<reasoning>sum</reasoning>"
        texts.append([f"{reasoning}<answer>{right}</answer>" if (j + p) % 2 == 0
                      else "<reasoning>sum</reasoning>no idea" for p in range(passes)])
    return texts


def main(out: Path) -> None:
    from maxtext.trainers.post_train.rl import evaluate_rl

    config, _, _ = checked_config(maxtext_argv(*EVAL), {}, num_hosts=2)
    tokenizer = data.load_tokenizer(config)
    _, rows = data.dataset_rows(config, tokenizer)
    texts = scripted_texts(rows, config.num_eval_passes)
    tokens = [phases.encode_prompt(tokenizer, i, p) for i, p in enumerate(rows["prompts"])]
    rewards = data.reward_fns(config)
    per_host = np.stack([
        MaxTextEvaluator(config, rows, rewards, tokenizer, host, 2).local_sums(
            ScriptedEngine(tokenizer, tokens, texts), seed=0) for host in (0, 1)])
    (corr, total, acc, partial, fmt, reward), _ = evaluate_rl.evaluate(
        config, [rows], rl_cluster=ScriptedCluster(rows["prompts"], texts),
        num_passes=config.num_eval_passes, reward_fns=list(rewards))
    maxtext = {"corr": corr, "total": total, "accuracy": acc, "partial_accuracy": partial,
               "format_accuracy": fmt, "mean_reward": reward}
    out.write_text(json.dumps({"ours": global_result(per_host), "maxtext": maxtext}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
