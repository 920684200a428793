// y[M, N] = x[M, K] @ w[K, N] for a float32 weight kept in 64-column panels, as an XLA FFI
// call (`pallas_kernels.cpu_native.dense_matmul_cpu`).
//
// Why native code: XLA:CPU hands every dot to Eigen, whose GEMM packs the weight matrix on
// each call. For the few rows of a decode or speculative-verification step that packing
// costs more than the arithmetic: on the demo model the layers' matmuls took 21 ms at one
// row and 41 ms at eight (the weights are the same bytes either way), and the LM head 3.3 ms
// at one row but 7.5 ms at two to eight. Here each panel [K, 64] of the weight is one
// contiguous stream (`models.qlinear.to_dense_panels`) that is read once per block of up to
// six rows and used straight from the cache lines: up to six rows cost what one costs, which
// is what a speculative step's k + 1 rows need.
//
// Work items are (panel, chunk of rows) pairs over XLA's intra-op thread pool (the calling
// thread too), each thread with its own list (a last item that does not divide evenly is cut
// between the threads by rows: `Split`). With more than one register block of rows, an
// item also pulls the panel its thread takes next into L2, one line every few k spread over
// the item's blocks, so that panel's first pass does not wait on memory (in a standalone copy
// of this kernel the demo model's weight matmuls at 64 rows went from ~91 to ~72 ms a step
// with a guessed next panel and bursts of prefetches; with each thread's own list, the
// prefetches spread evenly and uneven items cut, 74.3 -> 64.3 ms in `bench/native_ab.py
// --kind matmul --base 4ded95e`; docs/v1-core.md).
// At one block (batch-1 decode) the whole next panel would be fetched during a single pass,
// which measured slower, so none is.
//
// A step of at most three rows (batch-1 decode, a small verification step) reads every
// weight once for very little arithmetic: it is bound by memory bandwidth. One sequential
// stream per thread drew ~24 GB/s from this host's memory, four side by side ~29.5 (a
// standalone read test), so such a step's items are groups of up to 6 / rows panels (at most
// four) read together, one register block over all of them: the demo model's weight matmuls at
// one row went from ~23.3 to ~19.7 ms, at two and three rows 6-8 % faster (docs/v1-core.md).
//
// With AVX-512 a 6 x 64 register block (24 accumulators) runs over K; with AVX2 and FMA a
// 6 x 16 one over each 16-column strip of a panel; else a portable loop. Each output is one
// fused multiply-add chain over k = 0 .. K-1 in order, the same whichever block or chunk holds
// its row: results do not depend on the number of rows (a row scores the same in a decode
// step as in a verification step) and differ from a float dot only by reassociation.

// The MLP's gate and up projections as one call with the activation in its epilogue
// (`DenseMatmulSiluMul`, `dense_matmul_cpu(..., silu_mul=True)`): y = silu(x @ W_gate) *
// (x @ W_up) for the fused gate_up weight, whose first half of panels is the gate's and second
// the up's. An item computes gate panel b's register block into a stack buffer, then up panel
// b's into y, and combines them there while both are in L1: the [M, 2I] product is never
// written and XLA's separate silu * up thunk (55 us a 64-row layer on the demo model, 1.65 ms a
// step; docs/v1-core.md) is gone. silu is computed the same way in every build (`silu_mul`).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 64;        // output columns per panel
constexpr int64_t kBlockRows = 6;    // rows sharing one pass over a panel (register block)
constexpr int64_t kChunkRows = 64;  // a 64-row step is one item per panel
// Rows per chunk of an M-row step: chunks start on register-block boundaries, so only the
// step's last block is short. With 64-row chunks every chunk of a 256-row step ended in a
// 4-row block, which read the panel from L2 for two thirds of a 6-row block's work: those
// blocks took ~8 % of a 256-row decode step's matmul samples for 6 % of its rows (perf, the
// demo model; docs/v1-core.md). Up to 512 rows (decode steps) the ceil(M / 64) chunks are
// rounded up to whole blocks (256 rows: 66 + 66 + 66 + 58, ~1.5 % faster in
// `bench/native_ab.py --kind matmul`); past that (prefill) down (60 rows), since chunks of
// more than 64 rows ran a 2048-row step 3-10 % slower there, likely by spilling L2 (a chunk of
// x, its panel and the next one pulled in: ~1.2 MB at K = 1536).
inline int64_t chunk_rows(int64_t M) {
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t per = (M + chunks - 1) / chunks;
  if (M > 8 * kChunkRows) return per / kBlockRows * kBlockRows;
  return (per + kBlockRows - 1) / kBlockRows * kBlockRows;
}
// The chunks of an M-row step: chunk_rows(M) rows each, the last taking what is left, and
// fewer than 6 rows left over join the chunk before (544 rows: 8 x 60 and 64, not 9 x 60
// and 4).
inline int64_t chunk_count(int64_t M) {
  const int64_t rows = chunk_rows(M), chunks = (M + rows - 1) / rows;
  return chunks > 1 && M - (chunks - 1) * rows < kBlockRows ? chunks - 1 : chunks;
}
constexpr int64_t kMaxChunkRows = kChunkRows + 2 * kBlockRows;  // above any chunk (<= 66 rows)

// The end of the register block that starts at row m of rows [m, m1): 6 rows, except that
// the last 7-9 rows are two blocks of 3-5 (one of 1-3 rows would read the panel from L2 for
// almost nothing each time).
inline int64_t block_end(int64_t m, int64_t m1) {
  const int64_t left = m1 - m;
  if (left > kBlockRows && left < kBlockRows + 4) return m + (left + 1) / 2;
  return std::min(m1, m + kBlockRows);
}

constexpr int64_t kGroupMaxRows = 3;  // steps of up to this many rows read panels in groups
constexpr int64_t kAhead = 32;   // rows per work item: 8 blocks over a panel held in L2

struct Dense {
  int64_t M, K, N, panels;
  const float* x;  // [M, K]
  const float* w;  // [ceil(N / 64), K, 64]; gated: [2 panels, K, 64], gate then up
  float* y;        // output (m, n) at y[(m - row0) * ldy + n - col0]: [M, N], or a helper's
  int64_t ldy, row0 = 0, col0 = 0;  // scratch for one work item (`Shared`)
  bool gated = false;  // y = silu(x @ gate) * (x @ up) (`DenseMatmulSiluMul`)
  int64_t cols(int64_t b) const { return std::min(kCols, N - b * kCols); }
  float* out(int64_t m, int64_t n) const { return y + (m - row0) * ldy + (n - col0); }
};

// silu(g) * u, the same bits in every build (the scalar and vector forms below are one
// sequence of correctly rounded operations): e = exp(-g) by n = rint(-g / ln 2),
// r = -g - n ln 2 (two FMAs, ln 2 in two parts) and a degree-7 Taylor polynomial in r
// (|r| <= 0.347: truncation below 6e-9, under half an ulp), scaled by 2^n; then
// g * (1 / (1 + e)) * u. -g is clamped to [-87, 88] so 2^n stays a normal float, and past 88
// the sigmoid is 0 (silu's limit: a gate of -1e30 gives -0, not -1e30 * e^-88; -inf gives
// NaN, as XLA's does); NaN in g stays NaN. Within a few ulps of float64
// (`tests/kernels/test_dense_silu_mul.py`); XLA's own silu rounds differently, so outputs
// differ from the unfused graph by ulps.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f,
                kLn2Lo = 1.42860682030941723e-6f;
constexpr float kTaylor[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720,
                              1.f / 5040};

inline float silu_mul_one(float g, float u) {
  const float neg = -g;
  const float x = std::min(neg > -87.f ? neg : -87.f, 88.f);  // NaN -> -87, as maxps does
  const float n = __builtin_rintf(x * kLog2e);
  float r = std::fma(-n, kLn2Hi, x);
  r = std::fma(-n, kLn2Lo, r);
  float q = kTaylor[7];
  for (int i = 6; i >= 0; --i) q = std::fma(q, r, kTaylor[i]);
  uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  const float e = q * scale;
  const float sig = neg > 88.f ? 0.f : 1.f / (1.f + e);
  return (g * sig) * u;
}

// y[i] = silu(g[i]) * y[i] for i < n.
void silu_mul(const float* g, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 lo = _mm512_set1_ps(-87.f), hi = _mm512_set1_ps(88.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gv);
    // min(max(-g, lo), hi) with NaN kept: a NaN lane is fixed below by g * ...
    const __m512 x = _mm512_min_ps(_mm512_max_ps(neg, lo), hi);
    const __m512 nv = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(nv, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(nv, _mm512_set1_ps(kLn2Lo), r);
    __m512 q = _mm512_set1_ps(kTaylor[7]);
    for (int t = 6; t >= 0; --t) q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(kTaylor[t]));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(nv), _mm512_set1_epi32(127)), 23);
    const __m512 e = _mm512_mul_ps(q, _mm512_castsi512_ps(bits));
    const __m512 sig = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(neg, hi, _CMP_LE_OQ) |
                                               _mm512_cmp_ps_mask(neg, neg, _CMP_UNORD_Q),
                                           _mm512_set1_ps(1.f),
                                           _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(gv, sig), _mm512_loadu_ps(y + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 lo = _mm256_set1_ps(-87.f), hi = _mm256_set1_ps(88.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), gv);
    const __m256 x = _mm256_min_ps(_mm256_max_ps(neg, lo), hi);
    const __m256 nv = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(nv, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(nv, _mm256_set1_ps(kLn2Lo), r);
    __m256 q = _mm256_set1_ps(kTaylor[7]);
    for (int t = 6; t >= 0; --t) q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(kTaylor[t]));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(nv), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(q, _mm256_castsi256_ps(bits));
    const __m256 sig = _mm256_andnot_ps(  // 0 where -g > 88 (NaN compares false: kept)
        _mm256_cmp_ps(neg, hi, _CMP_GT_OQ),
        _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(y + i)));
  }
#endif
  for (; i < n; ++i) y[i] = silu_mul_one(g[i], y[i]);
}

#if defined(__AVX512F__)
inline __mmask16 lane_mask(int64_t nc, int i) {
  const int64_t left = nc - 16 * i;
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

// Rows [m0, m0 + MR) of panel b.
// `ahead`, `lines`: cache lines of a later panel to pull into L2 over the pass (null: none).
template <int MR>
void block(const Dense& p, int64_t b, int64_t m0, const char* ahead, int64_t lines) {
  const float* w = p.w + b * p.K * kCols;
  const float* x = p.x + m0 * p.K;
  __m512 c[MR][4];
  for (int q = 0; q < MR; ++q)
    for (int i = 0; i < 4; ++i) c[q][i] = _mm512_setzero_ps();
  // The later panel's lines one at a time, evenly over the pass: a software prefetch holds
  // one of the core's few L1 fill buffers until memory answers, and bursts of them starved
  // this pass's own loads from L2 (two lines per k over the first part of the pass ran the
  // demo model's 64-row matmuls ~7 % slower in a standalone copy; docs/v1-core.md).
  const int64_t every = std::max<int64_t>(1, p.K / std::max<int64_t>(1, lines));
  int64_t wait = 0, line = ahead != nullptr ? 0 : lines;
  for (int64_t k = 0; k < p.K; ++k) {
    const float* wk = w + k * kCols;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kCols), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kCols + 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kCols + 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kCols + 48), _MM_HINT_T0);
    if (line < lines && --wait <= 0) {  // a counter, not a division per k
      _mm_prefetch(ahead + 64 * line++, _MM_HINT_T1);
      wait = every;
    }
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16),
                 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int q = 0; q < MR; ++q) {
      const __m512 a = _mm512_set1_ps(x[q * p.K + k]);
      c[q][0] = _mm512_fmadd_ps(a, w0, c[q][0]);
      c[q][1] = _mm512_fmadd_ps(a, w1, c[q][1]);
      c[q][2] = _mm512_fmadd_ps(a, w2, c[q][2]);
      c[q][3] = _mm512_fmadd_ps(a, w3, c[q][3]);
    }
  }
  const int64_t nc = p.cols(b);
  for (int q = 0; q < MR; ++q)
    for (int i = 0; i < 4; ++i)
      _mm512_mask_storeu_ps(p.out(m0 + q, b * kCols + 16 * i), lane_mask(nc, i), c[q][i]);
}

// Rows [m0, m0 + MR) of panels [b, b + G): G streams read side by side, no software prefetch
// (the hardware's stream prefetchers follow G streams; extra prefetches measured slower).
template <int MR, int G>
void group_block(const Dense& p, int64_t b, int64_t m0) {
  const float* w = p.w + b * p.K * kCols;
  const int64_t stride = p.K * kCols;
  const float* x = p.x + m0 * p.K;
  __m512 c[G][MR][4];
  for (int g = 0; g < G; ++g)
    for (int q = 0; q < MR; ++q)
      for (int i = 0; i < 4; ++i) c[g][q][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K; ++k) {
    for (int g = 0; g < G; ++g) {
      const float* wk = w + g * stride + k * kCols;
      const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16),
                   w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
      for (int q = 0; q < MR; ++q) {
        const __m512 a = _mm512_set1_ps(x[q * p.K + k]);
        c[g][q][0] = _mm512_fmadd_ps(a, w0, c[g][q][0]);
        c[g][q][1] = _mm512_fmadd_ps(a, w1, c[g][q][1]);
        c[g][q][2] = _mm512_fmadd_ps(a, w2, c[g][q][2]);
        c[g][q][3] = _mm512_fmadd_ps(a, w3, c[g][q][3]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const int64_t nc = p.cols(b + g);
    for (int q = 0; q < MR; ++q)
      for (int i = 0; i < 4; ++i)
        _mm512_mask_storeu_ps(p.out(m0 + q, (b + g) * kCols + 16 * i), lane_mask(nc, i),
                              c[g][q][i]);
  }
}

// Panels [b, b + g) for MR rows, at most 6 / MR (and 4) of them side by side: the register
// block holds G x MR x 4 accumulators.
template <int MR>
void group_of(const Dense& p, int64_t b, int64_t g) {
  constexpr int64_t kMax = MR == 1 ? 4 : 6 / MR;
  for (; g > 0; b += kMax, g -= kMax) {
    switch (std::min(g, kMax)) {
      case 4: if constexpr (kMax >= 4) group_block<MR, 4>(p, b, 0); break;
      case 3: if constexpr (kMax >= 3) group_block<MR, 3>(p, b, 0); break;
      case 2: group_block<MR, 2>(p, b, 0); break;
      default: group_block<MR, 1>(p, b, 0); break;
    }
  }
}

// All rows (M <= kGroupMaxRows) of panels [b, b + g).
void group(const Dense& p, int64_t b, int64_t g) {
  switch (p.M) {
    case 1: group_of<1>(p, b, g); break;
    case 2: group_of<2>(p, b, g); break;
    default: group_of<3>(p, b, g); break;
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 with FMA (AMD Zen 2-3, Intel without AVX-512): 16 vector registers of 8 floats, so a
// panel's 64 columns do not fit one register block of several rows as they do above. Batched
// rows run a 6 x 16 block (12 accumulators, 2 weight vectors, one broadcast: the usual AVX2
// GEMM shape) over each of the panel's four 16-column strips in turn; a strip of one k is one
// cache line, so the four passes read the panel once per 6 rows, from L2. One to three rows
// read the panel's full width in one pass (1 x 64) or two (2-3 x 32): they are bound by memory,
// not by the FMAs. Each output is the same FMA chain over k as everywhere else, so results
// are bit-identical to the AVX-512 and portable paths (`tests/kernels/test_cpu_isa_paths.py`).

// Rows [m0, m0 + MR) x columns [c0, c0 + 8 NV) of panel b; `ahead`, `lines` as in the
// AVX-512 `block`.
template <int MR, int NV>
void strip(const Dense& p, int64_t b, int64_t m0, int64_t c0, const char* ahead, int64_t lines) {
  const int64_t K = p.K;
  const float* w = p.w + b * K * kCols + c0;
  const float* x = p.x + m0 * K;
  __m256 c[MR][NV];
  for (int q = 0; q < MR; ++q)
    for (int v = 0; v < NV; ++v) c[q][v] = _mm256_setzero_ps();
  // The later panel's lines one every `every` k, issued between runs of k.
  const int64_t every = std::max<int64_t>(1, K / std::max<int64_t>(1, lines));
  int64_t line = ahead != nullptr ? 0 : lines;
  for (int64_t k0 = 0; k0 < K; k0 += every) {
    if (line < lines) _mm_prefetch(ahead + 64 * line++, _MM_HINT_T1);
    const int64_t k1 = std::min(K, k0 + every);
    for (int64_t k = k0; k < k1; ++k) {
      const float* wk = w + k * kCols;
      for (int v = 0; v < NV; v += 2)  // this strip's line(s) kAhead rows of k further on
        _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * kCols + 8 * v), _MM_HINT_T0);
      __m256 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(wk + 8 * v);
#pragma GCC unroll 6
      for (int q = 0; q < MR; ++q) {
        const __m256 a = _mm256_broadcast_ss(x + q * K + k);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) c[q][v] = _mm256_fmadd_ps(a, wv[v], c[q][v]);
      }
    }
  }
  // Only the columns of this strip that exist (panels pad with zeros): plain stores for a
  // whole strip, a mask for the last panel's part. Loops of fixed trip counts: an
  // accumulator indexed at run time (a `break` here) made GCC keep them all in memory,
  // storing every one of them every k (a quarter of the FMA peak).
  const int64_t nc = p.cols(b) - c0;
  if (nc >= 8 * NV) {
#pragma GCC unroll 6
    for (int q = 0; q < MR; ++q)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v)
        _mm256_storeu_ps(p.y + (m0 + q - p.row0) * p.ldy + (b * kCols + c0 + 8 * v - p.col0),
                         c[q][v]);
    return;
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    const int left = int(std::clamp<int64_t>(nc - 8 * v, 0, 8));
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#pragma GCC unroll 6
    for (int q = 0; q < MR; ++q)
      _mm256_maskstore_ps(p.y + (m0 + q - p.row0) * p.ldy + (b * kCols + c0 + 8 * v - p.col0),
                          mask, c[q][v]);
  }
}

// Rows [m0, m0 + MR) of panel b, in strips of 16 columns; the later panel's lines spread over
// the strips.
template <int MR>
void block(const Dense& p, int64_t b, int64_t m0, const char* ahead, int64_t lines) {
  const int64_t nc = p.cols(b), quarter = (lines + 3) / 4;
  for (int s = 0; s < 4 && 16 * s < nc; ++s) {
    const int64_t from = std::min<int64_t>(lines, s * quarter);
    const int64_t n = std::min<int64_t>(quarter, lines - from);
    strip<MR, 2>(p, b, m0, 16 * s, ahead != nullptr && n > 0 ? ahead + 64 * from : nullptr,
                 ahead != nullptr ? n : 0);
  }
}

// All rows (M <= kGroupMaxRows) of panels [b, b + g): one pass per panel at one row, two
// half-width passes at two or three.
void group(const Dense& p, int64_t b, int64_t g) {
  for (int64_t i = b; i < b + g; ++i) {
    switch (p.M) {
      case 1: strip<1, 8>(p, i, 0, 0, nullptr, 0); break;
      case 2:
        strip<2, 4>(p, i, 0, 0, nullptr, 0);
        if (p.cols(i) > 32) strip<2, 4>(p, i, 0, 32, nullptr, 0);
        break;
      default:
        strip<3, 4>(p, i, 0, 0, nullptr, 0);
        if (p.cols(i) > 32) strip<3, 4>(p, i, 0, 32, nullptr, 0);
        break;
    }
  }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Rows [m0, m1) of panel b, at most one register block (either path's `block`).
void one_block(const Dense& p, int64_t b, int64_t m0, int64_t m1, const char* ahead,
               int64_t n) {
  switch (m1 - m0) {
    case 6: block<6>(p, b, m0, ahead, n); break;
    case 5: block<5>(p, b, m0, ahead, n); break;
    case 4: block<4>(p, b, m0, ahead, n); break;
    case 3: block<3>(p, b, m0, ahead, n); break;
    case 2: block<2>(p, b, m0, ahead, n); break;
    case 1: block<1>(p, b, m0, ahead, n); break;
    default: break;
  }
}

// Rows [m0, m1) of panel b in register blocks of up to 6 rows (either path's `block`), the
// lines of panel `nb`, which this thread takes next (out of range: none), spread over them.
void rows(const Dense& p, int64_t b, int64_t m0, int64_t m1, int64_t nb) {
  const int64_t blocks = (m1 - m0 + kBlockRows - 1) / kBlockRows;
  const int64_t lines = p.K * kCols * int64_t(sizeof(float)) / 64;  // one panel's
  const int64_t per = (lines + blocks - 1) / blocks;                // per block
  const char* next = blocks > 1 && nb >= 0 && nb < p.panels
                         ? reinterpret_cast<const char*>(p.w + nb * p.K * kCols)
                         : nullptr;
  for (int64_t m = m0, j = 0; m < m1; ++j) {
    const char* ahead = next != nullptr && j * per < lines ? next + 64 * j * per : nullptr;
    const int64_t n = std::max<int64_t>(0, std::min(per, lines - j * per));
    const int64_t e = block_end(m, m1);
    one_block(p, b, m, e, ahead, n);
    m = e;
  }
}
#else
// Portable: the same chain per output (a fused multiply-add where the target has one).
void rows(const Dense& p, int64_t b, int64_t m0, int64_t m1, int64_t /*nb*/) {
  const float* w = p.w + b * p.K * kCols;
  const int64_t nc = p.cols(b);
  for (int64_t m = m0; m < m1; ++m) {
    float acc[kCols] = {};
    const float* x = p.x + m * p.K;
    for (int64_t k = 0; k < p.K; ++k)
      for (int64_t c = 0; c < kCols; ++c) acc[c] = __builtin_fmaf(x[k], w[k * kCols + c], acc[c]);
    for (int64_t c = 0; c < nc; ++c) *p.out(m, b * kCols + c) = acc[c];
  }
}

void group(const Dense& p, int64_t b, int64_t g) {
  for (int64_t i = 0; i < g; ++i) rows(p, b + i, 0, p.M, -1);
}

void one_block(const Dense& p, int64_t b, int64_t m0, int64_t m1, const char*, int64_t) {
  rows(p, b, m0, m1, -1);
}
#endif

// The gated call's pieces: gate panel b into a buffer (`gate_part`), up panel b into y
// (`up_part`: its panels follow the gate's, and land on output column b * 64 + c).
Dense gate_part(const Dense& p, float* buf, int64_t ld, int64_t row0, int64_t b) {
  Dense q = p;
  q.gated = false;
  q.y = buf;
  q.ldy = ld;
  q.row0 = row0;
  q.col0 = b * kCols;
  return q;
}

Dense up_part(const Dense& p) {
  Dense q = p;
  q.gated = false;
  q.N = 2 * p.N;  // up panel b + panels has as many columns as gate panel b (N % 64 == 0)
  q.col0 = p.col0 + p.panels * kCols;
  return q;
}

// Gated rows [m0, m1) of output panel b: per register block, the gate's into a buffer, the
// up's into y, then y = silu(gate) * y. The lines of the thread's next gate and up panels
// (`nb`) are pulled into L2 over the blocks, as `rows` does for one panel.
void gated_rows(const Dense& p, int64_t b, int64_t m0, int64_t m1, int64_t nb) {
  alignas(64) float buf[kBlockRows * kCols];
  const Dense up = up_part(p);
  const int64_t blocks = (m1 - m0 + kBlockRows - 1) / kBlockRows;
  const int64_t lines = p.K * kCols * int64_t(sizeof(float)) / 64;
  const int64_t per = (lines + blocks - 1) / blocks;
  const bool ahead = blocks > 1 && nb >= 0 && nb < p.panels;
  const char* next_gate = ahead ? reinterpret_cast<const char*>(p.w + nb * p.K * kCols) : nullptr;
  const char* next_up =
      ahead ? reinterpret_cast<const char*>(p.w + (nb + p.panels) * p.K * kCols) : nullptr;
  const int64_t nc = p.cols(b);
  for (int64_t m = m0, j = 0, e = 0; m < m1; m = e, ++j) {
    e = block_end(m, m1);
    const bool some = ahead && j * per < lines;
    const int64_t n = some ? std::min(per, lines - j * per) : 0;
    one_block(gate_part(p, buf, kCols, m, b), b, m, e, some ? next_gate + 64 * j * per : nullptr, n);
    one_block(up, b + p.panels, m, e, some ? next_up + 64 * j * per : nullptr, n);
    for (int64_t r = m; r < e; ++r) silu_mul(buf + (r - m) * kCols, p.out(r, b * kCols), nc);
  }
}

// Gated, all rows (M <= kGroupMaxRows) of output panels [b, b + g).
void gated_group(const Dense& p, int64_t b, int64_t g) {
  alignas(64) float buf[kGroupMaxRows * 4 * kCols];  // g <= 4 (`group_size`)
  group(gate_part(p, buf, g * kCols, 0, b), b, g);
  group(up_part(p), b + p.panels, g);
  const int64_t nc = std::min(g * kCols, p.N - b * kCols);
  for (int64_t m = 0; m < p.M; ++m) silu_mul(buf + m * g * kCols, p.out(m, b * kCols), nc);
}

// Work sharing that tolerates a stalled helper. On a shared machine the OS preempts a pool
// thread for a whole time slice (milliseconds) while it holds a work item; if the caller
// waited for it, every matmul of the step would wait out the other process, and the second
// core's remaining half was lost (one core busy: the demo model's one-row matmuls ran 35.2 ms
// with two threads, 34.5 with one; docs/v1-core.md). Every item has a state, and a call runs
// in one of two modes (`take_over`):
// - direct (the default): helpers claim an item (kFree -> kClaimed), compute it straight into
//   y and mark it kDone; the caller, out of unclaimed items, waits for those in flight.
// - taking over (PAGEDJAX_MATMUL_TAKE_OVER=1, for shared machines): helpers compute an item
//   into their own scratch from a copy of x (held here, so a helper that resumes after the
//   call returned reads nothing XLA may have reused or freed), then commit it to y only by
//   winning kClaimed -> kWriting; the caller waits for items in flight up to twice its own
//   mean item time (a running helper finishes within that), then takes over what is left
//   (kFree/kClaimed -> kStolen) and computes it into y itself, and the late helper's commit
//   fails. This costs ~2-3 % on a quiet machine (the copy of x, the scratch), and in the whole
//   engine with one core taken by another process it gained only 2-8 % (the matmuls alone:
//   1.25-1.4x; docs/v1-core.md), so it is not the default. Switching to it after a detected
//   stall misfired on this project's noisy VM: quiet runs paid the 2-3 %.
// In both, an item still kFree after its list ran out (its helper stalled between the claim
// and kClaimed) is the caller's. Every output is computed by the same code whoever does it,
// so results do not depend on who did an item or on the mode.
// Heap-held (shared_ptr) so a task that starts, or resumes, after the call never touches a
// dead stack frame.
enum : int8_t { kFree = 0, kClaimed = 1, kWriting = 2, kDone = 3, kStolen = 4 };

struct Shared {
  Shared(int64_t threads, int64_t items, const Dense& p, bool take_over)
      : take_over(take_over), own(new std::atomic<int64_t>[threads]),
        state(new std::atomic<int8_t>[items]) {
    for (int64_t t = 0; t < threads; ++t) own[t].store(0);
    for (int64_t i = 0; i < items; ++i) state[i].store(kFree);
    if (take_over && threads > 1) {  // only helpers read the copy
      xcopy.reset(new float[p.M * p.K]);
      std::memcpy(xcopy.get(), p.x, sizeof(float) * p.M * p.K);
    }
  }
  const bool take_over;
  std::atomic<int64_t> next{0};    // groups of panels: one list
  std::unique_ptr<std::atomic<int64_t>[]> own;  // row chunks: each thread's list
  std::unique_ptr<std::atomic<int8_t>[]> state;  // per item
  std::unique_ptr<float[]> xcopy;  // x as the helpers read it (taking over)
};

// PAGEDJAX_MATMUL_TAKE_OVER=1: take items over (`bench/offline_throughput.py --engines
// pagedjax-wait-helpers,pagedjax-take-over --busy-core`); unset or 0: direct.
bool take_over_setting() {
  static const bool on = [] {
    const char* v = std::getenv("PAGEDJAX_MATMUL_TAKE_OVER");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

// Debug: helpers sleep this many microseconds before committing each item
// (PAGEDJAX_MATMUL_HELPER_STALL_US; tests stand it in for a preempted thread).
int64_t helper_stall_us() {
  static const int64_t us = [] {
    const char* v = std::getenv("PAGEDJAX_MATMUL_HELPER_STALL_US");
    return v != nullptr ? std::max<int64_t>(0, std::atoll(v)) : int64_t(0);
  }();
  return us;
}

// Panels per item for a step of `m` rows: 0 = single panels in row chunks (`rows`).
int64_t group_size(int64_t m, int64_t panels, int64_t threads) {
  if (m > kGroupMaxRows) return 0;
  const int64_t g = std::min<int64_t>(m == 1 ? 4 : 6 / m, (panels + threads - 1) / threads);
  return std::max<int64_t>(1, g);
}

// The row-chunk items of a step: (panel, chunk) pairs, panel-major, except that when they do
// not divide evenly among the threads the last `items % threads` of them are each cut into
// `threads` parts of whole register blocks, one per thread. Otherwise a matrix of few panels
// (the demo model's o and down projections have 9) keeps one thread working on its extra
// panel while the other waits (~40 us a call at 64 rows in a standalone copy).
struct Split {
  Split(const Dense& p, int64_t chunks, int64_t threads)
      : M(p.M), chunks(chunks), threads(threads), rows(chunk_rows(p.M)) {
    const int64_t all = p.panels * chunks;
    whole = all - all % threads;
    items = whole + (all % threads) * threads;
  }
  int64_t M, chunks, threads, rows, whole, items;  // rows: per chunk (`chunk_rows`)
  // The (panel, chunk) pair behind item i.
  int64_t unit(int64_t i) const { return i < whole ? i : whole + (i - whole) / threads; }
  int64_t panel(int64_t i) const { return unit(i) / chunks; }
  void rows_of(int64_t i, int64_t& m0, int64_t& m1) const {
    const int64_t c = unit(i) % chunks, c0 = c * rows;
    const int64_t c1 = c + 1 == chunks ? M : std::min(M, c0 + rows);  // `chunk_count`
    if (i < whole) {
      m0 = c0;
      m1 = c1;
      return;
    }
    const int64_t part = (i - whole) % threads;  // == the owner's id: items step by threads
    const int64_t blocks = (c1 - c0 + kBlockRows - 1) / kBlockRows;
    m0 = std::min(c1, c0 + kBlockRows * (part * blocks / threads));
    m1 = std::min(c1, c0 + kBlockRows * ((part + 1) * blocks / threads));
  }
};

// Item i of a step: panels [i * g, ...) of every row (g > 0), or the (panel, rows) of `sp`.
struct Items {
  const Split& sp;
  int64_t g, panels;
  int64_t count() const { return g ? (panels + g - 1) / g : sp.items; }
  // First panel, panel count and rows of item i.
  void span(int64_t i, int64_t& b, int64_t& nb, int64_t& m0, int64_t& m1) const {
    if (g) {
      b = i * g;
      nb = std::min(g, panels - b);
      m0 = 0;
      m1 = sp.M;
      return;
    }
    b = sp.panel(i);
    nb = 1;
    sp.rows_of(i, m0, m1);
  }
};

// Item i into p's output; `next`: the panel to pull into L2 meanwhile (-1: none).
void compute(const Dense& p, const Items& it, int64_t i, int64_t next) {
  int64_t b, nb, m0, m1;
  it.span(i, b, nb, m0, m1);
  if (it.g)
    p.gated ? gated_group(p, b, nb) : group(p, b, nb);
  else if (m0 < m1)
    p.gated ? gated_rows(p, b, m0, m1, next) : rows(p, b, m0, m1, next);
}

// A helper's item: direct, straight into y; taking over, into scratch from the copy of x and
// committed unless stolen.
void helper_item(Shared& sh, const Dense& p, const Items& it, int64_t i, int64_t next,
                 float* scratch) {
  int8_t expect = kFree;
  if (!sh.state[i].compare_exchange_strong(expect, kClaimed)) return;  // the caller has it
  if (!sh.take_over) {  // direct: the caller waits for this item
    compute(p, it, i, next);
    if (const int64_t us = helper_stall_us())
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    sh.state[i].store(kDone, std::memory_order_release);
    return;
  }
  int64_t b, nb, m0, m1;
  it.span(i, b, nb, m0, m1);
  Dense q = p;
  q.x = sh.xcopy.get();
  q.y = scratch;
  q.ldy = nb * kCols;
  q.row0 = m0;
  q.col0 = b * kCols;
  compute(q, it, i, next);
  if (const int64_t us = helper_stall_us()) std::this_thread::sleep_for(std::chrono::microseconds(us));
  expect = kClaimed;
  if (!sh.state[i].compare_exchange_strong(expect, kWriting)) return;  // stolen: drop it
  const int64_t n0 = b * kCols, n1 = std::min(p.N, (b + nb) * kCols);
  for (int64_t m = m0; m < m1; ++m)
    std::memcpy(p.out(m, n0), q.out(m, n0), sizeof(float) * (n1 - n0));
  sh.state[i].store(kDone, std::memory_order_release);
}

// The caller's item: straight into y (nobody else commits an item the caller claimed).
void caller_item(Shared& sh, const Dense& p, const Items& it, int64_t i, int64_t next) {
  int8_t expect = kFree;
  if (!sh.state[i].compare_exchange_strong(expect, kStolen)) return;  // cannot happen: claimed once
  compute(p, it, i, next);
}

// `g`: `group_size` of this step (0: row chunks); `id`: this thread's list (0: the caller's).
//
// Row chunks: item i is (panel i / chunks, chunk i % chunks), panel-major, so a panel's
// chunks run side by side and it comes from memory once per thread. Thread t owns items
// t, t + threads, ...: it knows which panel it takes next and pulls that one into L2 while it
// works (with one shared counter it had to guess, and a wrong guess left the next panel
// cold: the demo model's 64-row matmuls ran ~15 % faster with own lists in a standalone
// copy). A thread done with its list takes from the others' (no prefetching for them).
void work(const std::shared_ptr<Shared>& sh, const Dense& p, int64_t chunks, int64_t threads,
          int64_t g, int64_t id) {
  const Split sp(p, chunks, threads);
  const Items it{sp, g, p.panels};
  float scratch[kMaxChunkRows * kCols];  // a helper's item: a chunk x 64, or <= 6 x 64 x 1-3 rows
  int64_t own_items = 0;  // the caller's, and the time they took
  const auto t0 = std::chrono::steady_clock::now();
  auto run = [&](int64_t i, int64_t next) {
    if (id == 0) {
      caller_item(*sh, p, it, i, next);
      ++own_items;
    } else {
      helper_item(*sh, p, it, i, next, scratch);
    }
  };
  if (g) {
    for (int64_t i = sh->next.fetch_add(1); i < it.count(); i = sh->next.fetch_add(1)) run(i, -1);
  } else {
    for (int64_t o = 0; o < threads; ++o) {
      const int64_t t = (id + o) % threads;
      for (int64_t j = sh->own[t].fetch_add(1); t + j * threads < sp.items;
           j = sh->own[t].fetch_add(1)) {
        const int64_t i = t + j * threads, b = sp.panel(i);
        int64_t nb = -1;  // the owner's next panel other than b
        if (o == 0)
          for (int64_t i2 = i + threads; i2 < sp.items; i2 += threads)
            if (sp.panel(i2) != b) {
              nb = sp.panel(i2);
              break;
            }
        run(i, nb);
      }
    }
  }
  if (id != 0) return;
  // Every item is claimed. A helper that is running finishes its last item within about an
  // item's time, which is much sooner than the caller could redo it (taking each over at once
  // cost 13 % at one row and 5 % at 64 rows in `bench/native_ab.py`: the last item done twice
  // in every call). So, taking over, wait up to twice the caller's own mean item time (at
  // least 20 us), then take over what is left; a preempted helper stays away for a time slice
  // (milliseconds). Direct, wait for kClaimed items.
  const auto now = std::chrono::steady_clock::now();
  const auto mean = own_items ? (now - t0) / own_items : std::chrono::nanoseconds(0);
  const auto deadline = now + std::max<std::chrono::nanoseconds>(2 * mean, std::chrono::microseconds(20));
  for (int64_t i = 0; i < it.count(); ++i) {
    for (;;) {
      int8_t s = sh->state[i].load(std::memory_order_acquire);
      if (s == kDone || s == kStolen) break;
      const bool wait = sh->take_over ? s == kWriting || std::chrono::steady_clock::now() < deadline
                                      : s == kClaimed;
      if (wait) {  // yield: the helper may be waiting for this very core
        std::this_thread::yield();
        continue;
      }
      if (sh->state[i].compare_exchange_strong(s, kStolen)) {
        compute(p, it, i, -1);
        break;
      }
    }
  }
}

// y = x @ w over x's first `live` rows; rows from `live` on are zeros (the padding of a
// bucketed step: `DenseMatmulLive`).
// Gated (`DenseMatmulSiluMul`): w holds 2 N / 64 panels, gate then up, and y = silu(gate) * up.
ffi::Error run_dense(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w,
                     ffi::Result<ffi::Buffer<ffi::F32>>& y, int64_t live, bool gated = false) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("expected x [M, K] and y [M, N]");
  if (gated && (wd.size() != 3 || wd[1] != xd[1] || wd[2] != kCols || yd[1] % kCols != 0 ||
                wd[0] != 2 * yd[1] / kCols))
    return ffi::Error::InvalidArgument(
        "expected gate and up panels [2 N / 64, K, 64] for y [M, N], N a multiple of 64");
  if (!gated && (wd.size() != 3 || wd[1] != xd[1] || wd[2] != kCols || wd[0] * kCols < yd[1] ||
                 (wd[0] - 1) * kCols >= yd[1]))
    return ffi::Error::InvalidArgument("expected w in panels [ceil(N / 64), K, 64]");
  live = std::clamp<int64_t>(live, 0, xd[0]);
  if (live < xd[0])
    std::memset(y->typed_data() + live * yd[1], 0, (xd[0] - live) * yd[1] * sizeof(float));
  Dense p{live, xd[1], yd[1], gated ? wd[0] / 2 : wd[0], x.typed_data(), w.typed_data(),
          y->typed_data(), yd[1]};
  p.gated = gated;
  if (p.M == 0 || p.N == 0) return ffi::Error::Success();
  const int64_t panels = p.panels, chunks = chunk_count(p.M);
  // The calling thread works too: one helper fewer than the pool's threads (one per core).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t g = group_size(p.M, panels, threads);
  const int64_t items = g ? (panels + g - 1) / g : panels * chunks;
  const int64_t helpers = std::min<int64_t>(threads - 1, items - 1);
  const Split sp(p, chunks, helpers + 1);
  auto sh = std::make_shared<Shared>(helpers + 1, g ? items : sp.items, p, take_over_setting());
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([sh, p, chunks, helpers, g, i] { work(sh, p, chunks, helpers + 1, g, i + 1); });
  work(sh, p, chunks, helpers + 1, g, 0);  // returns with every item in y (`Shared`)
  return ffi::Error::Success();
}

ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::Result<ffi::Buffer<ffi::F32>> y) {
  return run_dense(pool, x, w, y, x.dimensions().size() == 2 ? x.dimensions()[0] : 0);
}

// A step padded to its token bucket multiplies only its real tokens, the first `live[0]`
// rows (`cu_q_lens[num_seqs]`): a 766-token prefill in the 1024 bucket did a third more
// matmul work than it needed. Each row's result is the same whichever rows come with it.
ffi::Error DenseMatmulLive(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> live,
                           ffi::Result<ffi::Buffer<ffi::F32>> y) {
  if (live.element_count() != 1) return ffi::Error::InvalidArgument("live rows: one int32");
  return run_dense(pool, x, w, y, live.typed_data()[0]);
}

// y = silu(x @ gate) * (x @ up) over the first `live[0]` rows (the rest zeros), w the fused
// gate_up weight's panels (the header's note on the MLP).
ffi::Error DenseMatmulSiluMul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> live,
                              ffi::Result<ffi::Buffer<ffi::F32>> y) {
  if (live.element_count() != 1) return ffi::Error::InvalidArgument("live rows: one int32");
  return run_dense(pool, x, w, y, live.typed_data()[0], true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxDenseMatmulSiluMulCpu, DenseMatmulSiluMul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // gate, up panels [2N/64, K, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxDenseMatmulCpu, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w panels [P, K, 64]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxDenseMatmulLiveCpu, DenseMatmulLive,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w panels [P, K, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, N]
