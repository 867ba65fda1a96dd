"""A scripted engine for the chat: the same event types as the real engine, from a fixed script.

``ChatApp`` takes its engine as an argument and reads only ``generate`` (the event stream),
``cancel``, ``chat_tokens`` and a few names; this class answers those with a recorded
answer, so a screen snapshot is the same on every machine (a real model's greedy text flips
at near ties between CPU kernels). The events go through the app's normal path: its thread
worker iterates ``generate`` and posts each event to the UI with ``call_from_thread``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

from eesd_local.speculative.events import Event, FinishEvent, RoundEvent, Stats, TokenEvent

# one round: (tokens drafted, the emitted pieces as (text, source)); accepted = the "draft" pieces
Round = tuple[int, list[tuple[str, str]]]

ANSWER: list[Round] = [
    (0, [("Here", "target")]),
    (4, [(" is", "draft"), (" the", "draft"), (" function", "target")]),
    (4, [(" with", "draft"), (" type", "draft"), (" hints", "draft"), (":", "draft"), ("\n\n", "bonus")]),
    (4, [("```", "draft"), ("python", "draft"), ("\n", "target")]),
    (4, [("def", "draft"), (" add", "draft"), ("(a", "draft"), (":", "draft"), (" int", "bonus")]),
    (4, [(",", "draft"), (" b", "draft"), (":", "draft"), (" int", "draft"), (")", "bonus")]),
    (4, [(" ->", "draft"), (" int", "draft"), (":\n", "target")]),
    (4, [("    return", "draft"), (" a", "draft"), (" +", "draft"), (" b", "draft"), ("\n", "bonus")]),
    (4, [("```", "target")]),
]


@dataclass
class ScriptedEngine:
    """Duck-types what ``ChatApp`` uses of ``Engine``; ``generate`` replays ``script``."""

    script: list[Round] = field(default_factory=lambda: list(ANSWER))
    drafter_name: str = "lookup"
    controller_name: str = "fixed:4"
    model_path: str = "/models/scripted.gguf"
    n_ctx: int = 4096
    draft_max: int = 8
    hold_after: int | None = None  # block after this many tokens until cancel() (a long answer to stop)

    def __post_init__(self) -> None:
        self.drafter = SimpleNamespace(name=self.drafter_name)
        self.controller = SimpleNamespace(name=self.controller_name)
        self.config = SimpleNamespace(draft_max=self.draft_max)
        self.ctx = SimpleNamespace(n_ctx=self.n_ctx)
        self.drafter_note = f"drafter: {self.drafter_name}"
        self.prompts: list[str | list[int]] = []
        self._cancel = threading.Event()

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def chat_tokens(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return list(self.apply_chat_template(messages, add_generation_prompt).encode("utf-8"))  # bytes stand in for tokens

    def generate(self, prompt: str | list[int], *, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 **_: object) -> Iterator[Event]:
        self.prompts.append(prompt)
        self._cancel.clear()
        stats = Stats(n_prompt=len(prompt.split()) if isinstance(prompt, str) else len(prompt), drafter=self.drafter.name, controller=self.controller.name)
        text, reason = "", "stop"
        for index, (drafted, pieces) in enumerate(self.script):
            if self._cancel.is_set():
                reason = "cancelled"
                break
            if stats.n_generated >= max_tokens:
                reason = "length"
                break
            pieces = pieces[: max_tokens - stats.n_generated]
            accepted = sum(src == "draft" for _, src in pieces)
            for piece, src in pieces:
                stats.n_generated += 1
                text += piece
                yield TokenEvent(token=stats.n_generated, text=piece, source=src, round=index)  # type: ignore[arg-type]
                if self.hold_after is not None and stats.n_generated >= self.hold_after:
                    self._cancel.wait(timeout=30)
            source = ("eesd" if index % 3 == 0 else "lookup") if drafted else ""  # as auto picks per round
            stats.record_round(drafted, accepted, len(pieces), source)
            stats.t_draft += 0.001 * drafted
            stats.t_verify += 0.02
            belief = {"mean": 0.8, "lo": 0.6, "hi": 0.9, "k": float(drafted)}
            yield RoundEvent(index=index, drafted=drafted, accepted=accepted, emitted=len(pieces),
                             t_draft=0.001 * drafted, t_verify=0.02, belief=belief, source=source)
        stats.t_decode = 0.5
        yield FinishEvent(reason=reason, stats=stats, text=text)  # type: ignore[arg-type]

    def cancel(self) -> None:
        self._cancel.set()

    def set_drafter(self, kind: str) -> str:
        self.drafter = SimpleNamespace(name=kind)
        self.drafter_note = f"drafter: {kind}"
        return self.drafter_note

    def set_controller(self, spec: str) -> None:
        self.controller = SimpleNamespace(name=spec)

    def close(self) -> None:
        pass

    @property
    def text(self) -> str:
        return "".join(p for _, pieces in self.script for p, _ in pieces)
