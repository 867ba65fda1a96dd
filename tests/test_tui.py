"""eesd-chat: pilot tests (App.run_test) and layout snapshots, on the real demo model.

Answers are greedy and short. The lookup drafter with the fixed:4 controller makes every
figure on screen a function of the tokens alone (no timing decides a draft length), so
with ``timings=False`` (no wall-clock figures drawn) the snapshots are deterministic.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from eesd_chat.app import ChatApp, ChatOptions, main, swap_controller, swap_drafter
from eesd_chat.widgets import SpeculationPanel

from eesd_local import heads
from eesd_local.engine import load
from tests.conftest import QWEN05

REWRITE = "Add type hints to: def add(a, b): return a + b"  # lookup drafts from the prompt and gets accepted
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


def status(app: ChatApp) -> str:
    return app.status_text


# --- pilot tests -----------------------------------------------------------------


def test_answer_streams_with_speculation_figures(engine):
    app = make_app(engine)
    seen_live = []

    async def script(pilot):
        app.query_one("#prompt").value = REWRITE
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.current is not None and app.current.answer.pieces)
        seen_live.append(len(app.current.answer.pieces))  # tokens arrive while the answer streams
        await wait_until(pilot, lambda: not app.generating)
        seen_live.append(app.query_one(SpeculationPanel).plain_text())

    drive(app, script)
    answer = app.current.answer
    assert seen_live and answer.reason == "length" and answer.stats.n_generated == 24
    assert answer.stats.n_drafted > 0 and answer.stats.n_accepted > 0
    assert {s for _, s in answer.pieces} >= {"draft", "target"}
    panel = seen_live[-1]
    drafted = next(line for line in panel.splitlines() if line.startswith("drafted")).split()
    accepted = next(line for line in panel.splitlines() if line.startswith("accepted")).split()
    assert int(drafted[1]) == answer.stats.n_drafted > 0 and int(accepted[1]) == answer.stats.n_accepted > 0
    assert "P(accept)" in panel and "90% CI" in panel and " 1 " in panel  # belief and acceptance by position
    assert [t.role for t in app.conv.turns] == ["user", "assistant"]
    assert app.conv.turns[1].content == answer.text and "def add" in answer.text


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


def test_save_transcript_markdown_and_jsonl(engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = make_app(engine, max_tokens=8, system="You are terse.")
    target = tmp_path / "out" / "chat.jsonl"
    shown = []

    async def script(pilot):
        await ask(pilot, REWRITE)
        await pilot.press("ctrl+s")
        shown.append(status(app))
        app.query_one("#prompt").value = f"/save {target}"
        await pilot.press("enter")
        shown.append(status(app))

    drive(app, script)
    answer = app.current.answer
    md_files = list(tmp_path.glob("eesd-chat-*.md"))
    assert len(md_files) == 1 and str(md_files[0]) in shown[0]
    md = md_files[0].read_text()
    assert REWRITE in md and answer.text.strip() in md and "## assistant" in md and "You are terse." in md
    assert str(target) in shown[1] and not list(target.parent.glob(".*tmp*"))
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert rows[0]["type"] == "meta" and rows[0]["model"] == QWEN05
    msgs = [(r["role"], r["content"]) for r in rows[1:]]
    assert msgs == [("system", "You are terse."), ("user", REWRITE), ("assistant", answer.text)]
    spec = rows[-1]["speculation"]
    assert spec["n_generated"] == 8 and spec["drafter"] == "lookup"
    assert "".join(t for t, _ in rows[-1]["provenance"]) == answer.text


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
    assert first.reason == "length" and 0 < first.stats.n_generated < 200
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


def test_bad_input_before_the_app_starts(tmp_path, capsys, qwen05_path, gemma_path):
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
    assert main([str(qwen05_path), "--drafter", "eesd", "--head", str(gemma_path)]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


# --- snapshots -------------------------------------------------------------------


async def still_cursor(pilot) -> None:
    pilot.app.query_one("#prompt").cursor_blink = False  # a blinking cursor would be caught in either phase
    await pilot.pause()


def test_snapshot_idle(engine, snap_compare):
    assert snap_compare(make_app(engine), terminal_size=SIZE, run_before=still_cursor)


def test_snapshot_finished_answer_coloured(engine, snap_compare):
    async def run_before(pilot):
        await still_cursor(pilot)
        await ask(pilot, REWRITE)
        await pilot.press("ctrl+o")
        await pilot.pause()

    assert snap_compare(make_app(engine), terminal_size=SIZE, run_before=run_before)
