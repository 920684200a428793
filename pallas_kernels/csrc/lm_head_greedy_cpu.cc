// Greedy tokens straight from the final hidden states, without the float32 LM head's full
// [M, V] logits, as an XLA FFI call (`pallas_kernels.cpu_native.lm_head_greedy_cpu`, behind
// `pagedjax.sampler.sample_greedy_hidden`). The tokens are exactly the first argmax of the
// float32 logits that `dense_matmul_cpu` computes from the same panels.
//
// Why: the LM head is a fifth of a decode step's weight bytes and FLOPs on the demo model
// (49152 x 576 of 135 M parameters). A greedy row wants only its argmax, so the head is
// screened in bfloat16 (AVX512-BF16's `vdpbf16ps`: twice the FMA's work per instruction on
// this project's host, from half the bytes; with AVX2 the pairs widened in registers for
// FMAs: half the bytes, the same work), each score s_j comes with a proven bound on its
// distance to the float32 logit r_j, and only columns that could still be the maximum are
// computed again in float32, by the panel matmul's own chain. On the demo model that is ~2
// columns a row (docs/v1-core.md "The LM head screened in bfloat16").
//
// The bound. x~, w~ are x and w rounded to bfloat16 (relative error <= u_b = 2^-9 each);
// both sums are K terms in float32 (unit u = 2^-24, gamma_K = K u / (1 - K u)):
//   |s_j - sum x~ w~|   <= gamma_K (1 + u_b)^2 sum |x w|      (vdpbf16ps' additions)
//   |sum x~ w~ - sum x w| <= (2 u_b + u_b^2) sum |x w|        (the roundings to bfloat16)
//   |r_j - sum x w|     <= gamma_K sum |x w|                  (the float32 FMA chain)
// and sum_i |x_i w_ij| <= ||x||_2 ||w_j||_2 (Cauchy-Schwarz), with ||w_j|| precomputed in
// float64 and rounded up. So |s_j - r_j| <= b_j = C ||x|| ||w_j|| + A, where C takes 1 %
// of margin for the float arithmetic of the bound itself and A = 1e-12 covers what flushing
// subnormals can move (rows with ||x|| > 1e20 are not screened). Every column j with
// s_j + b_j < T = max_k (s_k - b_k) has r_j < r_k for the k reaching T, so it is neither the
// maximum nor tied with it; the first argmax of the exact r over the remaining columns is the
// row's. A row that is not finite (or too large to bound) is computed in full.
//
// The 8-bit screen (`LmHeadGreedyInt8`, AVX512-VNNI hosts without AMX). `vpdpbusd` does four
// u8 x s8 products per lane and instruction, twice `vdpbf16ps`' work (bench/fma_peak.cc
// `int8`: 446 against 223 G/s on one thread of the Zen 4 host), from half its bytes.
// Each column j is held as steps q_kj in [-127, 127] of s_j = max_k |w_kj| / 127; each row x
// keeps a set O of 24 dimensions in float32 and the rest as steps of
// t = max_{k not in O} |x_k| / 127. Hidden states have a few large dimensions (on the demo
// model max |x| / rms is 4-20): one shared step for them all left a median of 374 columns a
// row to recompute, each row's 16 largest |x_k| taken out 4 (docs/v1-core.md "The LM head
// screened in 8 bits"). The rows of a 6-row register block share their O (the 24 largest
// |x_k| / ||x|| over the block's rows), so the block reads each of those float32 weight lines
// once, for all its rows: a mean of ~7 columns a row to recompute on the demo model.
//   s_j = (t s_j) * sum_k qx_k q_kj  +  sum_{k in O} x_k w_kj     (int32 exact, then float32)
// With x~ = t qx (zero on O), ex = x - x~ off O, w~_j = s_j q_j, ew_j = w_j - w~_j (norms
// in float64, rounded up; ||ex||, ||x~|| per row, ||ew_j|| per column):
//   |sum_{k not in O} (x w - x~ w~)| = |ex . w_j + x~ . ew_j| <= ||ex|| ||w_j|| + ||x~|| ||ew_j||
// The float32 arithmetic (two roundings of the scale, 24 FMAs, the bound's own
// evaluation and the logit's chain gamma_K) stays below (gamma_K + 1024 u) ||x|| ||w_j||,
// since ||x~|| <= 2 ||x|| and ||w~_j|| <= 2 ||w_j||. So
//   b_j = alpha ||w_j|| + beta ||ew_j|| + A,  alpha = 1.02 (||ex|| + (gamma_K + 1024 u) ||x||),
//   beta = 1.02 ||x~||,
// and the same rule picks the candidates. The u8 side is qx + 128; the 128 sum_k q_kj this
// adds to every sum is taken off again (`qbias`) before the sums become floats.
//
// Work: items of panels over XLA's intra-op pool, the calling thread too. Each thread keeps
// its own running T per row and the columns that passed it so far, shares its T after each
// item (`Shared::T`), filters its columns by the rows' final T once every item is screened,
// computes their float32 logits, and publishes; the caller merges.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 64;          // columns per panel (`models.qlinear.to_dense_panels`)
constexpr int64_t kBlockRows = 6;      // rows sharing one pass over a panel
constexpr int64_t kPanelsPerItem = 4;  // a work item: 256 columns for every row
constexpr double kAbsSlack = 1e-12;
constexpr double kMaxNorm = 1e20;      // rows with a larger ||x|| are computed in full

struct Cand {
  int32_t row, col;
  float hi;     // s + b
  float exact;  // r, once computed
};

struct Head {
  int64_t M, K, Kp2, N, panels;
  const float* x;          // [M, K]
  const uint32_t* xb;      // [M, Kp2]: x in bfloat16 pairs (k even low, k odd high)
  const uint16_t* wb;      // [panels, Kp2, 64, 2]
  const float* norms;      // [N]: ||w_j||_2, rounded up
  const float* w;          // [panels, K, 64] float32
  const float* scale;      // [M]: C ||x_m||
  const uint8_t* full;     // [M]: 1 = not screened
  const float* xf;         // [M, 2 Kp2]: x rounded to bfloat16, as floats (AVX2 only)
  bool amx;                // screened by AMX tiles; `xb` then has rows up to a multiple of 16
  // The 8-bit screen (`LmHeadGreedyInt8`); wq null in the bfloat16 one.
  const int8_t* wq = nullptr;     // [panels, Kq, 64, 4]: the steps q_kj, four k per lane
  int64_t Kq = 0;
  const float* qscale = nullptr;  // [panels * 64]: s_j
  const float* qerr = nullptr;    // [panels * 64]: ||ew_j||, rounded up
  const int32_t* qbias = nullptr;  // [panels * 64]: -128 sum_k q_kj
  const uint32_t* xq = nullptr;   // [M, Kq]: qx + 128 as bytes (zero steps on O and past K)
  const float* xstep = nullptr;   // [M]: t
  const float* beta = nullptr;    // [M]: beta (`scale` holds alpha)
  const int32_t* outl = nullptr;  // [ceil(M / 6), nout]: each 6-row block's O, ascending
  int64_t nout = 0;
  const std::vector<int32_t>* dims = nullptr;  // every block's O together, ascending
};

// The float32 logit of (row m, column j): the panel matmul's chain, k = 0 .. K-1 in order,
// one fused multiply-add each, so it is bit for bit `dense_matmul_cpu`'s.
inline float exact_logit(const Head& h, int64_t m, int64_t j) {
  const float* x = h.x + m * h.K;
  const float* w = h.w + (j / kCols) * h.K * kCols + (j % kCols);
  float c = 0.f;
  for (int64_t k = 0; k < h.K; ++k) c = __builtin_fmaf(x[k], w[k * kCols], c);
  return c;
}

// The exact logits of `n` candidates, eight at a time: the chains of different candidates run
// side by side (each still k = 0 .. K-1), their weights gathered from the panels.
void exact_logits(const Head& h, Cand* c, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 8 <= n; i += 8) {
    alignas(64) int64_t xi[8], wi[8];
    for (int l = 0; l < 8; ++l) {
      xi[l] = int64_t(c[i + l].row) * h.K;
      wi[l] = (c[i + l].col / kCols) * h.K * kCols + (c[i + l].col % kCols);
    }
    __m512i xv = _mm512_load_si512(xi), wv = _mm512_load_si512(wi);
    const __m512i kstep = _mm512_set1_epi64(kCols);
    const __m512i one = _mm512_set1_epi64(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < h.K; ++k) {
      const __m256 a = _mm512_i64gather_ps(xv, h.x, 4);
      const __m256 b = _mm512_i64gather_ps(wv, h.w, 4);
      acc = _mm256_fmadd_ps(a, b, acc);
      xv = _mm512_add_epi64(xv, one);
      wv = _mm512_add_epi64(wv, kstep);
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, acc);
    for (int l = 0; l < 8; ++l) c[i + l].exact = out[l];
  }
#endif
  for (; i < n; ++i) c[i].exact = exact_logit(h, c[i].row, c[i].col);
}

// One thread's running screen: per row its T and the columns that passed it so far.
struct Local {
  explicit Local(int64_t m)
      : T(m, -std::numeric_limits<float>::infinity()), cand(m), limit(m, 4096) {}
  std::vector<float> T;
  std::vector<std::vector<Cand>> cand;
  std::vector<size_t> limit;  // prune a row's list past this; doubled when pruning keeps most
  int64_t items = 0;

  void offer(int64_t m, int64_t j0, int64_t nc, const float* s, const Head& h) {
    const float sc = h.scale[m];
    float t = T[m];
    float lo[kCols], hi[kCols];
    for (int64_t c = 0; c < nc; ++c) {
      const float b = std::fma(sc, h.norms[j0 + c], float(kAbsSlack));
      lo[c] = s[c] - b;
      hi[c] = s[c] + b;
      t = std::max(t, lo[c]);
    }
    T[m] = t;
    auto& v = cand[m];
    for (int64_t c = 0; c < nc; ++c)
      if (hi[c] >= t) v.push_back(Cand{int32_t(m), int32_t(j0 + c), hi[c], 0.f});
    if (v.size() > limit[m]) prune(m);
  }
  // Drops the columns whose interval ends below the row's T. A row whose columns all stay
  // (a zero hidden state: every score 0) doubles its limit instead of pruning every panel.
  void prune(int64_t m) {
    auto& v = cand[m];
    const float t = T[m];
    v.erase(std::remove_if(v.begin(), v.end(), [t](const Cand& c) { return c.hi < t; }), v.end());
    if (v.size() > limit[m] / 2) limit[m] *= 2;
  }
};

#if !(defined(__AVX512BF16__) && defined(__AVX512F__)) && defined(__AVX2__) && defined(__FMA__)
#define PAGEDJAX_SCREEN_AVX2 1  // the screen below that reads `Head::xf`
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
inline __mmask16 lane_mask(int64_t nc, int i) {
  const int64_t left = nc - 16 * i;
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

// What every row's bounds read of panel b: its live lanes and column norms.
struct PanelBounds {
  PanelBounds(const Head& h, int64_t b) {
    const int64_t nc = std::min(kCols, h.N - b * kCols);
    for (int i = 0; i < 4; ++i) {
      valid[i] = lane_mask(nc, i);
      nrm[i] = _mm512_maskz_loadu_ps(valid[i], h.norms + b * kCols + 16 * i);
      err[i] = h.qerr ? _mm512_maskz_loadu_ps(valid[i], h.qerr + b * kCols + 16 * i)
                      : _mm512_setzero_ps();
      qs[i] = h.qscale ? _mm512_maskz_loadu_ps(valid[i], h.qscale + b * kCols + 16 * i)
                       : _mm512_setzero_ps();
    }
  }
  __mmask16 valid[4];
  __m512 nrm[4], err[4], qs[4];  // ||w_j||; the 8-bit screen's ||ew_j|| and s_j (else zeros)
};

// Row m's scores c[0..3] on panel b: bounds, T and the columns that pass it, 16 lanes at a
// time (most panels add none).
inline void offer_row(const Head& h, int64_t b, int64_t m, const __m512* c, const PanelBounds& pb,
                      Local& loc) {
  if (h.full[m]) return;
  const __m512 slack = _mm512_set1_ps(float(kAbsSlack));
  const __m512 sc = _mm512_set1_ps(h.scale[m]);
  const __m512 be = _mm512_set1_ps(h.beta ? h.beta[m] : 0.f);  // bfloat16: 0 * 0 + A = A
  __m512 hi[4], top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < 4; ++i) {
    const __m512 bnd = _mm512_fmadd_ps(sc, pb.nrm[i], _mm512_fmadd_ps(be, pb.err[i], slack));
    top = _mm512_mask_max_ps(top, pb.valid[i], top, _mm512_sub_ps(c[i], bnd));
    hi[i] = _mm512_add_ps(c[i], bnd);
  }
  const float t = std::max(loc.T[m], _mm512_reduce_max_ps(top));
  loc.T[m] = t;
  const __m512 tv = _mm512_set1_ps(t);
  for (int i = 0; i < 4; ++i) {
    __mmask16 pass = _mm512_mask_cmp_ps_mask(pb.valid[i], hi[i], tv, _CMP_GE_OQ);
    if (!pass) continue;
    alignas(64) float hv[16];
    _mm512_store_ps(hv, hi[i]);
    for (; pass; pass &= pass - 1) {
      const int l = __builtin_ctz(pass);
      loc.cand[m].push_back(Cand{int32_t(m), int32_t(b * kCols + 16 * i + l), hv[l], 0.f});
    }
  }
  if (loc.cand[m].size() > loc.limit[m]) loc.prune(m);
}

template <int MR>
void screen_block(const Head& h, int64_t b, int64_t m0, Local& loc) {
  const uint16_t* w = h.wb + b * h.Kp2 * kCols * 2;
  __m512 c[MR][4];
  for (int q = 0; q < MR; ++q)
    for (int i = 0; i < 4; ++i) c[q][i] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < h.Kp2; ++kp) {
    const uint16_t* wk = w + kp * kCols * 2;
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 2 + 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 2 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 2 + 96), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
    for (int q = 0; q < MR; ++q) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int32_t(h.xb[(m0 + q) * h.Kp2 + kp]));
      c[q][0] = _mm512_dpbf16_ps(c[q][0], a, w0);
      c[q][1] = _mm512_dpbf16_ps(c[q][1], a, w1);
      c[q][2] = _mm512_dpbf16_ps(c[q][2], a, w2);
      c[q][3] = _mm512_dpbf16_ps(c[q][3], a, w3);
    }
  }
  const PanelBounds pb(h, b);
  for (int q = 0; q < MR; ++q) offer_row(h, b, m0 + q, c[q], pb, loc);
}

#if defined(__AVX512VNNI__)
#define PAGEDJAX_SCREEN_INT8 1
// Rows [m0, m0 + MR) of panel b in 8 bits: 24 int32 accumulators, one `vpdpbusd` per 4 k and
// 16 columns (`int8_sums`); then per row the columns' -128 sum q and the float32 scale, and
// the block's large dimensions O from the float32 panel (`screen_block_int8`).
//
// The int32 sums of rows [m0, m0 + MR) over panel b, into `sums`. A function of its own: with
// the epilogue in the same body, GCC (12) copied the accumulators between registers, or
// between registers and the stack, every k (13.9 against 7.5-7.9 ms at 64 rows with the sums
// read in a loop over rows; 46 against 30 ms at 256 rows with the epilogue's 24 float32
// accumulators).
template <int MR>
__attribute__((noinline)) void int8_sums(const Head& h, int64_t b, int64_t m0,
                                         int32_t (*sums)[kCols]) {
  const int8_t* w = h.wq + b * h.Kq * kCols * 4;
  __m512i c[MR][4];
#pragma GCC unroll 6
  for (int q = 0; q < MR; ++q)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) c[q][i] = _mm512_setzero_si512();
  for (int64_t kq = 0; kq < h.Kq; ++kq) {
    const int8_t* wk = w + kq * kCols * 4;
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 4), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 4 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 4 + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 4 + 192), _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 64),
                  w2 = _mm512_loadu_si512(wk + 128), w3 = _mm512_loadu_si512(wk + 192);
#pragma GCC unroll 6
    for (int q = 0; q < MR; ++q) {
      const __m512i a = _mm512_set1_epi32(int32_t(h.xq[(m0 + q) * h.Kq + kq]));
      c[q][0] = _mm512_dpbusd_epi32(c[q][0], a, w0);
      c[q][1] = _mm512_dpbusd_epi32(c[q][1], a, w1);
      c[q][2] = _mm512_dpbusd_epi32(c[q][2], a, w2);
      c[q][3] = _mm512_dpbusd_epi32(c[q][3], a, w3);
    }
  }
#pragma GCC unroll 6
  for (int q = 0; q < MR; ++q)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) _mm512_store_si512(sums[q] + 16 * i, c[q][i]);
}

template <int MR>
void screen_block_int8(const Head& h, int64_t b, int64_t m0, const PanelBounds& pb,
                       Local& loc) {
  alignas(64) int32_t sums[MR][kCols];
  int8_sums<MR>(h, b, m0, sums);
  __m512 f[MR][4];  // exact below 2^24 (K <= 1040), one rounding past it (in the bound)
  for (int i = 0; i < 4; ++i) {
    const __m512i start = _mm512_loadu_si512(h.qbias + b * kCols + 16 * i);
    for (int q = 0; q < MR; ++q)
      f[q][i] = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(sums[q] + 16 * i), start)),
          _mm512_mul_ps(_mm512_set1_ps(h.xstep[m0 + q]), pb.qs[i]));
  }
  // The block's O from the float32 panel: each line of weights read once for all MR rows,
  // 4 MR independent chains. Each row's own 16 dimensions (one chain of 16 FMAs per 16
  // columns, from lines read per row) took a quarter of the screen's time at 256 rows; shared,
  // 24 of them took ~8 % less time a call at 64 and 256 rows (real hidden rows of the demo
  // model, interleaved runs), though a row recomputes ~7 columns instead of ~6.
  const float* wf = h.w + b * h.K * kCols;
  const int32_t* o = h.outl + (m0 / kBlockRows) * h.nout;
  for (int64_t j = 0; j < h.nout; ++j) {
    const float* wk = wf + int64_t(o[j]) * kCols;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16),
                 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int q = 0; q < MR; ++q) {
      const __m512 xv = _mm512_set1_ps(h.x[(m0 + q) * h.K + o[j]]);
      f[q][0] = _mm512_fmadd_ps(xv, w0, f[q][0]);
      f[q][1] = _mm512_fmadd_ps(xv, w1, f[q][1]);
      f[q][2] = _mm512_fmadd_ps(xv, w2, f[q][2]);
      f[q][3] = _mm512_fmadd_ps(xv, w3, f[q][3]);
    }
  }
  for (int q = 0; q < MR; ++q) offer_row(h, b, m0 + q, f[q], pb, loc);  // skips full rows
}

void screen_panel_int8(const Head& h, int64_t b, Local& loc) {
  const PanelBounds pb(h, b);
  // The float32 lines the rows' large dimensions read in the next panel, into L2 now: a
  // row's first read of each missed cache (a ninth of the screen's time at 64 rows).
  if (b + 1 < h.panels) {
    const char* next = reinterpret_cast<const char*>(h.w + (b + 1) * h.K * kCols);
    for (const int32_t d : *h.dims)
      for (int l = 0; l < 4; ++l) _mm_prefetch(next + int64_t(d) * kCols * 4 + 64 * l, _MM_HINT_T1);
  }
  for (int64_t m = 0; m < h.M; m += kBlockRows) {
    switch (std::min(kBlockRows, h.M - m)) {
      case 6: screen_block_int8<6>(h, b, m, pb, loc); break;
      case 5: screen_block_int8<5>(h, b, m, pb, loc); break;
      case 4: screen_block_int8<4>(h, b, m, pb, loc); break;
      case 3: screen_block_int8<3>(h, b, m, pb, loc); break;
      case 2: screen_block_int8<2>(h, b, m, pb, loc); break;
      default: screen_block_int8<1>(h, b, m, pb, loc); break;
    }
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX (Intel Sapphire Rapids and later): `tdpbf16ps` multiplies the same bfloat16 pairs as
// `vdpbf16ps` and adds each product into float32 sums, rounding to nearest (subnormals
// flushed, which kAbsSlack covers), so the bound above holds for its scores as it is; it
// does 16 x 16 x 32 of them per instruction. The bfloat16 panels [Kp2, 64, 2] are already the
// B tiles' layout: 16 pairs of k by 16 columns is 16 rows of 64 bytes, 256 bytes apart.
// Rows are taken 16 at a time (`xb` is padded with zero rows), a panel's four column tiles
// at once: A in tmm0, B in tmm1-3 in turn, C in tmm4-7.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use the tile data (Linux asks each process to request it).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

void load_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

void screen_panel_amx(const Head& h, int64_t b, Local& loc) {
  const uint16_t* w = h.wb + b * h.Kp2 * kCols * 2;
  const PanelBounds pb(h, b);
  alignas(64) float s[16][kCols];
  for (int64_t m0 = 0; m0 < h.M; m0 += 16) {
    const uint32_t* xa = h.xb + m0 * h.Kp2;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t kp = 0; kp < h.Kp2; kp += 16) {
      const uint16_t* wk = w + kp * kCols * 2;
      _tile_loadd(0, xa + kp, h.Kp2 * 4);
      _tile_loadd(1, wk, kCols * 4);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(2, wk + 32, kCols * 4);
      _tile_dpbf16ps(5, 0, 2);
      _tile_loadd(3, wk + 64, kCols * 4);
      _tile_dpbf16ps(6, 0, 3);
      _tile_loadd(1, wk + 96, kCols * 4);
      _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, &s[0][0], kCols * 4);
    _tile_stored(5, &s[0][16], kCols * 4);
    _tile_stored(6, &s[0][32], kCols * 4);
    _tile_stored(7, &s[0][48], kCols * 4);
    const int64_t rows = std::min<int64_t>(16, h.M - m0);
    for (int64_t q = 0; q < rows; ++q) {
      const __m512 c[4] = {_mm512_load_ps(s[q]), _mm512_load_ps(s[q] + 16),
                           _mm512_load_ps(s[q] + 32), _mm512_load_ps(s[q] + 48)};
      offer_row(h, b, m0 + q, c, pb, loc);
    }
  }
}
#endif

void screen_panel(const Head& h, int64_t b, Local& loc) {
#if defined(PAGEDJAX_SCREEN_INT8)
  if (h.wq) return screen_panel_int8(h, b, loc);
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (h.amx) return screen_panel_amx(h, b, loc);
#endif
  for (int64_t m = 0; m < h.M; m += kBlockRows) {
    switch (std::min(kBlockRows, h.M - m)) {
      case 6: screen_block<6>(h, b, m, loc); break;
      case 5: screen_block<5>(h, b, m, loc); break;
      case 4: screen_block<4>(h, b, m, loc); break;
      case 3: screen_block<3>(h, b, m, loc); break;
      case 2: screen_block<2>(h, b, m, loc); break;
      default: screen_block<1>(h, b, m, loc); break;
    }
  }
}
#elif defined(PAGEDJAX_SCREEN_AVX2)
// AVX2 with FMA (no `vdpbf16ps`): the bfloat16 pairs are widened to float32 in registers (a
// shift for k even, a mask for k odd) and multiplied by fused multiply-adds. A product of two
// bfloat16 values is exact in float32, so each FMA rounds once, as the portable loop's add
// does: the same scores bit for bit, in the same order (k even, then k odd, per pair), and the
// bound above holds as it is. Half the float32 head's bytes for the same FMAs: it pays where
// the head is read from memory (few rows), not where the FMAs set the pace.
// Rows [m0, m0 + MR) x columns [c0, c0 + 16) of panel b, into s[q * 64 + c0 ...]: 12
// accumulators, a strip of one pair of k is one cache line.
template <int MR>
void screen_strip(const Head& h, int64_t b, int64_t m0, int64_t c0, float* s) {
  const int64_t Kp2 = h.Kp2;
  const uint16_t* w = h.wb + (b * Kp2 * kCols + c0) * 2;
  const float* xf = h.xf + m0 * 2 * Kp2;
  __m256 c[MR][2];
  for (int q = 0; q < MR; ++q) c[q][0] = c[q][1] = _mm256_setzero_ps();
  const __m256i odd = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  for (int64_t kp = 0; kp < Kp2; ++kp) {
    const uint16_t* wk = w + kp * kCols * 2;
    _mm_prefetch(reinterpret_cast<const char*>(wk + 16 * kCols * 2), _MM_HINT_T0);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
#pragma GCC unroll 6
    for (int q = 0; q < MR; ++q) {
      const __m256 a = _mm256_broadcast_ss(xf + q * 2 * Kp2 + 2 * kp);
      c[q][0] = _mm256_fmadd_ps(a, e0, c[q][0]);
      c[q][1] = _mm256_fmadd_ps(a, e1, c[q][1]);
    }
    const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, odd));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, odd));
#pragma GCC unroll 6
    for (int q = 0; q < MR; ++q) {
      const __m256 a = _mm256_broadcast_ss(xf + q * 2 * Kp2 + 2 * kp + 1);
      c[q][0] = _mm256_fmadd_ps(a, o0, c[q][0]);
      c[q][1] = _mm256_fmadd_ps(a, o1, c[q][1]);
    }
  }
#pragma GCC unroll 6
  for (int q = 0; q < MR; ++q) {  // fixed trip counts: the accumulators stay in registers
    _mm256_storeu_ps(s + q * kCols + c0, c[q][0]);
    _mm256_storeu_ps(s + q * kCols + c0 + 8, c[q][1]);
  }
}

void screen_panel(const Head& h, int64_t b, Local& loc) {
  const int64_t nc = std::min(kCols, h.N - b * kCols);
  alignas(32) float s[kBlockRows * kCols];
  for (int64_t m = 0; m < h.M; m += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, h.M - m);
    for (int64_t c0 = 0; c0 < nc; c0 += 16) {
      switch (rows) {
        case 6: screen_strip<6>(h, b, m, c0, s); break;
        case 5: screen_strip<5>(h, b, m, c0, s); break;
        case 4: screen_strip<4>(h, b, m, c0, s); break;
        case 3: screen_strip<3>(h, b, m, c0, s); break;
        case 2: screen_strip<2>(h, b, m, c0, s); break;
        default: screen_strip<1>(h, b, m, c0, s); break;
      }
    }
    for (int64_t q = 0; q < rows; ++q)
      if (!h.full[m + q]) loc.offer(m + q, b * kCols, nc, s + q * kCols, h);
  }
}
#else
// Portable: the same scores one product at a time (products of bfloat16 values are exact in
// float32, so the bound holds for this order of additions too).
inline float bf16_to_f32(uint32_t v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}

void screen_panel(const Head& h, int64_t b, Local& loc) {
  const uint16_t* w = h.wb + b * h.Kp2 * kCols * 2;
  const int64_t nc = std::min(kCols, h.N - b * kCols);
  float s[kCols];
  for (int64_t m = 0; m < h.M; ++m) {
    if (h.full[m]) continue;
    for (int64_t c = 0; c < nc; ++c) {
      float acc = 0.f;
      for (int64_t kp = 0; kp < h.Kp2; ++kp) {
        const uint32_t xp = h.xb[m * h.Kp2 + kp];
        const uint16_t* wk = w + (kp * kCols + c) * 2;
        acc += bf16_to_f32(xp << 16) * bf16_to_f32(uint32_t(wk[0]) << 16);
        acc += bf16_to_f32(xp & 0xFFFF0000u) * bf16_to_f32(uint32_t(wk[1]) << 16);
      }
      s[c] = acc;
    }
    loc.offer(m, b * kCols, nc, s, h);
  }
}
#endif

// A slot per thread: what it published. Heap-held (shared_ptr), so a helper that starts after
// the call returned (it then finds no item left and publishes nothing) touches no dead frame;
// it reads the buffers only after claiming an item, which the caller waits for.
struct Shared {
  Shared(int64_t threads, int64_t rows) : slots(threads), T(new std::atomic<float>[rows]) {
    for (int64_t m = 0; m < rows; ++m) T[m].store(-std::numeric_limits<float>::infinity());
  }
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> published{0};  // items whose thread has published
  std::atomic<int64_t> screened{0};   // items screened (their T shared)
  std::vector<std::unique_ptr<Local>> slots;
  // Per row the highest T a thread has shared. Each T is s_k - b_k of a column k screened by
  // someone, so r_k >= T and any of them is a valid threshold for every thread: a thread
  // that takes the other's higher T keeps, and computes in float32, only the columns that
  // could still beat it. Without this each thread filtered by the T of its own panels, and
  // with the 8-bit screen's wider bounds its float32 recomputation (a gather per k from a
  // column 256 bytes a line) took 14 % of the call at 64 rows. Relaxed: a stale or lost
  // update only leaves a lower, still valid, T.
  std::unique_ptr<std::atomic<float>[]> T;
};

// This thread's T and the shared one, each raised to the higher.
void share_T(Shared& sh, Local& loc, int64_t M) {
  for (int64_t m = 0; m < M; ++m) {
    const float g = sh.T[m].load(std::memory_order_relaxed), t = loc.T[m];
    if (t > g)
      sh.T[m].store(t, std::memory_order_relaxed);
    else if (g > t)
      loc.T[m] = g;
  }
}

void work(Shared& sh, const Head& h, int64_t items, int64_t id) {
  std::unique_ptr<Local> loc;
  for (int64_t i = sh.next.fetch_add(1); i < items; i = sh.next.fetch_add(1)) {
    if (!loc) {
      loc.reset(new Local(h.M));
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if (h.amx) load_tiles();  // the tile configuration is each thread's own
#endif
    }
    const int64_t b1 = std::min(h.panels, (i + 1) * kPanelsPerItem);
    for (int64_t b = i * kPanelsPerItem; b < b1; ++b) screen_panel(h, b, *loc);
    ++loc->items;
    share_T(sh, *loc, h.M);
    sh.screened.fetch_add(1, std::memory_order_acq_rel);
  }
  if (!loc) return;
  // Every item is claimed; once all are screened the shared T is the rows' final one, and
  // only the columns that can still win globally are recomputed. (Claimed items belong to
  // running threads, which the caller waits for below in any case.)
  while (sh.screened.load(std::memory_order_acquire) < items) std::this_thread::yield();
  share_T(sh, *loc, h.M);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (h.amx) _tile_release();  // so the thread's later context switches save no tile state
#endif
  std::vector<Cand> all;
  for (int64_t m = 0; m < h.M; ++m) {
    loc->prune(m);
    all.insert(all.end(), loc->cand[m].begin(), loc->cand[m].end());
    loc->cand[m].clear();
  }
  exact_logits(h, all.data(), int64_t(all.size()));
  for (const Cand& c : all) loc->cand[c.row].push_back(c);
  const int64_t n = loc->items;
  sh.slots[id] = std::move(loc);
  sh.published.fetch_add(n, std::memory_order_acq_rel);
}

// First argmax of row m computed in full (NaN counts as the maximum, ties to the lowest
// index, all -inf gives 0: `greedy_rows_cpu`'s rule).
int32_t full_row(const Head& h, int64_t m) {
  int32_t arg = 0;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < h.N; ++j) {
    const float r = exact_logit(h, m, j);
    if (std::isnan(r)) return int32_t(j);
    if (r > top) {
      top = r;
      arg = int32_t(j);
    }
  }
  return arg;
}

// Screens every panel over the pool, then picks each row's token from the candidates
// (rows marked `full` are computed in full).
void screen_and_merge(ffi::ThreadPool& pool, const Head& h, int32_t* out) {
  const int64_t M = h.M;
  const int64_t items = (h.panels + kPanelsPerItem - 1) / kPanelsPerItem;
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()) - 1, items - 1);
  auto sh = std::make_shared<Shared>(helpers + 1, M);
  for (int64_t i = 0; i < helpers; ++i)
    pool.Schedule([sh, h, items, i] { work(*sh, h, items, i + 1); });
  work(*sh, h, items, 0);
  while (sh->published.load(std::memory_order_acquire) < items) std::this_thread::yield();

  for (int64_t m = 0; m < M; ++m) {
    if (h.full[m]) {
      out[m] = full_row(h, m);
      continue;
    }
    float T = -std::numeric_limits<float>::infinity();
    for (const auto& s : sh->slots)
      if (s) T = std::max(T, s->T[m]);
    int32_t arg = -1;
    float top = 0.f;
    for (const auto& s : sh->slots) {
      if (!s) continue;
      for (const Cand& c : s->cand[m]) {
        if (c.hi < T) continue;
        if (arg < 0 || c.exact > top || (c.exact == top && c.col < arg)) {
          arg = c.col;
          top = c.exact;
        }
      }
    }
    out[m] = arg < 0 ? full_row(h, m) : arg;  // no candidate cannot happen; stay exact anyway
  }
}

uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

ffi::Error LmHeadGreedy(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U16> wb,
                        ffi::Buffer<ffi::F32> norms, ffi::Buffer<ffi::F32> w,
                        ffi::Result<ffi::Buffer<ffi::S32>> tok) {
  auto xd = x.dimensions(), bd = wb.dimensions(), nd = norms.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || tok->dimensions().size() != 1 || tok->dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument("expected hidden x [M, K] and tokens [M]");
  const int64_t M = xd[0], K = xd[1], Kp2 = (K + 1) / 2;
  if (nd.size() != 1 || nd[0] < 1)
    return ffi::Error::InvalidArgument("expected column norms [N]");
  const int64_t N = nd[0], panels = (N + kCols - 1) / kCols;
  if (wd.size() != 3 || wd[0] != panels || wd[1] != K || wd[2] != kCols)
    return ffi::Error::InvalidArgument("expected float32 panels [ceil(N / 64), K, 64]");
  if (bd.size() != 4 || bd[0] != panels || bd[1] != Kp2 || bd[2] != kCols || bd[3] != 2)
    return ffi::Error::InvalidArgument("expected bfloat16 panels [ceil(N / 64), ceil(K / 2), 64, 2]");
  if (M == 0) return ffi::Error::Success();
  int32_t* out = tok->typed_data();

  // Per row: x in bfloat16 pairs, C ||x||, and whether it is screened at all.
  const double ub = std::ldexp(1.0, -9), u = std::ldexp(1.0, -24);
  const double gk = double(K) * u / (1.0 - double(K) * u);
  const double C = 1.01 * ((2 * ub + ub * ub) + gk * (1 + ub) * (1 + ub) + gk);
  // AMX screens whole tiles: 16 pairs of k at a time (Kp2 in whole tiles) and 16 rows (zero
  // rows added), from 4 rows up: below that the head's bytes set the pace and `vdpbf16ps` was
  // ~10 % faster. On the 2-core Xeon host of stop 73 (49152 x 576, the demo model's head) 64
  // rows took 6.1 ms against 22.7, 256 rows 15.9 against 82.5, 4 rows 1.62 against 1.71.
  // PAGEDJAX_LM_HEAD_AMX=0 keeps `vdpbf16ps` (for A/B runs).
  bool amx = false;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const char* amx_env = std::getenv("PAGEDJAX_LM_HEAD_AMX");
  amx = !(amx_env && std::strcmp(amx_env, "0") == 0) && M >= 4 && Kp2 % 16 == 0 &&
        amx_permitted();
#endif
  const int64_t Mpad = amx ? (M + 15) / 16 * 16 : M;
  // On 64-byte boundaries: with Kp2 a multiple of 16 (AMX's condition) each row then starts a
  // cache line and every 64-byte row of an A tile is one line, where malloc's 16-byte
  // alignment may split rows over two (bench/amx_fp32_split.cc: a tile load and product took
  // 15.5-16.2 ns that way, 6.5 ns aligned). Here the A tile is one load in five, shared by
  // four products, and the screen measured within noise of before (-1 % to +3 % at 16-256
  // rows, `bench/native_ab.py --kind lm_head`); aligned, it does not depend on malloc.
  const size_t xb_bytes = size_t(Mpad * Kp2 * 4 + 63) / 64 * 64;
  std::unique_ptr<uint32_t[], FreeDeleter> xb_mem(
      static_cast<uint32_t*>(std::aligned_alloc(64, xb_bytes)));
  if (!xb_mem)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "lm_head_greedy_cpu: no memory for the bfloat16 rows");
  uint32_t* const xb = xb_mem.get();
  std::memset(xb, 0, xb_bytes);
  std::vector<float> scale(M);
  std::vector<uint8_t> full(M, 0);
  const float* xs = x.typed_data();
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t k = 0; k < K; ++k) ss += double(xs[m * K + k]) * xs[m * K + k];
    const double nx = std::sqrt(ss);
    if (!std::isfinite(nx) || nx > kMaxNorm) {
      full[m] = 1;
      continue;
    }
    scale[m] = float(C * nx);
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t v = to_bf16(xs[m * K + k]);
      xb[m * Kp2 + k / 2] |= (k % 2) ? (v << 16) : v;
    }
  }
  std::vector<float> xf;  // the pairs widened (k even: low half, odd: high): AVX2's screen
#if defined(PAGEDJAX_SCREEN_AVX2)
  xf.resize(M * 2 * Kp2);
  for (int64_t i = 0; i < M * Kp2; ++i) {
    const uint32_t lo = xb[i] << 16, hi = xb[i] & 0xFFFF0000u;
    std::memcpy(&xf[2 * i], &lo, 4);
    std::memcpy(&xf[2 * i + 1], &hi, 4);
  }
#endif
  const Head h{M, K, Kp2, N, panels, xs, xb, wb.typed_data(), norms.typed_data(),
               w.typed_data(), scale.data(), full.data(), xf.data(), amx};
  screen_and_merge(pool, h, out);
  return ffi::Error::Success();
}

constexpr int64_t kOutliers = 24;  // a block's dimensions taken in float32 (the set O):
// 16 left ~10 columns a row to recompute (each reads K scattered float32 lines), 32 ~6
// for a third more FMAs; 24 measured fastest
constexpr int64_t kInt8MaxK = 32768;  // int32 sums: K * 255 * 127 < 2^31

// The 8-bit screen (the header's "8-bit screen"): x's steps, O, and the bound's alpha, beta.
ffi::Error LmHeadGreedyInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S8> wq, ffi::Buffer<ffi::F32> norms,
                            ffi::Buffer<ffi::F32> qcols, ffi::Buffer<ffi::S32> qbias,
                            ffi::Buffer<ffi::F32> w, ffi::Result<ffi::Buffer<ffi::S32>> tok) {
#if !defined(PAGEDJAX_SCREEN_INT8)
  return ffi::Error::InvalidArgument("lm_head_greedy_cpu: this build has no AVX512-VNNI");
#else
  auto xd = x.dimensions(), qd = wq.dimensions(), nd = norms.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || tok->dimensions().size() != 1 || tok->dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument("expected hidden x [M, K] and tokens [M]");
  const int64_t M = xd[0], K = xd[1], Kq = (K + 3) / 4;
  if (K > kInt8MaxK) return ffi::Error::InvalidArgument("8-bit screen: K over 32768");
  if (nd.size() != 1 || nd[0] < 1)
    return ffi::Error::InvalidArgument("expected column norms [N]");
  const int64_t N = nd[0], panels = (N + kCols - 1) / kCols;
  if (wd.size() != 3 || wd[0] != panels || wd[1] != K || wd[2] != kCols)
    return ffi::Error::InvalidArgument("expected float32 panels [ceil(N / 64), K, 64]");
  if (qd.size() != 4 || qd[0] != panels || qd[1] != Kq || qd[2] != kCols || qd[3] != 4)
    return ffi::Error::InvalidArgument("expected 8-bit panels [ceil(N / 64), ceil(K / 4), 64, 4]");
  auto cd = qcols.dimensions(), bd = qbias.dimensions();
  if (cd.size() != 2 || cd[0] != 2 || cd[1] != panels * kCols || bd.size() != 1 ||
      bd[0] != panels * kCols)
    return ffi::Error::InvalidArgument("expected column steps and errors [2, P * 64], sums [P * 64]");
  if (M == 0) return ffi::Error::Success();

  const double u = std::ldexp(1.0, -24);
  const double gk = double(K) * u / (1.0 - double(K) * u);
  const int64_t nout = std::min(kOutliers, K);
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  std::vector<uint32_t> xq(M * Kq, 0x80808080u);  // a zero step is the byte 128
  std::vector<float> alpha(M), beta(M), step(M, 0.f);
  std::vector<int32_t> outl(blocks * nout);
  std::vector<uint8_t> full(M, 0);
  std::vector<int32_t> idx(K);
  std::vector<uint8_t> in_o(K), any_o(K, 0);
  std::vector<double> nx(kBlockRows), score(K);
  const float* xs = x.typed_data();
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t m0 = blk * kBlockRows, m1 = std::min(M, m0 + kBlockRows);
    // O: the dimensions largest relative to their row's norm in any row of the block.
    std::fill(score.begin(), score.end(), 0.0);
    for (int64_t m = m0; m < m1; ++m) {
      const float* xm = xs + m * K;
      double ss = 0;
      for (int64_t k = 0; k < K; ++k) ss += double(xm[k]) * xm[k];
      nx[m - m0] = std::sqrt(ss);
      if (!std::isfinite(nx[m - m0]) || nx[m - m0] > kMaxNorm) {
        full[m] = 1;
        continue;
      }
      if (nx[m - m0] > 0)
        for (int64_t k = 0; k < K; ++k)
          score[k] = std::max(score[k], std::fabs(double(xm[k])) / nx[m - m0]);
    }
    for (int64_t k = 0; k < K; ++k) idx[k] = int32_t(k);
    std::nth_element(idx.begin(), idx.begin() + (nout - 1), idx.end(), [&score](int32_t a, int32_t b) {
      return score[a] > score[b] || (score[a] == score[b] && a < b);
    });
    std::sort(idx.begin(), idx.begin() + nout);  // ascending: the panel's lines in order
    std::fill(in_o.begin(), in_o.end(), 0);
    for (int64_t j = 0; j < nout; ++j) {
      outl[blk * nout + j] = idx[j];
      in_o[idx[j]] = any_o[idx[j]] = 1;
    }
    for (int64_t m = m0; m < m1; ++m) {
      if (full[m]) continue;
      const float* xm = xs + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k)
        if (!in_o[k]) amax = std::max(amax, std::fabs(xm[k]));
      // A tiny rest keeps no steps (ex is then all of it): no subnormal step to flush.
      const float t = amax >= 1e-20f ? amax / 127.f : 0.f;
      double ex2 = 0, xt2 = 0;
      uint8_t* bytes = reinterpret_cast<uint8_t*>(xq.data() + m * Kq);
      for (int64_t k = 0; k < K; ++k) {
        if (in_o[k]) continue;
        const int q = t > 0.f ? int(std::clamp(std::nearbyint(xm[k] / t), -127.f, 127.f)) : 0;
        const double xt = double(t) * q;
        ex2 += (double(xm[k]) - xt) * (double(xm[k]) - xt);
        xt2 += xt * xt;
        bytes[k] = uint8_t(q + 128);
      }
      step[m] = t;
      alpha[m] = float(1.02 * (std::sqrt(ex2) + (gk + 1024 * u) * nx[m - m0]));
      beta[m] = float(1.02 * std::sqrt(xt2));
    }
  }
  Head h{M, K, 0, N, panels, xs, nullptr, nullptr, norms.typed_data(), w.typed_data(),
         alpha.data(), full.data(), nullptr, false};
  h.wq = wq.typed_data();
  h.Kq = Kq;
  h.qscale = qcols.typed_data();
  h.qerr = qcols.typed_data() + panels * kCols;
  h.qbias = qbias.typed_data();
  h.xq = xq.data();
  h.xstep = step.data();
  h.beta = beta.data();
  h.outl = outl.data();
  h.nout = nout;
  std::vector<int32_t> dims;  // every block's O together
  for (int64_t k = 0; k < K; ++k)
    if (any_o[k]) dims.push_back(int32_t(k));
  h.dims = &dims;
  screen_and_merge(pool, h, tok->typed_data());
  return ffi::Error::Success();
#endif
}

}  // namespace

// 1 when this build has the 8-bit screen (AVX512-VNNI).
extern "C" int PagedjaxLmHeadInt8() {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// 1 when this build screens with AMX tiles and the process may use them (tests, benches).
extern "C" int PagedjaxLmHeadAmx() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxLmHeadGreedyCpu, LmHeadGreedy,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // hidden x [M, K]
                                  .Arg<ffi::Buffer<ffi::U16>>()   // bf16 panels [P, K/2, 64, 2]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // column norms [N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // float32 panels [P, K, 64]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // first argmax [M]

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxLmHeadGreedyInt8Cpu, LmHeadGreedyInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // hidden x [M, K]
                                  .Arg<ffi::Buffer<ffi::S8>>()    // 8-bit panels [P, K/4, 64, 4]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // column norms [N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // steps, error norms [2, P*64]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // -128 sum q [P * 64]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // float32 panels [P, K, 64]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // first argmax [M]
