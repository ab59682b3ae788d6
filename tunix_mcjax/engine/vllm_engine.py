"""VllmEngine: in-process `vllm.LLM` replicas on this host's local devices (`rollout_engine=vllm`).

- Requests are token prompts (`skip_tokenizer_init=True`, `detokenize=False`). Consecutive equal
  prompts (a GRPO group) become one vLLM request with `n` samples, so the prompt is prefilled
  once; outputs come back in request order, the n samples of a group in order.
- Seeds are ours: request r of a call gets `request_seed(seed, r)` (vLLM gives its sample i the
  seed + i), so a (step, host) seed reproduces every token on any backend, whichever replica
  serves the request.
- Logprob mode: the logprob of each sampled token under log softmax(logits / T), before
  top-k/top-p truncation (greedy: T=1), the trainer's recomputation. vLLM's own
  "processed_logprobs" renormalise after top-k/top-p (biased ratios, vllm #42259) and its
  "raw_logprobs" ignore T; `vllm_logits` makes "processed_logits" carry the right value. Greedy
  runs as top_k=1 at T=1 so every request takes that path.
- EOS ids (and the sampling's stop ids) are vLLM stop tokens: they stay in the completion.
- One `vllm.LLM` per process (vLLM's parallel state is process-global). Backend by device
  platform: torch vLLM on CPU/GPU, one in-process worker (DP 1 x TP 1 per host); tpu-inference
  on TPU, DP x TP inside the one LLM over the device indexes passed in its sharding config, as
  Tunix's VllmSampler does. Weights arrive through `engine.vllm_publish`, the whole tree at once.
- `session` steps `generate`'s requests on vLLM's LLMEngine in slices (`engine.vllm_session`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tunix.models.qwen3.model import ModelConfig

from tunix_mcjax.engine import hf_qwen3, vllm_publish
from tunix_mcjax.engine.base import Completion, Engine, FinishReason, SamplingParams
from tunix_mcjax.engine.stops import stop_reason
from tunix_mcjax.engine.trees import flatten_tree
from tunix_mcjax.engine.vllm_session import VllmSession
from tunix_mcjax.train import layer_runs

# Set before vLLM is first imported: one process, no engine-core subprocess.
FORCED_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Defaults a user may override: 1 GiB of CPU KV cache per engine, no OMP thread pinning (the
# host's cores are shared with JAX and the other hosts' processes).
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
LOGPROBS_MODE = "processed_logits"


def import_vllm() -> Any:
    """`vllm`, imported with the environment this engine needs."""
    os.environ.update(FORCED_ENV)
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    import vllm

    return vllm


@dataclasses.dataclass(frozen=True)
class VllmOptions:
    """vLLM settings (MaxText's key names in Config): HBM share, batch limits, extras."""

    hbm_utilization: float = 0.72
    max_num_batched_tokens: int = 0  # 0: vLLM's default
    block_size: int = 0  # tokens per KV page; 0: vLLM's default
    enable_prefix_caching: bool = True
    enable_dp_attention: bool = False
    async_scheduling: bool = False
    additional_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def request_seed(seed: int, request: int) -> int:
    """31-bit seed of one vLLM request; its samples use seed + i."""
    return int(np.random.SeedSequence([seed, request]).generate_state(1)[0] >> 1)


def group_requests(prompts: Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
    """Runs of equal consecutive prompts -> [(prompt, n)], in order."""
    groups: list[tuple[list[int], int]] = []
    for p in prompts:
        p = [int(t) for t in p]
        if groups and groups[-1][0] == p:
            groups[-1] = (p, groups[-1][1] + 1)
        else:
            groups.append((p, 1))
    return groups


def device_indexes(devices: Sequence[jax.Device], local: Sequence[jax.Device]) -> list[int]:
    """Positions of `devices` among this host's `local` devices; anything else is an error."""
    local = list(local)
    outside = [d for d in devices if d not in local]
    if outside:
        raise ValueError(f"vLLM engines run on this host's devices only; {outside} are not local")
    return [local.index(d) for d in devices]


def _host_array(leaf: Any, dtype: Any) -> np.ndarray:
    """A full host copy of one leaf (a replicated jax Array's local shard is used)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        full = [s.data for s in leaf.addressable_shards if s.data.shape == leaf.shape]
        if not full:
            raise ValueError("a jax Array param must be replicated over this host's devices; "
                             "reshard it to replicated first")
        leaf = full[0]
    return np.asarray(leaf).astype(dtype, copy=False)


class VllmEngine(Engine):
    """One vLLM engine over `data_parallelism` x `tensor_parallelism` of this host's `devices`."""

    def __init__(self, model_config: ModelConfig, devices: Sequence[jax.Device], *, pad_id: int,
                 eos_ids: Sequence[int], max_prompt_length: int, max_new_tokens: int,
                 tensor_parallelism: int = 1, data_parallelism: int = -1,
                 max_num_seqs: int = 64, options: VllmOptions | None = None,
                 local_devices: Sequence[jax.Device] | None = None):
        devices, tp = list(devices), tensor_parallelism
        dp = len(devices) // tp if data_parallelism == -1 else data_parallelism
        if tp < 1 or dp < 1 or dp * tp > len(devices):
            raise ValueError(f"data_parallelism={data_parallelism} x tensor_parallelism={tp} "
                             f"does not fit {len(devices)} devices")
        indexes = device_indexes(devices[:dp * tp], local_devices or jax.local_devices())
        self.platform = devices[0].platform
        self.options = options or VllmOptions()
        if self.platform != "tpu" and dp * tp > 1:
            raise ValueError(
                f"torch vLLM runs one in-process worker: rollout_data_parallelism x "
                f"rollout_tensor_parallelism = {dp} x {tp} per host must be 1 x 1 on "
                f"{self.platform}: set rollout_data_parallelism=1 (the first local device) or "
                "launch one process per device; DP x TP per host is TPU-only here")
        if self.platform != "tpu" and self.options.enable_dp_attention:
            raise ValueError("enable_dp_attention is a tpu-inference setting; unset it on CPU/GPU")
        self.model_config, self.pad_id = model_config, pad_id
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.masked_id = None if pad_id in self.eos_ids else pad_id
        self.max_prompt_length, self.max_new_tokens = max_prompt_length, max_new_tokens
        self.max_num_seqs = max_num_seqs
        self.data_parallelism, self.tensor_parallelism = dp, tp
        self.device_indexes = indexes
        vllm = import_vllm()
        from tunix_mcjax.engine.vllm_logits import temperature_log_softmax

        self._model_dir = tempfile.TemporaryDirectory(prefix="vllm_qwen3_")
        config = hf_qwen3.hf_config(model_config, max_prompt_length + max_new_tokens,
                                    self.options.hf_overrides)
        Path(self._model_dir.name, "config.json").write_text(json.dumps(config))
        processor = temperature_log_softmax(self.masked_id)
        self.llm = vllm.LLM(**self.llm_args(processor))
        self.publisher = (
            vllm_publish.TpuInferencePublisher(self.llm, model_config, tp)
            if self.platform == "tpu"
            else vllm_publish.TorchPublisher(self.llm, model_config, self.platform))
        self.loaded = False
        self._session: VllmSession | None = None

    @property
    def compile_count(self) -> int:
        """vLLM compiles inside its own runner (eagerly on CPU); this engine compiles nothing."""
        return 0

    def llm_args(self, processor: type) -> dict[str, Any]:
        """`vllm.LLM`'s keyword arguments."""
        o = self.options
        args: dict[str, Any] = {
            "model": self._model_dir.name, "skip_tokenizer_init": True, "load_format": "dummy",
            "dtype": np.dtype(self.model_config.param_dtype).name,
            "max_model_len": self.max_prompt_length + self.max_new_tokens,
            "max_num_seqs": self.max_num_seqs, "seed": 0,
            "tensor_parallel_size": self.tensor_parallelism,
            "data_parallel_size": self.data_parallelism, "logprobs_mode": LOGPROBS_MODE,
            "logits_processors": [processor],
            "enable_prefix_caching": o.enable_prefix_caching,
            "gpu_memory_utilization": o.hbm_utilization, "enforce_eager": self.platform == "cpu",
            "async_scheduling": o.async_scheduling, "disable_log_stats": True,
        }
        if o.max_num_batched_tokens:
            args["max_num_batched_tokens"] = o.max_num_batched_tokens
        if o.block_size:
            args["block_size"] = o.block_size
        additional = dict(o.additional_config)
        if self.platform == "tpu":
            additional["sharding"] = {"sharding_strategy": {
                "device_indexes": self.device_indexes,
                "enable_dp_attention": o.enable_dp_attention}}
        if additional:
            args["additional_config"] = additional
        return args

    def sampling_params(self, vllm: Any, sampling: SamplingParams, n: int, seed: int) -> Any:
        """vLLM's SamplingParams of one request of `n` samples."""
        stops = list(sampling.stop_token_ids) + ([] if sampling.ignore_eos else list(self.eos_ids))
        greedy = sampling.greedy
        return vllm.SamplingParams(
            n=n, max_tokens=sampling.max_new_tokens,
            temperature=1.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p, top_k=1 if greedy else sampling.top_k,
            seed=seed, stop_token_ids=list(dict.fromkeys(stops)), logprobs=0, detokenize=False,
            ignore_eos=sampling.ignore_eos)

    def load_weights(self, params: Any) -> None:
        """Publishes the WHOLE tree in one call; a partial tree is an error. A trainer's stacked
        layers (`layer_runs`) are unstacked: vLLM takes per-layer names."""
        if self._session is not None and self._session.in_vllm:
            raise RuntimeError(
                "load_weights() while an open VllmSession has requests in vLLM: a publish "
                "resets vLLM's prefix cache, which vLLM refuses with requests running; step the "
                "session until they return (or close it) first")
        params = layer_runs.unstack(params)
        flat = flatten_tree(params)
        hf_qwen3.check_complete(flat, self.model_config)
        if isinstance(self.publisher, vllm_publish.TpuInferencePublisher):
            self.publisher.publish(params)
        else:
            dtype = self.model_config.param_dtype
            self.publisher.publish({p: _host_array(v, dtype) for p, v in flat.items()})
        self.loaded = True

    def _validate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> None:
        if not self.loaded:
            raise ValueError("load_weights() has not run: publish a full param tree first")
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        vocab = self.model_config.vocab_size
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= self.max_prompt_length:
                raise ValueError(f"prompt {i} has {len(p)} tokens; need 1..max_prompt_length="
                                 f"{self.max_prompt_length}")
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        if not 1 <= sampling.max_new_tokens <= self.max_new_tokens:
            raise ValueError(f"sampling.max_new_tokens={sampling.max_new_tokens} must be in "
                             f"1..{self.max_new_tokens} (the engine's max_new_tokens)")
        if not sampling.greedy and sampling.temperature <= 0:
            raise ValueError("temperature must be > 0 unless greedy=True")

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 seed: int) -> list[Completion]:
        self._check_no_session("generate()")
        self._validate(prompt_token_ids, sampling)
        requests = self.requests(prompt_token_ids, sampling, seed)
        outputs = self.llm.generate([prompt for prompt, _, _ in requests],
                                    [params for _, params, _ in requests], use_tqdm=False)
        return [c for (_, _, n), output in zip(requests, outputs, strict=True)
                for c in self.completions(output, n, sampling)]

    def requests(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams,
                 seed: int) -> list[tuple[Any, Any, int]]:
        """The vLLM requests of `generate(prompt_token_ids, sampling, seed)`: (token prompt,
        SamplingParams, n), a run of equal prompts one request."""
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        return [(TokensPrompt(prompt_token_ids=prompt),
                 self.sampling_params(vllm, sampling, n, request_seed(seed, r)), n)
                for r, (prompt, n) in enumerate(group_requests(prompt_token_ids))]

    def completions(self, output: Any, n: int, sampling: SamplingParams) -> list[Completion]:
        """The `Completion`s of one finished vLLM request of `n` samples, in sample order."""
        samples = sorted(output.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for a request of n={n}")
        return [self._completion(c, sampling) for c in samples]

    @property
    def decodes_in_slices(self) -> bool:
        return True

    def session(self, sampling: SamplingParams, max_requests: int, **capacity: Any
                ) -> VllmSession:
        """A `VllmSession`: `generate`'s requests on vLLM's LLMEngine, stepped in slices
        (`engine.session`); `generate` and another session wait until it is closed."""
        self._check_no_session("another session")
        self._session = VllmSession(self, sampling, max_requests, **capacity)
        return self._session

    def _close_session(self, session: VllmSession) -> None:
        if self._session is session:
            self._session = None

    def _check_no_session(self, what: str) -> None:
        if self._session is not None:
            raise RuntimeError(f"the engine's vLLM is held by an open VllmSession: close() it "
                               f"before {what}")

    def _completion(self, sample: Any, sampling: SamplingParams) -> Completion:
        tokens = np.asarray(sample.token_ids, np.int32)
        if sample.logprobs is None or len(sample.logprobs) != len(tokens):
            raise RuntimeError("vLLM returned no logprob for some sampled tokens")
        logprobs = np.asarray([step[int(t)].logprob for t, step in zip(tokens, sample.logprobs,
                                                                       strict=True)], np.float32)
        return Completion(tokens=tokens, logprobs=logprobs,
                          finish_reason=self._finish_reason(sample, tokens, sampling))

    def _finish_reason(self, sample: Any, tokens: np.ndarray,
                       sampling: SamplingParams) -> FinishReason:
        if sample.finish_reason == "length":
            return "length"
        if sample.finish_reason != "stop":
            raise RuntimeError(f"vLLM ended a completion with {sample.finish_reason!r}")
        last = int(tokens[-1])
        reason = stop_reason(last, self.eos_ids, sampling)
        if reason is None:
            raise RuntimeError(f"vLLM stopped on token {last}, which is no stop token of ours")
        return reason
