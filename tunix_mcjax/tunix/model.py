"""The Tunix CLI's model: a Qwen3 Hugging Face checkpoint, as `model_config.*` names it.

`model_source=huggingface` downloads `model_id` into `model_download_path` with Tunix's own
`hf_pipeline`, unless that directory already holds a checkpoint (config.json and safetensors):
then it is used as it is, offline. The architecture is Tunix's config for `model_name` when
Tunix names one (`automodel.call_model_config`: qwen3-0.6b ... qwen3-8b, -base too), else the
checkpoint's own config.json (e.g. a tiny test model). The weights load through Tunix's Qwen3
safetensors loader (`tunix_mcjax.models.load_model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tunix_mcjax import topology
from tunix_mcjax.config import ConfigError
from tunix_mcjax.models import PRESETS

# Our Config's preset for each architecture Tunix names (its -base variants share them).
_PRESET_OF = {"qwen3_0p6b": "qwen3-0.6b", "qwen3_1p7b": "qwen3-1.7b", "qwen3_4b": "qwen3-4b",
              "qwen3_8b": "qwen3-8b"}


def has_checkpoint(directory: str) -> bool:
    path = Path(directory)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def checkpoint_dir(model: dict[str, Any], topo: topology.Topology | None = None) -> str:
    """The local checkpoint directory; downloads it first when it is not there (host 0 first,
    then the others find it, or download to their own disks)."""
    if model.get("model_source") != "huggingface":
        raise ConfigError(f"model_config.model_source={model.get('model_source')!r}: "
                          "checkpoints load from Hugging Face safetensors; use "
                          "model_source=huggingface")
    directory = str(model.get("model_download_path") or "")
    if not directory:
        raise ConfigError("model_config.model_download_path must name the checkpoint directory "
                          "(a local Hugging Face Qwen3 checkpoint, or where to download it)")
    directory = str(Path(directory).absolute())
    if topo is None or has_checkpoint(directory):
        return directory
    from tunix.oss import utils as oss_utils

    for turn in (True, False):
        if topo.is_leader == turn and not has_checkpoint(directory):
            oss_utils.hf_pipeline(model["model_id"], directory)
        topology.allgather(np.zeros(1, np.int32))  # a barrier: host 0 downloads first
    if not has_checkpoint(directory):
        raise ConfigError(f"{directory} holds no config.json and *.safetensors after downloading "
                          f"{model['model_id']!r}")
    return directory


def model_keys(model: dict[str, Any], directory: str) -> dict[str, Any]:
    """Our Config's model keys for the checkpoint: Tunix's named config, else config.json's."""
    from tunix.models import automodel, naming

    hf = json.loads((Path(directory) / "config.json").read_text()) \
        if (Path(directory) / "config.json").is_file() else {}
    if hf and hf.get("model_type") != "qwen3":
        raise ConfigError(f"{directory}/config.json: model_type={hf.get('model_type')!r}; "
                          "rl_runtime=mcjax runs Tunix's dense Qwen3 (model_type qwen3)")
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"{directory}/config.json: dtype {dtype!r}; use float32 or bfloat16")
    names = naming.ModelNaming(model_name=model["model_name"])
    if names.model_family != "qwen3":
        raise ConfigError(f"model_config.model_name={model['model_name']!r} (family "
                          f"{names.model_family!r}): rl_runtime=mcjax runs Tunix's Qwen3 models")
    keys = {"load_parameters_path": directory, "weight_dtype": dtype, "dtype": "float32"}
    try:
        mc = automodel.call_model_config(names.model_name)
    except (AttributeError, ValueError):
        mc = None
    if mc is not None:
        preset = _PRESET_OF.get(names.model_config_id.removesuffix("_base"))
        if preset not in PRESETS:
            raise ConfigError(f"model_config.model_name={model['model_name']!r}: not a dense "
                              f"Qwen3 this runtime has a preset for ({', '.join(PRESETS)})")
        return {**keys, "model_name": preset}
    if not hf:
        raise ConfigError(f"model_config.model_name={model['model_name']!r} is not a model "
                          f"Tunix names, and {directory} has no config.json to read its shape")
    if not hf.get("tie_word_embeddings", False):
        raise ConfigError(f"{directory}/config.json: an untied lm_head needs a model Tunix "
                          "names (model_config.model_name); tiny models tie their embeddings")
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return {**keys, "model_name": "qwen3-tiny",
            "base_num_decoder_layers": hf["num_hidden_layers"], "base_emb_dim": hf["hidden_size"],
            "base_mlp_dim": hf["intermediate_size"],
            "base_num_query_heads": hf["num_attention_heads"],
            "base_num_kv_heads": hf["num_key_value_heads"], "head_dim": head_dim,
            "vocab_size": hf["vocab_size"], "rope_max_timescale": int(hf.get("rope_theta", 1e6))}
