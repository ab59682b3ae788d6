"""Benchmark workloads: the paper's Table 1 at full scale, and scaled-down CPU versions.

Most profiles are a recipe (config keys) plus a synthetic GSM8K-format dataset whose prompt
lengths fill the profile's prompt budget. Timing needs the workload's shape, not its content:
models are random-init and completions are forced to their full budget (`ignore_eos`), so
every arm decodes the same number of tokens. The dataset holds exactly `batches` global
batches, and `data_repeat_period` replays them: steps 0..B-1 and B..2B-1 see the same batches.
`gsm8k-cpu-eos` and `numina-cpu-eos` honour EOS instead, so completions stop early and pack
unevenly as in real RL (numina-cpu-eos far below its 1024-token cap); the equal-work rule
(`bench.equal_work`) then checks that the arms' lengths agree. Training moves a random-init
policy's lengths (at the default learning rate, numina-cpu-eos's mean output over its 40 steps was
96 tokens in the mcjax arm and 124 in Tunix's), so numina-cpu-eos trains at a learning rate too
small to move them: its arms sample from the same length distribution at every step, and a step
costs the same at any rate.
`gsm8k-cpu-lora` is gsm8k-cpu with LoRA on (Tunix's `run_qwen3.sh` rank, alpha and module
path). `demo-cpu` is `recipes/cpu/demo.yml`'s task and config (next digit, 2 new tokens).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tunix_mcjax.config import Config

BATCHES = 20  # distinct global batches; a run covers them twice
WORDS = ("apples", "boxes", "each", "total", "how", "many", "costs", "sold", "per", "week",
         "more", "than", "half", "left", "after", "gave", "buys", "price", "of", "the")


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    character: str  # balanced | decode-heavy | prefill-heavy
    batch_size: int  # prompts per step
    num_generations: int
    prompt_budget: int  # tokens, BOS included
    completion_budget: int
    prompt_chars: tuple[int, int]  # synthetic prompt length range (char tokenizer: chars)
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    ignore_eos: bool = True
    # Another task and its keys instead of the synthetic GSM8K rows (no data file).
    task: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Further keys of every arm (e.g. the learning rate).
    keys: dict[str, Any] = dataclasses.field(default_factory=dict)

    def recipe(self, data_file: str) -> dict[str, Any]:
        """Config keys shared by every arm."""
        data = self.task or {"dataset_name": "gsm8k", "hf_train_files": data_file}
        return {
            **data,
            "data_repeat_period": BATCHES,
            "steps": 2 * BATCHES,
            "batch_size": self.batch_size,
            "num_generations": self.num_generations,
            "max_prefill_predict_length": self.prompt_budget,
            "max_target_length": self.prompt_budget + self.completion_budget,
            "ignore_eos": self.ignore_eos,
            "tokenizer_type": "char",
            **self.model,
            **self.keys,
        }


DEMO_MODEL = {"base_num_decoder_layers": 2, "base_emb_dim": 64, "base_mlp_dim": 128,
              "base_num_query_heads": 4, "base_num_kv_heads": 2, "head_dim": 16}
QWEN3_0P6B = {"model_name": "qwen3-0.6b", "dtype": "bfloat16", "weight_dtype": "float32"}
# Tunix 0.1.7's examples/rl/grpo/gsm8k/run_qwen3.sh LoRA: rank 64, alpha 64, on all seven
# projections (its module path is the `lora_module_path` default).
RUN_QWEN3_LORA = {"lora_rank": 64, "lora_alpha": 64.0,
                  "lora_module_path": Config.lora_module_path}

PROFILES = {p.name: p for p in (
    # Paper Table 1, Qwen3-0.6B shapes (random init). Accelerator scale.
    Profile("gsm8k", "balanced", 128, 16, 512, 2048, (256, 511), QWEN3_0P6B),
    Profile("numina", "decode-heavy", 256, 8, 4096, 8192, (1024, 4095), QWEN3_0P6B),
    Profile("swe", "prefill-heavy", 256, 8, 15360, 1024, (8192, 15359), QWEN3_0P6B),
    # The same three characters at the paper's group sizes and prompt:response shapes, 64 rows
    # per step and a tiny Qwen3, so that each arm runs on two CPU cores in minutes.
    Profile("gsm8k-cpu", "balanced", 4, 16, 32, 128, (12, 31)),
    Profile("numina-cpu", "decode-heavy", 8, 8, 32, 192, (12, 31)),
    Profile("swe-cpu", "prefill-heavy", 8, 8, 256, 16, (160, 255)),
    Profile("gsm8k-cpu-eos", "balanced, EOS honoured", 4, 16, 32, 128, (12, 31),
            ignore_eos=False),
    # Decode-heavy RL as it runs: a 1024-token cap far above the typical completion (a
    # random-init model meets EOS about once in 100 tokens: mean near 100, a few past 400).
    Profile("numina-cpu-eos", "decode-heavy, EOS honoured", 4, 8, 32, 1024, (12, 31),
            ignore_eos=False, keys={"learning_rate": 1e-6}),
    # numina-cpu-eos on 2 decode slots: its 32 requests queue (as an accelerator engine's do
    # when requests outnumber its slots), so groups finish one after another, and decoding
    # lasts about half a 50 ms/completion reward on one worker (`bench.step --streaming`).
    Profile("numina-cpu-eos-queued", "decode-heavy, EOS honoured, requests queue", 4, 8, 32,
            1024, (12, 31), ignore_eos=False,
            keys={"learning_rate": 1e-6, "rollout_max_batch_size": 2}),
    # gsm8k-cpu with run_qwen3.sh's LoRA: the workload of the tunix-cli arm's comparison.
    Profile("gsm8k-cpu-lora", "balanced, LoRA on", 4, 16, 32, 128, (12, 31), RUN_QWEN3_LORA),
    # recipes/cpu/demo.yml: 16 prompts x 32 samples, prompts "d=" (3 tokens with BOS).
    Profile("demo-cpu", "overhead-bound", 16, 32, 4, 2, (3, 3), DEMO_MODEL, ignore_eos=False,
            task={"dataset_name": "next_digit", "seed": 0, "learning_rate": 0.003,
                  "grpo_beta": 0.0, "decode_sampling_temperature": 1.0}),
)}


def synthetic_rows(profile: Profile, seed: int = 0) -> list[dict[str, str]]:
    """`BATCHES x batch_size` GSM8K-format rows with prompt lengths in `profile.prompt_chars`."""
    rng = np.random.default_rng(seed)
    low, high = profile.prompt_chars
    rows = []
    for _ in range(BATCHES * profile.batch_size):
        target = int(rng.integers(low, high + 1))
        text = ""
        while len(text) < target:
            text += f"{WORDS[rng.integers(len(WORDS))]} {rng.integers(100)} "
        rows.append({"question": text[:target - 1] + "?",
                     "answer": f"#### {int(rng.integers(1000))}"})
    return rows


def write_workload(profile: Profile, out_dir: Path, seed: int = 0) -> Path:
    """Writes `<out_dir>/recipe.yml` (and the synthetic rows, `data.jsonl`); returns its path.

    `out_dir` should be relative to the directory the arms run in: the recipe names the
    data file by that same path.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "data.jsonl"
    if not profile.task:
        data.write_text("".join(json.dumps(r) + "\n"
                                for r in synthetic_rows(profile, seed)))
    recipe = out_dir / "recipe.yml"
    recipe.write_text(f"# benchmark profile {profile.name} ({profile.character})\n"
                      + yaml.safe_dump(profile.recipe(str(data)), sort_keys=False))
    return recipe
