"""The engine benchmark's workload: its profiles, model shapes, prompts and tokenizer.

Every arm sees the same random-init Qwen3 of the profile's shape (`MODELS`), the same prompts
(`make_prompts`: GRPO groups) and ids through `IdTokenizer`; `MAXTEXT_MODELS` are MaxText's
arguments for a model of `MODEL`'s shape (`--engine maxtext`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from tunix.models.qwen3 import model as qwen3

PAD_ID, EOS_ID = 0, 1


@dataclasses.dataclass(frozen=True)
class EngineProfile:
    """A rollout workload: prompts x generations, prompt lengths, completion budget, stops."""

    name: str
    prompts: int
    generations: int
    prompt_lengths: tuple[int, int]  # uniform in [low, high]
    max_new_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]  # with eos, each ends a sequence (~1/vocab each per token)
    decode_batch: int  # rows one replica decodes at once
    repeats: int
    short_cap: int = 0  # also run at this completion cap (same work: stops end every request)
    model: str = "tiny"  # a key of MODELS
    xla_arm: bool = False  # also run the engine with its pages on the XLA path (engine_xla)

    @property
    def requests(self) -> int:
        return self.prompts * self.generations


PROFILES = {
    "gsm8k-cpu": EngineProfile(
        "gsm8k-cpu", prompts=16, generations=4, prompt_lengths=(48, 64), max_new_tokens=64,
        ignore_eos=True, stop_token_ids=(), decode_batch=64, repeats=5,
    ),
    "numina-cpu": EngineProfile(
        "numina-cpu", prompts=16, generations=4, prompt_lengths=(16, 32), max_new_tokens=256,
        ignore_eos=False, stop_token_ids=tuple(range(2, 9)), decode_batch=16, repeats=3,
    ),
    # Decode-heavy RL: a cap far above the typical completion (7 of 1024 ids end a sequence:
    # mean near 150 tokens, a few past 500).
    "eos-cpu": EngineProfile(
        "eos-cpu", prompts=16, generations=4, prompt_lengths=(16, 32), max_new_tokens=1024,
        ignore_eos=False, stop_token_ids=tuple(range(2, 8)), decode_batch=64, repeats=5,
    ),
    # What a cap costs: 25 of 1024 ids end a sequence (mean near 40 tokens, none near 512), at
    # caps of 4096 and 512.
    "eos-cap-cpu": EngineProfile(
        "eos-cap-cpu", prompts=16, generations=4, prompt_lengths=(16, 32), max_new_tokens=4096,
        ignore_eos=False, stop_token_ids=tuple(range(2, 26)), decode_batch=64, repeats=5,
        short_cap=512,
    ),
    # Qwen3-0.6B's shape in bf16 (random init: its 151,936-way distribution meets no stop id,
    # so completions run to the cap and every arm does the same work).
    "qwen3-0.6b-cpu": EngineProfile(
        "qwen3-0.6b-cpu", prompts=4, generations=4, prompt_lengths=(32, 64), max_new_tokens=64,
        ignore_eos=True, stop_token_ids=(), decode_batch=16, repeats=3, model="qwen3-0.6b",
    ),
    # Qwen3-0.6B's shape in bf16 on one GPU: 512 requests through 256 rows, every completion to
    # the cap of 256 (as qwen3-0.6b-cpu), the Pallas decode kernel against the XLA path. On an
    # H200 under jax 0.11.2 the engine's program outran a 2-minute compile (docs/engines.md).
    "qwen3-0.6b-gpu": EngineProfile(
        "qwen3-0.6b-gpu", prompts=64, generations=8, prompt_lengths=(64, 128),
        max_new_tokens=256, ignore_eos=True, stop_token_ids=(), decode_batch=256, repeats=3,
        model="qwen3-0.6b", xla_arm=True,
    ),
    # GRPO groups on long prompts: 8 samples of each ~1k-token prompt, short completions, so
    # a row's keys are mostly its group's prompt (which cascade attention reads once a group).
    "long-prompt-cpu": EngineProfile(
        "long-prompt-cpu", prompts=8, generations=8, prompt_lengths=(896, 1024), max_new_tokens=64,
        ignore_eos=True, stop_token_ids=(), decode_batch=64, repeats=7,
    ),
    # `make demo`'s share of one replica (recipes/cpu/demo.yml on 2 hosts x 2 devices): 4 prompts
    # x 32 samples of 3 tokens, 2 new tokens, its tiny model: what the loop itself costs.
    "demo-cpu": EngineProfile(
        "demo-cpu", prompts=4, generations=32, prompt_lengths=(3, 3), max_new_tokens=2,
        ignore_eos=True, stop_token_ids=(), decode_batch=64, repeats=41, model="demo",
    ),
}  # fmt: skip

# Big enough that compute, not dispatch, dominates a CPU step; small enough for ~5 min total.
MODEL = qwen3.ModelConfig(
    num_layers=4, vocab_size=1024, embed_dim=256, hidden_dim=1024, num_heads=4, head_dim=64,
    num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=True,
    shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=True),
)  # fmt: skip
# Model shapes a profile can name: the tiny one above, the demo's, and Qwen3-0.6B's in bf16.
MODELS = {
    "tiny": MODEL,
    "demo": dataclasses.replace(MODEL, num_layers=2, vocab_size=99, embed_dim=64, hidden_dim=128,
                                head_dim=16),
    "qwen3-0.6b": dataclasses.replace(
        qwen3.ModelConfig.qwen3_0p6b(), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
        shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=True)),
}
MODEL_FIELDS = ("num_layers", "vocab_size", "embed_dim", "hidden_dim", "num_heads", "head_dim",
                "num_kv_heads", "rope_theta", "norm_eps", "use_tied_embedding")


def model_of(profile: EngineProfile) -> qwen3.ModelConfig:
    return MODELS[profile.model]


class IdTokenizer:
    """Tunix-compatible tokenizer over space-separated ids, so both arms see identical tokens.
    bos_id() is 0 (falsy), so Tunix adds no BOS."""

    def encode(self, text: str, **_: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return " ".join(str(i) for i in ids)

    def bos_id(self) -> int:
        return 0

    def eos_id(self) -> int:
        return EOS_ID

    def pad_id(self) -> int:
        return PAD_ID


def make_prompts(profile: EngineProfile, vocab: int, seed: int = 0) -> list[list[int]]:
    """`prompts` distinct random prompts, each repeated `generations` times (GRPO groups)."""
    rng = np.random.default_rng(seed)
    low, high = profile.prompt_lengths
    distinct = [
        rng.integers(9, vocab, size=int(rng.integers(low, high + 1))).tolist()
        for _ in range(profile.prompts)
    ]
    return [p for p in distinct for _ in range(profile.generations)]


# MaxText's Qwen3 at MODEL's shape, CPU kernels, fp32 (`--engine maxtext`).
MAXTEXT_SHAPE = [
    "override_model_config=true",
    f"base_num_decoder_layers={MODEL.num_layers}", f"vocab_size={MODEL.vocab_size}",
    f"base_emb_dim={MODEL.embed_dim}", f"base_mlp_dim={MODEL.hidden_dim}",
    f"base_num_query_heads={MODEL.num_heads}", f"base_num_kv_heads={MODEL.num_kv_heads}",
    f"head_dim={MODEL.head_dim}", "logits_via_embedding=true", "dtype=float32",
    "weight_dtype=float32", "hardware=cpu", "attention=dot_product",
    "convert_checkpoint_if_possible=false", "log_config=false",
]  # fmt: skip
# `--maxtext-model` -> MaxText's arguments: dense Qwen3, or Qwen3 MoE whose 2 active experts
# of 8 have the dense model's MLP width between them (MaxText's own expert computation, its
# CPU path: no megablox, no sparse matmul).
MAXTEXT_MODELS = {
    "qwen3": ["model_name=qwen3-0.6b", *MAXTEXT_SHAPE],
    "qwen3-moe": ["model_name=qwen3-30b-a3b", *MAXTEXT_SHAPE, "num_experts=8",
                  "num_experts_per_tok=2", f"base_moe_mlp_dim={MODEL.hidden_dim // 2}",
                  "megablox=false", "sparse_matmul=false"],
}
