"""JaxEngine: the JAX-native per-host rollout engine.

Data-parallel replicas over this host's devices (tensor parallelism inside a replica), each
running one jitted program per share: prefill, then an on-device `lax.while_loop` decode with a
per-row KV cache and, by default, continuous batching. Shapes are bucketed to powers of two so a
run compiles a bounded number of programs. `lockstep=True` instead runs ONE program over all
given devices with the batch sharded across them and every decode iteration in lockstep (the
single-controller structure, kept as a benchmark baseline).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tunix.models.qwen3 import model as qwen3

from tunix_mcjax import lora
from tunix_mcjax.engine.base import Completion, Engine, FinishReason, SamplingParams
from tunix_mcjax.engine.decode_loop import (
    DecodeModel,
    Inputs,
    Outputs,
    ProgramShape,
    Qwen3DecodeModel,
    build_program,
)
from tunix_mcjax.engine.sampling import SamplerSpec

LeafPath = tuple[str, ...]
MAX_STOP_IDS = 8
MIN_PROMPT_BUCKET = 8


@dataclasses.dataclass(frozen=True)
class _LeafSpec:
    shape: tuple[int, ...]
    dtype: Any
    partition: P


@dataclasses.dataclass
class _Pending:
    """A dispatched program whose outputs are not read yet."""

    request_ids: list[int]
    outputs: Outputs


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def flatten_tree(tree: Mapping[Any, Any], prefix: LeafPath = ()) -> dict[LeafPath, Any]:
    flat: dict[LeafPath, Any] = {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, Mapping):
            flat.update(flatten_tree(value, path))
        else:
            flat[path] = value
    return flat


def unflatten_tree(flat: Mapping[LeafPath, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def pack_prompts(
    prompts: Sequence[np.ndarray], pad_id: int, prompt_len: int, multiple: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct prompts, right-padded: (tokens [U, prompt_len], lengths [U], request_prompts [N]).

    N and U are powers of two rounded up to `multiple`; padding requests point at prompt -1.
    """
    distinct: dict[bytes, int] = {}
    index = [distinct.setdefault(p.tobytes(), len(distinct)) for p in prompts]
    n = -(-pow2_at_least(len(prompts)) // multiple) * multiple
    u = -(-pow2_at_least(len(distinct)) // multiple) * multiple
    request_prompts = np.full((n,), -1, np.int32)
    request_prompts[: len(index)] = index
    tokens = np.full((u, prompt_len), pad_id, np.int32)
    lengths = np.zeros((u,), np.int32)
    for prompt, i in zip(prompts, index, strict=True):
        tokens[i, : len(prompt)] = prompt
        lengths[i] = len(prompt)
    return tokens, lengths, request_prompts


def _leaf_specs(cfg: qwen3.ModelConfig, tp: int) -> dict[LeafPath, _LeafSpec]:
    """Expected shape/dtype of every param, and its sharding over a replica's `tp` axis.

    Matrices follow Tunix's sampling specs on `tp` (dims that don't divide stay whole); norms
    and anything on `fsdp` are replicated. A LoRA config adds its adapters (`lora.py`).
    """
    def build():
        model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
        return lora.add_adapters(model) if lora.lora_of(cfg) else model

    abstract = nnx.eval_shape(build)
    state = nnx.state(abstract, nnx.Param)
    shapes = flatten_tree(nnx.to_pure_dict(state))
    partitions = flatten_tree(nnx.to_pure_dict(nnx.get_partition_spec(state)))
    specs = {}
    for path, leaf in shapes.items():
        axes = tuple(partitions[path]) + (None,) * (len(leaf.shape) - len(partitions[path]))
        axes = tuple(
            "tp" if axis == "tp" and len(leaf.shape) > 1 and dim % tp == 0 else None
            for axis, dim in zip(axes, leaf.shape, strict=True)
        )
        specs[path] = _LeafSpec(tuple(leaf.shape), leaf.dtype, P(*axes))
    return specs


class JaxEngine(Engine):
    """Per-host rollout engine on `devices` (this host's local devices).

    `eos_ids` are the model's end-of-sequence ids (`engine.stops.model_stop_ids`); each ends a
    sequence unless `ignore_eos`. `max_batch_size` caps the rows one replica decodes at once
    (rounded up to a power of two):
    with continuous batching a larger share streams through that many rows; without it the
    share runs in waves. `lockstep` decodes the whole batch at once and ignores it.
    `data_parallelism` replicas use the first data_parallelism x tensor_parallelism devices.
    """

    def __init__(
        self,
        model_config: qwen3.ModelConfig,
        devices: Sequence[jax.Device],
        *,
        pad_id: int,
        eos_ids: Sequence[int],
        max_prompt_length: int,
        max_new_tokens: int,
        tensor_parallelism: int = 1,
        continuous_batching: bool = True,
        lockstep: bool = False,
        max_batch_size: int = 64,
        data_parallelism: int = -1,
    ):
        devices = list(devices)
        tp = tensor_parallelism
        if data_parallelism != -1:  # -1: as many replicas as the devices hold
            if not 1 <= data_parallelism * tp <= len(devices):
                raise ValueError(f"data_parallelism={data_parallelism} x tensor_parallelism={tp} "
                                 f"does not fit {len(devices)} devices")
            devices = devices[:data_parallelism * tp]
        if not devices or tp < 1 or len(devices) % tp:
            raise ValueError(
                f"{len(devices)} devices do not split into replicas of tensor_parallelism={tp}"
            )
        self.model_config = model_config
        self._check_tensor_parallelism(tp)
        if max_prompt_length < 1 or max_new_tokens < 1 or max_batch_size < 1:
            raise ValueError("max_prompt_length, max_new_tokens and max_batch_size must be >= 1")
        self.pad_id = pad_id
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        # Pad is sampled only when it is one of the model's EOS ids (Qwen3's <|endoftext|>).
        self.masked_id = None if pad_id in self.eos_ids else pad_id
        self.max_prompt_length = max_prompt_length
        self.max_new_tokens = max_new_tokens
        self.continuous_batching = continuous_batching
        self.lockstep = lockstep
        self.max_batch_size = max_batch_size
        groups = np.array(devices, dtype=object).reshape(-1, tp)
        if lockstep:
            self.meshes = [self._mesh(groups)]
        else:
            self.meshes = [self._mesh(group.reshape(1, tp)) for group in groups]
        self._leaf_specs = self._param_specs(tp)
        self._params: list[dict[LeafPath, jax.Array]] = [{} for _ in self.meshes]
        self._programs: dict[tuple[Any, ...], Any] = {}
        self.last_iterations: list[int] = []  # decode iterations per program of the last call

    # ----- what a model family defines (Tunix Qwen3 here) -----

    def _check_tensor_parallelism(self, tp: int) -> None:
        cfg = self.model_config
        if cfg.num_heads % tp or cfg.num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallelism={tp} must divide num_heads={cfg.num_heads} and "
                f"num_kv_heads={cfg.num_kv_heads}"
            )

    def _mesh(self, devices: np.ndarray) -> Mesh:
        """A replica's mesh over devices [replicas, tp]."""
        return Mesh(devices, ("data", "tp"))

    def _param_specs(self, tp: int) -> dict[LeafPath, _LeafSpec]:
        return _leaf_specs(self.model_config, tp)

    def _decode_model(self, mesh: Mesh, shape: ProgramShape) -> DecodeModel:
        return Qwen3DecodeModel(self.model_config, shape.max_new, mesh)

    def _tree(self, flat: Mapping[LeafPath, Any]) -> dict[str, Any]:
        """The nested param tree the decode model takes."""
        return unflatten_tree(flat)

    @property
    def num_replicas(self) -> int:
        return 1 if self.lockstep else len(self.meshes)

    @property
    def compile_count(self) -> int:
        return len(self._programs)

    # ----- weights -----

    def load_weights(self, params: Any) -> None:
        flat = flatten_tree(params)
        for path, leaf in flat.items():
            spec = self._leaf_specs.get(path)
            if spec is None:
                raise ValueError(f"unknown param {'/'.join(path)}: not in the engine's param tree")
            if tuple(np.shape(leaf)) != spec.shape:
                raise ValueError(
                    f"param {'/'.join(path)} has shape {tuple(np.shape(leaf))}, "
                    f"expected {spec.shape}"
                )
        for mesh, replica_params in zip(self.meshes, self._params, strict=True):
            for path, leaf in flat.items():
                replica_params[path] = self._place(leaf, self._leaf_specs[path], mesh)

    def _place(self, leaf: Any, spec: _LeafSpec, mesh: Mesh) -> jax.Array:
        """Put one leaf on `mesh`; a replicated jax Array is used in place, shard by shard."""
        sharding = NamedSharding(mesh, spec.partition)
        if not isinstance(leaf, jax.Array):
            return jax.device_put(np.asarray(leaf, dtype=spec.dtype), sharding)
        full_copies = {
            s.device: s.data for s in leaf.addressable_shards if s.data.shape == leaf.shape
        }
        mesh_devices = list(mesh.devices.flat)
        if sharding.is_fully_replicated and all(d in full_copies for d in mesh_devices):
            return jax.make_array_from_single_device_arrays(
                spec.shape, sharding, [full_copies[d].astype(spec.dtype) for d in mesh_devices]
            )
        if full_copies:
            source = full_copies.get(mesh_devices[0], next(iter(full_copies.values())))
        elif leaf.is_fully_addressable:
            source = leaf
        else:
            raise ValueError(
                "a jax Array param must be replicated over this host's devices (or fully "
                "addressable); reshard it to replicated first"
            )
        return jax.device_put(source.astype(spec.dtype), sharding)

    def weights(self, replica: int = 0) -> dict[str, Any]:
        """The param tree replica `replica` decodes with (a nested dict of jax Arrays)."""
        return self._tree(self._params[replica])

    def _missing_params(self) -> list[str]:
        return ["/".join(p) for p in self._leaf_specs if p not in self._params[0]]

    # ----- generation -----

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        prompts = [np.asarray(p, dtype=np.int32).reshape(-1) for p in prompt_token_ids]
        self._validate(prompts, sampling)
        spec = SamplerSpec.of(sampling, self.model_config.vocab_size)
        buckets = self._buckets(prompts, sampling)
        base_key = jax.random.PRNGKey(seed)
        shares = np.array_split(np.arange(len(prompts)), self.num_replicas)
        pending = []
        for replica, share in enumerate(shares):
            if len(share):
                key = jax.random.fold_in(base_key, replica)
                request_ids = [int(i) for i in share]
                pending += self._dispatch(
                    replica, request_ids, prompts, sampling, spec, key, *buckets
                )
        return self._collect(pending, len(prompts), sampling)

    def generate_share(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        key: jax.Array,
        replica: int = 0,
    ) -> list[Completion]:
        """One replica's share with an explicit key: what `generate` runs on replica `replica`
        with key `fold_in(PRNGKey(seed), replica)`."""
        prompts = [np.asarray(p, dtype=np.int32).reshape(-1) for p in prompt_token_ids]
        self._validate(prompts, sampling)
        spec = SamplerSpec.of(sampling, self.model_config.vocab_size)
        buckets = self._buckets(prompts, sampling)
        request_ids = list(range(len(prompts)))
        pending = self._dispatch(replica, request_ids, prompts, sampling, spec, key, *buckets)
        return self._collect(pending, len(prompts), sampling)

    def _buckets(self, prompts: list[np.ndarray], sampling: SamplingParams) -> tuple[int, int]:
        """(prompt length, new tokens) padded to powers of two, capped by the engine limits."""
        longest = max(len(p) for p in prompts)
        prompt_bucket = min(max(MIN_PROMPT_BUCKET, pow2_at_least(longest)), self.max_prompt_length)
        new_bucket = min(pow2_at_least(sampling.max_new_tokens), self.max_new_tokens)
        return prompt_bucket, new_bucket

    def _validate(self, prompts: list[np.ndarray], sampling: SamplingParams) -> None:
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        vocab = self.model_config.vocab_size
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= self.max_prompt_length:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; need 1..max_prompt_length="
                    f"{self.max_prompt_length}"
                )
            if p.min() < 0 or p.max() >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        if not 1 <= sampling.max_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"sampling.max_new_tokens={sampling.max_new_tokens} must be in "
                f"1..{self.max_new_tokens} (the engine's max_new_tokens)"
            )
        if not sampling.greedy and sampling.temperature <= 0:
            raise ValueError("temperature must be > 0 unless greedy=True")
        if sampling.top_k < 0 or not 0 < sampling.top_p <= 1:
            raise ValueError("top_k must be >= 0 and top_p in (0, 1]")
        stops = len(self._stop_ids(sampling))
        if stops > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop tokens (eos included) are supported")
        missing = self._missing_params()
        if missing:
            raise ValueError(
                f"load_weights() has not set {len(missing)} params (e.g. {missing[0]}); "
                "load a full param tree before generate()"
            )

    def _dispatch(
        self,
        replica: int,
        request_ids: list[int],
        prompts: list[np.ndarray],
        sampling: SamplingParams,
        spec: SamplerSpec,
        key: jax.Array,
        prompt_bucket: int,
        new_bucket: int,
    ) -> list[_Pending]:
        """Launch one replica's share without blocking: one program, or waves without CB."""
        mesh_index = 0 if self.lockstep else replica
        mesh = self.meshes[mesh_index]
        data_size = mesh.shape["data"]
        if self.lockstep or self.continuous_batching:
            batches = [request_ids]
        else:
            size = self.max_batch_size
            batches = [request_ids[i : i + size] for i in range(0, len(request_ids), size)]
        stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
        stops = self._stop_ids(sampling)
        stop_ids[: len(stops)] = stops
        pending, first = [], 0
        for batch in batches:
            tokens, lens, request_prompts = pack_prompts(
                [prompts[r] for r in batch], self.pad_id, prompt_bucket, data_size
            )
            n, u = len(request_prompts), len(lens)
            slots = n if self.lockstep else min(n, pow2_at_least(self.max_batch_size))
            shape = ProgramShape(n, slots, u, prompt_bucket, new_bucket)
            batch_sharding = NamedSharding(mesh, P("data"))
            replicated = NamedSharding(mesh, P())
            inputs = Inputs(
                prompts=jax.device_put(tokens, batch_sharding),
                prompt_lens=jax.device_put(lens, batch_sharding),
                request_prompts=jax.device_put(request_prompts, batch_sharding),
                key=jax.device_put(key, replicated),
                first_request_index=jax.device_put(np.int32(first), replicated),
                temperature=jax.device_put(
                    np.float32(1.0 if sampling.greedy else sampling.temperature), replicated
                ),
                top_p=jax.device_put(np.float32(sampling.top_p), replicated),
                stop_ids=jax.device_put(stop_ids, replicated),
                max_new_tokens=jax.device_put(np.int32(sampling.max_new_tokens), replicated),
            )
            params = self._tree(self._params[mesh_index])
            program = self._program(mesh_index, shape, spec, params, inputs)
            pending.append(_Pending(batch, program(params, inputs)))
            first += len(batch)
        return pending

    def _program(self, mesh_index: int, shape: ProgramShape, spec: SamplerSpec, params, inputs):
        """The compiled program for (replica, shape, sampler), compiling it on first use."""
        cache_key = (mesh_index, shape, spec)
        if cache_key not in self._programs:
            model = self._decode_model(self.meshes[mesh_index], shape)
            fn = build_program(model, shape, spec, self.masked_id)
            self._programs[cache_key] = jax.jit(fn).lower(params, inputs).compile()
        return self._programs[cache_key]

    def _collect(
        self, pending: list[_Pending], num_requests: int, sampling: SamplingParams
    ) -> list[Completion]:
        results: list[Completion | None] = [None] * num_requests
        self.last_iterations = []
        for item in pending:
            tokens = np.asarray(item.outputs.tokens)
            logprobs = np.asarray(item.outputs.logprobs)
            lengths = np.asarray(item.outputs.lengths)
            self.last_iterations.append(int(item.outputs.iterations))
            for row, request in enumerate(item.request_ids):
                n = int(lengths[row])
                seq = tokens[row, :n].copy()
                results[request] = Completion(
                    tokens=seq,
                    logprobs=logprobs[row, :n].copy(),
                    finish_reason=self._finish_reason(seq, sampling),
                )
        return results  # type: ignore[return-value]

    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        eos = [] if sampling.ignore_eos else list(self.eos_ids)
        return list(dict.fromkeys([*sampling.stop_token_ids, *eos]))

    def _finish_reason(self, tokens: np.ndarray, sampling: SamplingParams) -> FinishReason:
        last = int(tokens[-1])
        if last in self.eos_ids and not sampling.ignore_eos:
            return "eos"
        if last in sampling.stop_token_ids:
            return "stop"
        return "length"
