"""What the engine yields: token events, round events, and a final summary.

One stream feeds the TUI, the Python API, the CLI and the bench alike.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# where an emitted token came from
Source = Literal["draft", "target", "bonus"]


@dataclass(slots=True)
class TokenEvent:
    token: int
    text: str  # the decoded piece; "" while a multi-byte character is incomplete
    source: Source  # draft: accepted draft; target: the target's correction; bonus: all drafts accepted
    round: int


@dataclass(slots=True)
class RoundEvent:
    index: int
    drafted: int
    accepted: int
    emitted: int
    t_draft: float  # seconds spent drafting this round
    t_verify: float  # seconds of the target's batched decode
    belief: dict[str, float] = field(default_factory=dict)  # the controller's state after the round
    source: str = ""  # the source that drafted (lookup, eesd, draft-model, ...); "" when nothing was drafted
    rows: int = 0  # tokens in the target's verify batch: drafted + 1, or drafted for a probe without the bonus (0: unknown)


@dataclass
class Stats:
    n_prompt: int = 0
    n_cached: int = 0  # prompt tokens taken from the KV cache (an earlier prompt's or answer's), not decoded again
    n_generated: int = 0
    n_rounds: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_emitted: int = 0  # tokens the rounds emitted: accepted + 1 each, except a probe that ends on its draft
    t_prefill: float = 0.0
    t_decode: float = 0.0  # wall time after the prefill until the last token
    t_draft: float = 0.0
    t_verify: float = 0.0
    drafted_at: list[int] = field(default_factory=list)  # drafts made at position i of a round
    accepted_at: list[int] = field(default_factory=list)  # of those, accepted
    draft_lengths: list[int] = field(default_factory=list)  # per round
    drafter: str = ""
    controller: str = ""
    exact: bool = False  # greedy output is byte-identical to plain decoding on this engine (runtime.exactness)
    # per drafting source (lookup, eesd, draft-model, ...): [rounds it drafted, tokens drafted, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def record_round(self, drafted: int, accepted: int, emitted: int | None = None, source: str = "") -> None:
        """Count one round: ``drafted`` tokens proposed (by ``source``), the first ``accepted`` of them kept."""
        if drafted:
            c = self.by_source.setdefault(source or self.drafter or "?", [0, 0, 0])
            c[0] += 1
            c[1] += drafted
            c[2] += accepted
        self.n_rounds += 1
        self.n_emitted += accepted + 1 if emitted is None else emitted
        self.n_drafted += drafted
        self.n_accepted += accepted
        self.draft_lengths.append(drafted)
        self._grow(drafted)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < accepted)

    def add(self, other: Stats) -> None:
        """Add another generation's figures to these (a session's, a bench method's)."""
        for f in ("n_prompt", "n_cached", "n_generated", "n_rounds", "n_drafted", "n_accepted", "n_emitted",
                  "t_prefill", "t_decode", "t_draft", "t_verify"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.draft_lengths += other.draft_lengths
        for src, (r, d, a) in other.by_source.items():
            c = self.by_source.setdefault(src, [0, 0, 0])
            c[0] += r
            c[1] += d
            c[2] += a
        self._grow(len(other.drafted_at))
        for i, (d, a) in enumerate(zip(other.drafted_at, other.accepted_at, strict=True)):
            self.drafted_at[i] += d
            self.accepted_at[i] += a

    def _grow(self, n: int) -> None:
        while len(self.drafted_at) < n:
            self.drafted_at.append(0)
            self.accepted_at.append(0)

    @property
    def tokens_per_s(self) -> float:
        return self.n_generated / self.t_decode if self.t_decode > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target verification (per round)."""
        return self.n_emitted / self.n_rounds if self.n_rounds else 0.0

    @property
    def mean_draft_length(self) -> float:
        return self.n_drafted / self.n_rounds if self.n_rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def source_summary(self) -> str:
        """Per drafting source: rounds, drafted, accepted (acceptance); "" when nothing was drafted."""
        parts = [f"{src} {r} rounds, drafted {d}, accepted {a} ({100 * a / d:.0f}%)"
                 for src, (r, d, a) in sorted(self.by_source.items(), key=lambda kv: -kv[1][1]) if d]
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("draft_lengths")
        d.update(
            tokens_per_s=self.tokens_per_s,
            acceptance_rate=self.acceptance_rate,
            tau=self.tau,
            mean_draft_length=self.mean_draft_length,
            acceptance_by_position=self.acceptance_by_position,
        )
        return d

    def summary(self) -> str:
        return (
            f"{self.n_generated} tokens in {self.t_decode:.2f}s ({self.tokens_per_s:.1f} tok/s), "
            f"prefill {self.n_prompt} tokens in {self.t_prefill:.2f}s | drafter {self.drafter}, controller {self.controller}: "
            f"drafted {self.n_drafted}, accepted {self.n_accepted} ({100 * self.acceptance_rate:.0f}%), "
            f"tau {self.tau:.2f}, mean draft {self.mean_draft_length:.2f}"
        )


@dataclass(slots=True)
class FinishEvent:
    # stop: end of generation or a stop string; length: max_tokens; context: the context is full; cancelled
    reason: Literal["stop", "length", "context", "cancelled"]
    stats: Stats
    text: str = ""


Event = TokenEvent | RoundEvent | FinishEvent
