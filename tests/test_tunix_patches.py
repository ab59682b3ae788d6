"""The Tunix patch series (patches/tunix/) and `python -m tunix_mcjax.patches ... tunix`.

The installed tunix is never patched here. Each check copies it into a temporary directory
(verified byte for byte against google-tunix's wheel RECORD), applies the series there with the
tool, and runs a script from tests/tunix_checks/ in a subprocess with that copy first on
PYTHONPATH. The same script runs against the pristine copy, and the tests assert both: the
failure Tunix 0.1.7 shows, and its absence with the patch. Multi-process checks are real
jax.distributed jobs on 127.0.0.1 (gloo), 2 processes x 2 CPU devices, each with a deadline.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_maxtext_patches import record_hash
from tunix_mcjax import hostenv, patches

TUNIX = patches.TARGETS["tunix"]
SERIES = patches.series(TUNIX)
REPO = Path(__file__).resolve().parents[1]
CHECKS = Path(__file__).resolve().parent / "tunix_checks"
DIST_INFO = f"google_tunix-{TUNIX.version}.dist-info"
MIN_CONFIG = """\
model_config:
  model_name: qwen3-0.6b
  model_source: huggingface
  intermediate_ckpt_dir: /unused/ckpt
tokenizer_config:
  tokenizer_path: /unused/tokenizer
  tokenizer_type: huggingface
batch_size: 1
"""


def _touched_files() -> list[str]:
    return [f for p in SERIES for f in patches.patched_files(p)]



@pytest.fixture(scope="module")
def installed_root() -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH; tunix_mcjax.patches needs it")
    return patches.find_root(TUNIX)


@pytest.fixture(scope="module")
def pristine_root(installed_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the installed tunix (and its dist-info) with the series reverse-applied."""
    root = tmp_path_factory.mktemp("pristine")
    shutil.copytree(installed_root / "tunix", root / "tunix",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(installed_root / DIST_INFO, root / DIST_INFO)
    for patch in reversed(SERIES):
        if patches.patch_state(patch, root) is patches.State.APPLIED:
            assert patches.git_apply(patch, root, "--reverse").returncode == 0
    record = {str(f): f.hash.value for f in importlib.metadata.distribution("google-tunix").files
              if f.hash}
    for rel in _touched_files():
        assert record[rel] == record_hash(root / rel), (
            f"installed {rel} differs from the google-tunix {TUNIX.version} wheel even with the "
            "series reverse-applied; fix: pip install --force-reinstall --no-deps "
            f"google-tunix=={TUNIX.version}"
        )
    return root


@pytest.fixture(scope="module")
def patched_root(pristine_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full pristine copy with the whole series applied by the tool."""
    root = tmp_path_factory.mktemp("patched")
    shutil.copytree(pristine_root, root, dirs_exist_ok=True)
    assert patches.main(["apply", "tunix", "--root", str(root)]) == 0
    return root


@pytest.fixture
def tree(pristine_root: Path, tmp_path: Path) -> Path:
    """A pristine copy of just the files the series touches, and the version file."""
    for rel in [*_touched_files(), f"{DIST_INFO}/METADATA"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine_root / rel, tmp_path / rel)
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in _touched_files()}


def _report(stdout: str) -> dict | None:
    lines = [line for line in stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(lines[-1].removeprefix("REPORT ")) if lines else None


def run_check(root: Path, script: str, *args: str, timeout: float = 120) -> dict:
    """Runs tests/tunix_checks/SCRIPT in one process with ROOT's tunix first; its report."""
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}", "JAX_PLATFORMS": "cpu"}
    env = {k: v for k, v in env.items() if not k.startswith("T_")}
    result = subprocess.run([sys.executable, str(CHECKS / script), *args], cwd=root, env=env,
                            capture_output=True, text=True, timeout=timeout)
    report = _report(result.stdout)
    assert result.returncode == 0 and report, result.stderr[-5000:]
    return report


def run_check_mp(root: Path, script: str, *args: str, timeout: float = 60,
                 processes: int = 2, devices: int = 2) -> list[dict]:
    """Runs SCRIPT as every process of one jax.distributed job on 127.0.0.1.

    Returns one dict per process: its report, or {"timeout": True} when the job was still
    running at the deadline (then every process is killed), or {"rc", "stderr"} on a failure.
    """
    port = hostenv.free_port()
    procs = []
    for host in range(processes):
        env = hostenv.host_env(host, processes, devices, port)
        env["PYTHONPATH"] = f"{root}{os.pathsep}{REPO}"
        procs.append(subprocess.Popen([sys.executable, str(CHECKS / script), *args], cwd=root,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outcomes: list[dict] = []
    timed_out = False
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=None if timed_out else timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in procs:
                if p.poll() is None:
                    p.kill()
            stdout, stderr = proc.communicate()
        report = _report(stdout)
        if report is not None and proc.returncode == 0:
            outcomes.append(report)
        elif timed_out:
            outcomes.append({"timeout": True})
        else:
            outcomes.append({"rc": proc.returncode, "stderr": stderr[-3000:]})
    return outcomes


# --- the series and the tool ---------------------------------------------------------------------

def test_every_patch_has_pr_text() -> None:
    assert [p.name[:4] for p in SERIES] == [f"{i:04d}" for i in range(1, len(SERIES) + 1)]
    for patch in SERIES:
        pr_text = patch.with_suffix(".md").read_text()
        assert pr_text.startswith("# ") and "## Summary" in pr_text and "## Testing" in pr_text
        assert "## Behaviour change for existing users" in pr_text
        files = patches.patched_files(patch)
        assert files and all(f.startswith("tunix/") for f in files)


@pytest.mark.parametrize("patch", SERIES, ids=lambda p: p.name[:4])
def test_each_patch_applies_alone_and_after_all_the_others(patch: Path, tree: Path) -> None:
    """0002 and 0005 share sampler.py (separate hunks): each patch's state stays its own."""
    others = [p for p in SERIES if p != patch]
    assert patches.git_apply(patch, tree).returncode == 0
    assert [patches.patch_state(p, tree) for p in SERIES] == [
        patches.State.APPLIED if p == patch else patches.State.NOT_APPLIED for p in SERIES]
    assert patches.git_apply(patch, tree, "--reverse").returncode == 0
    for other in others:
        assert patches.git_apply(other, tree).returncode == 0
    assert patches.patch_state(patch, tree) is patches.State.NOT_APPLIED
    assert patches.apply(TUNIX, tree) == [patch]
    assert set(patches.status(TUNIX, tree).values()) == {patches.State.APPLIED}


def test_check_passes_on_pristine_tunix_and_apply_is_idempotent(tree: Path) -> None:
    assert patches.main(["check", "tunix", "--root", str(tree)]) == 0
    assert set(patches.status(TUNIX, tree).values()) == {patches.State.NOT_APPLIED}
    assert patches.main(["status", "tunix", "--root", str(tree)]) == 1
    before = _snapshot(tree)
    assert patches.check(TUNIX, tree) == SERIES
    assert _snapshot(tree) == before, "check must not change files"
    assert patches.apply(TUNIX, tree) == SERIES
    patched = _snapshot(tree)
    assert patches.apply(TUNIX, tree) == []
    assert _snapshot(tree) == patched
    assert patches.main(["status", "tunix", "--root", str(tree)]) == 0


def test_refuses_another_tunix_version(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metadata = tree / DIST_INFO / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.1.7", "Version: 0.1.8"))
    before = _snapshot(tree)
    assert patches.main(["apply", "tunix", "--root", str(tree)]) == 1
    err = capsys.readouterr().err
    assert "tunix 0.1.8 is installed" in err and "pip install google-tunix==0.1.7" in err
    assert _snapshot(tree) == before


def test_refuses_a_tree_without_tunix_metadata(tree: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    shutil.rmtree(tree / DIST_INFO)
    assert patches.main(["check", "tunix", "--root", str(tree)]) == 1
    assert "no single tunix installation" in capsys.readouterr().err


# --- 0001: rl_runtime and the dispatch -----------------------------------------------------------

@pytest.fixture(scope="module")
def dispatch_reports(pristine_root: Path, patched_root: Path) -> dict[str, dict]:
    reports = {}
    for name, root in (("pristine", pristine_root), ("patched", patched_root)):
        (root / "grpo.yaml").write_text(MIN_CONFIG)
        (root / "grpo_mcjax.yaml").write_text(MIN_CONFIG + "rl_runtime: mcjax\n")
        reports[name] = run_check(root, "cli_dispatch.py", "grpo.yaml", "grpo_mcjax.yaml")
        assert reports[name]["grpo_main"].startswith(str(root))
    return reports


def test_rl_runtime_hands_the_run_over_before_any_backend_exists(
        dispatch_reports: dict[str, dict]) -> None:
    pristine, patched = dispatch_reports["pristine"], dispatch_reports["patched"]
    assert pristine["runtime_calls"] == []
    assert "rl_runtime was passed at the command line but isn't in config" in pristine["cli"]
    assert "isn't in config" in pristine["override_file"]
    assert "T_RL_RUNTIME but it doesn't match a key" in pristine["env"]
    assert pristine["yaml"] is not None, "Tunix 0.1.7 runs its own pipeline, which fails here"

    assert all(patched[k] is None for k in ("cli", "yaml", "override_file", "env"))
    calls = patched["runtime_calls"]
    assert [c["argv"] for c in calls] == [
        ["grpo_main", "grpo.yaml", "rl_runtime=mcjax"], ["grpo_main", "grpo_mcjax.yaml"],
        ["grpo_main", "grpo.yaml", "override_config_file=grpo_mcjax.yaml"],
        ["grpo_main", "grpo.yaml"]]
    assert [c["kwargs"] for c in calls] == [{"extra": 1}, {}, {}, {}]
    assert not any(c["backends_initialized"] for c in calls)
    assert patched["backends_initialized_by_dispatch"] is False


def test_rl_runtime_errors_name_the_fix(dispatch_reports: dict[str, dict]) -> None:
    patched = dispatch_reports["patched"]
    missing = patched["missing_runtime"]
    assert missing.startswith("RuntimeError") and "pip install tunix_mcjax" in missing
    assert "'tunix.rl_runtimes'" in missing
    unknown = patched["unknown_runtime"]
    assert unknown.startswith("ValueError") and "'foo'" in unknown and "default, mcjax" in unknown


def test_rl_runtime_is_a_config_key_defaulting_to_default(
        dispatch_reports: dict[str, dict]) -> None:
    pristine, patched = dispatch_reports["pristine"], dispatch_reports["patched"]
    assert pristine["key_default"] == {"value": None}
    assert "isn't in config" in pristine["key_cli"]["error"]
    assert patched["key_default"] == {"value": "default"}
    assert patched["key_cli"] == {"value": "mcjax"}
    assert patched["key_env"] == {"value": "mcjax"}


# --- 0002: the sampler's key without a seed ------------------------------------------------------

def test_unseeded_sampler_calls_draw_fresh_keys_only_when_asked(pristine_root: Path,
                                                                patched_root: Path) -> None:
    pristine = run_check(pristine_root, "sampler_seed.py")
    patched = run_check(patched_root, "sampler_seed.py")
    assert pristine["sampler"].startswith(str(pristine_root))
    assert patched["sampler"].startswith(str(patched_root))
    assert "fresh_key_per_call" in pristine["fresh_keys"]["error"]
    assert pristine["unseeded"][0] == pristine["unseeded"][1], "Tunix 0.1.7 reuses PRNGKey(0)"
    assert patched["unseeded"] == pristine["unseeded"], "by default, still PRNGKey(0)"
    assert patched["seeded"] == pristine["seeded"], "seeded sampling is unchanged"
    fresh = patched["fresh_keys"]
    assert fresh[0] != fresh[1] and pristine["unseeded"][0] not in fresh
    for report in (pristine, patched):
        assert report["seeded"][0] == report["seeded"][1], "a given seed stays reproducible"
        assert report["seeded"][0] != report["unseeded"][0]


# --- 0003: shard_input under jax.distributed -----------------------------------------------------

@pytest.fixture(scope="module")
def shard_reports(pristine_root: Path, patched_root: Path) -> dict[str, list[dict]]:
    return {"pristine": run_check_mp(pristine_root, "shard_input.py"),
            "patched": run_check_mp(patched_root, "shard_input.py")}


def _global_fsdp(summary: dict, expected_rows: list[int], global_rows: int) -> bool:
    return (summary["type"] == "jax.Array" and summary["global_shape"][0] == global_rows
            and summary["spec"] == "P('fsdp',)" and summary["local_rows"] == expected_rows)


def test_shard_input_makes_local_leaves_global_beside_global_ones(
        shard_reports: dict[str, list[dict]]) -> None:
    """beta > 0: the reference logps are global, the completions local, in one batch."""
    for pristine, patched in zip(shard_reports["pristine"], shard_reports["patched"], strict=True):
        rows = patched["expected_local_rows"]
        assert pristine["mixed"]["completion_ids"] == {"type": "ndarray"}, "Tunix 0.1.7 mixes"
        for key in ("completion_ids", "ref_per_token_logps"):
            assert _global_fsdp(patched["mixed"][key], rows, 2 * len(rows))


def test_shard_input_shards_rows_that_split_over_local_devices(
        shard_reports: dict[str, list[dict]]) -> None:
    """2 rows per process on a 4-way FSDP mesh: each process's devices hold one row each."""
    for pristine, patched in zip(shard_reports["pristine"], shard_reports["patched"], strict=True):
        rows = patched["expected_local_rows"][:2]
        silent = pristine["local_only"]["completion_ids"]
        assert silent["spec"] == "P()" and silent["global_shape"] == [2, 3], (
            "Tunix 0.1.7 replicates, so each process's rows pass for one shared array")
        assert _global_fsdp(patched["local_only"]["completion_ids"], rows, 4)


def test_shard_input_refuses_rows_that_do_not_split(
        shard_reports: dict[str, list[dict]]) -> None:
    for pristine, patched in zip(shard_reports["pristine"], shard_reports["patched"], strict=True):
        assert pristine["uneven"]["completion_ids"]["spec"] == "P()", "Tunix 0.1.7 replicates"
        error = patched["uneven"]["error"]
        assert "this process holds 3 rows" in error and "multiple of 2" in error


def test_shard_input_replicates_uneven_rows_on_a_process_local_mesh(
        shard_reports: dict[str, list[dict]]) -> None:
    """No other process's devices in the mesh: nothing to corrupt, Tunix's behaviour stays."""
    for pristine, patched in zip(shard_reports["pristine"], shard_reports["patched"], strict=True):
        assert patched["uneven_local_mesh"] == pristine["uneven_local_mesh"]
        assert pristine["uneven_local_mesh"]["completion_ids"]["spec"] == "P()"


def test_single_process_shard_input_behaves_as_tunix_does(pristine_root: Path,
                                                          patched_root: Path) -> None:
    """One process, 4 devices: 8 rows shard, 2, 7 and 9 rows are replicated, never refused."""
    pristine = run_check(pristine_root, "shard_input_single.py")
    patched = run_check(patched_root, "shard_input_single.py")
    assert patched["sharding_utils"].startswith(str(patched_root))
    assert patched["devices"] == 4
    assert patched["rows"] == pristine["rows"]
    assert {rows: out["spec"] for rows, out in pristine["rows"].items()} == {
        "2": "P()", "7": "P()", "8": "P('fsdp',)", "9": "P()"}


# --- 0002 in Tunix's own loop: a GRPO run resumed from a checkpoint -----------------------------

def test_grpo_learner_resumed_from_a_checkpoint_equals_an_uninterrupted_run(
        patched_root: Path, tmp_path: Path) -> None:
    """Tunix's rollout draws its keys without a seed; a resumed run must draw the same ones."""
    report = run_check(patched_root, "grpo_resume.py", str(tmp_path / "checkpoints"))
    assert report["grpo_learner"].startswith(str(patched_root))
    assert report["restored_step"] == 1 and report["steps"] == [2, 1, 2]
    assert report["trained_change"] > 0, "the check must change the actor's weights"
    assert report["max_diff"] == 0.0


# --- 0004: RLCluster with a per-process rollout ---------------------------------------------------

@pytest.mark.slow  # Tunix over two processes on a pristine or patched copy
def test_rl_cluster_builds_and_syncs_a_per_process_rollout(pristine_root: Path,
                                                           patched_root: Path) -> None:
    """Actor FSDP over both processes, rollout on each process's own devices."""
    pristine = run_check_mp(pristine_root, "per_process_rollout.py")
    patched = run_check_mp(patched_root, "per_process_rollout.py")
    for report in pristine:
        assert "does not support cross-host device transfers" in report["error"], report
        assert "built" not in report
    for report in patched:
        assert report["reshard"].startswith(str(patched_root)) and "error" not in report, report
        assert report["built"] and report["rollout_fully_addressable"]
        assert report["unsynced_max_diff"] > 0.1, "the check must change the actor's weights"
        assert report["synced_max_diff"] == 0.0
    host0, host1 = (r["completions"] for r in patched)
    assert host0[1] == host1[1], "the same prompt decodes the same on both processes"
    assert host0[0] != host1[0], "each process decodes its own prompt"


# --- 0005: generation on params that span processes ----------------------------------------------

def _generation(root: Path, stops: str) -> list[dict]:
    return run_check_mp(root, "global_mesh_generation.py", stops)


@pytest.mark.slow  # Tunix over two processes on a pristine or patched copy
def test_global_mesh_generation_mixes_processes_rows_without_the_patch(
        pristine_root: Path) -> None:
    pristine = _generation(pristine_root, "equal")
    assert pristine[0]["completions"] == pristine[1]["completions"], (
        "Tunix 0.1.7 hands every process the same mixture of rows")
    assert any(r["completions"] != r["reference"] for r in pristine)


@pytest.mark.slow  # Tunix over two processes on a pristine or patched copy
def test_global_mesh_generation_gives_each_process_its_own_rows(patched_root: Path) -> None:
    """Each process's completions must equal a local decode of its own prompts."""
    patched = _generation(patched_root, "equal")
    for report in patched:
        assert report["sampler"].startswith(str(patched_root))
        assert report["completions"] == report["reference"]
        assert report["completions_2_rows"] == report["reference_2_rows"]
    assert patched[0]["completions"] != patched[1]["completions"]


@pytest.mark.bench  # Tunix generation on a patched copy over two processes
def test_global_mesh_generation_with_uneven_stops_does_not_hang(pristine_root: Path,
                                                                patched_root: Path) -> None:
    """Process 1's rows stop at their first token, process 0's run to the budget."""
    pristine = _generation(pristine_root, "uneven")
    assert pristine[0] == {"timeout": True}, "Tunix 0.1.7's decode loop deadlocks"
    patched = _generation(patched_root, "uneven")
    for report in patched:
        assert report["completions"] == report["reference"], report
    assert all(len(tokens) == 12 for tokens in patched[0]["completions"])
    assert patched[1]["completions"] == [[], [], [], []]
