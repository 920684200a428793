// What the native samplers (`greedy_rows_cpu.cc`, `sample_rows_cpu.cc`) share: rows spread
// over XLA's thread pool, and (AVX-512 only; each includer keeps a scalar fallback) float32
// exp and log over 16 lanes, a tail mask, and one pass that finds a row's first maximum.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>

namespace pagedjax_rows {

#if defined(__AVX512F__)
// exp(a) for a <= 0 (and NaN, which it keeps): 2^n * p(r), r = a - n ln 2 in [-ln2/2, ln2/2],
// p the degree-7 Taylor polynomial (relative error ~5e-9, below float rounding). Inputs under
// -104 are clamped there: their exp is below float's smallest subnormal either way, and
// `scalef` then gives 0. `max(c, a)` returns a when a is NaN (MAXPS returns its second
// operand on unordered inputs), so NaN goes through.
inline __m512 exp_nonpositive(__m512 a) {
  a = _mm512_max_ps(_mm512_set1_ps(-104.0f), a);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), a);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// log(a) for positive normal a: a = m * 2^e with m in [0.75, 1.5), log m = 2 atanh(s),
// s = (m - 1) / (m + 1) in [-1/7, 1/5], by its odd series to s^11 (truncation ~1e-10, below
// float rounding), and e ln 2 added in two parts. Within ~1 ulp of the true value.
inline __m512 log_positive(__m512 a) {
  const __m512 m = _mm512_getmant_ps(a, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_zero);
  // getexp gives floor(log2 a); a mantissa under 1 came from the octave above.
  const __m512 e = _mm512_add_ps(
      _mm512_getexp_ps(a),
      _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, _mm512_set1_ps(1.0f), _CMP_LT_OQ),
                          _mm512_set1_ps(1.0f)));
  const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, _mm512_set1_ps(1.0f)),
                                 _mm512_add_ps(m, _mm512_set1_ps(1.0f)));
  const __m512 s2 = _mm512_mul_ps(s, s);
  __m512 p = _mm512_set1_ps(1.0f / 11);
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 9));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 7));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 5));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 3));
  const __m512 two_s = _mm512_add_ps(s, s);
  const __m512 lm = _mm512_fmadd_ps(_mm512_mul_ps(two_s, s2), p, two_s);  // 2s + 2s^3 p(s^2)
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693145751953125f),
                         _mm512_fmadd_ps(e, _mm512_set1_ps(1.42860682030941723212e-6f), lm));
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// sum(exp(x - top)) over x[0, V) for top >= every x (NaN in, NaN out): each 64 values summed
// in float, those sums in double, so the result does not drift with the vocabulary's size (one
// float accumulator per lane was off by ~2e-6 over 49152 values; XLA's tree sum by ~2e-7).
inline double sum_exp_below(const float* x, int64_t V, float top) {
  const __m512 t = _mm512_set1_ps(top);
  __m512d lo = _mm512_setzero_pd(), hi = lo;
  auto add = [&](__m512 s) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(s)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                               _mm512_castps_pd(s), 1))));
  };
  int64_t v = 0;
  for (; v + 64 <= V; v += 64) {
    const __m512 e0 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + v), t));
    const __m512 e1 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + v + 16), t));
    const __m512 e2 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + v + 32), t));
    const __m512 e3 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + v + 48), t));
    add(_mm512_add_ps(_mm512_add_ps(e0, e1), _mm512_add_ps(e2, e3)));
  }
  for (; v < V; v += 16) {
    const __mmask16 k = tail_mask(V - v);
    add(_mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + v), t))));
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

// The first maximum of x[0, V) in one vector pass: per lane the largest value and the first
// index holding it (a strict > keeps the earlier index). Returns false, with `idx` the first
// NaN's index, when the row holds a NaN (it counts as the maximum); else true with `idx` the
// first maximum's index (0 for a row of all -inf) and `top` its value.
inline bool first_max(const float* x, int64_t V, int32_t& idx, float& top) {
  const float ninf = -std::numeric_limits<float>::infinity();
  __m512 best = _mm512_set1_ps(ninf);
  __m512i best_i = _mm512_set1_epi32(0);
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  auto take = [&](__m512 xv) {
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(xv, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, xv);
    best_i = _mm512_mask_mov_epi32(best_i, gt, at);
    at = _mm512_add_epi32(at, step);
  };
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) take(_mm512_loadu_ps(x + v));
  if (v < V) take(_mm512_mask_loadu_ps(_mm512_set1_ps(ninf), tail_mask(V - v), x + v));
  if (nan) {  // the first NaN is the maximum: find it (rare: a broken row)
    for (int64_t i = 0; i < V; ++i)
      if (x[i] != x[i]) {
        idx = int32_t(i);
        break;
      }
    top = std::numeric_limits<float>::quiet_NaN();
    return false;
  }
  top = _mm512_reduce_max_ps(best);
  const __mmask16 hit = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  idx = hit ? _mm512_mask_reduce_min_epi32(hit, best_i) : 0;
  return true;
}
#endif

// Calls `make()` once per worker (the caller and up to pool.num_threads() - 1 helpers) and
// the callable it returns on each row of [0, B), rows handed out `per_item` at a time by one
// counter; returns when every row is done. No helper below `min_rows` rows: waking one costs
// more than it saves. The counters are heap-held so a helper that starts after the call
// returned (it then finds no item left) touches no dead stack frame; a helper reads the
// buffers only for an item it claimed, which the caller waits for.
template <class Pool, class Make>
void for_rows(Pool& pool, int64_t B, int64_t per_item, int64_t min_rows, Make make) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  if (B <= 0) return;
  const int64_t items = (B + per_item - 1) / per_item;
  auto sh = std::make_shared<Shared>();
  auto work = [sh, B, per_item, items, make] {
    auto fn = make();
    for (int64_t i = sh->next.fetch_add(1); i < items; i = sh->next.fetch_add(1)) {
      const int64_t m1 = std::min(B, (i + 1) * per_item);
      for (int64_t m = i * per_item; m < m1; ++m) fn(m);
      sh->done.fetch_add(m1 - i * per_item, std::memory_order_acq_rel);
    }
  };
  const int64_t helpers =
      B < min_rows ? 0 : std::min<int64_t>(int64_t(pool.num_threads()) - 1, items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  while (sh->done.load(std::memory_order_acquire) < B) std::this_thread::yield();
}

}  // namespace pagedjax_rows
