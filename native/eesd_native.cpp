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
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__SSE2__)
// GCC 12's intrinsics headers use _mm*_undefined_*() values that -Wall reports as uninitialized
// (GCC bug 105593): silenced for the header's lines only
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
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

// Speculative sampling works on distributions over the whole vocabulary (152k tokens for
// Qwen2.5): everything below is written for one pass over the float logit row, with loops
// that GCC vectorises (no libm call in them), no full-vocabulary copies, and buffers reused
// from round to round. The results agree with sampling.py to a few ulp, not to the bit
// (numpy's exp is a SIMD routine of its own); tokens agree unless a uniform draw falls within
// ~1e-15 of a boundary of the inverse CDF.

constexpr double EXP_MIN = -708.0;  // exp_fast's domain is [EXP_MIN, 0]: 2^k stays a normal double

// 1/0!, 1/1!, .., 1/D! (each n! is exact in a double up to 18!, so each entry is correctly rounded)
template <int D>
constexpr std::array<double, D + 1> inv_factorials() {
    std::array<double, D + 1> c{};
    double f = 1.0;
    for (int n = 0; n <= D; n++) {
        if (n > 0) f *= n;
        c[n] = 1.0 / f;
    }
    return c;
}

// 1 + r + r^2/2! + .. + r^D/D! by Horner's rule in T (float or double; coefficients rounded to T)
template <int D, class T>
inline T exp_taylor(T r) {
    constexpr auto c = inv_factorials<D>();
    T p = static_cast<T>(c[D]);
    for (int n = D - 1; n >= 0; n--) p = p * r + static_cast<T>(c[n]);
    return p;
}

// The constants of exp_fast in T: ln2 split Cody-Waite style (ln2_hi has few enough significant
// bits that k * ln2_hi is exact), the shift that rounds x / ln2 to an integer held in the low
// mantissa bits, the Taylor degree for |r| <= ln2/2, the exponent's bias and position.
template <class T>
struct ExpOf;
template <>
struct ExpOf<double> {
    using Bits = uint64_t;
    static constexpr double log2e = 1.4426950408889634, ln2_hi = 6.93147180369123816490e-01,
                            ln2_lo = 1.90821492927058770002e-10, shift = 0x1.8p52;
    static constexpr int degree = 13, bias = 1023, mantissa = 52;  // truncation r^14/14! < 5e-18
};
template <>
struct ExpOf<float> {
    using Bits = uint32_t;
    static constexpr float log2e = 1.44269504f, ln2_hi = 0.693145752f, ln2_lo = 1.42860677e-06f, shift = 0x1.8p23f;
    static constexpr int degree = 7, bias = 127, mantissa = 23;  // truncation r^8/8! < 2.5e-9
};

// exp(x) for x <= 0 within T's normal range (double: EXP_MIN <= x; float: -87 <= x) without a
// branch or a call, so that loops over it vectorise: x = k ln2 + r with k = round(x / ln2) and
// |r| <= ln2/2; exp(r) by its Taylor series; 2^k written straight into the exponent bits.
// About 1-2 ulp in double, ~2e-7 relative in float.
template <class T>
inline T exp_fast(T x) {
    using E = ExpOf<T>;
    T kd = x * E::log2e + E::shift;
    typename E::Bits ki;
    std::memcpy(&ki, &kd, sizeof ki);
    kd -= E::shift;
    T r = (x - kd * E::ln2_hi) - kd * E::ln2_lo;
    T p = exp_taylor<E::degree>(r);
    typename E::Bits sbits = (ki + E::bias) << E::mantissa;  // the low bits of ki are k (two's complement): 2^k
    T scale;
    std::memcpy(&scale, &sbits, sizeof scale);
    return p * scale;
}

// exp(x) for any x <= 0: the fast path, or libm below its domain (subnormals, zero)
inline double exp_neg(double x) { return x >= EXP_MIN ? exp_fast(x) : std::exp(x); }

inline double as_double(float x) { return x; }
inline double as_double(double x) { return x; }

#if defined(__AVX512F__)
// exp(z) of 8 doubles z <= 0, the vocabulary-wide pass's exp: z = (8e + j) ln2/8 + r, |r| <= ln2/16,
// exp(r) by its Taylor series to degree 8 (truncation r^9/9! < 1.6e-18), 2^(j/8) from a table of
// 8 (one permute), 2^e by scalef (which also rounds tiny results to subnormals or 0, as libm
// does). About 1-2 ulp, as exp_fast, in 8 multiply-adds instead of 13.
inline __m512d exp8(__m512d z) {
    const __m512d tab = _mm512_setr_pd(0x1.0000000000000p+0, 0x1.172b83c7d517bp+0, 0x1.306fe0a31b715p+0, 0x1.4bfdad5362a27p+0,
                                       0x1.6a09e667f3bcdp+0, 0x1.8ace5422aa0dbp+0, 0x1.ae89f995ad3adp+0, 0x1.d5818dcfba487p+0);
    const __m512d shift = _mm512_set1_pd(0x1.8p52);
    z = _mm512_max_pd(z, _mm512_set1_pd(-746.0));  // exp(-746) rounds to 0 (and -inf would give NaN)
    __m512d kd = _mm512_fmadd_pd(z, _mm512_set1_pd(8.0 * 1.4426950408889634), shift);
    __m512i ki = _mm512_castpd_si512(kd);  // the low bits are k = round(8 z / ln2): permutexvar reads k & 7
    kd = _mm512_sub_pd(kd, shift);
    __m512d r = _mm512_fnmadd_pd(kd, _mm512_set1_pd(6.93147180369123816490e-01 / 8), z);  // 32-bit ln2_hi: exact
    r = _mm512_fnmadd_pd(kd, _mm512_set1_pd(1.90821492927058770002e-10 / 8), r);
    constexpr auto c = inv_factorials<8>();
    __m512d p = _mm512_set1_pd(c[8]);
    for (int n = 7; n >= 0; n--) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(c[n]));
    __m512d e = _mm512_roundscale_pd(_mm512_mul_pd(kd, _mm512_set1_pd(0.125)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_scalef_pd(_mm512_mul_pd(p, _mm512_permutexvar_pd(ki, tab)), e);
}
#endif

// out[i] = exp((x[i] - m) * inv_t) for x[i] <= m; returns their sum (results below ~3e-308 may be
// left out of it: the sum holds exp(0) = 1)
template <class T>
double exp_scaled(const T* x, int n, double m, double inv_t, double* out) {
    double s = 0.0;
    int i = 0;
#if defined(__AVX512F__)
    const __m512d mv = _mm512_set1_pd(m), tv = _mm512_set1_pd(inv_t);
    __m512d acc = _mm512_setzero_pd();
    for (; i + 8 <= n; i += 8) {
        __m512d xv;
        if constexpr (std::is_same_v<T, float>)
            xv = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        else
            xv = _mm512_loadu_pd(x + i);
        __m512d e = exp8(_mm512_mul_pd(_mm512_sub_pd(xv, mv), tv));
        _mm512_storeu_pd(out + i, e);
        acc = _mm512_add_pd(acc, e);
    }
    s = _mm512_reduce_add_pd(acc);
#endif
    int low = 0;
#pragma omp simd reduction(+ : s, low)
    for (int j = i; j < n; j++) {
        double z = (as_double(x[j]) - m) * inv_t;
        low += z < EXP_MIN;
        double e = exp_fast(std::max(z, EXP_MIN));
        out[j] = z >= EXP_MIN ? e : 0.0;
        s += out[j];
    }
    if (low) {  // below exp_fast's domain: subnormal or zero, as numpy has them
        for (int j = i; j < n; j++) {
            double z = (as_double(x[j]) - m) * inv_t;
            if (z < EXP_MIN) out[j] = std::exp(z);
        }
    }
    return s;
}

// sum_i exp(row[i] - m) for the draft's confidence q(argmax) = 1 / that sum (drafters/model.pick):
// float32 exps summed in double, m >= every row[i] (a float logit). Agrees with the float64
// figure to ~4e-7 relative: the confidence only steers the controller's draft length, never which
// token is drafted or accepted, and float32 halves the time of this vocabulary-wide sum.
double sum_exp_conf(const float* row, int n, float m) {
    double s = 0.0;
    for (int i0 = 0; i0 < n; i0 += 1024) {  // float partial sums of 1024 terms (<= 1024 each), then double
        int i1 = std::min(n, i0 + 1024);
        float b = 0.0f;
#pragma omp simd reduction(+ : b)
        for (int i = i0; i < i1; i++) {
            float z = row[i] - m;  // rounded to float: a relative error of |z| 6e-8 on terms of size exp(z)
            float e = exp_fast(std::max(z, -87.0f));
            b += z >= -87.0f ? e : 0.0f;
        }
        s += b;
    }
    return s;
}

// the largest logit (GCC leaves the `omp simd` max reduction scalar here: explicit vectors)
float max_of(const float* row, int n) {
    float m = row[0];
    int i = 0;
#if defined(__AVX512F__)
    if (n >= 64) {
        __m512 a = _mm512_loadu_ps(row), b = a, c = a, d = a;
        for (; i + 64 <= n; i += 64) {
            a = _mm512_max_ps(a, _mm512_loadu_ps(row + i));
            b = _mm512_max_ps(b, _mm512_loadu_ps(row + i + 16));
            c = _mm512_max_ps(c, _mm512_loadu_ps(row + i + 32));
            d = _mm512_max_ps(d, _mm512_loadu_ps(row + i + 48));
        }
        m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
    }
#elif defined(__SSE2__)
    if (n >= 16) {
        __m128 a = _mm_loadu_ps(row), b = a, c = a, d = a;
        for (; i + 16 <= n; i += 16) {
            a = _mm_max_ps(a, _mm_loadu_ps(row + i));
            b = _mm_max_ps(b, _mm_loadu_ps(row + i + 4));
            c = _mm_max_ps(c, _mm_loadu_ps(row + i + 8));
            d = _mm_max_ps(d, _mm_loadu_ps(row + i + 12));
        }
        float lanes[4];
        _mm_storeu_ps(lanes, _mm_max_ps(_mm_max_ps(a, b), _mm_max_ps(c, d)));
        m = std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
    }
#endif
    for (; i < n; i++) m = std::max(m, row[i]);
    return m;
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

struct Sampling {
    bool greedy;
    double temperature;  // 0: greedy
    int top_k;           // 0: off
    double top_p;        // 1: off
};

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
// in the order and with the tie rules of eesd_local.sampling.probs.
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
            if (hit) {  // compress in a register, store whole: fast on every AVX-512 core
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
int sample(const Dist& d, const double* w, int skip, TokenRng& rng, std::vector<double>& blocks) {
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

// first index of the largest logit, as np.argmax: a vectorised max, then a scan for it
int argmax(const float* row, int n) {
    // the largest value (max_of keeps four independent chains; a single value-and-index chain
    // is latency-bound at ~5 cycles a vector), then the first index holding it
    float best = max_of(row, n);
    int i = 0;
#if defined(__AVX512F__)
    const __m512 bv = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), bv, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
    }
#endif
    for (; i < n; i++)
        if (row[i] == best) return i;
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
           uintptr_t f_decide, uintptr_t f_update, int no_bonus_slot) {
        no_bonus_slot_ = no_bonus_slot;
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
    // run LookupDrafter.lookup in C++ from now on, on the history this loop holds (0, 0: off,
    // the proposals come from Python)
    void set_lookup(int ngram_min, int ngram_max) {
        if (ngram_max < 0 || (ngram_max > 0 && (ngram_min < 1 || ngram_min > ngram_max)))
            throw py::value_error("lookup n-grams need 1 <= ngram_min <= ngram_max (or 0, 0 to turn it off)");
        ngram_min_ = ngram_min;
        ngram_max_ = ngram_max;
    }

    // One round; returns (drafted tokens, accepted m, next token, t_draft, t_verify, t_llama, rng state).
    py::tuple run(StateArray state, size_t n_history, int max_n, int mode, std::vector<llama_token> cands, double cand_conf,
                  double temperature, int top_k, double top_p, uint64_t rng_state) {
        check_call(n_history, mode);
        max_n = std::max(0, max_n);
        check_fits(max_n);
        for (llama_token t : cands)
            if (t < 0 || t >= tgt_.n_vocab) throw py::value_error(("proposed token " + std::to_string(t) + " is outside the vocabulary").c_str());
        Sampling sp{temperature == 0.0, temperature, top_k, top_p};
        TokenRng rng{rng_state};
        auto [st, n_st] = controller_state(state);
        RoundOut r;
        double t_llama = 0.0;
        {
            py::gil_scoped_release unlocked;
            one_round(st, n_st, max_n, mode, cands, cand_conf, sp, rng, r, t_llama);
        }
        return py::make_tuple(drafted_, r.m, r.nxt, r.t_draft, r.t_verify, t_llama, rng.s);
    }

    // The settings of a generation's batches: the controller's state array (kept and written in
    // place), the drafting mode, the sampling parameters, the random stream's state, the time
    // budget of a batch and a cancel flag that another thread may set (cancel[0] != 0).
    void configure(StateArray state, int mode, double temperature, int top_k, double top_p, uint64_t rng_state,
                   double budget_s, py::array_t<uint8_t, py::array::c_style> cancel) {
        controller_state(state);
        check_mode(mode);
        if (cancel.ndim() != 1 || cancel.shape(0) < 1) throw py::value_error("cancel must be a 1-d uint8 array of size >= 1");
        state_ = std::move(state);
        cancel_ = std::move(cancel);
        mode_ = mode;
        sp_ = Sampling{temperature == 0.0, temperature, top_k, top_p};
        rng_ = TokenRng{rng_state};
        budget_s_ = budget_s;
        configured_ = true;
    }
    uint64_t rng_state() const { return rng_.s; }
    double t_llama() const { return t_llama_; }  // seconds inside llama_decode over all batches

    // Rounds one after another in one call (configure() first), as the engine would ask for them:
    // round r drafts at most min(draft_max, left_r - 1, room_r - 1) tokens (left_r: tokens still
    // wanted, room_r: free KV positions), and the batch ends after a round that emits an
    // end-of-generation token, when no token is wanted or fits any more, after max_rounds, once the
    // time budget has passed, or when the cancel flag is set. Returns [(drafted, accepted, next
    // token, t_draft, t_verify, max_n, room before the round)]. An error in a round after the first
    // ends the batch with the rounds before it; the next call raises it.
    py::list run_batch(size_t n_history, int draft_max, int left, int max_rounds) {
        if (pending_) {
            std::exception_ptr e = pending_;
            pending_ = nullptr;
            std::rethrow_exception(e);
        }
        if (!configured_) throw py::value_error("configure() first");
        check_call(n_history, mode_);
        draft_max = std::max(0, draft_max);
        check_fits(draft_max);
        auto [st, n_st] = controller_state(state_);
        const volatile uint8_t* stop = cancel_.data();
        const llama_vocab* vocab = llama_model_get_vocab(llama_get_model(tgt_.ctx));
        rec_tok_.clear();
        recs_.clear();
        {
            py::gil_scoped_release unlocked;
            double start = now_s();
            while (static_cast<int>(recs_.size()) < std::max(1, max_rounds)) {
                int room = tgt_.room();
                if (room < 1 || left < 1) break;
                int max_n = std::max(0, std::min({draft_max, left - 1, room - 1}));
                RoundOut r;
                try {
                    one_round(st, n_st, max_n, mode_, cands_, 0.0, sp_, rng_, r, t_llama_);
                } catch (...) {
                    if (recs_.empty()) throw;
                    pending_ = std::current_exception();  // the engine sees the rounds before it first
                    break;
                }
                r.max_n = max_n;
                r.room = room;
                r.first = static_cast<int>(rec_tok_.size());
                rec_tok_.insert(rec_tok_.end(), drafted_.begin(), drafted_.end());
                recs_.push_back(r);
                bool eog = r.nxt >= 0 && llama_vocab_is_eog(vocab, r.nxt);
                for (int i = 0; i < r.m && !eog; i++) eog = llama_vocab_is_eog(vocab, drafted_[i]);
                left -= r.m + (r.nxt >= 0);
                if (eog || *stop || now_s() - start >= budget_s_) break;
            }
        }
        py::list out(recs_.size());
        for (size_t i = 0; i < recs_.size(); i++) {
            const RoundOut& r = recs_[i];
            size_t end = i + 1 < recs_.size() ? recs_[i + 1].first : rec_tok_.size();
            std::vector<llama_token> d(rec_tok_.begin() + r.first, rec_tok_.begin() + end);
            out[i] = py::make_tuple(std::move(d), r.m, r.nxt, r.t_draft, r.t_verify, r.max_n, r.room);
        }
        return out;
    }

  private:
    struct RoundOut {
        int m = 0, nxt = 0, max_n = 0, room = 0, first = 0;
        double t_draft = 0.0, t_verify = 0.0;
    };

    void check_call(size_t n_history, int mode) {
        open_target();
        if (history_.empty()) throw py::value_error("set_history() first: the round continues a history");
        if (n_history != history_.size())
            throw py::value_error(("the history has " + std::to_string(n_history) + " tokens but the round loop holds " +
                                   std::to_string(history_.size()) + ": set_history() after changing it").c_str());
        check_mode(mode);
    }
    void check_mode(int mode) {
        if (mode < NONE || mode > MODEL) throw py::value_error("mode must be 0 (none), 1 (lookup) or 2 (draft model)");
        if (mode == MODEL && !dft_.ctx) throw py::value_error("mode 2 needs a draft context");
    }
    void check_fits(int max_n) {
        if (max_n + 1 > tgt_.n_batch)
            throw py::value_error(("a draft of up to " + std::to_string(max_n) + " tokens plus the last one does not fit "
                                   "the target's batch of " + std::to_string(tgt_.n_batch) +
                                   ": lower draft_max or raise n_batch").c_str());
    }
    static std::pair<double*, int64_t> controller_state(StateArray& state) {
        if (state.ndim() != 1) throw py::value_error("the controller state must be a 1-d float64 array");
        return {state.mutable_data(), static_cast<int64_t>(state.shape(0))};
    }

    // one round (the GIL released): draft, verify in one decode, accept, trim, tell the controller
    void one_round(double* st, int64_t n_st, int max_n, int mode, std::vector<llama_token>& cands, double cand_conf,
                   const Sampling& sp, TokenRng& rng, RoundOut& r, double& t_llama) {
        begin_(st, n_st);
        double t1 = now_s();
        drafted_.clear();
        conf_.clear();
        point_.clear();
        if (ngram_max_ > 0 && mode != NONE) {  // the lookup drafter runs here rather than in Python
            int n_match = lookup(std::max(0, max_n), cands);
            cand_conf = static_cast<double>(n_match) / ngram_max_;  // a longer matched n-gram is a safer bet
        }
        if (mode == POINT) propose_point(st, n_st, max_n, cands, cand_conf);
        if (mode == MODEL) propose_model(st, n_st, max_n, cands, sp, rng, t_llama);
        double t2 = now_s();
        int k = static_cast<int>(drafted_.size());
        // a probe verifies its drafts without the bonus: [last, d1..d(k-1)], k rows (engine.PythonRounds)
        bool bonus = k == 0 || no_bonus_slot_ < 0 || no_bonus_slot_ >= n_st || st[no_bonus_slot_] == 0.0;
        int n_rows = bonus ? k + 1 : k;
        size_t n_keep = tgt_.tokens.size() + 1;  // the cache keeps `last` ...
        batch_.assign(1, history_.back());
        batch_.insert(batch_.end(), drafted_.begin(), drafted_.begin() + (n_rows - 1));
        tgt_.decode(batch_.data(), n_rows, n_rows, t_llama);
        int m = 0, nxt = 0;
        if (sp.greedy)
            verify_greedy(k, bonus, m, nxt);
        else
            verify_sampled(k, bonus, sp, rng, m, nxt);
        tgt_.trim(n_keep + std::min(m, n_rows - 1));  // ... and the accepted drafts it decoded; the rest is rolled back
        double t3 = now_s();
        r.m = m;
        r.nxt = nxt;
        r.t_draft = t2 - t1;
        r.t_verify = t3 - t2;
        update_(st, n_st, conf_.data(), static_cast<int64_t>(conf_.size()), m, r.t_draft, r.t_verify);
        history_.insert(history_.end(), drafted_.begin(), drafted_.begin() + m);
        if (nxt >= 0) history_.push_back(nxt);  // -1: a probe whose drafts were all accepted
    }

    Ctx tgt_, dft_;
    begin_fn begin_;
    decide_fn decide_;
    update_fn update_;
    std::vector<llama_token> history_, drafted_, batch_, feed_, rec_tok_;
    std::vector<RoundOut> recs_;
    std::exception_ptr pending_;  // an error in a batch's later round, raised by the next call
    // configure(): the batches' settings
    StateArray state_;
    py::array_t<uint8_t, py::array::c_style> cancel_;
    int mode_ = NONE;
    Sampling sp_{true, 0.0, 0, 1.0};
    TokenRng rng_{0};
    double budget_s_ = 0.0, t_llama_ = 0.0;
    bool configured_ = false;
    std::vector<llama_token> cands_;  // the lookup's proposals (run in C++)
    std::vector<double> conf_, resid_, blocks_;
    Dist p_;
    std::vector<Dist> q_;      // q of each drafted token (sampling with a draft model)
    std::vector<char> point_;  // 1: the token was proposed deterministically (q = point mass)
    Probs probs_;
    int ngram_min_ = 0, ngram_max_ = 0;
    int no_bonus_slot_ = -1;  // where the controller state says "verify this round without the bonus" (-1: never)

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

    // LookupDrafter.lookup: out = the tokens (at most max_n) after the latest earlier end e <= len-2
    // of the longest suffix n-gram, n from ngram_max down to ngram_min; returns n (0: no match).
    // One backward scan: L(e) = how many tokens ending at e match the suffix (capped at
    // ngram_max); the first e met with a new largest L is the latest end of that n-gram, which
    // is the entry Python's index keeps (it overwrites with later ends).
    int lookup(int max_n, std::vector<llama_token>& out) {
        out.clear();
        const llama_token* h = history_.data();
        int len = static_cast<int>(history_.size());
        int cap = std::min(ngram_max_, len), best_n = 0, best_e = -1;
        for (int e = len - 2; e >= 0 && best_n < cap; e--) {
            int l = 0;
            while (l < cap && l <= e && h[e - l] == h[len - 1 - l]) l++;
            if (l > best_n && l >= ngram_min_) best_n = l, best_e = e;
        }
        if (best_e < 0) return 0;
        int end = std::min(len, best_e + 1 + max_n);
        out.assign(h + best_e + 1, h + end);
        return best_n;
    }

    // lookup: the proposals arrive from Python or from lookup(); the controller cuts them (LookupDrafter.propose)
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
        if (sp.greedy) {  // q is not needed: the confidence q(argmax) = 1 / sum_i exp(row[i] - row[argmax])
            int tok = argmax(row, n);
            conf = 1.0 / sum_exp_conf(row, n, row[tok]);
            return tok;
        }
        if (q_.size() <= j) q_.resize(j + 1);
        Dist& q = q_[j];
        probs_.compute(row, n, sp, q);
        if (guess >= 0) {
            if (rng.random() < q[guess]) {
                conf = q[guess];
                return guess;
            }
            int tok = sample(q, q.v.data(), guess, rng, blocks_);  // q with the guess removed, if any mass is left
            if (tok >= 0) {
                conf = q[tok];
                return tok;
            }
        }
        int tok = sample(q, q.v.data(), -1, rng, blocks_);
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

    void verify_greedy(int k, bool bonus, int& m, int& nxt) {
        for (int i = 0; i <= k; i++) {
            if (i == k && !bonus) {
                m = k;
                nxt = -1;
                return;
            }
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
    void verify_sampled(int k, bool bonus, const Sampling& sp, TokenRng& rng, int& m, int& nxt) {
        int n = tgt_.n_vocab;
        for (int i = 0; i < k; i++) {
            llama_token d = drafted_[i];
            probs_.compute(tgt_.row(i), n, sp, p_);
            double qd = point_[i] ? 1.0 : q_[i][d];
            if (qd <= 0.0)
                throw std::domain_error("draft " + std::to_string(d) + " has zero draft probability: the drafter must sample from its q");
            if (rng.random() < std::min(1.0, p_[d] / qd)) continue;  // q(d) <= p(d): always accept
            int tok;
            if (point_[i]) {
                tok = sample(p_, p_.v.data(), d, rng, blocks_);  // max(0, p - onehot(d)): p without d
            } else {
                // max(0, p - q) is zero wherever p is: only p's support is written and read
                resid_.resize(n);
                const double* p = p_.v.data();
                const double* q = q_[i].v.data();
                double* r = resid_.data();
                if (p_.all) {
#pragma omp simd
                    for (int v = 0; v < n; v++) r[v] = std::max(p[v] - q[v], 0.0);
                } else {
                    for (int v : p_.sup) r[v] = std::max(p[v] - q[v], 0.0);
                }
                tok = sample(p_, r, -1, rng, blocks_);
            }
            if (tok < 0) tok = sample(p_, p_.v.data(), -1, rng, blocks_);  // p == q up to rounding: p itself
            m = i;
            nxt = tok;
            return;
        }
        m = k;
        if (!bonus) {  // a probe: no row k, no bonus draw
            nxt = -1;
            return;
        }
        probs_.compute(tgt_.row(k), n, sp, p_);
        nxt = sample(p_, p_.v.data(), -1, rng, blocks_);
    }
};

// sampling.probs in C++, for tests that the two agree bit for bit
py::array_t<double> probs_py(py::array_t<float, py::array::c_style | py::array::forcecast> logits, double temperature, int top_k,
                             double top_p) {
    if (logits.ndim() != 1 || logits.shape(0) < 1) throw py::value_error("logits must be a non-empty 1-d array");
    int n = static_cast<int>(logits.shape(0));
    Dist out;
    Probs pr;
    pr.compute(logits.data(), n, Sampling{temperature == 0.0, temperature, top_k, top_p}, out);
    py::array_t<double> res(n);
    std::copy(out.v.begin(), out.v.end(), res.mutable_data());
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
        .def(py::init<uintptr_t, int, uintptr_t, int, uintptr_t, uintptr_t, uintptr_t, int>(), py::arg("target"),
             py::arg("target_batch"), py::arg("draft"), py::arg("draft_batch"), py::arg("begin"), py::arg("decide"),
             py::arg("update"), py::arg("no_bonus_slot") = -1)
        .def("set_tokens", &Rounds::set_tokens, py::arg("which"), py::arg("tokens"), "Record what a KV cache holds (0 target, 1 draft).")
        .def("limit", &Rounds::limit, py::arg("which"), py::arg("n_ctx"), "Hold a context to fewer positions than its KV size.")
        .def("tokens", &Rounds::tokens, py::arg("which"), "What a KV cache holds, position by position.")
        .def("set_history", &Rounds::set_history, py::arg("history"), "The emitted history the next round continues.")
        .def("set_lookup", &Rounds::set_lookup, py::arg("ngram_min"), py::arg("ngram_max"),
             "Run the lookup drafter's n-gram search in C++ (0, 0: take proposals from run()).")
        .def("room", &Rounds::room, "How many more tokens fit into the target context.")
        .def("run", &Rounds::run, py::arg("state"), py::arg("n_history"), py::arg("max_n"), py::arg("mode"), py::arg("cands"),
             py::arg("cand_conf"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("rng_state"),
             "One round: (drafted, accepted, next token, t_draft, t_verify, t_llama, rng state).")
        .def("configure", &Rounds::configure, py::arg("state"), py::arg("mode"), py::arg("temperature"), py::arg("top_k"),
             py::arg("top_p"), py::arg("rng_state"), py::arg("budget_s"), py::arg("cancel"),
             "The settings of run_batch(): controller state, mode, sampling, random state, time budget, cancel flag.")
        .def("run_batch", &Rounds::run_batch, py::arg("n_history"), py::arg("draft_max"), py::arg("left"), py::arg("max_rounds"),
             "Rounds until an end token, the token budget, max_rounds, the time budget or the cancel flag: "
             "[(drafted, accepted, next token, t_draft, t_verify, max_n, room)].")
        .def("rng_state", &Rounds::rng_state, "The random stream's state after the batches so far.")
        .def_property_readonly("t_llama", &Rounds::t_llama, "Seconds inside llama_decode over all batches.")
        .def("close", &Rounds::close, "Free the batches; the contexts stay with Python.");
    m.def("probs", &probs_py, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"));
    m.def(
        "argmax",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> logits) {
            if (logits.ndim() != 1 || logits.shape(0) < 1) throw py::value_error("logits must be a non-empty 1-d array");
            return argmax(logits.data(), static_cast<int>(logits.shape(0)));
        },
        py::arg("logits"), "The first index of the largest logit (as numpy.argmax), for tests.");
}
