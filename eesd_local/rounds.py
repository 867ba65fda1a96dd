"""The round contract: what a round loop is, what a round returns, and the rules both loops share.

A round: the controller decides how far to draft, the drafter proposes d1..dk, the target
decodes [last, d1..dk] in ONE llama_decode, the accepted prefix plus one target token is
emitted, and the target's KV cache is trimmed past it. :class:`PythonRounds` is the
reference implementation; the native loop (``native_round.NativeRounds``) must give the
same events for every drafter and is tested against it.
"""

from __future__ import annotations


def round_limit(draft_max: int, left: int, room: int) -> int:
    """Most tokens a round may draft: a round emits up to k + 1 tokens, so k <= left - 1
    (tokens still wanted) and k <= room - 1 (free KV positions after `last`), and never
    more than ``draft_max``. The C++ loop applies the same rule (tested against this one)."""
    return max(0, min(draft_max, left - 1, room - 1))
