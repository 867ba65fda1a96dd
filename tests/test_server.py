"""``eesd serve`` on the real demo model: the official openai client, greedy answers equal to the
engine's, one engine behind a bounded queue, cancelled streams, errors, memory and /metrics.

The server runs as ``python -m eesd_local.cli serve`` on a free port; its Ctrl-C (SIGINT) at
teardown must end it with exit code 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
prom_parser = pytest.importorskip("prometheus_client.parser")
pytest.importorskip("fastapi")

import eesd_local  # noqa: E402

from .conftest import QWEN05  # noqa: E402

ENGINE = dict(drafter="lookup", n_ctx=1024, n_threads=2)
FLAGS = ["--drafter", "lookup", "--n-ctx", "1024", "--n-threads", "2", "--log-level", "warning"]
N = 16  # max_tokens of the greedy comparisons
# prompts whose greedy answers do not depend on what the KV cache held before: where the target's two
# best tokens nearly tie, a prefill reused from the cache can pick the other one (e.g. "def fib(n):")
PROMPTS = ["def factorial(n):", "def add(a, b):", "def gcd(a, b):", "class Stack:",
           "def is_prime(n):", "# reverse a string\ndef reverse(s):", "def mean(xs):", "SELECT name FROM"]
CHAT = [{"role": "user", "content": "Name three colors."}]


class Server:
    def __init__(self, log: Path, *extra: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "eesd_local.cli", "serve", QWEN05, "--port", str(self.port), *FLAGS, *extra],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 180
        while time.time() < deadline:
            assert self.proc.poll() is None, f"the server exited:\n{log.read_text()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)
        raise AssertionError(f"the server did not come up:\n{log.read_text()}")

    def stop(self) -> int:
        """Ctrl-C; the exit code."""
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.url + "/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in prom_parser.text_string_to_metric_families(text) for s in fam.samples}


@contextmanager
def _serve(tmp_path_factory, *extra: str) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("serve") / "server.log", *extra)
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"Ctrl-C ended the server with {code}:\n{server.log.read_text()}"
    assert "Traceback" not in server.log.read_text(), server.log.read_text()


@pytest.fixture(scope="module")
def server(qwen05_path, tmp_path_factory):
    with _serve(tmp_path_factory) as s:
        yield s


@pytest.fixture(scope="module")
def engine(qwen05_path):
    with eesd_local.load(QWEN05, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def greedy(engine):
    """The single-request greedy answer of each prompt, from the engine directly."""
    return {p: engine.run(p, max_tokens=N, temperature=0.0).text for p in PROMPTS}


def _complete(url: str, prompt: str, client: httpx.Client | None = None, **kw) -> httpx.Response:
    body = {"model": QWEN05, "prompt": prompt, "max_tokens": N, "temperature": 0, **kw}
    return (client or httpx).post(url + "/v1/completions", json=body, timeout=300)


def test_the_openai_client_gets_what_the_engine_says(server, engine, greedy):
    client = server.client()
    assert [m.id for m in client.models.list()] == [QWEN05]

    out = client.completions.create(model=QWEN05, prompt=PROMPTS[0], max_tokens=N, temperature=0)
    assert out.choices[0].text == greedy[PROMPTS[0]]
    assert out.usage.completion_tokens == N and out.choices[0].finish_reason == "length"
    spec = out.model_extra["speculation"]
    assert spec["drafter"] == "lookup" and set(spec) >= {"controller", "drafted", "accepted", "tau",
                                                         "acceptance_by_position", "tokens_per_s"}

    want = engine.create_chat_completion(CHAT, max_tokens=N, temperature=0)["choices"][0]["message"]["content"]
    chat = client.chat.completions.create(model=QWEN05, messages=CHAT, max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == want
    assert chat.usage.prompt_tokens > 0 and chat.model_extra["speculation"]["drafter"] == "lookup"

    chunks = list(client.chat.completions.create(model=QWEN05, messages=CHAT, max_tokens=N, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert chunks[-1].model_extra["speculation"]["drafter"] == "lookup"

    # per request: plain decoding says the same; the next request is back on the server's drafter
    out = client.completions.create(model=QWEN05, prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                    extra_body={"top_k": 1, "speculation": {"drafter": "none", "draft_max": 4}})
    assert out.choices[0].text == greedy[PROMPTS[0]] and out.model_extra["speculation"]["drafter"] == "none"
    out = client.completions.create(model=QWEN05, prompt=PROMPTS[1], max_tokens=N, temperature=0, stop=["\n\n\n"])
    assert out.choices[0].text == greedy[PROMPTS[1]].split("\n\n\n")[0]
    assert out.model_extra["speculation"]["drafter"] == "lookup"


FUNC = """def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
"""
EDIT = [{"role": "user", "content": "Rename `merged` to `out` in this function. Reply with the code only.\n\n```python\n"
         + FUNC + "```"}]


def test_the_openai_client_sends_a_prediction(server, engine):
    """OpenAI's predicted outputs through the official client: the answer is the one without the prediction,
    and the usage says how many predicted tokens the answer kept and how many were turned down."""
    want = engine.create_chat_completion(EDIT, max_tokens=120, temperature=0)["choices"][0]["message"]["content"]
    client = server.client()
    out = client.chat.completions.create(model=QWEN05, messages=EDIT, max_tokens=120, temperature=0,
                                         prediction={"type": "content", "content": "```python\n" + FUNC + "```"})
    assert out.choices[0].message.content == want
    d = out.usage.completion_tokens_details
    assert d.accepted_prediction_tokens >= 30, d
    assert d.accepted_prediction_tokens <= out.usage.completion_tokens and d.rejected_prediction_tokens >= 0
    assert out.model_extra["speculation"]["accepted"] >= d.accepted_prediction_tokens
    parts = {"type": "content", "content": [{"type": "text", "text": "```python\n"}, {"type": "text", "text": FUNC + "```"}]}
    chunks = list(client.chat.completions.create(model=QWEN05, messages=EDIT, max_tokens=120, temperature=0, stream=True,
                                                 prediction=parts))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 30  # (the controller learns between)
    # a round's tokens come in one chunk: a stream of long accepted drafts is not one event per token
    texts = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) <= chunks[-1].model_extra["speculation"]["rounds"] + 1 < chunks[-1].usage.completion_tokens // 2
    plain = client.chat.completions.create(model=QWEN05, messages=EDIT, max_tokens=120, temperature=0)
    assert plain.choices[0].message.content == want and plain.usage.completion_tokens_details is None


def test_a_stream_is_server_sent_events_ending_in_done(server):
    with httpx.stream("POST", server.url + "/v1/completions", timeout=300,
                      json={"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and "speculation" in chunks[-1]


def test_concurrent_clients_each_get_their_own_greedy_answer(server, engine, greedy):
    answers: list[tuple[str, int, str]] = []

    def client(i: int) -> None:
        with httpx.Client() as c:
            for j in range(5):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                r = _complete(server.url, prompt, c)
                answers.append((prompt, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 40
    assert all(code == 200 for _, code, _ in answers), [a for a in answers if a[1] != 200]
    # each answer is the single-request greedy one, byte for byte: requests share the engine's cache and
    # lookup's drafts change the batch shapes, which exact kernels and exact cache reuse make irrelevant
    for p, _, text in answers:
        assert text == greedy[p], (p, greedy[p], text)


def test_a_full_queue_answers_429(qwen05_path, tmp_path_factory):
    with _serve(tmp_path_factory, "--queue", "2") as small:
        codes: list[httpx.Response] = []

        def one(i: int) -> None:
            codes.append(_complete(small.url, PROMPTS[i], max_tokens=24))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        busy = [r for r in codes if r.status_code == 429]
        assert busy and all(r.status_code == 200 for r in codes if r not in busy)
        assert len(codes) - len(busy) >= 3  # one running and two waiting always get through
        assert busy[0].headers["retry-after"] and busy[0].json()["error"]["code"] == "queue_full"
        assert small.metrics()[("eesd_requests_total", (("code", "429"), ("endpoint", "/v1/completions")))] == len(busy)


def test_a_dropped_stream_cancels_its_generation(server, greedy):
    key = ("eesd_requests_cancelled_total", (("stage", "running"),))
    before = server.metrics()
    # an answer asked for nowhere else in this module: earlier answers (the engine's store) would draft a
    # repeated one in a round or two, and it could end before the server noticed the drop
    story = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm, at least 500 words."}]
    body = {"model": QWEN05, "messages": story, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        got: list[str] = []
        for line in lines:
            if line.startswith("data: "):
                got.append(line)
                if len(got) == 5:
                    break
    assert len(got) == 5
    r = _complete(server.url, PROMPTS[3])  # the worker takes it only after the dropped generation has ended
    assert r.json()["choices"][0]["text"] == greedy[PROMPTS[3]]
    after = server.metrics()
    assert after[key] == before[key] + 1
    tokens = ("eesd_completion_tokens_total", (("drafter", "lookup"),))
    assert after[tokens] - before.get(tokens, 0) < 100 + N  # it stopped long before its 400 tokens


def test_a_client_that_hangs_up_on_a_whole_answer_cancels_it(server, greedy):
    key = ("eesd_requests_cancelled_total", (("stage", "running"),))
    tokens = ("eesd_completion_tokens_total", (("drafter", "lookup"),))
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[6], "max_tokens": 400, "temperature": 0},
                   timeout=httpx.Timeout(60, read=1.5))
    assert _complete(server.url, PROMPTS[6]).json()["choices"][0]["text"] == greedy[PROMPTS[6]]
    after = server.metrics()
    assert after[key] == before[key] + 1
    assert after[tokens] - before.get(tokens, 0) < 150 + N


BAD = [  # (body, param)
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "x", "temperature": -0.5}', "temperature"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    (b'{"prompt": "x", "top_p": 0}', "top_p"),
    (b'{"prompt": "x", "top_p": 1.5}', "top_p"),
    (b'{"prompt": "x", "top_k": -1}', "top_k"),
    (b'{"prompt": "x", "stop": 3}', "stop"),
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"prompt": "x", "model": "gpt-4o"}', "model"),
    (b'{"prompt": "x", "speculation": {"drafter": "magic"}}', "speculation.drafter"),
    (b'{"prompt": "x", "speculation": {"controller": "nope"}}', "speculation.controller"),
    (b'{"prompt": "x", "speculation": {"draft_max": 0}}', "speculation.draft_max"),
    (b'{"prompt": "x", "speculation": {"draft_max": 100000}}', "speculation.draft_max"),
    (b'{"prompt": "x", "prediction": 5}', "prediction"),
    (b'{"prompt": "x", "prediction": {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}}', "prediction"),
    (b'{"prompt": "x", "prediction": {"type": "text", "content": "x"}}', "prediction"),
    (b'{"prompt": "x", "prediction": {"type": "content", "content": "\\ud800"}}', "prediction"),
    (json.dumps({"prompt": "x", "prediction": {"type": "content", "content": "word " * 1100}}).encode(), "prediction"),
    (b'{"max_tokens": 4}', "prompt"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"prompt": [1, 2, 99999999]}', "prompt"),
    (json.dumps({"prompt": "hello " * 1100}).encode(), "prompt"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p or b.decode()[:10] for b, p in BAD])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and "Traceback" not in err["message"]
    if param:
        assert param.split(".")[-1] in err["message"] or param == "prompt"


def test_bad_chat_input_and_the_server_goes_on(server, greedy):
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
                        ({"messages": CHAT, "stream": True, "top_p": -1}, "top_p"),
                        ({"messages": [{"role": "user", "content": "hi " * 1100}], "stream": True}, "messages")]:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert _complete(server.url, PROMPTS[4]).json()["choices"][0]["text"] == greedy[PROMPTS[4]]


def test_memory_stays_flat_over_200_requests(server):
    proc = psutil.Process(server.proc.pid)
    with httpx.Client() as c:
        for i in range(200):
            r = _complete(server.url, f"# note {i}: {PROMPTS[i % len(PROMPTS)]}", c, max_tokens=2)
            assert r.status_code == 200
            if i == 19:
                rss20 = proc.memory_info().rss
    rss200 = proc.memory_info().rss
    assert rss200 <= 1.05 * rss20, (rss20, rss200)


def test_metrics_parse_as_prometheus_text(server):
    _complete(server.url, PROMPTS[5])
    m = server.metrics()
    lookup = (("drafter", "lookup"),)
    assert m[("eesd_generations_total", lookup)] >= 1 and m[("eesd_completion_tokens_total", lookup)] >= N
    assert m[("eesd_tau", lookup)] >= 1.0 and 0 < m[("eesd_time_per_token_seconds", lookup)] < 60
    assert m[("eesd_accepted_tokens_total", lookup)] <= m[("eesd_drafted_tokens_total", lookup)]
    assert m[("eesd_queue_limit", ())] == 8
    assert ("eesd_requests_total", (("code", "200"), ("endpoint", "/v1/completions"))) in m


def test_an_idle_server_keeps_its_last_conversation_in_ram(qwen05_path, tmp_path_factory):
    """When a response has gone and no request waits, the server saves the conversation the engine holds into
    the RAM prompt cache (off every request's path: a request for another conversation would else copy it
    first); the next request for another conversation leaves it there, and a request that comes back to it
    is served from RAM."""
    def states(s: Server) -> float:
        deadline = time.monotonic() + 20
        while True:
            n = s.metrics()[("eesd_prompt_cache_states", ())]
            if n or time.monotonic() > deadline:
                return n
            time.sleep(0.1)

    first = "# Helpers that parse the dates and times written in a web server's access logs.\n" + PROMPTS[0]
    other = "# A stack and a queue, each with push, pop and peek, for the scheduler's tests.\n" + PROMPTS[3]
    with _serve(tmp_path_factory) as s:
        assert s.metrics()[("eesd_prompt_cache_states", ())] == 0
        assert _complete(s.url, first).status_code == 200
        assert states(s) == 1, "the idle server kept nothing"
        assert _complete(s.url, other).status_code == 200
        again = _complete(s.url, first + "\n    pass\n").json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def test_the_prompt_cache_holds_its_bound_under_concurrent_conversations(qwen05_path, tmp_path_factory):
    """Six conversations at once, each coming back for a second turn, on a server with 4 MB of prompt cache
    (a state of one of these conversations is about 1.5 MB): states are kept, restored and evicted, the
    bytes (on /metrics) never pass the bound while the requests run, and a turn restored from RAM answers
    as a fresh request does."""
    topic = ("Here is a note about a small Python service that reads orders from a queue, checks each "
             "order's items against the stock table, and writes the accepted ones to the ledger. ")
    seen: list[float] = []
    with _serve(tmp_path_factory, "--cache-ram", "4") as s:
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                m = s.metrics()
                seen.append(m[("eesd_prompt_cache_bytes", ())])
                time.sleep(0.2)

        def conversation(i: int) -> tuple[list[dict], str, int]:
            msgs = [{"role": "user", "content": f"Conversation {i}. {topic * 2}Summarise it in one line."}]
            with httpx.Client() as c:
                r = c.post(s.url + "/v1/chat/completions", timeout=300,
                           json={"messages": msgs, "max_tokens": 6, "temperature": 0}).json()
                msgs += [r["choices"][0]["message"], {"role": "user", "content": "Shorter."}]
                r = c.post(s.url + "/v1/chat/completions", timeout=300,
                           json={"messages": msgs, "max_tokens": 6, "temperature": 0}).json()
            return msgs, r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

        watcher = threading.Thread(target=watch)
        watcher.start()
        results: list[tuple[list[dict], str, int]] = [None] * 6  # type: ignore[list-item]

        def run(i: int) -> None:
            results[i] = conversation(i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        watcher.join()
        m = s.metrics()
    limit = 4 << 20
    assert m[("eesd_prompt_cache_limit_bytes", ())] == limit
    assert seen and max(seen + [m[("eesd_prompt_cache_bytes", ())]]) <= limit
    assert m[("eesd_prompt_cache_states", ())] >= 1, "nothing was kept: the bound was not exercised"
    assert sum(cached for _, _, cached in results) > 0
    with eesd_local.load(QWEN05, drafter="none") as fresh:  # every second turn as a fresh process answers it
        for msgs, text, _ in results:
            want = fresh.create_chat_completion(msgs, max_tokens=6, temperature=0)["choices"][0]["message"]["content"]
            assert want == text
