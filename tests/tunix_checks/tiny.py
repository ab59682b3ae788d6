"""What the Tunix checks share: a one-layer random Qwen3 and a tokenizer over token ids."""

from __future__ import annotations

from tunix.models.qwen3 import model as qwen3

from tunix_mcjax.bench.engine import IdTokenizer  # pad 0, EOS 1, no BOS

__all__ = ["VOCAB", "IdTokenizer", "tiny_config"]

VOCAB = 64


def tiny_config(is_sampling: bool = False) -> qwen3.ModelConfig:
    """A one-layer, 32-wide Qwen3 with tied embeddings (Tunix's default sharding)."""
    return qwen3.ModelConfig(
        num_layers=1, vocab_size=VOCAB, embed_dim=32, hidden_dim=64, num_heads=2, head_dim=16,
        num_kv_heads=1, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=True,
        shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=is_sampling),
    )  # fmt: skip
