"""Compile each program for the target and read XLA's verdict: memory per device beside the
planner's figure for its phase, and the decode step's cost against the HBM roofline."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tunix_mcjax import plan
from tunix_mcjax.aot.programs import Program
from tunix_mcjax.aot.target import Target, shard_bytes

# The paper's measured decode iteration: Qwen3-0.6B, GSM8K, 64 TPU7x chips (section 4.3).
PAPER_DECODE_MS = 0.90
# What to change when a phase does not fit, as the planner names them.
FIX_KEYS = {
    "generate": "hbm_utilization_vllm, rollout_max_batch_size or max_num_batched_tokens",
    "train": "train_micro_batch_size, remat_policy=full or fsdp_gather_params_once=false",
    "publish": "rl_publish_weights_single_call=false (one leaf at a time)",
}


def progress(message: str) -> None:
    print(f"[aot] {message}", file=sys.stderr, flush=True)


def memory_figures(compiled) -> dict[str, int]:
    """XLA's memory analysis per device; `peak` is XLA's own where it reports one, else
    arguments + outputs - aliased + temporaries + code."""
    m = compiled.memory_analysis()
    figures = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
               "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
               "code": m.generated_code_size_in_bytes}
    summed = figures["arguments"] + figures["outputs"] - figures["aliased"] \
        + figures["temporaries"] + figures["code"]
    figures["peak"] = int(getattr(m, "peak_memory_in_bytes", 0) or summed)
    return figures


def compile_program(program: Program, target: Target, p: plan.Plan | None
                    ) -> tuple[dict[str, Any], Any]:
    """Compiles `program`; its phase's peak is XLA's peak for it plus what the other programs
    hold meanwhile (`resident`, from their shapes), beside the planner's peak for the phase
    (None: the planner has no figure for the model); it fits when that phase peak (the
    program's own peak where nothing else is held) is within the device's HBM."""
    progress(f"compiling {program.name} for {target.topology} ...")
    load_1m = os.getloadavg()[0]  # this host is shared: its load moves the wall seconds
    start, cpu = time.perf_counter(), time.process_time()
    try:
        compiled = program.lowered.compile()
    except Exception as e:  # XLA refuses programs that do not fit its HBM
        progress(f"{program.name}: XLA refused it: {str(e).splitlines()[0][:300]}")
        return {"name": program.name, "phase": program.phase, "compiled": False,
                "error": str(e).splitlines()[0][:1000], "fits": False}, None
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    progress(f"{program.name}: compiled in {seconds:.1f} s ({cpu_seconds:.1f} CPU s)")
    figures = memory_figures(compiled)
    row = {"name": program.name, "phase": program.phase, "compiled": True,
           "compile_s": round(seconds, 2), "compile_cpu_s": round(cpu_seconds, 2),
           "load_1m": round(load_1m, 2), **figures,
           "argument_shapes_bytes": shard_bytes(program.args)}
    row["fits"] = figures["peak"] <= target.chip.hbm_bytes
    if program.resident is not None:
        resident = shard_bytes(program.resident)
        row.update(resident=resident, phase_peak=figures["peak"] + resident,
                   plan_phase_peak=p.phases[program.phase] if p else None)
        row["fits"] = row["phase_peak"] <= target.chip.hbm_bytes
    return row, compiled


def decode_cost(compiled, target: Target, kv: dict) -> dict[str, Any]:
    """XLA's cost analysis of the decode step and its time at the HBM roofline: the bytes XLA
    counts plus the KV pages the attention kernel reads, at the chip's bandwidth."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_bytes = float(cost.get("bytes accessed", 0.0))
    total = xla_bytes + kv["kv_bytes_read"]
    return {**kv, "xla_bytes_accessed": xla_bytes, "flops": float(cost.get("flops", 0.0)),
            "roofline_ms": 1e3 * total / target.chip.hbm_bytes_per_s,
            "hbm_bytes_per_s": target.chip.hbm_bytes_per_s, "paper_ms": PAPER_DECODE_MS}


def gib(n: float) -> str:
    return f"{n / plan.GIB:8.2f}"


def program_lines(row: dict[str, Any]) -> list[str]:
    if not row["compiled"]:
        return [f"{row['name']}: XLA refused it ({row['error'][:200]})"]
    lines = [f"{row['name']} ({row['phase']}): compiled in {row['compile_s']:.1f} s; per device "
             f"GiB: arguments {gib(row['arguments'])}, outputs {gib(row['outputs'])} "
             f"(aliased {gib(row['aliased'])}), temporaries {gib(row['temporaries'])}, code "
             f"{gib(row['code'])}, peak {gib(row['peak'])}"]
    if "phase_peak" in row:
        planner = "-" if row["plan_phase_peak"] is None else gib(row["plan_phase_peak"])
        lines.append(f"  {row['phase']} phase: XLA {gib(row['phase_peak'])} (program + "
                     f"{gib(row['resident']).strip()} held by the others), planner "
                     f"{planner}: "
                     f"{'fits' if row['fits'] else 'does NOT fit'}")
    return lines


def cost_lines(cost: dict[str, Any]) -> list[str]:
    return [f"decode step: {cost['rows']} rows at {cost['context_tokens']} tokens; XLA "
            f"{cost['xla_bytes_accessed'] / 1e9:.3f} GB accessed, {cost['flops'] / 1e9:.1f} "
            f"GFLOP; + {cost['kv_bytes_read'] / 1e9:.3f} GB of KV pages read by the kernel",
            f"  roofline at {cost['hbm_bytes_per_s'] / 1e12:.2f} TB/s: "
            f"{cost['roofline_ms']:.3f} ms per iteration (paper, measured: "
            f"{cost['paper_ms']:.2f} ms, Qwen3-0.6B GSM8K on 64 TPU7x chips)"]
