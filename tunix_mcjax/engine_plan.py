"""The paged engine's part of the memory plan (`plan.py`), on the machines a plan is for
(`Cluster`): per replica, the pool it allocates, the shape of the program it compiles for a
full share at the caps (`replica_share`: GRPO's rows, or an agentic run's turns), and what
generate adds beside the pool, from the engine's own arithmetic (`engine.pages`)."""

from __future__ import annotations

import dataclasses

from tunix_mcjax.activations import ModelShape
from tunix_mcjax.agentic.loop import kept_session_capacity
from tunix_mcjax.config import Config
from tunix_mcjax.engine import pages, quantize
from tunix_mcjax.engine.buckets import pow2_at_least, prompt_bucket
from tunix_mcjax.engine.options import DEFAULT_MAX_NUM_BATCHED_TOKENS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The machines a plan is for: hosts of equal devices."""

    hosts: int
    devices_per_host: int
    device_bytes: int  # usable memory of one device (on CPU: the host's RAM / local devices)
    cpu: bool = False  # devices are the host's CPU: the process's own RAM counts against them
    tpu: bool = False  # TPU devices: XLA's TPU assignment of the train step (`TPU_SAVED_PER_UNIT`)

    def __post_init__(self):
        if self.cpu and self.tpu:
            raise ValueError("Cluster: devices are either the host's CPU or TPUs, not both")

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host


@dataclasses.dataclass(frozen=True)
class PagedShape:
    """One replica's paged engine (`rollout_engine=jax`) for a full share at the caps: the pool
    it allocates, the program it compiles, and the pages that share needs."""

    requests: int  # requests of the replica's share (of one wave without continuous batching)
    distinct_prompts: int  # prompt slots: distinct prompts among them (`replica_share`)
    num_requests: int  # N: requests, padded to a power of two
    num_prompts: int  # U: prompt slots, padded to a power of two
    num_slots: int  # B: rows decoded at once
    prompt_len: int  # the prompt bucket at the cap
    max_new: int
    page_size: int
    page_bytes: int  # one page on one device
    pool_pages: int
    pool_limited_by_budget: bool  # False: capped at what every row at the caps could use
    least_pages: int  # one sequence at the caps and its prompt (the engine refuses less)
    chunk: int  # prefill tokens per row
    prefill_rows: int  # prefill rows per loop iteration

    @property
    def prompt_pages(self) -> int:
        return pages.cdiv(self.prompt_len, self.page_size)

    @property
    def private_pages(self) -> int:
        """Pages a row owns at the caps: its table past the prompt's full pages."""
        return pages.table_pages(self.prompt_len, self.max_new, self.page_size) \
            - self.prompt_len // self.page_size

    @property
    def step_pages(self) -> int:
        """Pages the share needs at the caps with group sharing, at most: every distinct prompt
        resident, and every row at the caps on its private pages. More than the pool: the
        loop preempts rows (and recomputes them), it does not fail."""
        rows = min(self.num_slots, self.requests)
        return self.distinct_prompts * self.prompt_pages + rows * self.private_pages

    @property
    def pool_holds_one_sequence(self) -> bool:
        return self.pool_pages >= self.least_pages


def replica_share(cfg: Config, cluster: Cluster) -> tuple[int, int]:
    """(requests, prompt slots) of one replica's share of a decode call at the caps. GRPO: the
    host's rows (a wave of them without continuous batching), a slot a distinct prompt with
    prefix caching. Agentic: a turn of up to max_concurrency conversations; with kept pages on
    a session (continuous batching, not lockstep), the session's slots
    (`agentic.loop.kept_session_capacity`), else a `generate` a round, whose contexts are all
    distinct after the first turn."""
    lockstep = cfg.rl_runtime == "single"
    waves = not (cfg.rollout_continuous_batching or lockstep)
    replicas = engine_replicas(cfg, cluster)
    host_rows = -(-cfg.global_rows // cluster.hosts)
    agentic = cfg.use_agentic_rollout
    if agentic and cfg.agentic_keep_pages and not (waves or lockstep):
        shared = host_rows // cfg.num_generations if cfg.num_generations > 1 else 0
        turns, slots = kept_session_capacity(host_rows, shared, cfg.max_concurrency)
        return -(-turns // replicas), -(-slots // replicas)
    requests = -(-(min(host_rows, cfg.max_concurrency) if agentic else host_rows) // replicas)
    if waves:
        requests = min(requests, cfg.rollout_max_batch_size)  # the share runs in waves
    if agentic or not cfg.enable_prefix_caching:
        return requests, requests
    return requests, share_prompts(requests, cfg.num_generations)


def share_prompts(requests: int, group: int) -> int:
    """Distinct prompts in `requests` consecutive requests of groups of `group`, at most (a share
    may start and end inside a group)."""
    return -(-requests // group) + (requests % group != 0)


def engine_replicas(cfg: Config, cluster: Cluster) -> int:
    """Rollout replicas per host (`rollout_data_parallelism`; -1: as many as the devices hold)."""
    if cfg.rollout_data_parallelism != -1:
        return cfg.rollout_data_parallelism
    return cluster.devices_per_host // cfg.rollout_tensor_parallelism


def engine_weight_dtype(cfg: Config) -> str:
    """The dtype of the engine's copy of the weights (`rollout_weight_dtype`, else the
    trainer's `weight_dtype`)."""
    return cfg.rollout_weight_dtype or cfg.weight_dtype


def engine_weight_bytes(cfg: Config, m: ModelShape) -> int:
    """The engine's copy of the weights on one device (tensor parallelism splits it); under
    `quantization` the layers' projections and an untied lm head take a byte a value and a
    float32 scale an output channel (`engine.quantize`)."""
    itemsize = DTYPE_BYTES[engine_weight_dtype(cfg)]
    total = m.param_count * itemsize
    if cfg.quantization:
        values, channels = quantize.quantized_sizes(m)
        total -= values * (itemsize - quantize.VALUE_BYTES) - channels * quantize.SCALE_BYTES
    return total // cfg.rollout_tensor_parallelism


def paged_shape(cfg: Config, cluster: Cluster, m: ModelShape) -> PagedShape:
    """The jax engine's pool and program for a replica's share, from its own arithmetic."""
    page_size = cfg.vllm_block_size or pages.DEFAULT_PAGE_SIZE
    one_page = pages.page_bytes(m.layers, m.kv_heads, m.head_dim, page_size,
                                DTYPE_BYTES[cfg.dtype], cfg.rollout_tensor_parallelism,
                                pages.kv_mode_of(cfg))
    return paged_shape_of(cfg, cluster, one_page, engine_weight_bytes(cfg, m))


def paged_shape_of(cfg: Config, cluster: Cluster, one_page: int,
                   weight_bytes: int) -> PagedShape:
    """A paged engine's pool and program for a replica's share, given the bytes of one page
    and of the engine's weights on a device (the jax engine's from `paged_shape`; the maxtext
    engine's from its model)."""
    page_size = cfg.vllm_block_size or pages.DEFAULT_PAGE_SIZE
    batched = cfg.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    prompt_cap, max_new = cfg.engine_prompt_length, cfg.engine_new_tokens
    lockstep = cfg.rl_runtime == "single"
    requests, distinct = replica_share(cfg, cluster)
    n, u = pow2_at_least(requests), pow2_at_least(distinct)
    slots = n if lockstep else min(n, pow2_at_least(cfg.rollout_max_batch_size))
    prompt_len = prompt_bucket(prompt_cap, prompt_cap)
    needed = pages.pages_needed(pow2_at_least(cfg.rollout_max_batch_size), prompt_cap,
                                max_new, page_size)
    budget = int(cfg.hbm_utilization_vllm * cluster.device_bytes) - weight_bytes
    pool = pages.pool_pages(budget, one_page, needed)
    chunk, rows_per_budget = pages.prefill_chunk(prompt_len, batched)
    return PagedShape(
        requests=requests, distinct_prompts=distinct, num_requests=n, num_prompts=u,
        num_slots=slots, prompt_len=prompt_len, max_new=max_new, page_size=page_size,
        page_bytes=one_page, pool_pages=pool, pool_limited_by_budget=pool < needed,
        least_pages=pages.least_pool_pages(prompt_cap, max_new, page_size), chunk=chunk,
        prefill_rows=max(1, min(u, rows_per_budget)))


# Attention over gathered pages (`paged_attention.SplitPages`, the CPU and GPU path), as XLA's
# CPU buffer assignment lays it out for the engine's compiled program: each row's pages
# gathered once, kv-head-major (already the keys and values, no split copy), and two [queries,
# keys] buffers per head in the compute dtype (in bf16 the fp32 softmax over the scores; in
# fp32 the scores and their exponentials). Checked against the program's memory analysis
# (`tests/test_plan.py`). On TPU the Pallas kernel reads pages in place: upper bounds there.
GATHER_COPIES = 1
SCORE_COPIES = 2
# fp32 [rows, vocab] copies a decode step makes: the logits and the sampler's sorted top-p.
SAMPLER_LOGIT_COPIES = 4


def attention_bytes(m: ModelShape, c: int, rows: int, queries: int, keys: int) -> int:
    """One layer's attention over `keys` gathered positions for `rows` x `queries` (all heads;
    tensor parallelism splits them)."""
    gathered = GATHER_COPIES * rows * keys * 2 * m.kv_width * c
    return gathered + SCORE_COPIES * rows * m.query_heads * queries * keys * c


def layer_pass_bytes(m: ModelShape, c: int, rows: int, tokens: int, keys: int) -> int:
    """Scratch of `rows` x `tokens` through one decoder layer: the larger of its attention
    (hidden state, q, k, v and the attention above) and its MLP (hidden state, gate, up and
    their product)."""
    attend = rows * tokens * (m.embed + m.q_width + 2 * m.kv_width) * c \
        + attention_bytes(m, c, rows, tokens, keys)
    return max(attend, rows * tokens * (m.embed + 3 * m.mlp) * c)


def paged_engine_items(cfg: Config, shape: PagedShape, m: ModelShape) -> dict[str, int]:
    """Per device: the engine's weights and page pool (the pool freed after each rollout
    unless kept: `plan`) and
    what its generation program adds: one prefill chunk (R rows x C tokens through a layer,
    attending to the prompt's pages), one decode step (B rows attending to their tables at the
    caps, and the sampler's logits) and the prompts' last logits [U, V] fp32."""
    tp, c = cfg.rollout_tensor_parallelism, DTYPE_BYTES[cfg.dtype]
    prompt_keys = shape.prompt_pages * shape.page_size
    table_keys = pages.table_pages(shape.prompt_len, shape.max_new, shape.page_size) \
        * shape.page_size
    prefill = layer_pass_bytes(m, c, shape.prefill_rows, shape.chunk, prompt_keys) // tp
    decode = layer_pass_bytes(m, c, shape.num_slots, 1, table_keys) // tp
    return {
        "engine weights": engine_weight_bytes(cfg, m),
        "KV page pool": shape.pool_pages * shape.page_bytes,
        "prefill chunk scratch": prefill + shape.prefill_rows * 4 * m.vocab,
        "decode scratch": decode + shape.num_slots * SAMPLER_LOGIT_COPIES * 4 * m.vocab,
        "prompt logits": shape.num_prompts * 4 * m.vocab,
        "engine weights cast": engine_cast_bytes(cfg, m) // tp,
    }


def engine_cast_bytes(cfg: Config, m: ModelShape) -> int:
    """The engine's weights in the compute dtype a model call holds: all, when kept in another
    dtype; under `quantization` the leaves kept whole so, and the larger of one layer's
    projections (dequantized in the layer scan) and an untied head's (TPU fuses: a bound)."""
    c, whole = DTYPE_BYTES[cfg.dtype], engine_weight_dtype(cfg) != cfg.dtype
    if not cfg.quantization:
        return m.param_count * c * whole
    values, _ = quantize.quantized_sizes(m)
    layer = m.embed * (2 * m.q_width + 2 * m.kv_width + 3 * m.mlp)
    return ((m.param_count - values) * whole + max(layer, values - m.layers * layer)) * c


def generate_scratch(items: dict[str, int]) -> int:
    """What generate adds beside the pool: the prompt logits (loop state), the larger of a
    prefill chunk and a decode step, which take turns in one loop iteration, and the weights
    cast to the compute dtype that either holds."""
    return items["prompt logits"] + max(items["prefill chunk scratch"], items["decode scratch"]) \
        + items["engine weights cast"]
