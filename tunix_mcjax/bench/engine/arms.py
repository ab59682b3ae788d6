"""The engine benchmark's generating arms, each built and warmed up on one device.

An arm builder returns `(measure, info)`: `measure(rep)` runs repeat `rep` (seed `rep + 1`;
the warm-up used seed 0) and returns its measurements, `info` what the arm is (its batch, its
layout, its compiles). `ENGINE_ARMS` are the `--engine` arms beside the JAX engine, which
always runs; the revision arms are in `rev_arms`, the floor in `floor`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from tunix.generate import sampler as tunix_sampler

from tunix_mcjax.bench.engine.workload import EOS_ID, MAXTEXT_MODELS, PAD_ID, IdTokenizer, model_of
from tunix_mcjax.engine import paged_attention
from tunix_mcjax.engine.buckets import pow2_at_least
from tunix_mcjax.engine.jax_engine import JaxEngine
from tunix_mcjax.engine.qwen3_forward import Qwen3PagedModel


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


Measure = Callable[[int], dict[str, float]]  # repeat index -> one repeat's measurements

# `--layout`: the engine arm's page layout; auto is what `layout_for` picks for one device.
LAYOUTS: dict[str, Callable[[], Any] | None] = {
    "auto": None,
    "xla": paged_attention.SplitPages,
    "gpu": paged_attention.GpuPages,
    "gpu-interpret": lambda: paged_attention.GpuPages(interpret=True),
}


def resolve_layout(layout: Any = None) -> Any:
    """`layout`, or the one `layout_for` picks for a one-device replica on this platform."""
    return layout or paged_attention.layout_for(jax.devices()[0].platform, 1)


class PinnedLayoutEngine(JaxEngine):
    """JaxEngine whose replicas decode on `layout`, whatever their platform would pick."""

    def __init__(self, *args: Any, layout: Any, **kwargs: Any):
        self.pinned_layout = layout
        super().__init__(*args, **kwargs)

    def _decode_model(self, mesh):
        return Qwen3PagedModel(self.model_config, mesh, self.pinned_layout)


def engine_arm(
    profile, params, prompts, sampling, *, continuous: bool, batch: int, layout: Any = None,
    **fields: Any,
) -> tuple[Measure, dict]:
    """A warmed-up JaxEngine decoding at most `batch` rows at once (CB or waves), its
    completion cap `sampling.max_new_tokens`, its pages on `layout` (None: its platform's);
    `fields` are further EngineOptions fields (quantization, kv_quantization)."""
    options = {"layout": layout} if layout is not None else {}
    engine = (PinnedLayoutEngine if layout is not None else JaxEngine)(
        model_of(profile), jax.devices()[:1], pad_id=PAD_ID, eos_ids=(EOS_ID,),
        max_prompt_length=pow2_at_least(profile.prompt_lengths[1]),
        max_new_tokens=sampling.max_new_tokens, continuous_batching=continuous,
        max_batch_size=batch, **options, **fields,
    )  # fmt: skip
    engine.load_weights(params)
    engine.generate(prompts, sampling, seed=0)  # compile
    info = {"decode_batch": min(batch, pow2_at_least(profile.requests)),
            "pool_pages": engine.num_pages, "page_size": engine.options.page_size,
            "layout": type(resolve_layout(layout)).__name__}

    def measure(rep: int) -> dict[str, float]:
        wall, out = timed(lambda: engine.generate(prompts, sampling, seed=rep + 1))
        info["compile_count"] = engine.compile_count
        stats = engine.last_stats
        return {
            "wall_s": wall,
            "tokens": sum(len(c.tokens) for c in out),
            "iterations": sum(s["iterations"] for s in stats),
            "peak_pages": max(s["peak_pages"] for s in stats),
            "shared_pages": sum(s["shared_pages"] for s in stats),
            "preemptions": sum(s["preemptions"] for s in stats),
            "packed_steps": sum(s["packed_steps"] for s in stats),
            "completions": [c.tokens.tolist() for c in out],
        }

    return measure, info


def maxtext_arm(profile, _params, prompts, sampling,
                model_args: Sequence[str] = tuple(MAXTEXT_MODELS["qwen3"])
                ) -> tuple[Measure, dict]:
    """The maxtext engine (MaxText's own model of `model_args`, random init, MODEL's shape)
    with the same loop settings as the `engine` arm: continuous batching through
    `decode_batch` rows. It has its own params (MaxText's init), not the JAX engine's."""
    if profile.model != "tiny":
        raise ValueError(f"--engine maxtext builds the tiny shape only; profile {profile.name} "
                         f"is {profile.model}")
    batch = profile.decode_batch
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    from tunix_mcjax.engine.maxtext_engine import MaxTextEngine
    from tunix_mcjax.maxtext import load_maxtext_config, policy

    rl_yml = f"{MAXTEXT_CONFIGS_DIR}/post_train/rl.yml"
    config, _ = load_maxtext_config(["", rl_yml, *model_args], {})
    model, _ = policy.build_model(config, pad_id=PAD_ID)
    _, params = policy.maxtext_policy(model, config)
    engine = MaxTextEngine(
        config, jax.devices()[:1], pad_id=PAD_ID, eos_ids=(EOS_ID,),
        max_prompt_length=pow2_at_least(profile.prompt_lengths[1]),
        max_new_tokens=profile.max_new_tokens, max_batch_size=batch,
    )  # fmt: skip
    engine.load_weights(policy.maxtext_tree(params))
    engine.generate(prompts, sampling, seed=0)  # compile
    info = {"decode_batch": min(batch, pow2_at_least(profile.requests))}

    def measure(rep: int) -> dict[str, float]:
        wall, out = timed(lambda: engine.generate(prompts, sampling, seed=rep + 1))
        info["compile_count"] = engine.compile_count
        return {"wall_s": wall, "tokens": sum(len(c.tokens) for c in out),
                "iterations": sum(engine.last_iterations),
                "completions": [c.tokens.tolist() for c in out]}

    return measure, info


def tunix_arm(profile, model, prompts, sampling, compiles: list[int]) -> tuple[Measure, dict]:
    """A warmed-up Tunix Sampler over the same model, whole batch per call."""
    prompt_bucket = pow2_at_least(profile.prompt_lengths[1])
    cache = tunix_sampler.CacheConfig(
        cache_size=prompt_bucket + profile.max_new_tokens, num_layers=model_of(profile).num_layers,
        num_kv_heads=model_of(profile).num_kv_heads, head_dim=model_of(profile).head_dim,
    )  # fmt: skip
    sampler = tunix_sampler.Sampler(model, IdTokenizer(), cache)
    texts = [" ".join(map(str, p)) for p in prompts]
    ends = [model_of(profile).vocab_size] if sampling.ignore_eos \
        else [EOS_ID, *sampling.stop_token_ids]

    def call(seed: int):
        return sampler(
            texts, max_generation_steps=profile.max_new_tokens, max_prompt_length=prompt_bucket,
            eos_tokens=ends, temperature=sampling.temperature, top_p=1.0, top_k=None,
            seed=seed, return_logprobs=True,
        )  # fmt: skip

    before = compiles[0]
    call(0)  # compile
    info = {"compile_count": compiles[0] - before}

    def measure(rep: int) -> dict[str, float]:
        wall, out = timed(lambda: call(rep + 1))
        # Tunix drops the stop token from its output; count it as generated, as we do.
        tokens = sum(min(len(t) + 1, profile.max_new_tokens) for t in out.tokens)
        return {"wall_s": wall, "tokens": tokens}

    return measure, info


def vllm_arm(profile, params, prompts, sampling) -> tuple[Measure, dict]:
    """A warmed-up VllmEngine (vLLM in-process) over the same weights, whole batch per call."""
    from tunix_mcjax.engine.vllm_engine import VllmEngine

    engine = VllmEngine(
        model_of(profile), jax.devices()[:1], pad_id=PAD_ID, eos_ids=(EOS_ID,),
        max_prompt_length=pow2_at_least(profile.prompt_lengths[1]),
        max_new_tokens=profile.max_new_tokens, max_num_seqs=profile.decode_batch)
    publish_s, _ = timed(lambda: engine.load_weights(params))
    engine.generate(prompts, sampling, seed=0)  # warm-up
    info = {"compile_count": engine.compile_count, "decode_batch": profile.decode_batch,
            "publish_s": publish_s}

    def measure(rep: int) -> dict[str, float]:
        wall, out = timed(lambda: engine.generate(prompts, sampling, seed=rep + 1))
        return {"wall_s": wall, "tokens": sum(len(c.tokens) for c in out)}

    return measure, info


# `--engine` arms beside the JAX engine (which always runs): name -> arm builder.
ENGINE_ARMS = {"maxtext": maxtext_arm, "vllm": vllm_arm}
