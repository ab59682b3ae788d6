"""Links from the docs to repository files outside `docs/`: result files, sources, patch series.

Pages link such a file by its relative path (`../bench_results/step-gsm8k-cpu/report.md`), so
the link works where the Markdown is read in the repository. In the built site the link points
at a copy under `_repo/`, made when the HTML build finishes: the site carries the files its
numbers come from. A linked folder gets an `index.html` listing its files (in a git checkout,
the files git tracks, so ignored benchmark traces stay out). A link to a path that does not
exist is left to Sphinx, which warns (and `-W` fails the build).
"""

from __future__ import annotations

import html
import posixpath
import shutil
import subprocess
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms import SphinxTransform

OUT_DIR = "_repo"


def repo_root(app: Sphinx) -> Path:
    return (Path(app.srcdir) / app.config.repo_files_root).resolve()


def repo_path(app: Sphinx, docname: str, target: str) -> str | None:
    """`target` as a path relative to the repository root, if it leaves the docs and exists."""
    path = target.split("#", 1)[0]
    if not path or "://" in path:
        return None
    srcdir = Path(app.srcdir).resolve()
    absolute = (srcdir / posixpath.dirname(docname) / path).resolve()
    root = repo_root(app)
    if absolute.is_relative_to(srcdir) or not absolute.is_relative_to(root):
        return None
    if not absolute.exists():
        return None
    return absolute.relative_to(root).as_posix() + ("/" if absolute.is_dir() else "")


class RepoLinks(SphinxTransform):
    """Turns links to repository files into plain links to their copies under `_repo/`."""

    default_priority = 5  # before MyST's download collection and reference resolution

    def apply(self) -> None:
        docname = self.env.docname
        up = "../" * docname.count("/")
        linked = self.env.repo_files_linked.setdefault(docname, set())
        for node in list(self.document.findall(addnodes.download_reference)) + [
            n
            for n in self.document.findall(addnodes.pending_xref)
            if n.get("reftype") == "myst" and n.get("refdomain") in (None, "doc")
        ]:
            target = node["reftarget"]
            if node.get("refdomain") == "doc":
                # MyST took a Markdown file outside the docs for a document: an absolute
                # name without its suffix. Real documents have relative names.
                if not target.startswith("/"):
                    continue
                target = next((target + s for s in self.config.source_suffix
                               if Path(target + s).is_file()), target)
            rel = repo_path(self.app, docname, target)
            if rel is None:
                continue
            linked.add(rel)
            uri = f"{up}{OUT_DIR}/{rel}" + ("index.html" if rel.endswith("/") else "")
            ref = nodes.reference("", "", *node.children, refuri=uri, classes=["repo-file"])
            node.replace_self(ref)


def tracked_files(root: Path, folder: str) -> list[str]:
    """Files under `folder` (relative to `root`): git's tracked ones, else every file."""
    if (root / ".git").exists() and shutil.which("git"):
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--", folder],
            capture_output=True,
            check=False,
        )
        if out.returncode == 0:
            files = [f for f in out.stdout.decode().split("\0") if f]
            if files:
                return sorted(f for f in files if (root / f).is_file())
    return sorted(p.relative_to(root).as_posix() for p in (root / folder).rglob("*") if p.is_file())


def folder_index(folder: str, files: list[str]) -> str:
    items = "\n".join(
        f'<li><a href="{html.escape(posixpath.relpath(f, folder))}">'
        f"{html.escape(posixpath.relpath(f, folder))}</a></li>"
        for f in files
    )
    title = html.escape(folder)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{title}</title>"
        "<style>body{font-family:sans-serif;margin:2em;line-height:1.5}"
        "code{font-size:1.1em}</style></head>\n"
        f"<body><h1><code>{title}</code></h1>\n"
        "<p>Files of this folder of the repository, as the documentation was built.</p>\n"
        f"<ul>\n{items}\n</ul></body></html>\n"
    )


def copy_linked(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    root = repo_root(app)
    out = Path(app.outdir) / OUT_DIR
    linked = set().union(set(), *app.env.repo_files_linked.values())
    for rel in sorted(linked):
        if rel.endswith("/"):
            folder = rel.rstrip("/")
            files = tracked_files(root, folder)
            (out / folder).mkdir(parents=True, exist_ok=True)
            (out / folder / "index.html").write_text(folder_index(folder, files))
        else:
            files = [rel]
        for f in files:
            (out / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, out / f)


def init_env(app: Sphinx, env, docnames) -> None:
    if not hasattr(env, "repo_files_linked"):
        env.repo_files_linked = {}


def purge_doc(app: Sphinx, env, docname: str) -> None:
    getattr(env, "repo_files_linked", {}).pop(docname, None)


def merge_info(app: Sphinx, env, docnames, other) -> None:
    env.repo_files_linked.update(
        {d: other.repo_files_linked[d] for d in docnames if d in other.repo_files_linked}
    )


def setup(app: Sphinx) -> dict:
    app.add_config_value("repo_files_root", "..", "env")
    app.add_transform(RepoLinks)
    app.connect("env-before-read-docs", init_env)
    app.connect("env-purge-doc", purge_doc)
    app.connect("env-merge-info", merge_info)
    app.connect("build-finished", copy_linked)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
