// One llama context and the record of what its KV cache holds (runtime.Context in C++): the
// round loop appends to it with decode() and rolls it back with trim(), and the record always
// names the tokens whose KV entries llama.cpp holds, also after a failed decode.
#pragma once

#include <llama.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace eesd {

// a KV cache or a llama_decode that cannot take the tokens (Python: ContextFullError)
struct ContextFull : std::runtime_error {
    using std::runtime_error::runtime_error;
};

inline double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One llama context with seq 0 and a record of what its KV cache holds (runtime.Context).
struct Ctx {
    llama_context* ctx = nullptr;
    llama_memory_t mem = nullptr;
    llama_batch batch{};
    int n_batch = 0, n_ctx = 0, n_vocab = 0;
    int embd = 0;  // > 0: fed rows of this width (llama_batch.embd) rather than token ids
    int out_base = 0;
    std::vector<llama_token> tokens;

    void open(uintptr_t ptr, int batch_size, int width = 0) {
        ctx = reinterpret_cast<llama_context*>(ptr);
        mem = llama_get_memory(ctx);
        n_batch = batch_size;
        n_ctx = static_cast<int>(llama_n_ctx(ctx));
        n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        embd = width;
        batch = llama_batch_init(n_batch, embd, 1);
    }
    void close() {
        if (ctx) llama_batch_free(batch);
        ctx = nullptr;
    }
    int room() const { return n_ctx - static_cast<int>(tokens.size()); }
    void trim(size_t n_keep) {
        if (n_keep < tokens.size()) {
            llama_memory_seq_rm(mem, 0, static_cast<llama_pos>(n_keep), -1);
            tokens.resize(n_keep);
        }
    }
    const float* row(int r) const { return llama_get_logits_ith(ctx, out_base + r); }

    // append toks with logits for the last n_logits, in n_batch chunks (Context.decode); an embd
    // context is fed rows (n x embd) and toks only say what its cache holds
    void decode(const llama_token* toks, int n, int n_logits, double& t_llama, const float* rows = nullptr) {
        if (n == 0) return;
        if (static_cast<int>(tokens.size()) + n > n_ctx)
            throw ContextFull("the context is full: " + std::to_string(tokens.size()) + " + " + std::to_string(n) +
                              " tokens exceed n_ctx=" + std::to_string(n_ctx));
        n_logits = std::max(0, std::min(n_logits, n));
        int start = 0;
        while (start < n) {
            int size = std::min(n_batch, n - start);
            if (start + size < n && n - (start + size) < n_logits) size = std::max(1, n - start - n_logits);
            int first_out = n - n_logits - start;
            int pos0 = static_cast<int>(tokens.size());
            if (embd > 0) {
                if (rows == nullptr) throw std::invalid_argument("this context is fed embeddings");
                std::copy(rows + static_cast<size_t>(start) * embd, rows + static_cast<size_t>(start + size) * embd, batch.embd);
            }
            for (int i = 0; i < size; i++) {
                if (embd == 0) batch.token[i] = toks[start + i];
                batch.pos[i] = pos0 + i;
                batch.n_seq_id[i] = 1;
                batch.seq_id[i][0] = 0;
                batch.logits[i] = i >= first_out;
            }
            batch.n_tokens = size;
            double t0 = now_s();
            int rc = llama_decode(ctx, batch);
            t_llama += now_s() - t0;
            if (rc != 0) {
                // llama.cpp keeps processed ubatches on fatal errors: resynchronise the record
                int pos_max = static_cast<int>(llama_memory_seq_pos_max(mem, 0));
                int kept = std::max(0, std::min(size, pos_max + 1 - pos0));
                tokens.insert(tokens.end(), toks + start, toks + start + kept);
                trim(pos0);
                if (rc == 1) throw ContextFull("llama.cpp found no KV slot for " + std::to_string(size) + " tokens");
                throw std::runtime_error("llama_decode failed with code " + std::to_string(rc));
            }
            tokens.insert(tokens.end(), toks + start, toks + start + size);
            start += size;
            out_base = first_out;
        }
    }
};

}  // namespace eesd
