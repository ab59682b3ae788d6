"""JaxEngine: the JAX-native per-host rollout engine, paged.

Data-parallel replicas over this host's devices (tensor parallelism inside a replica), each with
its own KV page pool and one jitted program per share (`engine.decode_loop`): chunked prefill,
admission and decode in one on-device loop, with continuous batching, prompt pages shared by the
requests of a group, and preemption when the pool runs dry. The pool is sized once from device
memory (`hbm_utilization`) and lives across calls. Shapes are bucketed to powers of two so a run
compiles a bounded number of programs. `lockstep=True` instead runs ONE program over all given
devices, a replica per device group, with every loop iteration in lockstep (the
single-controller structure, kept as a benchmark baseline).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tunix.models.qwen3 import model as qwen3

from tunix_mcjax import hostmem, memory
from tunix_mcjax.engine import layer_stack, pages, quantize
from tunix_mcjax.engine.base import Completion, Engine, SamplingParams
from tunix_mcjax.engine.buckets import pack_prompts, pow2_at_least, prompt_bucket
from tunix_mcjax.engine.completions import completion_of, stats_of
from tunix_mcjax.engine.decode_loop import build_program
from tunix_mcjax.engine.keys import generate_keys, request_keys
from tunix_mcjax.engine.kv_quant import check_tpu_kv_mode
from tunix_mcjax.engine.layer_stack import StackedParams
from tunix_mcjax.engine.loop_state import DecodeModel, Inputs, Outputs, ProgramShape
from tunix_mcjax.engine.options import EngineOptions, options_of
from tunix_mcjax.engine.paged_attention import layout_for
from tunix_mcjax.engine.qwen3_forward import Qwen3PagedModel
from tunix_mcjax.engine.sampling import SamplerSpec
from tunix_mcjax.engine.session import DecodeSession
from tunix_mcjax.engine.trees import LeafPath, flatten_tree, unflatten_tree
from tunix_mcjax.train import lora

MAX_STOP_IDS = 32


@dataclasses.dataclass(frozen=True)
class _LeafSpec:
    shape: tuple[int, ...]
    dtype: Any
    partition: P


@dataclasses.dataclass
class _Pending:
    """A dispatched program whose outputs are not read yet."""

    request_ids: list[int]  # in row order: replica 0's share, then replica 1's (lockstep)
    share_sizes: list[int]  # requests per replica of the program
    shape: ProgramShape
    outputs: Outputs


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
    """Per-host rollout engine on `devices` (this host's local devices), with `options`
    (`EngineOptions`; or its fields as keywords). A decode step runs the live rows only,
    packed into an eighth of the slots when they fit (`runner.ModelRunner.decode_rows`).
    """

    pack_decode_rows = True  # the model runs at any row count (`loop_state.decode_row_sizes`)

    def __init__(self, model_config: Any, devices: Sequence[jax.Device],
                 options: EngineOptions | None = None, **fields: Any):
        self.options = opts = options_of(options, fields)
        devices = list(devices)
        tp = opts.tensor_parallelism
        if opts.data_parallelism != -1:  # -1: as many replicas as the devices hold
            if not 1 <= opts.data_parallelism * tp <= len(devices):
                raise ValueError(f"data_parallelism={opts.data_parallelism} x "
                                 f"tensor_parallelism={tp} does not fit {len(devices)} devices")
            devices = devices[:opts.data_parallelism * tp]
        if not devices or tp < 1 or len(devices) % tp:
            raise ValueError(
                f"{len(devices)} devices do not split into replicas of tensor_parallelism={tp}"
            )
        self.model_config = model_config
        self._check_tensor_parallelism(tp)
        # Pad is sampled only when it is one of the model's EOS ids (Qwen3's <|endoftext|>).
        self.masked_id = None if opts.pad_id in opts.eos_ids else opts.pad_id
        groups = np.array(devices, dtype=object).reshape(-1, tp)
        if opts.lockstep:
            self.meshes = [self._mesh(groups)]
        else:
            self.meshes = [self._mesh(group.reshape(1, tp)) for group in groups]
        self._leaf_specs = self._param_specs(tp)
        self.num_pages = opts.num_pages or self._pages_for(devices[0], len(devices),
                                                           opts.hbm_utilization, tp)
        self._check_pool()
        self.pool_bytes = self.num_pages * self._page_bytes(tp) * len(devices)  # all replicas
        self._params: list[Any] = [self._param_store() for _ in self.meshes]
        self._pools: list[Any] = [None for _ in self.meshes]
        self._pool_holders: list[Any] = [None for _ in self.meshes]  # an open DecodeSession
        self._replica_models: dict[int, DecodeModel] = {}
        self._programs: dict[tuple[Any, ...], Any] = {}
        self.last_stats: list[dict[str, int]] = []  # per program of the last call

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

    def _decode_model(self, mesh: Mesh) -> DecodeModel:
        platform = mesh.devices.flat[0].platform
        if platform == "tpu":
            check_tpu_kv_mode(self.options.kv_quantization)
        return Qwen3PagedModel(self.model_config, mesh, layout_for(
            platform, mesh.devices.size, self.model_config.head_dim, mesh=mesh,
            kv_heads=self.model_config.num_kv_heads, kv_mode=self.options.kv_quantization,
            dtype=self.model_config.dtype))

    def _replica_model(self, mesh_index: int) -> DecodeModel:
        """The decode model of replica (mesh) `mesh_index`, built once."""
        if mesh_index not in self._replica_models:
            self._replica_models[mesh_index] = self._decode_model(self.meshes[mesh_index])
        return self._replica_models[mesh_index]

    def _param_store(self) -> Any:
        """A replica's loaded params, by path: Tunix's layers held stacked for the scan."""
        return StackedParams(self.model_config.num_layers)

    def _tree(self, flat: Any) -> dict[str, Any]:
        """The nested param tree the decode model takes (its layers stacked)."""
        return flat.tree()

    @property
    def num_replicas(self) -> int:
        return 1 if self.options.lockstep else len(self.meshes)

    @property
    def compile_count(self) -> int:
        return len(self._programs)

    # ----- the page pool -----

    def _page_bytes(self, tp: int) -> int:
        cfg = self.model_config
        itemsize = np.dtype(cfg.dtype).itemsize
        return pages.page_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                self.options.page_size, itemsize, tp,
                                self.options.kv_quantization)

    def _pages_needed(self) -> int:
        opts = self.options
        return pages.pages_needed(pow2_at_least(opts.max_batch_size), opts.max_prompt_length,
                                  opts.max_new_tokens, opts.page_size)

    def _pages_for(self, device: jax.Device, local_devices: int, utilization: float,
                   tp: int) -> int:
        """Pages a replica's pool takes: `utilization` of a device, less the engine's weights."""
        budget = (int(utilization * memory.device_memory_bytes(device, local_devices))
                  - self._weight_bytes(tp))
        return pages.pool_pages(budget, self._page_bytes(tp), self._pages_needed())

    def _weight_bytes(self, tp: int) -> int:
        """The engine's weights on one device (projections quantized under `quantization`)."""
        return sum(quantize.weight_bytes(path, s.shape, np.dtype(s.dtype).itemsize,
                                         self.options.quantization)
                   for path, s in self._leaf_specs.items()) // tp

    def _check_pool(self) -> None:
        """One sequence at the caps, with its prompt's pages, must fit: then the loop always
        moves (a lone row never waits on a page)."""
        opts = self.options
        least = pages.least_pool_pages(opts.max_prompt_length, opts.max_new_tokens,
                                       opts.page_size)
        if self.num_pages < least:
            raise ValueError(
                f"the KV page pool holds {self.num_pages} pages of {opts.page_size} tokens, but "
                f"one sequence at the caps (max_prefill_predict_length={opts.max_prompt_length} "
                f"prompt tokens, {opts.max_new_tokens} new) needs {least}: raise "
                "hbm_utilization_vllm (the engine's share of device memory), or lower "
                "max_prefill_predict_length / max_target_length")

    # ----- weights -----

    def load_weights(self, params: Any) -> None:
        flat = flatten_tree(params)
        specs = {path: self._spec_of(path, leaf) for path, leaf in flat.items()}
        for path, leaf in flat.items():
            spec = specs[path]
            if spec is None:
                raise ValueError(f"unknown param {'/'.join(path)}: not in the engine's param tree")
            if tuple(np.shape(leaf)) != spec.shape:
                raise ValueError(
                    f"param {'/'.join(path)} has shape {tuple(np.shape(leaf))}, "
                    f"expected {spec.shape}"
                )
        for mesh, replica_params in zip(self.meshes, self._params, strict=True):
            with jax.set_mesh(mesh):  # a cast runs on the replica, not the trainer's mesh
                for path, leaf in flat.items():
                    replica_params[path] = self._placed(path, leaf, specs[path], mesh)

    def _placed(self, path: LeafPath, leaf: Any, spec: _LeafSpec, mesh: Mesh) -> Any:
        """One leaf as a replica holds it: placed on `mesh`, a projection quantized under
        `quantization` (or placed as it is, when its publish quantized it already)."""
        mode = self.options.quantization
        if quantize.is_quantized(leaf):
            return quantize.place_quantized(path, leaf, NamedSharding(mesh, spec.partition), mode)
        return quantize.quantize_leaf(path, self._place(leaf, spec, mesh), mode)

    def _spec_of(self, path: LeafPath, leaf: Any) -> _LeafSpec | None:
        """A path's spec; a trainer's layer run (`layer_stack.run_of`) stacks its first
        layer's, the layer axis unsplit."""
        if layer_stack.run_of(path) is None:
            return self._leaf_specs.get(path)
        first = self._leaf_specs.get(layer_stack.first_layer_path(path))
        return first and _LeafSpec((np.shape(leaf)[0], *first.shape), first.dtype,
                                   P(None, *first.partition))

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
            placed = jax.make_array_from_single_device_arrays(
                spec.shape, sharding, [full_copies[d] for d in mesh_devices]
            )
            return placed if placed.dtype == spec.dtype else placed.astype(spec.dtype)
        if full_copies:
            source = full_copies.get(mesh_devices[0], next(iter(full_copies.values())))
        elif leaf.is_fully_addressable:
            source = leaf
        else:
            raise ValueError(
                "a jax Array param must be replicated over this host's devices (or fully "
                "addressable); reshard it to replicated first"
            )
        placed = jax.device_put(source, sharding)
        return placed if placed.dtype == spec.dtype else placed.astype(spec.dtype)

    def weights(self, replica: int = 0) -> dict[str, Any]:
        """The param tree replica `replica` decodes with (a nested dict of jax Arrays), in
        Tunix's per-layer layout (the engine holds its layers stacked)."""
        return unflatten_tree(dict(self._params[replica]))

    def _missing_params(self) -> list[str]:
        return ["/".join(p) for p in self._leaf_specs if p not in self._params[0]]

    # ----- generation -----

    @property
    def decodes_in_slices(self) -> bool:
        return not self.options.lockstep and self.options.continuous_batching

    def session(self, sampling: SamplingParams, max_requests: int, **capacity: Any
                ) -> DecodeSession:
        """A `DecodeSession`: this engine's loop in slices, requests joining as it runs
        (`engine.session`); it holds the page pools until closed."""
        return DecodeSession(self, sampling, max_requests, **capacity)

    def _take_pool(self, mesh_index: int, session: DecodeSession) -> Any:
        pool = self._pool(mesh_index)
        self._pools[mesh_index], self._pool_holders[mesh_index] = None, session
        return pool

    def _return_pool(self, mesh_index: int, pool: Any, session: DecodeSession) -> None:
        if self._pool_holders[mesh_index] is not session:
            raise RuntimeError(f"replica {mesh_index}'s page pool is not this session's")
        self._pool_holders[mesh_index] = None
        if self.options.free_pool_after_generate:
            hostmem.trim(self.meshes[mesh_index].devices.flat, self.pool_bytes)
        else:
            self._pools[mesh_index] = pool

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        prompts = [np.asarray(p, dtype=np.int32).reshape(-1) for p in prompt_token_ids]
        self._validate(prompts, sampling)
        spec = SamplerSpec.of(sampling, self.model_config.vocab_size)
        buckets = self._buckets(prompts, sampling)
        shares = np.array_split(np.arange(len(prompts)), self.num_replicas)
        # Every request's key on the host before any program is queued: a key made after
        # replica 0's program would wait behind it on the default device, and the replicas
        # would run one after another instead of at once.
        keys = generate_keys(seed, len(prompts), self.num_replicas)
        pending = []
        for replica, share in enumerate(shares):
            if len(share):
                request_ids = [int(i) for i in share]
                pending += self._dispatch(
                    replica, request_ids, prompts, sampling, spec, keys[replica], *buckets
                )
        return self._finish(pending, len(prompts), sampling)

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
        keys = request_keys(np.broadcast_to(np.asarray(key), (len(prompts), 2)),
                            np.arange(len(prompts)))
        pending = self._dispatch(replica, request_ids, prompts, sampling, spec, keys, *buckets)
        return self._finish(pending, len(prompts), sampling)

    def _finish(self, pending: list[_Pending], num_requests: int,
                sampling: SamplingParams) -> list[Completion]:
        """The completions; the pools go back when the engine frees them between calls."""
        try:
            return self._collect(pending, num_requests, sampling)
        finally:
            if self.options.free_pool_after_generate:
                self._pools = [None for _ in self.meshes]
                hostmem.trim(self.meshes[0].devices.flat, self.pool_bytes)

    def _buckets(self, prompts: list[np.ndarray], sampling: SamplingParams) -> tuple[int, int]:
        """(prompt length, new tokens) padded to powers of two, capped by the engine limits."""
        longest = max(len(p) for p in prompts)
        return (prompt_bucket(longest, self.options.max_prompt_length),
                min(pow2_at_least(sampling.max_new_tokens), self.options.max_new_tokens))

    def _validate(self, prompts: list[np.ndarray], sampling: SamplingParams) -> None:
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        vocab = self.model_config.vocab_size
        lengths = np.array([len(p) for p in prompts])
        cap = self.options.max_prompt_length
        if bad := np.flatnonzero((lengths < 1) | (lengths > cap)).tolist():
            raise ValueError(
                f"prompt {bad[0]} has {lengths[bad[0]]} tokens; need 1..max_prompt_length="
                f"{self.options.max_prompt_length}"
            )
        ids = np.concatenate(prompts)
        if ids.min() < 0 or ids.max() >= vocab:
            first = int(np.searchsorted(np.cumsum(lengths), np.flatnonzero(
                (ids < 0) | (ids >= vocab))[0], side="right"))
            raise ValueError(f"prompt {first} has token ids outside [0, {vocab})")
        if not 1 <= sampling.max_new_tokens <= self.options.max_new_tokens:
            raise ValueError(
                f"sampling.max_new_tokens={sampling.max_new_tokens} must be in "
                f"1..{self.options.max_new_tokens} (the engine's max_new_tokens)"
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
        keys: np.ndarray,
        prompt_bucket: int,
        new_bucket: int,
    ) -> list[_Pending]:
        """Launch one replica's share without blocking: one program, or waves without CB.
        In lockstep, `replica` 0 runs every replica's share in one program. `keys` [share, 2]
        are the share's request keys, in `request_ids` order."""
        mesh_index = 0 if self.options.lockstep else replica
        mesh = self.meshes[mesh_index]
        if self.options.lockstep or self.options.continuous_batching:
            batches = [request_ids]
        else:
            size = self.options.max_batch_size
            batches = [request_ids[i : i + size] for i in range(0, len(request_ids), size)]
        pending, first = [], 0
        for batch in batches:
            # In lockstep each device group takes a slice; request i keeps its key.
            parts = mesh.shape["data"] if self.options.lockstep else 1
            shares = [[int(r) for r in part] for part in np.array_split(batch, parts)]
            offsets = first + np.cumsum([0] + [len(share) for share in shares[:-1]])
            host_inputs = [self._host_inputs([prompts[r] for r in share], sampling,
                                             keys[offset:offset + len(share)], prompt_bucket)
                           for share, offset in zip(shares, offsets, strict=True)]
            shape = self._shape(host_inputs, prompt_bucket, new_bucket)
            host_inputs = [self._pad_inputs(h, shape) for h in host_inputs]
            inputs = self._inputs(host_inputs)
            params = self._tree(self._params[mesh_index])
            pool = self._pool(mesh_index)
            program = self._program(mesh_index, shape, spec, params, pool, inputs)
            outputs, self._pools[mesh_index] = program(params, pool, inputs)
            pending.append(_Pending([r for share in shares for r in share],
                                    [len(share) for share in shares], shape, outputs))
            first += len(batch)
        return pending

    def _host_inputs(self, prompts: list[np.ndarray], sampling: SamplingParams,
                     keys: np.ndarray, prompt_bucket: int) -> dict[str, Any]:
        tokens, lens, request_prompts = pack_prompts(prompts, self.options.pad_id, prompt_bucket, 1,
                                                     share=self.options.prefix_caching)
        return dict(prompts=tokens, prompt_lens=lens, request_prompts=request_prompts,
                    request_keys=np.asarray(keys, np.uint32), **self._sampling_inputs(sampling))

    def _sampling_inputs(self, sampling: SamplingParams) -> dict[str, np.ndarray]:
        """The program inputs that say how to sample and when a sequence ends."""
        stop_ids = np.full((MAX_STOP_IDS,), -1, np.int32)
        stops = self._stop_ids(sampling)
        stop_ids[: len(stops)] = stops
        return dict(temperature=np.float32(1.0 if sampling.greedy else sampling.temperature),
                    top_p=np.float32(sampling.top_p), stop_ids=stop_ids,
                    max_new_tokens=np.int32(sampling.max_new_tokens))

    def _shape(self, host_inputs: list[dict[str, Any]], prompt_bucket: int,
               new_bucket: int) -> ProgramShape:
        """The program shape of a share: the largest request and prompt counts of its replicas."""
        n = max(len(h["request_prompts"]) for h in host_inputs)
        u = max(len(h["prompt_lens"]) for h in host_inputs)
        group = max(int(np.bincount(h["request_prompts"][h["request_prompts"] >= 0]).max(
            initial=1)) for h in host_inputs)
        chunk, rows = pages.prefill_chunk(prompt_bucket, self.options.max_num_batched_tokens)
        return ProgramShape(
            num_requests=n, num_slots=n if self.options.lockstep else min(n, pow2_at_least(
                self.options.max_batch_size)),
            num_prompts=u, prompt_len=prompt_bucket, max_new=new_bucket,
            page_size=self.options.page_size, num_pages=self.num_pages, chunk=chunk,
            prefill_rows=max(1, min(u, rows)), group_size=pow2_at_least(group),
            pack_decode_rows=self.pack_decode_rows,
            routing=getattr(self._replica_model(0), "routing_shape", None))

    @staticmethod
    def _pad_inputs(h: dict[str, Any], shape: ProgramShape) -> dict[str, Any]:
        """Pad a replica's requests and prompts to the program's counts."""
        h = dict(h)
        pad_n = shape.num_requests - len(h["request_prompts"])
        pad_u = shape.num_prompts - len(h["prompt_lens"])
        h["request_prompts"] = np.pad(h["request_prompts"], (0, pad_n), constant_values=-1)
        h["request_keys"] = np.pad(h["request_keys"], ((0, shape.num_requests
                                                        - len(h["request_keys"])), (0, 0)))
        h["prompt_lens"] = np.pad(h["prompt_lens"], (0, pad_u))
        h["prompts"] = np.pad(h["prompts"], ((0, pad_u), (0, 0)))
        return h

    def _inputs(self, host_inputs: list[dict[str, Any]]) -> Inputs:
        """One replica's inputs, or in lockstep every replica's stacked, as host arrays: the
        compiled program places them (`_input_specs`), cheaper than a device_put per call."""
        if not self.options.lockstep:
            return Inputs(**host_inputs[0])
        return Inputs(**{k: np.stack([np.asarray(h[k]) for h in host_inputs])
                         for k in host_inputs[0]})

    def _input_specs(self, inputs: Inputs, mesh: Mesh) -> Inputs:
        """Where the program takes its inputs: replicated over the replica's mesh, or in
        lockstep each replica's slice on its device group."""
        sharding = NamedSharding(mesh, P("data") if self.options.lockstep else P())
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            inputs)

    def _pool(self, mesh_index: int) -> Any:
        """The replica's page pool, made on first use (again after `free_pool_after_generate`)."""
        if self._pool_holders[mesh_index] is not None:
            raise RuntimeError(f"replica {mesh_index}'s page pool is held by an open "
                               "DecodeSession: close() it before generate() or another session")
        if self._pools[mesh_index] is None:
            replicas = self.meshes[mesh_index].shape["data"]  # > 1 in lockstep: a slice each
            model = self._replica_model(mesh_index)
            self._pools[mesh_index] = model.empty_pool(self.num_pages * replicas,
                                                       self.options.page_size)
        return self._pools[mesh_index]

    def _program(self, mesh_index: int, shape: ProgramShape, spec: SamplerSpec, params, pool,
                 inputs):
        """The compiled program for (replica, shape, sampler), compiling it on first use."""
        cache_key = (mesh_index, shape, spec)
        if cache_key not in self._programs:
            mesh = self.meshes[mesh_index]
            model = self._replica_model(mesh_index)
            vocab = self.model_config.vocab_size
            if self.options.lockstep:
                fn = self._lockstep(build_program(model, shape, spec, self.masked_id, vocab,
                                                  lockstep_axis="data"), mesh,
                                    model.layout.spec("data"))
            else:
                fn = build_program(model, shape, spec, self.masked_id, vocab)
            self._programs[cache_key] = jax.jit(fn, donate_argnums=1).lower(
                params, pool, self._input_specs(inputs, mesh)).compile()
        return self._programs[cache_key]

    @staticmethod
    def _lockstep(program, mesh: Mesh, pool_spec: P):
        """Each device group of `mesh` runs its replica's program on its slice of the pool and
        of the stacked inputs; the loop condition is one all-reduce over `data`."""
        pages = P(*(axis if axis == "data" else None for axis in pool_spec))
        def per_replica(params, pool, inputs):
            inputs = jax.tree.map(lambda x: x[0], inputs)
            outputs, pool = program(params, pool, inputs)
            return jax.tree.map(lambda x: x[None], outputs), pool

        return jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), pages, P("data")),
                             out_specs=(P("data"), pages), axis_names={"data"},
                             check_vma=False)

    def _collect(
        self, pending: list[_Pending], num_requests: int, sampling: SamplingParams
    ) -> list[Completion]:
        results: list[Completion | None] = [None] * num_requests
        self.last_stats = []
        for item in pending:
            out = jax.device_get(item.outputs)  # one batched transfer
            if not self.options.lockstep:  # one replica: the lockstep layout [replicas, ...]
                out = jax.tree.map(lambda x: x[None], out)
            if out.stalled.any():
                raise RuntimeError(
                    f"the decode loop stopped with requests left: the KV page pool "
                    f"({self.num_pages} pages) could not hold them; raise hbm_utilization_vllm")
            requests = iter(item.request_ids)  # replica 0's share, then replica 1's
            for replica, count in enumerate(item.share_sizes):
                one = jax.tree.map(lambda x, r=replica: x[r], out)
                self.last_stats.append(stats_of(one))
                for row in range(count):
                    results[next(requests)] = completion_of(one, row, sampling,
                                                            self.options.eos_ids)
        return results  # type: ignore[return-value]

    @property
    def last_iterations(self) -> list[int]:
        """Loop iterations per program (per replica in lockstep) of the last call."""
        return [stats["iterations"] for stats in self.last_stats]

    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        eos = [] if sampling.ignore_eos else list(self.options.eos_ids)
        return list(dict.fromkeys([*sampling.stop_token_ids, *eos]))

