"""Reward modules for Tunix's CLI (`reward_functions`), one per task: Tunix takes every public
function defined in the named module as a reward function."""
