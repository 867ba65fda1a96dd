"""Defaults shared by the engine, the controllers, the simulator, the bench and the CLI."""

DRAFT_MAX = 8  # most tokens drafted per round
N_CTX = 4096  # context size in tokens
# the native loop runs rounds in batches of about this long before Python takes them (and
# streams their tokens): fewer Python calls per token; 0 = back to Python after every round
BATCH_MS = 50.0
