// Can AMX's bfloat16 tiles do the float32 weight matmuls of a batched CPU step faster than
// AVX-512 FMAs, at float32 accuracy? A standalone measurement, not engine code.
//
// Each float32 value v is split into three bfloat16 parts, hi = bf16(v), mid = bf16(v - hi),
// lo = bf16(v - hi - mid) (round to nearest even each time; together they carry v's 24
// significant bits). A product x * w is then the six partial products whose size is at least
// 2^-16 of the whole (hi*hi, hi*mid, mid*hi, mid*mid, hi*lo, lo*hi), each exact in float32 and
// summed by `tdpbf16ps` into float32 accumulators. The three terms left out are below 2^-24
// of the product: float32's own rounding.
//
// The weight is read in the engine's float32 panels [K, 64] (`models.qlinear.to_dense_panels`)
// and split per panel into a thread-local scratch in the B tiles' layout (pairs of k next to
// each other), so memory holds the same 4 bytes a weight as today; the rows of x are split
// once per call. Against it: the panel matmul's 6 x 64 AVX-512 register block (a copy of
// `csrc/dense_matmul_cpu.cc`'s inner loop without its prefetches). One thread each; every
// call walks `copies` distinct weights so that they come from memory, as a step's layers do.
//
//   g++ -O3 -march=native -std=c++17 bench/amx_fp32_split.cc -o /tmp/amx_fp32_split
//   /tmp/amx_fp32_split M K N copies iters
//
// Prints, per variant, ms per weight and the largest error against a float64 reference,
// relative to the row's sum of |x * w|.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kCols = 64;

template <int MR>
void fp32_block(const float* w, const float* x, int K, float* y, int ldy, int nc) {
  __m512 c[MR][4];
  for (int q = 0; q < MR; ++q)
    for (int i = 0; i < 4; ++i) c[q][i] = _mm512_setzero_ps();
  for (int k = 0; k < K; ++k) {
    const float* wk = w + k * kCols;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16),
                 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int q = 0; q < MR; ++q) {
      const __m512 a = _mm512_set1_ps(x[q * K + k]);
      c[q][0] = _mm512_fmadd_ps(a, w0, c[q][0]);
      c[q][1] = _mm512_fmadd_ps(a, w1, c[q][1]);
      c[q][2] = _mm512_fmadd_ps(a, w2, c[q][2]);
      c[q][3] = _mm512_fmadd_ps(a, w3, c[q][3]);
    }
  }
  for (int q = 0; q < MR; ++q)
    for (int i = 0; i < 4 && 16 * i < nc; ++i) _mm512_storeu_ps(y + q * ldy + 16 * i, c[q][i]);
}

void fp32_matmul(const float* panels, const float* x, int M, int K, int N, float* y) {
  for (int b = 0; b < N / kCols; ++b) {
    const float* w = panels + static_cast<int64_t>(b) * K * kCols;
    int m = 0;
    for (; m + 6 <= M; m += 6) fp32_block<6>(w, x + m * K, K, y + m * N + b * kCols, N, kCols);
    for (; m + 4 <= M; m += 4) fp32_block<4>(w, x + m * K, K, y + m * N + b * kCols, N, kCols);
    for (; m < M; ++m) fp32_block<1>(w, x + m * K, K, y + m * N + b * kCols, N, kCols);
  }
}

// Round each lane's float32 to bfloat16 (nearest even), kept as a float32 with 16 zero bits.
inline __m512i bf16_round(__m512i bits) {
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

inline void split3(__m512 v, __m512i& hi, __m512i& mid, __m512i& lo) {
  hi = bf16_round(_mm512_castps_si512(v));
  const __m512 r1 = _mm512_sub_ps(v, _mm512_castsi512_ps(hi));
  mid = bf16_round(_mm512_castps_si512(r1));
  const __m512 r2 = _mm512_sub_ps(r1, _mm512_castsi512_ps(mid));
  lo = bf16_round(_mm512_castps_si512(r2));
}

// Two rows' bfloat16s (upper halves of a, b) as pairs: lane n = (b[n] << 16) | a[n].
inline __m512i pair(__m512i a, __m512i b) {
  return _mm512_or_si512(b, _mm512_srli_epi32(a, 16));
}

// A float32 panel [K, 64] into three [K/2, 64, 2] bfloat16 panels (B tiles: 16 pairs of k by
// 16 columns is 16 rows of 64 bytes, 256 bytes apart).
void split_panel(const float* w, int K, uint32_t* hi, uint32_t* mid, uint32_t* lo) {
  for (int k = 0; k < K; k += 2) {
    for (int i = 0; i < 4; ++i) {
      __m512i ah, am, al, bh, bm, bl;
      split3(_mm512_loadu_ps(w + k * kCols + 16 * i), ah, am, al);
      split3(_mm512_loadu_ps(w + (k + 1) * kCols + 16 * i), bh, bm, bl);
      const int64_t at = (k / 2) * kCols + 16 * i;
      _mm512_storeu_si512(hi + at, pair(ah, bh));
      _mm512_storeu_si512(mid + at, pair(am, bm));
      _mm512_storeu_si512(lo + at, pair(al, bl));
    }
  }
}

// Rows of x [Mpad, K] into three bfloat16 matrices [Mpad, K] (A tiles: 16 rows of 32 k).
void split_rows(const float* x, int64_t n, uint16_t* hi, uint16_t* mid, uint16_t* lo) {
  for (int64_t i = 0; i < n; i += 16) {
    __m512i h, m, l;
    split3(_mm512_loadu_ps(x + i), h, m, l);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(mid + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(m, 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(l, 16)));
  }
}

// The same 8 tiles of 16 x 64 bytes as the LM head's screen (`csrc/lm_head_greedy_cpu.cc`
// `load_tiles`), written out here so that this program builds without XLA's FFI headers
// (including that source would need them; `bench/panel_stream.cc` does so for the matmul).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void load_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// y[Mpad, N] = x @ w with the six partial products, x split into ah/am/al [Mpad, K].
// `terms`: 6 (float32 accuracy) or 3 (hi*hi, hi*mid, mid*hi: ~16 bits, for comparison).
void amx_matmul(const float* panels, const uint16_t* ah, const uint16_t* am, const uint16_t* al,
                int Mpad, int K, int N, float* y, uint32_t* scratch, int terms) {
  uint32_t* bh = scratch;
  uint32_t* bm = scratch + K / 2 * kCols;
  uint32_t* bl = scratch + K * kCols;
  const int64_t lda = static_cast<int64_t>(K) * 2;  // bytes per row of x's parts
  for (int b = 0; b < N / kCols; ++b) {
    split_panel(panels + static_cast<int64_t>(b) * K * kCols, K, bh, bm, bl);
    for (int m0 = 0; m0 < Mpad; m0 += 16) {
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int k = 0; k < K; k += 32) {
        const int64_t a_at = static_cast<int64_t>(m0) * K + k;
        const int64_t b_at = static_cast<int64_t>(k / 2) * kCols;
        _tile_loadd(0, ah + a_at, lda);
        _tile_loadd(1, am + a_at, lda);
        if (terms == 6) _tile_loadd(2, al + a_at, lda);
// A column tile's products, its B parts loaded once each: 15 tile loads for 24
// `tdpbf16ps` a k step. (Ordering the products so that consecutive ones accumulate into
// different tiles, each B part loaded once per product that reads it, 27 loads, measured
// slower: the loads, not the unit's latency, set the pace here.)
#define PAGEDJAX_COLUMN_TILE(J, C)                 \
  _tile_loadd(3, bh + b_at + 16 * (J), kCols * 4); \
  _tile_dpbf16ps(C, 0, 3);                         \
  _tile_dpbf16ps(C, 1, 3);                         \
  if (terms == 6) _tile_dpbf16ps(C, 2, 3);         \
  _tile_loadd(3, bm + b_at + 16 * (J), kCols * 4); \
  _tile_dpbf16ps(C, 0, 3);                         \
  if (terms == 6) {                                \
    _tile_dpbf16ps(C, 1, 3);                       \
    _tile_loadd(3, bl + b_at + 16 * (J), kCols * 4); \
    _tile_dpbf16ps(C, 0, 3);                       \
  }
        PAGEDJAX_COLUMN_TILE(0, 4)
        PAGEDJAX_COLUMN_TILE(1, 5)
        PAGEDJAX_COLUMN_TILE(2, 6)
        PAGEDJAX_COLUMN_TILE(3, 7)
#undef PAGEDJAX_COLUMN_TILE
      }
      float* out = y + static_cast<int64_t>(m0) * N + b * kCols;
      _tile_stored(4, out, N * 4);
      _tile_stored(5, out + 16, N * 4);
      _tile_stored(6, out + 32, N * 4);
      _tile_stored(7, out + 48, N * 4);
    }
  }
}

// Tile rows are 64 bytes: a buffer on a 64-byte boundary keeps each row in one cache line.
// (With std::allocator's 16-byte alignment a tile load and product took 15.5-16 ns a pair
// or 6.5 ns, depending on where the buffer fell.)
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64));
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, Aligned64<T>>;

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int M = argc > 1 ? std::atoi(argv[1]) : 64;
  const int K = argc > 2 ? std::atoi(argv[2]) : 576;
  const int N = argc > 3 ? std::atoi(argv[3]) : 1536;
  const int copies = argc > 4 ? std::atoi(argv[4]) : 30;
  const int iters = argc > 5 ? std::atoi(argv[5]) : 5;
  if (K % 32 != 0 || N % kCols != 0) {
    std::fprintf(stderr, "K must be a multiple of 32 and N of 64\n");
    return 2;
  }
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    std::fprintf(stderr, "no AMX tile permission\n");
    return 2;
  }
  const int Mpad = (M + 15) / 16 * 16;
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t wsize = static_cast<int64_t>(K) * N;
  AlignedVector<float> panels(wsize * copies);  // copy c, panel b: [K, 64]
  for (auto& v : panels) v = nd(rng) * 0.05f;
  AlignedVector<float> x(static_cast<int64_t>(Mpad) * K, 0.f);
  for (int64_t i = 0; i < static_cast<int64_t>(M) * K; ++i) x[i] = nd(rng);

  // float64 reference for copy 0, and each row's sum of |x * w| (the scale of its rounding).
  std::vector<double> ref(static_cast<int64_t>(M) * N), mag(static_cast<int64_t>(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = 0, a = 0;
      const float* w = panels.data() + static_cast<int64_t>(n / kCols) * K * kCols + n % kCols;
      for (int k = 0; k < K; ++k) {
        const double p = static_cast<double>(x[m * K + k]) * w[k * kCols];
        s += p;
        a += std::fabs(p);
      }
      ref[m * N + n] = s;
      mag[m * N + n] = a;
    }
  auto max_err = [&](const AlignedVector<float>& y) {
    double e = 0;
    for (int m = 0; m < M; ++m)
      for (int n = 0; n < N; ++n)
        e = std::max(e, std::fabs(y[m * N + n] - ref[m * N + n]) / mag[m * N + n]);
    return e;
  };

  AlignedVector<float> y(static_cast<int64_t>(Mpad) * N);
  AlignedVector<uint16_t> ah(x.size()), am(x.size()), al(x.size());
  AlignedVector<uint32_t> scratch(static_cast<int64_t>(K) / 2 * kCols * 3);
  load_tiles();
  double best[3] = {1e30, 1e30, 1e30}, err[3] = {0, 0, 0};
  for (int it = 0; it < iters; ++it) {
    for (int v = 0; v < 3; ++v) {
      const double t0 = now_ms();
      for (int c = 0; c < copies; ++c) {
        const float* w = panels.data() + c * wsize;
        if (v == 0) {
          fp32_matmul(w, x.data(), M, K, N, y.data());
        } else {
          split_rows(x.data(), static_cast<int64_t>(Mpad) * K, ah.data(), am.data(), al.data());
          amx_matmul(w, ah.data(), am.data(), al.data(), Mpad, K, N, y.data(), scratch.data(),
                     v == 1 ? 6 : 3);
        }
        if (c == 0 && it == 0) err[v] = max_err(y);
      }
      best[v] = std::min(best[v], (now_ms() - t0) / copies);
    }
  }
  // The weight's split alone, every panel into the scratch as `amx_matmul` does it.
  double split = 1e30;
  for (int it = 0; it < iters; ++it) {
    const double t0 = now_ms();
    for (int c = 0; c < copies; ++c)
      for (int b = 0; b < N / kCols; ++b)
        split_panel(panels.data() + c * wsize + static_cast<int64_t>(b) * K * kCols, K,
                    scratch.data(), scratch.data() + K / 2 * kCols, scratch.data() + K * kCols);
    split = std::min(split, (now_ms() - t0) / copies);
  }
  // The unit alone: `tdpbf16ps` into four independent tiles with the operands in tiles, then
  // with a 1 KiB tile load (from L1) before each.
  AlignedVector<uint16_t> ones(16 * 32 * 4, 0x3f80);
  _tile_loadd(0, ones.data(), 64);
  _tile_loadd(1, ones.data(), 64);
  _tile_loadd(2, ones.data(), 64);
  _tile_loadd(3, ones.data(), 64);
  const int64_t reps = 1000000;
  double t0 = now_ms();
  for (int64_t i = 0; i < reps; ++i) {
    _tile_dpbf16ps(4, 0, 3);
    _tile_dpbf16ps(5, 1, 3);
    _tile_dpbf16ps(6, 2, 3);
    _tile_dpbf16ps(7, 0, 2);
  }
  const double dp_ns = (now_ms() - t0) * 1e6 / (4.0 * reps);
  t0 = now_ms();
  for (int64_t i = 0; i < reps; ++i) {
    _tile_loadd(3, ones.data(), 64);
    _tile_dpbf16ps(4, 0, 3);
    _tile_loadd(3, ones.data() + 512, 64);
    _tile_dpbf16ps(5, 1, 3);
    _tile_loadd(3, ones.data() + 1024, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(3, ones.data() + 1536, 64);
    _tile_dpbf16ps(7, 0, 3);
  }
  const double load_dp_ns = (now_ms() - t0) * 1e6 / (4.0 * reps);
  _tile_release();
  std::printf("%-20s %.2f ns a tdpbf16ps (%.0f G bf16 multiply-adds/s), %.2f ns with a tile "
              "load before each\n", "AMX unit alone", dp_ns, 16 * 16 * 32 / dp_ns, load_dp_ns);
  std::printf("%-20s M %d K %d N %d: %.3f ms a weight\n", "split alone", M, K, N, split);
  const char* names[3] = {"fp32 AVX-512 FMA", "AMX bf16 x 6 terms", "AMX bf16 x 3 terms"};
  for (int v = 0; v < 3; ++v)
    std::printf("%-20s M %d K %d N %d: %.3f ms a weight (best of %d), %.1f GFLOP/s, "
                "max error / sum|x*w| %.2e\n", names[v], M, K, N, best[v], iters,
                2.0 * M * K * N / best[v] * 1e-6, err[v]);
  return 0;
}
