"""Memory planner: what a run holds per device, and whether it fits, before anything runs.

    python -m tunix_mcjax.plan RECIPE.yml [key=value ...] [--hbm-gib N]
                               [--hosts H --devices-per-host D] [--tpu]

Pure arithmetic on the config and the Tunix ModelConfig (param shapes come from an abstract
`eval_shape`; no device is touched). It makes the trainer's own choices through the functions
the trainer calls (`memory.gather_params_once`, `memory.num_micro_batches`,
`memory.micro_batch_rows`), so plan and run never disagree. Sizes are worst case for the
budgets: every sequence at `max_target_length`, one sequence per packed row.

A step's memory peaks in one of three phases, each on top of the trainer state (params and
Adam moments, FSDP-sharded over all devices) and the engine's copy of the weights: generate
(the paged jax engine's KV page pool, a prefill chunk or a decode step, whichever is larger,
and the prompts' last logits; with free_kv_cache_during_weight_sync=false the pool is kept
across steps and counts in every phase; the maxtext engine is paged the same way), train
(gradients, the gathered replica when params are gathered once, saved activations and logits
scratch) and publish (the replicated gather of the new weights). The pool is sized as the
engine sizes it (`engine.pages`), and a plan that the engine would refuse (a pool that cannot
hold one sequence at the caps) does not fit. An agentic run's engine is planned at its turns
(`Config.engine_prompt_length`, `replica_share`). On CPU, where a device's memory is the host's
RAM, the host's own costs outside XLA's buffers are added too (`cpu_host_items`); on TPU
(`--tpu`, the aot path's targets) the train step's activations are what XLA's TPU assignment
keeps, elsewhere the fit to its CPU assignment (`activations.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from tunix_mcjax import memory
from tunix_mcjax.activations import (
    ModelShape,
    activation_bytes_per_token,
    attention_mask_bytes,
    model_shape,
)
from tunix_mcjax.config import Config, ConfigError, load_config
from tunix_mcjax.engine.buckets import pow2_at_least
from tunix_mcjax.engine_plan import (
    DTYPE_BYTES,
    Cluster,
    PagedShape,
    engine_weight_dtype,
    generate_scratch,
    paged_engine_items,
    paged_shape,
)

GIB = 2**30


# --- the trainer --------------------------------------------------------------------------


LOGITS_SCRATCH = 9  # bytes per scored token per vocab entry: fp32 logits and their gradient

# On CPU the devices' memory is the host's RAM, so two host costs outside XLA's buffers count.
# The process baseline: RSS a built runtime holds beyond its live JAX arrays (interpreter,
# JAX/XLA, Tunix/MaxText, transformers, the Qwen3 tokenizer, compiled executables, allocator).
# Measured, not derived: 0.92 GiB (Qwen3-0.6B, 2 hosts x 1 device, bf16), 0.93 and 1.08 GiB
# (8 layers x 512, 1 device, fp32 and bf16), RSS minus this host's live array bytes before the
# first train step.
PROCESS_BASELINE = 1 * GIB
# A bf16 matmul on XLA's CPU backend converts its operands to fp32 in runtime scratch that
# buffer assignment does not see; the largest is the (tied) vocab x embed matrix in the logits
# matmuls of generate and train. Measured as the step's RSS rise beyond XLA's temp bytes:
# 0.31 GiB at 8 x 512 (fp32 copy of the embedding 0.29 GiB; 0.02 GiB for the same run in
# fp32) and 0.75 GiB at Qwen3-0.6B (0.58 GiB).
CPU_UPCAST_BYTES = 4



def logits_bytes(m: ModelShape, tokens: int, chunk_tokens: int) -> int:
    """fp32 logits scratch of the scored chunk (of the whole step when `chunk_tokens` is 0)."""
    live = tokens if chunk_tokens <= 0 else min(tokens, chunk_tokens)
    return LOGITS_SCRATCH * m.vocab * live


@dataclasses.dataclass(frozen=True)
class TrainLayout:
    gather_once: bool
    micro_batches: int  # micro-batches run per step
    rows_per_device: int  # K: packed rows per device per step (worst case)
    micro_rows: int  # rows per device in each micro-batch


def train_layout(cfg: Config, cluster: Cluster, m: ModelShape) -> TrainLayout:
    """The trainer's own choices: gather-once or sharded compute, and micro-batching."""
    gather = memory.gather_params_once(
        cfg.fsdp_gather_params_once, param_count=m.param_count,
        bytes_per_param=DTYPE_BYTES[cfg.weight_dtype], num_devices=cluster.num_devices,
        device_memory_bytes=cluster.device_bytes)
    host_sequences = cfg.global_rows // cluster.hosts
    k = pow2_at_least(max(1, -(-host_sequences // cluster.devices_per_host)))
    n, per = memory.micro_batch_rows(
        k, memory.num_micro_batches(cfg.batch_size, cfg.train_micro_batch_size))
    return TrainLayout(gather, n, k, per)


def cpu_host_items(cfg: Config, cluster: Cluster, m: ModelShape) -> dict[str, int]:
    """Per device, on CPU only: its share of the process baseline, and the fp32 copy a bf16
    matmul makes of the largest weight (the embedding) outside XLA's buffers."""
    if not cluster.cpu:
        return {"process baseline": 0, "bf16 matmul fp32 copy": 0}
    upcast = CPU_UPCAST_BYTES * m.largest_leaf if cfg.dtype == "bfloat16" else 0
    return {"process baseline": PROCESS_BASELINE // cluster.devices_per_host,
            "bf16 matmul fp32 copy": upcast}


def params_cast_bytes(cfg: Config, cluster: Cluster, m: ModelShape, layout: TrainLayout) -> int:
    """On TPU, with weights in another dtype than the compute dtype: the weights compute uses,
    cast to the compute dtype, which the step keeps for the backward's matmuls (JAX saves them
    as residuals; every param when gathered once or on one device, else one layer and the
    embedding). On CPU and GPU the fitted activations hold it."""
    if not cluster.tpu or cfg.weight_dtype == cfg.dtype:
        return 0
    whole = layout.gather_once or cluster.num_devices == 1
    return (m.param_count if whole else m.layer_param_count + m.largest_leaf) \
        * DTYPE_BYTES[cfg.dtype]


# On TPU the flat step's collectives (`train/fsdp_flat.py`: params gathered once, over more than
# one device) run as all-reduces over [devices, shard] buffers, each a full copy of the params
# in their dtype: the gradients' reduce-scatter (their sum) and the new params' all-gather (a
# zero-filled buffer, this device's shard written into it, and their sum). Live together after
# the last micro-batch's backward, beside the step's gathered params (its argument) and the new
# ones (its output): XLA's TPU buffer assignment of gsm8k's step on 64 TPU7x chips
# (bench_results/aot/buffers), where this is the step's peak (short rows: small activations).
FLAT_COLLECTIVE_COPIES = 4
LANES = 128  # a TPU tile's minor dimension


def flat_collective_bytes(cluster: Cluster, m: ModelShape, layout: TrainLayout, w: int) -> int:
    """On TPU, the flat collectives' full-size buffers (`FLAT_COLLECTIVE_COPIES`) and the lanes
    their layout leaves empty (`lane_padding`); none on one device, with params sharded through
    compute, or off TPU (the CPU fit holds its own)."""
    if not (cluster.tpu and layout.gather_once and cluster.num_devices > 1):
        return 0
    return (FLAT_COLLECTIVE_COPIES * m.param_count + sum(lane_padding(m, cluster.num_devices))) * w


def padded_lanes(n: int, lanes: int) -> int:
    """Elements of padding when `n` elements lie with `lanes` of them in a tile's minor dim."""
    return n * (-(-lanes // LANES) * LANES - lanes) // lanes


def lane_padding(m: ModelShape, devices: int) -> tuple[int, int]:
    """Padding elements of the flat collectives' layout on TPU: (pieces, gradients' sum). A leaf
    sharded along its last dimension moves as [devices, ..., last / devices] pieces; XLA puts
    the wider of those two dims in the 128 lanes (the shard on a tie). Where that is the
    devices, the gradients' [devices, shard] sum has them in the lanes too. As XLA laid them out
    at 16, 32, 64 and 128 devices (bench_results/aot/buffers, `tests/test_aot_cells.py`)."""
    pieces = sum(padded_lanes(n, max(last // devices, devices)) for n, last in m.last_dim_sharded)
    lanes_hold_devices = any(devices > last // devices for _, last in m.last_dim_sharded)
    return pieces, padded_lanes(m.param_count, devices) if lanes_hold_devices else 0


def train_peak(items: dict[str, int]) -> int:
    """What the train step adds to the state at its peak: the larger of a micro-batch's backward
    (gradients, gathered params, activations and masks, the weights' cast, logits) and the
    update after the last one (the gathered params and their new copy, the flat collectives)."""
    backward = ("gradients", "gathered params + grads", "reference params", "activations",
                "attention masks", "params cast", "logits", "bf16 matmul fp32 copy")
    update = ("gradients", "gathered params + grads", "reference params", "flat collectives")
    return max(sum(items[k] for k in backward), sum(items[k] for k in update))


# --- the plan -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: Config
    cluster: Cluster
    model: ModelShape
    layout: TrainLayout
    engine: PagedShape
    items: dict[str, int]  # per device
    phases: dict[str, int]  # per device
    activations: dict[str, int]  # what-ifs: saved activations per device

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        pool_ok = self.engine.pool_holds_one_sequence
        return self.peak <= self.cluster.device_bytes and pool_ok

    @property
    def preempts(self) -> bool:
        """Whether a step at the caps needs more pages than the pool holds (rows wait, and
        are recomputed: slower, not a failure)."""
        return self.engine.step_pages > self.engine.pool_pages


def engine_items(cfg: Config, cluster: Cluster, m: ModelShape
                 ) -> tuple[PagedShape, dict[str, int]]:
    """The engine's shape and its items per device (both engines of our loop are paged; the
    maxtext engine's Gemma4 global layers, with their own kv heads and head dim, are counted at
    the config's `num_kv_heads` and `head_dim`)."""
    shape = paged_shape(cfg, cluster, m)
    return shape, paged_engine_items(cfg, shape, m)


ROUTING_INDEX_BYTES = 4  # int32


def routing_items(shape: PagedShape, train_tokens: int, routing: tuple[int, int] | None
                  ) -> dict[str, int]:
    """Per device, the top-k expert indices router replay records (int32 [tokens, MoE layers,
    k]): the engine's for its prompts and completions at the caps, the train batch's for its
    rows; none without `routing` (MoE layers, k)."""
    if routing is None:
        return {}
    per_token = routing[0] * routing[1] * ROUTING_INDEX_BYTES
    engine = shape.num_prompts * shape.prompt_len + shape.num_requests * shape.max_new
    return {"routing indices (engine)": engine * per_token,
            "routing indices (train)": train_tokens * per_token}


def plan(cfg: Config, cluster: Cluster, mc, routing: tuple[int, int] | None = None) -> Plan:
    """What fits where; `routing`: (MoE layers, top-k) when moe_router_replay records them."""
    m = model_shape(mc, cluster.num_devices)
    layout = train_layout(cfg, cluster, m)
    w, c = DTYPE_BYTES[cfg.weight_dtype], DTYPE_BYTES[cfg.dtype]
    row_len = cfg.max_target_length
    tokens = layout.micro_rows * row_len
    sharded = m.sharded_param_count * w
    # The gathered copy (and its gradient) of what compute needs whole: every param when gathered
    # once, else one layer and the embedding at a time. One device has nothing to gather.
    replica = m.param_count if layout.gather_once else m.layer_param_count + m.largest_leaf
    replica *= cluster.num_devices > 1
    accumulating = layout.micro_batches > 1
    engine, engine_bytes = engine_items(cfg, cluster, m)
    items = {
        "params": sharded,
        "optimizer state": 2 * sharded,
        "gradients": sharded * (2 if accumulating else 1),
        "gathered params + grads": 2 * replica * w,
        "reference params": sharded if cfg.grpo_beta else 0,
        "activations": tokens * activation_bytes_per_token(
            m, c, row_len, remat=cfg.remat_policy == "full", tpu=cluster.tpu),
        "attention masks": layout.micro_rows * attention_mask_bytes(m, row_len) * cluster.tpu,
        "params cast": params_cast_bytes(cfg, cluster, m, layout),
        "logits": logits_bytes(m, tokens, cfg.train_logits_chunk_tokens),
        "flat collectives": flat_collective_bytes(cluster, m, layout, w),
        **engine_bytes,
        **cpu_host_items(cfg, cluster, m),
        **routing_items(engine, layout.rows_per_device * row_len, routing),
    }
    # The page pool is made for each rollout and given back before the train step
    # (free_kv_cache_during_weight_sync), or made once and kept: then it is in every phase.
    pool = items.get("KV page pool", 0)
    kept = 0 if cfg.free_kv_cache_during_weight_sync else pool
    state = items["params"] + items["optimizer state"] + items["engine weights"] + kept \
        + items["process baseline"]
    publish = m.param_count * w if cfg.rl_publish_weights_single_call \
        else m.largest_published_leaf * w
    phases = {
        "generate": state + pool - kept + generate_scratch(engine_bytes)
        + items["bf16 matmul fp32 copy"] + items.get("routing indices (engine)", 0),
        "train": state + train_peak(items) + items.get("routing indices (train)", 0),
        "publish": state + publish,
    }
    whole = layout.rows_per_device * row_len
    activations = {
        f"{name}, {mode}": n * activation_bytes_per_token(m, c, row_len, remat=mode == "remat",
                                                           tpu=cluster.tpu)
        for name, n in (("one batch", whole), ("micro-batch", tokens))
        for mode in ("no remat", "remat")
    }
    return Plan(cfg, cluster, m, layout, engine, items, phases, activations)


def largest_micro_batch_that_fits(cfg: Config, cluster: Cluster, mc) -> int | None:
    """The largest `train_micro_batch_size` (a divisor of batch_size) whose plan fits."""
    for mb in sorted((d for d in range(1, cfg.batch_size + 1) if cfg.batch_size % d == 0),
                     reverse=True):
        if plan(cfg.replace(train_micro_batch_size=mb), cluster, mc).fits:
            return mb
    return None


def gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def engine_lines(p: Plan) -> list[str]:
    """The paged engine's pool against what a step at the caps needs."""
    e = p.engine
    limit = (f"hbm_utilization_vllm={p.cfg.hbm_utilization_vllm} of the device less the "
             "engine's weights" if e.pool_limited_by_budget else
             "every row at the caps (the most it can use)")
    lines = [
        f"engine: {p.cfg.rollout_engine}, paged; per replica {e.requests} requests in "
        f"{e.distinct_prompts} prompt slots, {e.num_slots} rows, prefill {e.prefill_rows} "
        f"x {e.chunk} tokens per iteration",
        f"KV page pool: {e.pool_pages} pages of {e.page_size} tokens "
        f"({e.page_bytes / 2**20:.2f} MiB each per device), sized by {limit}",
        f"a step at the caps needs {e.step_pages} pages: {e.distinct_prompts} prompt slots x "
        f"{e.prompt_pages} + {min(e.num_slots, e.requests)} rows x {e.private_pages} "
        f"own ({e.distinct_prompts * e.prompt_pages * e.page_bytes / GIB:.2f} GiB of prompt "
        "pages)",
    ]
    if not e.pool_holds_one_sequence:
        lines.append(f"the pool cannot hold one sequence at the caps with its prompt "
                     f"({e.least_pages} pages): the engine refuses it; raise "
                     "hbm_utilization_vllm, or lower max_prefill_predict_length / "
                     "max_target_length")
    elif p.preempts:
        lines.append(f"note: {e.step_pages} > {e.pool_pages} pages, so such a step preempts "
                     "rows (they wait and are recomputed): slower, not a failure")
    return lines


def table(p: Plan) -> str:
    cfg, cl, lay = p.cfg, p.cluster, p.layout
    lines = [
        f"{cfg.model_name}: {p.model.param_count / 1e9:.3f}B params, {cl.hosts} hosts x "
        f"{cl.devices_per_host} devices, {cl.device_bytes / GIB:.1f} GiB per device",
        f"weights {cfg.weight_dtype}, compute {cfg.dtype}, engine "
        f"{engine_weight_dtype(cfg)}; params "
        f"{'gathered once' if lay.gather_once else 'sharded through compute'} "
        f"(fsdp_gather_params_once={cfg.fsdp_gather_params_once})",
        f"train: {lay.rows_per_device} rows x {cfg.max_target_length} tokens per device, "
        f"{lay.micro_batches} micro-batch(es) of {lay.micro_rows} rows, "
        f"remat_policy={cfg.remat_policy}",
        *engine_lines(p),
        "",
        f"{'per device':<28}{'GiB':>8}",
    ]
    lines += [f"  {k:<26}{gib(v)}" for k, v in p.items.items() if v]
    lines += ["", "saved activations (what-ifs)"]
    lines += [f"  {k:<26}{gib(v)}" for k, v in p.activations.items()]
    lines += ["", "peak by phase"]
    lines += [f"  {k:<26}{gib(v)}" for k, v in p.phases.items()]
    verdict = "fits" if p.fits else "does NOT fit"
    lines += ["", f"peak {p.peak / GIB:.2f} GiB of {cl.device_bytes / GIB:.1f} GiB per device "
              f"({p.peak * cl.devices_per_host / GIB:.2f} GiB per host): {verdict}"]
    return "\n".join(lines)


def model_config_for(cfg: Config):
    """The trainer's Tunix ModelConfig; the vocabulary is the preset's, or the tokenizer's."""
    from tunix_mcjax import models

    vocab = cfg.vocab_size
    if not vocab and cfg.model_name == "qwen3-tiny":
        from tunix_mcjax.tokenizer import load_tokenizer

        vocab = len(load_tokenizer(cfg.tokenizer_type, cfg.tokenizer_path))
    return models.model_config(cfg, vocab)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_mcjax.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--hbm-gib", type=float, default=0.0,
                        help="memory per device (default: this machine's RAM / devices per host,"
                             " as the trainer assumes on CPU)")
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--devices-per-host", type=int, default=1)
    parser.add_argument("--tpu", action="store_true",
                        help="the devices are TPUs of --hbm-gib each (the train step's "
                             "activations as XLA's TPU assignment keeps them)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.hosts < 1 or args.devices_per_host < 1:
            raise ConfigError("--hosts and --devices-per-host must be >= 1")
        if args.tpu and args.hbm_gib <= 0:
            raise ConfigError("--tpu needs --hbm-gib, the HBM of one TPU device")
        cfg.validate_topology(args.hosts, args.devices_per_host)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    device_bytes = int(args.hbm_gib * GIB) if args.hbm_gib > 0 else \
        host_memory_bytes() // args.devices_per_host
    cluster = Cluster(args.hosts, args.devices_per_host, device_bytes, cpu=args.hbm_gib <= 0,
                      tpu=args.tpu)
    mc = model_config_for(cfg)
    p = plan(cfg, cluster, mc)
    print(table(p))
    if not p.fits or cfg.train_micro_batch_size <= 0:
        mb = largest_micro_batch_that_fits(cfg, cluster, mc)
        print("no train_micro_batch_size fits" if mb is None else
              f"largest train_micro_batch_size that fits: {mb} (prompts per micro-batch)")
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
