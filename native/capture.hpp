// Capture of one named tensor of a llama.cpp graph, through the scheduler's eval callback
// (llama_context_params.cb_eval): the shared-trunk target copies the residual stream after the
// trunk's last base layer ("l_out-{N-1}", every row of the batch) out of the trunk+exit context and
// feeds it to the tail context as embeddings. The callback answers "yes" for that one tensor only,
// so the scheduler computes the graph in two pieces and hands it over in between; the copy uses
// ggml_backend_tensor_get, so the tensor may live on any backend (CPU, CUDA, Metal).
#pragma once

#include <ggml-backend.h>
#include <ggml.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace eesd {

struct Capture {
    std::string name;          // the tensor's name in the graph
    int64_t n_embd = 0;        // its row width
    std::vector<float> rows;   // the rows captured since reset(), n_rows x n_embd
    int64_t n_rows = 0;
    int64_t n_bad = 0;         // captures of another shape or type (skipped): the caller raises

    Capture(std::string tensor, int64_t width) : name(std::move(tensor)), n_embd(width) {}
    void reset() {
        rows.clear();
        n_rows = 0;
        n_bad = 0;
    }
};

// the cb_eval function: ask == true: "do you want this tensor's data?"; ask == false: here it is
// (return false to stop the computation, which we never do). A decode in several ubatches calls it
// once per ubatch; the rows are appended in order.
inline bool capture_eval(struct ggml_tensor* t, bool ask, void* user) {
    auto* c = static_cast<Capture*>(user);
    if (std::strncmp(t->name, c->name.c_str(), GGML_MAX_NAME) != 0) return !ask;
    if (ask) return true;
    if (t->type != GGML_TYPE_F32 || t->ne[0] != c->n_embd || t->ne[2] != 1 || t->ne[3] != 1 || !ggml_is_contiguous(t)) {
        c->n_bad++;
        return true;
    }
    const int64_t n = t->ne[1];
    c->rows.resize(static_cast<size_t>((c->n_rows + n) * c->n_embd));
    ggml_backend_tensor_get(t, c->rows.data() + c->n_rows * c->n_embd, 0, ggml_nbytes(t));
    c->n_rows += n;
    return true;
}

// rows of a (possibly quantized) embedding table as float32, dequantized by ggml's own type
// traits: the very function the CPU backend's get_rows calls, so a model fed these rows computes
// what it computes from the token ids. Returns false for a type ggml cannot dequantize.
struct EmbedTable {
    const char* base = nullptr;  // n_rows rows of row_bytes bytes
    size_t row_bytes = 0;
    int type = 0;
    int64_t n_rows = 0, n_embd = 0;

    bool valid() const {
        if (type == GGML_TYPE_F32) return true;
        const ggml_type_traits* tr = ggml_get_type_traits(static_cast<ggml_type>(type));
        return tr != nullptr && tr->to_float != nullptr;
    }
    // rows ids[0..n) into dst (n x n_embd); an id out of range is the caller's bug (checked by the caller)
    void rows(const int32_t* ids, size_t n, float* dst) const {
        const ggml_type_traits* tr = type == GGML_TYPE_F32 ? nullptr : ggml_get_type_traits(static_cast<ggml_type>(type));
        for (size_t i = 0; i < n; i++) {
            const char* row = base + static_cast<size_t>(ids[i]) * row_bytes;
            if (tr == nullptr)
                std::memcpy(dst + i * n_embd, row, n_embd * sizeof(float));
            else
                tr->to_float(row, dst + i * n_embd, n_embd);
        }
    }
};

}  // namespace eesd
