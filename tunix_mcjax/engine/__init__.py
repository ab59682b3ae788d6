"""Per-host rollout engines behind one interface (`Engine`)."""

from tunix_mcjax.engine.base import Completion, Engine, FinishReason, SamplingParams

__all__ = ["Completion", "Engine", "FinishReason", "SamplingParams"]
