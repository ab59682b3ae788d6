"""Agentic environment factories that go wrong, for tests/test_agentic_demo.py."""

from __future__ import annotations

import os

from tunix_mcjax.agentic.demo import lookup_conversation


def fails_on_host_1(prompt, fields, *, seed, system_prompt):
    if os.environ.get("TUNIX_MCJAX_PROCESS_ID") == "1":
        raise RuntimeError("host 1 cannot build its environment")
    return lookup_conversation(prompt, fields, seed=seed, system_prompt=system_prompt)
