"""GGUF files: the fast header reader and its checks, the one writer (gguf-py's GGUFWriter), exit-head
files and the draft builder, tiny synthetic models. The bottom layer: imports only the base modules."""
