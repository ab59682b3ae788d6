"""`Keys`: every key of a run (tunix_mcjax/config/sections.py), flat, with MaxText's names, and
the values that follow from them alone. `core.Config` adds what needs the rules."""

from __future__ import annotations

import dataclasses

from etils import epath

from tunix_mcjax.config.sections import SECTIONS


# dataclasses collect fields from the last base first: reversed, the keys keep SECTIONS' order.
@dataclasses.dataclass(frozen=True)
class Keys(*reversed(SECTIONS)):
    """The keys' values; derived lengths and paths as properties."""

    @property
    def max_completion_length(self) -> int:
        return self.max_target_length - self.max_prefill_predict_length

    @property
    def agentic_turn_tokens(self) -> int:
        """Tokens of one model turn (agentic_max_turn_tokens; 0: the completion budget)."""
        return self.agentic_max_turn_tokens or self.max_completion_length

    @property
    def engine_prompt_length(self) -> int:
        """The longest prompt our decode loop takes: the prompt budget, or with
        use_agentic_rollout a turn's context (anything up to the whole budget but a token)."""
        if self.use_agentic_rollout:
            return self.max_target_length - 1
        return self.max_prefill_predict_length

    @property
    def engine_new_tokens(self) -> int:
        """Tokens our decode loop samples a request at most: the completion budget, or with
        use_agentic_rollout one turn's."""
        return self.agentic_turn_tokens if self.use_agentic_rollout else self.max_completion_length

    @property
    def global_rows(self) -> int:
        return self.batch_size * self.num_generations

    @property
    def run_dir(self) -> epath.Path:
        """base_output_directory/run_name, through etils.epath (local paths, gs://, ...)."""
        return epath.Path(self.base_output_directory) / self.run_name

    @property
    def checkpoint_dir(self) -> epath.Path:
        if self.checkpoint_directory:
            return epath.Path(self.checkpoint_directory)
        return self.run_dir / "checkpoints"
