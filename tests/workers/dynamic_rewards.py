"""Reward functions for the dynamic sampling tests: rewards that depend on the prompt and the
position within its group only, so they are the same whatever host runs the group."""

from __future__ import annotations


def odd_digits_vary(prompts, completions, **_):
    """Prompt "d=": a group of an even d gets all 1.0 (no spread); of an odd d, 1.0 and 0.0
    alternating down the group (groups start at even positions: num_generations is even)."""
    return [1.0 if int(p[0]) % 2 == 0 else float(j % 2) for j, p in enumerate(prompts)]


def constant(prompts, completions, **_):
    return [0.5] * len(completions)
