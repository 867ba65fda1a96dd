"""What the chat remembers: the conversation, running speculation figures, transcripts.

Nothing here touches Textual: the app feeds engine events in and reads figures out, and
the tests read the same figures.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eesd_local.base.atomic import atomic_path
from eesd_local.base.errors import EesdError
from eesd_local.speculative.events import RoundEvent, Stats, TokenEvent

SOURCES = ("draft", "target", "bonus")  # accepted draft, the target's own token, the bonus after a full accept


@dataclass
class Answer:
    """One assistant answer as it streams: provenance pieces and its speculation figures."""

    drafter: str
    controller: str
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (text, source) per emitted token
    stats: Stats = field(default_factory=Stats)
    belief: dict[str, float] = field(default_factory=dict)  # the controller's belief after the last round
    reason: str = ""  # "", or the FinishEvent's reason once done
    error: str = ""  # a user-facing error that ended the answer
    t_start: float = 0.0  # when the first token arrived (the prefill is over)
    final: bool = False  # stats come from the FinishEvent (exact times)
    last_source: str = ""  # the source that drafted the latest round that drafted

    def __post_init__(self) -> None:
        self.stats.drafter, self.stats.controller = self.drafter, self.controller

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)

    def add_token(self, ev: TokenEvent) -> None:
        if not self.pieces and not self.t_start:
            self.t_start = time.perf_counter()
        self.pieces.append((ev.text, ev.source))
        self.stats.n_generated += 1
        if not self.final:
            self.stats.t_decode = time.perf_counter() - self.t_start

    def add_round(self, ev: RoundEvent) -> None:
        self.stats.record_round(ev.drafted, ev.accepted, ev.emitted, getattr(ev, "source", ""))
        if ev.drafted:
            self.last_source = getattr(ev, "source", "") or self.drafter
        self.stats.t_draft += ev.t_draft
        self.stats.t_verify += ev.t_verify
        if ev.belief:
            self.belief = dict(ev.belief)

    def finish(self, reason: str, stats: Stats, text: str) -> None:
        """Take the engine's final figures; add the detokenizer's tail if it held one back."""
        have = self.text
        if text.startswith(have) and len(text) > len(have):
            self.pieces.append((text[len(have):], "target"))
        self.reason = reason
        self.stats = stats
        self.final = True


def merge_stats(parts: list[Stats]) -> Stats:
    """The figures of several answers taken together (the session column)."""
    out = Stats()
    for s in parts:
        out.add(s)
    return out


class PlainEstimate:
    """Seconds per token of plain decoding, estimated from the rounds seen so far.

    A round that drafted nothing is exactly one plain decode step, so their mean verify
    time is the estimate. Before any such round, a least-squares line through
    (tokens decoded, verify seconds) of the drafting rounds is read off at one token.
    """

    def __init__(self) -> None:
        self.plain: list[float] = []
        self.points: list[tuple[int, float]] = []

    def add(self, drafted: int, t_verify: float) -> None:
        if drafted == 0:
            self.plain.append(t_verify)
        else:
            self.points.append((drafted + 1, t_verify))

    def seconds_per_token(self) -> float | None:
        if self.plain:
            recent = self.plain[-64:]
            return sum(recent) / len(recent)
        xs = [x for x, _ in self.points[-64:]]
        if len(set(xs)) < 2:
            return None
        ys = [y for _, y in self.points[-64:]]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        at_one = my + slope * (1 - mx)
        return at_one if at_one > 0 else None

    def tokens_per_s(self) -> float | None:
        s = self.seconds_per_token()
        return 1.0 / s if s else None


@dataclass
class Turn:
    role: str  # user | assistant
    content: str
    answer: Answer | None = None  # for assistant turns


@dataclass
class Conversation:
    """The messages sent to the chat template, plus what the transcript file records."""

    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": t.role, "content": t.content} for t in self.turns]

    def answers(self) -> list[Answer]:
        return [t.answer for t in self.turns if t.answer is not None]


def transcript_markdown(conv: Conversation, meta: dict[str, Any]) -> str:
    lines = ["# eesd-chat transcript", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    if conv.system:
        lines += ["", "## system", "", conv.system]
    for t in conv.turns:
        lines += ["", f"## {t.role}", "", t.content]
        if t.answer is not None:
            s = t.answer.stats
            note = f"{s.n_generated} tokens, drafter {t.answer.drafter}, controller {t.answer.controller}: " \
                   f"drafted {s.n_drafted}, accepted {s.n_accepted}, tau {s.tau:.2f}"
            if t.answer.reason and t.answer.reason != "stop":
                note += f" ({t.answer.reason})"
            lines += ["", f"_{note}_"]
    return "\n".join(lines) + "\n"


def transcript_jsonl(conv: Conversation, meta: dict[str, Any]) -> str:
    """One JSON object per line: a meta record, then one per message."""
    rows: list[dict[str, Any]] = [{"type": "meta", **meta}]
    if conv.system:
        rows.append({"type": "message", "role": "system", "content": conv.system})
    for t in conv.turns:
        row: dict[str, Any] = {"type": "message", "role": t.role, "content": t.content}
        if t.answer is not None:
            a = t.answer
            row["finish_reason"] = a.reason or None
            row["speculation"] = a.stats.as_dict() | {"controller_belief": a.belief}
            row["provenance"] = [[text, src] for text, src in a.pieces]
        rows.append(row)
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def save_transcript(path: str | Path, conv: Conversation, meta: dict[str, Any]) -> Path:
    """Write the transcript atomically: JSONL for a ``.jsonl`` path, else Markdown."""
    final = Path(path).expanduser().resolve()
    text = transcript_jsonl(conv, meta) if final.suffix.lower() == ".jsonl" else transcript_markdown(conv, meta)
    try:
        with atomic_path(final) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise EesdError(f"cannot write the transcript to {final}: {exc.strerror}", hint="pick another path: /save PATH.md or PATH.jsonl") from None
    return final


def default_transcript_path(suffix: str = ".md") -> Path:
    return Path.cwd() / f"eesd-chat-{time.strftime('%Y%m%d-%H%M%S')}{suffix}"
