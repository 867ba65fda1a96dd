"""``eesd-chat``: a terminal chat that answers with speculative decoding and shows it live.

The app only composes widgets and routes events. Each answer runs in a thread worker
that iterates the engine's event stream and hands every event to the UI thread with
``call_from_thread``; the engine is cancelled cleanly with ``Engine.cancel``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import events, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Input, Static

from eesd_chat.session import Answer, Conversation, PlainEstimate, Turn, default_transcript_path, merge_stats, save_transcript
from eesd_chat.widgets import AnswerView, SpeculationPanel, UserView
from eesd_local.base.claim import CLAIM
from eesd_local.base.defaults import CHAT_MAX_TOKENS, TEMPERATURE, TOP_P
from eesd_local.base.errors import EesdError
from eesd_local.base.interrupts import keep_interrupts
from eesd_local.base.params import check_sampling
from eesd_local.speculative.events import FinishEvent, RoundEvent, TokenEvent

if TYPE_CHECKING:  # the engine pulls in llama.cpp and numba: open_engine imports it inside main's Ctrl-C handler
    from eesd_local.speculative.engine import Engine

DRAFTER_CYCLE = ["eesd", "lookup", "none"]
CONTROLLER_CYCLE = ["cost-ts", "beta-ts", "calibration-ts", "heuristic", "pmin:0.75", "fixed:4"]
MIN_WIDTH, MIN_HEIGHT = 72, 18

WELCOME = (
    "Ask a coding question. Enter sends · Esc stops the answer · Ctrl+D cycles the drafter · Ctrl+T the controller · "
    "Ctrl+O colours tokens by provenance · Ctrl+S saves the transcript (or type /save PATH.md|PATH.jsonl) · "
    "Ctrl+N starts a new chat · Ctrl+Q quits."
)


@dataclass
class ChatOptions:
    model_name: str = ""  # shown in the header (default: the model file's name)
    system: str | None = None  # system message of every conversation
    temperature: float = TEMPERATURE  # 0 = greedy
    top_p: float = TOP_P
    max_tokens: int = CHAT_MAX_TOKENS  # per answer
    timings: bool = True  # False hides wall-clock figures (deterministic screens for snapshot tests)


class _AppGone(Exception):
    """The app stopped while an answer was streaming."""


class ChatApp(App[None]):
    """Transcript and input on the left, the speculation panel on the right."""

    CSS_PATH = "chat.tcss"
    TITLE = "eesd-chat"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (MIN_WIDTH, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (MIN_HEIGHT, "-tall")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("ctrl+d", "cycle_drafter", "Drafter", priority=True),
        Binding("ctrl+t", "cycle_controller", "Controller", priority=True),
        Binding("ctrl+o", "toggle_colours", "Colours", priority=True),
        Binding("ctrl+s", "save", "Save", priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, engine: Engine, options: ChatOptions | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.options = options or ChatOptions()
        self.conv = Conversation(system=self.options.system)
        self.finished: list[Any] = []  # Stats of every finished answer since the app started (the session)
        self.plain = PlainEstimate()
        self.current: AnswerView | None = None  # the answer streaming now (or the last one)
        self.generating = False
        self.colouring = False
        self.last_saved: Path | None = None
        self.status_text = ""
        self._stop_requested = False
        self._quitting = False
        self._busy_note = ""

    # --- layout ------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                with VerticalScroll(id="transcript"):
                    yield Static(WELCOME, id="welcome")
                yield Static("", id="status")
                yield Input(placeholder="Ask a coding question · Enter sends", id="prompt")
            yield SpeculationPanel(id="panel")
        yield Static("", id="too-small")
        yield Footer()

    interrupted = False  # a SIGINT came (run_app's handler sets it)
    screen_ready = False
    loop: asyncio.AbstractEventLoop | None = None  # the app's loop while it runs, for run_app's handler

    def on_load(self) -> None:
        self.loop = asyncio.get_running_loop()

    def on_ready(self) -> None:
        self.screen_ready = True
        self.end_if_interrupted()

    def end_if_interrupted(self) -> None:
        """End as a Ctrl-C would, once the screen is whole (ending mid-mount leaves a traceback)."""
        if self.interrupted and self.screen_ready:
            self._quitting = True
            self.engine.cancel()  # as action_quit: an answer being written stops after its round
            self.exit(return_code=130)

    def on_mount(self) -> None:
        self.query_one("#panel").border_title = "speculation"
        self._update_header()
        self._refresh_panel()
        self.set_status(self.engine.drafter_note or f"drafter: {self.engine.drafter.name}")
        self.query_one("#prompt", Input).focus()

    def on_resize(self, event: events.Resize) -> None:
        w, h = event.size
        self.query_one("#too-small", Static).update(
            f"The terminal is too small ({w}×{h}): eesd-chat needs at least {MIN_WIDTH}×{MIN_HEIGHT}.\n"
            "Enlarge the window; the conversation is kept."
        )
        if w >= MIN_WIDTH and h >= MIN_HEIGHT:
            # a terminal too small hid the input, which took its focus away: give it back once the input shows
            self.call_after_refresh(self._refocus)

    def _refocus(self) -> None:
        w, h = self.size
        if self.focused is None and w >= MIN_WIDTH and h >= MIN_HEIGHT:
            self.query_one("#prompt", Input).focus()

    def _update_header(self) -> None:
        model = self.options.model_name or Path(self.engine.model_path).name
        self.sub_title = f"{model} · drafter {self.engine.drafter.name} · controller {self.engine.controller.name}"

    def set_status(self, text: str, *, error: bool = False) -> None:
        self.status_text = text
        status = self.query_one("#status", Static)
        status.update(Text(text))
        status.set_class(error, "error")

    def _refresh_panel(self) -> None:
        answer = self.current.answer if self.current is not None else None
        live = [answer.stats] if answer is not None and not answer.final and answer.reason == "" else []
        self.query_one(SpeculationPanel).show(
            answer, merge_stats(self.finished + live), self.plain.tokens_per_s(),
            draft_max=self.engine.config.draft_max,
            controller=answer.controller if answer is not None else self.engine.controller.name,
            timings=self.options.timings, colouring=self.colouring,
        )

    # --- sending and streaming ---------------------------------------------

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if text.startswith("/"):
            event.input.clear()
            self._command(text)
            return
        if self.generating:
            self.set_status(self._busy_note)
            return
        event.input.clear()
        await self.send(text)

    async def send(self, text: str) -> None:
        """Start an answer to ``text`` as the next user turn."""
        self.conv.turns.append(Turn("user", text))
        try:
            prompt = self.engine.chat_tokens(self.conv.messages())  # what was typed stays text, control tokens too
        except EesdError as exc:
            self.conv.turns.pop()
            self.set_status(f"error: {exc.message}", error=True)
            return
        answer = Answer(drafter=self.engine.drafter.name, controller=self.engine.controller.name)
        view = AnswerView(answer)
        self.query_one("#welcome").display = False
        transcript = self.query_one("#transcript", VerticalScroll)
        await transcript.mount_all([UserView(text), view])
        transcript.scroll_end(animate=False)
        self.current = view
        self.generating = True
        self._busy_note = "an answer is still streaming: wait for it or press Esc to stop it"
        self._stop_requested = False
        self.set_status("answering… Esc stops")
        self._refresh_panel()
        self._generate(prompt, view)

    @work(thread=True, exclusive=True, group="answer")
    def _generate(self, prompt: list[int], view: AnswerView) -> None:
        o = self.options
        events_ = None
        try:
            events_ = self.engine.generate(prompt, max_tokens=o.max_tokens, temperature=o.temperature, top_p=o.top_p)
            for ev in events_:
                if self._stop_requested:
                    self.engine.cancel()  # also covers a stop pressed before the engine's loop began
                self._post(self._on_event, view, ev)
        except EesdError as exc:
            try:
                self._post(self._on_error, view, exc)
            except _AppGone:
                pass
        except _AppGone:
            pass
        except Exception:
            if not self._quitting:
                raise  # a bug: keep its traceback
        finally:
            if events_ is not None:
                events_.close()  # stops the engine's loop if we left early; its rollback runs

    def _post(self, callback: Any, *args: Any) -> None:
        if self._quitting or not self.is_running:
            raise _AppGone
        self.call_from_thread(callback, *args)

    async def _on_event(self, view: AnswerView, ev: Any) -> None:
        if self._quitting:
            return
        answer = view.answer
        transcript = self.query_one("#transcript", VerticalScroll)
        follow = transcript.scroll_y >= transcript.max_scroll_y - 1  # keep the end in view unless the user scrolled up
        if isinstance(ev, TokenEvent):
            answer.add_token(ev)
            await view.add_piece(ev.text)
        elif isinstance(ev, RoundEvent):
            answer.add_round(ev)
            self.plain.add(ev.drafted, ev.t_verify)
        elif isinstance(ev, FinishEvent):
            answer.finish(ev.reason, ev.stats, ev.text)
            await self._end_answer(view)
        if not isinstance(ev, FinishEvent):
            self._refresh_panel()
        if follow:
            transcript.scroll_end(animate=False)

    async def _on_error(self, view: AnswerView, exc: EesdError) -> None:
        if self._quitting:
            return
        answer = view.answer
        answer.error = exc.message
        answer.reason = answer.reason or "error"
        message = exc.message + (f" ({exc.hint})" if exc.hint else "")
        if not answer.pieces:
            self.conv.turns.pop()  # the user turn was never answered: do not send it again
        await self._end_answer(view, error=message)

    async def _end_answer(self, view: AnswerView, error: str | None = None) -> None:
        answer = view.answer
        s = answer.stats
        if answer.pieces or error is None:
            self.conv.turns.append(Turn("assistant", answer.text, answer))
        self.finished.append(s)
        note = f"{s.n_generated} tokens · drafted {s.n_drafted}, accepted {s.n_accepted} · tau {s.tau:.2f}"
        if self.options.timings and s.t_decode > 0:
            note += f" · {s.tokens_per_s:.1f} tok/s"
        context_full = answer.reason == "context"
        if error:
            note += f" · error: {error}"
            self.set_status(f"error: {error}", error=True)
        elif context_full:
            note += " · context full"
            self.set_status(f"the context is full ({self.engine.ctx.n_ctx} tokens): Ctrl+N starts a new chat, "
                            "or restart with a larger --n-ctx", error=True)
        elif answer.reason == "cancelled":
            note += " · stopped"
            self.set_status("stopped")
        else:
            self.set_status("ready" + (" (max tokens reached)" if answer.reason == "length" else ""))
        await view.finish(note)
        self.generating = False
        self._refresh_panel()

    # --- actions -----------------------------------------------------------

    def action_stop(self) -> None:
        if self.generating and self.current is not None and not self.current.answer.reason:
            self._stop_requested = True
            self.engine.cancel()
            self.set_status("stopping…")

    async def action_quit(self) -> None:
        self._quitting = True
        self.engine.cancel()  # the worker leaves after the current round; the process does not wait for the answer
        self.exit()

    async def action_new_chat(self) -> None:
        if self._busy("a new chat"):
            return
        await self.query(".turn").remove()
        self.query_one("#welcome").display = True
        self.conv = Conversation(system=self.options.system)
        self.current = None  # the session figures (all answers since the start) stay
        self._refresh_panel()
        self.set_status("new chat")

    def action_cycle_drafter(self) -> None:
        if self._busy("the drafter"):
            return
        self.generating = True  # no sends while a drafter loads
        self._busy_note = "the drafter is loading: one moment"
        self.set_status("switching the drafter…")
        self._switch_drafter()

    @work(thread=True, exclusive=True, group="drafter")
    def _switch_drafter(self) -> None:
        notes = []
        current = self.engine.drafter.name
        start = DRAFTER_CYCLE.index(current) + 1 if current in DRAFTER_CYCLE else 0
        for i in range(len(DRAFTER_CYCLE) - 1 if current in DRAFTER_CYCLE else len(DRAFTER_CYCLE)):
            kind = DRAFTER_CYCLE[(start + i) % len(DRAFTER_CYCLE)]
            try:
                notes.append(swap_drafter(self.engine, kind))
                break
            except EesdError as exc:
                notes.append(f"{kind} unavailable ({exc.message}): skipped")
        try:
            self._post(self._switched, "; ".join(notes))
        except _AppGone:
            pass

    def _switched(self, note: str) -> None:
        self.generating = False
        self._update_header()
        self._refresh_panel()
        self.set_status(note)

    def action_cycle_controller(self) -> None:
        if self._busy("the controller"):
            return
        current = self.engine.controller.name
        spec = CONTROLLER_CYCLE[(CONTROLLER_CYCLE.index(current) + 1) % len(CONTROLLER_CYCLE)] if current in CONTROLLER_CYCLE else CONTROLLER_CYCLE[0]
        swap_controller(self.engine, spec)
        self._update_header()
        self._refresh_panel()
        self.set_status(f"controller: {self.engine.controller.name}")

    def action_toggle_colours(self) -> None:
        self.colouring = not self.colouring
        self.screen.set_class(self.colouring, "colouring")
        self._refresh_panel()
        self.set_status("colouring tokens by provenance" if self.colouring else "Markdown view")

    def action_save(self, path: str | None = None) -> None:
        target = Path(path) if path else default_transcript_path(".md")
        try:
            self.last_saved = save_transcript(target, self.conv, self._transcript_meta())
        except EesdError as exc:
            self.set_status(f"error: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""), error=True)
            return
        self.set_status(f"saved the transcript to {self.last_saved}")

    def _command(self, text: str) -> None:
        name, _, arg = text.partition(" ")
        if name == "/save":
            self.action_save(arg.strip() or None)
        else:
            self.set_status(f"unknown command {name!r}: the only command is /save [PATH.md|PATH.jsonl]", error=True)

    def _busy(self, what: str) -> bool:
        if self.generating:
            self.set_status(f"{what} changes between answers: wait for this one or press Esc")
        return self.generating

    def _transcript_meta(self) -> dict[str, Any]:
        return {
            "model": self.options.model_name or Path(self.engine.model_path).name,
            "drafter": self.engine.drafter.name,
            "controller": self.engine.controller.name,
            "temperature": self.options.temperature,
            "top_p": self.options.top_p,
            "saved": time.strftime("%Y-%m-%d %H:%M:%S"),
        }


def swap_drafter(engine: Engine, kind: str) -> str:
    """Give ``engine`` a new drafter of ``kind`` on the same target; returns the drafter's note."""
    return engine.set_drafter(kind)


def swap_controller(engine: Engine, spec: str) -> None:
    engine.set_controller(spec)


# --- command line -------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # imported once main() handles Ctrl-C: the engine's flags pull in llama.cpp and numba, and a Ctrl-C
    # while they load must end in one line, not a traceback (as eesd's commands, imported by name in cli.py)
    from eesd_local.commands.options import add_engine_args  # noqa: PLC0415 - after keep_interrupts(), see above

    p = argparse.ArgumentParser(prog="eesd-chat", description="A terminal chat that shows speculative decoding live.",
                                epilog=CLAIM)
    add_engine_args(p, positional_model=True)
    p.set_defaults(cache_reuse="conversation")  # a chat goes on from its own turns: reuse them (engine.EngineConfig)
    p.add_argument("--temperature", "--temp", dest="temperature", type=float, default=TEMPERATURE,
                   help="temperature (0 = greedy, the default)")
    p.add_argument("--top-p", type=float, default=TOP_P, help="nucleus sampling mass (1: off)")
    p.add_argument("--system", help="system message")
    p.add_argument("--max-tokens", type=int, default=CHAT_MAX_TOKENS, help="most tokens per answer (default %(default)s)")
    return p


def open_engine(args: argparse.Namespace) -> Engine:
    """Pull a registry model if missing, check the options, load the engine (before the app starts)."""
    from eesd_local.api import load  # noqa: PLC0415 - after keep_interrupts(), as in build_parser
    from eesd_local.commands.options import engine_config  # noqa: PLC0415 - after keep_interrupts(), as in build_parser

    check_sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)  # as the engine will
    if args.n_ctx < 64:
        raise EesdError(f"--n-ctx must be at least 64 tokens, got {args.n_ctx}", hint="e.g. --n-ctx 4096")
    config = engine_config(args)
    print(f"eesd-chat: loading {args.model} …", file=sys.stderr)
    return load(**vars(config))


def main(argv: list[str] | None = None) -> int:
    keep_interrupts()  # a Ctrl-C inside a ctypes callback (numba compiling, llama.cpp logging) is not lost
    engine: Engine | None = None
    try:
        args = build_parser().parse_args(argv)  # imports llama.cpp and numba: Ctrl-C may land here
        engine = open_engine(args)
        options = ChatOptions(model_name=args.model if "/" not in args.model else Path(args.model).name,
                              system=args.system, temperature=args.temperature, top_p=args.top_p,
                              max_tokens=args.max_tokens)
        run_app(ChatApp(engine, options))  # building the app imports Textual's driver: Ctrl-C may land here too
    except EesdError as exc:
        print(f"eesd-chat: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        with contextlib.suppress(ValueError):  # ValueError: not the main thread
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while exiting must not print a traceback
        print("\neesd-chat: interrupted", file=sys.stderr)
        return 130
    finally:
        if engine is not None:
            engine.close()
    return 0


def run_app(app: ChatApp) -> None:
    """Run the chat; a SIGINT (``kill -INT``; in a terminal Ctrl-C is a key) ends it as its own quit does.

    While Textual runs, the handler never raises: a KeyboardInterrupt raised in the middle of Textual's start
    or of its shutdown can leave its loop or its input thread running (a chat that no signal ends). It marks
    the app interrupted and wakes the app's loop; the app exits once its screen is whole (``on_ready``).
    Raises KeyboardInterrupt after the app has ended if a SIGINT came.
    """

    def sigint(signum: int, frame: object) -> None:
        app.interrupted = True
        loop = app.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: app.run() is returning, it sees the flag
                loop.call_soon_threadsafe(app.end_if_interrupted)

    try:
        old = signal.signal(signal.SIGINT, sigint)
    except ValueError:  # not the main thread
        old = None
    try:
        app.run()
    finally:
        if old is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, old if signal.getsignal(signal.SIGINT) is sigint else signal.SIG_IGN)
    if app.interrupted or app.return_code == 130:
        raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
