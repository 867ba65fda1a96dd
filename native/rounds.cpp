// The round loop (see rounds.hpp): the round, the batch of rounds, drafting, verification,
// then set-up and checks. The decodes and trims of both contexts, split target or not, are in
// split.cpp.

#include "rounds.hpp"

#include <limits>
#include <stdexcept>
#include <string>

namespace eesd {

// One round: the controller begins, the drafter proposes d1..dk, the target decodes
// [last, d1..dk] in one batch (one llama_decode; two with a split target: the trunk's rows
// the draft did not compute, then the tail: split.cpp), the accepted prefix d1..dm and one target token are
// emitted, the target's KV cache is trimmed past them, and the controller learns how it went.
void Rounds::one_round(int max_n, RoundOut& r) {
    double t1 = now_s();
    if (hindsight_) see_offers();
    put(slots_.t_catchup, 0.0);
    t_catchup_ = 0.0;
    if (mode_ == CALL) {
        propose_called(max_n);  // the Python drafter's offer, the controller's begin and the proposal, in one call
        r.src = called_.src;
    } else {
        // what is free to know before the round: lookup's match, how far the draft model is behind
        cands_.clear();
        double conf = 0.0;
        bool predicted = !ref_.empty() && propose_reference(max_n);
        bool from_store = false;
        if (predicted) {
            conf = match_confidence(std::min(match_len_, std::max(ngram_max_, 1)), std::max(ngram_max_, 1));
        } else if (ngram_max_ > 0 && mode_ != NONE) {
            int len = static_cast<int>(history_.size());
            int n_match = lookup_match(history_.data(), len, ngram_min_, ngram_max_, max_n, cands_, match_len_);
            conf = match_confidence(n_match, ngram_max_);
            double share = 0.0;  // an earlier answer that matches longer than the history's own text goes first
            int l = store_ ? store_->find(history_.data(), len, max_n, MATCH_CAP, stored_, share) : 0;
            if (l > (cands_.empty() ? 0 : match_len_) && !stored_.empty()) {
                cands_.swap(stored_);
                match_len_ = share < 1.0 ? 1 : l;  // earlier answers that went on differently: a guess between them
                conf = match_confidence(ngram_max_, ngram_max_);
                from_store = true;
            }
            if (match_len_ < LOOKUP_MIN_MATCH && (mode_ == POINT || mode_ == CHOOSE)) {  // too short to bet a verify on
                cands_.clear();
                from_store = false;
            }
        }
        int mode = predicted && mode_ == NONE ? POINT : mode_;  // plain decoding drafts a prediction alone
        bool offers = mode == POINT || mode == CHOOSE;  // a hierarchical drafter's guesses are not free proposals
        put(slots_.offer_n, offers ? static_cast<double>(cands_.size()) : 0.0);
        put(slots_.offer_conf, offers && !cands_.empty() ? conf : 0.0);
        put(slots_.offer_match, offers && !cands_.empty() ? static_cast<double>(match_len_) : 0.0);
        // a prediction is the caller's word that the answer goes on as it does: its offer may draft all of
        // itself, however short the match since its last realignment (lookup's offers reach as far as they match)
        put(slots_.offer_reach, offers && predicted ? static_cast<double>(cands_.size()) : 0.0);
        if (hindsight_ && offers && !cands_.empty() && !covered(history_.size(), cands_))
            offers_.push_back(PendingOffer{history_.size(), cands_, match_len_});
        put(slots_.behind, (mode == MODEL || mode == CHOOSE) && dft_.ctx ? behind() : 0.0);
        begin_(st_, n_st_);
        r.src = draft(max_n, conf, mode);
        if (predicted && r.src == SRC_LOOKUP) r.src = SRC_PREDICTION;
        if (from_store && r.src == SRC_LOOKUP) r.src = SRC_STORE;
    }
    double t2 = now_s();
    int k = static_cast<int>(drafted_.size());
    // a probe verifies its drafts without the bonus: [last, d1..d(k-1)], k rows
    bool bonus = k == 0 || no_bonus_slot_ < 0 || no_bonus_slot_ >= n_st_ || st_[no_bonus_slot_] == 0.0;
    int n_rows = bonus ? k + 1 : k;
    size_t n_keep = tgt_.tokens.size() + 1;  // the cache keeps `last` ...
    batch_.assign(1, history_.back());
    batch_.insert(batch_.end(), drafted_.begin(), drafted_.begin() + (n_rows - 1));
    target_decode(batch_.data(), n_rows, n_rows);
    int m = 0, nxt = 0;
    auto rows = [this](int i) { return tgt_.row(i); };
    if (sp_.greedy)
        Verifier::greedy(rows, tgt_.n_vocab, drafted_.data(), k, bonus, m, nxt);
    else
        ver_.sampled(rows, tgt_.n_vocab, sp_, drafted_.data(), point_.data(), q_, k, bonus, rng_, m, nxt);
    target_trim(n_keep + std::min(m, n_rows - 1));  // ... and the accepted drafts it decoded; the rest is rolled back
    double t3 = now_s();
    r.m = m;
    r.nxt = nxt;
    r.rows = n_rows;
    r.t_draft = t2 - t1;
    r.t_verify = t3 - t2;
    if (drafted_.empty()) r.src = SRC_NONE;
    put(slots_.t_catchup, t_catchup_);
    update_(st_, n_st_, conf_.data(), static_cast<int64_t>(conf_.size()), m, r.t_draft - t_catchup_, r.t_verify);
    history_.insert(history_.end(), drafted_.begin(), drafted_.begin() + m);
    if (nxt >= 0) history_.push_back(nxt);  // -1: a probe whose drafts were all accepted
}

void Rounds::run_batch(size_t n_history, int draft_max, int left, int max_rounds) {
    if (pending_) {
        std::exception_ptr e = pending_;
        pending_ = nullptr;
        std::rethrow_exception(e);
    }
    if (!configured_) throw std::invalid_argument("configure() first");
    check_call(n_history);
    draft_max = std::max(0, draft_max);
    check_fits(draft_max);
    const llama_vocab* vocab = eog_vocab_ ? eog_vocab_ : llama_model_get_vocab(llama_get_model(tgt_.ctx));
    rec_tok_.clear();
    recs_.clear();
    double start = now_s();
    while (static_cast<int>(recs_.size()) < std::max(1, max_rounds)) {
        int room = tgt_.room();
        if (room < 1 || left < 1) break;
        RoundOut r;
        r.max_n = round_limit(draft_max, left, room);
        r.room = room;
        try {
            one_round(r.max_n, r);
        } catch (...) {
            if (recs_.empty()) throw;
            pending_ = std::current_exception();  // the engine sees the rounds before it first
            break;
        }
        r.first = static_cast<int>(rec_tok_.size());
        rec_tok_.insert(rec_tok_.end(), drafted_.begin(), drafted_.end());
        recs_.push_back(r);
        bool eog = r.nxt >= 0 && llama_vocab_is_eog(vocab, r.nxt);
        for (int i = 0; i < r.m && !eog; i++) eog = llama_vocab_is_eog(vocab, drafted_[i]);
        left -= r.m + (r.nxt >= 0);
        if (eog || *cancel_ || now_s() - start >= budget_s_) break;
    }
}

// --- drafting -------------------------------------------------------------------------

// d1..dk into drafted_, with the controller's confidence in each and whether it is a point proposal;
// returns the source that drafted (cands_ holds the lookup's proposals already)
int Rounds::draft(int max_n, double conf, int mode) {
    drafted_.clear();
    conf_.clear();
    point_.clear();
    int src = mode == POINT ? SRC_LOOKUP : mode == MODEL ? SRC_MODEL : SRC_NONE;
    if (mode == CHOOSE) {
        src = slots_.source >= 0 && slots_.source < n_st_ ? static_cast<int>(st_[slots_.source]) : SRC_ANY;
        if (src == SRC_ANY) src = !cands_.empty() || !dft_.ctx ? SRC_LOOKUP : SRC_MODEL;  // a baseline controller does not choose
        if (src == SRC_MODEL && !dft_.ctx) src = SRC_NONE;
    }
    if (src == SRC_LOOKUP) propose_point(max_n, conf);
    // a drafting model stops at model_max_ (hierarchical: the lookup's proposals are its guesses)
    if (src == SRC_MODEL) propose_model(std::min(max_n, model_max_), mode == MODEL);
    return src;
}

// tokens of the history the draft context lacks, but the last one
int Rounds::behind() const {
    size_t common = 0;
    size_t lim = std::min(dft_.tokens.size(), history_.size());
    while (common < lim && dft_.tokens[common] == history_[common]) common++;
    return static_cast<int>(history_.size() - 1 - std::min(common, history_.size() - 1));
}

void Rounds::add(llama_token tok, bool point, double conf) {
    drafted_.push_back(tok);
    point_.push_back(point);
    conf_.push_back(conf);
}

// the prediction's continuation into cands_ (and match_len_), where the answer follows it; false: it does not
bool Rounds::propose_reference(int max_n) {
    int len = static_cast<int>(history_.size());
    int n_answer = len - static_cast<int>(std::min(ref_prompt_, history_.size()));
    int match = 0;
    int expect = ref_expect_ + (len - ref_expect_len_);  // the answer moved on since the last alignment
    int at = reference_at(history_.data(), len, n_answer, ref_.data(), static_cast<int>(ref_.size()), expect, REF_MIN_MATCH,
                          MATCH_CAP, match);
    if (at < 0) return false;
    ref_expect_ = at;
    ref_expect_len_ = len;
    int end = std::min(static_cast<int>(ref_.size()), at + std::max(0, max_n));
    cands_.assign(ref_.begin() + at, ref_.begin() + end);
    match_len_ = match;
    return !cands_.empty();
}

// a pending offer already predicts this one's tokens wherever they overlap (the same copy,
// offered again a round later): counted once
bool Rounds::covered(size_t start, const std::vector<llama_token>& toks) const {
    for (const PendingOffer& o : offers_) {
        if (start <= o.start || start - o.start >= o.toks.size()) continue;
        size_t d = start - o.start, n = std::min(o.toks.size() - d, toks.size());
        if (std::equal(toks.begin(), toks.begin() + static_cast<std::ptrdiff_t>(n), o.toks.begin() + static_cast<std::ptrdiff_t>(d)))
            return true;
    }
    return false;
}

// report what the history now tells of each pending offer: its tokens the target has emitted since
// the last report (accepted, at their match lengths), and at its end (a token that differs from the
// offer, or every offered token emitted) the miss; resolved offers go. A long offer in a copy is thus
// learned from while the copy runs, not once it ends: a 60-token offer drafted nothing while its
// match classes waited for its last token (tests/test_hindsight.py)
void Rounds::see_offers() {
    size_t keep = 0;
    for (size_t i = 0; i < offers_.size(); i++) {
        PendingOffer& o = offers_[i];
        size_t n = o.toks.size(), r = o.reported;
        size_t lim = std::min(history_.size() - o.start, n);
        size_t m = r;
        while (m < lim && history_[o.start + m] == o.toks[m]) m++;
        auto report = [&](size_t offered, size_t matched) {
            hindsight_(st_, n_st_, o.match + static_cast<int64_t>(r), static_cast<int64_t>(offered), static_cast<int64_t>(matched));
        };
        if (m < lim || m == n) {
            report(n - r, m - r);
        } else {
            if (m > r) report(m - r, m - r);  // all of them emitted so far: accepted, no miss yet
            o.reported = m;
            if (keep != i) offers_[keep] = std::move(o);
            keep++;
        }
    }
    offers_.resize(keep);
}

// lookup: the controller cuts the proposals
void Rounds::propose_point(int max_n, double conf) {
    if (max_n <= 0 || cands_.empty() || !decide_(st_, n_st_, 0, 1.0)) return;
    int n = std::min(max_n, static_cast<int>(cands_.size()));
    for (int i = 0; i < n; i++) {
        if (i && !decide_(st_, n_st_, i, conf)) break;
        add(cands_[i], true, conf);
    }
}

// a drafter written in Python: one call gives the round's offer, begins the controller and proposes
void Rounds::propose_called(int max_n) {
    Called& c = called_;
    c.toks.clear();
    c.conf.clear();
    c.q.clear();
    c.offer.clear();
    c.t_catchup = 0.0;
    c.src = SRC_NONE;
    c.offer_match = 0;
    call_(history_.data() + call_seen_, history_.size() - call_seen_, max_n, rng_, c);
    call_seen_ = history_.size();
    int k = static_cast<int>(c.toks.size());
    if (k > std::max(0, max_n)) throw std::invalid_argument("the drafter proposed " + std::to_string(k) + " tokens, more than the " + std::to_string(max_n) + " asked for");
    if (c.conf.size() != c.toks.size() || (!c.q.empty() && c.q.size() != c.toks.size()))
        throw std::invalid_argument("the drafter's proposal has " + std::to_string(k) + " tokens but " + std::to_string(c.conf.size()) +
                                    " confidences and " + std::to_string(c.q.size()) + " distributions");
    drafted_.clear();
    conf_.clear();
    point_.clear();
    if (q_.size() < c.toks.size()) q_.resize(c.toks.size());
    for (int i = 0; i < k; i++) {
        llama_token t = c.toks[i];
        if (t < 0 || t >= tgt_.n_vocab) throw std::invalid_argument("the drafter proposed token " + std::to_string(t) + ", outside the vocabulary");
        bool point = c.q.empty() || c.q[i].empty();
        if (!point) {
            if (static_cast<int>(c.q[i].size()) != tgt_.n_vocab)
                throw std::invalid_argument("a draft distribution has " + std::to_string(c.q[i].size()) + " entries, not the vocabulary's " +
                                            std::to_string(tgt_.n_vocab));
            q_[i].all = true;
            q_[i].sup.clear();
            q_[i].v.assign(c.q[i].begin(), c.q[i].end());
        }
        add(t, point, c.conf[i]);
    }
    t_catchup_ = c.t_catchup;
    if (hindsight_ && !c.offer.empty() && !covered(history_.size(), c.offer))
        offers_.push_back(PendingOffer{history_.size(), c.offer, c.offer_match});
}

// (token, confidence) from a draft logit row; q_[j] is filled when sampling
llama_token Rounds::pick(const float* row, llama_token guess, size_t j, double& conf) {
    int n = dft_.n_vocab;
    if (sp_.greedy) {  // q is not needed: the confidence q(argmax) = 1 / sum_i exp(row[i] - row[argmax])
        int tok = argmax(row, n);
        conf = 1.0 / sum_exp_conf(row, n, row[tok]);
        return split_ ? vocab_[tok] : tok;  // the shared trunk drafts over V': its index i is target token vocab_[i]
    }
    if (split_) {  // q over the target's vocabulary: the V' row, -inf (q = 0) elsewhere (TrunkContext.logits)
        full_.assign(n_target_, -std::numeric_limits<float>::infinity());
        for (int i = 0; i < n; i++) full_[vocab_[i]] = row[i];
        row = full_.data();
        n = n_target_;
    }
    if (q_.size() <= j) q_.resize(j + 1);
    Dist& q = q_[j];
    probs_.compute(row, n, sp_, q);
    if (guess >= 0) {
        if (rng_.random() < q[guess]) {
            conf = q[guess];
            return guess;
        }
        int tok = sample(q, q.v.data(), guess, rng_, blocks_);  // q with the guess removed, if any mass is left
        if (tok >= 0) {
            conf = q[tok];
            return tok;
        }
    }
    int tok = sample(q, q.v.data(), -1, rng_, blocks_);
    conf = q[tok];
    return tok;
}

// a draft model: sync its cache with the history lazily, then draft token by token,
// taking the lookup's guesses (cands_) while they survive
void Rounds::propose_model(int max_n, bool guesses) {
    if (max_n <= 0 || !decide_(st_, n_st_, 0, 1.0)) return;
    static const std::vector<llama_token> no_guess;
    const std::vector<llama_token>& guess = guesses ? cands_ : no_guess;
    Ctx& d = dft_;
    size_t common = 0;
    size_t lim = std::min(d.tokens.size(), history_.size());
    while (common < lim && d.tokens[common] == history_[common]) common++;
    size_t n0 = std::min(common, history_.size() - 1);
    draft_trim(n0);
    feed_.assign(history_.begin() + n0, history_.end());
    int n_feed = static_cast<int>(feed_.size());
    int n_guess = std::max(0, std::min({max_n, d.room() - n_feed, static_cast<int>(guess.size())}));
    if (n_feed + n_guess > d.room()) return;
    if (n_feed > 1) {  // catching up on tokens emitted while it did not draft: timed apart (charged to resuming)
        double t0 = now_s();
        draft_decode(feed_.data(), n_feed - 1, 0);
        t_catchup_ = now_s() - t0;
        feed_.erase(feed_.begin(), feed_.end() - 1);
    }
    feed_.insert(feed_.end(), guess.begin(), guess.begin() + n_guess);
    draft_decode(feed_.data(), static_cast<int>(feed_.size()), n_guess + 1);
    int n_rows = n_guess + 1;
    int row_ofs = 0;  // rows[j] is the logit row (j - row_ofs) of the last decode
    while (true) {
        int j = static_cast<int>(drafted_.size());  // rows[j] is the distribution after history + drafts
        llama_token g = j < n_guess ? guess[j] : -1;
        double conf = 0.0;
        llama_token tok = pick(d.row(j - row_ofs), g, j, conf);
        add(tok, false, conf);
        if (static_cast<int>(drafted_.size()) >= max_n || !decide_(st_, n_st_, drafted_.size(), conf)) break;
        if (tok == g && j + 1 < n_rows) continue;  // the next row was computed with g in place
        draft_trim(history_.size() + j);  // drop the guesses from j on: the KV holds history + drafts[:-1]
        n_guess = std::min(n_guess, j);
        if (d.room() < 1) break;
        draft_decode(&tok, 1, 1);
        n_rows = j + 2;
        row_ofs = j + 1;
    }
}

// --- verification ---------------------------------------------------------------------

// --- set-up and checks ----------------------------------------------------------------

Rounds::Rounds(uintptr_t target, int target_batch, uintptr_t draft, int draft_batch, uintptr_t f_begin, uintptr_t f_decide,
               uintptr_t f_update, int no_bonus_slot)
    : no_bonus_slot_(no_bonus_slot) {
    if (!target) throw std::invalid_argument("the target context is closed (null pointer)");
    if (!f_begin || !f_decide || !f_update) throw std::invalid_argument("the controller kernels are null pointers");
    if (target_batch < 1 || (draft && draft_batch < 1)) throw std::invalid_argument("batch sizes must be >= 1");
    tgt_.open(target, target_batch);
    if (draft) {
        dft_.open(draft, draft_batch);
        if (dft_.n_vocab != tgt_.n_vocab) {
            close();
            throw std::invalid_argument("the draft and target vocabularies differ in size");
        }
    }
    begin_ = reinterpret_cast<begin_fn>(f_begin);
    decide_ = reinterpret_cast<decide_fn>(f_decide);
    update_ = reinterpret_cast<update_fn>(f_update);
}

void Rounds::close() {
    tgt_.close();
    dft_.close();
}

void Rounds::set_lookup(int ngram_min, int ngram_max) {
    if (ngram_max < 0 || (ngram_max > 0 && (ngram_min < 1 || ngram_min > ngram_max)))
        throw std::invalid_argument("lookup n-grams need 1 <= ngram_min <= ngram_max (or 0, 0 to turn it off)");
    ngram_min_ = ngram_min;
    ngram_max_ = ngram_max;
}

void Rounds::configure(double* state, int64_t n_state, int mode, const Sampling& sp, uint64_t rng_state, double budget_s,
                       const volatile uint8_t* cancel) {
    check_mode(mode);
    st_ = state;
    n_st_ = n_state;
    mode_ = mode;
    sp_ = sp;
    rng_ = TokenRng{rng_state};
    budget_s_ = budget_s;
    cancel_ = cancel;
    configured_ = true;
}

void Rounds::check_call(size_t n_history) {
    open_target();
    if (history_.empty()) throw std::invalid_argument("set_history() first: the round continues a history");
    if (n_history != history_.size())
        throw std::invalid_argument("the history has " + std::to_string(n_history) + " tokens but the round loop holds " +
                                    std::to_string(history_.size()) + ": set_history() after changing it");
    check_mode(mode_);
}

void Rounds::check_mode(int mode) const {
    if (mode < NONE || mode > CALL)
        throw std::invalid_argument("mode must be 0 (none), 1 (lookup), 2 (draft model), 3 (the controller chooses) or 4 (a call)");
    if (mode == MODEL && !dft_.ctx) throw std::invalid_argument("mode 2 needs a draft context");
    if (mode == CALL && !call_) throw std::invalid_argument("mode 4 needs set_call() first");
}

void Rounds::check_fits(int max_n) const {
    if (max_n + 1 > tgt_.n_batch)
        throw std::invalid_argument("a draft of up to " + std::to_string(max_n) + " tokens plus the last one does not fit " +
                                    "the target's batch of " + std::to_string(tgt_.n_batch) + ": lower draft_max or raise n_batch");
}

Ctx& Rounds::side(int which) {
    if (which != 0 && which != 1) throw std::invalid_argument("which must be 0 (target) or 1 (draft)");
    Ctx& c = which == 0 ? tgt_ : dft_;
    if (!c.ctx) throw std::invalid_argument(which == 0 ? "the target context is closed" : "there is no draft context");
    return c;
}

Ctx& Rounds::open_target() {
    if (!tgt_.ctx) throw std::invalid_argument("this round loop is closed");
    return tgt_;
}

}  // namespace eesd
