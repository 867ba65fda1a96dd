"""``eesd bench``: prompt files and built-in sets, method specs, a tiny real run through the
CLI (JSON keys, losslessness, plots), mismatch certification, and Ctrl-C."""

from __future__ import annotations

import http.server
import json
import sys
import threading

import pytest

import eesd_local
from eesd_local import cli
from eesd_local.base.errors import EesdError
from eesd_local.gguf.reader import bytes_read_per_token
from eesd_local.speculative.events import Stats
from eesd_local.tools.bench import runner, servers
from eesd_local.tools.bench.methods import EngineMethod, MethodSpec, Sampling, Turn, parse_methods
from eesd_local.tools.bench.prompts import CHAT_KINDS, PromptItem, chat_kind, chat_set, code_set, load_prompts, rewrite_set
from eesd_local.tools.bench.report import (
    REQUIRED_KEYS,
    _by_turn,
    _rate,
    _vs,
    _vs_cell,
    draft_histogram,
    draft_lengths_markdown,
    projected_speedup,
)
from eesd_local.tools.heads.data import heldout_sharegpt_range, is_heldout_module, sharegpt_records

from .conftest import QWEN05

LINES = [
    {"id": "raw", "category": "code", "prompt": "def add(a, b):\n    return"},
    {"id": "msg", "category": "code", "messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Say hi."}]},
    {"id": "mt", "category": "chat", "turns": ["Name a colour.", "And another?"]},
    {"id": "nocat", "prompt": "Hello"},
]


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n\n")
    return path


def test_prompt_file_parsing(tmp_path):
    items = load_prompts(str(_write(tmp_path / "p.jsonl", LINES)))
    by_id = {it.id: it for it in items}
    assert by_id["raw"].prompt.startswith("def add") and by_id["raw"].n_turns == 1
    assert by_id["msg"].messages == (("system", "Be brief."), ("user", "Say hi."))
    assert by_id["mt"].turns == ("Name a colour.", "And another?") and by_id["mt"].n_turns == 2
    assert by_id["nocat"].category == "default"
    # categories take turns; a filter keeps only the named ones
    assert [it.id for it in items] == ["raw", "mt", "nocat", "msg"]
    assert [it.id for it in load_prompts(str(tmp_path / "p.jsonl"), categories=["chat"])] == ["mt"]
    assert [it.id for it in load_prompts(str(tmp_path / "p.jsonl"), categories=["code"], n_per_category=1)] == ["raw"]


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "x"}', "no 'id'"),
    ('{"id": 1, "prompt": "x", "turns": ["y"]}', "exactly one"),
    ('{"id": 1, "turns": []}', "'turns'"),
    ('{"id": 1, "messages": [{"role": "assistant", "content": "x"}]}', "last message"),
    ('{"id": 1, "prompt": "x"', "not valid JSON"),
    ('["x"]', "JSON object"),
])
def test_bad_prompt_lines_name_the_line(tmp_path, line, words):
    path = _write(tmp_path / "bad.jsonl", ['{"id": 0, "prompt": "ok"}', line])
    with pytest.raises(EesdError) as e:
        load_prompts(str(path))
    assert f"{path}:2" in e.value.message and words in e.value.message


def test_unknown_set_and_category():
    with pytest.raises(EesdError, match="no prompt set"):
        load_prompts("nonsense")
    with pytest.raises(EesdError, match="category"):
        load_prompts("code", categories=["chat"])


def test_builtin_sets_hold_no_training_records():
    code = code_set()
    assert len(code) == 164 and all(it.id.startswith("HumanEval/") and it.category == "code" for it in code)
    held = heldout_sharegpt_range()
    records = sharegpt_records()
    chat = chat_set()
    assert len(chat) > 500
    for it in chat:
        i = int(it.id.split(":")[1])
        assert i in held, f"{it.id} is a training record"
        assert it.messages[-1] == ("user", records[i]["conversations"][0]["value"].strip())
    rewrite = rewrite_set()
    assert len(rewrite) > 100
    for it in rewrite:
        module = it.id.split(":")[1].rsplit(".", 1)[0]
        assert is_heldout_module(module), f"{it.id} comes from a training module"
        assert "```python\n" in it.messages[0][1]
    picked = load_prompts("code,chat,rewrite", n_per_category=3)
    kinds = ["code"] + [f"chat-{k}" for k in CHAT_KINDS] + ["rewrite"]
    assert sorted({it.category for it in picked}) == sorted(kinds)  # every kind of chat request is a category
    assert [it.category for it in picked[: len(kinds)]] == list(dict.fromkeys(it.category for it in picked))  # they take turns
    assert len(picked) == 3 * len(kinds)
    only_chat = load_prompts("chat", categories=["chat"], n_per_category=1)  # "chat" selects every kind
    assert {it.category for it in only_chat} == {f"chat-{k}" for k in CHAT_KINDS}


def test_the_multi_turn_sets_come_from_held_out_text():
    """edits (one file changed turn after turn), rework (a second turn on the first answer) and agent (the file
    re-sent with a small change): multi-turn items from held-out modules and records only."""
    records = sharegpt_records()
    held = set(heldout_sharegpt_range())
    for name, turns in (("edits", 3), ("rework", 2), ("agent", 2)):
        items = load_prompts(name)
        assert len(items) > 50 and all(it.category == name and len(it.turns) == turns for it in items), name
        for it in items:
            where = it.id.split(":", 1)[1]
            if name == "rework":
                i = int(where.rsplit(":", 1)[1])
                assert i in held and it.turns[0] == records[i]["conversations"][0]["value"].strip()
            else:
                assert is_heldout_module(where.rsplit(":", 1)[0]) and "```python\n" in it.turns[0]
    agent = load_prompts("agent", n_per_category=1)[0]
    first, second = (t.split("```python\n")[1].split("\n```")[0] for t in agent.turns)
    assert first != second and second.replace("    # TODO: validate the input\n", "", 1) == first


def test_chat_kinds():
    assert chat_kind("Please rephrase this paragraph so it sounds friendlier.") == "edit"
    assert chat_kind("Write a Python function that merges two sorted lists.") == "coding"
    assert chat_kind("If it takes 5 machines 5 minutes to make 5 devices, how long for 100?") == "math"
    assert chat_kind("Give me 10 ideas for a birthday party.") == "list"
    assert chat_kind("Write a poem about the sea.") == "writing"
    assert chat_kind("Why is the sky blue?") == "explain"
    assert chat_kind("Act as a travel agent for me.") == "other"


def test_method_specs():
    specs = parse_methods("lookup,eesd-fixed:4,none,llama-cpp-python-lookup:3,llama-cpp-python", controller="beta-ts")
    assert [s.name for s in specs] == ["none", "lookup", "eesd-fixed:4", "llama-cpp-python-lookup:3", "llama-cpp-python"]
    assert specs[1] == MethodSpec("lookup", "lookup", "beta-ts")
    assert specs[2] == MethodSpec("eesd-fixed:4", "eesd", "fixed:4")
    assert specs[3].is_peer and specs[3].peer_lookup == 3 and specs[4].peer_lookup == 0
    assert parse_methods("lookup")[0].name == "none"  # the baseline is always measured
    assert parse_methods("eesd@calibration-ts")[1] == MethodSpec("eesd@calibration-ts", "eesd", "calibration-ts")
    for bad in ("eesd-fixed:0", "warp-drive", "lookup,lookup", "eesd@warp", "none@beta-ts"):
        with pytest.raises(EesdError):
            parse_methods(bad)


def test_tiny_run_through_the_cli(tmp_path, qwen05_path):
    prompts = _write(tmp_path / "tiny.jsonl", [LINES[0], LINES[2]])
    out, plots, md = tmp_path / "out.json", tmp_path / "plots", tmp_path / "out.md"
    argv = ["bench", "--model", QWEN05, "--prompts", str(prompts), "--methods", "none,lookup,llama-cpp-python,serve:eesd:none",
            "--max-tokens", "16", "--warmup-tokens", "2", "--ctx", "512", "--json", str(out), "--plots", str(plots),
            "--markdown", str(md)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["model"] == QWEN05
    assert data["machine"]["cores"] >= 1 and "gpu" in data["machine"]
    assert data["run"]["complete"] and data["run"]["runs_done"] == 8
    assert set(data["methods"]) == {"none", "lookup", "llama-cpp-python", "serve:eesd:none"}
    # eesd serve, streamed over HTTP: the same answers, and its time to the first token of each turn
    serve = data["methods"].pop("serve:eesd:none")
    assert serve["all"]["identical"] == 2 and serve["all"]["tokens_per_s"] > 0
    ttft = serve["chat"]["prefill_s_by_turn"]
    assert len(ttft) == 2 and all(t is not None and t > 0 for t in ttft)
    assert len(data["methods"]["none"]["chat"]["prefill_s_by_turn"]) == 2 and data["methods"]["none"]["code"]["prefill_s_by_turn"] == []
    assert "seconds to the first token, by turn" in md.read_text()
    for method, by_cat in data["methods"].items():
        assert set(by_cat) == {"code", "chat", "all"}
        for cat, f in by_cat.items():
            assert set(REQUIRED_KEYS) <= set(f), (method, cat)
            assert f["lossless"] is True, f["mismatches"]
            assert f["n_prompts"] == (2 if cat == "all" else 1)
            assert f["tokens_per_s"] > 0 and f["tau"] >= 1.0
    assert data["methods"]["none"]["all"]["speedup"] == 1.0
    assert data["methods"]["none"]["chat"]["n_generated"] > 16  # two turns of up to 16 tokens
    assert data["methods"]["lookup"]["all"]["memory_overhead"] == 0
    lk = data["methods"]["lookup"]["all"]
    drafted_by = lk["sources"]  # every drafted token is counted under the source that drafted it
    assert set(drafted_by) <= {"lookup"}
    drafted, accepted = sum(v["drafted"] for v in drafted_by.values()), sum(v["accepted"] for v in drafted_by.values())
    assert drafted == sum(data["methods"]["lookup"][c]["sources"].get("lookup", {}).get("drafted", 0) for c in ("code", "chat"))
    if drafted:
        assert accepted / drafted == pytest.approx(lk["acceptance_rate"])
    # the memory-bound projection: plain decoding is 1, lookup's drafts read no weights so it is tau
    assert data["methods"]["none"]["all"]["projected_memory_bound_speedup"] == pytest.approx(1.0)
    assert lk["projected_memory_bound_speedup"] == pytest.approx(lk["tau"])
    assert "projected mem-bound speedup" in md.read_text()
    for name in ("speedup.png", "acceptance_by_position.png", "draft_length.png"):
        assert (plots / name).read_bytes()[:4] == b"\x89PNG"
    assert "| lookup |" in md.read_text()
    # outputs are not overwritten without --force (checked before anything runs)
    assert cli.main(argv) == 2


def test_projection_charges_a_model_source_its_share_of_the_weights(qwen05_path):
    st = Stats()
    st.record_round(4, 3, 4, "eesd")  # 3 of 4 drafts kept and a correction: 4 tokens
    st.record_round(2, 2, 3, "lookup")  # both kept and the bonus: 3 tokens
    st.record_round(0, 0, 1)
    assert projected_speedup(st, {"eesd": 0.25}) == pytest.approx(8 / (3 + 4 * 0.25))
    assert projected_speedup(st, {}) == pytest.approx(8 / 3)
    whole = bytes_read_per_token(qwen05_path)
    assert 0.5 * qwen05_path.stat().st_size < whole <= qwen05_path.stat().st_size  # tied embeddings: the LM head reads them


def test_certify_flags_a_real_divergence(qwen05_path):
    with eesd_local.load(QWEN05, drafter="none", n_ctx=512) as eng:
        ref = EngineMethod(MethodSpec("none"), eng)
        item = PromptItem("x", "code", prompt="def add(a, b):\n    return")
        s = Sampling(max_tokens=8)
        plain = runner.run_item(ref, item, ref, s, 512, 0)
        toks = plain.turns[0].tokens
        assert len(toks) == 8
        same = runner.run_item(ref, item, ref, s, 512, 0)
        assert runner.certify(ref, plain, same, s, 512) is None
        other = runner.run_item(ref, item, ref, s, 512, 0)
        other.turns[0].tokens = toks[:3] + [eng.tokenize("zebra")[-1]] + toks[4:]
        mm = runner.certify(ref, plain, other, s, 512)
        assert mm is not None and mm.index == 3 and mm.plain_token == toks[3] and not mm.near_tie and mm.gap > 1
        # an output that stops early where plain decoding went on is a divergence too
        other.turns[0].tokens = toks[:5]
        mm = runner.certify(ref, plain, other, s, 512)
        assert mm is not None and mm.index == 5 and eng.model.is_eog(mm.other_token) and not mm.near_tie
        assert type(mm.other_token) is int  # a NumPy integer here once made the --json report fail after the whole run


def test_ctrl_c_reports_what_was_measured(tmp_path, qwen05_path, monkeypatch):
    prompts = _write(tmp_path / "two.jsonl", [LINES[0], {"id": "raw2", "category": "code", "prompt": "def sub(a, b):\n"}])
    calls = []
    real = runner.run_item

    def interrupting(*a, **kw):
        calls.append(1)
        if len(calls) == 4:  # the second prompt, second method
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(runner, "run_item", interrupting)
    out = tmp_path / "out.json"
    rc = cli.main(["bench", "--model", QWEN05, "--prompts", str(prompts), "--methods", "none,lookup", "--max-tokens", "8",
                   "--warmup-tokens", "0", "--ctx", "512", "--json", str(out)])
    assert rc == 130
    data = json.loads(out.read_text())
    assert data["run"]["complete"] is False and data["run"]["runs_done"] == 2 and data["run"]["runs_planned"] == 4
    assert data["methods"]["lookup"]["code"]["n_prompts"] == 1 and data["methods"]["none"]["code"]["n_prompts"] == 1


def test_the_draft_length_distribution_counts_rounds_by_tokens_drafted():
    h = draft_histogram([0, 0, 3, 5, 9, 20, 40, 64])
    assert h == {"rounds": {"0": 2, "1-3": 1, "4-8": 1, "9-16": 1, "17-32": 1, "33+": 2}, "longest": 64}
    md = draft_lengths_markdown({"auto": {"code": {"draft_lengths": h}}, "none": {"code": {"draft_lengths": draft_histogram([0])}}},
                                ["code"])
    assert "| auto | code | 25% | 12% | 12% | 12% | 12% | 25% | 64 |" in md
    assert "| none |" not in md  # a method that never drafted has no row


def test_plain_baselines_are_not_sent_the_prediction():
    """A predict item's plain rows (in process and `eesd serve --drafter none` over HTTP) decode without the
    prediction, so every speedup over them is over plain decoding; the other rows get it."""
    specs = {s.name: s for s in parse_methods("auto,serve:eesd,serve:eesd:none,serve:eesd:auto,serve:llama-server,"
                                              "serve:llama-server:ngram-mod,llama-server")}
    assert [n for n, s in specs.items() if s.plain] == ["none", "serve:eesd:none", "serve:llama-server", "llama-server"]

    class Engine:
        config = type("C", (), {"draft_max": 8})()

        def apply_chat_template(self, messages):
            return "".join(m["content"] for m in messages)

        def tokenize(self, text):
            return list(range(len(text) % 7 + 3))

    class Method:
        def __init__(self, spec):
            self.spec, self.sent = spec, []

        def generate(self, prompt, s, *, prediction=None):
            self.sent.append(prediction)
            return type("T", (), {"text": "```python\nx = 2\n```"})()

    item = PromptItem("p", "predict", turns=("Edit:\n\n```python\nx = 1\n```\n", "Again."), predict=True)
    ref = type("R", (), {"engine": Engine()})()
    for name, spec in specs.items():
        m = Method(spec)
        runner.run_item(m, item, ref, Sampling(max_tokens=4), 4096, 0)
        assert m.sent == ([None, None] if spec.plain else ["```python\nx = 1\n```", "```python\nx = 2\n```"]), name


def test_a_prompt_run_several_times_counts_its_median_run():
    """With --repeats, one run slowed by a burst of noise moves no prompt's figure: each prompt counts its
    median run (the mean of the middle two for an even count), and speedups pair prompt with prompt."""
    def run(method, item, rep, secs, n=101, ttft=(0.5,)):
        turns = [Turn(list(range(n)), "", t, secs / len(ttft)) for t in ttft]
        return runner.Run(method, item, "chat", rep, [[1]] * len(ttft), turns)

    slow = [run("auto", "a", 0, 1.0), run("auto", "a", 1, 9.0), run("auto", "a", 2, 1.2)]
    assert _rate(slow) == (100, pytest.approx(1.2))  # the median run, not 11.2 s over three
    assert _rate(slow[:2]) == (100, pytest.approx(5.0))  # two runs: their mean, as the totals had it
    both = slow + [run("auto", "b", r, s) for r, s in enumerate((2.0, 2.0, 2.0))]
    assert _rate(both) == (200, pytest.approx(3.2))
    plain = {(r.category, r.item, r.repeat): r for r in (run("none", i, k, 2.4) for i in "ab" for k in range(3))}
    assert _vs(both, plain, alike=False) == (pytest.approx(4.8 / 3.2), 0)
    multi = [run("auto", "m", k, 1.0, ttft=(0.9, t)) for k, t in enumerate((0.2, 3.0, 0.3))]
    assert _by_turn(multi) == [pytest.approx(0.9), pytest.approx(0.3)]


def test_rates_over_llama_server_compare_like_with_like():
    """Greedy, a prompt counts in a ratio over llama-server's only where both did the same work: end to end, an
    answer of another length is other work (llama-server's stock kernels turned a chat prompt's near tie into a
    13-token refusal where ours wrote 96 tokens, and its rate, mostly the prefill, came out a third of ours)."""
    def run(method, item, text, n, secs):
        return runner.Run(method, item, "chat", 0, [[1]], [Turn([], text, 0.5, secs, count=n)])

    ref = {("chat", i, 0): r for i, r in (("a", run("serve:llama-server", "a", "x" * 96, 96, 4.0)),
                                          ("b", run("serve:llama-server", "b", "sorry", 13, 0.6)))}
    ours = [run("serve:eesd:none", "a", "x" * 96, 96, 3.8), run("serve:eesd:none", "b", "y" * 96, 96, 4.0)]
    assert _vs(ours, ref, alike=True) == (pytest.approx(4.0 / 3.8), 1)  # prompt b left out
    assert _vs(ours, ref, alike=False)[0] == pytest.approx((190 / 7.8) / (107 / 4.6))  # counted as it was
    assert _vs(ours[1:], ref, alike=True) == (None, 1)
    # other text of the same size after the same prompt is the same work: two kernels broke a near tie otherwise
    ref[("chat", "b", 0)] = run("serve:llama-server", "b", "z" * 96, 96, 4.2)
    assert _vs(ours, ref, alike=True) == (pytest.approx((192 / 7.8) / (192 / 8.2)), 0)
    # a later turn after an answer of another length re-sends a prompt of another length: other work
    two = [runner.Run("serve:eesd:none", "c", "chat", 0, [[1], [1] * 40], [Turn([], "x", 0.5, 1.0, count=8)] * 2)]
    ref2 = {("chat", "c", 0): runner.Run("serve:llama-server", "c", "chat", 0, [[1], [1] * 41],
                                         [Turn([], "y", 0.5, 1.0, count=8)] * 2)}
    assert _vs(two, ref2, alike=True) == (None, 1)
    ref2[("chat", "c", 0)].prompts[1].pop()  # prompts as long: counted
    assert _vs(two, ref2, alike=True) == (pytest.approx(1.0), 0)
    assert _vs_cell({"vs_llama_server": 1.05, "vs_llama_server_differ": 1}) == "1.05*"
    assert _vs_cell({"vs_llama_server": None, "vs_llama_server_differ": 1}) == "differ"
    assert _vs_cell({"vs_llama_server": 0.98, "vs_llama_server_differ": 0}) == "0.98"


def test_a_repeat_starts_from_nothing_every_method_kept(tmp_path, qwen05_path, monkeypatch):
    """--repeats measures the same requests again: the second pass must not read answers, prompts or n-gram pools
    the first left behind (a server kept them and ran 2-4x faster on a repeat). Our engines forget them (the
    whole prompt is prefilled again), servers are started anew and warmed up again."""
    prompts = _write(tmp_path / "one.jsonl", [LINES[0]])
    started = []
    real_start = servers.ServerProcess.__init__

    def counting(self, argv, port, what, env=None):
        started.append(port)
        real_start(self, argv, port, what, env)

    monkeypatch.setattr(servers.ServerProcess, "__init__", counting)
    said = []
    cfg = runner.BenchConfig(model=QWEN05, prompts=str(prompts), methods="none,serve:eesd:none", max_tokens=8, repeats=2,
                             warmup_tokens=2, n_ctx=512, cost_repeats=0)
    res = runner.run_bench(cfg, progress=lambda done, total, what: said.append(what))
    assert res.complete and len(res.runs) == 4
    assert len(started) == 2 and "restarting serve:eesd:none" in said
    first, second = (r for r in res.runs if r.method == "none")
    assert second.turns[0].rounds.n_cached == 0 and second.turns[0].tokens == first.turns[0].tokens
    assert all(r.mismatch is None and r.same_as_plain is not False for r in res.runs)


def test_no_method_keeps_its_place_or_its_neighbour_from_pass_to_pass():
    """Each prompt's median pass is not one place's: with as many prompts as methods (the old rotation by the
    prompt's number then gave a prompt the same order in every pass), a prompt's order changes between passes,
    and every method runs right after a given other one in some passes and not in others."""
    methods = ["none", "auto", "llama-server", "ngram-simple", "ngram-mod", "ngram-map-k"]
    for k in range(12):
        orders = [runner.run_order(methods, rep, k) for rep in range(3)]
        assert all(sorted(o) == sorted(methods) for o in orders)
        assert len({tuple(o) for o in orders}) == 3
        after_none = {o[o.index("none") + 1] if o.index("none") + 1 < len(o) else None for o in orders}
        assert len(after_none) > 1, (k, orders)
    firsts = {runner.run_order(methods, rep, k)[0] for rep in range(3) for k in range(12)}
    assert firsts == set(methods)


def _sse_server(chunks: list[dict]) -> tuple[http.server.HTTPServer, str]:
    """A local server that answers any POST with ``chunks`` as server-sent events, then [DONE]."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for c in chunks:
                self.wfile.write(b"data: " + json.dumps(c).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def test_answers_are_counted_alike_for_every_server():
    """llama-server's usage counts the end-of-generation token that ended the answer (14 for a 13-token
    answer), eesd serve's does not: the end-to-end rates count the answer's own tokens for both, else
    llama-server gains 1/n on every answer that ends before max_tokens."""
    words = [{"choices": [{"index": 0, "text": w, "finish_reason": None}]} for w in ("I'm", " sorry", ".")]
    ended = {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}], "usage": {"completion_tokens": 4}}
    httpd, url = _sse_server([*words, ended])
    try:
        text, first, chunks, usage, finish = servers._post_stream(url + "/v1/completions", {"prompt": [1]})
    finally:
        httpd.shutdown()
    assert (text, chunks, usage, finish) == ("I'm sorry.", 3, 4, "stop") and first > 0
    assert servers.answer_tokens("llama-server", usage, chunks, finish) == 3
    assert servers.answer_tokens("eesd", 3, 1, "stop") == 3  # ours counts the text's tokens; one chunk a round
    assert servers.answer_tokens("llama-server", 128, 128, "length") == 128  # cut at max_tokens: no such token
    assert servers.answer_tokens("llama-server", None, 7, "stop") == 7  # no usage: one chunk a token


def test_llama_server_keeps_the_engines_weight_buffers(monkeypatch, tmp_path):
    """llama-server is started with the engine's rule for llama.cpp's repacked weight buffers: off (--no-repack)
    where the engine keeps them off (a CPU with AMX, whose buffers crash llama-server on some virtual machines),
    on otherwise, so both sides run the same kind of kernels."""
    model = tmp_path / "m.gguf"
    monkeypatch.setattr(servers, "find_binary", lambda name: tmp_path / name)
    argv = {}
    for env in ("0", "1"):
        monkeypatch.setenv("EESD_EXTRA_BUFTS", env)
        argv[env] = servers.llama_server_argv(model, 8080, spec_type=None, draft_model=None, n_ctx=4096, n_threads=2,
                                              n_gpu_layers=0)
    assert "--no-repack" in argv["0"] and "--no-repack" not in argv["1"]


def test_eesd_serve_argv_is_what_eesd_serve_parses(tmp_path):
    """The one command line the bench and the probe scripts start ``eesd serve`` with parses as `eesd serve`'s own
    options, each value where it was meant to go."""
    model, draft = tmp_path / "m.gguf", tmp_path / "d.gguf"
    argv = servers.eesd_serve_argv(model, 8123, drafter="draft-model", n_ctx=2048, n_threads=3, n_gpu_layers=5,
                                   draft_max=17, draft_model=draft, rpc=("10.0.0.2:50052",))
    assert argv[:4] == [sys.executable, "-m", "eesd_local.cli", "serve"]
    args = cli.build_parser(argv[3:]).parse_args(argv[3:])
    assert (args.command, args.model, args.host, args.port, args.drafter) == ("serve", str(model), "127.0.0.1", 8123,
                                                                               "draft-model")
    assert (args.n_ctx, args.n_threads, args.n_gpu_layers, args.draft_max) == (2048, 3, 5, 17)
    assert args.draft_model == str(draft) and args.log_level == "warning"
    plain = cli.build_parser(["serve"]).parse_args(servers.eesd_serve_argv(model, 1, drafter="none", n_ctx=4096, n_threads=2)[3:])
    assert plain.draft_model is None and plain.drafter == "none"
