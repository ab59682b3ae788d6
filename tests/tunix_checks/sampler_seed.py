"""Check for patch 0002: Tunix's Sampler without a seed must not reuse one key on every call.

Run with a tunix copy first on PYTHONPATH. Samples a tiny random Qwen3 at temperature 1: twice
without a seed, twice with seed 7. Prints one "REPORT <json>" line.
"""

from __future__ import annotations

import json

from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3

from tests.tunix_checks.tiny import VOCAB, IdTokenizer, tiny_config

NEW_TOKENS = 16
CONFIG = tiny_config(is_sampling=True)


model = qwen3.Qwen3(CONFIG, rngs=nnx.Rngs(0))
cache = sampler_lib.CacheConfig(cache_size=8 + NEW_TOKENS, num_layers=CONFIG.num_layers,
                                num_kv_heads=CONFIG.num_kv_heads, head_dim=CONFIG.head_dim)
sampler = sampler_lib.Sampler(model, IdTokenizer(), cache)
prompts = ["5 6 7 8", "9 10 11 12", "13 14", "15 16 17"]


def sample(seed: int | None) -> list[list[int]]:
    out = sampler(prompts, max_generation_steps=NEW_TOKENS, max_prompt_length=8,
                  eos_tokens=[VOCAB], temperature=1.0, top_p=1.0, seed=seed)
    return [[int(t) for t in tokens] for tokens in out.tokens]


report = {"sampler": sampler_lib.__file__, "unseeded": [sample(None), sample(None)],
          "seeded": [sample(7), sample(7)]}
print("REPORT " + json.dumps(report))
