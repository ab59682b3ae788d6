"""The MaxText patch series (patches/maxtext/) and the tool that applies it (tunix_mcjax.patches).

Every tree these tests patch is a temporary copy. The pristine copy is rebuilt from the installed
maxtext by reverse-applying whatever of the series is applied there, then checked byte for byte
against the hashes in maxtext's wheel RECORD.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stubs import stub_gcluster
from tunix_mcjax import patches

MAXTEXT = patches.TARGETS["maxtext"]
SERIES = patches.series(MAXTEXT)
SCRIPTS = [
    f"maxtext/trainers/post_train/rl/scripts/{name}"
    for name in ("run_qwen3_30b_rl.sh", "run_gptoss_20b_rl.sh", "run_gemma4_26b_rl.sh",
                 "run_gemma4_e4b_rl.sh")
]
PATHWAYS_ENV = ("JAX_PLATFORMS", "JAX_BACKEND_TARGET", "ENABLE_PATHWAYS_PERSISTENCE")
FLAGS = ["rl_async_metrics_export", "rl_gc_freeze_after_warmup", "rl_balance_prompts_by_length",
         "rl_publish_weights_single_call"]


def _touched_files() -> list[str]:
    return [f for p in SERIES for f in patches.patched_files(p)] + [MAXTEXT.version_file]


def record_hash(path: Path) -> str:
    """The file's hash as a wheel RECORD writes it."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@pytest.fixture(scope="module")
def installed_root() -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH; tunix_mcjax.patches needs it")
    try:
        return patches.find_root(MAXTEXT)
    except patches.PatchError:
        pytest.skip("maxtext is not installed in this venv; run `make setup`")


@pytest.fixture(scope="module")
def pristine_root(installed_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full copy of the installed maxtext package with the series reverse-applied."""
    root = tmp_path_factory.mktemp("pristine")
    shutil.copytree(installed_root / "maxtext", root / "maxtext",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for patch in reversed(SERIES):
        if patches.patch_state(patch, root) is patches.State.APPLIED:
            assert patches.git_apply(patch, root, "--reverse").returncode == 0
    record = {str(f): f.hash.value for f in importlib.metadata.distribution("maxtext").files
              if f.hash}
    for rel in _touched_files():
        assert record[rel] == record_hash(root / rel), (
            f"installed {rel} differs from the maxtext {MAXTEXT.version} wheel even with the "
            "series reverse-applied; fix: pip install --force-reinstall --no-deps "
            "maxtext==0.2.5 && python -m tunix_mcjax.patches apply maxtext"
        )
    return root


@pytest.fixture
def tree(pristine_root: Path, tmp_path: Path) -> Path:
    """A pristine copy of just the files the series touches."""
    for rel in _touched_files():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine_root / rel, tmp_path / rel)
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {rel: (root / rel).read_bytes() for rel in _touched_files()}


# --- the series itself ---------------------------------------------------------------------------

def test_every_patch_has_pr_text_and_applies_alone() -> None:
    """Each patch is one upstream PR: its own text, and files that another patch changes
    only in hunks apart (each applies to pristine MaxText alone: the parametrized test below)."""
    assert [p.name[:4] for p in SERIES] == ["0001", "0002", "0003", "0004"]
    shared = {"maxtext/configs/types.py"}  # 0001's RL fields, 0004's router replay list
    seen: set[str] = set()
    for patch in SERIES:
        pr_text = patch.with_suffix(".md").read_text()
        assert pr_text.startswith("# ") and "## Summary" in pr_text and "## Testing" in pr_text
        assert "## Behaviour change for existing users" in pr_text
        files = patches.patched_files(patch)
        assert files and all(f.startswith("maxtext/") for f in files)
        assert not (seen & set(files)) - shared, f"{patch.name} repeats a file of an earlier one"
        seen |= set(files)


@pytest.mark.parametrize("patch", SERIES, ids=lambda p: p.name[:4])
def test_patch_applies_to_pristine_maxtext(patch: Path, tree: Path) -> None:
    result = patches.git_apply(patch, tree, "--check")
    assert result.returncode == 0, result.stderr
    assert patches.patch_state(patch, tree) is patches.State.NOT_APPLIED


# --- the tool ------------------------------------------------------------------------------------

def test_apply_is_idempotent_and_status_reports_each_patch(tree: Path) -> None:
    assert set(patches.status(MAXTEXT, tree).values()) == {patches.State.NOT_APPLIED}
    assert patches.main(["status", "maxtext", "--root", str(tree)]) == 1
    before = _snapshot(tree)
    assert patches.check(MAXTEXT, tree) == SERIES
    assert _snapshot(tree) == before, "check must not change files"

    assert patches.apply(MAXTEXT, tree) == SERIES
    patched = _snapshot(tree)
    assert b"rl_runtime: RLRuntime" in patched["maxtext/configs/types.py"]
    assert b"import maxtext.integration.vllm" not in patched[
        "maxtext/trainers/post_train/rl/train_rl.py"].split(b"def _load_vllm_rollout")[0]

    assert patches.apply(MAXTEXT, tree) == []
    assert patches.main(["apply", "maxtext", "--root", str(tree)]) == 0
    assert _snapshot(tree) == patched
    assert set(patches.status(MAXTEXT, tree).values()) == {patches.State.APPLIED}
    assert patches.main(["status", "maxtext", "--root", str(tree)]) == 0
    assert patches.main(["check", "maxtext", "--root", str(tree)]) == 0


def test_apply_completes_a_partly_applied_series(tree: Path) -> None:
    assert patches.git_apply(SERIES[1], tree).returncode == 0
    states = patches.status(MAXTEXT, tree)
    assert [states[p] for p in SERIES] == [patches.State.NOT_APPLIED, patches.State.APPLIED,
                                           patches.State.NOT_APPLIED, patches.State.NOT_APPLIED]
    assert patches.apply(MAXTEXT, tree) == [SERIES[0], SERIES[2], SERIES[3]]
    assert set(patches.status(MAXTEXT, tree).values()) == {patches.State.APPLIED}


def test_refuses_another_maxtext_version(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    version_file = tree / MAXTEXT.version_file
    version_file.write_text(version_file.read_text().replace('"0.2.5"', '"0.2.6"'))
    before = _snapshot(tree)
    assert patches.main(["apply", "maxtext", "--root", str(tree)]) == 1
    err = capsys.readouterr().err
    assert "maxtext 0.2.6 is installed" in err and "pip install maxtext==0.2.5" in err
    assert _snapshot(tree) == before


def test_refuses_changed_content_before_changing_anything(
        tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train_rl = tree / "maxtext/trainers/post_train/rl/train_rl.py"
    text = train_rl.read_text()
    train_rl.write_text(text.replace("adapter.register()\n", "adapter.register(None)\n"))
    assert patches.status(MAXTEXT, tree)[SERIES[1]] is patches.State.MISMATCH
    before = _snapshot(tree)
    assert patches.main(["apply", "maxtext", "--root", str(tree)]) == 1
    err = capsys.readouterr().err
    assert SERIES[1].name in err and "maxtext/trainers/post_train/rl/train_rl.py" in err
    assert "pip install --force-reinstall --no-deps maxtext==0.2.5" in err
    assert _snapshot(tree) == before, "a refused apply must leave every file as it was"


def test_applies_inside_an_unrelated_git_repository(tree: Path) -> None:
    """A venv inside a checkout: git must patch the files, not skip them as outside the repo."""
    subprocess.run(["git", "init", "-q", str(tree.parent)], check=True)
    assert patches.apply(MAXTEXT, tree) == SERIES
    assert b"rl_runtime" in (tree / "maxtext/configs/types.py").read_bytes()


# --- patch 3: recipe scripts ---------------------------------------------------------------------

def _submit(script: Path, tmp_path: Path, rl_runtime: str | None) -> tuple[int, list[str] | None]:
    """Runs a recipe script against a stub gcluster; returns its exit code and submit arguments."""
    bin_dir, log = stub_gcluster(tmp_path)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SUBMIT_LOG": str(log), "PROJECT_ID": "p",
           "CLUSTER_NAME": "c", "ZONE": "z", "BASE_OUTPUT_DIRECTORY": "gs://out",
           "DOCKER_IMAGE": "img", "MAXTEXT_CKPT_PATH": "gs://ckpt", "RUN_NAME": "run"}
    if rl_runtime is not None:
        env["RL_RUNTIME"] = rl_runtime
    rc = subprocess.run(["bash", str(script)], env=env, capture_output=True).returncode
    return rc, log.read_text().split("\0")[:-1] if log.exists() else None


def _command(args: list[str]) -> list[str]:
    (command,) = [a.removeprefix("--command=") for a in args if a.startswith("--command=")]
    return shlex.split(command)


@pytest.mark.parametrize("rel", SCRIPTS, ids=lambda r: Path(r).stem)
def test_recipe_script_rl_runtime_switch(rel: str, pristine_root: Path, tree: Path,
                                         tmp_path: Path) -> None:
    rc, before = _submit(pristine_root / rel, tmp_path, None)
    assert rc == 0 and before and "--pathways" in before
    assert patches.git_apply(SERIES[2], tree).returncode == 0

    rc, default = _submit(tree / rel, tmp_path, None)
    assert rc == 0 and default
    assert sorted(a for a in default if not a.startswith("--command=")) == sorted(
        a for a in before if not a.startswith("--command="))
    assert sorted(_command(default)) == sorted(_command(before) + ["rl_runtime=pathways"])

    rc, mcjax = _submit(tree / rel, tmp_path, "mcjax")
    assert rc == 0 and mcjax
    assert not [a for a in mcjax if a.startswith("--pathways")]
    command = _command(mcjax)
    assert command[-1] == "rl_runtime=mcjax"
    (proxy_args,) = [a.removeprefix("--pathways-proxy-args=") for a in before
                     if a.startswith("--pathways-proxy-args=")]
    assert command.count(f"LIBTPU_INIT_ARGS={proxy_args}") == 1
    kept = [w for w in _command(before) if w.split("=")[0] not in PATHWAYS_ENV]
    assert sorted(w for w in command if not w.startswith("LIBTPU_INIT_ARGS=")) == sorted(
        kept + ["rl_runtime=mcjax"])

    assert _submit(tree / rel, tmp_path, "foo") == (1, None)


# --- patches 1 and 2 in a patched copy of the whole package, in a subprocess ---------------------

DRIVER = r'''
"""Exercises a patched maxtext first on sys.path; prints one "REPORT <json>" line."""
import importlib.metadata as md
import json
import os
import sys
import traceback

from jax._src import xla_bridge
from maxtext.configs import pyconfig, types
from maxtext.trainers.post_train.rl import train_rl
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

RL_YML = os.path.join(MAXTEXT_CONFIGS_DIR, "post_train", "rl.yml")
BASE = ["train_rl", RL_YML, "model_name=qwen3-0.6b"]
FLAGS = __FLAGS__
report = {"train_rl": train_rl.__file__, "runtime_calls": []}
real_entry_points = md.entry_points


def fake_runtime(argv, kwargs):
    report["runtime_calls"].append({"argv": list(argv), "kwargs": kwargs,
                                    "backends_initialized": xla_bridge.backends_are_initialized()})


def registered(runtimes):
    def entry_points(**selection):
        if selection.get("group") != train_rl.RL_RUNTIME_ENTRY_POINT_GROUP:
            return real_entry_points(**selection)
        return md.EntryPoints([md.EntryPoint(name, "__main__:fake_runtime", selection["group"])
                               for name in runtimes if name == selection.get("name")])
    return entry_points


def error_of(fn):
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def config(argv, **env):
    os.environ.update(env)
    try:
        cfg = pyconfig.initialize(argv, config_class=types.RLConfig)
        return {key: getattr(cfg, key) for key in ["rl_runtime", *FLAGS]}
    finally:
        for key in env:
            del os.environ[key]


md.entry_points = registered(["mcjax"])
train_rl.main(BASE + ["rl_runtime=mcjax", "run_name=cli"], {"extra": 1})
os.environ["M_RL_RUNTIME"] = "mcjax"
train_rl.main(BASE + ["run_name=env"])
del os.environ["M_RL_RUNTIME"]
md.entry_points = registered([])
report["missing_runtime"] = error_of(lambda: train_rl.main(BASE + ["rl_runtime=mcjax"]))
report["unknown_runtime"] = error_of(lambda: train_rl.main(BASE + ["rl_runtime=foo"]))
md.entry_points = real_entry_points
report["backends_initialized_by_dispatch"] = xla_bridge.backends_are_initialized()

report["config_default"] = config(BASE)
report["config_cli"] = config(BASE + ["rl_runtime=mcjax"] + [f"{flag}=true" for flag in FLAGS])
report["config_env"] = config(BASE, M_RL_RUNTIME="mcjax", **{f"M_{f.upper()}": "1" for f in FLAGS})
report["config_yaml"] = config(["train_rl", sys.argv[1], "model_name=qwen3-0.6b"])
report["config_foo"] = error_of(lambda: config(BASE + ["rl_runtime=foo"]))

try:
    train_rl.main(BASE)
    report["pathways"] = "returned"
except ImportError as e:
    report["pathways"] = {"error": str(e), "cause": type(e.__cause__).__name__,
                          "raised_in": traceback.extract_tb(e.__traceback__)[-1].name}
print("REPORT " + json.dumps(report))
'''


@pytest.fixture(scope="module")
def patched_maxtext_report(pristine_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Applies the series to a full copy of maxtext and runs DRIVER against it."""
    root = tmp_path_factory.mktemp("patched")
    shutil.copytree(pristine_root / "maxtext", root / "maxtext")
    assert patches.apply(MAXTEXT, root) == SERIES
    yaml_config = root / "mcjax.yml"
    yaml_config.write_text('base_config: "post_train/rl.yml"\nrl_runtime: mcjax\n'
                           + "".join(f"{flag}: true\n" for flag in FLAGS))
    driver = root / "driver.py"
    driver.write_text(DRIVER.replace("__FLAGS__", repr(FLAGS)))
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("M_")}
    result = subprocess.run([sys.executable, str(driver), str(yaml_config)], cwd=root, env=env,
                            capture_output=True, text=True, timeout=300)
    reports = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and reports, result.stderr[-5000:]
    report = json.loads(reports[-1].removeprefix("REPORT "))
    assert report["train_rl"].startswith(str(root)), "the driver must import the patched copy"
    return report



def test_config_defaults_are_pathways_and_flags_off(patched_maxtext_report: dict) -> None:
    assert patched_maxtext_report["config_default"] == {"rl_runtime": "pathways",
                                                        **dict.fromkeys(FLAGS, False)}


@pytest.mark.parametrize("source", ["cli", "env", "yaml"])
def test_config_accepts_mcjax_and_flags(source: str, patched_maxtext_report: dict) -> None:
    assert patched_maxtext_report[f"config_{source}"] == {"rl_runtime": "mcjax",
                                                          **dict.fromkeys(FLAGS, True)}


def test_config_rejects_unknown_runtime(patched_maxtext_report: dict) -> None:
    rejected = patched_maxtext_report["config_foo"]
    assert rejected.startswith("ValidationError") and "rl_runtime" in rejected
    assert "Input should be 'pathways' or 'mcjax'" in rejected


def test_mcjax_hands_the_run_over_before_any_backend_exists(patched_maxtext_report: dict) -> None:
    calls = patched_maxtext_report["runtime_calls"]
    assert [c["argv"][-1] for c in calls] == ["run_name=cli", "run_name=env"]
    assert calls[0]["argv"][-2] == "rl_runtime=mcjax" and calls[0]["kwargs"] == {"extra": 1}
    assert not any(c["backends_initialized"] for c in calls)
    assert patched_maxtext_report["backends_initialized_by_dispatch"] is False


def test_dispatch_errors_name_the_fix(patched_maxtext_report: dict) -> None:
    missing = patched_maxtext_report["missing_runtime"]
    assert missing.startswith("RuntimeError") and "pip install tunix_mcjax" in missing
    assert "'maxtext.rl_runtimes'" in missing
    unknown = patched_maxtext_report["unknown_runtime"]
    assert unknown.startswith("ValueError") and "'foo'" in unknown


def test_default_runtime_reaches_pathways_path_and_its_lazy_vllm_import(
        patched_maxtext_report: dict) -> None:
    pathways = patched_maxtext_report["pathways"]
    assert pathways["raised_in"] == "_load_vllm_rollout"
    assert pathways["cause"] == "ModuleNotFoundError"
    assert "vLLM on tpu-inference" in pathways["error"]


# --- without rl_runtime, train_rl.main takes MaxText's own path ---------------------------------

DEFAULT_PATH_DRIVER = r'''
"""Runs maxtext's train_rl.main without rl_runtime, recording what it calls; one REPORT line.

vLLM's two MaxText modules are stubbed, so an unpatched train_rl (which imports them at module
load) imports on a CPU host too; the stubs record when the adapter registers.
"""
import importlib.metadata as md
import json
import os
import sys
import types

calls = []
adapter = types.ModuleType("maxtext.integration.vllm.maxtext_vllm_adapter")
adapter.register = lambda: calls.append("adapter.register")
rollout = types.ModuleType("maxtext.integration.vllm.maxtext_vllm_rollout")
rollout.MaxTextVllmRollout = type("MaxTextVllmRollout", (), {})
sys.modules.update({adapter.__name__: adapter, rollout.__name__: rollout})
import maxtext.integration.vllm as vllm_package  # noqa: E402  (light: no vLLM import)

vllm_package.maxtext_vllm_adapter, vllm_package.maxtext_vllm_rollout = adapter, rollout

from maxtext.trainers.post_train.rl import train_rl  # noqa: E402
from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR  # noqa: E402

real_entry_points = md.entry_points


def entry_points(**selection):
    calls.append(f"entry_points({selection.get('group')})")
    return real_entry_points(**selection)


md.entry_points = entry_points
train_rl.pathwaysutils.initialize = lambda: calls.append("pathwaysutils.initialize")
train_rl.max_utils.print_system_information = lambda: calls.append("print_system_information")
train_rl.rl_train = lambda argv, kwargs: calls.append(
    ["rl_train", [a.replace(MAXTEXT_CONFIGS_DIR, "<configs>") for a in argv], kwargs])
argv = ["train_rl", os.path.join(MAXTEXT_CONFIGS_DIR, "post_train", "rl.yml"),
        "model_name=qwen3-0.6b"]
train_rl.main(argv, {"extra": 1})
print("REPORT " + json.dumps({"train_rl": train_rl.__file__, "calls": calls}))
'''


def _default_path_calls(root: Path) -> list:
    """What train_rl.main calls without rl_runtime, with ROOT's maxtext first on sys.path."""
    driver = root / "default_path_driver.py"
    driver.write_text(DEFAULT_PATH_DRIVER)
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("M_")}
    result = subprocess.run([sys.executable, str(driver)], cwd=root, env=env,
                            capture_output=True, text=True, timeout=300)
    reports = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and reports, result.stderr[-5000:]
    report = json.loads(reports[-1].removeprefix("REPORT "))
    assert report["train_rl"].startswith(str(root)), "the driver must import this copy"
    return report["calls"]


@pytest.mark.slow  # MaxText's own train_rl on a patched copy
def test_train_rl_without_rl_runtime_takes_maxtexts_own_path(
        pristine_root: Path, tmp_path: Path) -> None:
    """The same calls in the same order as unpatched MaxText; only the vLLM import moved."""
    patched = tmp_path / "patched"
    shutil.copytree(pristine_root / "maxtext", patched / "maxtext")
    assert patches.apply(MAXTEXT, patched) == SERIES
    pristine_calls = _default_path_calls(pristine_root)
    patched_calls = _default_path_calls(patched)
    assert pristine_calls[0] == "adapter.register", "unpatched MaxText registers at import"
    assert patched_calls == pristine_calls[1:]
    assert patched_calls[-1] == [
        "rl_train", ["train_rl", "<configs>/post_train/rl.yml", "model_name=qwen3-0.6b"],
        {"extra": 1}]
