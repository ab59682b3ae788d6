"""The field layer: a config key carries its default, description and constraint.

`key(default, doc, check=...)` is a `dataclasses.field` whose metadata holds the rest, so the
config stays a plain frozen dataclass (`dataclasses.asdict`, class attributes for defaults).
Allowed values are the key's `Literal[...]` type; ranges are `Check`s built by the helpers below.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable
from typing import Any, Literal


class ConfigError(ValueError):
    """A recipe or override that cannot run; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Check:
    """A one-key constraint: `ok(value)` holds. `bound` states it for the reference ("> 0");
    `text` is how an error says it ("a finite number > 0"), with why where that helps."""

    ok: Callable[[Any], bool]
    bound: str
    text: str


def positive(note: str = "") -> Check:
    """> 0 and finite (refuses nan and inf)."""
    return Check(lambda v: 0 < v < math.inf, "> 0", _say("a finite number > 0", note))


def non_negative(note: str = "") -> Check:
    return Check(lambda v: 0 <= v < math.inf, ">= 0", _say("a finite number >= 0", note))


def at_least(low: int, note: str = "") -> Check:
    return Check(lambda v: v >= low, f">= {low}", _say(f">= {low}", note))


def between(low: float, high: float, ends: str = "()", note: str = "") -> Check:
    """In the interval from `low` to `high`; `ends` is its brackets: "()", "(]", "[)" or "[]"."""
    above = (lambda v: v >= low) if ends[0] == "[" else (lambda v: v > low)
    below = (lambda v: v <= high) if ends[1] == "]" else (lambda v: v < high)
    bound = f"in {ends[0]}{low:g}, {high:g}{ends[1]}"
    return Check(lambda v: above(v) and below(v), bound, _say(bound, note))


def _say(bound: str, note: str) -> str:
    return f"{bound} {note}" if note else bound


def key(default: Any, doc: str, *, check: Check | None = None, runtime_only: bool = False) -> Any:
    """A config key. `runtime_only`: it changes how a run executes or reports, not what it
    computes, so a resume may change it (it is left out of `algorithm_fingerprint`)."""
    return dataclasses.field(
        default=default, metadata={"doc": doc, "check": check, "runtime_only": runtime_only})


def choices(hint: Any) -> tuple[Any, ...]:
    """The allowed values of a `Literal[...]` type; () for any other type."""
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def keys_of(section: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(section))


def coerce(name: str, hint: Any, value: Any, default: Any) -> Any:
    """`value` as the key's type: ints widen to floats, lists (or a,b strings) to tuples."""
    allowed = choices(hint)
    if allowed:
        if isinstance(value, bool) and str(value).lower() in allowed:  # YAML's true/false
            return str(value).lower()
        hint = type(allowed[0])
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name} must be a list of strings, got {value!r}")
        return tuple(value)
    if hint is bool and isinstance(value, bool):
        return value
    if not isinstance(value, bool):
        if hint is int and isinstance(value, int):
            return value
        if hint is float and isinstance(value, (int, float)):
            return float(value)
        if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if hint is str and isinstance(value, (str, int, float)):
            return str(value)
    raise ConfigError(
        f"{name} must be {hint.__name__}, got {type(value).__name__} {value!r}. "
        f"Example: {name}={default!r}")


def check_value(field: dataclasses.Field, hint: Any, value: Any) -> None:
    """Raises ConfigError naming the key, the value and an example if `value` is not allowed."""
    allowed = choices(hint)
    if allowed and value not in allowed:
        raise ConfigError(f"{field.name}={value!r} is not one of {', '.join(allowed)}")
    check = field.metadata["check"]
    if check and not check.ok(value):
        raise ConfigError(f"{field.name} must be {check.text}, got {value}. "
                          f"Example: {field.name}={field.default!r}")
