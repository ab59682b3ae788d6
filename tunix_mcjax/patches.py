"""Apply the repo's patch series (`patches/<package>/*.patch`) to an installed upstream package.

    python -m tunix_mcjax.patches status maxtext   # per patch: applied / not applied / mismatch
    python -m tunix_mcjax.patches check maxtext    # dry run of `apply`; changes nothing
    python -m tunix_mcjax.patches apply maxtext    # apply what is missing; idempotent
    python -m tunix_mcjax.patches apply tunix      # the same for google-tunix (patches/tunix/)

The package is found where Python imports it from (`--root DIR` points at another tree that holds
it). Each patch is checked with `git apply --check`, forward and reverse, so its state is known per
patch. `apply` refuses, changing nothing, when the installed version is not the one the series was
written against or when a patch neither applies nor is already applied. Exit status: 0 on success
(`status`: every patch applied), 1 otherwise.
"""

from __future__ import annotations

import argparse
import enum
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PATCHES_DIR = Path(__file__).resolve().parent.parent / "patches"


@dataclass(frozen=True)
class Target:
    """An upstream package the repo patches, pinned to the version its series is written against."""

    name: str
    version: str
    version_file: str  # relative to the root (a glob); holds the version
    version_pattern: str = r"""__version__\s*=\s*["']([^"']+)["']"""  # group 1 is the version
    distribution: str = ""  # the PyPI name, where it differs from the package's


TARGETS = {
    "maxtext": Target("maxtext", "0.2.5", "maxtext/version.py"),
    # Tunix reads its version from package metadata, so the wheel's dist-info holds the literal.
    "tunix": Target("tunix", "0.1.7", "google_tunix-*.dist-info/METADATA",
                    r"(?m)^Version:\s*(\S+)$", "google-tunix"),
}


class State(enum.Enum):
    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    MISMATCH = "mismatch"


class PatchError(RuntimeError):
    """The series cannot be applied; the message names the problem and the fix."""


def _pip_name(target: Target) -> str:
    return target.distribution or target.name


def find_root(target: Target) -> Path:
    """The directory that holds the importable `target.name` package (e.g. site-packages)."""
    spec = importlib.util.find_spec(target.name)
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(
            f"{target.name} is not installed in this Python ({sys.executable}). "
            f"Fix: pip install {_pip_name(target)}=={target.version} (make setup does this)."
        )
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def installed_version(target: Target, root: Path) -> str:
    """Reads the version from the tree under `root`, without importing it."""
    paths = sorted(glob.glob(str(root / target.version_file)))
    if len(paths) != 1:
        found = f"{len(paths)} files match" if paths else "it is missing"
        raise PatchError(f"no single {target.name} installation under {root} "
                         f"({root / target.version_file}: {found}).")
    path = Path(paths[0])
    match = re.search(target.version_pattern, path.read_text())
    if match is None:
        raise PatchError(f"cannot read {target.name}'s version from {path}.")
    return match.group(1)


def series(target: Target) -> list[Path]:
    """The target's patches, in the order they apply."""
    patches = sorted((PATCHES_DIR / target.name).glob("*.patch"))
    if not patches:
        raise PatchError(
            f"no patch series found in {PATCHES_DIR / target.name}. Fix: use a source checkout of "
            "tunix_mcjax (pip install -e .), which carries patches/ next to the package."
        )
    return patches


def patched_files(patch: Path) -> list[str]:
    """Paths (relative to the root) that `patch` changes."""
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.MULTILINE)


def git_apply(patch: Path, root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """Runs `git apply` on plain files under `root`, never on a git repository around it."""
    if shutil.which("git") is None:
        raise PatchError("git is not on PATH; it is needed to apply patches. Fix: install git.")
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}
    # Without a ceiling, git inside a repository (a venv in a checkout) applies paths relative to
    # that repository's top and silently skips the rest.
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    return subprocess.run(
        ["git", "apply", *flags, str(patch)], cwd=root, env=env, capture_output=True, text=True
    )


def patch_state(patch: Path, root: Path) -> State:
    """Whether `patch` is applied to the tree under `root`, applies cleanly, or neither."""
    if git_apply(patch, root, "--check", "--reverse").returncode == 0:
        return State.APPLIED
    if git_apply(patch, root, "--check").returncode == 0:
        return State.NOT_APPLIED
    return State.MISMATCH


def _check_version(target: Target, root: Path) -> None:
    version = installed_version(target, root)
    if version != target.version:
        raise PatchError(
            f"{target.name} {version} is installed at {root}, but patches/{target.name}/ is "
            f"written against {target.name} {target.version}. "
            f"Fix: pip install {_pip_name(target)}=={target.version}, or port the series to "
            f"{version}."
        )


def status(target: Target, root: Path) -> dict[Path, State]:
    """Each patch of the series with its state, after checking the installed version."""
    _check_version(target, root)
    return {patch: patch_state(patch, root) for patch in series(target)}


def _refuse_mismatches(target: Target, root: Path, states: dict[Path, State]) -> None:
    for patch, state in states.items():
        if state is State.MISMATCH:
            reason = git_apply(patch, root, "--check").stderr.strip()
            raise PatchError(
                f"patches/{target.name}/{patch.name} neither applies to nor is applied in {root} "
                f"(files: {', '.join(patched_files(patch))}). git says:\n{reason}\n"
                f"Something else changed these files. Fix: reinstall a pristine copy "
                f"(pip install --force-reinstall --no-deps {_pip_name(target)}=={target.version}), "
                f"then run: python -m tunix_mcjax.patches apply {target.name}"
            )


def check(target: Target, root: Path) -> list[Path]:
    """Dry run of `apply`: the patches it would apply; raises PatchError where it would refuse."""
    states = status(target, root)
    _refuse_mismatches(target, root, states)
    return [patch for patch, state in states.items() if state is State.NOT_APPLIED]


def apply(target: Target, root: Path) -> list[Path]:
    """Applies every patch not yet applied, in order; returns those it applied.

    Refuses before changing anything when the version differs or any patch mismatches. Each
    patch of a series applies to the pristine tree alone (patches that share a file change
    separate hunks of it), so each patch's state is independent of the others.
    """
    missing = check(target, root)
    for patch in missing:
        result = git_apply(patch, root)
        if result.returncode != 0:
            raise PatchError(f"git apply {patch.name} failed in {root}:\n{result.stderr.strip()}")
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_mcjax.patches", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("check", "apply", "status"))
    parser.add_argument("package", choices=sorted(TARGETS))
    parser.add_argument("--root", type=Path, help="directory holding the package (default: where "
                        "Python imports it from)")
    args = parser.parse_args(argv)
    target = TARGETS[args.package]
    try:
        root = args.root.resolve() if args.root else find_root(target)
        if args.command == "status":
            states = status(target, root)
            print(f"{target.name} {target.version} at {root}")
            for patch, state in states.items():
                print(f"  {state.value:<12} {patch.name}")
            return 0 if all(s is State.APPLIED for s in states.values()) else 1
        if args.command == "check":
            missing = check(target, root)
            print(f"{target.name} at {root}: {len(missing)} patch(es) to apply"
                  + "".join(f"\n  {p.name}" for p in missing))
            return 0
        applied = apply(target, root)
        print(f"{target.name} at {root}: applied {len(applied)}, series complete"
              + "".join(f"\n  {p.name}" for p in applied))
        return 0
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
