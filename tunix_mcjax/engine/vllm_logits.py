"""The vLLM logits processor behind the engine's logprobs. Import only after `import_vllm()`.

vLLM runs argmax-invariant processors after temperature and before top-k/top-p. This one
replaces the temperature-scaled logits by their log-softmax over the whole vocabulary, a shift per
row, so top-k/top-p and the draw are unchanged; with `logprobs_mode="processed_logits"` vLLM then
returns, for the sampled token, log softmax(logits / T) before truncation: what the trainer
recomputes. The masked id (a pad that is not an EOS id) is set to -inf after normalising, as the
JAX engine masks it after taking its logprobs.
"""

from __future__ import annotations

import functools

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor


class _TemperatureLogSoftmax(LogitsProcessor):
    masked_id: int | None = None

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        del vllm_config, device, is_pin_memory

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits = torch.log_softmax(logits, dim=-1)
        if self.masked_id is not None:
            logits[:, self.masked_id] = -float("inf")
        return logits

    def is_argmax_invariant(self) -> bool:
        # Only the masking is not, and the engine never sends greedy (T=0) requests: greedy is
        # top_k=1 at T=1, which takes this path too.
        return True

    def update_state(self, batch_update) -> None:
        del batch_update


@functools.cache
def temperature_log_softmax(masked_id: int | None) -> type[LogitsProcessor]:
    """The processor class that masks `masked_id` (None: nothing)."""
    return type("TemperatureLogSoftmax", (_TemperatureLogSoftmax,), {"masked_id": masked_id})
