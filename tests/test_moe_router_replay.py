"""Router replay for MaxText's MoE families (patches/maxtext/0004, `moe_router_replay`).

MaxText's MoE layer, patched, records each call's top-k experts and routes with given ones. On a
tiny Qwen3 MoE and gpt-oss (fp32), the routing an unscanned forward records, replayed through
the scanned trainer model of the same weights, gives that forward's logits; replaying other
experts moves them, so the forced routing is what routes. The checks run in one subprocess on a
patched copy of the installed maxtext (or on the install itself once `make setup` patched it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("maxtext")

from tests.mp import REPO, xla_flags  # noqa: E402
from tests.test_maxtext_engine import CPU, FAMILIES  # noqa: E402
from tunix_mcjax import patches  # noqa: E402

# The subprocess builds two families' models twice (trainer and engine): minutes on a busy CPU,
# so the tests that read its report are in the slow tier (`make test-slow`, which CI runs).
pytestmark = pytest.mark.timeout(1800)

MAXTEXT = patches.TARGETS["maxtext"]
REPLAY_PATCH = next(p for p in patches.series(MAXTEXT) if p.name.startswith("0004"))
MOE_FAMILIES = ("qwen3_moe", "gpt_oss")
# Routers whose experts 1 and 2 differ by this much noise: the engine's and the trainer's
# rounding then pick different experts for some tokens (ties as real checkpoints have them).
ROUTER_TIE = 1e-6


def patched_maxtext_root(tmp: Path) -> Path:
    """A site directory whose maxtext has the whole series applied: the installed one when it
    does, else a patched copy under `tmp`."""
    installed = patches.find_root(MAXTEXT)
    if set(patches.status(MAXTEXT, installed).values()) == {patches.State.APPLIED}:
        return installed
    shutil.copytree(installed / "maxtext", tmp / "maxtext",
                    ignore=shutil.ignore_patterns("__pycache__"))
    patches.apply(MAXTEXT, tmp)
    return tmp


def run_check(root: Path, mode: str) -> dict:
    """tests.workers.moe_replay_check's report for the MoE families in `mode`."""
    families = {name: [*FAMILIES[name], *CPU] for name in MOE_FAMILIES}
    rl_yml = root / "maxtext" / "configs" / "post_train" / "rl.yml"
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags(2)}
    result = subprocess.run(
        [sys.executable, "-m", "tests.workers.moe_replay_check", json.dumps(families),
         str(rl_yml), mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH; tunix_mcjax.patches needs it")
    return patched_maxtext_root(tmp_path_factory.mktemp("patched"))


@pytest.fixture(scope="module")
def replay_report(patched_root: Path) -> dict:
    return run_check(patched_root, f"test:{ROUTER_TIE}")


@pytest.fixture(scope="module")
def bf16_report(patched_root: Path) -> dict:
    return run_check(patched_root, f"bf16:0:{ROUTER_TIE}")


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_recorded_routing_replays_to_the_same_logits(replay_report: dict, family: str) -> None:
    """Within float32 summation order relative to the logits (20-26 at this init; the two
    forwards differ by 2e-6 to 4e-6 of that, and replaying other experts moves them by 28-31)."""
    out = replay_report[family]
    assert out["shape"] == [2, 24, 2, 2]  # [rows, tokens, moe layers, top-k]
    assert out["own"] < 1e-5 * out["scale"], "the scanned and unscanned forwards disagree"
    assert out["replayed"] < 1e-5 * out["scale"]


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_other_experts_changes_the_logits(replay_report: dict, family: str) -> None:
    assert replay_report[family]["shifted"] > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_trainer_replaying_the_engines_routing_scores_its_logprobs(replay_report: dict,
                                                                       family: str) -> None:
    """fp32, the rollout's weights: with replay the trainer's logprobs of the rollout tokens
    equal the engine's within 1e-4. Whether float32 rounding flips a near-tied route without
    replay turns on last-bit rounding that moves with the engine's kernels and the CPU (0.28 at
    64027ed, 1.1e-5 since), so the test that this check can fail is the bf16 one below, where
    rounding flips routes on any machine."""
    out = replay_report[family]["engine"]
    assert out["rest_routed"] and out["unrun_is_minus_one"]
    assert [shape[0] for shape in out["routing_shapes"]] == [a + n for a, n in out["lengths"]]
    assert all(shape[1:] == [2, 2] for shape in out["routing_shapes"])
    assert out["replay"] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_in_bf16_replay_halves_the_mismatch_on_near_tied_routers(bf16_report: dict,
                                                                 family: str) -> None:
    """A bf16 engine against the fp32 trainer at MaxText's init, routers tied as above: the
    routes that rounding flips are most of the mismatch, and replay removes them (mean
    |dlogp| at most half; measured 0.38x and 0.24x, docs/mismatch.md)."""
    out = bf16_report[family]
    assert out["replay"]["mean_abs_dlogp"] <= 0.5 * out["no_replay"]["mean_abs_dlogp"]
    assert out["replay"]["max_abs_dlogp"] < out["no_replay"]["max_abs_dlogp"]


def test_the_replay_patch_touches_only_moe_routing_files() -> None:
    assert patches.patched_files(REPLAY_PATCH) == [
        "maxtext/layers/moe.py", "maxtext/models/qwen3.py", "maxtext/models/gpt_oss.py",
        "maxtext/layers/nnx_decoders.py", "maxtext/configs/types.py"]


# --- the recorded routing through packing, and the key ------------------------------------------

def test_packing_places_each_sequences_routing_and_pads_with_no_expert() -> None:
    from tunix_mcjax.runtime.stepmath import local_batch
    from tunix_mcjax.train import packing

    rng = np.random.default_rng(0)

    def seq(a: int, b: int) -> packing.Sequence:
        return packing.Sequence(np.arange(1, a + 1, dtype=np.int32),
                                np.arange(1, b + 1, dtype=np.int32), 1.0,
                                np.zeros(b, np.float32),
                                routing=rng.integers(0, 4, (a + b, 2, 2)).astype(np.int32))

    seqs = [seq(3, 2), seq(2, 4), seq(4, 1)]
    rows = packing.pack(seqs, row_len=8, pad_id=0)
    for r in range(rows.num_rows):
        offset = 0
        for s_id in range(1, rows.segment_ids[r].max() + 1):
            span = np.flatnonzero(rows.segment_ids[r] == s_id)
            placed = rows.routing[r, span]
            assert any(np.array_equal(placed, s.routing) for s in seqs)
            offset = span[-1] + 1
        assert (rows.routing[r, offset:] == -1).all()  # padding routes nowhere
    local = local_batch(rows, rows_per_device=2, num_local_devices=2, pad_id=0,
                        loss_agg_mode="token-mean", global_sequences=3, global_tokens=7)
    assert local["routing"].shape == (4, 8, 2, 2) and (local["routing"][rows.num_rows:] == -1).all()
    with pytest.raises(ValueError, match="all or none"):
        packing.pack([seqs[0], packing.Sequence(seqs[1].prompt, seqs[1].completion, 1.0,
                                                seqs[1].behaviour_logprobs)], 8, 0)


def test_the_key_is_refused_where_nothing_routes() -> None:
    from tests.test_corrections_adapters import maxtext_argv
    from tunix_mcjax.config import ConfigError, load_config
    from tunix_mcjax.maxtext import checked_config

    with pytest.raises(ConfigError, match="moe_router_replay.*rollout_engine=jax"):
        load_config(None, ["moe_router_replay=true"])
    with pytest.raises(ConfigError, match="moe_router_replay.*rollout_engine=vllm"):
        load_config(None, ["moe_router_replay=true", "rollout_engine=vllm",
                           "rl_publish_weights_single_call=true"])
    with pytest.raises(ConfigError, match="moe_router_replay.*dense"):
        checked_config(maxtext_argv("moe_router_replay=true", "rollout_engine=maxtext"), {},
                       num_hosts=1)


def test_the_maxtext_adapter_takes_the_key_for_an_moe_family() -> None:
    from tests.test_maxtext_engine import RL_YML
    from tunix_mcjax.maxtext import checked_config

    argv = ["", RL_YML, *FAMILIES["qwen3_moe"], *CPU, "tokenizer_path=qwen3-tokenizer",
            "moe_router_replay=true"]
    _, cfg, _ = checked_config(argv, {}, num_hosts=1)
    assert cfg.moe_router_replay and cfg.rollout_engine == "maxtext"
