"""``eesd bench``: side-by-side speed, acceptance and losslessness of every method.

    prompts.py  JSONL prompt files and the built-in sets (code, chat, rewrite, edits, rework, agent)
    methods.py  each method behind one interface: our engine per drafter, llama-cpp-python peers
    runner.py   load and warm up, the interleaved loop, near-tie certification, Ctrl-C
    report.py   figures per method and category, the JSON, the tables
    plots.py    PNGs with matplotlib

Import the module you need (``eesd_local.tools.bench.prompts`` and so on): the package itself imports
nothing, so reading the built-in prompt sets (`eesd models`) does not load the runner and the engine.
"""
