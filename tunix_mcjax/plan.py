"""Memory planner: what a run holds per device, and whether it fits, before anything runs.

    python -m tunix_mcjax.plan RECIPE.yml [key=value ...] [--hbm-gib N]
                               [--hosts H --devices-per-host D]

Pure arithmetic on the config and the Tunix ModelConfig (param shapes come from an abstract
`eval_shape`; no device is touched). It makes the trainer's own choices through the functions
the trainer calls (`memory.gather_params_once`, `memory.num_micro_batches`,
`memory.micro_batch_rows`), so plan and run never disagree. Sizes are worst case for the
budgets: every sequence at `max_target_length`, one sequence per packed row.

A step's memory peaks in one of three phases, each on top of the trainer state (params and
Adam moments, FSDP-sharded over all devices) and the engine's copy of the weights:
generate (KV cache, prompt store, prefill), train (gradients, the gathered replica when params
are gathered once, saved activations and logits scratch) and publish (the
replicated gather of the new weights). On CPU, where a device's memory is the host's RAM, the
host's own costs outside XLA's buffers are added too (`cpu_host_items`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from tunix_mcjax import memory
from tunix_mcjax.attention import KEY_BLOCK
from tunix_mcjax.config import Config, ConfigError, load_config

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Cluster:
    hosts: int
    devices_per_host: int
    device_bytes: int  # usable memory of one device (on CPU: the host's RAM / local devices)
    cpu: bool = False  # devices are the host's CPU: the process's own RAM counts against them

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What memory depends on, from the Tunix ModelConfig and its param tree."""

    layers: int
    embed: int  # D
    q_width: int  # query heads x head dim
    kv_width: int  # kv heads x head dim
    query_heads: int
    mlp: int  # F
    vocab: int
    param_count: int
    layer_param_count: int  # one decoder layer
    sharded_param_count: int  # per device, FSDP over all devices (dims that divide)
    largest_leaf: int


def model_shape(mc, fsdp: int) -> ModelShape:
    """Param counts from an abstract Tunix Qwen3 (no arrays are made)."""
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    abstract = nnx.eval_shape(lambda: qwen3.Qwen3(mc, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    leaves = [(tuple(path), v.get_value()) for path, v in nnx.to_flat_state(state)]
    specs = dict((tuple(p), v.get_value()) for p, v in
                 nnx.to_flat_state(nnx.get_partition_spec(state)))
    total = sharded = layer0 = largest = 0
    for path, leaf in leaves:
        n = math.prod(leaf.shape)
        total += n
        largest = max(largest, n)
        layer0 += n if path[:2] == ("layers", 0) else 0
        spec = tuple(specs[path]) + (None,) * len(leaf.shape)
        sharded += math.prod(-(-d // fsdp) if "fsdp" in _axes(a) else d
                             for d, a in zip(leaf.shape, spec[:len(leaf.shape)], strict=True))
    return ModelShape(mc.num_layers, mc.embed_dim, mc.num_heads * mc.head_dim,
                      mc.num_kv_heads * mc.head_dim, mc.num_heads, mc.hidden_dim, mc.vocab_size,
                      total, layer0, sharded, largest)


def _axes(axis) -> tuple:
    return axis if isinstance(axis, tuple) else (axis,)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# --- the trainer --------------------------------------------------------------------------


# Bytes a token leaves saved per decoder layer, per unit of each width, as `fixed + per_byte *
# c` with c the compute dtype's bytes. `heads_x_keys` counts query heads x key positions: all of
# them for rows of one attention key block (the dense formula keeps its probabilities), one
# block's worth for longer rows (blockwise, softmax statistics only). Fitted to XLA's buffer
# assignment for the trainer's step (compiled memory analysis on CPU: fp32 and bf16, 2 and 4
# layers, each width doubled in turn, rows of 128, 256 and 1024 tokens; within 5% on those 32
# shapes).
SAVED_PER_UNIT = {"embed": (18.1, 1.0), "mlp": (0.7, 4.5), "q_width": (16.7, 2.7),
                  "kv_width": (0.3, 10.2)}
DENSE_HEADS_X_KEYS = (8.1, 0.9)
BLOCKWISE_HEADS_X_KEYS = (2.0, 0.0)
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


def activation_bytes_per_token(m: ModelShape, compute_bytes: int, row_len: int,
                               remat: bool) -> int:
    """Bytes one token leaves saved for the backward, over all layers. With remat
    (`remat_policy=full`: a decoder layer recomputed in its backward) only each layer's input
    stays, plus one layer's worth while it is recomputed (not fitted; from the shapes)."""
    widths = {"embed": m.embed, "mlp": m.mlp, "q_width": m.q_width, "kv_width": m.kv_width}
    coefficients = dict(SAVED_PER_UNIT)
    if row_len <= KEY_BLOCK:
        widths["heads_x_keys"], coefficients["heads_x_keys"] = \
            m.query_heads * row_len, DENSE_HEADS_X_KEYS
    else:
        widths["heads_x_keys"], coefficients["heads_x_keys"] = \
            m.query_heads * KEY_BLOCK, BLOCKWISE_HEADS_X_KEYS
    per_layer = sum((fixed + per_byte * compute_bytes) * widths[dim]
                    for dim, (fixed, per_byte) in coefficients.items())
    if remat:
        return int(compute_bytes * m.embed * m.layers + per_layer)
    return int(per_layer * m.layers)


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


# --- the engine ---------------------------------------------------------------------------


def engine_items(cfg: Config, cluster: Cluster, m: ModelShape) -> dict[str, int]:
    """Per device: weights, and during generate the KV cache, prompt store and prefill scratch
    of one replica (tensor parallelism splits all of them)."""
    tp = cfg.rollout_tensor_parallelism
    c = DTYPE_BYTES[cfg.dtype]
    weight_dtype = cfg.rollout_weight_dtype or cfg.weight_dtype
    replicas = cluster.devices_per_host // tp
    requests = -(-cfg.global_rows // cluster.hosts // replicas)
    prompts = -(-requests // cfg.num_generations) + (requests % cfg.num_generations != 0)
    slots = min(pow2_at_least(requests), pow2_at_least(cfg.rollout_max_batch_size))
    if not cfg.rollout_continuous_batching:
        slots = min(pow2_at_least(requests), cfg.rollout_max_batch_size)
    distinct = pow2_at_least(prompts)
    prompt_len = cfg.max_prefill_predict_length
    kv_per_token = m.layers * 2 * m.kv_width * c
    prefill_layer = distinct * prompt_len * (
        (m.embed + m.q_width + 2 * m.kv_width + 3 * m.mlp) * c
        + 2 * 4 * m.query_heads * prompt_len)  # dense causal scores and probabilities, fp32
    return {
        "engine weights": m.param_count * DTYPE_BYTES[weight_dtype] // tp,
        "KV cache": slots * (prompt_len + cfg.max_completion_length) * kv_per_token // tp,
        "prompt store": distinct * (prompt_len * kv_per_token // tp + 4 * m.vocab),
        "prefill scratch": prefill_layer // tp + slots * 4 * 4 * m.vocab,
    }


def cpu_host_items(cfg: Config, cluster: Cluster, m: ModelShape) -> dict[str, int]:
    """Per device, on CPU only: its share of the process baseline, and the fp32 copy a bf16
    matmul makes of the largest weight (the embedding) outside XLA's buffers."""
    if not cluster.cpu:
        return {"process baseline": 0, "bf16 matmul fp32 copy": 0}
    upcast = CPU_UPCAST_BYTES * m.largest_leaf if cfg.dtype == "bfloat16" else 0
    return {"process baseline": PROCESS_BASELINE // cluster.devices_per_host,
            "bf16 matmul fp32 copy": upcast}


# --- the plan -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: Config
    cluster: Cluster
    model: ModelShape
    layout: TrainLayout
    items: dict[str, int]  # per device
    phases: dict[str, int]  # per device
    activations: dict[str, int]  # what-ifs: saved activations per device

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.cluster.device_bytes


def plan(cfg: Config, cluster: Cluster, mc) -> Plan:
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
    items = {
        "params": sharded,
        "optimizer state": 2 * sharded,
        "gradients": sharded * (2 if accumulating else 1),
        "gathered params + grads": 2 * replica * w,
        "reference params": sharded if cfg.grpo_beta else 0,
        "activations": tokens * activation_bytes_per_token(m, c, row_len,
                                                           remat=cfg.remat_policy == "full"),
        "logits": logits_bytes(m, tokens, cfg.train_logits_chunk_tokens),
        **engine_items(cfg, cluster, m),
        **cpu_host_items(cfg, cluster, m),
    }
    state = items["params"] + items["optimizer state"] + items["engine weights"] \
        + items["process baseline"]
    train_keys = ("gradients", "gathered params + grads", "reference params", "activations",
                  "logits", "bf16 matmul fp32 copy")
    generate_keys = ("KV cache", "prompt store", "prefill scratch", "bf16 matmul fp32 copy")
    publish = m.param_count * w if cfg.rl_publish_weights_single_call else m.largest_leaf * w
    phases = {
        "generate": state + sum(items[k] for k in generate_keys),
        "train": state + sum(items[k] for k in train_keys),
        "publish": state + publish,
    }
    whole = layout.rows_per_device * row_len
    activations = {
        f"{name}, {mode}": n * activation_bytes_per_token(m, c, row_len, remat=mode == "remat")
        for name, n in (("one batch", whole), ("micro-batch", tokens))
        for mode in ("no remat", "remat")
    }
    return Plan(cfg, cluster, m, layout, items, phases, activations)


def largest_micro_batch_that_fits(cfg: Config, cluster: Cluster, mc) -> int | None:
    """The largest `train_micro_batch_size` (a divisor of batch_size) whose plan fits."""
    for mb in sorted((d for d in range(1, cfg.batch_size + 1) if cfg.batch_size % d == 0),
                     reverse=True):
        if plan(cfg.replace(train_micro_batch_size=mb), cluster, mc).fits:
            return mb
    return None


def gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def table(p: Plan) -> str:
    cfg, cl, lay = p.cfg, p.cluster, p.layout
    lines = [
        f"{cfg.model_name}: {p.model.param_count / 1e9:.3f}B params, {cl.hosts} hosts x "
        f"{cl.devices_per_host} devices, {cl.device_bytes / GIB:.1f} GiB per device",
        f"weights {cfg.weight_dtype}, compute {cfg.dtype}, engine "
        f"{cfg.rollout_weight_dtype or cfg.weight_dtype}; params "
        f"{'gathered once' if lay.gather_once else 'sharded through compute'} "
        f"(fsdp_gather_params_once={cfg.fsdp_gather_params_once})",
        f"train: {lay.rows_per_device} rows x {cfg.max_target_length} tokens per device, "
        f"{lay.micro_batches} micro-batch(es) of {lay.micro_rows} rows, "
        f"remat_policy={cfg.remat_policy}",
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
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        if args.hosts < 1 or args.devices_per_host < 1:
            raise ConfigError("--hosts and --devices-per-host must be >= 1")
        cfg.validate_topology(args.hosts, args.devices_per_host)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    device_bytes = int(args.hbm_gib * GIB) if args.hbm_gib > 0 else \
        host_memory_bytes() // args.devices_per_host
    cluster = Cluster(args.hosts, args.devices_per_host, device_bytes, cpu=args.hbm_gib <= 0)
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
