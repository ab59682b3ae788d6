"""Every sample of the jax and maxtext engines at fixed seeds, over settings that exercise each
part of the decode loop, written to one JSON file: a refactor of the engine that changes no
behaviour leaves the file equal.

    python tools/engine_samples.py OUT.json [--no-maxtext]

Settings (tiny random-init models, as the tests build them, on CPU): continuous batching
through few rows, chunked prefill under a small token budget, GRPO groups sharing prompt pages,
preemption in the smallest pool the engine takes, packed decode rows (32 slots, a long tail),
lockstep over two devices, fp32 and bf16 weights, and the maxtext engine's Qwen3. Each
setting records every request's tokens, logprobs (as float32 bit patterns, so equality is
exact), length and finish reason, and the loop's counters per program.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' model builders

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tunix_mcjax import config, models  # noqa: E402
from tunix_mcjax.engine import pages  # noqa: E402
from tunix_mcjax.engine.base import SamplingParams  # noqa: E402
from tunix_mcjax.engine.jax_engine import JaxEngine  # noqa: E402

VOCAB, PAD, EOS = 99, 0, 1
GROUPS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [40, 41, 42, 43, 44, 45, 46], [20, 21]]
GRPO = [p for p in GROUPS for _ in range(3)]  # groups of 3 equal prompts
STOPS = tuple(range(2, 9))  # with eos, ~8% of tokens end a sequence: lengths vary
SAMPLE = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=STOPS)
GREEDY = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)
TAIL = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.9, stop_token_ids=STOPS)


def tiny_qwen3(dtype: str):
    """test_engine's tiny Qwen3 (seed 0), weights and activations in `dtype`."""
    cfg = config.load_config(None, {"dtype": dtype, "weight_dtype": dtype})
    mc = models.model_config(cfg, vocab_size=VOCAB, for_sampling=True)
    return mc, nnx.to_pure_dict(nnx.state(models.create_model(mc, 0), nnx.Param))


def record(engine, completions) -> dict:
    return {
        "requests": [{"tokens": c.tokens.tolist(),
                      "logprob_bits": np.asarray(c.logprobs, np.float32).view(np.uint32).tolist(),
                      "logprobs": np.asarray(c.logprobs, np.float64).tolist(),
                      "length": len(c.tokens), "finish_reason": c.finish_reason}
                     for c in completions],
        "stats": engine.last_stats,
    }


def jax_settings(dtype: str) -> dict:
    """The jax engine's settings at one dtype: {name: record}."""
    mc, params = tiny_qwen3(dtype)

    def engine(devices=None, **kwargs):
        options = dict(pad_id=PAD, eos_ids=(EOS,), max_prompt_length=16, max_new_tokens=8,
                       page_size=4)
        made = JaxEngine(mc, devices or jax.devices()[:1], **{**options, **kwargs})
        made.load_weights(params)
        return made

    least = pages.cdiv(16, 4) + pages.sequence_pages(16, 8, 4)
    least_3 = pages.cdiv(16, 3) + pages.sequence_pages(16, 8, 3)
    many = [list(range(10 + i % 7, 12 + i % 7 + i % 9)) for i in range(40)]
    two = jax.devices()[:2]
    runs = {  # name: (engine options, prompts, sampling, seed)
        "grpo_shared_cb4": (dict(max_batch_size=4), GRPO, SAMPLE, 3),
        "preemption": (dict(num_pages=least), GRPO, SAMPLE, 5),
        "packed_tail": (dict(max_new_tokens=32, max_batch_size=32), many, TAIL, 7),
    }
    if dtype == "float32":
        runs |= {
            "grpo_unshared": (dict(prefix_caching=False), GRPO, SAMPLE, 3),
            "chunked_prefill": (dict(max_num_batched_tokens=4), GRPO, SAMPLE, 4),
            "preemption_greedy": (dict(page_size=3, num_pages=least_3), GRPO, GREEDY, 0),
            "no_cb_waves": (dict(continuous_batching=False, max_batch_size=4), GRPO, SAMPLE, 6),
            "lockstep": (dict(lockstep=True, devices=two), GRPO, SAMPLE, 8),
            "two_replicas": (dict(devices=two, max_batch_size=2), GRPO, SAMPLE, 9),
        }
    out = {}
    for name, (options, prompts, sampling, seed) in runs.items():
        made = engine(**options)
        out[f"jax_{dtype}_{name}"] = record(made, made.generate(prompts, sampling, seed=seed))
    return out


def maxtext_settings() -> dict:
    """The maxtext engine over test_maxtext_engine's tiny Qwen3, perturbed weights."""
    from tests.test_maxtext_engine import World

    out = {}
    world = World("qwen3")
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(7, 11, 13))
    out["maxtext_qwen3_cb2"] = record(world.engine, world.engine.generate(
        world.prompts, sampling, seed=11))
    tight = World("qwen3", page_size=4, max_num_batched_tokens=4,
                  num_pages=pages.cdiv(16, 4) + pages.sequence_pages(16, 8, 4))
    grouped = [p for p in world.prompts[:3] for _ in range(3)]
    out["maxtext_qwen3_grpo_tight"] = record(tight.engine, tight.engine.generate(
        grouped, sampling, seed=12))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--no-maxtext", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = {**jax_settings("float32"), **jax_settings("bfloat16")}
    if not args.no_maxtext:
        results.update(maxtext_settings())
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{len(results)} settings in {time.perf_counter() - start:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
