"""The README and the docs pages link only to what exists.

Pure Python, no Sphinx: every relative link in README.md and docs/*.md names an existing file or
folder, every `#anchor` names a heading of its page (MyST's GitHub-style slugs, as
`myst_heading_anchors` makes them), every result file quoted as `bench_results/...` exists, and
every page is in the site's table of contents. `make docs` checks the same links again in
Sphinx, with warnings as errors.
"""

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
HEADING_ANCHOR_LEVELS = 4  # docs/conf.py: myst_heading_anchors

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
RESULT_PATH = re.compile(r"bench_results/[^\s`'\"),;]*")


def prose(text: str) -> str:
    """The page without its fenced code blocks (commands there name outputs, not results)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return "\n".join(lines)


def github_slug(title: str) -> str:
    """MyST's `github_slugify` (myst_parser.slugs)."""
    return re.sub(r"[^\w\u4e00-\u9fff\- ]", "", title.lower().replace(" ", "-"))


def heading_title(markdown: str) -> str:
    """The text MyST slugs: text and inline code, without markup or link targets."""
    parts = []
    for i, piece in enumerate(re.split(r"(`+[^`]+`+)", markdown)):
        if i % 2:
            parts.append(piece.strip("`").strip() if piece.startswith("`") else piece)
        else:
            piece = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", piece)
            parts.append(piece.replace("*", ""))
    return "".join(parts)


def anchors(page: Path) -> set[str]:
    slugs: set[str] = set()
    for line in prose(page.read_text()).splitlines():
        m = HEADING.match(line)
        if not m or len(m.group(1)) > HEADING_ANCHOR_LEVELS:
            continue
        slug = base = github_slug(heading_title(m.group(2)))
        i = 1
        while slug in slugs:
            slug, i = f"{base}-{i}", i + 1
        if slug:
            slugs.add(slug)
    return slugs


def links(page: Path) -> list[str]:
    text = CODE_SPAN.sub(lambda m: "`" + "x" * len(m.group(2)) + "`", prose(page.read_text()))
    return [m.group(1) for m in LINK.finditer(text)]


def expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [
        out
        for alt in m.group(1).split(",")
        for out in expand_braces(pattern[: m.start()] + alt + pattern[m.end() :])
    ]


def result_paths(page: Path) -> list[str]:
    """`bench_results/...` paths quoted in code spans or link targets of the page's prose."""
    text = prose(page.read_text())
    quoted = [m.group(2) for m in CODE_SPAN.finditer(text)] + links(page)
    paths = []
    for chunk in quoted:
        for m in RESULT_PATH.finditer(chunk):
            if "<" not in m.group(0):  # a placeholder, e.g. bench_results/<name>
                paths.append(m.group(0).rstrip("."))
    return paths


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not broken, f"{page_id(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_quoted_result_files_exist(page):
    missing = [
        path
        for path in result_paths(page)
        if not any(glob.glob(str(ROOT / p)) for p in expand_braces(path))
    ]
    assert not missing, f"{page_id(page)} quotes result files that are not there: {missing}"


def test_every_page_is_in_the_table_of_contents():
    index = (DOCS / "index.md").read_text()
    toctrees = "\n".join(re.findall(r"```\{toctree\}(.*?)```", index, re.S))
    listed = set(re.findall(r"^([\w-]+)\s*$", toctrees, re.M))
    pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
    assert pages <= listed, f"pages missing from docs/index.md's toctree: {sorted(pages - listed)}"


def test_slugs_follow_myst():
    slug = github_slug(heading_title("Ablation: O1–O4 one at a time"))
    assert slug == "ablation-o1o4-one-at-a-time"
    assert (
        github_slug(heading_title("`rollout_engine=jax` (`engine/jax_engine.py`)"))
        == "rollout_enginejax-enginejax_enginepy"
    )
