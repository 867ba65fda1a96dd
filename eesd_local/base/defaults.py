"""Defaults shared by the engine, the controllers, the simulator, the bench and the CLI."""

# most tokens drafted per round: a free offer (prompt lookup, earlier answers, a prediction) drafts as far as
# its match is long, up to this (the batch-invariant kernels keep a verify of any size exact)
DRAFT_MAX = 64
# most tokens a drafting model (the exit head, a draft model, hierarchical) drafts per round: every token it
# adds is less likely to be kept, and on the simulator's CPU profiles a model allowed 64 lost up to 13%
MODEL_DRAFT_MAX = 8
N_CTX = 4096  # context size in tokens
# the native loop runs rounds in batches of about this long before Python takes them (and
# streams their tokens): fewer Python calls per token; 0 = back to Python after every round
BATCH_MS = 50.0
# megabytes of idle prompts' KV states kept in RAM (a conversation that comes back pays only for its new turn)
CACHE_RAM_MB = 2048
# Sampling: what a request gets for an option it leaves out. Engine.generate, the API (LLM, completion),
# params.check_sampling, `eesd generate`/`run`, eesd-chat and the bench read these; the server differs
# only where OpenAI's API says otherwise (SERVER_*).
MAX_TOKENS = 256  # most tokens generated per request
TEMPERATURE = 0.0  # 0: greedy (argmax), where speculation is exact
TOP_K = 0  # 0: off
TOP_P = 1.0  # 1: off
SEED: int | None = None  # None: a random seed per request
CHAT_MAX_TOKENS = 1024  # eesd-chat: most tokens per answer
BENCH_MAX_TOKENS = 128  # eesd bench: tokens generated per prompt (per turn)
BENCH_SEED = 0  # eesd bench: the base seed of sampled runs, so that a bench is repeatable
SERVER_TEMPERATURE = 1.0  # OpenAI's default for a request that names no temperature
SERVER_MAX_TOKENS = 16  # OpenAI's default for a /v1/completions request without max_tokens (a chat gets the context)
