// The rules of a round that do not touch a context, written once: the lookup's match, the
// target's first token, greedy and speculative-sampling verification. The round loop
// (rounds.cpp) calls them on its contexts' rows; module.cpp binds them for the tests, which
// hold them to slow, obvious references (tests/reference.py).
#pragma once

#include <llama.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "probs.hpp"
#include "simd.hpp"

namespace eesd {

// a lookup match is measured up to this many tokens (the controller's longest class: 64 and more)
constexpr int MATCH_CAP = 64;

// Prompt lookup over the history h[0..len): out = the tokens (at most max_n) after the latest
// earlier end e <= len-2 of the longest suffix n-gram, n from ngram_max down to ngram_min;
// returns n (0: no match). match_len: how many tokens before the continuation agree with the
// history's end (n and on, up to MATCH_CAP); an ambiguous n-gram (an earlier occurrence went on
// with another token) counts as a one-token match: its latest continuation is a guess between them.
// One backward scan: L(e) = how many tokens ending at e match the suffix (capped at ngram_max);
// the first e met with a new largest L is the latest end of that n-gram.
inline int lookup_match(const llama_token* h, int len, int ngram_min, int ngram_max, int max_n, std::vector<llama_token>& out,
                        int& match_len) {
    out.clear();
    match_len = 0;
    int cap = std::min(ngram_max, len), best_n = 0, best_e = -1;
    for (int e = len - 2; e >= 0 && best_n < cap; e--) {
        int l = 0;
        while (l < cap && l <= e && h[e - l] == h[len - 1 - l]) l++;
        if (l > best_n && l >= ngram_min) best_n = l, best_e = e;
    }
    if (best_e < 0) return 0;
    int l = best_n;
    while (l < MATCH_CAP && best_e - l >= 0 && h[best_e - l] == h[len - 1 - l]) l++;
    match_len = l;
    for (int e = best_e - 1; l > 1 && e >= best_n - 1; e--) {
        if (h[e + 1] == h[best_e + 1]) continue;
        int k = 0;
        while (k < best_n && h[e - k] == h[len - 1 - k]) k++;
        if (k == best_n) {
            match_len = 1;
            break;
        }
    }
    int end = std::min(len, best_e + 1 + std::max(0, max_n));
    out.assign(h + best_e + 1, h + end);
    return best_n;
}

// A predicted continuation (OpenAI's predicted outputs): where in ref[0..rlen) the history h[0..len) goes on.
// aligned: the answer so far (n_answer tokens, the end of h) is ref's start: it goes on at n_answer, and its
// match is the whole answer. Else the longest suffix of h (at least min_match tokens, measured up to cap)
// that ends somewhere in ref: ties go to the end nearest to `expect` (where the last alignment said the
// answer would be now). Returns where it goes on (-1: nowhere); match: the match's length.
inline int reference_at(const llama_token* h, int len, int n_answer, const llama_token* r, int rlen, int expect, int min_match,
                        int cap, int& match) {
    match = 0;
    if (n_answer <= rlen && std::equal(h + len - n_answer, h + len, r)) {
        match = std::min(cap, std::max(n_answer, 1));
        return n_answer < rlen ? n_answer : -1;
    }
    int best = -1, best_l = 0;
    for (int e = 0; e + 1 < rlen; e++) {  // ref[e] matches the history's last token: goes on at e + 1
        int l = 0;
        while (l < cap && l <= e && l < len && r[e - l] == h[len - 1 - l]) l++;
        if (l < min_match) continue;
        if (l > best_l || (l == best_l && std::abs(e + 1 - expect) < std::abs(best - expect))) best_l = l, best = e + 1;
    }
    match = best_l;
    return best;
}

// the confidence of a matched n-gram, strictly inside (0, 1) so the controller tells it from "unknown"
inline double match_confidence(int n, int ngram_max) { return n > 0 ? n / (ngram_max + 1.0) : 0.0; }

// Verification of d1..dk against the target's rows (rows(i): the logits after [last, d1..di]),
// with the scratch it reuses from round to round.
struct Verifier {
    Dist p;
    std::vector<double> resid, blocks;
    Probs probs;

    // a token from one row: the argmax when greedy, else a draw from p (the prompt's first token)
    int pick(const float* row, int n, const Sampling& sp, TokenRng& rng) {
        if (sp.greedy) return argmax(row, n);
        probs.compute(row, n, sp, p);
        return sample(p, p.v.data(), -1, rng, blocks);
    }

    // greedy: accept while d_i is the target's argmax; the first mismatch's argmax is the next token.
    // Without the bonus (a probe: the target saw [last, d1..d(k-1)], k rows) all k accepted gives nxt -1.
    template <class Rows>
    static void greedy(Rows rows, int n, const llama_token* drafts, int k, bool bonus, int& m, int& nxt) {
        for (int i = 0; i <= k; i++) {
            if (i == k && !bonus) {
                m = k;
                nxt = -1;
                return;
            }
            int best = argmax(rows(i), n);
            if (i == k || best != drafts[i]) {
                m = i;
                nxt = best;
                return;
            }
        }
    }

    // speculative sampling: accept d with probability min(1, p(d)/q(d)); else sample max(0, p - q)
    // normalised (p without d for a point proposal, q = onehot(d)); all accepted: a bonus token from
    // p_{k+1}, or none for a probe (each emitted token is still distributed as the target's)
    template <class Rows>
    void sampled(Rows rows, int n, const Sampling& sp, const llama_token* drafts, const char* point, const std::vector<Dist>& q,
                 int k, bool bonus, TokenRng& rng, int& m, int& nxt) {
        for (int i = 0; i < k; i++) {
            llama_token d = drafts[i];
            probs.compute(rows(i), n, sp, p);
            double qd = point[i] ? 1.0 : q[i][d];
            if (qd <= 0.0)
                throw std::domain_error("draft " + std::to_string(d) + " has zero draft probability: the drafter must sample from its q");
            if (rng.random() < std::min(1.0, p[d] / qd)) continue;  // q(d) <= p(d): always accept
            int tok;
            if (point[i]) {
                tok = sample(p, p.v.data(), d, rng, blocks);  // max(0, p - onehot(d)): p without d
            } else {
                // max(0, p - q) is zero wherever p is: only p's support is written and read
                resid.resize(n);
                const double* pv = p.v.data();
                const double* qv = q[i].v.data();
                double* r = resid.data();
                if (p.all) {
#pragma omp simd
                    for (int v = 0; v < n; v++) r[v] = std::max(pv[v] - qv[v], 0.0);
                } else {
                    for (int v : p.sup) r[v] = std::max(pv[v] - qv[v], 0.0);
                }
                tok = sample(p, r, -1, rng, blocks);
            }
            if (tok < 0) tok = sample(p, p.v.data(), -1, rng, blocks);  // p == q up to rounding: p itself
            m = i;
            nxt = tok;
            return;
        }
        m = k;
        if (!bonus) {
            nxt = -1;
            return;
        }
        probs.compute(rows(k), n, sp, p);
        nxt = sample(p, p.v.data(), -1, rng, blocks);
    }
};

}  // namespace eesd
