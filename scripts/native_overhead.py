"""Time per round spent outside llama_decode: the Python round loop against the native one.

    .venv/bin/python scripts/native_overhead.py                 # tiny synthetic GGUF
    .venv/bin/python scripts/native_overhead.py --demo          # plus the demo model
    .venv/bin/python scripts/native_overhead.py --leak 10000    # RSS before/after N native rounds (tiny GGUF)

Two figures per case, both excluding the time inside llama_decode: "round" is the round
call itself (draft, verify, accept, KV trims: PythonRounds.run against NativeRounds.run);
"loop" is the whole generation divided by its rounds, which adds what both loops share
(token and round events, statistics, the prefill's share). Python's llama_decode
calls are timed by wrapping llama_cpp.llama_decode; the native loop times its own.
Both loops run in the same process, alternating, so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time
from pathlib import Path

import llama_cpp

import eesd_local
from eesd_local.gguf.tiny import write_tiny_gguf
from eesd_local.speculative import native_round

_decode = llama_cpp.llama_decode
_t_decode = [0.0]


def _timed_decode(ctx, batch):
    t = time.perf_counter()
    try:
        return _decode(ctx, batch)
    finally:
        _t_decode[0] += time.perf_counter() - t


def _clear(eng) -> None:
    eng.ctx.clear()
    inner = getattr(eng.drafter, "inner", eng.drafter)
    if hasattr(inner, "ctx"):
        inner.ctx.clear()


def measure(eng, prompt: list[int], native: bool, n_gen: int, max_tokens: int, **kw) -> tuple[float, float, int]:
    """(seconds outside llama_decode per round: whole loop, round call alone; rounds) over n_gen generations."""
    os.environ["EESD_NATIVE"] = "1" if native else "0"
    made: list = []
    in_round = [0.0]
    real = native_round.open_loop

    def spy(*a, **k):
        r, note = real(*a, **k)
        made.append(r)
        run = r.run

        def timed_run(*args):  # the round itself: draft, verify, accept, trim (native: a batch, then its queue)
            t = time.perf_counter()
            try:
                return run(*args)
            finally:
                in_round[0] += time.perf_counter() - t

        r.run = timed_run
        return r, note

    native_round.open_loop = spy
    try:
        wall = decode = round_wall = round_decode = 0.0
        rounds = 0
        for _ in range(n_gen):
            _clear(eng)
            _t_decode[0] = in_round[0] = 0.0
            t0 = time.perf_counter()
            fin = eng.generate(prompt, max_tokens=max_tokens, **kw)
            t_prefill_decode = 0.0
            last = None
            for ev in fin:
                last = ev
                if not t_prefill_decode:
                    t_prefill_decode = _t_decode[0] or 1e-12  # the prefill's decode, before the first round
            wall += time.perf_counter() - t0
            native_llama = sum(getattr(r, "t_llama", 0.0) for r in made)
            decode += _t_decode[0] + native_llama
            round_wall += in_round[0]
            round_decode += _t_decode[0] - t_prefill_decode + native_llama
            made.clear()
            rounds += last.stats.n_rounds
    finally:
        native_round.open_loop = real
    n = max(1, rounds)
    return (wall - decode) / n, (round_wall - round_decode) / n, rounds


def compare(model: str, label: str, drafters: list[tuple[str, dict]], prompt_of, n_gen: int, max_tokens: int) -> None:
    for name, extra in drafters:
        with eesd_local.load(model, drafter=name, n_ctx=4096, **extra) as eng:
            prompt = prompt_of(eng)
            for kw in (dict(), dict(temperature=0.8, top_p=0.95, seed=1)):
                measure(eng, prompt, True, 1, 16, **kw)  # warm-up: JIT, caches
                measure(eng, prompt, False, 1, 16, **kw)
                py = [measure(eng, prompt, False, n_gen, max_tokens, **kw) for _ in range(2)]
                nat = [measure(eng, prompt, True, n_gen, max_tokens, **kw) for _ in range(2)]
                mode = "greedy" if not kw else "sampled"
                for what, i in (("round", 1), ("loop", 0)):
                    t_py, t_nat = min(p[i] for p in py), min(n[i] for n in nat)
                    print(f"{label:5} {name:13} {mode:8} {what:6} python {1e6 * t_py:8.1f} us/round  native {1e6 * t_nat:7.1f} "
                          f"us/round  ratio {t_py / t_nat:5.1f}x  ({py[0][2]} rounds)", flush=True)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def leak(model: str, n_rounds: int) -> None:
    os.environ["EESD_NATIVE"] = "1"
    with eesd_local.load(model, drafter="draft-model", draft_model=model, n_ctx=4096, controller="fixed:4") as eng:
        prompt = list(range(300, 340))
        assert native_round.status(eng.drafter)[0], "the native loop is not available"
        done = 0
        before = None
        while done < n_rounds:
            for kw in (dict(), dict(temperature=0.8, top_k=40, seed=done)):
                done += eng.run(prompt, max_tokens=500, **kw).stats.n_rounds
            if before is None and done >= 1000:  # after warm-up: caches, JIT, allocator pools
                before, at = rss_mb(), done
        print(f"RSS after {at} rounds: {before:.1f} MiB; after {done} rounds: {rss_mb():.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", action="store_true", help="also measure on the demo model (qwen2.5-coder-0.5b-instruct)")
    ap.add_argument("--leak", type=int, default=0, metavar="N", help="only the memory check over N native rounds")
    ap.add_argument("--gens", type=int, default=2, help="generations per measurement")
    args = ap.parse_args()
    llama_cpp.llama_decode = _timed_decode  # the runtime calls llama_cpp.llama_decode through the module
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(write_tiny_gguf(Path(tmp) / "tiny.gguf", seed=0))
        if args.leak:
            leak(tiny, args.leak)
            return
        prompt = list(range(300, 340)) * 4
        compare(tiny, "tiny", [("none", {}), ("lookup", dict(controller="fixed:4")),
                               ("draft-model", dict(draft_model=tiny, controller="fixed:4")),
                               ("hierarchical", dict(draft_model=tiny, controller="fixed:4"))],
                lambda eng: prompt, args.gens, 400)
    if args.demo:
        def chat(eng):
            return eng.tokenize(eng.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string."}]))
        compare("qwen2.5-coder-0.5b-instruct", "demo", [("none", {}), ("lookup", dict(controller="fixed:4")),
                                                         ("eesd", dict(controller="fixed:4"))], chat, args.gens, 64)


if __name__ == "__main__":
    main()
