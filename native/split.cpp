// The decodes and KV trims of both contexts (see rounds.hpp). Without the shared trunk each is
// one llama_decode / one trim of its own context. With it (llama/trunk.py, Rounds::set_split)
// the draft context is the trunk fed embedding rows, and the target is split: a target batch is
// TWO llama_decode calls, the trunk over the positions the draft has not computed yet, then the
// tail fed the trunk's captured h_N rows.

#include "rounds.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace eesd {

// --- the shared trunk (trunk.py) -----------------------------------------------------

// the draft context: with the shared trunk, fed the embedding rows of toks, its h_N rows kept
// (TrunkContext.decode)
void Rounds::draft_decode(const llama_token* toks, int n, int n_logits) {
    if (!split_) {
        dft_.decode(toks, n, n_logits, t_llama_);
        return;
    }
    if (n == 0) return;
    size_t pos0 = dft_.tokens.size();
    for (int i = 0; i < n; i++)
        if (toks[i] < 0 || toks[i] >= table_.n_rows) throw std::invalid_argument("token " + std::to_string(toks[i]) + " out of range");
    emb_.resize(static_cast<size_t>(n) * table_.n_embd);
    table_.rows(reinterpret_cast<const int32_t*>(toks), n, emb_.data());
    cap_->reset();
    try {
        dft_.decode(toks, n, n_logits, t_llama_, emb_.data());
    } catch (...) {
        draft_trim(dft_.tokens.size());  // keep the rows of what llama.cpp kept
        throw;
    }
    if (cap_->n_bad || cap_->n_rows < n) throw std::runtime_error("the trunk's capture of " + cap_->name + " failed");
    // the rows are contiguous with those held (else start over from pos0: earlier ones are not needed)
    size_t w = static_cast<size_t>(table_.n_embd);
    if (h_base_ + h_.size() / w != pos0) {
        h_.clear();
        h_base_ = pos0;
    }
    h_.insert(h_.end(), cap_->rows.begin(), cap_->rows.begin() + static_cast<size_t>(n) * w);
    cap_->reset();
}

void Rounds::draft_trim(size_t n_keep) {
    dft_.trim(n_keep);
    if (!split_) return;
    size_t w = static_cast<size_t>(table_.n_embd);
    size_t end = dft_.tokens.size();
    if (end <= h_base_) {
        h_.clear();
        h_base_ = end;
    } else if (h_.size() / w > end - h_base_) {
        h_.resize((end - h_base_) * w);
    }
}

// the target: with the shared trunk, the trunk decodes what it has not (reusing the rows the draft
// computed), then the tail is fed those rows (SplitTarget.decode)
void Rounds::target_decode(const llama_token* toks, int n, int n_logits) {
    if (!split_) {
        tgt_.decode(toks, n, n_logits, t_llama_);
        return;
    }
    if (n == 0) return;
    size_t base = tgt_.tokens.size();
    if (dft_.tokens.size() < base) throw std::runtime_error("the trunk context is out of step with the tail");
    size_t w = static_cast<size_t>(table_.n_embd);
    size_t held = h_base_ <= base ? h_base_ + h_.size() / w : 0;  // rows held up to this position
    size_t k = 0;
    while (k < static_cast<size_t>(n) && base + k < dft_.tokens.size() && base + k < held && dft_.tokens[base + k] == toks[k]) k++;
    draft_trim(base + k);
    if (k < static_cast<size_t>(n)) draft_decode(toks + k, n - static_cast<int>(k), 0);
    if (h_base_ > base || h_base_ + h_.size() / w < base + n) throw std::runtime_error("the trunk's rows are not held");
    tgt_.decode(toks, n, n_logits, t_llama_, h_.data() + (base - h_base_) * w);
    // rows before the tail's last position are not needed again (SplitTarget.forget_before)
    size_t keep_from = tgt_.tokens.size() - 1;
    if (keep_from > h_base_) {
        size_t cut = std::min(keep_from - h_base_, h_.size() / w);
        h_.erase(h_.begin(), h_.begin() + cut * w);
        h_base_ += cut;
    }
}

void Rounds::target_trim(size_t n_keep) {
    tgt_.trim(n_keep);
    if (split_) draft_trim(n_keep);  // drafts past the accepted ones go too
}

void Rounds::set_split(uintptr_t trunk, int trunk_batch, Capture* cap, const EmbedTable& table, std::vector<int32_t> vocab,
                       const llama_model* target_model) {
    if (!trunk || !cap || !table.base || !target_model) throw std::invalid_argument("set_split: null pointer");
    if (!table.valid()) throw std::invalid_argument("set_split: the embedding table's type cannot be dequantized");
    if (trunk_batch < 1) throw std::invalid_argument("batch sizes must be >= 1");
    dft_.close();
    dft_.open(trunk, trunk_batch, static_cast<int>(table.n_embd));
    if (dft_.n_vocab != static_cast<int>(vocab.size())) throw std::invalid_argument("set_split: the trunk's vocabulary is not V'");
    n_target_ = llama_vocab_n_tokens(llama_model_get_vocab(target_model));
    for (int32_t v : vocab)
        if (v < 0 || v >= n_target_) throw std::invalid_argument("set_split: a V' id is out of the target's vocabulary");
    if (tgt_.n_vocab != n_target_) throw std::invalid_argument("set_split: the tail's vocabulary differs from the target's");
    // the tail is fed rows: reopen its batch for embeddings
    uintptr_t tail = reinterpret_cast<uintptr_t>(tgt_.ctx);
    int tail_batch = tgt_.n_batch;
    std::vector<llama_token> toks = std::move(tgt_.tokens);
    int n_ctx = tgt_.n_ctx;
    tgt_.close();
    tgt_.open(tail, tail_batch, static_cast<int>(table.n_embd));
    tgt_.tokens = std::move(toks);
    tgt_.n_ctx = std::min(tgt_.n_ctx, n_ctx);
    cap_ = cap;
    table_ = table;
    vocab_ = std::move(vocab);
    eog_vocab_ = llama_model_get_vocab(target_model);
    h_.clear();
    h_base_ = dft_.tokens.size();
    split_ = true;
}

}  // namespace eesd
