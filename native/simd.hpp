// Vector maths over a float logit row: exp, sums of exps, max, argmax.
//
// Speculative sampling works on distributions over the whole vocabulary (152k tokens for
// Qwen2.5): everything here is written for one pass over the row, with loops that compilers
// vectorise (no libm call in them) and, where they do not, explicit vectors. AVX-512 code sits
// behind `#if defined(__AVX512F__)`; every function has a portable path that gives the same
// result. The results agree with the NumPy reference (tests/reference.py) to a few ulp, not to the bit (numpy's exp is a
// SIMD routine of its own); tokens agree unless a uniform draw falls within ~1e-15 of a
// boundary of the inverse CDF.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

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
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace eesd {

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

// sum_i exp(row[i] - m) for the draft's confidence q(argmax) = 1 / that sum:
// float32 exps summed in double, m >= every row[i] (a float logit). Agrees with the float64
// figure to ~4e-7 relative: the confidence only steers the controller's draft length, never which
// token is drafted or accepted, and float32 vectors hold twice the lanes of float64 ones.
inline double sum_exp_conf(const float* row, int n, float m) {
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

// the largest logit, in four independent chains of vector maxima (compilers leave an `omp simd`
// max reduction scalar: it must keep std::max's order for NaN, which logits never hold)
inline float max_of(const float* row, int n) {
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
#elif defined(__ARM_NEON) && defined(__aarch64__)
    if (n >= 16) {
        float32x4_t a = vld1q_f32(row), b = a, c = a, d = a;
        for (; i + 16 <= n; i += 16) {
            a = vmaxq_f32(a, vld1q_f32(row + i));
            b = vmaxq_f32(b, vld1q_f32(row + i + 4));
            c = vmaxq_f32(c, vld1q_f32(row + i + 8));
            d = vmaxq_f32(d, vld1q_f32(row + i + 12));
        }
        m = vmaxvq_f32(vmaxq_f32(vmaxq_f32(a, b), vmaxq_f32(c, d)));
    }
#endif
    for (; i < n; i++) m = std::max(m, row[i]);
    return m;
}

// first index of the largest logit, as np.argmax: the largest value (max_of keeps four
// independent chains; one value-and-index chain would wait on each compare), then the first
// index holding it
inline int argmax(const float* row, int n) {
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

}  // namespace eesd
