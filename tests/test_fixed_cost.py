"""The fixed cost of a train step on 4 CPU devices of one process: the compiled step's
collectives, and publishing without a second gather (engine weights are the trainer's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.mp import REPO, xla_flags
from tunix_mcjax.bench.hlo import collectives


@pytest.fixture(scope="module")
def fixed_cost(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fixed_cost")
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "XLA_FLAGS": xla_flags(4)}
    proc = subprocess.run([sys.executable, "-m", "tests.workers_memory.fixed_cost", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "fixed_cost.json").read_text())


@pytest.mark.parametrize("layout", ["flat", "flat_ref_micro_remat"])
def test_gathered_train_step_has_three_collectives(fixed_cost, layout):
    """One reduce-scatter of all gradients (and the loss sums), one all-reduce (the gradient
    norm's partial sums), one all-gather of the updated params; with a reference model,
    micro-batches and remat too."""
    result = fixed_cost[layout]
    assert result["flat"]
    if layout != "flat":
        assert result["ref"] and result["micro_batches"] > 1
    counts = {k: v["count"] for k, v in result["collectives"].items()}
    assert counts == {"reduce-scatter": 1, "all-reduce": 1, "all-gather": 1, "total": 3}


def test_sharded_compute_keeps_the_partitioners_collectives(fixed_cost):
    """The contrast: fsdp_gather_params_once=false gathers per layer (more, smaller ops)."""
    assert not fixed_cost["sharded"]["flat"]
    assert fixed_cost["sharded"]["collectives"]["total"]["count"] > 3


@pytest.mark.parametrize("layout", ["flat", "flat_ref_micro_remat", "sharded"])
@pytest.mark.parametrize("mode", ["single_call=True", "single_call=False"])
def test_published_weights_equal_the_trainers_exactly(fixed_cost, layout, mode):
    """After each of two steps, every engine replica holds the trainer's params bit for bit;
    from the flat step, without a gather and, outside the layers the engine stacks, in the
    trainer's own buffers (no copy on load)."""
    flat = fixed_cost[layout]["flat"]
    for check in fixed_cost[layout]["publish"]:
        assert check["finite"] == 1.0
        publish = check[mode]
        assert publish["equal"] and publish["leaves"] > 1
        assert publish["shared_buffers"] == flat
        gathers = 0 if flat else 1 if mode == "single_call=True" else publish["leaves"]
        assert publish["gather_calls"] == gathers


def test_collective_count_reads_tuples_and_async_starts():
    hlo = "\n".join([
        "  %all-reduce.1 = (f32[], bf16[4,2]{1,0}) all-reduce(%a, %b), channel_id=3",
        "  %ag = f32[2,8]{1,0} all-gather(%c), channel_id=1",
        "  ROOT %s = f32[3]{0} reduce-scatter-start(%y)",
        "  %d = f32[3]{0} reduce-scatter-done(%s)",
        "  %w = f32[3]{0} add(%all-gather.1, %b)",
    ])
    assert collectives(hlo) == {"all-reduce": {"count": 1, "bytes": 4 + 16},
                                "all-gather": {"count": 1, "bytes": 64},
                                "reduce-scatter": {"count": 1, "bytes": 12},
                                "total": {"count": 3, "bytes": 96}}
