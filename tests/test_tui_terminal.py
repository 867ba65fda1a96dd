"""eesd-chat in a real terminal: tmux runs the console script, keys go in, capture-pane reads the screen."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (scripts/setup.sh installs it)")

PROMPT = "Add type hints to: def add(a, b): return a + b"


class Tmux:
    """One tmux server on a private socket, so the test never touches the user's sessions."""

    def __init__(self, name: str) -> None:
        self.socket = name

    def __call__(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30)
        return out.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "chat")

    def wait_for(self, text: str, timeout: float = 600.0) -> str:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared; the screen was:\n{self.screen()}")


def test_eesd_chat_in_tmux(qwen05_path, tmp_path):
    exe = Path(sys.executable).parent / "eesd-chat"
    done = tmp_path / "exit-code"
    # Textual draws on stderr, so nothing is redirected: what the app leaves behind stays in the pane;
    # COLUMNS/LINES (set by some test runners) would override the pane's size
    command = f"env -u COLUMNS -u LINES {exe} {qwen05_path} --drafter lookup --controller fixed:4 --max-tokens 400; echo $? > {done}; sleep 60"
    tmux = Tmux(f"eesd-chat-test-{os.getpid()}")
    tmux("new-session", "-d", "-s", "chat", "-x", "120", "-y", "40", command)
    try:
        tmux.wait_for("Ask a coding question", timeout=120)
        tmux("send-keys", "-t", "chat", "-l", PROMPT)
        tmux("send-keys", "-t", "chat", "Enter")
        screen = tmux.wait_for(" tokens · drafted")  # the answer's summary line: it has finished
        print("\n" + screen)
        # the answer's text depends on the CPU's kernels at near ties: check that one appeared, not what it says
        left = [line.split("│")[0] for line in screen.splitlines()]  # the transcript column, without the panel
        head = next(i for i, line in enumerate(left) if "assistant · lookup / fixed:4" in line)
        end = next(i for i, line in enumerate(left) if " tokens · drafted" in line)
        assert PROMPT in screen and head < end and any(line.strip() for line in left[head + 1:end])
        rows: dict[str, list[str]] = {}
        for line in screen.splitlines():  # the panel's rows, first one of each label ("drafted", then "drafted by source")
            cells = line.split("│")[-2].split() if line.count("│") >= 2 else []
            if cells:
                rows.setdefault(cells[0], cells[1:])
        assert int(rows["drafted"][0]) > 0 and int(rows["accepted"][0]) > 0
        assert "P(accept)" in screen and "draft length per round" in screen and "ready" in screen

        # quitting during an answer exits at once, without a traceback
        tmux("send-keys", "-t", "chat", "-l", "Write a long tutorial about Python decorators.")
        tmux("send-keys", "-t", "chat", "Enter")
        tmux.wait_for("answering")
        tmux("send-keys", "-t", "chat", "C-q")
        # it quits mid-answer: the status never goes back to "ready" (the answer finished) before the chat is gone
        finished = False
        for _ in range(600):  # 30 s at most
            if done.exists():
                break
            finished = finished or "answering" not in (screen := tmux.screen()) and "ready" in screen
            time.sleep(0.05)
        assert done.exists(), "eesd-chat did not exit after ctrl+q"
        assert not finished, "the chat finished the answer before it quit"
        assert done.read_text().strip() == "0"
        time.sleep(0.3)
        after = tmux.screen()
        assert "Traceback" not in after and "Error" not in after
    finally:
        tmux("kill-server")
