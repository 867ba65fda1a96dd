"""Turn `pip install -v` output of a CMake build into a short progress display.

Prints one line per 5% of [n/N] compiler steps plus pip's own result lines, so a
six-minute build shows it is moving without flooding the terminal.
"""

from __future__ import annotations

import re
import sys

STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]")
KEEP = ("Successfully", "ERROR", "error:", "Building wheel", "Collecting", "Requirement already")


def main() -> int:
    last_pct = -5
    tail: list[str] = []
    for line in sys.stdin:
        tail = (tail + [line])[-40:]
        m = STEP.match(line)
        if m:
            done, total = int(m.group(1)), int(m.group(2))
            pct = 100 * done // total
            if pct >= last_pct + 5 or done == total:
                last_pct = pct
                print(f"  compiling llama.cpp: {done}/{total} ({pct}%)", flush=True)
        elif line.lstrip().startswith(KEEP):
            print("  " + line.strip()[:160], flush=True)
    if not any("Successfully installed" in t for t in tail):
        sys.stdout.writelines(tail)  # show why it failed
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
