"""One config object for a run: YAML recipe plus `key=value` overrides, MaxText key names.

- `fields`: how a key is declared (type, default, description, constraint);
- `sections`: the keys, grouped by concern;
- `core`: `Config` and `load_config`; `rules`: the cross-key rules;
- `fingerprint`: what a checkpoint depends on; `reference`: writes the docs' key reference.
"""

from tunix_mcjax.config.core import (
    Config,
    load_config,
    parse_overrides,
    unknown_key_error,
)
from tunix_mcjax.config.fields import ConfigError
from tunix_mcjax.config.fingerprint import (
    RUNTIME_ONLY_KEYS,
    algorithm_fingerprint,
    fingerprint_mismatch,
    warmup_updates,
)
from tunix_mcjax.config.rules import (
    DA_KEYS,
    DA_REFUSED,
    DA_SPLITS,
    KV_POOL_KEYS,
    PAGED_ENGINES,
    VLLM_KEYS,
    json_object,
)

__all__ = [
    "DA_KEYS", "DA_REFUSED", "DA_SPLITS", "KV_POOL_KEYS", "PAGED_ENGINES", "RUNTIME_ONLY_KEYS",
    "VLLM_KEYS", "Config", "ConfigError", "algorithm_fingerprint", "fingerprint_mismatch",
    "json_object", "load_config", "parse_overrides", "unknown_key_error", "warmup_updates",
]
