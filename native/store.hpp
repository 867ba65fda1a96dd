// Earlier answers of this process, for prompt lookup across requests (issue 41: a second turn, a repeated
// tool call, the same request again find their continuation here). Each entry is the end of a request's
// prompt followed by its answer; an index of their n-grams finds where the history's end occurred before.
// The oldest entries go once the tokens held pass the bound.
#pragma once

#include <llama.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

namespace eesd {

class Store {
  public:
    // limit: most tokens held; n: the shortest match looked up (the index's n-gram length)
    Store(size_t limit, int n) : limit_(limit), n_(std::max(1, n)) {}

    size_t size() const { return held_; }
    size_t entries() const { return seqs_.size(); }
    int n() const { return n_; }

    void add(const llama_token* t, size_t len) {
        if (len < static_cast<size_t>(n_) + 1 || len > limit_) return;
        seqs_.emplace_back(t, t + len);
        held_ += len;
        bool dropped = false;
        while (held_ > limit_) {
            held_ -= seqs_.front().size();
            seqs_.pop_front();
            first_id_++;
            dropped = true;
        }
        if (dropped) {
            reindex();
        } else {
            index(seqs_.size() - 1);
        }
    }

    // The longest earlier match of the history's end h[0..len) (at least n tokens, measured up to cap): its
    // continuation (at most max_n tokens) into out; returns the match's length (0: none). Among matches of
    // the same length the continuation that followed most often wins (then the latest); share: how many of
    // those matches went on with the chosen next token, over all of them.
    int find(const llama_token* h, int len, int max_n, int cap, std::vector<llama_token>& out, double& share) const {
        out.clear();
        share = 0.0;
        if (len < n_ || max_n <= 0) return 0;
        auto it = index_.find(key(h + len - n_));
        if (it == index_.end()) return 0;
        int best_l = 0;
        std::vector<std::pair<size_t, size_t>>& cand = cand_;
        cand.clear();
        for (const auto& [id, pos] : it->second) {  // pos: the last token of the n-gram in seqs_[id - first_id_]
            if (id < first_id_) continue;
            const std::vector<llama_token>& s = seqs_[id - first_id_];
            if (pos + 1 >= s.size()) continue;  // nothing followed
            int l = 0;
            while (l < cap && l < len && static_cast<size_t>(l) <= pos && s[pos - l] == h[len - 1 - l]) l++;
            if (l < n_ || l < best_l) continue;
            if (l > best_l) {
                best_l = l;
                cand.clear();
            }
            cand.emplace_back(id - first_id_, pos);
        }
        if (cand.empty()) return 0;
        // the next token that followed most often among the longest matches, then its latest occurrence
        std::unordered_map<llama_token, int> votes;
        for (const auto& [i, pos] : cand) votes[seqs_[i][pos + 1]]++;
        llama_token pick = -1;
        int most = 0;
        for (auto c = cand.rbegin(); c != cand.rend(); ++c) {
            llama_token t = seqs_[c->first][c->second + 1];
            if (votes[t] > most) most = votes[t], pick = t;
        }
        for (auto c = cand.rbegin(); c != cand.rend(); ++c) {
            const std::vector<llama_token>& s = seqs_[c->first];
            if (s[c->second + 1] != pick) continue;
            size_t end = std::min(s.size(), c->second + 1 + static_cast<size_t>(max_n));
            out.assign(s.begin() + static_cast<std::ptrdiff_t>(c->second + 1), s.begin() + static_cast<std::ptrdiff_t>(end));
            break;
        }
        share = static_cast<double>(most) / static_cast<double>(cand.size());
        return best_l;
    }

  private:
    uint64_t key(const llama_token* t) const {  // FNV-1a over the n-gram's ids
        uint64_t k = 1469598103934665603ull;
        for (int i = 0; i < n_; i++) k = (k ^ static_cast<uint32_t>(t[i])) * 1099511628211ull;
        return k;
    }
    void index(size_t i) {
        const std::vector<llama_token>& s = seqs_[i];
        for (size_t e = static_cast<size_t>(n_) - 1; e < s.size(); e++) index_[key(s.data() + e + 1 - n_)].emplace_back(first_id_ + i, e);
    }
    void reindex() {
        index_.clear();
        for (size_t i = 0; i < seqs_.size(); i++) index(i);
    }

    size_t limit_;
    int n_;
    size_t held_ = 0;
    size_t first_id_ = 0;  // the id of seqs_.front(): ids count every entry ever added
    std::deque<std::vector<llama_token>> seqs_;
    std::unordered_map<uint64_t, std::vector<std::pair<size_t, size_t>>> index_;  // n-gram -> (entry id, end)
    mutable std::vector<std::pair<size_t, size_t>> cand_;
};

}  // namespace eesd
