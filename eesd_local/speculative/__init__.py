"""Speculation: the engine, the round loop (Python and native), sampling and verification, drafters,
controllers. Imports the llama.cpp runtime, GGUF files and the base, never the tools or the app."""
