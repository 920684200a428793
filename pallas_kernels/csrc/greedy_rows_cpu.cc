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

#include <cmath>
#include <cstdint>
#include <limits>

#include "row_math.h"
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
void row(const Rows& p, int64_t m) {
  const float* x = p.x + m * p.V;
  // Pass 1: the first maximum (per lane the largest value and the first index holding it).
  float top;
  if (!pagedjax_rows::first_max(x, p.V, p.tok[m], top)) {  // a NaN: it is the maximum
    p.lp[m] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // Pass 2: sum(exp(x - top)), the row in L2 now (`pagedjax_rows::sum_exp_below`).
  const double sum = pagedjax_rows::sum_exp_below(x, p.V, top);
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

ffi::Error GreedyRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Result<ffi::Buffer<ffi::S32>> tok,
                      ffi::Result<ffi::Buffer<ffi::F32>> lp) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || tok->dimensions().size() != 1 || tok->dimensions()[0] != xd[0] ||
      lp->dimensions().size() != 1 || lp->dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument("expected logits [B, V], tokens [B] and logprobs [B]");
  if (xd[1] < 1) return ffi::Error::InvalidArgument("logits need at least one column");
  const Rows p{xd[0], xd[1], x.typed_data(), tok->typed_data(), lp->typed_data()};
  pagedjax_rows::for_rows(pool, p.B, kRowsPerItem, kMinRowsForHelpers,
                          [p] { return [p](int64_t m) { row(p, m); }; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxGreedyRowsCpu, GreedyRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [B, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // first argmax [B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // its raw logprob [B]
