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
from typing import Any

from eesd_local.llama.runtime import common_prefix

# A state is kept when at least SAVE_MIN_TOKENS cached tokens would otherwise be lost, and put back when it
# gives the prompt at least RESTORE_MIN_TOKENS more tokens than the cache does. Saving and restoring copy the
# KV, which costs far less than decoding the tokens again (the 0.5B: a 150-token state, 1.8 MB, saved in 2.3 ms
# and restored in 1.2 ms, 600 tokens in 8.7 and 3.0 ms, against 70-90 ms to decode 8 prompt tokens). With 32
# for both (until 2026-11-29) a short chat prompt never came back: its own part after the shared system prompt
# was 19-29 tokens, so it was prefilled again each time (0.12-0.17 s to llama-server's 0.03 s).
SAVE_MIN_TOKENS = 8
RESTORE_MIN_TOKENS = 4

# Fresh memory is what a save costs: this VM maps and zeroes new pages at about 0.5 ms a MB, ten times the copy into
# pages already mapped (the 1.5B, a 1562-token state of 45 MB: 23 ms to allocate a bytearray, 4.7 ms to write it; in
# a request's time to the first token 28 ms of 69). So a state's buffer is kept when the state goes (made redundant by
# a longer state of the same conversation, or least recently used) and the next state that fits takes it; a new
# buffer has SLACK more room than its state, so the next turn of the same conversation fits its last turn's buffer.
SLACK = 1.25


class PromptCache:
    """Saved KV states by the tokens they hold, within ``limit`` bytes (least recently used out first).

    The bytes counted are the buffers' (a state sits in a buffer at least its size), kept and free alike: the
    bound is on what the cache holds in RAM."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._states: OrderedDict[tuple[int, ...], tuple[memoryview, bytearray]] = OrderedDict()  # (state, its buffer)
        self._free: list[bytearray] = []  # buffers of states gone, for the next save
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._states

    def _drop(self, key: tuple[int, ...]) -> None:
        """The state of ``key`` goes; its buffer waits for the next save."""
        self._free.append(self._states.pop(key)[1])

    def _drop_prefixes(self, key: tuple[int, ...]) -> None:
        """The states that ``key``'s makes redundant (a prefix of it, itself included) go."""
        for other in [k for k in self._states if k == key[: len(k)]]:
            self._drop(other)

    def _make_room(self, extra: int) -> None:
        """Free buffers go, then the least recently used states, until ``extra`` more bytes fit the bound."""
        while self.bytes + extra > self.limit and (self._free or self._states):
            if self._free:
                self.bytes -= len(self._free.pop(0))
            else:
                self._drop(next(iter(self._states)))

    def _buffer(self, size: int) -> bytearray | None:
        """A writable buffer of at least ``size`` bytes: a free buffer that fits (not one more than twice as
        big), else a new one with SLACK room; None when even the state alone passes the bound."""
        fits = [b for b in self._free if size <= len(b) <= 2 * size]
        if fits:
            buf = min(fits, key=len)
            self._free.remove(buf)
            return buf
        cap = min(max(size, int(size * SLACK)), self.limit)
        if cap < size:
            return None
        self._make_room(cap)
        self.bytes += cap
        return bytearray(cap)

    def save(self, tokens: Sequence[int], ctx: Any) -> bool:
        """Save ``ctx``'s KV state (holding ``tokens``) into a kept or new buffer; states it makes redundant
        (a prefix of it) go first, their buffers free for it. False when the state alone passes the bound."""
        key = tuple(tokens)
        self._drop_prefixes(key)
        size = ctx.state_size()
        buf = self._buffer(size)
        if buf is None:
            return False
        view = memoryview(buf)[:size]
        try:
            ctx.save_state_into(view)
        except BaseException:
            view.release()
            self._free.append(buf)
            raise
        self._states[key] = (view, buf)
        return True

    def best(self, prompt: Sequence[int]) -> tuple[tuple[int, ...], memoryview, int] | None:
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
        return found, self._states[found][0], shared

    def pop(self, key: tuple[int, ...]) -> None:
        if key in self._states:
            self._drop(key)
