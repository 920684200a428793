// Ragged paged attention for XLA:CPU, as an XLA FFI custom call.
//
// Why native code: on CPU, XLA can only express paged attention as a gather of every
// sequence's K/V through its block table into a dense copy, then dots over the copy. The
// copy costs more than the attention and grows with the padded table width
// (`bench/cpu_attention.py`: 2.7 vs 8.0 ms per layer for 64 decodes at 128-token contexts,
// 12.4 vs 46.9 ms at 1000; docs/v1-core.md). Pallas has no CPU backend. This kernel reads K/V blocks in place through the table, so its cost
// follows each sequence's real length, like the GPU kernels'.
//
// Semantics are those of `ragged_paged_attention_ref` (pallas_kernels/ragged_paged_attention.py):
// sequence s owns query rows cu_q_lens[s]:cu_q_lens[s+1]; query i of a sequence with q_len new
// tokens and kv_len total tokens sits at position kv_len - q_len + i and sees positions <= its
// own, and only its last `window` positions when window > 0 (a sliding window). Logits may be
// soft-capped (softcap > 0: c * tanh(logit / c)). Rows past cu_q_lens[num_seqs], and sequences
// with kv_len 0, get zeros. Only blocks the table names for positions inside [first visible,
// kv_len) are read (ids are clamped into the pool, so a bad table cannot read out of bounds):
// blocks wholly before a window may already be freed. A decode step is the case q_len = 1.
//
// Work is split into items (sequence, kv head, tile of up to kTileQ query tokens); the items
// are shared out over XLA's intra-op thread pool, the calling thread included. Each item keeps
// its tile's queries, running max, sum and accumulator in fp32 (an online softmax over the
// context, one block at a time). Per query row and block, scores, max, exponentials and the
// V accumulation are separate loops the compiler vectorizes (the exponential is a polynomial,
// not libm's scalar call), with the accumulator in registers for head dims 64 and 128.
//
// Quantized caches (int8, FP8 e4m3 / e5m2; pallas_kernels/kv_quant.py) hold k / s_k and v / s_v
// with static scales per (layer, KV head, channel), passed as `scales` [2, Hkv, D]: s_k
// multiplies the queries and s_v the output, so blocks are only widened to fp32. An int8
// cache with per-token factors (data_slots > 0) also divides each token by its own factor,
// kept in the factor slots; rows are multiplied back as they are widened.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTileQ = 16;          // query tokens per work item
constexpr float kMask = -1e30f;     // finite, so exp(kMask - m) is exactly 0

// The next block of an item, pulled towards L2 (prefetcht1) row by row while this block's
// rows are read: K row t during the key pass's row t, V row t during the value pass's.
// Before (stops 68-72) they went in one burst of 2 x 64 lines ahead of the block, where the
// core's own loads queued behind them, and an item's first block was never pulled. Spread,
// and with each thread's next item's first block pulled during its current item's last
// (`run_item`'s `next`), a 64 x 76 decode step's 30 layers from memory ran 1.27-1.36x as
// fast on the Zen 4 host, 256 x 44 1.30-1.42x, 16 x 1000 1.24-1.27x, the AVX2 build
// 1.35-1.37x, with the blocks in cache 1.01x (`bench/native_ab.py --kind attention`;
// spreading alone: 1.07-1.09x). Into L1 (prefetcht0): 0.61-0.66x; the next block's V rows
// pulled with its K rows during the key pass: 0.91x.
struct Ahead {
  const char* k = nullptr;  // the next block's K and V (null: no next block)
  const char* v = nullptr;
  int64_t row_bytes = 0;    // bytes of one token's row in the cache
};

// Lines of rows [a, b) of the block at `base`.
inline void pull_rows(const char* base, int64_t row_bytes, int64_t a, int64_t b) {
  if (!base) return;
  for (int64_t off = (a * row_bytes) & ~int64_t(63); off < b * row_bytes; off += 64)
    __builtin_prefetch(base + off, 0, 2);
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(int8_t x) { return static_cast<float>(x); }

// FP8 storage types, decoded through a 256-entry table each.
struct F8E4M3 { uint8_t bits; };  // e4m3fn: bias 7, no infinities, S.1111.111 is NaN
struct F8E5M2 { uint8_t bits; };  // e5m2: bias 15, IEEE-like infinities and NaNs

inline float decode_fp8(uint8_t b, int mant_bits, int bias, bool has_inf) {
  const int exp_bits = 7 - mant_bits;
  const int sign = b >> 7, e = (b >> mant_bits) & ((1 << exp_bits) - 1);
  const int m = b & ((1 << mant_bits) - 1);
  const int emax = (1 << exp_bits) - 1;
  float v;
  if (has_inf && e == emax) {
    v = m ? NAN : INFINITY;
  } else if (!has_inf && e == emax && m == (1 << mant_bits) - 1) {
    v = NAN;
  } else if (e == 0) {
    v = std::ldexp(static_cast<float>(m), 1 - bias - mant_bits);  // subnormal
  } else {
    v = std::ldexp(static_cast<float>(m + (1 << mant_bits)), e - bias - mant_bits);
  }
  return sign ? -v : v;
}

struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = decode_fp8(static_cast<uint8_t>(b), 3, 7, false);
      e5m2[b] = decode_fp8(static_cast<uint8_t>(b), 2, 15, true);
    }
  }
};
const Fp8Tables kFp8;

inline float to_float(F8E4M3 x) { return kFp8.e4m3[x.bits]; }
inline float to_float(F8E5M2 x) { return kFp8.e5m2[x.bits]; }

inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp is a scalar libm call, and
// one per (query row, key) was the kernel's largest cost: `bench/cpu_attention.py`). Cephes'
// expf reduction and polynomial (relative error ~1e-7, i.e. within a couple of fp32 ulps);
// below -87 the result is exactly 0, so masked logits (kMask) still weigh nothing.
inline float exp_nonpos(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const int32_t e = (static_cast<int32_t>(std::max(n, -126.f)) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, sizeof two_n);
  return x < -87.f ? 0.f : y * two_n;
}

struct Item {
  int32_t seq, head, q0, nq;  // query rows [q0, q0 + nq) of sequence `seq` (relative)
};

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim, num_kv_heads, num_blocks, block_size, width;
  int64_t layer;
  int64_t span;  // positions a query sees, itself included (the window, or all)
  float scale;
  float softcap;  // 0: off
  const int32_t* kv_lens;
  const int32_t* tables;
  const int32_t* cu;
  const float* scales;  // [2, Hkv, D] (K, V) for a quantized cache; null: none
  int64_t data_slots;   // > 0: per-token factors after this many slots (kv_quant.py); 0: none
};

// The float32 factor of (p.layer, head, block, offset) in a per-token cache (kv_quant.py:
// extra slots after the data slots, 4 bytes per data slot in each token's row).
template <typename C>
inline float token_factor(const Problem& p, const C* cache, int64_t head, int64_t block,
                          int64_t offset) {
  const int64_t per = p.head_dim / 4;
  const int64_t row =
      (((p.data_slots + p.layer / per) * p.num_kv_heads + head) * p.num_blocks + block) *
          p.block_size + offset;
  float f;
  std::memcpy(&f, reinterpret_cast<const char*>(cache + row * p.head_dim) + 4 * (p.layer % per),
              sizeof f);
  return f;
}

#if defined(__AVX512F__)
// out[t] = the sum of v[t]'s sixteen lanes, t < 16. Adds pairs of vectors after interleaving
// them: 32-bit lanes, then 64-bit lanes, then 128-bit quarters (twice), so each step halves
// the vectors and leaves lane t holding key t's partial sums.
inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // quarter-wise: (x0+x2, y0+y2, x1+x3, y1+y3)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // quarter-wise: keys 4i .. 4i+3, each summed over its quarter
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// exp_nonpos on sixteen lanes.
inline __m512 exp_nonpos16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_max_ps(n, _mm512_set1_ps(-126.f))),
                       _mm512_set1_epi32(127)),
      23);
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(live, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

// attend_block_row for head dims that are whole vectors and no soft cap, sixteen keys at a
// time in registers: one vector of products per key and one transpose-and-add tree for all
// sixteen dots (a horizontal sum per key, and a scalar max chain, were most of the kernel's
// time), the softmax update on the score vector, the accumulator held in registers.
template <int DC>
inline void attend_block_row16(const float* qr, const float* kp, const float* vp, int64_t t0,
                               int64_t keys, float& m, float& l, float* acc) {
  constexpr int NV = DC / 16;
  __m512 qv[NV], a[NV];
  for (int j = 0; j < NV; ++j) {
    qv[j] = _mm512_loadu_ps(qr + 16 * j);
    a[j] = _mm512_loadu_ps(acc + 16 * j);
  }
  for (int64_t tb = t0; tb < keys; tb += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, keys - tb));
    __m512 part[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
      if (t < n) {  // keys past n are never read
        const float* kr = kp + (tb + t) * DC;
        __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
        for (int j = 1; j < NV; ++j) x = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kr + 16 * j), x);
        part[t] = x;
      } else {
        part[t] = _mm512_setzero_ps();
      }
    }
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    const __m512 sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(kMask), lane_sums16(part));
    const float mx = std::max(m, _mm512_reduce_max_ps(sc));
    const __m512 e = exp_nonpos16(_mm512_sub_ps(sc, _mm512_set1_ps(mx)));
    const float alpha = exp_nonpos(m - mx);
    l = l * alpha + _mm512_reduce_add_ps(e);
    m = mx;
    alignas(64) float w[16];
    _mm512_store_ps(w, e);
    const __m512 av = _mm512_set1_ps(alpha);
    for (int j = 0; j < NV; ++j) a[j] = _mm512_mul_ps(a[j], av);
    for (int t = 0; t < n; ++t) {
      const __m512 wt = _mm512_set1_ps(w[t]);
      const float* vr = vp + (tb + t) * DC;
      for (int j = 0; j < NV; ++j) a[j] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(vr + 16 * j), a[j]);
    }
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + 16 * j, a[j]);
}

// attend_block_row16 for the R query heads that share one KV head (R = the GQA group, rows
// contiguous in qr, m, l, acc), one query token: the same operations per row in the same
// order, so the results are bit-identical, but the value pass loads each V row once for all
// R rows and runs R x DC / 16 independent accumulator chains instead of DC / 16 (one row's
// chain of 16 dependent FMAs per block was what a decode step's attention waited on).
template <int DC, int R>
inline void attend_block_rows16(const float* qr, const float* kp, const float* vp, int64_t t0,
                                int64_t keys, float* m, float* l, float* acc,
                                const Ahead& ah) {
  constexpr int NV = DC / 16;
  for (int64_t tb = t0; tb < keys; tb += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, keys - tb));
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    alignas(64) float w[R][16];
    float alpha[R];
    for (int r = 0; r < R; ++r) {
      __m512 qv[NV];
      for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qr + r * DC + 16 * j);
      __m512 part[16];
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) {
        if (t < n) {
          if (r == 0) pull_rows(ah.k, ah.row_bytes, tb + t, tb + t + 1);
          const float* kr = kp + (tb + t) * DC;
          __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int j = 1; j < NV; ++j)
            x = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kr + 16 * j), x);
          part[t] = x;
        } else {
          part[t] = _mm512_setzero_ps();
        }
      }
      const __m512 sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(kMask), lane_sums16(part));
      const float mx = std::max(m[r], _mm512_reduce_max_ps(sc));
      const __m512 e = exp_nonpos16(_mm512_sub_ps(sc, _mm512_set1_ps(mx)));
      alpha[r] = exp_nonpos(m[r] - mx);
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(e);
      m[r] = mx;
      _mm512_store_ps(w[r], e);
    }
    __m512 a[R][NV];
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(alpha[r]);
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * DC + 16 * j), av);
    }
    for (int t = 0; t < n; ++t) {
      pull_rows(ah.v, ah.row_bytes, tb + t, tb + t + 1);
      const float* vr = vp + (tb + t) * DC;
      __m512 v[NV];
      for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_ps(vr + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 wt = _mm512_set1_ps(w[r][t]);
        for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(wt, v[j], a[r][j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + r * DC + 16 * j, a[r][j]);
  }
}

// The G rows of one query token against one block through attend_block_rows16, where it
// applies (head dims in whole vectors, no soft cap, G of 2 to 4); false: not handled.
template <int DC>
inline bool attend_block_group(int64_t G, const float* qr, const float* kp, const float* vp,
                               int64_t t0, int64_t keys, float softcap, float* m, float* l,
                               float* acc, const Ahead& ah) {
  if constexpr (DC > 0 && DC % 16 == 0 && DC <= 128) {
    if (softcap != 0.f) return false;
    switch (G) {
      case 2: attend_block_rows16<DC, 2>(qr, kp, vp, t0, keys, m, l, acc, ah); return true;
      case 3: attend_block_rows16<DC, 3>(qr, kp, vp, t0, keys, m, l, acc, ah); return true;
      case 4: attend_block_rows16<DC, 4>(qr, kp, vp, t0, keys, m, l, acc, ah); return true;
      default: return false;
    }
  }
  return false;
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 with FMA (AMD Zen 2-3, Intel without AVX-512): the grouped rows of
// attend_block_rows16 in vectors of eight. On AVX2 builds the attention otherwise ran the
// portable per-row loops, 0.84-0.86x the AVX-512 kernel's speed for a 64-row decode step's 30
// layers and 0.72x with the blocks in cache (`bench/native_ab.py --march x86-64-v3
// --base-march native`, docs/v1-core.md "AVX2 hosts").

// out[t] = the sum of v[t]'s eight lanes, t < 8: pairwise adds within 128-bit halves, then
// the two halves of each.
inline __m256 lane_sums8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

inline float reduce_max8(__m256 x) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

inline float reduce_add8(__m256 x) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// exp_nonpos on eight lanes (the same reduction and polynomial).
inline __m256 exp_nonpos8(__m256 x) {
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_max_ps(n, _mm256_set1_ps(-126.f))),
                       _mm256_set1_epi32(127)),
      23);
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_NLT_UQ);
  return _mm256_and_ps(live, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// The R query rows that share one KV head (rows contiguous in qr, m, l, acc) against keys
// [t0, keys) of one block, sixteen keys at a time as attend_block_rows16: per row one vector
// of products per key and one transpose-and-add per eight dots, the softmax update on the
// two score vectors; then the value pass loads each V row once for all R rows, over CH
// vectors of the head dim at a time (R x CH accumulators and CH values fit the sixteen
// registers). All K rows of sixteen keys before their V rows: alternating the two every
// eight keys ran up to 10 % slower on streamed blocks.
template <int DC, int R>
inline void attend_block_rows8(const float* qr, const float* kp, const float* vp, int64_t t0,
                               int64_t keys, float* m, float* l, float* acc, const Ahead& ah) {
  constexpr int NV = DC / 8;
  constexpr int CH = R <= 3 ? 4 : 2;
  static_assert(NV % CH == 0, "head dim in whole chunks");
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t tb = t0; tb < keys; tb += 16) {  // a block's K rows, then its V rows
    const int n = static_cast<int>(std::min<int64_t>(16, keys - tb));
    alignas(32) float w[R][16];
    float alpha[R];
    for (int r = 0; r < R; ++r) {
      const float* q = qr + r * DC;
      __m256 sc[2];
      for (int g = 0; g < 2; ++g) {  // keys tb + 8g .. tb + 8g + 7
        const int ng = std::clamp(n - 8 * g, 0, 8);
        __m256 part[8];
        for (int t = 0; t < 8; ++t) {
          if (t < ng) {  // keys past n are never read
            if (r == 0) pull_rows(ah.k, ah.row_bytes, tb + 8 * g + t, tb + 8 * g + t + 1);
            const float* kr = kp + (tb + 8 * g + t) * DC;
            __m256 x = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kr));
            for (int j = 1; j < NV; ++j)
              x = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * j), _mm256_loadu_ps(kr + 8 * j), x);
            part[t] = x;
          } else {
            part[t] = _mm256_setzero_ps();
          }
        }
        const __m256 live =
            _mm256_cmp_ps(iota, _mm256_set1_ps(static_cast<float>(ng)), _CMP_LT_OQ);
        sc[g] = _mm256_blendv_ps(_mm256_set1_ps(kMask), lane_sums8(part), live);
      }
      const float mx = std::max(m[r], reduce_max8(_mm256_max_ps(sc[0], sc[1])));
      const __m256 e0 = exp_nonpos8(_mm256_sub_ps(sc[0], _mm256_set1_ps(mx)));
      const __m256 e1 = exp_nonpos8(_mm256_sub_ps(sc[1], _mm256_set1_ps(mx)));
      alpha[r] = exp_nonpos(m[r] - mx);
      l[r] = l[r] * alpha[r] + reduce_add8(_mm256_add_ps(e0, e1));
      m[r] = mx;
      _mm256_store_ps(w[r], e0);
      _mm256_store_ps(w[r] + 8, e1);
    }
    for (int c = 0; c < NV; c += CH) {
      __m256 a[R][CH];
      for (int r = 0; r < R; ++r) {
        const __m256 av = _mm256_set1_ps(alpha[r]);
        for (int j = 0; j < CH; ++j)
          a[r][j] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * DC + 8 * (c + j)), av);
      }
      for (int t = 0; t < n; ++t) {
        if (c == 0) pull_rows(ah.v, ah.row_bytes, tb + t, tb + t + 1);
        const float* vr = vp + (tb + t) * DC + 8 * c;
        __m256 v[CH];
        for (int j = 0; j < CH; ++j) v[j] = _mm256_loadu_ps(vr + 8 * j);
        for (int r = 0; r < R; ++r) {
          const __m256 wt = _mm256_set1_ps(w[r][t]);
          for (int j = 0; j < CH; ++j) a[r][j] = _mm256_fmadd_ps(wt, v[j], a[r][j]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < CH; ++j) _mm256_storeu_ps(acc + r * DC + 8 * (c + j), a[r][j]);
    }
  }
}

// The G rows of one query token against one block through attend_block_rows8, where it
// applies (head dims 64 or 128, no soft cap, G of 1 to 4); false: not handled.
template <int DC>
inline bool attend_block_group(int64_t G, const float* qr, const float* kp, const float* vp,
                               int64_t t0, int64_t keys, float softcap, float* m, float* l,
                               float* acc, const Ahead& ah) {
  if constexpr (DC > 0 && DC % 32 == 0 && DC <= 128) {
    if (softcap != 0.f) return false;
    switch (G) {
      case 1: attend_block_rows8<DC, 1>(qr, kp, vp, t0, keys, m, l, acc, ah); return true;
      case 2: attend_block_rows8<DC, 2>(qr, kp, vp, t0, keys, m, l, acc, ah); return true;
      case 3: attend_block_rows8<DC, 3>(qr, kp, vp, t0, keys, m, l, acc, ah); return true;
      case 4: attend_block_rows8<DC, 4>(qr, kp, vp, t0, keys, m, l, acc, ah); return true;
      default: return false;
    }
  }
  return false;
}
#endif

// One query row against keys [t0, keys) of one block: scores, then the online-softmax
// update of the row's max `m`, sum `l` and accumulator `acc`. Each pass is a loop over keys
// or channels the compiler vectorizes; DC is the head dim when known at compile time (64,
// 128: the accumulator stays in registers), else 0.
template <int DC>
inline void attend_block_row(const float* qr, const float* kp, const float* vp, int64_t D,
                             int64_t t0, int64_t keys, float softcap, float* s, float& m,
                             float& l, float* acc) {
  if constexpr (DC > 0) D = DC;
  float mx = m;
#if defined(__AVX512F__)
  if constexpr (DC > 0 && DC % 16 == 0) {
    if (softcap == 0.f) return attend_block_row16<DC>(qr, kp, vp, t0, keys, m, l, acc);
  }
#endif
  for (int64_t t = t0; t < keys; ++t) {
    const float* kr = kp + t * D;
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
    s[t] = dot;
  }
  if (softcap > 0.f)
    for (int64_t t = t0; t < keys; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  for (int64_t t = t0; t < keys; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
  for (int64_t t = t0; t < keys; ++t) {
    s[t] = exp_nonpos(s[t] - mx);
    sum += s[t];
  }
  const float alpha = exp_nonpos(m - mx);
  l = l * alpha + sum;
  m = mx;
  if constexpr (DC > 0) {
    float a[DC];
    for (int d = 0; d < DC; ++d) a[d] = acc[d] * alpha;
    for (int64_t t = t0; t < keys; ++t) {
      const float w = s[t];
      const float* vr = vp + t * DC;
      for (int d = 0; d < DC; ++d) a[d] += w * vr[d];
    }
    for (int d = 0; d < DC; ++d) acc[d] = a[d];
  } else {
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
    for (int64_t t = t0; t < keys; ++t) {
      const float w = s[t];
      const float* vr = vp + t * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += w * vr[d];
    }
  }
}

// The blocks [j0, j1) of its sequence's table that an item reads, and its first query's
// position.
struct Span {
  int64_t pos0, first, last, j0, j1;
};
inline Span item_span(const Problem& p, const Item& it) {
  Span sp;
  sp.pos0 = int64_t(p.kv_lens[it.seq]) - (p.cu[it.seq + 1] - p.cu[it.seq]) + it.q0;
  sp.last = sp.pos0 + it.nq - 1;  // the tile sees keys [first, last]
  sp.first = std::max<int64_t>(sp.pos0 - p.span + 1, 0);
  sp.j0 = sp.first / p.block_size;
  sp.j1 = sp.last < 0 ? 0 : std::min<int64_t>(sp.last / p.block_size + 1, p.width);
  return sp;
}

// The pool block that entry j of item `it`'s table names (clamped into the pool, so a bad
// table cannot read out of bounds), and where that block starts in a cache, in elements.
inline int64_t block_id(const Problem& p, const Item& it, int64_t j) {
  return std::clamp<int64_t>(p.tables[int64_t(it.seq) * p.width + j], 0, p.num_blocks - 1);
}
inline int64_t block_start(const Problem& p, const Item& it, int64_t bid) {
  return ((p.layer * p.num_kv_heads + it.head) * p.num_blocks + bid) * p.block_size *
         p.head_dim;
}

// Block j of item `it`'s table as an `Ahead` (its K and V rows in the cache).
template <typename C>
inline Ahead block_ahead(const Problem& p, const Item& it, int64_t j, const C* k_cache,
                         const C* v_cache) {
  const int64_t at = block_start(p, it, block_id(p, it, j));
  return Ahead{reinterpret_cast<const char*>(k_cache + at),
               reinterpret_cast<const char*>(v_cache + at), int64_t(sizeof(C)) * p.head_dim};
}

// One work item: the tile's queries against its sequence's context, block by block.
// T: queries and output (fp32 / bf16); C: the cache's storage (T, int8 or FP8). `next`: the
// item this thread runs after it (null: none), whose first block is pulled during this
// item's last (an item's first block otherwise waits on memory: one in five of a 76-token
// decode's).
template <typename T, typename C, int DC>
void run_item(const Problem& p, const Item& it, const Item* next, const T* q, const C* k_cache,
              const C* v_cache, T* out, std::vector<float>& scratch) {
  const int64_t D = DC ? DC : p.head_dim, G = p.num_q_heads / p.num_kv_heads, bs = p.block_size;
  const int64_t rows = it.nq * G;
  const Span sp = item_span(p, it);
  const int64_t pos0 = sp.pos0;  // position of the tile's first query
  // Only the accumulators start at zero: the queries, widened blocks and scores are written
  // before they are read. (Zeroing the whole scratch per item, ~10 KiB, was ~56 MB of
  // stores per 64-row decode step of the demo model, though `bench/native_ab.py` measured
  // no time saved: the block reads set the pace.)
  const size_t need = size_t(rows * (2 * D + 2) + 2 * bs * D + bs);
  if (scratch.size() < need) scratch.resize(need);
  float* qf = scratch.data();           // [rows, D] scaled queries
  float* acc = qf + rows * D;           // [rows, D]
  float* m = acc + rows * D;            // [rows]
  float* l = m + rows;                  // [rows]
  float* kb = l + rows;                 // [bs, D] block converted to fp32 (non-fp32 caches)
  float* vb = kb + bs * D;
  float* s = vb + bs * D;               // [bs] scores of one row
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(l, l + rows, 0.f);
  const float* k_scale = p.scales ? p.scales + it.head * D : nullptr;  // [D] or none
  const float* v_scale = p.scales ? p.scales + (p.num_kv_heads + it.head) * D : nullptr;
  for (int64_t i = 0; i < it.nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = q + ((p.cu[it.seq] + it.q0 + i) * p.num_q_heads + it.head * G + g) * D;
      float* dst = qf + (i * G + g) * D;
      for (int64_t d = 0; d < D; ++d)
        dst[d] = to_float(src[d]) * p.scale * (k_scale ? k_scale[d] : 1.f);
    }
  std::fill(m, m + rows, kMask);
  const int64_t last = sp.last, nblocks = sp.j1;
  for (int64_t j = sp.j0; j < nblocks; ++j) {
    const int64_t bid = block_id(p, it, j);
    const C* kt = k_cache + block_start(p, it, bid);
    const C* vt = v_cache + block_start(p, it, bid);
    // Blocks are scattered: pull the next one (after the last, the thread's next item's
    // first) towards L2 while this one runs (`Ahead`). A decode item's block goes through
    // attend_block_group, which spreads the pulls over its rows; a query tile's, or the
    // per-row loops', get them in one burst here. (L2, not L1: 1.12-1.20x at stop 72, the
    // bursts then competing for L1 and its fill buffers; two blocks ahead gained nothing,
    // prefetchnta nothing.)
    Ahead ah;
    if (j + 1 < nblocks) {
      ah = block_ahead(p, it, j + 1, k_cache, v_cache);
    } else if (next) {
      const Span ns = item_span(p, *next);
      if (ns.j0 < ns.j1) ah = block_ahead(p, *next, ns.j0, k_cache, v_cache);
    }
    auto burst = [&] {
      pull_rows(ah.k, ah.row_bytes, 0, bs);
      pull_rows(ah.v, ah.row_bytes, 0, bs);
      ah = Ahead{};
    };
    if (it.nq > 1) burst();
    const float* kp;
    const float* vp;
    if constexpr (std::is_same_v<C, float>) {
      kp = kt;
      vp = vt;
    } else {
      const int64_t keys = std::min<int64_t>(bs, last + 1 - j * bs);
      const int64_t from = std::max<int64_t>(sp.first - j * bs, 0) * D;
      if (p.data_slots > 0) {  // per-token factors, widened in with each row's values
        for (int64_t t = from / D; t < keys; ++t) {
          const float fk = token_factor(p, k_cache, it.head, bid, t);
          const float fv = token_factor(p, v_cache, it.head, bid, t);
          for (int64_t d = 0; d < D; ++d) kb[t * D + d] = to_float(kt[t * D + d]) * fk;
          for (int64_t d = 0; d < D; ++d) vb[t * D + d] = to_float(vt[t * D + d]) * fv;
        }
      } else {
        for (int64_t x = from; x < keys * D; ++x) kb[x] = to_float(kt[x]);
        for (int64_t x = from; x < keys * D; ++x) vb[x] = to_float(vt[x]);
      }
      kp = kb;
      vp = vb;
    }
    for (int64_t i = 0; i < it.nq; ++i) {
      const int64_t keys = std::min<int64_t>(bs, pos0 + i + 1 - j * bs);  // causal, by length
      const int64_t t0 = std::max<int64_t>(pos0 + i - p.span + 1 - j * bs, 0);  // window
      if (keys <= t0) {
        burst();
        continue;
      }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      if (attend_block_group<DC>(G, qf + i * G * D, kp, vp, t0, keys, p.softcap, m + i * G,
                                 l + i * G, acc + i * G * D, ah)) {
        // rows the group did not read: before a window, past the last key
        for (const char* base : {ah.k, ah.v}) {
          pull_rows(base, ah.row_bytes, 0, t0);
          pull_rows(base, ah.row_bytes, keys, bs);
        }
        continue;
      }
#endif
      burst();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        attend_block_row<DC>(qf + r * D, kp, vp, D, t0, keys, p.softcap, s, m[r], l[r],
                             acc + r * D);
      }
    }
  }
  for (int64_t i = 0; i < it.nq; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      T* dst = out + ((p.cu[it.seq] + it.q0 + i) * p.num_q_heads + it.head * G + g) * D;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      for (int64_t d = 0; d < D; ++d)
        from_float(acc[r * D + d] * inv * (v_scale ? v_scale[d] : 1.f), dst + d);
    }
}

// Shared by the calling thread and pool tasks; heap-held so a task that starts after the
// work is done (and finds nothing to claim) never touches a dead stack frame.
struct Shared {
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

template <typename T, typename C>
void work(const std::shared_ptr<Shared>& sh, const Problem& p, const T* q, const C* k,
          const C* v, T* out) {
  std::vector<float> scratch;
  const int64_t n = static_cast<int64_t>(sh->items.size());
  // Each thread claims its next item before running the current one, so that it can pull
  // the next one's first block during the current one's last.
  for (int64_t i = sh->next.fetch_add(1); i < n;) {
    const int64_t j = sh->next.fetch_add(1);
    const Item* nx = j < n ? &sh->items[j] : nullptr;
    if (p.head_dim == 64)
      run_item<T, C, 64>(p, sh->items[i], nx, q, k, v, out, scratch);
    else if (p.head_dim == 128)
      run_item<T, C, 128>(p, sh->items[i], nx, q, k, v, out, scratch);
    else
      run_item<T, C, 0>(p, sh->items[i], nx, q, k, v, out, scratch);
    i = j;
  }
}

template <typename T, typename C>
ffi::Error attend(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                  ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                  ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                  ffi::Buffer<ffi::S32> num_seqs_buf, ffi::Buffer<ffi::S32> layer_buf,
                  ffi::Buffer<ffi::S32> window_buf, ffi::Buffer<ffi::F32> scales,
                  ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                  int64_t data_slots) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), td = block_tables.dimensions();
  Problem p;
  p.num_tokens = qd[0];
  p.num_q_heads = qd[1];
  p.head_dim = qd[2];
  p.num_kv_heads = kd[1];
  p.num_blocks = kd[2];
  p.block_size = kd[3];
  p.width = td[1];
  p.data_slots = 0;
  if constexpr (!std::is_same_v<C, T>) {
    if (data_slots > 0) {
      if (p.head_dim % 4 != 0 || data_slots + (data_slots + p.head_dim / 4 - 1) / (p.head_dim / 4) != kd[0])
        return ffi::Error::InvalidArgument("data_slots does not match the per-token cache");
      p.data_slots = data_slots;
    }
  }
  const int64_t num_layers = p.data_slots > 0 ? p.data_slots : kd[0];
  p.layer = std::clamp<int64_t>(layer_buf.typed_data()[0], 0, num_layers - 1);
  const int64_t window = window_buf.typed_data()[0];
  p.span = window > 0 ? window : (int64_t(1) << 40);
  p.scale = scale;
  p.softcap = softcap > 0.f ? softcap : 0.f;
  p.kv_lens = kv_lens.typed_data();
  p.tables = block_tables.typed_data();
  p.cu = cu_q_lens.typed_data();
  p.scales = nullptr;
  if constexpr (!std::is_same_v<C, T>) {
    if (scales.element_count() != 2 * p.num_kv_heads * p.head_dim)
      return ffi::Error::InvalidArgument(
          "a quantized cache needs scales [2, num_kv_heads, head_dim]");
    p.scales = scales.typed_data();
  }
  const int64_t max_seqs = td[0];
  const int64_t num_seqs = std::clamp<int64_t>(num_seqs_buf.typed_data()[0], 0, max_seqs);
  const T* qp = static_cast<const T*>(q.untyped_data());
  const C* kp = static_cast<const C*>(k_cache.untyped_data());
  const C* vp = static_cast<const C*>(v_cache.untyped_data());
  T* op = static_cast<T*>(out->untyped_data());
  const int64_t row = p.num_q_heads * p.head_dim;

  auto sh = std::make_shared<Shared>();
  std::vector<char> owned(p.num_tokens, 0);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t start = p.cu[s], end = p.cu[s + 1];
    if (start < 0 || end > p.num_tokens || end < start)
      return ffi::Error::InvalidArgument("cu_q_lens out of range");
    if (p.kv_lens[s] <= 0 || p.kv_lens[s] < end - start) continue;  // zeros
    for (int64_t t = start; t < end; ++t) owned[t] = 1;
    for (int64_t q0 = 0; q0 < end - start; q0 += kTileQ)
      for (int64_t h = 0; h < p.num_kv_heads; ++h)
        sh->items.push_back(Item{int32_t(s), int32_t(h), int32_t(q0),
                                 int32_t(std::min<int64_t>(kTileQ, end - start - q0))});
  }
  for (int64_t t = 0; t < p.num_tokens; ++t)
    if (!owned[t]) std::memset(op + t * row, 0, row * sizeof(T));
  // Longest items first: each tile's cost grows with its context.
  std::sort(sh->items.begin(), sh->items.end(), [&](const Item& a, const Item& b) {
    return p.kv_lens[a.seq] - (p.cu[a.seq + 1] - p.cu[a.seq]) + a.q0 + a.nq >
           p.kv_lens[b.seq] - (p.cu[b.seq + 1] - p.cu[b.seq]) + b.q0 + b.nq;
  });
  // As many helpers as the pool has threads, the calling thread besides (one fewer was
  // slightly slower in a development A/B of 256-decode model steps on 2 cores).
  const int64_t helpers =
      std::min<int64_t>(pool.num_threads(), static_cast<int64_t>(sh->items.size()) - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([sh, p, qp, kp, vp, op] {
      sh->active.fetch_add(1);
      work(sh, p, qp, kp, vp, op);
      sh->active.fetch_sub(1);
    });
  }
  work(sh, p, qp, kp, vp, op);
  // Every item is claimed; wait for helpers still running theirs. A helper that starts
  // later claims nothing.
  while (sh->active.load() > 0) std::this_thread::yield();
  return ffi::Error::Success();
}

template <typename T>
ffi::Error DispatchCache(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                         ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                         ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                         ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> scales,
                         ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                         int64_t data_slots) {
  const auto cd = k_cache.element_type();
#define PAGEDJAX_ATTEND(C)                                                                    \
  attend<T, C>(pool, q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, layer, \
               window, scales, out, scale, softcap, data_slots)
  if (cd == q.element_type()) return PAGEDJAX_ATTEND(T);
  if (cd == ffi::DataType::S8) return PAGEDJAX_ATTEND(int8_t);
  if (cd == ffi::DataType::F8E4M3FN) return PAGEDJAX_ATTEND(F8E4M3);
  if (cd == ffi::DataType::F8E5M2) return PAGEDJAX_ATTEND(F8E5M2);
#undef PAGEDJAX_ATTEND
  return ffi::Error::InvalidArgument(
      "k_cache must have q's dtype or be int8, float8_e4m3fn or float8_e5m2");
}

ffi::Error Dispatch(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                    ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                    ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                    ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> layer,
                    ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> scales,
                    ffi::Result<ffi::AnyBuffer> out, float scale, float softcap,
                    int64_t data_slots) {
  const auto dt = q.element_type();
  if (v_cache.element_type() != k_cache.element_type() || out->element_type() != dt)
    return ffi::Error::InvalidArgument("k_cache and v_cache, q and out must share a dtype");
  if (q.dimensions().size() != 3 || k_cache.dimensions().size() != 5 ||
      block_tables.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("expected q [T,Hq,D], caches [L,Hkv,N,bs,D], tables [S,M]");
  if (q.dimensions()[1] % k_cache.dimensions()[1] != 0)
    return ffi::Error::InvalidArgument("num_q_heads must be a multiple of num_kv_heads");
  if (dt == ffi::DataType::F32)
    return DispatchCache<float>(pool, q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens,
                                num_seqs, layer, window, scales, out, scale, softcap,
                                data_slots);
  if (dt == ffi::DataType::BF16)
    return DispatchCache<uint16_t>(pool, q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens,
                                   num_seqs, layer, window, scales, out, scale, softcap,
                                   data_slots);
  return ffi::Error::InvalidArgument("dtype must be float32 or bfloat16");
}

// write_kv for byte caches (FP8: XLA:CPU widens a float8 scatter's whole operand, ~50 ms a
// layer for the demo model's cache; int8 with per-token factors, whose factors it writes
// beside the values): copies each token's head rows of already-quantized bytes into their
// slots, in place (the caches are aliased to the results).
ffi::Error WriteKvBytes(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer k_cache_in,
                        ffi::AnyBuffer v_cache_in, ffi::Buffer<ffi::S32> slots,
                        ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::F32> k_factors,
                        ffi::Buffer<ffi::F32> v_factors, ffi::Result<ffi::AnyBuffer> k_cache,
                        ffi::Result<ffi::AnyBuffer> v_cache, int64_t data_slots) {
  auto kd = k.dimensions(), cd = k_cache->dimensions();
  if (kd.size() != 3 || cd.size() != 5 || ffi::ByteWidth(k.element_type()) != 1 ||
      ffi::ByteWidth(k_cache->element_type()) != 1)
    return ffi::Error::InvalidArgument("expected 1-byte k [T,Hkv,D] and caches [L,Hkv,N,bs,D]");
  const int64_t T = kd[0], H = kd[1], D = kd[2];
  const int64_t L = cd[0], N = cd[2], bs = cd[3];
  if (cd[1] != H || cd[4] != D) return ffi::Error::InvalidArgument("k does not match the cache");
  const int64_t per = D / 4;
  if (data_slots > 0 &&
      (D % 4 != 0 || data_slots + (data_slots + per - 1) / per != L ||
       k_factors.element_count() != T * H || v_factors.element_count() != T * H))
    return ffi::Error::InvalidArgument("token factors [T, Hkv] and data_slots must match the cache");
  const int64_t layer =
      std::clamp<int64_t>(layer_buf.typed_data()[0], 0, (data_slots > 0 ? data_slots : L) - 1);
  const int32_t* sl = slots.typed_data();
  const auto* ks = static_cast<const uint8_t*>(k.untyped_data());
  const auto* vs = static_cast<const uint8_t*>(v.untyped_data());
  auto* kc = static_cast<uint8_t*>(k_cache->untyped_data());
  auto* vc = static_cast<uint8_t*>(v_cache->untyped_data());
  // Aliased: results are the inputs' buffers (XLA copies first when it cannot alias).
  if (kc != k_cache_in.untyped_data())
    std::memcpy(kc, k_cache_in.untyped_data(), k_cache->size_bytes());
  if (vc != v_cache_in.untyped_data())
    std::memcpy(vc, v_cache_in.untyped_data(), v_cache->size_bytes());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = sl[t];
    if (slot < 0 || slot >= N * bs) continue;  // padding
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = ((layer * H + h) * N + slot / bs) * bs + slot % bs;
      std::memcpy(kc + row * D, ks + (t * H + h) * D, D);
      std::memcpy(vc + row * D, vs + (t * H + h) * D, D);
      if (data_slots > 0) {  // the token's factors, in its row of the factor slot
        const int64_t frow = (((data_slots + layer / per) * H + h) * N + slot / bs) * bs + slot % bs;
        std::memcpy(kc + frow * D + 4 * (layer % per), k_factors.typed_data() + t * H + h, 4);
        std::memcpy(vc + frow * D + 4 * (layer % per), v_factors.typed_data() + t * H + h, 4);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxWriteKvBytesCpu, WriteKvBytes,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // k [T, Hkv, D] bytes
                                  .Arg<ffi::AnyBuffer>()          // v
                                  .Arg<ffi::AnyBuffer>()          // k_cache (aliased)
                                  .Arg<ffi::AnyBuffer>()          // v_cache (aliased)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [T] (-1: padding)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k factors [T, Hkv] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v factors
                                  .Ret<ffi::AnyBuffer>()          // k_cache
                                  .Ret<ffi::AnyBuffer>()          // v_cache
                                  .Attr<int64_t>("data_slots"));  // 0: no token factors

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxRaggedPagedAttentionCpu, Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q [T, Hq, D]
                                  .Arg<ffi::AnyBuffer>()          // k_cache [L, Hkv, N, bs, D]
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [S, M]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // window [] (0: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales [2, Hkv, D] or [0]
                                  .Ret<ffi::AnyBuffer>()          // out [T, Hq, D]
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")         // 0: none
                                  .Attr<int64_t>("data_slots"));  // 0: no token factors
