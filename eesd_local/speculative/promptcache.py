"""Idle prompts' KV states in RAM (llama-server's ``--cache-ram``), so that a request that continues
another conversation than the last one pays only for its new tokens.

When a new prompt would drop a long stretch of what the target's cache holds (another conversation
comes in), that state is saved here first; when a prompt shares more with a saved state than with
the cache, the state is put back before the prefill. Least recently used states go first once the
states' bytes pass the bound. A restored state is the bytes that were computed, so with the
batch-invariant kernels an answer from it is a fresh process's (tests/test_prompt_reuse.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from eesd_local.llama.runtime import common_prefix

# A state is kept when at least SAVE_MIN_TOKENS cached tokens would otherwise be lost, and put back when it
# gives the prompt at least RESTORE_MIN_TOKENS more tokens than the cache does. Saving and restoring copy the
# KV, which costs far less than decoding the tokens again (the 0.5B: a 150-token state, 1.8 MB, saved in 2.3 ms
# and restored in 1.2 ms, 600 tokens in 8.7 and 3.0 ms, against 70-90 ms to decode 8 prompt tokens). With 32
# for both (until 2026-11-29) a short chat prompt never came back: its own part after the shared system prompt
# was 19-29 tokens, so it was prefilled again each time (0.12-0.17 s to llama-server's 0.03 s).
SAVE_MIN_TOKENS = 8
RESTORE_MIN_TOKENS = 4


class PromptCache:
    """Saved KV states by the tokens they hold, within ``limit`` bytes (least recently used out first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._states: OrderedDict[tuple[int, ...], bytes | bytearray] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._states)

    def put(self, tokens: Sequence[int], state: bytes | bytearray) -> None:
        """Keep ``state`` (holding ``tokens``); states it makes redundant (a prefix of it) go."""
        key = tuple(tokens)
        if len(state) > self.limit:
            return
        for other in [k for k in self._states if k == key[: len(k)]]:
            self.bytes -= len(self._states.pop(other))
        self._states[key] = state
        self.bytes += len(state)
        while self.bytes > self.limit:
            _, old = self._states.popitem(last=False)
            self.bytes -= len(old)

    def best(self, prompt: Sequence[int]) -> tuple[tuple[int, ...], bytes | bytearray, int] | None:
        """The saved state that shares the longest prefix with ``prompt``: (its tokens, the state, how many
        tokens they share), marked as just used; None when none shares any."""
        found, shared = None, 0
        for key in self._states:
            n = common_prefix(key, prompt)
            if n > shared:
                found, shared = key, n
        if found is None:
            return None
        self._states.move_to_end(found)
        return found, self._states[found], shared

    def pop(self, key: tuple[int, ...]) -> None:
        state = self._states.pop(key, None)
        if state is not None:
            self.bytes -= len(state)
