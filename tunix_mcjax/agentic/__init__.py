"""Multi-turn, tool-using rollouts on each host's own engine.

Tunix's agents and environments (`tunix.rl.agentic`: ToolAgent, ToolEnvironment, its tool
parsers and tools) run unchanged; `loop.run_turns` drives a host's conversations turn after
turn on its engine, `rollout.sequences` packs the trajectories into our rows with loss masks
(model tokens 1, tool and environment tokens 0).
"""
