"""Chat templates: render the model's own Jinja template from its GGUF metadata."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from functools import cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from eesd_local.base.errors import EesdError
from eesd_local.base.params import ParamError, show

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
    return json.dumps(value, ensure_ascii=False, indent=indent)


ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name for system
TEXT_PART = "{'type': 'text', 'text': ...}"


def check_messages(messages: Any) -> list[Message]:
    """``messages`` as a list of {'role', 'content'} dicts with text content (the shapes the server
    accepts: a string, None, or a list of text parts); anything else raises ParamError."""
    if not isinstance(messages, list | tuple):
        raise ParamError("messages", f"messages must be a list of messages, got {show(messages)}",
                         hint="e.g. [{'role': 'user', 'content': 'Hello'}]")
    if not messages:
        raise ParamError("messages", "messages is empty: there is nothing to answer",
                         hint="give at least one message, e.g. [{'role': 'user', 'content': 'Hello'}]")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ParamError("messages", f"message {i} must be a dict with 'role' and 'content', got {show(m)}")
        role = m["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise ParamError("messages", f"message {i} has an unknown role {show(role)}", hint="use system, user or assistant")
        out.append({"role": "system" if role == "developer" else role, "content": _text(i, m["content"])})
    return out


def _text(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                                 for p in content):
        return "".join(p["text"] for p in content)
    raise ParamError("messages", f"message {i} content must be text (a string or a list of {TEXT_PART} parts), "
                                 f"got {show(content)}")


def _render(template: str | None, msgs: Sequence[Message], add_generation_prompt: bool, bos_token: str, eos_token: str) -> str:
    try:
        return _compile(template or CHATML).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
            tools=None, documents=None,
        )
    except jinja2.TemplateError as exc:
        raise EesdError(f"the model's chat template failed: {exc}",
                        hint="check the order of the roles (many templates want user and assistant turns to alternate), "
                             "or send a plain prompt") from None


def render(template: str | None, messages: Sequence[Message], *, add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text for ``messages`` under ``template`` (ChatML when the model has none)."""
    return _render(template, check_messages(messages), add_generation_prompt, bos_token, eos_token)


_MARKS = "\ue000\ue001\ue002\ue003"  # private-use characters that open and close a message's text in render_parts


def render_parts(template: str | None, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                 bos_token: str = "", eos_token: str = "") -> list[tuple[str, bool]]:
    """The rendered prompt as (text, is_message_text) pieces: the template's own text, where its control
    tokens are special, apart from the messages' text, which must be tokenized as plain text.

    Each message's text is rendered between two markers made unique to this call; whatever the
    template does with it (trim it, indent it) stays between them. A template that cuts a marked
    text apart leaves a marker unmatched, and the prompt is refused rather than guessed at."""
    nonce = secrets.token_hex(8)
    opening = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
    closing = f"\ue002{nonce}\ue003"
    msgs = check_messages(messages)
    marked = [{"role": m["role"], "content": f"\ue000{nonce}:{i}\ue001{m['content']}{closing}"} for i, m in enumerate(msgs)]
    text = _render(template, marked, add_generation_prompt, bos_token, eos_token)
    parts: list[tuple[str, bool]] = []
    at = 0
    while (m := opening.search(text, at)) is not None:
        end = text.find(closing, m.end())
        if end < 0 or nonce in text[at:m.start()] or nonce in text[m.end():end]:
            raise _cut_apart(msgs[int(m.group(1))])
        parts += [(text[at:m.start()], False), (text[m.end():end], True)]
        at = end + len(closing)
    parts.append((text[at:], False))
    if any(not is_text and any(c in piece for c in _MARKS) for piece, is_text in parts):
        raise _cut_apart(None)  # a piece of a marker outside a pair: the template cut a message's text apart
    return [(piece, is_text) for piece, is_text in parts if piece]


def _cut_apart(message: Message | None) -> EesdError:
    which = f"a {message['role']} message" if message else "a message"
    return EesdError(f"this model's chat template rewrites the text of {which}, and that text holds control-token "
                     "text (such as <|im_end|>) that could not be kept apart from the template's own markers",
                     hint="remove the control-token text from the message")
