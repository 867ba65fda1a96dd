// eesd_local._native: one speculative round (draft, ONE batched verify, accept, KV rollback)
// in C++, against the libllama that llama-cpp-python loaded. The contexts belong to
// Python (their pointers arrive as integers); the controller is the Numba code of
// eesd_local.controllers, called through cfunc pointers on its float64 state array.
// Every step mirrors the Python loop (engine.py, sampling.py, drafters/model.py) so that
// both give the same tokens: same decode calls, same maths, same random stream.

#include <llama.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace py = pybind11;

#ifndef EESD_LLAMA_CPP_VERSION
#error "EESD_LLAMA_CPP_VERSION must name the llama-cpp-python version this is built against"
#endif

namespace {

// a KV cache or a llama_decode that cannot take the tokens (Python: ContextFullError)
struct ContextFull : std::runtime_error {
    using std::runtime_error::runtime_error;
};

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// splitmix64 (Steele, Lea, Flood), bit-identical to eesd_local.sampling.TokenRNG:
// uniform = (z >> 11) * 2**-53, so every double in [0, 1) on the 2**-53 grid
struct TokenRng {
    uint64_t s;
    double random() {
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        return static_cast<double>(z >> 11) * 0x1.0p-53;
    }
};

// numpy's pairwise summation of a contiguous float64 array (np.sum), so sums agree to the bit
double pairwise_sum(const double* a, size_t n) {
    if (n < 8) {
        double res = 0.0;
        for (size_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        size_t i = 8;
        for (; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    size_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

struct Sampling {
    bool greedy;
    double temperature;  // 0: greedy
    int top_k;           // 0: off
    double top_p;        // 1: off
};

constexpr int TOP_P_CANDIDATES = 2048;  // as sampling._TOP_P_CANDIDATES

// Processing of logits into p, exactly as eesd_local.sampling.probs.
struct Probs {
    std::vector<double> x, tmp, mass;
    std::vector<int> keep, cand, order;

    // the k largest of x; at the boundary value the lowest indices win (sampling._top_indices)
    void top_indices(int n, int k, std::vector<int>& out) {
        tmp.assign(x.begin(), x.begin() + n);
        std::nth_element(tmp.begin(), tmp.begin() + (n - k), tmp.end());
        double thr = tmp[n - k];
        out.clear();
        for (int i = 0; i < n; i++)
            if (x[i] > thr) out.push_back(i);
        int need = k - static_cast<int>(out.size());
        for (int i = 0; i < n && need > 0; i++)
            if (x[i] == thr) out.push_back(i), need--;
    }

    // smallest set by descending logit (ties: lower index) whose softmax mass reaches top_p
    void top_p_set(int n, const std::vector<int>* candidates, double top_p, std::vector<int>& out) {
        double m = *std::max_element(x.begin(), x.begin() + n);
        tmp.resize(n);
        for (int i = 0; i < n; i++) tmp[i] = std::exp(x[i] - m);
        double total = pairwise_sum(tmp.data(), n);
        order.clear();
        if (candidates) {
            order = *candidates;
            std::sort(order.begin(), order.end());
        } else {
            for (int i = 0; i < n; i++) order.push_back(i);
        }
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return -x[a] < -x[b]; });
        // np.cumsum is sequential; searchsorted (left) finds the first mass >= top_p
        double acc = 0.0;
        size_t cut = order.size() + 1;
        for (size_t i = 0; i < order.size(); i++) {
            acc += std::exp(x[order[i]] - m);
            if (acc / total >= top_p) {
                cut = i + 1;
                break;
            }
        }
        if (cut > order.size()) {  // the candidates do not hold top_p of the mass: use everything
            if (candidates) return top_p_set(n, nullptr, top_p, out);
            out = order;
            return;
        }
        out.assign(order.begin(), order.begin() + cut);
    }

    void compute(const float* logits, int n, const Sampling& sp, std::vector<double>& out) {
        x.resize(n);
        for (int i = 0; i < n; i++) x[i] = static_cast<double>(logits[i]);
        bool all = true;
        if (sp.top_k > 0 && sp.top_k < n) {
            top_indices(n, sp.top_k, keep);
            all = false;
        }
        if (sp.top_p < 1.0) {
            const std::vector<int>* c = nullptr;
            if (!all) {
                cand = keep;
                c = &cand;
            } else if (n > TOP_P_CANDIDATES) {
                top_indices(n, TOP_P_CANDIDATES, cand);
                c = &cand;
            }
            top_p_set(n, c, sp.top_p, keep);
            all = false;
        }
        double t = sp.temperature > 0 ? sp.temperature : 1.0;
        out.assign(n, 0.0);
        if (all) {
            double m = *std::max_element(x.begin(), x.end());
            for (int i = 0; i < n; i++) out[i] = std::exp((x[i] - m) / t);
        } else {
            double m = -INFINITY;
            for (int i : keep) m = std::max(m, x[i]);
            for (int i : keep) out[i] = std::exp((x[i] - m) / t);
        }
        double s = pairwise_sum(out.data(), n);
        for (int i = 0; i < n; i++) out[i] /= s;
    }
};

// inverse CDF over the support of p, as sampling.sample
int sample(const std::vector<double>& p, TokenRng& rng, std::vector<double>& cdf, std::vector<int>& idx) {
    cdf.clear();
    idx.clear();
    double acc = 0.0;
    for (size_t i = 0; i < p.size(); i++) {
        if (p[i] != 0.0) {
            acc += p[i];
            cdf.push_back(acc);
            idx.push_back(static_cast<int>(i));
        }
    }
    double u = rng.random() * cdf.back();
    size_t i = std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin();  // searchsorted side="right"
    return idx[std::min(i, idx.size() - 1)];
}

// p / sum(p), the normalisation numpy does before sampling a residual
void normalise(std::vector<double>& p) {
    double s = pairwise_sum(p.data(), p.size());
    for (double& v : p) v /= s;
}

// first index of the largest logit, as np.argmax: a vectorised max, then a scan for it
int argmax(const float* row, int n) {
    float best = row[0];
    int i = 0;
#if defined(__SSE2__)
    if (n >= 16) {
        __m128 m0 = _mm_loadu_ps(row), m1 = m0, m2 = m0, m3 = m0;
        for (; i + 16 <= n; i += 16) {
            m0 = _mm_max_ps(m0, _mm_loadu_ps(row + i));
            m1 = _mm_max_ps(m1, _mm_loadu_ps(row + i + 4));
            m2 = _mm_max_ps(m2, _mm_loadu_ps(row + i + 8));
            m3 = _mm_max_ps(m3, _mm_loadu_ps(row + i + 12));
        }
        float lanes[4];
        _mm_storeu_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
        best = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
    }
#endif
    for (; i < n; i++)
        if (row[i] > best) best = row[i];
    for (int j = 0; j < n; j++)
        if (row[j] == best) return j;
    return 0;
}

// One llama context with seq 0 and a record of what its KV cache holds (runtime.Context).
struct Ctx {
    llama_context* ctx = nullptr;
    llama_memory_t mem = nullptr;
    llama_batch batch{};
    int n_batch = 0, n_ctx = 0, n_vocab = 0;
    int out_base = 0;
    std::vector<llama_token> tokens;

    void open(uintptr_t ptr, int batch_size) {
        ctx = reinterpret_cast<llama_context*>(ptr);
        mem = llama_get_memory(ctx);
        n_batch = batch_size;
        n_ctx = static_cast<int>(llama_n_ctx(ctx));
        n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
        batch = llama_batch_init(n_batch, 0, 1);
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

    // append toks with logits for the last n_logits, in n_batch chunks (Context.decode)
    void decode(const llama_token* toks, int n, int n_logits, double& t_llama) {
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
            for (int i = 0; i < size; i++) {
                batch.token[i] = toks[start + i];
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

using begin_fn = void (*)(double*, int64_t);
using decide_fn = int64_t (*)(double*, int64_t, int64_t, double);
using update_fn = void (*)(double*, int64_t, double*, int64_t, int64_t, double, double);

using StateArray = py::array_t<double, py::array::c_style>;  // no forcecast: the controller's own array, written in place

enum Mode { NONE = 0, POINT = 1, MODEL = 2 };  // no drafter; fixed proposals (lookup); a draft model

// The round loop's state between calls: both contexts, the history, scratch buffers.
class Rounds {
  public:
    Rounds(uintptr_t target, int target_batch, uintptr_t draft, int draft_batch, uintptr_t f_begin,
           uintptr_t f_decide, uintptr_t f_update) {
        if (!target) throw py::value_error("the target context is closed (null pointer)");
        if (!f_begin || !f_decide || !f_update) throw py::value_error("the controller kernels are null pointers");
        if (target_batch < 1 || (draft && draft_batch < 1)) throw py::value_error("batch sizes must be >= 1");
        tgt_.open(target, target_batch);
        if (draft) {
            dft_.open(draft, draft_batch);
            if (dft_.n_vocab != tgt_.n_vocab) {
                close();
                throw py::value_error("the draft and target vocabularies differ in size");
            }
        }
        begin_ = reinterpret_cast<begin_fn>(f_begin);
        decide_ = reinterpret_cast<decide_fn>(f_decide);
        update_ = reinterpret_cast<update_fn>(f_update);
    }
    ~Rounds() { close(); }

    void close() {
        tgt_.close();
        dft_.close();
    }

    void set_tokens(int which, std::vector<llama_token> toks) { side(which).tokens = std::move(toks); }
    // llama.cpp pads the KV size; the engine holds a context to the n_ctx it asked for
    void limit(int which, int n_ctx) { side(which).n_ctx = std::min(side(which).n_ctx, n_ctx); }
    std::vector<llama_token> tokens(int which) { return side(which).tokens; }
    void set_history(std::vector<llama_token> h) { history_ = std::move(h); }
    int room() { return open_target().room(); }

    // One round; returns (drafted tokens, accepted m, next token, t_draft, t_verify, t_llama, rng state).
    py::tuple run(StateArray state, size_t n_history, int max_n, int mode, std::vector<llama_token> cands, double cand_conf,
                  double temperature, int top_k, double top_p, uint64_t rng_state) {
        open_target();
        if (history_.empty()) throw py::value_error("set_history() first: the round continues a history");
        if (n_history != history_.size())
            throw py::value_error(("the history has " + std::to_string(n_history) + " tokens but the round loop holds " +
                                   std::to_string(history_.size()) + ": set_history() after changing it").c_str());
        if (mode < NONE || mode > MODEL) throw py::value_error("mode must be 0 (none), 1 (lookup) or 2 (draft model)");
        if (mode == MODEL && !dft_.ctx) throw py::value_error("mode 2 needs a draft context");
        max_n = std::max(0, max_n);
        if (max_n + 1 > tgt_.n_batch)
            throw py::value_error(("a draft of up to " + std::to_string(max_n) + " tokens plus the last one does not fit "
                                   "the target's batch of " + std::to_string(tgt_.n_batch) +
                                   ": lower draft_max or raise n_batch").c_str());
        for (llama_token t : cands)
            if (t < 0 || t >= tgt_.n_vocab) throw py::value_error(("proposed token " + std::to_string(t) + " is outside the vocabulary").c_str());
        Sampling sp{temperature == 0.0, temperature, top_k, top_p};
        TokenRng rng{rng_state};
        if (state.ndim() != 1) throw py::value_error("the controller state must be a 1-d float64 array");
        double* st = state.mutable_data();
        int64_t n_st = static_cast<int64_t>(state.shape(0));
        int m = 0, nxt = 0;
        double t_draft, t_verify, t_llama = 0.0;
        {
            py::gil_scoped_release unlocked;
            begin_(st, n_st);
            double t1 = now_s();
            drafted_.clear();
            conf_.clear();
            point_.clear();
            if (mode == POINT) propose_point(st, n_st, max_n, cands, cand_conf);
            if (mode == MODEL) propose_model(st, n_st, max_n, cands, sp, rng, t_llama);
            double t2 = now_s();
            int k = static_cast<int>(drafted_.size());
            size_t n_keep = tgt_.tokens.size() + 1;  // the cache keeps `last` ...
            batch_.assign(1, history_.back());
            batch_.insert(batch_.end(), drafted_.begin(), drafted_.end());
            tgt_.decode(batch_.data(), k + 1, k + 1, t_llama);
            if (sp.greedy)
                verify_greedy(k, m, nxt);
            else
                verify_sampled(k, sp, rng, m, nxt);
            tgt_.trim(n_keep + m);  // ... and the accepted drafts; the rest is rolled back
            double t3 = now_s();
            t_draft = t2 - t1;
            t_verify = t3 - t2;
            update_(st, n_st, conf_.data(), static_cast<int64_t>(conf_.size()), m, t_draft, t_verify);
            history_.insert(history_.end(), drafted_.begin(), drafted_.begin() + m);
            history_.push_back(nxt);
        }
        return py::make_tuple(drafted_, m, nxt, t_draft, t_verify, t_llama, rng.s);
    }

  private:
    Ctx tgt_, dft_;
    begin_fn begin_;
    decide_fn decide_;
    update_fn update_;
    std::vector<llama_token> history_, drafted_, batch_, feed_;
    std::vector<double> conf_, p_, resid_, cdf_;
    std::vector<std::vector<double>> q_;  // q of each drafted token (sampling with a draft model)
    std::vector<char> point_;             // 1: the token was proposed deterministically (q = point mass)
    std::vector<int> idx_;
    Probs probs_;

    Ctx& side(int which) {
        if (which != 0 && which != 1) throw py::value_error("which must be 0 (target) or 1 (draft)");
        Ctx& c = which == 0 ? tgt_ : dft_;
        if (!c.ctx) throw py::value_error(which == 0 ? "the target context is closed" : "there is no draft context");
        return c;
    }
    Ctx& open_target() {
        if (!tgt_.ctx) throw py::value_error("this round loop is closed");
        return tgt_;
    }

    void add(llama_token tok, bool point, double conf) {
        drafted_.push_back(tok);
        point_.push_back(point);
        conf_.push_back(conf);
    }

    // lookup: the proposals arrive from Python; the controller cuts them (LookupDrafter.propose)
    void propose_point(double* st, int64_t n_st, int max_n, const std::vector<llama_token>& cands, double conf) {
        if (max_n <= 0 || !decide_(st, n_st, 0, 1.0)) return;
        int n = std::min(max_n, static_cast<int>(cands.size()));
        for (int i = 0; i < n; i++) {
            if (i && !decide_(st, n_st, i, conf)) break;
            add(cands[i], true, conf);
        }
    }

    // (token, confidence) from a draft logit row; q_[j] is filled when sampling (drafters/model.pick)
    llama_token pick(const float* row, llama_token guess, const Sampling& sp, TokenRng& rng, size_t j, double& conf) {
        int n = dft_.n_vocab;
        if (sp.greedy) {
            int tok = argmax(row, n);
            resid_.resize(n);
            for (int i = 0; i < n; i++) resid_[i] = std::exp(static_cast<double>(row[i]) - static_cast<double>(row[tok]));
            conf = 1.0 / pairwise_sum(resid_.data(), n);
            return tok;
        }
        if (q_.size() <= j) q_.resize(j + 1);
        std::vector<double>& q = q_[j];
        probs_.compute(row, n, sp, q);
        if (guess >= 0) {
            if (rng.random() < q[guess]) {
                conf = q[guess];
                return guess;
            }
            resid_ = q;
            resid_[guess] = 0.0;
            if (pairwise_sum(resid_.data(), n) > 0) {
                normalise(resid_);
                int tok = sample(resid_, rng, cdf_, idx_);
                conf = q[tok];
                return tok;
            }
        }
        int tok = sample(q, rng, cdf_, idx_);
        conf = q[tok];
        return tok;
    }

    // a draft model: sync its cache with the history lazily, then draft token by token,
    // taking lookup guesses while they survive (ModelDrafter.propose)
    void propose_model(double* st, int64_t n_st, int max_n, const std::vector<llama_token>& guess, const Sampling& sp,
                       TokenRng& rng, double& t_llama) {
        if (max_n <= 0 || !decide_(st, n_st, 0, 1.0)) return;
        Ctx& d = dft_;
        size_t common = 0;
        size_t lim = std::min(d.tokens.size(), history_.size());
        while (common < lim && d.tokens[common] == history_[common]) common++;
        size_t n0 = std::min(common, history_.size() - 1);
        d.trim(n0);
        feed_.assign(history_.begin() + n0, history_.end());
        int n_feed = static_cast<int>(feed_.size());
        int n_guess = std::max(0, std::min({max_n, d.room() - n_feed, static_cast<int>(guess.size())}));
        if (n_feed + n_guess > d.room()) return;
        feed_.insert(feed_.end(), guess.begin(), guess.begin() + n_guess);
        d.decode(feed_.data(), static_cast<int>(feed_.size()), n_guess + 1, t_llama);
        int n_rows = n_guess + 1;
        int row_ofs = 0;  // rows[j] is the logit row (j - row_ofs) of the last decode
        while (true) {
            int j = static_cast<int>(drafted_.size());  // rows[j] is the distribution after history + drafts
            llama_token g = j < n_guess ? guess[j] : -1;
            double conf = 0.0;
            llama_token tok = pick(d.row(j - row_ofs), g, sp, rng, j, conf);
            add(tok, false, conf);
            if (static_cast<int>(drafted_.size()) >= max_n || !decide_(st, n_st, drafted_.size(), conf)) break;
            if (tok == g && j + 1 < n_rows) continue;  // the next row was computed with g in place
            d.trim(history_.size() + j);  // drop the guesses from j on: the KV holds history + drafts[:-1]
            n_guess = std::min(n_guess, j);
            if (d.room() < 1) break;
            d.decode(&tok, 1, 1, t_llama);
            n_rows = j + 2;
            row_ofs = j + 1;
        }
    }

    void verify_greedy(int k, int& m, int& nxt) {
        for (int i = 0; i <= k; i++) {
            int best = argmax(tgt_.row(i), tgt_.n_vocab);
            if (i == k || best != drafted_[i]) {
                m = i;
                nxt = best;
                return;
            }
        }
    }

    // speculative sampling over k drafts (sampling.verify_sampled):
    // accept d with probability min(1, p(d)/q(d)); else sample max(0, p - q) normalised;
    // all accepted: a bonus token from p_{k+1}
    void verify_sampled(int k, const Sampling& sp, TokenRng& rng, int& m, int& nxt) {
        int n = tgt_.n_vocab;
        for (int i = 0; i < k; i++) {
            llama_token d = drafted_[i];
            probs_.compute(tgt_.row(i), n, sp, p_);
            double qd = point_[i] ? 1.0 : q_[i][d];
            if (qd <= 0.0)
                throw std::domain_error("draft " + std::to_string(d) + " has zero draft probability: the drafter must sample from its q");
            if (rng.random() < std::min(1.0, p_[d] / qd)) continue;  // q(d) <= p(d): always accept
            if (point_[i]) {
                resid_ = p_;
                resid_[d] = 0.0;  // max(0, p - onehot(d))
            } else {
                resid_.resize(n);
                for (int v = 0; v < n; v++) resid_[v] = std::max(p_[v] - q_[i][v], 0.0);
            }
            if (pairwise_sum(resid_.data(), n) <= 0.0) resid_ = p_;  // p == q up to rounding
            normalise(resid_);
            m = i;
            nxt = sample(resid_, rng, cdf_, idx_);
            return;
        }
        probs_.compute(tgt_.row(k), n, sp, p_);
        m = k;
        nxt = sample(p_, rng, cdf_, idx_);
    }
};

// sampling.probs in C++, for tests that the two agree bit for bit
py::array_t<double> probs_py(py::array_t<float, py::array::c_style | py::array::forcecast> logits, double temperature, int top_k,
                             double top_p) {
    if (logits.ndim() != 1 || logits.shape(0) < 1) throw py::value_error("logits must be a non-empty 1-d array");
    int n = static_cast<int>(logits.shape(0));
    std::vector<double> out;
    Probs pr;
    pr.compute(logits.data(), n, Sampling{temperature == 0.0, temperature, top_k, top_p}, out);
    py::array_t<double> res(n);
    std::copy(out.begin(), out.end(), res.mutable_data());
    return res;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "The speculative round of eesd_local in C++ against llama-cpp-python's libllama";
    m.attr("LLAMA_CPP_VERSION") = EESD_LLAMA_CPP_VERSION;
    // libllama's ABI changes between llama-cpp-python releases: refuse any other one
    auto have = py::module_::import("llama_cpp").attr("__version__").cast<std::string>();
    if (have != EESD_LLAMA_CPP_VERSION)
        throw py::import_error(std::string("eesd_local._native was built for llama-cpp-python ") + EESD_LLAMA_CPP_VERSION +
                               " but " + have + " is installed: rebuild it with `pip install --no-build-isolation -e .`");
    py::register_exception<ContextFull>(m, "ContextFull", PyExc_RuntimeError);

    py::class_<Rounds>(m, "Rounds")
        .def(py::init<uintptr_t, int, uintptr_t, int, uintptr_t, uintptr_t, uintptr_t>(), py::arg("target"),
             py::arg("target_batch"), py::arg("draft"), py::arg("draft_batch"), py::arg("begin"), py::arg("decide"),
             py::arg("update"))
        .def("set_tokens", &Rounds::set_tokens, py::arg("which"), py::arg("tokens"), "Record what a KV cache holds (0 target, 1 draft).")
        .def("limit", &Rounds::limit, py::arg("which"), py::arg("n_ctx"), "Hold a context to fewer positions than its KV size.")
        .def("tokens", &Rounds::tokens, py::arg("which"), "What a KV cache holds, position by position.")
        .def("set_history", &Rounds::set_history, py::arg("history"), "The emitted history the next round continues.")
        .def("room", &Rounds::room, "How many more tokens fit into the target context.")
        .def("run", &Rounds::run, py::arg("state"), py::arg("n_history"), py::arg("max_n"), py::arg("mode"), py::arg("cands"),
             py::arg("cand_conf"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("rng_state"),
             "One round: (drafted, accepted, next token, t_draft, t_verify, t_llama, rng state).")
        .def("close", &Rounds::close, "Free the batches; the contexts stay with Python.");
    m.def("probs", &probs_py, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"));
}
