"""The chat's widgets: transcript entries and the live speculation panel."""

from __future__ import annotations

import io

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Markdown, Static

from eesd_chat.session import Answer
from eesd_local.speculative.events import Stats

# token provenance colours: accepted draft, the target's own token, bonus after a fully accepted draft
SOURCE_STYLE = {"draft": "bold #7ee787", "target": "#f0b35a", "bonus": "bold #79c0ff"}
SOURCE_LABEL = {"draft": "accepted draft", "target": "target", "bonus": "bonus"}
SPARK = "▁▂▃▄▅▆▇█"


def provenance_text(pieces: list[tuple[str, str]]) -> Text:
    text = Text()
    for piece, source in pieces:
        text.append(piece, SOURCE_STYLE.get(source, ""))
    return text


def legend(colouring: bool) -> Text:
    text = Text("token provenance ", "bold").append("(colours on)\n" if colouring else "(colours off: ctrl+o)\n", "dim")
    for source in ("draft", "target", "bonus"):
        text.append("■ ", SOURCE_STYLE[source]).append(SOURCE_LABEL[source] + "  ")
    return text


def sparkline(lengths: list[int], top: int, width: int) -> Text:
    """One cell per round, the height the draft length out of ``top``; a dot for no draft."""
    text = Text()
    for k in lengths[-width:]:
        if k <= 0:
            text.append("·", "dim")
        else:
            text.append(SPARK[min(len(SPARK) - 1, max(0, round(k / top * len(SPARK)) - 1))], "#79c0ff")
    return text


def bar(frac: float, width: int = 10) -> Text:
    full = round(max(0.0, min(1.0, frac)) * width)
    return Text("█" * full, "#7ee787").append("░" * (width - full), "dim")


class UserView(Vertical):
    """A user turn in the transcript."""

    def __init__(self, content: str) -> None:
        super().__init__(classes="turn user")
        self.content = content

    def compose(self) -> ComposeResult:
        yield Label("you", classes="role")
        yield Static(Text(self.content), classes="body")


class AnswerView(Vertical):
    """An assistant answer: Markdown as it streams, or its tokens coloured by provenance."""

    def __init__(self, answer: Answer) -> None:
        super().__init__(classes="turn assistant")
        self.answer = answer
        self._stream = None

    def compose(self) -> ComposeResult:
        yield Label(f"assistant · {self.answer.drafter} / {self.answer.controller}", classes="role")
        yield Markdown("", classes="body markdown")
        yield Static("", classes="body provenance")
        yield Static("…", classes="meta")

    def on_mount(self) -> None:
        self._stream = Markdown.get_stream(self.query_one(Markdown))

    async def add_piece(self, piece: str) -> None:
        self.query_one(".provenance", Static).update(provenance_text(self.answer.pieces))
        if self._stream is not None and piece:
            await self._stream.write(piece)

    async def finish(self, note: str) -> None:
        """The answer is complete (or stopped): render it whole and show its summary line."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        await self.query_one(Markdown).update(self.answer.text)
        self.query_one(".provenance", Static).update(provenance_text(self.answer.pieces))
        self.set_meta(note)

    def set_meta(self, note: str) -> None:
        self.query_one(".meta", Static).update(Text(note))


def _pct(x: float, n: int) -> str:
    return f"{100 * x:.0f}%" if n else "—"


def _num(x: float, n: int, fmt: str = "{:.2f}") -> str:
    return fmt.format(x) if n else "—"


class SpeculationPanel(Static):
    """Acceptance, tau, speed, draft lengths, the controller's belief, acceptance by position."""

    _group: Group | None = None

    def show(self, answer: Answer | None, session: Stats, plain_tps: float | None, *, draft_max: int,
             controller: str, timings: bool, colouring: bool) -> None:
        self._group = Group(*self._sections(answer, session, plain_tps, draft_max, controller, timings, colouring))
        self.update(self._group)

    def plain_text(self) -> str:
        """What the panel shows, as plain text (for tests and logs)."""
        out = io.StringIO()
        Console(file=out, width=max(20, self.content_size.width or 40), color_system=None, highlight=False).print(self._group or "")
        return out.getvalue()

    def _sections(self, answer: Answer | None, session: Stats, plain_tps: float | None, draft_max: int,
                  controller: str, timings: bool, colouring: bool) -> list[RenderableType]:
        cur = answer.stats if answer is not None else Stats()
        grid = Table.grid(padding=(0, 1), expand=True)
        grid.add_column("what", style="dim", width=16, no_wrap=True)
        grid.add_column("answer", justify="right", ratio=1, no_wrap=True)
        grid.add_column("session", justify="right", ratio=1, no_wrap=True)
        grid.add_row("", Text("answer", "bold"), Text("session", "bold"))
        grid.add_row("tokens", str(cur.n_generated), str(session.n_generated))
        grid.add_row("rounds", str(cur.n_rounds), str(session.n_rounds))
        grid.add_row("drafted", str(cur.n_drafted), str(session.n_drafted))
        grid.add_row("accepted", str(cur.n_accepted), str(session.n_accepted))
        grid.add_row("accept rate", _pct(cur.acceptance_rate, cur.n_drafted), _pct(session.acceptance_rate, session.n_drafted))
        grid.add_row("tau (tok/round)", _num(cur.tau, cur.n_rounds), _num(session.tau, session.n_rounds))
        if timings:
            grid.add_row("tokens/s", _num(cur.tokens_per_s, cur.t_decode > 0, "{:.1f}"),
                         _num(session.tokens_per_s, session.t_decode > 0, "{:.1f}"))
            if plain_tps:
                grid.add_row("plain tokens/s", "≈ " + f"{plain_tps:.1f}", "(estimate)")
                # like for like: tokens per second of the rounds themselves (drafting and verifying) over
                # the plain estimate, which is also a decode's time alone; the chat's own drawing and
                # Python's per-token work would slow plain decoding here just as much, and in a session's
                # first answer they showed a x0.77 "slow-down" for rounds that hardly drafted
                grid.add_row("speed-up", _num(_round_speed(cur) / plain_tps, cur.t_draft + cur.t_verify > 0, "×{:.2f}"),
                             _num(_round_speed(session) / plain_tps, session.t_draft + session.t_verify > 0, "×{:.2f}"))
            else:
                grid.add_row("plain tokens/s", "—", "(estimate)")
        else:
            grid.add_row("tokens/s", "hidden", "hidden")
        out: list[RenderableType] = [grid, Text("")]

        width = max(8, self.content_size.width or 30)
        lengths = cur.draft_lengths
        out.append(Text(f"draft length per round (0–{draft_max})", "bold"))
        out.append(sparkline(lengths, draft_max, width) if lengths else Text("no rounds yet", "dim"))
        out.append(Text(""))

        out.append(Text(f"controller belief · {controller}", "bold"))
        b = answer.belief if answer is not None else {}
        if b and "mean" in b:
            line = Text("P(accept) ", "dim").append(f"{b['mean']:.2f}")
            if "lo" in b and "hi" in b:
                line.append("  90% CI ", "dim").append(f"{b['lo']:.2f}–{b['hi']:.2f}")
            out.append(line)
            extra = Text()
            if "expected_k" in b:
                extra.append("E[draft] ", "dim").append(f"{b['expected_k']:.2f}  ")
            if "theta_1" in b:
                extra.append("θ₁ ", "dim").append(f"{b['theta_1']:.2f}")
            if "k" in b:
                extra.append("k ", "dim").append(f"{b['k']:.0f}")
            if extra.plain:
                out.append(extra)
        else:
            out.append(Text("no rounds yet", "dim"))
        out.append(Text(""))

        out.append(Text("drafted by source (session)", "bold"))
        if not session.by_source and not cur.by_source:
            out.append(Text("nothing drafted yet", "dim"))
        for src, (rounds, drafted, accepted) in sorted(session.by_source.items(), key=lambda kv: -kv[1][1]):
            frac = accepted / drafted if drafted else 0.0
            line = Text(f"{src[:8]:<8} ").append(bar(frac, 8)).append(f" {100 * frac:3.0f}% ")
            line.append(f"{accepted}/{drafted} in {rounds} rnd", "dim")
            if answer is not None and src == answer.last_source:
                line.append(" ◂", "bold")  # drafted the latest round
            out.append(line)
        out.append(Text(""))

        out.append(Text("acceptance by draft position (session)", "bold"))
        pos = session.acceptance_by_position
        if not pos:
            out.append(Text("nothing drafted yet", "dim"))
        for label, acc, n in position_rows(session.drafted_at[:draft_max], session.accepted_at[:draft_max]):
            frac = acc / n if n else 0.0
            out.append(Text(f"{label:>5} ").append(bar(frac)).append(f" {100 * frac:3.0f}% ").append(f"{acc}/{n}", "dim"))
        out.append(Text(""))
        out.append(legend(colouring))
        return out


def position_rows(drafted_at: list[int], accepted_at: list[int]) -> list[tuple[str, int, int]]:
    """(label, accepted, drafted) per draft position: 1 to 8 one by one, then 9-16, 17-32, 33-64, ..
    pooled, so that 64-token drafts fit the panel; positions never drafted are left out."""
    rows, lo = [], 0
    while lo < len(drafted_at):
        hi = lo + 1 if lo < 8 else 2 * lo  # [lo, hi): 8 -> 9-16, 16 -> 17-32, ..
        n, a = sum(drafted_at[lo:hi]), sum(accepted_at[lo:hi])
        if n:
            rows.append((str(lo + 1) if hi == lo + 1 else f"{lo + 1}-{min(hi, len(drafted_at))}", a, n))
        lo = hi
    return rows


def _round_speed(stats: Stats) -> float:
    """Tokens the rounds emitted per second spent in them (drafting and verifying)."""
    t = stats.t_draft + stats.t_verify
    return stats.n_emitted / t if t > 0 else 0.0
