"""The suite's local Ray start tries again only when Ray's raylet wait ran out."""

from __future__ import annotations

import pytest
import ray

from tests import ray_local


def failing_init(errors: list[Exception], calls: list[int]):
    def init(**kwargs):
        calls.append(1)
        if errors:
            raise errors.pop(0)
    return init


def test_a_raylet_startup_timeout_is_tried_once_more(monkeypatch):
    calls: list[int] = []
    timeout = Exception("The current node timed out during startup. This could happen ...")
    monkeypatch.setattr(ray, "init", failing_init([timeout], calls))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    ray_local.start_local_ray()
    assert len(calls) == 2


def test_other_errors_and_a_second_timeout_are_raised(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "init", failing_init([ValueError("bad resources")], calls))
    with pytest.raises(ValueError, match="bad resources"):
        ray_local.start_local_ray()
    assert len(calls) == 1
    timeouts = [Exception("node timed out during startup")] * 2
    monkeypatch.setattr(ray, "init", failing_init(timeouts, calls))
    with pytest.raises(Exception, match="timed out during startup"):
        ray_local.start_local_ray()
    assert len(calls) == 3
