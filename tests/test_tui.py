"""eesd-chat: pilot tests (App.run_test) on the real demo model, and snapshots of a scripted answer.

A real model's greedy text differs between machines at near ties (AVX2 and AVX-512 kernels
round differently), so the real-model tests check invariants only: an answer appears, the
panel's figures match the answer's, tokens carry their provenance colours. The snapshots
drive the same app end to end with a :class:`ScriptedEngine` that replays a fixed event
stream, so they are the same on every x86-64 and arm64 machine (``timings=False`` hides the
wall-clock figures).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

import eesd_chat.app as chat_app
from eesd_chat.app import ChatApp, ChatOptions, main, run_app, swap_controller, swap_drafter
from eesd_chat.widgets import SOURCE_STYLE, AnswerView, SpeculationPanel, position_rows
from eesd_local.api import load
from eesd_local.speculative.events import TokenEvent
from eesd_local.tools import heads

from .conftest import QWEN05
from .scripted import ScriptedEngine

REWRITE = "Add type hints to: def add(a, b): return a + b"
# lookup drafts from the prompt and gets accepted (it offers only on a match of LOOKUP_MIN_MATCH tokens or more: a
# sentence copied whole has them from its fourth word on)
COPY = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank."
SIZE = (120, 40)
QUESTION = "Write a Python function that reverses a string, with a docstring and tests."


@pytest.fixture(scope="module")
def shared_engine(qwen05_path):
    eng = load(qwen05_path, drafter="lookup", controller="fixed:4")
    yield eng
    eng.close()


@pytest.fixture
def engine(shared_engine):
    """The module's engine, reset to lookup + a fresh fixed:4 controller and an empty cache."""
    if shared_engine.drafter.name != "lookup":
        swap_drafter(shared_engine, "lookup")
    swap_controller(shared_engine, "fixed:4")
    shared_engine.ctx.clear()
    return shared_engine


def make_app(engine, **kw) -> ChatApp:
    opts = dict(model_name=QWEN05, max_tokens=24, timings=False) | kw
    return ChatApp(engine, ChatOptions(**opts))


def drive(app: ChatApp, script, size=SIZE) -> None:
    async def run() -> None:
        async with app.run_test(size=size) as pilot:
            await script(pilot)

    asyncio.run(run())


async def wait_until(pilot, cond, timeout: float = 600.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out waiting for the app"
        await pilot.pause(0.05)
    await pilot.pause()


async def ask(pilot, text: str) -> None:
    app = pilot.app
    app.query_one("#prompt").value = text
    await pilot.press("enter")
    await wait_until(pilot, lambda: not app.generating)


def row(panel: str, name: str) -> list[str]:
    """The answer and session figures of one row of the panel's text."""
    line = next(line for line in panel.splitlines() if line.startswith(name + " "))
    return line[len(name):].split()


def status(app: ChatApp) -> str:
    return app.status_text


def provenance_styles(view: AnswerView) -> dict[str, str]:
    """Text piece -> style of the answer's provenance view (what Ctrl+O shows)."""
    text = view.query_one(".provenance").content
    return {text.plain[s.start:s.end]: str(s.style) for s in text.spans}


# --- pilot tests -----------------------------------------------------------------


def test_answer_streams_with_speculation_figures(engine, monkeypatch):
    app = make_app(engine)
    seen_live = []
    generate = engine.generate

    def watched(*args, **kw):
        # the app's worker posts each event with call_from_thread, which returns once the app has
        # handled it: when this generator resumes after a token, the screen shows that token
        n = 0
        for ev in generate(*args, **kw):
            yield ev
            n += isinstance(ev, TokenEvent)
            if n == 3 and not seen_live:
                seen_live.append((app.generating, app.query_one(SpeculationPanel).plain_text()))

    monkeypatch.setattr(engine, "generate", watched)

    async def script(pilot):
        app.query_one("#prompt").value = COPY
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.generating)
        seen_live.append(app.query_one(SpeculationPanel).plain_text())
        await pilot.press("ctrl+o")
        await pilot.pause()
        seen_live.append((app.screen.has_class("colouring"), provenance_styles(app.current)))

    drive(app, script)
    answer = app.current.answer
    streaming, live_panel = seen_live[0]
    assert streaming and int(row(live_panel, "tokens")[0]) >= 1
    # the text itself depends on the CPU's kernels at near ties: only its shape is checked
    assert answer.reason in ("length", "stop") and 0 < answer.stats.n_generated <= 24
    assert answer.reason == "stop" or answer.stats.n_generated == 24
    assert answer.stats.n_drafted > 0 and answer.stats.n_accepted > 0
    assert {s for _, s in answer.pieces} >= {"draft", "target"}
    panel, (coloured, styles) = seen_live[-2:]
    assert int(row(panel, "tokens")[0]) == answer.stats.n_generated
    assert int(row(panel, "drafted")[0]) == answer.stats.n_drafted > 0
    assert int(row(panel, "accepted")[0]) == answer.stats.n_accepted > 0
    assert "P(accept)" in panel and "90% CI" in panel and " 1 " in panel  # belief and acceptance by position
    # acceptance per drafting source, the latest round's marked
    for src, (_, drafted, accepted) in answer.stats.by_source.items():
        line = next(ln for ln in panel.splitlines() if ln.startswith(src[:8]))
        assert f"{accepted}/{drafted}" in line
    assert "◂" in next(ln for ln in panel.splitlines() if ln.startswith(answer.last_source[:8]))
    assert [t.role for t in app.conv.turns] == ["user", "assistant"]
    assert app.conv.turns[1].content == answer.text and answer.text.strip()
    # Ctrl+O: every piece in the colour of its source
    assert coloured and {SOURCE_STYLE[s] for _, s in answer.pieces if _.strip()} <= set(styles.values())


def test_stop_mid_answer_keeps_the_partial_answer(engine):
    app = make_app(engine, max_tokens=400)

    async def script(pilot):
        app.query_one("#prompt").value = "Write a long Python tutorial about decorators."
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.current is not None and len(app.current.answer.pieces) >= 3)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.generating)

    drive(app, script)
    answer = app.current.answer
    assert answer.reason == "cancelled" and 3 <= answer.stats.n_generated < 400
    assert status(app) == "stopped"
    assert app.conv.turns[-1].role == "assistant" and app.conv.turns[-1].content == answer.text
    # the rollback left the cache holding the emitted history only (all but the last token)
    assert engine.ctx.n_past <= answer.stats.n_prompt + answer.stats.n_generated


def test_cycle_drafter_and_controller_between_answers(engine):
    app = make_app(engine, max_tokens=6)
    eesd_available = heads.find_head(engine.model_path) is not None
    notes = []

    async def script(pilot):
        await pilot.press("ctrl+d")  # lookup -> none
        await wait_until(pilot, lambda: not app.generating)
        notes.append(status(app))
        assert engine.drafter.name == "none" and "drafter none" in app.sub_title
        await ask(pilot, "Say hi.")
        await pilot.press("ctrl+d")  # none -> eesd, or past it to lookup when no exit head is known
        await wait_until(pilot, lambda: not app.generating)
        notes.append(status(app))
        await pilot.press("ctrl+t")  # fixed:4 is not in the cycle: the first, cost-ts
        notes.append(status(app))

    drive(app, script)
    assert "none" in notes[0]
    plain = app.current.answer.stats
    assert plain.drafter == "none" and plain.n_drafted == 0 and plain.n_generated > 0
    if eesd_available:
        assert engine.drafter.name == "eesd"
    else:
        assert "eesd unavailable" in notes[1] and "skipped" in notes[1] and engine.drafter.name == "lookup"
    assert engine.controller.name == "cost-ts" and "cost-ts" in notes[2] and "controller cost-ts" in app.sub_title


def test_two_turns_save_transcript_and_new_chat(engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(engine, max_tokens=8, system="You are terse.")
    target = tmp_path / "out" / "chat.jsonl"
    shown = []
    prompts = []
    real_template = engine.apply_chat_template

    def spy(messages, **kw):
        prompts.append([dict(m) for m in messages])
        return real_template(messages, **kw)

    monkeypatch.setattr(engine, "apply_chat_template", spy)

    async def script(pilot):
        await ask(pilot, REWRITE)
        await ask(pilot, "Now without the return type.")
        await pilot.press("ctrl+s")
        shown.append(status(app))
        app.query_one("#prompt").value = f"/save {target}"
        await pilot.press("enter")
        shown.append(status(app))
        await pilot.press("ctrl+n")
        await pilot.pause()
        shown.append((len(app.query(".turn")), app.query_one("#welcome").display, len(app.conv.turns)))

    drive(app, script)
    # the second turn re-rendered the whole conversation through the chat template
    assert [m["role"] for m in prompts[1]] == ["system", "user", "assistant", "user"]
    md_files = list(tmp_path.glob("eesd-chat-*.md"))
    assert len(md_files) == 1 and str(md_files[0]) in shown[0]
    md = md_files[0].read_text()
    assert REWRITE in md and "Now without the return type." in md and md.count("## assistant") == 2 and "You are terse." in md
    assert str(target) in shown[1] and not list(target.parent.glob(".*tmp*"))
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert rows[0]["type"] == "meta" and rows[0]["model"] == QWEN05
    assert [r["role"] for r in rows[1:]] == ["system", "user", "assistant", "user", "assistant"]
    assert rows[1]["content"] == "You are terse." and rows[2]["content"] == REWRITE
    for row in (rows[3], rows[5]):
        assert 0 < row["speculation"]["n_generated"] <= 8 and row["speculation"]["drafter"] == "lookup"
        assert "".join(t for t, _ in row["provenance"]) == row["content"] and row["content"]
    assert rows[3]["content"] in md and rows[5]["content"] in md
    assert shown[2] == (0, True, 0)  # ctrl+n: an empty chat


def test_context_full_mid_answer_keeps_the_transcript(qwen05_path):
    eng = load(qwen05_path, drafter="lookup", controller="fixed:4", n_ctx=256)
    try:
        n_ctx = eng.ctx.n_ctx
        # a system prompt that leaves ~16 tokens of room for the answer
        filler = " ".join(["lorem"] * 400)
        head = eng.tokenize(eng.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": QUESTION}]))
        words = filler.split()[: max(1, n_ctx - len(head) - 16)]
        system = " ".join(words)
        while len(eng.tokenize(eng.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]))) > n_ctx - 16:
            words.pop()
            system = " ".join(words)
        app = ChatApp(eng, ChatOptions(model_name=QWEN05, system=system, max_tokens=200, timings=False))
        notes = []

        async def script(pilot):
            await ask(pilot, QUESTION)
            notes.append(status(app))
            await ask(pilot, "and now a second question")
            notes.append(status(app))
            notes.append(len(app.query(".turn")))

        drive(app, script)
    finally:
        eng.close()
    first = app.conv.turns[1].answer
    assert first.reason == "context" and 0 < first.stats.n_generated < 200
    assert "context is full" in notes[0]
    assert notes[1].startswith("error:") and "context" in notes[1]
    assert [t.role for t in app.conv.turns] == ["user", "assistant"]  # the unanswered turn is not kept for sending
    assert notes[2] == 4  # ... but the screen keeps everything said so far


def test_terminal_too_small_shows_a_message(engine):
    app = make_app(engine)
    seen = {}

    async def script(pilot):
        seen["small"] = (app.query_one("#too-small").display, app.query_one("#main").display,
                         str(app.query_one("#too-small").render()))
        await pilot.resize_terminal(*SIZE)
        await pilot.pause()
        seen["big"] = (app.query_one("#too-small").display, app.query_one("#main").display)

    drive(app, script, size=(50, 12))
    small_shown, main_shown, message = seen["small"]
    assert small_shown and not main_shown and "too small" in message and "50×12" in message
    assert seen["big"] == (False, True)


def fake_head_for_another_model(path):
    """A head file's metadata (no trained weights) claiming another base model."""
    w = gguf.GGUFWriter(str(path), "eesd-head")
    w.add_uint32("eesd.head.format", 1)
    w.add_string("eesd.head.base_arch", "gemma3")
    w.add_string("eesd.head.base_name", "gemma-3-270m")
    w.add_string("eesd.head.base_fingerprint", "0123456789abcdef01234567")
    w.add_uint32("eesd.head.base_n_layer", 18)
    w.add_uint32("eesd.head.exit_layer", 4)
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_input_before_the_app_starts(tmp_path, capsys, qwen05_path):
    assert main([str(tmp_path / "missing.gguf")]) == 2
    assert "model file not found" in capsys.readouterr().err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    assert main([str(junk)]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err
    assert main(["no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main([str(qwen05_path), "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err
    head = fake_head_for_another_model(tmp_path / "other.head.gguf")
    assert main([str(qwen05_path), "--drafter", "eesd", "--head", str(head)]) == 2
    err = capsys.readouterr().err
    assert "was made for 'gemma-3-270m'" in err and "hint:" in err and "Traceback" not in err


# --- snapshots (a scripted answer: the same screen on every machine) ----------------


def scripted_app(**kw) -> tuple[ChatApp, ScriptedEngine]:
    engine = ScriptedEngine()
    return make_app(engine, **{"max_tokens": 64} | kw), engine


async def still_cursor(pilot) -> None:
    pilot.app.query_one("#prompt").cursor_blink = False  # a blinking cursor would be caught in either phase
    await pilot.pause()


def test_scripted_answer_goes_through_the_apps_event_path():
    app, engine = scripted_app()
    seen = {}

    async def script(pilot):
        await ask(pilot, REWRITE)
        seen["panel"] = app.query_one(SpeculationPanel).plain_text()

    drive(app, script)
    answer = app.current.answer
    rounds = engine.script
    assert answer.text == engine.text and answer.reason == "stop"
    assert [s for _, s in answer.pieces] == [s for _, pieces in rounds for _, s in pieces]
    drafted = sum(d for d, _ in rounds)
    accepted = sum(s == "draft" for _, pieces in rounds for _, s in pieces)
    assert row(seen["panel"], "tokens") == [str(len(answer.pieces))] * 2
    assert row(seen["panel"], "rounds") == [str(len(rounds))] * 2
    assert row(seen["panel"], "drafted") == [str(drafted)] * 2 and row(seen["panel"], "accepted") == [str(accepted)] * 2
    assert "P(accept) 0.80" in seen["panel"]
    assert engine.prompts == [engine.chat_tokens([{"role": "user", "content": REWRITE}])]
    assert app.conv.turns[-1].content == engine.text and status(app) == "ready"


def test_scripted_stop_mid_answer():
    app, engine = scripted_app()
    engine.hold_after = 3

    async def script(pilot):
        app.query_one("#prompt").value = COPY
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.current is not None and len(app.current.answer.pieces) >= 3)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.generating)

    drive(app, script)
    answer = app.current.answer
    assert answer.reason == "cancelled" and 3 <= answer.stats.n_generated < len(engine.text)
    assert status(app) == "stopped" and app.conv.turns[-1].content == answer.text


class Interrupted(ChatApp):
    """The chat, headless, that sends itself a SIGINT at one moment of its life (``when``)."""

    when = "mount"
    CSS_PATH = str(Path(chat_app.__file__).with_name("chat.tcss"))  # Textual reads it beside the subclass's file

    def run(self, **kw):
        return super().run(headless=True, size=SIZE)

    def on_mount(self) -> None:
        super().on_mount()
        if self.when == "mount":  # Textual is still building the screen
            signal.raise_signal(signal.SIGINT)

    def on_ready(self) -> None:
        super().on_ready()
        if self.when == "ready":  # the chat sits idle, its screen whole
            self.set_timer(0.05, lambda: signal.raise_signal(signal.SIGINT))


@pytest.mark.parametrize("when", ["mount", "ready"])
@pytest.mark.model
def test_a_sigint_ends_the_chat_wherever_it_lands(when):
    """run_app's handler never raises inside Textual (a KeyboardInterrupt in its start or shutdown could leave
    a chat that no signal ends, as CI once saw): the app ends once its screen is whole, then run_app raises."""
    engine = ScriptedEngine()
    app = Interrupted(engine, ChatOptions(model_name=QWEN05, timings=False))
    app.when = when
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        run_app(app)
    assert app.interrupted and app.screen_ready and app.return_code == 130 and engine._cancel.is_set()
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_snapshot_idle(snap_compare):
    assert snap_compare(scripted_app()[0], terminal_size=SIZE, run_before=still_cursor)


def test_snapshot_finished_answer_coloured(snap_compare):
    async def run_before(pilot):
        await still_cursor(pilot)
        await ask(pilot, REWRITE)
        await pilot.press("ctrl+o")
        await pilot.pause()

    assert snap_compare(scripted_app()[0], terminal_size=SIZE, run_before=run_before)


def test_acceptance_by_position_pools_long_drafts_into_ranges():
    """Positions 1 to 8 one by one, then 9-16, 17-32, 33-64 pooled (a 64-token draft fits the panel)."""
    drafted = [10] * 8 + [4] * 8 + [2] * 16 + [1] * 32
    accepted = [9] * 8 + [3] * 8 + [1] * 16 + [0] * 32
    rows = position_rows(drafted, accepted)
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5", "6", "7", "8", "9-16", "17-32", "33-64"]
    assert rows[8] == ("9-16", 24, 32) and rows[-1] == ("33-64", 0, 32)
    assert position_rows([3, 0], [2, 0]) == [("1", 2, 3)]  # a position never drafted is left out
