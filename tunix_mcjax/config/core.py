"""`Config`, the one config object of a run, and `load_config`: a YAML recipe plus `key=value`
overrides, every key checked alone and then the cross-key rules, before any process touches a
device."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from tunix_mcjax.config import rules
from tunix_mcjax.config.fields import ConfigError, check_value, coerce
from tunix_mcjax.config.keys import Keys


@dataclasses.dataclass(frozen=True)
class Config(Keys):
    """Every key of a run (`Keys`), and what needs the rules: replace, the DA split, the
    topology checks. The rules themselves read `Keys`, so they do not import this module."""

    def replace(self, **changes: Any) -> Config:
        return load_config(None, overrides=changes, base=self)

    def disaggregated_split(self, num_hosts: int) -> tuple[int, int]:
        """(trainer hosts, rollout hosts) of `num_hosts` under rl_runtime=mcjax_da."""
        return rules.disaggregated_split(self, num_hosts)

    def validate_topology(self, num_hosts: int, local_devices: int) -> None:
        """Divisibility checks that need the cluster shape. Raises ConfigError."""
        rules.check_topology(self, num_hosts, local_devices)


FIELDS = {f.name: f for f in dataclasses.fields(Config)}
HINTS = typing.get_type_hints(Config)


def unknown_key_error(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(FIELDS), n=3, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key {key!r}.{hint}")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`key=value` strings to a dict; values are parsed as YAML scalars, as MaxText does."""
    out: dict[str, Any] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"override {arg!r} is not key=value")
        key, raw = arg.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def _read_recipe(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} not found")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"recipe {path} must be a YAML mapping of key: value")
    return loaded


def load_config(
    path: str | Path | None,
    overrides: dict[str, Any] | list[str] | None = None,
    base: Config | None = None,
) -> Config:
    """Builds a Config from a YAML file (or `base`) and overrides, then validates it."""
    values: dict[str, Any] = dataclasses.asdict(base) if base else {}
    if path is not None:
        values.update(_read_recipe(path))
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    values.update(overrides or {})
    for key in values:
        if key not in FIELDS:
            raise unknown_key_error(key)
    cfg = Config(**{k: coerce(k, HINTS[k], v, FIELDS[k].default) for k, v in values.items()})
    for field in FIELDS.values():
        check_value(field, HINTS[field.name], getattr(cfg, field.name))
    rules.check_rules(cfg)
    return cfg
