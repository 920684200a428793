// Greedy sampling of float32 logits rows in one read: per row the first maximum's index and
// its raw logprob -log(sum(exp(x - max))), as an XLA FFI call
// (`pallas_kernels.cpu_native.greedy_rows_cpu`, behind `pagedjax.sampler.sample_greedy`).
//
// Why native code: XLA:CPU runs `sample_greedy` as three passes over [B, V] logits (a max, the
// first index reaching it, a sum of exponentials), each a fusion of its own: ~2.4 ms at 64
// rows of the demo model's 49152-token vocabulary and ~10 ms at 256 on this project's 2-core
// host, 4 % of a 64-row decode step and 5 % of a 256-row one. Here each row comes from memory
// once: the max pass reads it, the exponential pass reads it again from L2 (196 KB a row).
//
// Semantics are `first_argmax` and `sample_greedy`'s: a NaN counts as the maximum (the first
// NaN's index wins and the logprob is NaN); ties go to the lowest index; a row whose maximum is
// +inf or -inf gets a NaN logprob (x - max is NaN for the max itself), as XLA's formula gives.
// The sum's order differs from XLA's, so logprobs agree to float rounding, tokens exactly.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerItem = 2;  // a work item: ~30 us of a 49152-wide row pair
constexpr int64_t kMinRowsForHelpers = 4;  // below this, waking a helper costs more than it saves

struct Rows {
  int64_t B, V;
  const float* x;
  int32_t* tok;
  float* lp;
};

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

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

void row(const Rows& p, int64_t m) {
  const float* x = p.x + m * p.V;
  const float ninf = -std::numeric_limits<float>::infinity();
  // Pass 1: per lane the largest value and the first index holding it (a strict > keeps the
  // earlier index), and whether any NaN was seen.
  __m512 best = _mm512_set1_ps(ninf);
  __m512i best_i = _mm512_set1_epi32(0);
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  int64_t v = 0;
  for (; v + 16 <= p.V; v += 16) {
    const __m512 xv = _mm512_loadu_ps(x + v);
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(xv, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, xv);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (v < p.V) {
    const __mmask16 t = tail_mask(p.V - v);
    const __m512 xv = _mm512_mask_loadu_ps(_mm512_set1_ps(ninf), t, x + v);
    nan |= _mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(xv, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, xv);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
  }
  if (nan) {  // the first NaN is the maximum: find it (rare: a broken row)
    for (int64_t i = 0; i < p.V; ++i)
      if (std::isnan(x[i])) {
        p.tok[m] = int32_t(i);
        break;
      }
    p.lp[m] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float top = _mm512_reduce_max_ps(best);
  // The lowest index among lanes holding the maximum (a row of all -inf: index 0).
  const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  const int32_t first = _mm512_mask_reduce_min_epi32(at, best_i);
  p.tok[m] = at ? first : 0;
  // Pass 2: sum(exp(x - top)) (the row is in L2 now): each 64 values summed in float, those
  // sums in double, so the result does not drift with the vocabulary's size (one float
  // accumulator per lane was off by ~2e-6 over 49152 values; XLA's tree sum by ~2e-7).
  const __m512 t = _mm512_set1_ps(top);
  __m512d lo = _mm512_setzero_pd(), hi = lo;
  auto add = [&](__m512 s) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(s)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                               _mm512_castps_pd(s), 1))));
  };
  v = 0;
  for (; v + 64 <= p.V; v += 64) {
    const __m512 e0 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + v), t));
    const __m512 e1 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + v + 16), t));
    const __m512 e2 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + v + 32), t));
    const __m512 e3 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(x + v + 48), t));
    add(_mm512_add_ps(_mm512_add_ps(e0, e1), _mm512_add_ps(e2, e3)));
  }
  for (; v < p.V; v += 16) {
    const __mmask16 k = tail_mask(p.V - v);
    add(_mm512_maskz_mov_ps(k, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + v), t))));
  }
  const double sum = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
  p.lp[m] = float(-std::log(sum));
}
#else
// Portable: the same two passes, one value at a time.
void row(const Rows& p, int64_t m) {
  const float* x = p.x + m * p.V;
  int64_t arg = 0;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < p.V; ++i) {
    if (std::isnan(x[i])) {
      p.tok[m] = int32_t(i);
      p.lp[m] = std::numeric_limits<float>::quiet_NaN();
      return;
    }
    if (x[i] > top) {
      top = x[i];
      arg = i;
    }
  }
  p.tok[m] = int32_t(arg);
  double sum = 0.0;
  for (int64_t i = 0; i < p.V; ++i) sum += std::exp(x[i] - top);
  p.lp[m] = float(-std::log(sum));
}
#endif

// Items of kRowsPerItem rows handed out by one counter; `done` counts finished rows. Heap-held
// so a helper that starts after the call returned (it then finds no item left) touches no
// dead stack frame, and it reads the buffers only for an item it claimed, which the caller
// waits for.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void work(Shared& sh, const Rows& p, int64_t items) {
  for (int64_t i = sh.next.fetch_add(1); i < items; i = sh.next.fetch_add(1)) {
    const int64_t m1 = std::min(p.B, (i + 1) * kRowsPerItem);
    for (int64_t m = i * kRowsPerItem; m < m1; ++m) row(p, m);
    sh.done.fetch_add(m1 - i * kRowsPerItem, std::memory_order_acq_rel);
  }
}

ffi::Error GreedyRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Result<ffi::Buffer<ffi::S32>> tok,
                      ffi::Result<ffi::Buffer<ffi::F32>> lp) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || tok->dimensions().size() != 1 || tok->dimensions()[0] != xd[0] ||
      lp->dimensions().size() != 1 || lp->dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument("expected logits [B, V], tokens [B] and logprobs [B]");
  if (xd[1] < 1) return ffi::Error::InvalidArgument("logits need at least one column");
  const Rows p{xd[0], xd[1], x.typed_data(), tok->typed_data(), lp->typed_data()};
  if (p.B == 0) return ffi::Error::Success();
  const int64_t items = (p.B + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t helpers = p.B < kMinRowsForHelpers
                              ? 0
                              : std::min<int64_t>(pool.num_threads() - 1, items - 1);
  auto sh = std::make_shared<Shared>();
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh, p, items] { work(*sh, p, items); });
  work(*sh, p, items);
  while (sh->done.load(std::memory_order_acquire) < p.B) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxGreedyRowsCpu, GreedyRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // first argmax [B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // its raw logprob [B]
