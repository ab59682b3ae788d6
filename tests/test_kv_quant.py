"""Quantized KV pages (`quantize_kvcache`, `kv_quant_dtype`: int8, fp8; `kv_quant_axis`: dkv,
tensor) in the jax engine, on the XLA path and the TPU kernel's."""

import json

from tests.mp import force_cpu_devices

force_cpu_devices(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from tests.test_aot import TINY, needs_libtpu, run  # noqa: E402
from tests.test_engine import PAD, VOCAB, params_of  # noqa: E402
from tests.test_paged import (  # noqa: E402
    ReferenceKernelPages,
    ragged_case,
    shared_prefix_case,
    split_layer,
)
from tunix_mcjax import config, engine_plan, models, plan  # noqa: E402
from tunix_mcjax.activations import model_shape  # noqa: E402
from tunix_mcjax.config import ConfigError  # noqa: E402
from tunix_mcjax.engine import kv_quant, pages  # noqa: E402
from tunix_mcjax.engine import paged_attention as pa  # noqa: E402
from tunix_mcjax.engine.base import SamplingParams  # noqa: E402
from tunix_mcjax.engine.jax_engine import JaxEngine  # noqa: E402
from tunix_mcjax.engine.options import EngineOptions  # noqa: E402
from tunix_mcjax.runtime.engines import engine_options  # noqa: E402

MAX_NEW = 16
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, ignore_eos=True)
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(1, VOCAB, size=_rng.integers(2, 10)).tolist() for _ in range(32)]
MODES = ["int8", "fp8"]  # kv_quant_axis=dkv
TENSOR = "fp8_tensor"  # kv_quant_axis=tensor
# Scales other than 1.0 (the engine's), so that a scale applied twice or not at all shows.
SCALES = kv_quant.StaticKvScale(k_scale=0.5, v_scale=2.0)


def quantized_pool(pool_k, pool_v, mode):
    """A layer's pages [pages, page, K, H] each -> QuantizedPages' pool, and the keys and
    values it holds dequantized (float32, SplitPages' layout)."""
    k, v = split_layer(pool_k, pool_v)
    (k_values, k_scale), (v_values, v_scale) = (kv_quant.quantize_kv(k, mode),
                                                kv_quant.quantize_kv(v, mode))
    return (k_values, v_values, k_scale, v_scale), (
        kv_quant.dequantize_kv(k_values, k_scale, jnp.float32),
        kv_quant.dequantize_kv(v_values, v_scale, jnp.float32))


def by_position(x, tables, page_size):
    """SplitPages' [K, pages, page, H] -> each row's [R, L, K, H] by position."""
    g = np.asarray(x)[:, np.maximum(np.asarray(tables), 0)]  # [K, R, n, page, H]
    g = g.reshape(*g.shape[:2], -1, g.shape[-1])
    return jnp.asarray(np.moveaxis(g, 0, 2))


@pytest.mark.parametrize("mode", MODES)
def test_quantized_pages_attend_as_the_reference_over_their_dequantized_pages(mode):
    """XLA's attention over quantized pages (prefill chunks, decode rows, a shared prefix) is
    the definition over the pages dequantized, within 1e-5; and the quantization is close:
    int8 within 1% of each (token, head)'s absmax, fp8 within 1/16 of the value (3 mantissa
    bits) plus 2**-9 of the absmax (subnormals). Pages of 4 tokens: rows cross pages (the
    gather itself is SplitPages', tested at other page sizes in test_paged)."""
    page_size = 4
    (q, _, _, tables, kv_lens, q_lens), pool = ragged_case(page_size)
    layout = pa.QuantizedPages(mode, jnp.float32)
    held, (k, v) = quantized_pool(*pool, mode)
    want = pa.reference_attention(q, by_position(k, tables, page_size),
                                  by_position(v, tables, page_size), kv_lens, q_lens)
    np.testing.assert_allclose(jax.jit(layout.attend)(q, held, tables, kv_lens, q_lens), want,
                               atol=1e-5)
    x = np.moveaxis(pool[0], 2, 0)
    absmax = np.abs(x).max(-1, keepdims=True)
    error = np.abs(np.asarray(k) - x)
    bound = absmax / 100 if mode == "int8" else np.abs(x) / 16 + absmax * 2.0**-9
    assert (error <= bound).all() and error.max() > 0
    (q, _, _, tables, kv_lens, q_lens), pool, prefix = shared_prefix_case(page_size)
    held, (k, v) = quantized_pool(*pool, mode)
    want = pa.reference_attention(q, by_position(k, tables, page_size),
                                  by_position(v, tables, page_size), kv_lens, q_lens)
    got = jax.jit(lambda *a: layout.attend(*a[:-1], prefix=a[-1]))(q, held, tables, kv_lens,
                                                                   q_lens, prefix)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_a_write_stores_values_and_scales_and_a_copy_moves_both(mode):
    """A token written at (layer, page, slot) reads back as its quantize-dequantize, values
    finite (a NaN value becomes 0), and a copied page carries its scales."""
    layout = pa.QuantizedPages(mode, jnp.float32)
    pool = layout.empty(8, 4, 2, 16, jnp.float32, layers=3)
    assert [x.dtype for x in pool] == [pages.KV_MODES[mode]] * 2 + [jnp.bfloat16] * 2
    k = jnp.linspace(-3.0, 5.0, 32).reshape(1, 1, 2, 16)
    v = k.at[0, 0, 1, 3].set(jnp.nan)
    pool = layout.write(pool, jnp.array([[5]]), jnp.array([[2]]), k, v, layer=1)
    got_k, got_v = layout.sequences(pool, jnp.array([[5]]), 1, layer=1)
    np.testing.assert_array_equal(got_k[:, 0, 2], kv_quant.dequantize_kv(
        *kv_quant.quantize_kv(k, mode), jnp.float32)[0, 0])
    assert float(got_v[1, 0, 2, 3]) == 0.0 and np.isfinite(np.asarray(got_v)).all()
    copied = layout.copy_page(pool, 5, 7)
    again = layout.sequences(copied, jnp.array([[7]]), 1, layer=1)
    jax.tree.map(np.testing.assert_array_equal, again, (got_k, got_v))
    assert float(jnp.abs(layout.sequences(pool, jnp.array([[5]]), 1, layer=0)[0]).max()) == 0


def written(layout, pool_k, pool_v):
    """A layer's pages [pages, page, K, H] each written token by token into `layout`'s pool."""
    num_pages, page_size, kv_heads, head_dim = pool_k.shape
    empty = layout.empty(num_pages, page_size, kv_heads, head_dim, jnp.float32)
    page_of, slot_of = np.indices((num_pages, page_size))  # token (r, c) -> page r, slot c
    return jax.jit(layout.write)(empty, jnp.asarray(page_of), jnp.asarray(slot_of),
                                 jnp.asarray(pool_k), jnp.asarray(pool_v))


def test_tensor_scaled_pages_attend_as_the_reference_over_their_stored_pages():
    """kv_quant_axis=tensor on the XLA path: pages hold k / k_scale and v / v_scale in fp8,
    clipped to +-448, and attention over them (prefill chunks, decode rows, a shared prefix) is
    the definition over the stored pages times the scales, within 1e-5 (float32). The
    quantization is close: within 1/16 of the value (3 mantissa bits) plus 2**-10 of the scale
    (half of e4m3's least subnormal)."""
    layout = pa.TensorScaledPages(SCALES, jnp.float32)
    for (q, _, _, tables, kv_lens, q_lens), pool, prefix in ((*ragged_case(4), None),
                                                              shared_prefix_case(4)):
        held = written(layout, *pool)
        assert [x.dtype for x in held] == [jnp.float8_e4m3fn] * 2
        k, v = (kv_quant.StaticKvScale.load(x, s, jnp.float32)
                for x, s in zip(held, (SCALES.k_scale, SCALES.v_scale), strict=True))
        want = pa.reference_attention(q, by_position(k, tables, 4), by_position(v, tables, 4),
                                      kv_lens, q_lens)
        got = jax.jit(lambda *a: layout.attend(*a[:-1], prefix=a[-1]))(
            q, held, tables, kv_lens, q_lens, prefix)
        np.testing.assert_allclose(got, want, atol=1e-5)
    for x, got, scale in ((pool[0], k, SCALES.k_scale), (pool[1], v, SCALES.v_scale)):
        x = np.moveaxis(x, 2, 0)
        error = np.abs(np.asarray(got) - x)
        assert (error <= np.abs(x) / 16 + scale * 2.0**-10).all() and error.max() > 0
    big = jnp.full((1, 1, 1, 4), 1000.0)
    stored = SCALES.store(big, SCALES.v_scale)
    assert float(SCALES.load(stored, SCALES.v_scale, jnp.float32).max()) == 448 * 2.0


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_tpu_kernel_reads_tensor_scaled_pages_as_the_xla_path(dtype, atol):
    """The TPU path on CPU: CombinedPages under a StaticKvScale stores the same fp8 values
    as TensorScaledPages, and the kernel's own reference (`ref_ragged_paged_attention`, which
    applies the k_scale/v_scale CombinedPages passes it, block sizes aside) over them equals
    the XLA path over the same pages: within 1e-5 in float32, and 3e-2 in bfloat16 (the
    engine's TPU dtype; both round the dequantized keys to the queries' dtype, their softmaxes
    differ in where they round)."""
    (q, _, _, tables, kv_lens, q_lens), pool = ragged_case(4)
    q = q.astype(dtype)
    xla = pa.TensorScaledPages(SCALES, dtype)
    kernel = ReferenceKernelPages(kv_scale=SCALES)
    split, combined = written(xla, *pool), written(kernel, *pool)
    assert combined.dtype == jnp.float8_e4m3fn
    assert kernel.kernel_scales() == {"k_scale": 0.5, "v_scale": 2.0}
    for ours, theirs in zip(split, combined.reshape(*combined.shape[:2], -1, 2, 16)
                            .transpose(3, 2, 0, 1, 4), strict=True):
        np.testing.assert_array_equal(ours.astype(jnp.float32), theirs.astype(jnp.float32))
    want = jax.jit(xla.attend)(q, split, tables, kv_lens, q_lens)
    got = jax.jit(kernel.attend)(q, combined, tables, kv_lens, q_lens)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=atol)
    unscaled = jax.jit(ReferenceKernelPages().attend)(q, combined.astype(dtype), tables,
                                                      kv_lens, q_lens)
    assert np.abs(np.asarray(unscaled, np.float32) - np.asarray(got, np.float32)).max() > 0.1


@pytest.fixture(scope="module")
def engines():
    """kv mode -> (a bf16 engine over the tiny model with `kv_quantization=mode`, its greedy
    PROMPTS)."""
    cfg = config.load_config(None, ["rollout_weight_dtype=bfloat16"])
    mc = models.model_config(cfg, vocab_size=VOCAB, for_sampling=True)
    params = params_of(models.create_model(mc, 0))
    cache = {}

    def get(mode):
        if mode not in cache:
            engine = JaxEngine(mc, jax.devices()[:1], pad_id=PAD, eos_ids=(VOCAB - 1,),
                               max_prompt_length=16, max_new_tokens=MAX_NEW,
                               kv_quantization=mode)
            engine.load_weights(params)
            cache[mode] = engine, engine.generate(PROMPTS, GREEDY, 0)
        return cache[mode]

    return get


@pytest.mark.parametrize("mode, least", [("int8", 0.9), ("fp8", 0.5), (TENSOR, 0.5)])
def test_greedy_with_quantized_pages_agrees_with_float_pages(mode, least, engines):
    """Free-running greedy completions agree with the unquantized pool's (the tiny engine
    computes and pages in float32) position by position on >= 90% of tokens (int8; 91.2%
    measured here) and >= 50% (fp8: 71.3%); the random tiny model's logits are near ties and a
    decode parts at its first flip."""
    _, want = engines("")
    engine, got = engines(mode)
    agree = [np.asarray(a.tokens) == np.asarray(b.tokens)
             for a, b in zip(got, want, strict=True)]
    print(f"{mode}: {np.mean(agree):.3f} of tokens agree")
    assert np.mean(agree) >= least
    pool = engine._pool(0)
    assert pool[0].dtype == pages.KV_MODES[mode]


def test_page_bytes_count_values_and_scales_and_the_pool_holds_about_twice_the_pages(engines):
    """A quantized page is a byte a value plus a bfloat16 scale per (token, kv head) (dkv), or
    a byte a value alone (tensor): the bytes the engine's pool holds, and at one budget
    b * H / (H + 2) (dkv) or b (tensor) times the pages of b-byte pages (the tiny engine
    computes in float32); the planner's page term at Qwen3-0.6B is 1.97x (dkv) and 2x
    (tensor) smaller than bf16's (head_dim 128)."""
    bf16, _ = engines("")
    h, itemsize = bf16.model_config.head_dim, np.dtype(bf16.model_config.dtype).itemsize
    for mode, scale_bytes in (("int8", 2), (TENSOR, 0)):
        engine, _ = engines(mode)
        held = sum(x.nbytes for x in jax.tree.leaves(engine._pool(0))) // engine.num_pages
        assert engine._page_bytes(1) == held
        assert bf16._page_bytes(1) * (h + scale_bytes) == engine._page_bytes(1) * itemsize * h
        budget = 1000 * bf16._page_bytes(1)
        ratio = pages.pool_pages(budget, engine._page_bytes(1), 10**9) / 1000
        assert abs(ratio - itemsize * h / (h + scale_bytes)) < 0.01
    base_keys = ["model_name=qwen3-0.6b", "dtype=bfloat16"]
    base = config.load_config(None, base_keys)
    for keys, ratio in (([], 2 * 128 / 130), (["kv_quant_dtype=fp8"], 2 * 128 / 130),
                        (["kv_quant_dtype=fp8", "kv_quant_axis=tensor"], 2.0)):
        cfg = config.load_config(None, [*base_keys, "quantize_kvcache=true", *keys])
        mc = models.model_config(cfg, vocab_size=0, for_sampling=True)
        shape = model_shape(mc, 1)
        cluster = plan.Cluster(1, 1, 95 << 30, tpu=True)
        quantized = engine_plan.paged_shape(cfg, cluster, shape)
        bf16_pages = engine_plan.paged_shape(base, cluster, shape)
        assert bf16_pages.page_bytes / quantized.page_bytes == pytest.approx(ratio)


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match="quantize_kvcache=true: rollout_engine=vllm"):
        config.load_config(None, ["quantize_kvcache=true", "rollout_engine=vllm",
                                  "rl_publish_weights_single_call=true"])
    with pytest.raises(ConfigError, match="kv_quant_dtype"):
        config.load_config(None, ["kv_quant_dtype=int4"])
    with pytest.raises(ConfigError, match="kv_quant_axis"):
        config.load_config(None, ["kv_quant_axis=heads_and_dkv"])
    with pytest.raises(ValueError, match="kv_quant_dtype='int4'"):
        EngineOptions(pad_id=0, eos_ids=(1,), max_prompt_length=4, max_new_tokens=4,
                      kv_quantization="int4")
    with pytest.raises(ValueError, match="QuantizedPages needs kv_quant_dtype"):
        pa.QuantizedPages("")
    assert isinstance(pa.layout_for("tpu", 1, kv_mode="fp8"), pa.QuantizedPages)
    # The engine on a TPU mesh: dkv refused before its decode model is built, naming the fix.
    tpu_mesh = type("Mesh", (), {"devices": np.array([type("D", (), {"platform": "tpu"})()])})
    engine = type("E", (), {"options": EngineOptions(pad_id=0, eos_ids=(1,), max_prompt_length=4,
                                                     max_new_tokens=4, kv_quantization="fp8")})
    with pytest.raises(ValueError, match="kv_quant_axis=dkv on TPU.*set kv_quant_axis=tensor "
                                         "kv_quant_dtype=fp8"):
        JaxEngine._decode_model(engine, tpu_mesh)


def test_the_tensor_mode_is_fp8_only_and_the_kernel_reads_it_on_tpu():
    """kv_quant_axis=tensor: fp8, refused by name with int8 (which needs a calibrated scale);
    on TPU the kernel's layout with scales 1.0 where it tiles a device's kv heads (fp8 packs
    4 combined heads in 32 bits: an even number of kv heads a device), XLA's elsewhere."""
    keys = ["quantize_kvcache=true", "kv_quant_axis=tensor"]
    with pytest.raises(ConfigError, match="kv_quant_axis=tensor kv_quant_dtype=int8"):
        config.load_config(None, keys)
    with pytest.raises(ValueError, match="kv_quant_dtype=int8 kv_quant_axis=tensor"):
        EngineOptions(pad_id=0, eos_ids=(1,), max_prompt_length=4, max_new_tokens=4,
                      kv_quantization="int8_tensor")
    cfg = config.load_config(None, [*keys, "kv_quant_dtype=fp8"])
    assert pages.kv_mode_of(cfg) == TENSOR == engine_options(cfg, 0, (1,)).kv_quantization
    assert pages.kv_mode_of(config.load_config(None, ["kv_quant_axis=tensor"])) == ""
    on_tpu = pa.layout_for("tpu", 1, kv_heads=8, kv_mode=TENSOR)
    assert isinstance(on_tpu, pa.CombinedPages) and on_tpu.kernel_scales() == {
        "k_scale": 1.0, "v_scale": 1.0}
    assert on_tpu.kv_scale.dtype == jnp.float8_e4m3fn
    kv_quant.check_tpu_kv_mode(TENSOR)  # not refused
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "tp"))
    assert pa.layout_for("tpu", 2, mesh=mesh, kv_heads=4, kv_mode=TENSOR).mesh is mesh
    for platform, devices, kv_heads in (("tpu", 1, 1), ("tpu", 2, 2), ("cpu", 1, 8)):
        assert isinstance(pa.layout_for(platform, devices, mesh=mesh, kv_heads=kv_heads,
                                        kv_mode=TENSOR), pa.TensorScaledPages)
    assert isinstance(pa.layout_for("tpu", 1, kv_heads=1), pa.CombinedPages)  # bf16 packs 2


@needs_libtpu
def test_tensor_mode_engine_compiles_for_tpu7x_with_fp8_pages(tmp_path):
    """The AOT command compiles the tiny engine's loop under kv_quant_axis=tensor for TPU7x
    (its 2 kv heads of 128 on one device: the kernel's layout, `layout_for`), and the pool
    XLA updates in place is the planner's pages at head_dim bytes a token and head: fp8,
    half of bf16's."""
    from tunix_mcjax.aot.__main__ import load

    keys = [*TINY, "quantize_kvcache=true", "kv_quant_dtype=fp8", "kv_quant_axis=tensor"]
    out = run(["-m", "tunix_mcjax.aot", "recipes/cpu/demo.yml", *keys, "--topology",
               "tpu7x:2x2x1", "--programs", "engine", "--json", str(tmp_path / "aot.json")])
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads((tmp_path / "aot.json").read_text())
    [row] = result["compiled"]
    assert row["compiled"] and row["fits"], row
    cfg = load("recipes/cpu/demo.yml", keys)
    cluster = plan.Cluster(result["hosts"], result["devices_per_host"], result["hbm_bytes"],
                           tpu=True)
    engine = plan.plan(cfg, cluster, plan.model_config_for(cfg)).engine
    page_size = cfg.vllm_block_size or pages.DEFAULT_PAGE_SIZE  # 1 layer, a byte a value:
    assert engine.page_bytes == page_size * 2 * cfg.base_num_kv_heads * 128
    assert row["aliased"] == engine.pool_pages * engine.page_bytes
    layout = pa.layout_for("tpu", 1, 128, kv_heads=cfg.base_num_kv_heads, kv_mode=TENSOR)
    assert isinstance(layout, pa.CombinedPages) and layout.kv_scale is not None
