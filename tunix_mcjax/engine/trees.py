"""Param trees as nested dicts and as flat maps from key paths to leaves, both ways: the
engines check, place and publish weights leaf by leaf."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LeafPath = tuple[str, ...]


def flatten_tree(tree: Mapping[Any, Any], prefix: LeafPath = ()) -> dict[LeafPath, Any]:
    """`{path: leaf}` of a nested mapping; keys become strings."""
    flat: dict[LeafPath, Any] = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            flat.update(flatten_tree(value, path))
        else:
            flat[path] = value
    return flat


def unflatten_tree(flat: Mapping[LeafPath, Any]) -> dict[str, Any]:
    """The nested dict of `{path: leaf}` (`flatten_tree`'s inverse)."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
