"""Check for patch 0002: Tunix's Sampler can draw a fresh key per unseeded call, when asked.

Run with a tunix copy first on PYTHONPATH. Samples a tiny random Qwen3 at temperature 1: twice
without a seed and twice with seed 7 on a default sampler, twice without a seed on one built with
`fresh_key_per_call=True` (an error where that argument does not exist). Prints one
"REPORT <json>" line.
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
prompts = ["5 6 7 8", "9 10 11 12", "13 14", "15 16 17"]


def sample(sampler: sampler_lib.Sampler, seed: int | None) -> list[list[int]]:
    out = sampler(prompts, max_generation_steps=NEW_TOKENS, max_prompt_length=8,
                  eos_tokens=[VOCAB], temperature=1.0, top_p=1.0, seed=seed)
    return [[int(t) for t in tokens] for tokens in out.tokens]


def fresh_keys() -> list[list[list[int]]] | dict:
    """Two unseeded calls on a sampler that opts in to a fresh key per call."""
    try:
        sampler = sampler_lib.Sampler(model, IdTokenizer(), cache, fresh_key_per_call=True)
    except TypeError as e:
        return {"error": str(e)}
    return [sample(sampler, None), sample(sampler, None)]


default = sampler_lib.Sampler(model, IdTokenizer(), cache)
report = {"sampler": sampler_lib.__file__,
          "unseeded": [sample(default, None), sample(default, None)],
          "seeded": [sample(default, 7), sample(default, 7)], "fresh_keys": fresh_keys()}
print("REPORT " + json.dumps(report))
