// Residual add and RMSNorm over float32 rows, as an XLA FFI call
// (`pallas_kernels.cpu_native.add_rms_norm_cpu`): r = x + delta, h = r * inv(r) * w with
// inv(r) = 1 / sqrt(mean(r * r) + eps). Without delta, r = x and only h is written.
//
// Why native code: between two native matmuls XLA:CPU compiles a norm to four thunks (the
// add, the sum of squares as a YNNPACK reduction, the rsqrt, the scale), each paying the
// executor's dispatch. At 64 rows of 576 they took ~38 us together in a decode step's
// jax.profiler trace, this call ~25 (docs/v1-core.md, stop 83); most of either is probably
// reading rows the other core has just written (the matmul before splits its columns
// between the cores). Here one pass per row makes the sum and one the outputs, the row in L1 between
// them. At 256 rows XLA's fusions moved the rows as fast, so the model calls this up to
// `cpu_native.NATIVE_NORM_MAX_ROWS` rows only.
//
// Numerics follow `models.decoder.rms_norm` on the rounded sum: r rounded to float, the sum of
// squares in float over 16 lanes in a fixed order (so AVX-512, AVX2 and portable builds give
// the same bits where each contracts to fused multiply-adds alike), 1 / sqrt correctly rounded,
// h = (r * inv) * w.

#include <cmath>
#include <cstdint>

#include "row_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;
// Rows per work item, and no helper below this many rows: a 64- or 256-row decode step's norm
// takes microseconds, less than waking a helper on a virtual machine (tens of microseconds).
constexpr int64_t kRowsPerItem = 64;
constexpr int64_t kMinRowsForHelpers = 1024;

struct Norm {
  int64_t H;
  const float* x;
  const float* delta;  // null: no add
  const float* w;
  float eps;
  float* r;  // null: no add
  float* h;
};

// 16 float lanes as GCC's generic vector: one zmm with AVX-512, two ymm with AVX2, four xmm
// otherwise, the same arithmetic per lane in each.
typedef float Lanes __attribute__((vector_size(4 * kLanes)));

inline Lanes load(const float* a) {
  Lanes v;
  __builtin_memcpy(&v, a, sizeof(v));
  return v;
}

void row(const Norm& p, int64_t m) {
  const int64_t H = p.H, whole = H - H % kLanes;
  const float* x = p.x + m * H;
  if (p.delta != nullptr) {
    const float* d = p.delta + m * H;
    float* r = p.r + m * H;
    for (int64_t i = 0; i < H; ++i) r[i] = x[i] + d[i];
    x = r;
  }
  Lanes acc = {};
  for (int64_t i = 0; i < whole; i += kLanes) {
    const Lanes v = load(x + i);
    acc += v * v;
  }
  if (whole < H) {  // the tail, zero-padded to a whole vector
    float tail[kLanes] = {};
    __builtin_memcpy(tail, x + whole, sizeof(float) * (H - whole));
    const Lanes v = load(tail);
    acc += v * v;
  }
  float lanes[kLanes];
  __builtin_memcpy(lanes, &acc, sizeof(lanes));
  for (int64_t width = kLanes / 2; width > 0; width /= 2)  // pairwise, the same on every ISA
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  const float inv = 1.0f / std::sqrt(lanes[0] / float(H) + p.eps);
  float* h = p.h + m * H;
  for (int64_t j = 0; j < H; ++j) h[j] = (x[j] * inv) * p.w[j];
}

ffi::Error check(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w, int64_t& rows,
                 int64_t& hidden) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("expected x [M, H]");
  rows = xd[0];
  hidden = xd[1];
  if (w.dimensions().size() != 1 || w.dimensions()[0] != hidden)
    return ffi::Error::InvalidArgument("expected weight [H]");
  return ffi::Error::Success();
}

void run(ffi::ThreadPool& pool, int64_t rows, const Norm& p) {
  pagedjax_rows::for_rows(pool, rows, kRowsPerItem, kMinRowsForHelpers,
                          [p] { return [p](int64_t m) { row(p, m); }; });
}

ffi::Error AddRmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> delta,
                      ffi::Buffer<ffi::F32> w, float eps, ffi::Result<ffi::Buffer<ffi::F32>> r,
                      ffi::Result<ffi::Buffer<ffi::F32>> h) {
  int64_t rows, hidden;
  if (ffi::Error e = check(x, w, rows, hidden); e.failure()) return e;
  if (delta.element_count() != x.element_count() || r->element_count() != x.element_count() ||
      h->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("expected delta, r and h shaped as x");
  run(pool, rows, Norm{hidden, x.typed_data(), delta.typed_data(), w.typed_data(), eps,
                       r->typed_data(), h->typed_data()});
  return ffi::Error::Success();
}

ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   float eps, ffi::Result<ffi::Buffer<ffi::F32>> h) {
  int64_t rows, hidden;
  if (ffi::Error e = check(x, w, rows, hidden); e.failure()) return e;
  if (h->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("expected h shaped as x");
  run(pool, rows, Norm{hidden, x.typed_data(), nullptr, w.typed_data(), eps, nullptr,
                       h->typed_data()});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxAddRmsNormCpu, AddRmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // delta [M, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // weight [H]
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // r = x + delta [M, H]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // h [M, H]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxRmsNormCpu, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // weight [H]
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // h [M, H]
