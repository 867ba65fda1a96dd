"""The fields of a controller's float64 state array, defined once.

Header (every controller): kind, limits, RNG words, running statistics, and what the round loop
tells the controller before a round. Then the kind's own fields. A Thompson-sampling state appends
fields sized by max_draft K: per-position Beta posteriors, verify-time means and estimates per
batch size b = 1..K+1, and the per-position acceptance chances of the current round's plan. A
multi-source state holds, after its header, one whole Thompson state per source.

The records below (:class:`Record`, a list of :class:`Field`) are the only place where a field's
position is decided: every offset is generated from them, in order, with no gaps. Two views:

- kernels (Numba) index the array through the generated offsets: ``state[TS.rule]``; a field whose
  offset grows with K holds a :class:`Lin`, read with :func:`at`: ``state[at(TS.verify, k)]``; a
  field made of records is indexed by element and the record's own offsets:
  ``state[TS.pos + TR.size * i + TR.beta]``. The offsets are global namedtuples of ints, which Numba
  compiles as constants (the same machine code as numbers written in place).
- Python reads fields by name through a structured dtype: ``fields(state)["pos"]["alpha"]`` (a view:
  writing a field writes the state).

The native round loop reads and writes a few header fields at the offsets :func:`loop_slots` gives it.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any, NamedTuple

import numpy as np

from eesd_local.speculative.controllers.jitcache import kernel
from eesd_local.speculative.controllers.rng import RNG_WORDS

# controller kinds (the header's ``kind``)
FIXED = 1
PMIN = 2
HEURISTIC = 3
THOMPSON = 4
MULTI = 5  # several sources (lookup, a draft model), each with a Thompson state of its own: see multi.py

# the sources of a drafter, as the header's ``source`` numbers them
SRC_ANY = -2  # the controller does not choose (one source, or a baseline rule): the drafter's own default
SRC_NONE = -1  # nothing is drafted this round
SRC_LOOKUP = 0
SRC_MODEL = 1

N_BINS = 10  # confidence bins of a Thompson state
# learning in hindsight: one class per match length from 1 to 9, then 10-15, 16-23, 24-31, 32-47, 48-63, 64
# and more (the lower bounds; thompson.match_class): what a long match does is learned at its own length
MATCH_EDGES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 24, 32, 48, 64)
N_MATCH = len(MATCH_EDGES)
MAX_SRC = 2  # sources a multi-source state holds at most


class Lin(NamedTuple):
    """An offset or a size that grows with K = max_draft: base + per_k * K (see :func:`at`)."""

    base: int
    per_k: int


class Field(NamedTuple):
    """One field of a record: ``n`` elements plus ``per_k`` more per K (a field sized by max_draft),
    or, with ``per_source``, one element per source (the multi-source state's last field). An element is
    one float64, or a record ``of`` its own fields."""

    name: str
    n: int = 1
    per_k: int = 0
    of: Record | None = None
    per_source: bool = False
    doc: str = ""


class Record:
    """An ordered list of fields laid end to end in the float64 array."""

    def __init__(self, name: str, fields: tuple[Field, ...]) -> None:
        names = [f.name for f in fields]
        if len(set(names)) != len(names) or "size" in names:
            raise ValueError(f"{name}: field names must be unique and not 'size'")
        if any(f.per_source for f in fields[:-1]):
            raise ValueError(f"{name}: only the last field may hold one element per source")
        self.name = name
        self.fields = fields
        self._dtypes: dict[tuple[int, int], np.dtype] = {}
        self._offsets: dict[str, Lin] = {}
        end = Lin(0, 0)
        for f in fields:
            self._offsets[f.name] = end
            if not f.per_source:
                w = self._width(f)
                end = Lin(end.base + w.base, end.per_k + w.per_k)
        self._end = end  # where the fields before a per-source one end (the size, without one)

    def extend(self, name: str, fields: tuple[Field, ...]) -> Record:
        """This record's fields, then ``fields``."""
        return Record(name, self.fields + fields)

    @staticmethod
    def _element(f: Field) -> Lin:
        return Lin(1, 0) if f.of is None else f.of.size_lin()

    def _width(self, f: Field) -> Lin:
        e = self._element(f)
        if e.per_k and f.per_k:
            raise ValueError(f"{self.name}.{f.name}: a field sized by K cannot hold elements sized by K")
        return Lin(e.base * f.n, e.per_k * f.n + e.base * f.per_k)

    def size_lin(self) -> Lin:
        if self.fields and self.fields[-1].per_source:
            raise ValueError(f"{self.name} holds one element per source: its size needs their number")
        return self._end

    def offset(self, name: str, k: int) -> int:
        o = self._offsets[name]
        return o.base + o.per_k * k

    def elements(self, f: Field, k: int, n_src: int = 0) -> int:
        """Elements of field f for max_draft k (and n_src sources)."""
        return n_src if f.per_source else f.n + f.per_k * k

    def size(self, k: int = 0, n_src: int = 0) -> int:
        """float64s a state of this record takes for max_draft k (and n_src sources)."""
        n = self._end.base + self._end.per_k * k
        if self.fields and self.fields[-1].per_source:
            e = self._element(self.fields[-1])
            n += n_src * (e.base + e.per_k * k)
        return n

    def spans(self, k: int, n_src: int = 0) -> list[tuple[str, int, int]]:
        """(name, offset, float64s) of every field, in order, for max_draft k (and n_src sources)."""
        out = []
        for f in self.fields:
            e = self._element(f)
            out.append((f.name, self.offset(f.name, k), self.elements(f, k, n_src) * (e.base + e.per_k * k)))
        return out

    def dtype(self, k: int = 0, n_src: int = 0) -> np.dtype:
        """The structured dtype of a state of this record: its fields by name."""
        dt = self._dtypes.get((k, n_src))
        if dt is None:
            dt = self._dtypes[(k, n_src)] = self._make_dtype(k, n_src)
        return dt

    def _make_dtype(self, k: int, n_src: int) -> np.dtype:
        parts: list[Any] = []
        for f in self.fields:
            elem = np.dtype(np.float64) if f.of is None else f.of.dtype(k)
            n = self.elements(f, k, n_src)
            parts.append((f.name, elem) if n == 1 and not (f.per_k or f.per_source) else (f.name, elem, (n,)))
        dt = np.dtype(parts)
        assert dt.itemsize == 8 * self.size(k, n_src)
        return dt

    def offsets(self) -> Any:
        """The fields' offsets for the kernels: a namedtuple of ints (a Lin where the offset grows with K),
        and ``size`` (an int or a Lin; absent where the record holds one element per source)."""
        names = [f.name for f in self.fields]
        values: list[Any] = [o if o.per_k else o.base for o in (self._offsets[n] for n in names)]
        if not (self.fields and self.fields[-1].per_source):
            names.append("size")
            values.append(self._end if self._end.per_k else self._end.base)
        return namedtuple(f"{self.name}Offsets", names)(*values)

    def __repr__(self) -> str:
        return f"Record({self.name!r}, {[f.name for f in self.fields]})"


@kernel
def at(lin, k):
    """An offset (or size) that grows with K, for max_draft k."""
    return lin.base + lin.per_k * k


# --- the records ------------------------------------------------------------------------------

BETA_PAIR = Record("BetaPair", (Field("alpha"), Field("beta")))
# a Beta posterior and the sum of the chances the model predicted for the outcomes behind it (see thompson.py)
TRIPLE = BETA_PAIR.extend("Triple", (Field("predicted"),))
# one batch size's verify time: a batch of one in seconds, a larger one as its ratio to a batch of one
VERIFY_PAIR = Record("VerifyPair", (Field("mean"), Field("count", doc="timings behind the mean")))

HEADER = Record("Header", (
    Field("kind", doc="FIXED, PMIN, HEURISTIC, THOMPSON or MULTI"),
    Field("max_draft", doc="K"),
    Field("rng", RNG_WORDS, doc="xoshiro128** words (rng.py)"),
    Field("rounds", doc="rounds seen by end_round"),
    Field("ema_drafted", doc="drafted tokens per round"),
    Field("ema_accepted", doc="accepted drafts per round"),
    Field("ema_t_draft", doc="seconds per drafted token"),
    Field("ema_t_verify", doc="seconds per verify call, any batch size"),
    Field("n_t_draft", doc="rounds with at least one draft (timing sample count)"),
    Field("pooled", of=BETA_PAIR, doc="Beta posterior of 'a draft token is accepted', all positions"),
    Field("n_t_verify", doc="rounds with a usable verify time"),
    Field("no_bonus", doc="this round verifies its drafts without the bonus token (a probe: see thompson.py); set by begin"),
    # what the round loop knows before a round begins, written by the loop before controller_begin:
    Field("offer_n", doc="free proposals on offer (prompt lookup's continuation length; 0: none)"),
    Field("offer_conf", doc="their confidence (the lookup's matched n-gram length over its maximum; 0: unknown)"),
    Field("behind", doc="tokens a draft model would catch up on before drafting (it did not draft for a while)"),
    Field("source", doc="which source drafts this round (set by a multi-source begin: see SRC_*)"),
    Field("t_catchup", doc="seconds this round's draft model spent catching up (written by the loop before update)"),
    Field("offer_match", doc="how many tokens before the offer match its source (lookup's match length, beyond the n-gram)"),
    Field("offer_reach", doc="how far the offer may draft whatever its match (a request's prediction: all of it; 0: as far as it matches)"),
))

BASELINE_STATE = HEADER.extend("Baseline", (
    Field("param", doc="fixed: K; pmin: p_min; heuristic: the current K (a float that moves by +2/-1)"),
))

THOMPSON_STATE = HEADER.extend("Thompson", (
    Field("rule", doc="0: act optimally under the sampled model; 1: the EESD paper's Bernoulli(theta) rule"),
    Field("use_bins", doc="condition on the drafter's confidence (calibration)"),
    Field("batch_costs", doc="verify time per batch size (cost-aware; PROFILE_COSTS: B(b) kept); else one for all sizes"),
    Field("eps", doc="exploration budget: the share of time a closed gate may spend on one-token probes"),
    Field("forget", doc="per-observation discount of past evidence toward the prior"),
    Field("lam", doc="this round's target rate: tokens per second of the best fixed k under the sample"),
    Field("prefix", doc="sampled chance that every token drafted so far in this round is accepted"),
    Field("probe", doc="this round may probe (1) or not (0)"),
    Field("open", doc="drafting pays under the posterior means (1) or not (0): when not, only probes draft"),
    Field("resume", doc="seconds per token a model source spends catching up (charged to resuming, not to drafts)"),
    Field("n_resume", doc="catch-up samples behind resume"),
    Field("req_seen", doc="rounds of the current request whose drafts were verified (see thompson.ts_new_request)"),
    # acceptance of free offers is learned from every offer in hindsight (ts_hindsight), not from drafts, by
    # match length: one Beta (alpha, beta, -) per match-length class (the classes field, thompson.match_class)
    Field("hindsight"),
    # a round drafts only if the rate its plan gives (tokens per second, under the round's sample; posterior
    # means in hindsight) beats plain decoding's by this share: the costs a round's plan leaves out
    Field("margin"),
    # a model source's stretches: rounds it drafted since it last resumed (caught up), and the mean of
    # 1 / stretch over the stretches that ended: how a resume's catch-up is spread (thompson.resume_cost)
    Field("stretch"),
    Field("stretch_mean"),
    Field("model_max", doc="most tokens a round without a free offer (a drafting model) plans on (<= K)"),
    Field("bins", N_BINS, of=TRIPLE, doc="per confidence bin, see thompson.py"),
    Field("classes", N_MATCH, of=TRIPLE, doc="in hindsight: per match-length class (MATCH_EDGES), see thompson.py"),
    Field("pos", 0, per_k=1, of=TRIPLE, doc="per draft position (in hindsight: the first holds the request's ratio)"),
    Field("verify", 1, per_k=1, of=VERIFY_PAIR, doc="per batch size 1..K+1"),
    Field("estimate", 1, per_k=1, doc="verify time per batch size 1..K+1 the plan uses (observed, interpolated or assumed)"),
    Field("chance", 0, per_k=1, doc="the round's plan: per-position acceptance chances under its sample"),
    Field("gate_chance", 0, per_k=1, doc="the same at the gate's optimistic theta_1"),
))

# the outer header keeps the pooled statistics, the loop's offer and the round's source; each source's
# whole Thompson state (header included) follows at its offset
MULTI_STATE = HEADER.extend("Multi", (
    Field("n_src"),
    Field("src_ofs", MAX_SRC, doc="where each source's state begins"),
    Field("src", of=THOMPSON_STATE, per_source=True),
))

RECORDS = {FIXED: BASELINE_STATE, PMIN: BASELINE_STATE, HEURISTIC: BASELINE_STATE, THOMPSON: THOMPSON_STATE, MULTI: MULTI_STATE}

# the offsets the kernels index by
HD = HEADER.offsets()
BS = BASELINE_STATE.offsets()
TS = THOMPSON_STATE.offsets()
MS = MULTI_STATE.offsets()
BP = BETA_PAIR.offsets()
TR = TRIPLE.offsets()
VP = VERIFY_PAIR.offsets()


def source_offset(max_draft: int, s: int) -> int:
    """Where source s's Thompson state begins in a multi-source state."""
    return MS.src + s * THOMPSON_STATE.size(max_draft)


def source_state(state: np.ndarray, s: int) -> np.ndarray:
    """Source s's Thompson state in a multi-source state (a view), as multi.source_state in a kernel."""
    k = int(state[HD.max_draft])
    begin = source_offset(k, s)
    return state[begin : begin + THOMPSON_STATE.size(k)]


def record_of(state: np.ndarray) -> Record:
    return RECORDS[int(state[HD.kind])]


def fields(state: np.ndarray) -> Any:
    """The state's fields by name (a numpy structured scalar viewing the array: writing a field writes
    the state): ``fields(s)["pooled"]["alpha"]``, ``fields(s)["src"][SRC_LOOKUP]["pos"]``."""
    rec = record_of(state)
    n_src = int(state[MS.n_src]) if rec is MULTI_STATE else 0
    return state.view(rec.dtype(int(state[HD.max_draft]), n_src))[0]


def loop_slots() -> dict[str, int]:
    """Where the native round loop reads and writes the state, by field: what it knows before a round
    (offer_n, offer_conf, offer_match, offer_reach, behind), what begin decided (source, no_bonus) and the catch-up
    seconds it writes before update."""
    return {name: HEADER.offset(name, 0)
            for name in ("offer_n", "offer_conf", "behind", "source", "t_catchup", "offer_match", "offer_reach", "no_bonus")}
