"""eesd-local: lossless speculative decoding on llama.cpp.

    import eesd_local
    with eesd_local.load("qwen2.5-coder-0.5b-instruct", drafter="lookup") as llm:
        out = llm.create_chat_completion([{"role": "user", "content": "Reverse a string in Python"}])
        print(out["choices"][0]["message"]["content"], out["speculation"]["tau"])
"""

from __future__ import annotations

__all__ = ["EesdError", "load", "LLM", "Engine", "EngineConfig"]

# The package imports nothing when it is imported: the console scripts (eesd_local.startup) import it
# before their Ctrl-C handler is in place. (A local TYPE_CHECKING: typing itself is not loaded yet.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from eesd_local.api import LLM, load
    from eesd_local.base.errors import EesdError
    from eesd_local.speculative.engine import Engine, EngineConfig


def __getattr__(name: str) -> Any:
    # PEP 562: `import eesd_local` stays light; the engine (llama.cpp, numba) loads when asked for
    if name == "EesdError":
        from eesd_local.base import errors  # noqa: PLC0415 - lazy, as below

        return errors.EesdError
    if name in ("load", "LLM"):
        from eesd_local import api  # noqa: PLC0415 - lazy public API: llama.cpp and numba load on first use

        return getattr(api, name)
    if name in ("Engine", "EngineConfig"):
        from eesd_local.speculative import engine  # noqa: PLC0415 - lazy public API, as above

        return getattr(engine, name)
    raise AttributeError(name)
