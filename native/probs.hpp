// Sampling distributions over the vocabulary: top-k, top-p (on the logits at temperature 1),
// temperature, the inverse-CDF draw, and the token sampler's random stream. Every tie rule and
// cut-off is stated again, slowly, in the NumPy reference (tests/reference.py) that the tests hold
// this to.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "simd.hpp"

namespace eesd {

// splitmix64 (Steele, Lea, Flood), bit-identical to eesd_local.speculative.sampling.TokenRNG:
// uniform = (z >> 11) * 2**-53, so every double in [0, 1) on the 2**-53 grid
struct TokenRng {
    uint64_t s;
    uint64_t next() {
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double random() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
};

struct Sampling {
    bool greedy;
    double temperature;  // 0: greedy
    int top_k;           // 0: off
    double top_p;        // 1: off
};

// the settings of SamplingParams: temperature 0 is greedy
inline Sampling sampling_of(double temperature, int top_k, double top_p) { return Sampling{temperature == 0.0, temperature, top_k, top_p}; }

// top-p without top-k: logits binned 1/32 nat wide below the largest, the last bin takes the rest
// (as sampling._TOP_P_BINS, _TOP_P_BINS_PER_NAT)
constexpr int TOP_P_BINS = 2048;
constexpr double TOP_P_BINS_PER_NAT = 32.0;

inline int top_p_bin(float x, double m) {
    double b = (m - static_cast<double>(x)) * TOP_P_BINS_PER_NAT;  // as numpy: float64 maths, then truncation
    return b < TOP_P_BINS - 1 ? static_cast<int>(b) : TOP_P_BINS - 1;
}

// A distribution over the vocabulary, as sampling.probs returns it: v[i] = p(i), zero outside
// the support. The support is either everything (all) or the index-sorted list sup: then only
// those entries were written, and the next compute zeroes just them again.
struct Dist {
    std::vector<double> v;
    std::vector<int> sup;
    bool all = true;

    double operator[](int i) const { return v[i]; }
    int size() const { return all ? static_cast<int>(v.size()) : static_cast<int>(sup.size()); }
    int at(int j) const { return all ? j : sup[j]; }  // the j-th token of the support, by index
};

// Processing of logits into p: top-k, top-p (on the logits at temperature 1), temperature,
// in the order and with the tie rules of eesd_local.speculative.sampling.probs.
struct Probs {
    std::vector<int> idx, keep, order, part_;
    std::vector<float> vals;
    std::vector<double> w_, bins_, dense_;
    std::vector<int> cbin_;

    // scratch buffers only grow (resize would zero what it adds, every time a longer row comes)
    template <class T>
    static void grow(std::vector<T>& v, size_t n) {
        if (v.size() < n) v.resize(n);
    }

    // order of _top_p: larger logit first, among equal logits the lower index
    static bool before(const float* row, int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); }

    // indices (sorted) of the k largest logits, 0 < k < n; at the k-th value the lowest indices
    // win (sampling._top_indices). Only the values >= a threshold t go through nth_element: t is
    // read off a strided sample so that about 2k values pass, and checked (count >= k) before use.
    void top_indices(const float* row, int n, int k, std::vector<int>& out) {
        float t = -INFINITY;
        if (n >= 8192 && k <= n / 16) {
            constexpr int S = 2048;
            int stride = n / S;
            grow(vals, S);
            for (int s = 0; s < S; s++) vals[s] = row[static_cast<size_t>(s) * stride];
            int r = std::min(S - 1, static_cast<int>(2 * static_cast<int64_t>(k) * S / n) + 16);  // descending rank
            std::nth_element(vals.begin(), vals.begin() + r, vals.begin() + S, std::greater<float>());
            t = vals[r];
        }
        int c = collect_at_least(row, n, t);
        if (c < k) c = collect_at_least(row, n, -INFINITY);
        grow(vals, c);
        for (int j = 0; j < c; j++) vals[j] = row[idx[j]];
        std::nth_element(vals.begin(), vals.begin() + (c - k), vals.begin() + c);
        float thr = vals[c - k];  // the k-th largest logit
        int above = 0;
        for (int j = 0; j < c; j++) above += row[idx[j]] > thr;
        int ties = k - above;
        out.clear();
        for (int j = 0; j < c; j++) {
            int i = idx[j];
            if (row[i] > thr || (row[i] == thr && ties-- > 0)) out.push_back(i);
        }
    }

    // idx[0..c) = the indices i (ascending) with row[i] >= t; returns c
    int collect_at_least(const float* row, int n, float t) {
        grow(idx, static_cast<size_t>(n) + 16);  // compressed stores write whole vectors
        int c = 0, i = 0;
#if defined(__AVX512F__)
        const __m512 tv = _mm512_set1_ps(t);
        __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        for (; i + 16 <= n; i += 16) {
            __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), tv, _CMP_GE_OQ);
            if (hit) {  // compress in a register, store the whole vector (a compress-store to memory is slow on some cores)
                _mm512_storeu_si512(idx.data() + c, _mm512_maskz_compress_epi32(hit, iv));
                c += __builtin_popcount(hit);
            }
            iv = _mm512_add_epi32(iv, step);
        }
#endif
        for (; i < n; i++) {
            idx[c] = i;
            c += row[i] >= t;
        }
        return c;
    }

    // collect_at_least, and cbin_[j] = top_p_bin(row[idx[j]], m) beside it
    int collect_binned(const float* row, int n, float t, double m) {
        grow(idx, static_cast<size_t>(n) + 16);
        grow(cbin_, static_cast<size_t>(n) + 16);
        int c = 0, i = 0;
        int* ix = idx.data();
        int* cb = cbin_.data();
#if defined(__AVX512F__)
        const __m512 tv = _mm512_set1_ps(t);
        const __m512d mv = _mm512_set1_pd(m), per_nat = _mm512_set1_pd(TOP_P_BINS_PER_NAT),
                      last = _mm512_set1_pd(TOP_P_BINS - 1);
        __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        for (; i + 16 <= n; i += 16) {
            __m512 x = _mm512_loadu_ps(row + i);
            __mmask16 hit = _mm512_cmp_ps_mask(x, tv, _CMP_GE_OQ);
            if (hit) {  // the bin as top_p_bin: (m - x) * 32 in float64, capped, truncated
                __m512d lo = _mm512_min_pd(_mm512_mul_pd(_mm512_sub_pd(mv, _mm512_cvtps_pd(_mm256_loadu_ps(row + i))), per_nat), last);
                __m512d hi = _mm512_min_pd(_mm512_mul_pd(_mm512_sub_pd(mv, _mm512_cvtps_pd(_mm256_loadu_ps(row + i + 8))), per_nat), last);
                __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvttpd_epi32(lo)), _mm512_cvttpd_epi32(hi), 1);
                _mm512_storeu_si512(ix + c, _mm512_maskz_compress_epi32(hit, iv));
                _mm512_storeu_si512(cb + c, _mm512_maskz_compress_epi32(hit, b));
                c += __builtin_popcount(hit);
            }
            iv = _mm512_add_epi32(iv, step);
        }
#endif
        for (; i < n; i++) {
            ix[c] = i;
            cb[c] = top_p_bin(row[i], m);
            c += row[i] >= t;
        }
        return c;
    }

    // the candidates ix[0..c) with bin cb < cut to lo[0..o), those with cb == cut to eq[0..q)
    static void split(const int* ix, const int* cb, int c, int cut, int* lo, int& o, int* eq, int& q) {
        o = q = 0;
        int j = 0;
#if defined(__AVX512F__)
        const __m512i cv = _mm512_set1_epi32(cut);
        for (; j + 16 <= c; j += 16) {
            __m512i b = _mm512_loadu_si512(cb + j), v = _mm512_loadu_si512(ix + j);
            __mmask16 l = _mm512_cmplt_epi32_mask(b, cv), e = _mm512_cmpeq_epi32_mask(b, cv);
            _mm512_storeu_si512(lo + o, _mm512_maskz_compress_epi32(l, v));
            o += __builtin_popcount(l);
            if (e) {
                _mm512_storeu_si512(eq + q, _mm512_maskz_compress_epi32(e, v));
                q += __builtin_popcount(e);
            }
        }
#endif
        for (; j < c; j++) {
            lo[o] = ix[j];
            o += cb[j] < cut;
            eq[q] = ix[j];
            q += cb[j] == cut;
        }
    }

    // sampling._top_p after top-k: the smallest prefix, in the order of before(), of the survivors
    // (in keep) whose mass in their own softmax (temperature 1) reaches top_p
    void top_p_of(const float* row, double top_p, std::vector<int>& keep) {
        auto cmp = [row](int a, int b) { return before(row, a, b); };
        std::sort(keep.begin(), keep.end(), cmp);
        double m = row[keep[0]], total = 0.0;
        grow(w_, keep.size());
        for (size_t j = 0; j < keep.size(); j++) total += w_[j] = exp_neg(static_cast<double>(row[keep[j]]) - m);
        double need = top_p * total, acc = 0.0;
        for (size_t j = 0; j < keep.size(); j++) {
            acc += w_[j];
            if (acc >= need) {
                keep.resize(j + 1);
                return;
            }
        }
    }

    // sampling._top_p over the whole vocabulary: the candidates are the logits within `span` nats
    // of the largest, for a span (4, 8, 16 nats, or everything) whose mass reaches top_p; their mass
    // per logit bin gives the bin where the cumulative mass crosses top_p, and only that bin is sorted
    void top_p_all(const float* row, int n, double top_p, std::vector<int>& out) {
        // one pass: every weight, their total, and the mass within 4, 8 and 16 nats of the largest
        // logit (z >= -span is Python's x >= m - span: both exact in float64). Python tries 32 and
        // 64 nats as well; any span holding top_p of the mass gives the same set (the bins below
        // decide it), so where 16 does not, all tokens are candidates.
        double m = max_of(row, n), total = 0.0, h0 = 0.0, h1 = 0.0, h2 = 0.0;
        grow(w_, n);
        double* w = w_.data();
        int i0 = 0;
#if defined(__AVX512F__)
        {
            const __m512d mv = _mm512_set1_pd(m), s4 = _mm512_set1_pd(-4.0), s8 = _mm512_set1_pd(-8.0),
                          s16 = _mm512_set1_pd(-16.0);
            __m512d vt = _mm512_setzero_pd(), v0 = vt, v1 = vt, v2 = vt;
            for (; i0 + 8 <= n; i0 += 8) {
                __m512d z = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(row + i0)), mv);
                __m512d e = exp8(z);
                _mm512_storeu_pd(w + i0, e);
                vt = _mm512_add_pd(vt, e);
                v0 = _mm512_mask_add_pd(v0, _mm512_cmp_pd_mask(z, s4, _CMP_GE_OQ), v0, e);
                v1 = _mm512_mask_add_pd(v1, _mm512_cmp_pd_mask(z, s8, _CMP_GE_OQ), v1, e);
                v2 = _mm512_mask_add_pd(v2, _mm512_cmp_pd_mask(z, s16, _CMP_GE_OQ), v2, e);
            }
            total = _mm512_reduce_add_pd(vt);
            h0 = _mm512_reduce_add_pd(v0);
            h1 = _mm512_reduce_add_pd(v1);
            h2 = _mm512_reduce_add_pd(v2);
        }
#endif
#pragma omp simd reduction(+ : total, h0, h1, h2)
        for (int i = i0; i < n; i++) {  // the tail (or, without AVX-512, everything)
            double z = static_cast<double>(row[i]) - m;
            double e = z >= EXP_MIN ? exp_fast(std::max(z, EXP_MIN)) : 0.0;  // below: < 3e-308 of a sum >= 1
            w[i] = e;
            total += e;
            h0 += z >= -4.0 ? e : 0.0;
            h1 += z >= -8.0 ? e : 0.0;
            h2 += z >= -16.0 ? e : 0.0;
        }
        double need = top_p * total;
        const double held[3] = {h0, h1, h2};
        int s = 0;
        while (s < 3 && held[s] < need) s++;
        float t = -INFINITY;  // the smallest float >= m - span: row[i] >= t is row[i] >= m - span
        if (s < 3) {
            double lim = m - 4.0 * (1 << s);
            t = static_cast<float>(lim);
            if (static_cast<double>(t) < lim) t = std::nextafter(t, INFINITY);
        }
        int c = collect_binned(row, n, t, m);
        // mass per bin, in four interleaved histograms (one long chain of dependent adds otherwise)
        bins_.assign(4 * TOP_P_BINS, 0.0);
        const int* cb = cbin_.data();
        const int* ix = idx.data();
        double* bins = bins_.data();
        for (int j = 0; j < c; j++) bins[(j & 3) * TOP_P_BINS + cb[j]] += w[ix[j]];
        for (int b = 0; b < TOP_P_BINS; b++)
            bins[b] = (bins[b] + bins[TOP_P_BINS + b]) + (bins[2 * TOP_P_BINS + b] + bins[3 * TOP_P_BINS + b]);
        double acc = 0.0;
        int cut = 0;
        for (; cut < TOP_P_BINS - 1; cut++) {
            if (acc + bins[cut] >= need) break;
            acc += bins[cut];
        }
        // the bins before the cut are in; the cut's bin is sorted and taken until the mass reaches top_p
        grow(part_, static_cast<size_t>(n) + 16);
        grow(order, static_cast<size_t>(n) + 16);
        int o, q;
        int* dst = part_.data();
        int* mid = order.data();
        split(ix, cb, c, cut, dst, o, mid, q);
        out.assign(dst, dst + o);
        auto cmp = [row](int a, int b) { return before(row, a, b); };
        std::sort(mid, mid + q, cmp);
        size_t head = out.size();  // out[0, head) ascends (idx does): merge the crossing bin's share in
        for (int j = 0; j < q; j++) {
            int i = mid[j];
            out.push_back(i);
            acc += w[i];
            if (acc >= need) break;
        }
        std::sort(out.begin() + head, out.end());
        std::inplace_merge(out.begin(), out.begin() + head, out.end());
    }

    void compute(const float* row, int n, const Sampling& sp, Dist& out) {
        bool all = true;
        if (sp.top_k > 0 && sp.top_k < n) {
            top_indices(row, n, sp.top_k, keep);
            all = false;
        }
        if (sp.top_p < 1.0) {
            if (all) {
                top_p_all(row, n, sp.top_p, keep);  // index order already
                all = false;
            } else {
                top_p_of(row, sp.top_p, keep);
                std::sort(keep.begin(), keep.end());
            }
        }
        fill(row, n, sp.temperature > 0 ? sp.temperature : 1.0, all, out);
    }

    // p = exp((x - max) / t) / sum over the support (all, or keep)
    void fill(const float* row, int n, double t, bool all, Dist& out) {
        double inv_t = 1.0 / t;
        if (!all) {
            if (out.all || out.v.size() != static_cast<size_t>(n)) {
                out.v.assign(n, 0.0);
            } else {
                for (int i : out.sup) out.v[i] = 0.0;
            }
            out.all = false;
            out.sup.swap(keep);
            // gather the support's logits, exp them in one vectorised pass, scatter the result
            int len = static_cast<int>(out.sup.size());
            const int* sup = out.sup.data();
            grow(dense_, len);
            double* z = dense_.data();
            double m = -INFINITY;
            for (int j = 0; j < len; j++) m = std::max(m, z[j] = static_cast<double>(row[sup[j]]));
            double inv_s = 1.0 / exp_scaled(z, len, m, inv_t, z);
            double* v = out.v.data();
            for (int j = 0; j < len; j++) v[sup[j]] = z[j] * inv_s;
            return;
        }
        out.all = true;
        out.sup.clear();
        out.v.resize(n);
        double* v = out.v.data();
        double inv_s = 1.0 / exp_scaled(row, n, static_cast<double>(max_of(row, n)), inv_t, v);
#pragma omp simd
        for (int i = 0; i < n; i++) v[i] *= inv_s;
    }
};

// Inverse CDF over the support of the weights w (the support of d, with token skip's weight
// taken as 0), as sampling.sample on w / sum(w): the first token whose cumulative weight
// exceeds u * total (searchsorted side="right"). Large supports are walked in blocks: block
// sums first (vectorised), then token by token inside the block where the CDF crosses u * total.
// Returns -1 when all the weight is zero.
inline int sample(const Dist& d, const double* w, int skip, TokenRng& rng, std::vector<double>& blocks) {
    constexpr int B = 256;
    int len = d.size();
    auto weight = [&](int j) {
        int i = d.at(j);
        return i == skip ? 0.0 : w[i];
    };
    double total = 0.0;
    if (!d.all) {
        for (int j = 0; j < len; j++) total += weight(j);
    } else {
        blocks.resize((len + B - 1) / B);
        for (int b = 0; b * B < len; b++) {
            int e = std::min(len, (b + 1) * B);
            double s = 0.0;
#pragma omp simd reduction(+ : s)
            for (int i = b * B; i < e; i++) s += w[i];
            if (skip >= b * B && skip < e) s -= w[skip];
            blocks[b] = s;
            total += s;
        }
    }
    if (!(total > 0.0)) return -1;
    double u = rng.random() * total;
    double acc = 0.0;
    int j = 0;
    if (d.all) {
        for (size_t b = 0; b < blocks.size() && acc + blocks[b] <= u; b++, j += B) acc += blocks[b];
    }
    int last = -1;
    for (; j < len; j++) {
        double x = weight(j);
        if (x == 0.0) continue;
        last = d.at(j);
        acc += x;
        if (acc > u) return last;
    }
    if (last < 0)  // the block sums rounded past every token after u: take the last one with weight
        for (j = len - 1; j >= 0 && last < 0; j--)
            if (weight(j) != 0.0) last = d.at(j);
    return last;
}

}  // namespace eesd
