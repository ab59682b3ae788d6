"""Compiling a run's programs for a TPU slice on a host without one (`python -m tunix_mcjax.aot`).

libtpu's compiler (`aot.libtpu`) and a topology's devices (`aot.target`) stand in for the TPU;
every program of a step is built from shapes only (`aot.programs`) and compiled, and XLA's
memory and cost analyses are read beside the planner's figures (`aot.report`).
"""

# The programs of a step (`aot.programs.step_programs`): the engine's decode loop, a session's
# slice of it, the train step, publish's gather, and the engine's decode step alone.
PROGRAMS = ("engine", "slice", "train", "publish", "decode")
# Of a MaxText RL script (`aot.maxtext_script.run`): the maxtext engine's loop, its session's
# slice, the train step.
MAXTEXT_PROGRAMS = ("engine", "slice", "train")
