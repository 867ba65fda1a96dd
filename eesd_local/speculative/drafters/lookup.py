"""Prompt lookup: draft the tokens that followed the most recent earlier occurrence of
the current suffix (n-grams from longest to shortest). No model call; strong when
the answer copies its input (edits, code rewrites)."""

from __future__ import annotations

from eesd_local.speculative.drafters.base import SRC_ANY, DrafterBase, NativeSpec, Offer, Proposal, WantMore
from eesd_local.speculative.sampling import SamplingParams, Uniform

MATCH_CAP = 16  # a match is measured up to this many tokens (the controller pools 10 and more)


def match_confidence(n: int, ngram_max: int) -> float:
    """A matched n-gram's confidence, strictly inside (0, 1) so that the controller can tell it
    from "unknown": a longer match is a safer bet. The native loop uses the same rule."""
    return n / (ngram_max + 1.0)


class LookupDrafter(DrafterBase):
    name = "lookup"
    free_offers = True  # its offers are its proposals: the controller may learn from each in hindsight

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1) -> None:
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> last end position seen
        self._seen: list[int] = []  # the history the index was built from
        self._indexed = 0  # n-grams ending before this position are indexed
        self._ambiguous: set[tuple[int, ...]] = set()  # n-grams seen followed by two different tokens

    def begin(self, prompt: list[int]) -> None:
        self._index.clear()
        self._ambiguous.clear()
        self._seen = []
        self._indexed = 0

    def _update(self, history: list[int]) -> None:
        n_same = len(self._seen)
        if history[:n_same] != self._seen:  # history was rewritten: rebuild
            self.begin(history)
        self._seen = list(history)
        # index n-grams ending at e < len-1: the suffix itself must not match itself
        for e in range(self._indexed, len(history) - 1):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if e - n + 1 >= 0:
                    gram = tuple(history[e - n + 1 : e + 1])
                    before = self._index.get(gram)
                    if before is not None and history[before + 1] != history[e + 1]:
                        self._ambiguous.add(gram)
                    self._index[gram] = e
        self._indexed = max(self._indexed, len(history) - 1)

    def lookup(self, history: list[int], max_n: int) -> tuple[list[int], int]:
        """(continuation, n of the matched n-gram) for the longest suffix n-gram seen before."""
        cont, n, _ = self.lookup_match(history, max_n)
        return cont, n

    def lookup_match(self, history: list[int], max_n: int) -> tuple[list[int], int, int]:
        """(continuation, n of the matched n-gram, match length): the match length counts how many
        tokens before the continuation agree with the history's end, n and on, up to MATCH_CAP.
        An ambiguous n-gram (earlier occurrences went on with different tokens) counts as a match of
        one token, whatever its length: its latest continuation is a guess between them (on the built-in
        sets 0.04-0.28 of such offers' first tokens were right after a 4-9 token match, 0.73-0.99 of the
        others')."""
        self._update(history)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(history) < n:
                continue
            gram = tuple(history[-n:])
            e = self._index.get(gram)
            if e is not None:
                if gram in self._ambiguous:
                    return history[e + 1 : e + 1 + max_n], n, 1
                length = n
                while length < MATCH_CAP and e - length >= 0 and history[e - length] == history[-1 - length]:
                    length += 1
                return history[e + 1 : e + 1 + max_n], n, length
        return [], 0, 0

    def offer(self, history: list[int], max_n: int) -> Offer:
        cont, n, length = self.lookup_match(history, max_n)
        return Offer(len(cont), match_confidence(n, self.ngram_max) if cont else 0.0, tokens=tuple(cont),
                     match=length if cont else 0)

    def propose(self, history: list[int], want_more: WantMore, max_n: int, params: SamplingParams,
                rng: Uniform, source: int = SRC_ANY) -> Proposal:
        prop = Proposal(source=self.name)
        if max_n <= 0:
            return prop
        cont, n = self.lookup(history, max_n)
        if not cont or not want_more(0, 1.0):
            return prop
        confidence = match_confidence(n, self.ngram_max)
        for i, tok in enumerate(cont):
            if i and not want_more(i, confidence):
                break
            prop.add(tok, None, confidence)
        return prop

    def native(self) -> NativeSpec:
        return NativeSpec(lookup=(self.ngram_min, self.ngram_max))

    def close(self) -> None:
        pass
