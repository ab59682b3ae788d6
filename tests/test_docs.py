"""The README and the docs pages link only to what exists.

Pure Python, no Sphinx: every relative link in README.md and docs/*.md names an existing file or
folder, every `#anchor` names a heading of its page (MyST's GitHub-style slugs, as
`myst_heading_anchors` makes them), every result file quoted as `bench_results/...` exists, and
every page is in the site's table of contents. `make docs` checks the same links again in
Sphinx, with warnings as errors. The lead table of `docs/performance.md` names, per row, a
result file that exists and the commit it was measured on: a commit in the repository's history
that matches where the row says it was read from (`bench_meta.json`, `code_version`, `git log`).
"""

import glob
import json
import re
import subprocess
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
PERFORMANCE = DOCS / "performance.md"
LEAD_HEADING = "## Today's results"
LEAD_COLUMNS = ("result file", "measured on", "read from")
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")


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


def split_row(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def lead_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first table under `LEAD_HEADING`, each as {column: cell}."""
    lines = text.splitlines()
    assert LEAD_HEADING in lines, f"performance.md has no '{LEAD_HEADING}' heading"
    table: list[str] = []
    for line in lines[lines.index(LEAD_HEADING) + 1:]:
        if line.startswith("|"):
            table.append(line)
        elif table or line.startswith("#"):
            break
    assert len(table) > 2, f"no table under '{LEAD_HEADING}'"
    header, _, *body = (split_row(line) for line in table)
    missing = [c for c in LEAD_COLUMNS if c not in header]
    assert not missing, f"the lead table lacks the columns {missing}"
    return [dict(zip(header, cells, strict=True)) for cells in body]


def row_file(row: dict[str, str]) -> Path | None:
    """The one `bench_results/` link of the row's result-file cell, as a path; None if absent."""
    targets = [m.group(1) for m in LINK.finditer(row["result file"])]
    paths = [(DOCS / t).resolve() for t in targets if "bench_results/" in t]
    return paths[0] if len(paths) == 1 else None


def file_problems(rows: list[dict[str, str]]) -> list[str]:
    problems = []
    for row in rows:
        path = row_file(row)
        if path is None:
            problems.append(f"{row['result file']!r}: not one link under bench_results/")
        elif not path.exists():
            problems.append(f"{path.relative_to(ROOT)}: no such result file")
    return problems


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def no_history_reason() -> str | None:
    """Why commits cannot be checked here (no git, not a checkout, a shallow clone), or None."""
    try:
        shallow = git("rev-parse", "--is-shallow-repository")
    except FileNotFoundError:
        return "git is not installed"
    if shallow.returncode:
        return "the checkout has no git history (not a git work tree)"
    if shallow.stdout.strip() != "false":
        return "a shallow clone: the measured commits are not in it (git fetch --unshallow)"
    return None


def full_hash(rev: str) -> str | None:
    out = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return out.stdout.strip() if out.returncode == 0 else None


def recorded_commits(path: Path, read_from: str) -> set[str]:
    """The commits the result file itself records, by the row's `read from`."""
    if "bench_meta.json" in read_from:
        folder = path if path.is_dir() else path.parent
        return {json.loads(m.read_text())["code"] for m in folder.glob("runs/*/bench_meta.json")}
    if "code_version" in read_from:
        lines = path.read_text().splitlines()
        return {json.loads(lines[-1] if path.suffix == ".jsonl" else path.read_text())
                ["code_version"]}
    if "git log" in read_from:
        rel = path.relative_to(ROOT).as_posix()
        return {git("log", "-1", "--format=%H", "--", rel).stdout.strip()}
    return set()


def commit_problems(rows: list[dict[str, str]]) -> list[str]:
    problems = []
    for row in rows:
        m, path = COMMIT.search(row["measured on"]), row_file(row)
        named = full_hash(m.group(1)) if m else None
        if named is None:
            problems.append(f"{row['measured on']!r}: not a commit in this repository's history")
            continue
        if path is None or not path.exists():
            continue  # file_problems names it
        recorded = {full_hash(c) for c in recorded_commits(path, row["read from"])}
        if recorded != {named}:
            problems.append(f"{path.relative_to(ROOT)}: measured on {m.group(1)}, but its "
                            f"{row['read from']} gives {sorted(recorded - {None}) or 'nothing'}")
    return problems


def test_lead_table_names_existing_result_files():
    rows = lead_rows(PERFORMANCE.read_text())
    problems = file_problems(rows)
    assert not problems, "performance.md's lead table: " + "; ".join(problems)


def test_lead_table_commits_are_in_history_and_match_their_files():
    if reason := no_history_reason():
        pytest.skip(f"commits not checked: {reason}")
    problems = commit_problems(lead_rows(PERFORMANCE.read_text()))
    assert not problems, "performance.md's lead table: " + "; ".join(problems)


def test_lead_table_checks_catch_a_missing_file_and_a_bad_commit():
    """The two checks above fail on a row with a missing file and on rows with bad commits."""
    good = lead_rows(PERFORMANCE.read_text())[0]
    missing = {**good, "result file": "[`x`](../bench_results/no-such-result/)"}
    assert file_problems([missing]) and not file_problems([good])
    if reason := no_history_reason():
        pytest.skip(f"commits not checked: {reason}")
    root = git("rev-list", "--max-parents=0", "HEAD").stdout.split()[0][:12]
    not_a_commit = {**good, "measured on": "`0000000`"}
    other_commit = {**good, "measured on": f"`{root}`"}  # in the history, not the file's
    assert not commit_problems([good])
    assert commit_problems([not_a_commit]) and commit_problems([other_commit])
