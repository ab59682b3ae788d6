"""Writes the configuration reference, docs/configuration-reference.md, from the keys' fields.

    python -m tunix_mcjax.config.reference            # rewrite the page
    python -m tunix_mcjax.config.reference --check    # exit 1 if the page is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import typing
from pathlib import Path
from typing import Any

from tunix_mcjax.config.core import HINTS
from tunix_mcjax.config.fields import choices
from tunix_mcjax.config.sections import SECTIONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration-reference.md"
HEADER = """\
# Key reference

Every key of a recipe or a `key=value` override, with its type, default and meaning, grouped by
concern. The checks that involve more than one key, and what the keys do together, are on the
[Configuration](configuration.md) page.

*Written by `python -m tunix_mcjax.config.reference` from the keys' declarations in
[`tunix_mcjax/config/sections.py`](../tunix_mcjax/config/sections.py): edit those, not this page.*
"""


def type_text(hint: Any, field: dataclasses.Field) -> str:
    """The key's type and, where it has one, its constraint: `int, > 0`, `jax | vllm`."""
    allowed = choices(hint)
    if allowed:
        return " \\| ".join(code(v) for v in allowed)
    name = "list of str" if typing.get_origin(hint) is tuple else hint.__name__
    check = field.metadata["check"]
    return f"{name}, {check.bound}" if check else name


def code(value: Any) -> str:
    """A value as it is written in YAML or on the command line, as inline code."""
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, tuple):
        text = "[" + ", ".join(value) + "]"
    else:
        text = str(value) if value != "" else '""'
    return "`" + text.replace("|", "\\|") + "`"


def section_text(section: type) -> str:
    title, _, intro = inspect.cleandoc(section.__doc__).partition("\n")
    rows = [f"| `{f.name}` | {type_text(HINTS[f.name], f)} | {code(f.default)} | "
            f"{f.metadata['doc']} |" for f in dataclasses.fields(section)]
    return "\n".join([f"## {title}", "", intro.strip(), "",
                      "| key | type | default | description |", "|---|---|---|---|", *rows])


def render() -> str:
    return "\n\n".join([HEADER.rstrip(), *map(section_text, SECTIONS)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if PAGE.read_text() != text:
            print(f"{PAGE.name} is out of date: run python -m tunix_mcjax.config.reference")
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
