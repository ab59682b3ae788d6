"""Chat rendering of an agent's messages into tokens: the prompt, and each turn's observation.

A chat template is a JSON object of role formats (`{content}` is the message): keys `system`,
`user`, `assistant`, `tool` and `generation` (what opens the model's turn). A data_template_path
file holds one; empty: `PLAIN`. The model's own turns are never re-rendered: their tokens are
the sampled ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from tunix_mcjax.config import ConfigError

ROLES = ("system", "user", "assistant", "tool")
PLAIN = {"system": "{content}\n", "user": "{content}\n", "assistant": "{content}\n",
         "tool": "{content}\n", "generation": ""}


def load_chat_template(path: str) -> dict[str, str]:
    """The role formats in the JSON file `path`; empty: `PLAIN`."""
    if not path:
        return dict(PLAIN)
    try:
        template = json.loads(epath.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"data_template_path={path!r} is not a readable JSON file: {e}") from e
    missing = [k for k in (*ROLES, "generation") if not isinstance(template.get(k), str)]
    if missing:
        raise ConfigError(
            f"data_template_path={path!r} needs string role formats for {', '.join(missing)} "
            f"(an agentic chat template: {json.dumps(PLAIN)})")
    return template


class ChatParser:
    """Renders messages with a chat template and tokenizes them (no special tokens added)."""

    def __init__(self, tokenizer: Any, template: dict[str, str]):
        self.tokenizer, self.template = tokenizer, template

    def render(self, messages: Sequence[dict[str, Any]], generation: bool) -> str:
        text = "".join(self.template[m["role"]].format(content=m.get("content") or "")
                       for m in messages)
        return text + (self.template["generation"] if generation else "")

    def tokens(self, messages: Sequence[dict[str, Any]], generation: bool) -> np.ndarray:
        text = self.render(messages, generation)
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32)
