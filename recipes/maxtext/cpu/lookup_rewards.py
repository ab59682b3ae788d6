"""MaxText reward function (reward_functions_path) for the lookup tool demo: 1.0 for the right
secret digit after a tool call (tunix_mcjax.tasks.lookup_reward), 0 otherwise."""

from tunix_mcjax.tasks import lookup_reward as _lookup_reward


def lookup_reward(prompts, completions, tmvp_config, trajectory_rewards, tool_calls, **kwargs):
    del tmvp_config, kwargs
    return _lookup_reward(prompts, completions, trajectory_rewards, tool_calls)
