"""Chat templates: render the model's own Jinja template from its GGUF metadata."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import EesdError

Message = dict[str, str]

# Used only when a GGUF carries no template: ChatML, which Qwen models speak.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@cache
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = _raise
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, indent=indent)


def check_messages(messages: Sequence[Message]) -> list[Message]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise EesdError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise EesdError(f"message {i} has an unknown role {m['role']!r}", hint="use system, user or assistant")
        out.append({"role": m["role"], "content": str(m["content"])})
    return out


def render(template: str | None, messages: Sequence[Message], *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text for ``messages`` under ``template`` (ChatML when the model has none)."""
    msgs = check_messages(messages)
    try:
        return _compile(template or CHATML).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
            tools=None, documents=None,
        )
    except jinja2.TemplateError as exc:
        raise EesdError(f"the model's chat template failed: {exc}", hint="pass a raw prompt without --chat") from None
