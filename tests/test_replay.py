"""lossless.replay: the run's own batch schedule decoded again gives back every token it emitted
(the bench's certificate where a divergence from plain decoding is wider than a near tie)."""

from __future__ import annotations

import pytest

import eesd_local
from eesd_local import lossless
from eesd_local.controllers import layout
from eesd_local.events import RoundEvent, TokenEvent

PROMPT = [{"role": "user", "content": "Repeat this line three times: the quick brown fox jumps over the lazy dog."}]


def _run(eng, prompt, max_tokens=48):
    evs = list(eng.generate(prompt, max_tokens=max_tokens))
    toks = [e.token for e in evs if isinstance(e, TokenEvent)]
    schedule = [(e.rows, e.emitted) for e in evs if isinstance(e, RoundEvent)]
    return toks, schedule


@pytest.mark.parametrize("probe", [False, True])
def test_replaying_the_schedule_gives_back_every_token(qwen05_path, probe):
    with eesd_local.load(qwen05_path, drafter="lookup", controller="fixed:4", n_ctx=1024) as eng:
        if probe:
            eng.controller.state[layout.NO_BONUS] = 1.0  # every round verified without the bonus: k rows
        prompt = eng.tokenize(eng.apply_chat_template(PROMPT))
        toks, schedule = _run(eng, prompt)
        assert sum(e for _, e in schedule) >= len(toks) - 1  # the first token comes from the prefill (the last round may emit past max_tokens)
        assert any(rows > 1 for rows, _ in schedule), "nothing was drafted: the schedule is plain decoding's"
        if probe:
            assert all(rows == 1 or e <= rows for rows, e in schedule)
        model = eng.model
        assert lossless.replay(model, prompt, toks, schedule, len(toks) - 1)
        # a token the target did not choose is caught, in a drafted round and in the first one
        for i in (len(toks) // 2, 0):
            bad = list(toks)
            bad[i] = (bad[i] + 1) % model.n_vocab
            assert not lossless.replay(model, prompt, bad, schedule, len(toks) - 1)
        # a schedule that runs out before the position asked about certifies nothing
        assert not lossless.replay(model, prompt, toks, schedule[:2], len(toks) - 1)
