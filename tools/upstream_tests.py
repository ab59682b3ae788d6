"""Runs upstream's own test files for every module our patch series touches, pristine vs patched.

    python tools/upstream_tests.py tunix CHECKOUT --venv-dir DIR [--out TABLE.md]
    python tools/upstream_tests.py maxtext CHECKOUT --pristine VENV --patched VENV

CHECKOUT is a source checkout of google/tunix or AI-Hypercomputer/maxtext at the pinned release
(the version in `tunix_mcjax.patches.TARGETS`). Each test file runs in its own pytest process
(upstream's files set their own XLA device counts), on CPU, once per venv, and the script prints
one row per file: passed/failed/skipped on the pristine install, on the patched one, and whether
they agree. Exit status 0 when every file agrees.

Venvs: `--pristine` and `--patched` name existing ones (checked: no patch applied / the whole
series applied, for both packages); `--venv-dir DIR` builds whichever of DIR/pristine and
DIR/patched is missing, as `make setup` does (the patched one gets both series), plus the test
extra of CHECKOUT's pyproject.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tunix_mcjax import patches  # noqa: E402

# For each file a series touches, the upstream test files that exercise it. Files with no entry
# stop the script: add one (an empty list where no upstream test runs the file on CPU).
UPSTREAM_TESTS = {
    "tunix": {
        "tunix/cli/config.py": ["tests/cli/config_test.py"],
        "tunix/cli/grpo_main.py": ["tests/cli/grpo_main_test.py"],
        "tunix/generate/sampler.py": ["tests/generate/sampler_test.py",
                                      "tests/rl/grpo/grpo_learner_test.py"],
        "tunix/sft/sharding_utils.py": ["tests/sft/sharding_utils_test.py",
                                        "tests/sft/peft_trainer_test.py"],
        "tunix/rl/reshard.py": ["tests/rl/rl_cluster_test.py"],
    },
    "maxtext": {
        "maxtext/configs/types.py": ["tests/unit/configs_test.py"],
        "maxtext/configs/post_train/rl.yml": ["tests/unit/configs_test.py"],
        "maxtext/configs/pyconfig.py": ["tests/unit/pyconfig_test.py"],
        "maxtext/trainers/post_train/rl/train_rl.py": ["tests/post_training/unit/train_rl_test.py"],
        "maxtext/layers/moe.py": ["tests/unit/moe_test.py"],
        "maxtext/layers/nnx_decoders.py": ["tests/unit/moe_test.py"],
        "maxtext/models/qwen3.py": ["tests/unit/moe_test.py"],
        "maxtext/models/gpt_oss.py": ["tests/unit/moe_test.py"],
        **{f"maxtext/trainers/post_train/rl/scripts/run_{name}_rl.sh": []
           for name in ("gemma4_26b", "gemma4_e4b", "gptoss_20b", "qwen3_30b")},
    },
}


@dataclass(frozen=True)
class Outcome:
    """One test file's result on one install."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    note: str = ""  # "timeout" or "no report" when pytest gave no counts

    def __str__(self) -> str:
        return self.note or f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"


def test_files(package: str) -> list[str]:
    """The upstream test files for every file the package's series touches, in order."""
    mapping = UPSTREAM_TESTS[package]
    series = patches.series(patches.TARGETS[package])
    touched = [f for patch in series for f in patches.patched_files(patch)]
    missing = [f for f in touched if f not in mapping]
    if missing:
        raise SystemExit(f"error: no upstream tests listed for {', '.join(missing)}. Fix: add them "
                         f"to UPSTREAM_TESTS[{package!r}] in {Path(__file__).name}.")
    return list(dict.fromkeys(t for f in touched for t in mapping[f]))


def site_packages(venv: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, timeout=60)
    return Path(out.stdout.strip())


def check_venv(venv: Path, patched: bool) -> None:
    """Refuses a venv whose Tunix and MaxText are not all pristine (or all patched)."""
    root = site_packages(venv)
    want = patches.State.APPLIED if patched else patches.State.NOT_APPLIED
    for target in patches.TARGETS.values():
        states = set(patches.status(target, root).values())
        if states != {want}:
            raise SystemExit(
                f"error: {venv} is meant to be {'patched' if patched else 'pristine'}, but its "
                f"{target.name} patches are {sorted(s.value for s in states)}. Fix: pass another "
                "venv, or --venv-dir to build one.")


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args],
                   check=True, timeout=3600)


def build_venv(venv: Path, checkout: Path, patched: bool) -> None:
    """A venv as `make setup` builds it (pristine: unpatched), plus upstream's test extra."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    constraints = str(REPO / "constraints.txt")
    pip(venv, "-c", constraints, "-e", f"{REPO}[dev]")
    pip(venv, "-c", constraints, "-e", f"{REPO}[maxtext]")
    extra = test_extra(checkout)
    if extra:
        pip(venv, "-c", constraints, *extra)
    if patched:
        for package in patches.TARGETS:
            subprocess.run([str(venv / "bin" / "python"), "-m", "tunix_mcjax.patches", "apply",
                            package], check=True, timeout=300)


def test_extra(checkout: Path) -> list[str]:
    """The `test` optional dependencies of the checkout's pyproject, if it declares any."""
    pyproject = checkout / "pyproject.toml"
    if not pyproject.exists():
        return []
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    return list(project.get("optional-dependencies", {}).get("test", []))


def pytest_setup(package: str, checkout: Path, scratch: Path) -> tuple[Path, Path]:
    """(cwd, ini) for pytest, so tests import the installed package, not the checkout's.

    Tunix's pyproject puts the checkout itself on sys.path, so its tests run from a scratch
    directory with an empty config. MaxText's tests import `tests.utils` from the checkout root,
    which is safe: its package lives under src/.
    """
    if package == "maxtext":
        return checkout, checkout / "pytest.ini"
    ini = scratch / "pytest.ini"
    ini.write_text("[pytest]\n")
    return scratch, ini


def imported_from(venv: Path, package: str, cwd: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          f"import {package}; print({package}.__file__)"],
                         cwd=cwd, env=test_env(cwd), capture_output=True, text=True, check=True,
                         timeout=300)
    return Path(out.stdout.strip())


def test_env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    return {**env, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(cwd)}


def run_file(venv: Path, test: Path, cwd: Path, ini: Path, report: Path,
             timeout: float) -> Outcome:
    """Runs one test file under pytest in `venv`; its counts from the JUnit report."""
    command = [str(venv / "bin" / "python"), "-m", "pytest", str(test), "-q", "-p",
               "no:cacheprovider", "-c", str(ini), "--rootdir", str(ini.parent),
               f"--junitxml={report}"]
    try:
        subprocess.run(command, cwd=cwd, env=test_env(cwd), capture_output=True,
                       timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome(note="timeout")
    if not report.exists():
        return Outcome(note="no report")
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    count = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = count["failures"] + count["errors"]
    return Outcome(count["tests"] - failed - count["skipped"], failed, count["skipped"])


def table(rows: list[tuple[str, Outcome, Outcome]]) -> str:
    lines = ["| upstream test file | pristine | patched | same |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {a} | {b} | {'yes' if a == b else 'NO'} |" for name, a, b in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("package", choices=sorted(UPSTREAM_TESTS))
    parser.add_argument("checkout", type=Path, help="upstream source checkout at the pinned tag")
    parser.add_argument("--pristine", type=Path, help="venv with both packages unpatched")
    parser.add_argument("--patched", type=Path, help="venv with both series applied")
    parser.add_argument("--venv-dir", type=Path, help="build missing venvs here")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per test file")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    checkout = args.checkout.resolve()
    venvs = {}
    for name, patched in (("pristine", False), ("patched", True)):
        venv = getattr(args, name) or (args.venv_dir / name if args.venv_dir else None)
        if venv is None:
            parser.error(f"give --{name} VENV or --venv-dir DIR")
        if not (venv / "bin" / "python").exists():
            build_venv(venv, checkout, patched)
        check_venv(venv, patched)
        venvs[name] = venv.resolve()
    tests = test_files(args.package)
    with tempfile.TemporaryDirectory() as scratch:
        cwd, ini = pytest_setup(args.package, checkout, Path(scratch))
        for venv in venvs.values():
            location = imported_from(venv, args.package, cwd)
            if not location.is_relative_to(site_packages(venv)):
                raise SystemExit(f"error: {args.package} imports from {location}, not {venv}.")
        rows = []
        for test in tests:
            outcomes = [run_file(venv, checkout / test, cwd, ini,
                                 Path(scratch) / f"{name}.xml", args.timeout)
                        for name, venv in venvs.items()]
            for report in Path(scratch).glob("*.xml"):
                report.unlink()
            rows.append((test, *outcomes))
            print(f"{test}: {outcomes[0]} | {outcomes[1]}", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(a == b for _, a, b in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
