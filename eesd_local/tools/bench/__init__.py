"""``eesd bench``: side-by-side speed, acceptance and losslessness of every method.

    prompts.py  JSONL prompt files and the built-in sets (code, chat, rewrite)
    methods.py  each method behind one interface: our engine per drafter, llama-cpp-python peers
    runner.py   load and warm up, the interleaved loop, near-tie certification, Ctrl-C
    report.py   figures per method and category, the JSON, the tables
    plots.py    PNGs with matplotlib
"""

from __future__ import annotations

from eesd_local.tools.bench.prompts import BUILTIN_SETS, PromptItem, load_prompts
from eesd_local.tools.bench.report import REQUIRED_KEYS, summarize, to_json
from eesd_local.tools.bench.runner import BenchConfig, Results, run_bench

__all__ = ["BUILTIN_SETS", "REQUIRED_KEYS", "BenchConfig", "PromptItem", "Results", "load_prompts", "run_bench", "summarize",
           "to_json"]
