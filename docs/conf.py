"""Sphinx configuration for the tunix_mcjax documentation (MyST Markdown, book theme)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "tunix_mcjax"
copyright = "tunix_mcjax authors"
author = "tunix_mcjax authors"

extensions = ["myst_parser", "repo_files"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext"]

# GitHub-style heading slugs, so `page.md#a-heading` works here and on GitHub alike.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]
# Unlabelled code blocks (diagrams, logs) are shown as they are, not guessed at as Python.
highlight_language = "none"

html_theme = "sphinx_book_theme"
html_title = "tunix_mcjax"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
    # The sidebar has the search field; without this the pydata base theme adds a second one
    # in a header bar of its own.
    "navbar_persistent": [],
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
