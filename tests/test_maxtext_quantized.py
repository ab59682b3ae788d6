"""Quantized rollout in the maxtext engine (MaxText's own model, tiny dense Qwen3 on CPU): KV
pages (`quantize_kvcache`, `kv_quant_dtype`) and projection weights (`quantization`)."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("maxtext")

from tests.test_maxtext_engine import MAX_NEW, World  # noqa: E402
from tunix_mcjax import config  # noqa: E402
from tunix_mcjax.config import ConfigError  # noqa: E402
from tunix_mcjax.engine import (  # noqa: E402
    SamplingParams,
    maxtext_engine,
    maxtext_model,
    pages,
)
from tunix_mcjax.engine import paged_attention as pa  # noqa: E402
from tunix_mcjax.engine.maxtext_engine import MaxTextEngine  # noqa: E402
from tunix_mcjax.maxtext import policy  # noqa: E402
from tunix_mcjax.runtime.engines import engine_options  # noqa: E402

MODES = ["int8", "fp8"]
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)


@functools.cache
def world() -> World:
    return World("qwen3")


def engine_of(layouts=None, **options) -> MaxTextEngine:
    """The world's engine with `options`; `layouts` ({slot: layout}) in place of its own."""
    with pytest.MonkeyPatch.context() as patch:
        if layouts is not None:
            patch.setattr(maxtext_engine, "MaxTextPagedModel", functools.partial(
                maxtext_model.MaxTextPagedModel, layouts=layouts))
        engine = MaxTextEngine(world().config, jax.local_devices()[:1], pad_id=0, eos_ids=(),
                               max_prompt_length=16, max_new_tokens=MAX_NEW, max_batch_size=2,
                               **options)
        engine.load_weights(policy.maxtext_tree(world().params))
        return engine


@functools.cache
def decoded(kv_mode: str = "", reference: bool = False) -> tuple[MaxTextEngine, list]:
    """(the engine over `kv_mode` pages, or over the reference's `DequantizedPages`; its
    greedy completions of the world's prompts), built once."""
    engine = engine_of({0: DequantizedPages(kv_mode), 1: DequantizedPages(kv_mode)}) \
        if reference else engine_of(kv_quantization=kv_mode)
    return engine, engine.generate(world().prompts, GREEDY, seed=0)


class DequantizedPages(pa.SplitPages):
    """The reference: float pages that hold what `QuantizedPages` holds, each written key and
    value quantized and at once dequantized."""

    def __init__(self, mode: str):
        self.mode = mode

    def write(self, pool, pages, offsets, k, v, layer=None):
        k, v = (pa.dequantize_kv(*pa.quantize_kv(x, self.mode), x.dtype)
                for x in (k, pa.finite_values(v)))
        return super().write(pool, pages, offsets, k, v, layer)


@pytest.mark.slow  # MaxText's model, built and compiled for two engines
@pytest.mark.parametrize("mode", MODES)
def test_quantized_pages_decode_as_the_reference_over_their_dequantized_pages(mode):
    """MaxText's model over int8/fp8 pages decodes what it decodes over float pages holding
    the same values dequantized: greedy tokens exactly, logprobs within 1e-5. The pool holds
    the quantized dtype, and its bytes are the engine's page bytes (values, and a bfloat16
    scale per token and kv head)."""
    engine, got = decoded(mode)
    _, want = decoded(mode, reference=True)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    pool = engine._pool(0)
    assert [x.dtype for x in pool[0][:2]] == [pages.KV_MODES[mode]] * 2
    assert engine._page_bytes(1) * engine.num_pages == sum(x.nbytes
                                                           for x in jax.tree.leaves(pool))


@pytest.mark.slow
@pytest.mark.parametrize("mode, least", [("int8", 0.9), ("fp8", 0.5)])
def test_greedy_with_quantized_pages_agrees_with_float_pages(mode, least):
    """Free-running greedy completions over quantized pages agree with the float pool's
    position by position on >= 90% of tokens (int8) and >= 50% (fp8), as the jax engine's
    (tests/test_kv_quant.py); a decode parts at its first flip."""
    _, want = decoded()
    _, got = decoded(mode)
    agree = np.mean([np.asarray(a.tokens) == np.asarray(b.tokens)
                     for a, b in zip(got, want, strict=True)])
    print(f"{mode} pages: {agree:.3f} of greedy tokens agree with float pages")
    assert agree >= least


def test_quantized_pages_are_the_maxtext_engines_and_refused_on_tpu():
    """quantize_kvcache is taken with rollout_engine=maxtext (refused with vllm, by name); the
    engine on a TPU mesh refuses it before its decode model is built, as the jax engine does."""
    cfg = config.load_config(None, ["quantize_kvcache=true", "kv_quant_dtype=fp8",
                                    "rollout_engine=maxtext"])
    assert engine_options(cfg, 0, (1,)).kv_quantization == "fp8"
    with pytest.raises(ConfigError, match="quantize_kvcache=true: rollout_engine=vllm"):
        config.load_config(None, ["quantize_kvcache=true", "rollout_engine=vllm",
                                  "rl_publish_weights_single_call=true"])
    tpu_mesh = type("Mesh", (), {"devices": np.array([type("D", (), {"platform": "tpu"})()])})
    engine = type("E", (), {"options": engine_options(cfg, 0, (1,)), "_models": {}})
    with pytest.raises(ValueError, match="quantize_kvcache=true on TPU"):
        MaxTextEngine._decode_model(engine, tpu_mesh)

