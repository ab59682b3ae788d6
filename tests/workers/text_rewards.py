"""A reward that depends on every sampled character, so equal results mean equal samples."""

from __future__ import annotations


def char_codes(prompts, completions, **_):
    """The mean character code of each completion, over 100 (0 for an empty one)."""
    return [sum(map(ord, c)) / len(c) / 100 if c else 0.0 for c in completions]
