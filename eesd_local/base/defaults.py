"""Defaults shared by the engine, the controllers, the simulator, the bench and the CLI."""

DRAFT_MAX = 8  # most tokens drafted per round
N_CTX = 4096  # context size in tokens
# the native loop runs rounds in batches of about this long before Python takes them (and
# streams their tokens): fewer Python calls per token; 0 = back to Python after every round
BATCH_MS = 50.0
# where greedy output is exact (runtime.exactness), a prompt is decoded in chunks of this many tokens
# aligned to positions 0, 64, 128...: a cached chunk computed that way is exactly what a fresh
# prefill computes, so reusing it cannot change an answer (prefill speed on a 2-core CPU: the
# same as in chunks of 512 within noise, BENCHMARKS.md)
PREFILL_CHUNK = 64
