"""The llama.cpp runtime: models and contexts over llama-cpp-python's low-level API, the split target
(trunk + tail), the model catalog (names -> local files, no downloads), RPC, the optional C++
extension. Imports GGUF files and the base, never speculation or the tools."""
