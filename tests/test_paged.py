"""The paged engine: attention over pages against its definition and JAX's TPU kernel's, and the
loop's pool, prefix sharing, chunked prefill and preemption against unconstrained runs."""

import functools
import os

from tests.mp import force_cpu_devices

force_cpu_devices(2)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa  # noqa: E402

from tests.test_engine import (  # noqa: E402
    GREEDY,
    MAX_NEW,
    PAD,
    VOCAB,
    as_lists,
    assert_greedy_matches,
    params_of,
)
from tunix_mcjax import config, hostmem, models  # noqa: E402
from tunix_mcjax.engine import paged_attention as pa  # noqa: E402
from tunix_mcjax.engine import pages  # noqa: E402
from tunix_mcjax.engine.base import SamplingParams  # noqa: E402
from tunix_mcjax.engine.jax_engine import JaxEngine  # noqa: E402

# Groups of equal prompts (GRPO), lengths that no page size below divides evenly.
GROUPS = [[5, 6, 7], [8, 9, 10, 11, 12], [3], [40, 41, 42, 43, 44, 45, 46], [20, 21]]
PROMPTS = [p for p in GROUPS for _ in range(3)]
STOPS = tuple(range(2, 9))  # with eos, ~8% of tokens end a sequence: lengths vary
SAMPLE = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop_token_ids=STOPS)


# ----- attention over pages ----------------------------------------------------------------


def ragged_case(page_size: int, seed: int = 0):
    """Rows of mixed prefill chunks and decode tokens over a shuffled pool; rows 0 and 1 share
    their first pages (two samples of one prompt), row 3 is empty padding. Returns q, each
    row's keys and values by position, tables, kv_lens, q_lens."""
    rng = np.random.default_rng(seed)
    kv_lens = np.array([13, 11, 22, 0, 1, 9], np.int32)
    q_lens = np.array([1, 6, 4, 0, 1, 9], np.int32)  # decode, chunk, chunk, pad, decode, prefill
    table_pages = pages.cdiv(int(kv_lens.max()), page_size) + 1
    num_pages = 2 + sum(pages.cdiv(int(n), page_size) for n in kv_lens)
    order = rng.permutation(num_pages)
    tables = np.full((len(kv_lens), table_pages), -1, np.int32)
    used = 0
    for r, n in enumerate(kv_lens):
        count = pages.cdiv(int(n), page_size)
        tables[r, :count] = order[used:used + count]
        used += count
    tables[1, :11 // page_size] = tables[0, :11 // page_size]  # row 1's full pages are row 0's
    length = table_pages * page_size
    k_seq = np.zeros((len(kv_lens), length, 2, 16), np.float32)  # 2 kv heads
    v_seq = np.zeros_like(k_seq)
    pool_k = rng.normal(size=(num_pages, page_size, 2, 16)).astype(np.float32)
    pool_v = rng.normal(size=(num_pages, page_size, 2, 16)).astype(np.float32)
    for r in range(len(kv_lens)):
        for i, page in enumerate(tables[r]):
            if page >= 0:
                k_seq[r, i * page_size:(i + 1) * page_size] = pool_k[page]
                v_seq[r, i * page_size:(i + 1) * page_size] = pool_v[page]
    q = rng.normal(size=(len(kv_lens), 9, 4, 16)).astype(np.float32)  # 4 query heads, chunk 9
    case = tuple(map(jnp.asarray, (q, k_seq, v_seq, tables, kv_lens, q_lens)))
    return case, (pool_k, pool_v)


def split_layer(pool_k, pool_v):
    """The pool in SplitPages' layout: [kv_heads, pages, page_size, head_dim] each."""
    return jnp.asarray(np.moveaxis(pool_k, 2, 0)), jnp.asarray(np.moveaxis(pool_v, 2, 0))


def combined_layer(pool_k, pool_v):
    """The pool in CombinedPages' (the TPU kernel's) layout."""
    kv = np.stack([pool_k, pool_v], axis=-2).reshape(*pool_k.shape[:2], -1, pool_k.shape[-1])
    return jnp.asarray(kv)


@pytest.mark.parametrize("page_size", [3, 4, 5, 16])
def test_split_pages_attention_equals_the_reference_on_ragged_rows(page_size):
    (q, k_seq, v_seq, tables, kv_lens, q_lens), pool = ragged_case(page_size)
    want = pa.reference_attention(q, k_seq, v_seq, kv_lens, q_lens)
    layout = pa.SplitPages()
    attend = jax.jit(layout.attend)
    got = attend(q, split_layer(*pool), tables, kv_lens, q_lens)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.all(np.asarray(got)[3] == 0) and np.all(np.asarray(got)[0, 1:] == 0)  # padding
    # The decode row (query 0 at position 12) sees key 12: moving it moves the output.
    pool_k = pool[0].copy()
    pool_k[int(tables[0, 12 // page_size]), 12 % page_size] += 1.0
    moved = attend(q, split_layer(pool_k, pool[1]), tables, kv_lens, q_lens)
    assert np.abs(np.asarray(moved)[0, 0] - np.asarray(got)[0, 0]).max() > 1e-3


@pytest.mark.parametrize("soft_cap", [None, 2.0])
def test_gpu_decode_kernel_equals_the_reference_in_pallas_interpret_mode(soft_cap):
    """The GPU path, on CPU: JAX's Pallas GPU `paged_attention` in its interpreter, on decode
    rows (one query each; row 3 is padding) over shared and shuffled pages with page sizes
    that do not divide the lengths; prefill chunks and windows take SplitPages' path."""
    (q, k_seq, v_seq, tables, kv_lens, _), pool = ragged_case(3)
    decode_q, decode_lens = q[:, :1], (kv_lens > 0).astype(jnp.int32)
    want = pa.reference_attention(decode_q, k_seq, v_seq, kv_lens, decode_lens,
                                  soft_cap=soft_cap)
    gpu = pa.GpuPages(interpret=True)
    got = gpu.attend(decode_q, split_layer(*pool), tables, kv_lens, decode_lens,
                     soft_cap=soft_cap)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.all(np.asarray(got)[3] == 0)
    (q, k_seq, v_seq, tables, kv_lens, q_lens), pool = ragged_case(4)
    chunks = gpu.attend(q, split_layer(*pool), tables, kv_lens, q_lens, window=5)
    np.testing.assert_allclose(chunks, pa.reference_attention(q, k_seq, v_seq, kv_lens, q_lens,
                                                              window=5), atol=1e-5)
    assert [type(pa.layout_for(*case)).__name__ for case in
            [("gpu", 1), ("gpu", 2), ("tpu", 1), ("tpu", 1, 256), ("tpu", 4), ("tpu", 1, 64),
             ("cpu", 1)]] == ["GpuPages", "SplitPages", "CombinedPages", "SplitPages",
                              "SplitPages", "SplitPages", "SplitPages"]


def test_attention_reads_only_live_slots_of_a_rows_pages():
    """Stale slots (every page no row uses, and the slots past each row's length) never reach
    the output: NaN keys there are masked out, huge values get probability exactly 0. Values
    are finite in any page, since a layout writes non-finite values as 0."""
    (q, k_seq, v_seq, tables, kv_lens, q_lens), (pool_k, pool_v) = ragged_case(4)
    live = np.zeros(pool_k.shape[:2], bool)
    for r, table in enumerate(np.asarray(tables)):
        for t in range(int(kv_lens[r])):
            live[table[t // 4], t % 4] = True
    stale_k = np.where(live[:, :, None, None], pool_k, np.nan)
    stale_v = np.where(live[:, :, None, None], pool_v, 1e30)
    got = jax.jit(pa.SplitPages().attend)(q, split_layer(stale_k, stale_v), tables, kv_lens,
                                          q_lens)
    np.testing.assert_allclose(got, pa.reference_attention(q, k_seq, v_seq, kv_lens, q_lens),
                               atol=1e-5)
    written = pa.SplitPages().write(split_layer(pool_k, pool_v), jnp.array([[0]]),
                                    jnp.array([[0]]), jnp.zeros((1, 1, 2, 16)),
                                    jnp.full((1, 1, 2, 16), jnp.nan))
    assert bool(jnp.all(jnp.isfinite(written[1])))
    assert pa.page_buckets(6) == (1, 2, 3, 4, 5, 6)
    assert pa.page_buckets(21) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 15, 18, 21)


def shared_prefix_case(page_size: int, seed: int = 0):
    """Decode rows of four prompts (3, 2, 1 and 2 samples, lengths 7, 13, 2 and 16: the 2-token
    prompt fills no page) in shuffled rows, one padding row: each row's table begins with its
    prompt's full pages and goes on with its own. Returns q, keys and values by position,
    tables, kv_lens, q_lens and the SharedPrefix."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.array([7, 13, 2, 16], np.int32)
    row_prompt = rng.permutation([0, 0, 0, 1, 1, 2, 3, 3, 0])  # the last 0 becomes padding
    padding = int(np.flatnonzero(row_prompt == 0)[-1])
    kv_lens = prompt_lens[row_prompt] + rng.integers(1, 12, size=len(row_prompt)).astype(np.int32)
    q_lens = np.ones(len(row_prompt), np.int32)
    kv_lens[padding], q_lens[padding] = 0, 0
    full = prompt_lens // page_size
    width = 16 // page_size
    table_pages = pages.cdiv(int(kv_lens.max()), page_size)
    num_pages = int(full.sum()) + len(row_prompt) * table_pages
    order = iter(rng.permutation(num_pages))
    prompt_tables = np.full((4, width), -1, np.int32)
    for u, n in enumerate(full):
        prompt_tables[u, :n] = [next(order) for _ in range(n)]
    tables = np.full((len(row_prompt), table_pages), -1, np.int32)
    for r, u in enumerate(row_prompt):
        if r == padding:
            continue
        tables[r, :full[u]] = prompt_tables[u, :full[u]]
        for i in range(full[u], pages.cdiv(int(kv_lens[r]), page_size)):
            tables[r, i] = next(order)
    pool_k = rng.normal(size=(num_pages, page_size, 2, 16)).astype(np.float32)
    pool_v = rng.normal(size=(num_pages, page_size, 2, 16)).astype(np.float32)
    k_seq = np.zeros((len(row_prompt), table_pages * page_size, 2, 16), np.float32)
    v_seq = np.zeros_like(k_seq)
    for r in range(len(row_prompt)):
        for i, page in enumerate(tables[r]):
            if page >= 0:
                k_seq[r, i * page_size:(i + 1) * page_size] = pool_k[page]
                v_seq[r, i * page_size:(i + 1) * page_size] = pool_v[page]
    q = rng.normal(size=(len(row_prompt), 1, 4, 16)).astype(np.float32)
    prefix = pa.SharedPrefix(jnp.asarray(prompt_tables), jnp.asarray(full),
                             jnp.asarray(row_prompt, jnp.int32), group=4)
    case = tuple(map(jnp.asarray, (q, k_seq, v_seq, tables, kv_lens, q_lens)))
    return case, (pool_k, pool_v), prefix


@pytest.mark.parametrize("options", [{}, dict(window=5, sinks=jnp.asarray([0.5, -1.0, 2.0, 0.0]),
                                             soft_cap=2.0, scale=0.3)],
                         ids=["plain", "window+sinks+cap"])
@pytest.mark.parametrize("page_size", [3, 4, 16])
def test_a_groups_shared_prompt_pages_are_attended_once_with_the_same_result(page_size, options):
    """Cascade attention: each prompt's full pages gathered once for all its rows, the rows'
    own pages after, merged by log-sum-exp, equals the reference over each row's whole table."""
    (q, k_seq, v_seq, tables, kv_lens, q_lens), pool, prefix = shared_prefix_case(page_size)
    want = pa.reference_attention(q, k_seq, v_seq, kv_lens, q_lens, **options)
    attend = jax.jit(lambda q, layer, tables, kv_lens, q_lens, prefix: pa.SplitPages().attend(
        q, layer, tables, kv_lens, q_lens, prefix=prefix, **options))
    got = attend(q, split_layer(*pool), tables, kv_lens, q_lens, prefix)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.all(np.asarray(got)[np.asarray(q_lens) == 0] == 0)
    # A key of prompt 1's first page moves both of its rows (read through the shared part).
    if page_size < 13 and "window" not in options:  # a window of 5 no longer sees position 0
        pool_k = pool[0].copy()
        pool_k[int(prefix.tables[1, 0]), 0] += 3.0
        moved = attend(q, split_layer(pool_k, pool[1]), tables, kv_lens, q_lens, prefix)
        rows = np.flatnonzero(np.asarray(prefix.row_prompt) == 1)
        change = np.abs(np.asarray(moved) - np.asarray(got)).max(axis=(1, 2, 3))
        assert np.all(change[rows] > 1e-4) and np.all(np.delete(change, rows) == 0)


@pytest.mark.parametrize("page_size", [4, 16])
def test_tpu_kernel_arguments_pass_its_validators_and_its_reference_agrees(page_size):
    """The TPU path's page layout and packed queries, checked on CPU: JAX's
    `ragged_paged_attention` validators accept our arguments (static: shapes and dtypes;
    dynamic: lengths against pages and tokens), and the kernel's own reference on them equals
    our definition within 1e-5 (fp32). The kernel itself does not run in the TPU interpreter
    (jax 0.12.0.1)."""
    (q, k_seq, v_seq, tables, kv_lens, q_lens), pool = ragged_case(page_size)
    kv_pages = combined_layer(*pool)
    args, where = pa.rpa_arguments(q, tables, kv_lens, q_lens)
    scale = q.shape[-1] ** -0.5
    rpa.static_validate_inputs(args[0], kv_pages, *args[1:], sm_scale=scale)
    rpa.dynamic_validate_inputs(args[0], kv_pages, *args[1:], sm_scale=scale)
    assert int(args[3][-1]) == int(q_lens.sum()) and int(args[4][0]) == q.shape[0]
    theirs = rpa.ref_ragged_paged_attention(args[0], kv_pages, *args[1:], sm_scale=scale)
    got = pa.unpack_rows(theirs, where, q.shape)
    np.testing.assert_allclose(got, pa.reference_attention(q, k_seq, v_seq, kv_lens, q_lens),
                               atol=1e-5)


class ReferenceKernelPages(pa.CombinedPages):
    """CombinedPages with the TPU kernel's own reference in the kernel's place (the kernel does
    not run on CPU), block sizes aside, called back on each device's concrete arrays (it loops
    over them in Python): what the head split around it computes."""

    @staticmethod
    def kernel(packed, kv_pages, *rest, **options):
        seen.append((packed.shape, kv_pages.shape))
        def reference(*args):  # its real tokens' rows; the kernel's shape has every token's
            out = np.asarray(rpa.ref_ragged_paged_attention(*args, **options))
            return np.pad(out, ((0, packed.shape[0] - out.shape[0]), (0, 0), (0, 0)))

        return jax.pure_callback(reference, jax.ShapeDtypeStruct(packed.shape, packed.dtype),
                                 packed, kv_pages, *rest)


seen: list[tuple] = []


@pytest.mark.parametrize("window", [None, 5])
def test_tpu_kernel_on_each_devices_heads_equals_the_reference(window):
    """Tensor parallelism on TPU: over a replica mesh of 2 devices the kernel runs on each
    device's kv head (its keys and values, combined heads 2i and 2i + 1) and that head's query
    group, and the rows it returns are the whole-head reference's."""
    from jax.sharding import Mesh, NamedSharding

    (q, k_seq, v_seq, tables, kv_lens, q_lens), pool = ragged_case(4)
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "tp"))
    layout = ReferenceKernelPages(mesh)
    kv_pages = jax.device_put(combined_layer(*pool)[None], NamedSharding(mesh, layout.spec(None)))
    seen.clear()
    got = jax.jit(functools.partial(layout.attend, window=window, layer=0))(
        q, kv_pages, tables, kv_lens, q_lens)
    want = pa.reference_attention(q, k_seq, v_seq, kv_lens, q_lens, window=window)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert [(p[1], k[2]) for p, k in seen] == [(2, 2)]  # 2 of 4 query heads, 1 of 2 kv heads
    assert pa.layout_for("tpu", 2, mesh=mesh, kv_heads=2).mesh is mesh
    assert isinstance(pa.layout_for("tpu", 2, mesh=mesh, kv_heads=3), pa.SplitPages)


def brute_force(q, k_seq, v_seq, kv_lens, q_lens, window, sinks, scale):
    """Sliding window and sinks one query at a time, in numpy: the definition's definition."""
    q, k_seq, v_seq = (np.asarray(x, np.float64) for x in (q, k_seq, v_seq))
    out = np.zeros_like(q)
    groups = q.shape[2] // k_seq.shape[2]
    for r in range(q.shape[0]):
        for j in range(int(q_lens[r])):
            p = int(kv_lens[r]) - int(q_lens[r]) + j
            keys = [t for t in range(int(kv_lens[r])) if t <= p and (not window or t > p - window)]
            for n in range(q.shape[2]):
                scores = np.array([q[r, j, n] @ k_seq[r, t, n // groups] for t in keys]) * scale
                sink = [] if sinks is None else [float(sinks[n])]
                weights = np.exp(np.concatenate([scores, sink]) - np.max([*scores, *sink]))
                weights /= weights.sum()
                out[r, j, n] = weights[:len(keys)] @ v_seq[r, keys, n // groups]
    return out


@pytest.mark.parametrize("window,with_sinks", [(4, False), (None, True), (5, True)],
                         ids=["window", "sinks", "window+sinks"])
@pytest.mark.parametrize("page_size", [3, 4])
def test_sliding_window_and_sinks_by_position(page_size, window, with_sinks):
    """`window` by token position (MaxText's LOCAL_SLIDING: p - window < k <= p), and per-head
    sinks in each softmax's denominator: the reference is a brute force's, and the XLA pages
    are the reference, rows crossing pages and past the window alike."""
    (q, k_seq, v_seq, tables, kv_lens, q_lens), pool = ragged_case(page_size)
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0]) if with_sinks else None
    options = dict(window=window, sinks=sinks, scale=0.3)
    want = pa.reference_attention(q, k_seq, v_seq, kv_lens, q_lens, **options)
    np.testing.assert_allclose(want, brute_force(q, k_seq, v_seq, kv_lens, q_lens, window,
                                                 sinks, 0.3), atol=1e-5)
    got = jax.jit(lambda *a: pa.SplitPages().attend(*a, **options))(
        q, split_layer(*pool), tables, kv_lens, q_lens)
    np.testing.assert_allclose(got, want, atol=1e-5)
    plain = pa.reference_attention(q, k_seq, v_seq, kv_lens, q_lens, scale=0.3)
    assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 1e-3  # the options do something


@pytest.mark.parametrize("layout", [pa.SplitPages(), pa.CombinedPages()],
                         ids=["split", "combined"])
def test_each_layout_writes_and_copies_pages_where_the_tables_say(layout):
    """A token written at (page, slot) reads back at its position in every row whose table
    holds that page, and a copied page holds its source's keys and values."""
    (_, k_seq, v_seq, tables, kv_lens, _), _ = ragged_case(4)
    layer = layout.empty(40, 4, 2, 16, jnp.float32)
    k = jnp.ones((1, 1, 2, 16)) * jnp.arange(16.0)
    page = int(tables[0, 2])
    layer = layout.write(layer, jnp.array([[page]]), jnp.array([[1]]), k, -k)
    got_k, got_v = layout.sequences(layer, tables, tables.shape[1])  # [K, R, L, H]
    np.testing.assert_array_equal(got_k[:, 0, 9], k[0, 0])
    np.testing.assert_array_equal(got_v[:, 0, 9], -k[0, 0])
    assert float(jnp.abs(got_k[:, 0, 8]).max()) == 0.0
    copied = layout.copy_page(layer, page, 39)
    again, _ = layout.sequences(copied, jnp.array([[-1, -1, 39]]), 3)
    np.testing.assert_array_equal(again[:, 0, 9], k[0, 0])


def test_free_stack_hands_out_distinct_pages_and_takes_them_back():
    stack = pages.full_stack(6)
    want = jnp.array([[True, False, True], [True, False, False]])
    taken, stack = pages.take(stack, want)
    got = np.asarray(taken)
    assert int(stack.count) == 3 and sorted(got[got >= 0].tolist()) == [0, 1, 2]
    assert np.all(got[~np.asarray(want)] == -1)
    stack = pages.give(stack, taken, want)
    again, _ = pages.take(stack, jnp.ones((6,), bool))
    assert sorted(np.asarray(again).tolist()) == list(range(6))


# ----- the loop ------------------------------------------------------------------------------


EOS = 1  # in no prompt


@pytest.fixture(scope="module")
def tiny():
    """test_engine's tiny random-init Qwen3: (model config, model)."""
    mc = models.model_config(config.load_config(None), vocab_size=VOCAB, for_sampling=True)
    return mc, models.create_model(mc, 0)


def paged_engine(tiny, **kwargs):
    model_config, model = tiny
    engine = JaxEngine(model_config, jax.devices()[:1], pad_id=PAD, eos_ids=(EOS,),
                       max_prompt_length=16, max_new_tokens=MAX_NEW, **kwargs)
    engine.load_weights(params_of(model))
    return engine


@pytest.fixture(scope="module")
def roomy(tiny):
    """Pages of 4 tokens, a pool that never runs dry."""
    return paged_engine(tiny, page_size=4)


def test_groups_share_prompt_pages_and_sharing_changes_no_sample(roomy, tiny):
    shared = roomy.generate(PROMPTS, SAMPLE, seed=3)
    stats = roomy.last_stats[0]
    # The 2nd and 3rd row of each group read its full pages (floor(len / 4)) instead of owning.
    assert stats["shared_pages"] == sum(2 * (len(p) // 4) for p in GROUPS)
    assert stats["preemptions"] == 0
    alone = paged_engine(tiny, page_size=4, prefix_caching=False)
    assert as_lists(alone.generate(PROMPTS, SAMPLE, seed=3)) == as_lists(shared)
    assert alone.last_stats[0]["shared_pages"] == 0
    assert alone.last_stats[0]["peak_pages"] > stats["peak_pages"]
    assert len({len(c.tokens) for c in shared}) > 1  # stops fired: rows ended at different steps


def test_chunked_prefill_under_a_small_token_budget_changes_nothing(roomy, tiny):
    """A budget of 4 tokens prefills the 7-token prompt in 2 chunks (and its other prompts one
    per iteration): logits and samples are those of whole-prompt prefill."""
    want = roomy.generate(PROMPTS, SAMPLE, seed=4)
    assert roomy.last_stats[0]["prefill_steps"] == 1  # every prompt in one step of 8 x 5 rows
    small = paged_engine(tiny, page_size=4, max_num_batched_tokens=4)
    got = small.generate(PROMPTS, SAMPLE, seed=4)
    assert as_lists(got) == as_lists(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert small.last_stats[0]["prefill_steps"] >= 6  # 7 chunks of 4 tokens, one row a step


@pytest.mark.parametrize("page_size", [3, 5])
def test_greedy_is_the_full_forward_across_preemption_and_recompute(tiny, page_size):
    """A pool of one sequence at the caps (the least the engine takes): rows are preempted and
    recomputed, and every token is still Tunix's argmax with its logprob."""
    least = pages.cdiv(16, page_size) + pages.sequence_pages(16, MAX_NEW, page_size)
    tight = paged_engine(tiny, page_size=page_size, num_pages=least)
    out = tight.generate(PROMPTS, GREEDY, seed=0)
    assert tight.last_stats[0]["preemptions"] > 0
    assert tight.last_stats[0]["peak_pages"] <= least
    for prompt, completion in zip(PROMPTS, out, strict=True):
        assert len(completion.tokens) == MAX_NEW
        assert_greedy_matches(tiny[1], prompt, completion)


def test_a_pool_too_small_for_the_step_completes_by_preemption_with_the_same_samples(roomy, tiny):
    want = roomy.generate(PROMPTS, SAMPLE, seed=5)
    least = pages.cdiv(16, 4) + pages.sequence_pages(16, MAX_NEW, 4)
    tight = paged_engine(tiny, page_size=4, num_pages=least)
    got = tight.generate(PROMPTS, SAMPLE, seed=5)
    assert tight.last_stats[0]["preemptions"] > 0
    assert as_lists(got) == as_lists(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_pool_that_cannot_hold_one_sequence_is_refused_before_any_step(tiny):
    model_config = tiny[0]
    with pytest.raises(ValueError, match="hbm_utilization_vllm") as err:
        JaxEngine(model_config, jax.devices()[:1], pad_id=PAD, eos_ids=(EOS,),
                  max_prompt_length=64, max_new_tokens=MAX_NEW, page_size=4, num_pages=10)
    assert "max_prefill_predict_length=64" in str(err.value)
    assert "needs 35" in str(err.value)  # 16 prompt pages + 18 of the table + 1 copy
    with pytest.raises(ValueError, match="vllm_block_size"):
        JaxEngine(model_config, jax.devices()[:1], pad_id=PAD, eos_ids=(EOS,),
                  max_prompt_length=4, max_new_tokens=MAX_NEW, page_size=0)


def test_the_pool_is_sized_from_memory_and_capped_by_what_rows_can_use(tiny):
    model_config = tiny[0]
    small = JaxEngine(model_config, jax.devices()[:1], pad_id=PAD, eos_ids=(EOS,),
                      max_prompt_length=16, max_new_tokens=MAX_NEW, max_batch_size=6)
    # Never more than 8 rows (6 rounded up) at the caps could use: (24 tokens / 16) + 1 each.
    assert small.num_pages == pages.pages_needed(8, 16, MAX_NEW, 16) == 8 * 3
    page = pages.page_bytes(model_config.num_layers, model_config.num_kv_heads,
                            model_config.head_dim, 16, 4)
    assert page == model_config.num_layers * 16 * 2 * model_config.num_kv_heads \
        * model_config.head_dim * 4
    assert pages.pool_pages(10 * page + page // 2, page, 1000) == 10


def test_a_freed_pool_is_made_again_with_the_same_samples(roomy, tiny):
    """free_kv_cache_during_weight_sync: the pool goes back after each call (the trainer gets
    the memory) and the next call zeroes a new one; samples do not change."""
    want = roomy.generate(PROMPTS, SAMPLE, seed=6)
    freeing = paged_engine(tiny, page_size=4, free_pool_after_generate=True)
    for _ in range(2):
        assert as_lists(freeing.generate(PROMPTS, SAMPLE, seed=6)) == as_lists(want)
        assert freeing._pools == [None]
    assert roomy._pools != [None]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_freed_pool_leaves_the_resident_set_on_cpu(tiny):
    """On the CPU backend the freed pool's heap memory goes back to the system (`hostmem.trim`):
    without it, a generate on a freeing engine left about 3.7x the pool resident (the pool and
    the program's copies of it, freed but kept by malloc)."""
    scratch = np.ones(48 << 20, np.uint8)
    del scratch  # glibc now serves chunks up to 32 MiB, the pool's per-layer arrays, from the heap
    freeing = paged_engine(tiny, page_size=4, num_pages=61440, free_pool_after_generate=True)
    pool_bytes = freeing.num_pages * pages.page_bytes(tiny[0].num_layers, tiny[0].num_kv_heads,
                                                      tiny[0].head_dim, 4, 4)
    assert freeing.pool_bytes == pool_bytes >= hostmem.TRIM_FROM_BYTES
    before = resident_bytes()
    freeing.generate(PROMPTS, SAMPLE, seed=6)
    assert freeing._pools == [None]
    assert resident_bytes() - before < pool_bytes


def test_a_small_freed_pool_is_left_to_the_heap():
    """A trim walks the heap: it runs after a large free on CPU only."""
    cpu = jax.devices("cpu")
    assert hostmem.trim(cpu, hostmem.TRIM_FROM_BYTES)
    assert not hostmem.trim(cpu, hostmem.TRIM_FROM_BYTES - 1)


@pytest.mark.slow  # two engines' compiles
def test_a_tail_of_few_live_rows_decodes_packed_with_the_same_samples(tiny):
    """64 requests with ~30% of tokens a stop: most rows end in a few steps, and the steps after
    run the live rows packed into 8 rows. Samples equal an engine that decodes all 64
    slots every step (logprobs within 1e-5), and greedy tokens are still the full forward's
    argmax."""
    rng = np.random.default_rng(0)
    distinct = [rng.integers(9, VOCAB, int(rng.integers(2, 15))).tolist() for _ in range(16)]
    requests = [p for p in distinct for _ in range(4)]
    stops = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0,
                           stop_token_ids=tuple(range(2, 33)))
    packed = paged_engine(tiny, page_size=4)
    got = packed.generate(requests, stops, seed=7)
    assert packed.last_stats[0]["packed_steps"] > 0
    whole = paged_engine(tiny, page_size=4)
    whole.pack_decode_rows = False
    want = whole.generate(requests, stops, seed=7)
    assert whole.last_stats[0]["packed_steps"] == 0
    assert as_lists(got) == as_lists(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    lengths = [len(c.tokens) for c in got]
    assert min(lengths) < 3 and max(lengths) == MAX_NEW  # a tail: the packing had work to do
    greedy = SamplingParams(max_new_tokens=MAX_NEW, greedy=True,
                            stop_token_ids=tuple(range(2, 33)))
    out = packed.generate(requests, greedy, seed=0)
    assert packed.last_stats[0]["packed_steps"] > 0
    for prompt, completion in zip(requests, out, strict=True):
        assert_greedy_matches(tiny[1], prompt, completion)
