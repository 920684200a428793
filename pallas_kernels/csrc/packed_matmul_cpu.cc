// y[M, N] = x[M, K] @ w[K, N] for a packed weight (models/packed.py), as an XLA FFI call.
//
// Why native code: XLA can only dequantize a packed weight into a float copy and run its dot
// on the copy, which moves the full-precision weight through memory every step: on the demo
// model a batch-1 decode step ran 7x slower than the fp32 model. Here each weight row is
// widened in registers and used at once, so a step reads the packed bytes only.
//
// Codes and scales come in one of two layouts (the kernel tells them apart by rank):
// * canonical (models/packed.py): codes [K, N] (one code per byte; int8 when `is_signed`, else
//   uint8) or [K / 2, N] (two 4-bit codes per byte: in each 32-row group starting at k0, byte
//   row k0 / 2 + j holds row k0 + j in its low nibble and row k0 + 16 + j in its high one);
//   scale and offset [K / group, N] (float16 or float32); w[k, n] = code * scale + offset.
// * panels (`pallas_kernels.cpu_native.to_panels`): the same arrays cut into 64-column panels,
//   codes [N / 64, K or K / 2, 64], scale and offset [N / 64, K / group, 64] (N padded to a
//   multiple of 64). A panel's codes are one contiguous stream, which is what the hardware
//   prefetcher follows; canonical rows of one panel are N bytes apart, a new page every few
//   rows, and a decode step then waits on memory for every row (measured 4-6 GB/s vs ~20).
//
// Work items are 64-column panels over XLA's intra-op thread pool (the calling thread too).
// With AVX-512: up to 4 rows of x widen each code row in registers and use it at once, with
// scale and offset factored out of each group's sum (y += s * sum_k x_k q_k + o * sum_k x_k);
// more rows dequantize an L1-sized tile once for a 4 x 64 register-blocked kernel. Without
// AVX-512, a portable loop. Sums over K run in a fixed order: results are deterministic and
// differ from a float dot only by reassociation.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 64;  // output columns per work item (a panel)
constexpr int64_t kTileRows = 64;  // K rows dequantized at a time (16 KiB of fp32: L1)

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign << 31;
    } else {  // subnormal: normalise
      int e = -1;
      uint32_t m = mant;
      do {
        ++e;
        m <<= 1;
      } while ((m & 0x400) == 0);
      bits = (sign << 31) | ((127 - 15 - e) << 23) | ((m & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = (sign << 31) | 0x7F800000u | (mant << 13);
  } else {
    bits = (sign << 31) | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float bf16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float x) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct Problem {
  int64_t M, K, N, groups, group, code_rows;
  bool four_bit, is_signed, scale_f16, has_offset, panels;
  const uint8_t* codes;
  const void* scale;
  const void* offset;
  const float* x;  // [M, K] fp32 (bf16 inputs are widened first)
  float* y;        // [M, N]

  // Codes of panel b, code row r (64 bytes; `cols` of them valid); rows of a panel are
  // 64 bytes apart in panel layout, N bytes apart in the canonical one.
  const uint8_t* code_row(int64_t b, int64_t r) const {
    return panels ? codes + (b * code_rows + r) * kCols : codes + r * N + b * kCols;
  }
  int64_t param_at(int64_t b, int64_t g) const {  // element index of scale/offset (b, g, 0)
    return panels ? (b * groups + g) * kCols : g * N + b * kCols;
  }
  int64_t cols(int64_t b) const { return std::min(kCols, N - b * kCols); }
};

inline float read_param(const void* p, bool f16, int64_t i) {
  return f16 ? half_to_float(static_cast<const uint16_t*>(p)[i])
             : static_cast<const float*>(p)[i];
}

// Portable path: panel b, all rows of x, via a dequantized tile.
void panel_portable(const Problem& p, int64_t b, std::vector<float>& tile,
                    std::vector<float>& acc) {
  const int64_t nc = p.cols(b);
  tile.resize(kTileRows * kCols);
  acc.assign(p.M * kCols, 0.f);
  for (int64_t k0 = 0; k0 < p.K; k0 += kTileRows) {
    const int64_t kt = std::min(kTileRows, p.K - k0);
    for (int64_t r = 0; r < kt; ++r) {
      const int64_t k = k0 + r, g = k / p.group, at = p.param_at(b, g);
      float* t = tile.data() + r * kCols;
      const uint8_t* src;
      int shift = 0;
      if (p.four_bit) {
        const int64_t k32 = k & ~int64_t(31), j = k - k32;
        src = p.code_row(b, k32 / 2 + (j & 15));
        shift = j < 16 ? 0 : 4;
      } else {
        src = p.code_row(b, k);
      }
      for (int64_t c = 0; c < nc; ++c) {
        const float q = p.four_bit ? static_cast<float>((src[c] >> shift) & 15)
                        : p.is_signed ? static_cast<float>(static_cast<int8_t>(src[c]))
                                      : static_cast<float>(src[c]);
        t[c] = q * read_param(p.scale, p.scale_f16, at + c) +
               (p.has_offset ? read_param(p.offset, p.scale_f16, at + c) : 0.f);
      }
      for (int64_t c = nc; c < kCols; ++c) t[c] = 0.f;
    }
    for (int64_t m = 0; m < p.M; ++m) {
      float* a = acc.data() + m * kCols;
      const float* xr = p.x + m * p.K + k0;
      for (int64_t r = 0; r < kt; ++r)
        for (int64_t c = 0; c < kCols; ++c) a[c] += xr[r] * tile[r * kCols + c];
    }
  }
  for (int64_t m = 0; m < p.M; ++m)
    std::memcpy(p.y + m * p.N + b * kCols, acc.data() + m * kCols, nc * sizeof(float));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Wide {
  __m512 v[4];
};

inline __mmask64 byte_mask(int64_t nc) {
  return nc >= 64 ? ~__mmask64(0) : ((__mmask64(1) << nc) - 1);
}
inline __mmask16 lane_mask(int64_t nc, int i) {
  const int64_t left = nc - 16 * i;
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

inline Wide widen_bytes(__m512i b, bool is_signed) {
  Wide w;
  for (int i = 0; i < 4; ++i) {
    const __m128i q = _mm512_extracti32x4_epi32(b, i);
    w.v[i] = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q));
  }
  return w;
}

inline Wide load_params(const void* p, bool f16, int64_t at, int64_t nc) {
  Wide w;
  for (int i = 0; i < 4; ++i) {
    const __mmask16 m = lane_mask(nc, i);
    if (f16) {
      w.v[i] = _mm512_cvtph_ps(
          _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + at + 16 * i));
    } else {
      w.v[i] = _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + at + 16 * i);
    }
  }
  return w;
}

// The codes of code row r of panel b: rows (k0 + j, k0 + 16 + j) for 4-bit codes, row r for
// 8-bit ones; prefetches the row `ahead` rows on (canonical rows are N bytes apart).
inline void codes_at(const Problem& p, int64_t b, int64_t r, __mmask64 m, Wide& a, Wide& hi) {
  constexpr int64_t ahead = 64;
  if (r + ahead < p.code_rows)
    _mm_prefetch(reinterpret_cast<const char*>(p.code_row(b, r + ahead)), _MM_HINT_T0);
  const __m512i raw = _mm512_maskz_loadu_epi8(m, p.code_row(b, r));
  if (p.four_bit) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    a = widen_bytes(_mm512_and_si512(raw, nib), false);
    hi = widen_bytes(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nib), false);
  } else {
    a = widen_bytes(raw, p.is_signed);
  }
}

// Panel b for rows [m0, m0 + mr), mr <= 4: code rows widened as they are used.
void panel_direct(const Problem& p, int64_t b, int64_t m0, int64_t mr) {
  const int64_t nc = p.cols(b);
  const __mmask64 mask = byte_mask(nc);
  __m512 y[4][4];
  for (auto& row : y)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 s[4][4];
    for (auto& row : s)
      for (auto& v : row) v = _mm512_setzero_ps();
    const int64_t k_begin = g * p.group, k_end = k_begin + p.group;
    if (p.four_bit) {  // groups of 32 rows: byte rows k0 / 2 .. k0 / 2 + 15 hold both halves
      for (int64_t k0 = k_begin; k0 < k_end; k0 += 32)
        for (int64_t j = 0; j < 16; ++j) {
          Wide lo, hi;
          codes_at(p, b, k0 / 2 + j, mask, lo, hi);
          for (int64_t m = 0; m < mr; ++m) {
            const float* xr = p.x + (m0 + m) * p.K;
            const __m512 a = _mm512_set1_ps(xr[k0 + j]), c = _mm512_set1_ps(xr[k0 + 16 + j]);
            for (int i = 0; i < 4; ++i)
              s[m][i] = _mm512_fmadd_ps(c, hi.v[i], _mm512_fmadd_ps(a, lo.v[i], s[m][i]));
          }
        }
    } else {
      for (int64_t k = k_begin; k < k_end; ++k) {
        Wide w, unused;
        codes_at(p, b, k, mask, w, unused);
        for (int64_t m = 0; m < mr; ++m) {
          const __m512 a = _mm512_set1_ps(p.x[(m0 + m) * p.K + k]);
          for (int i = 0; i < 4; ++i) s[m][i] = _mm512_fmadd_ps(a, w.v[i], s[m][i]);
        }
      }
    }
    const int64_t at = p.param_at(b, g);
    const Wide sc = load_params(p.scale, p.scale_f16, at, nc);
    Wide off;
    if (p.has_offset) off = load_params(p.offset, p.scale_f16, at, nc);
    for (int64_t m = 0; m < mr; ++m) {
      float xs = 0.f;
      if (p.has_offset)
        for (int64_t k = k_begin; k < k_end; ++k) xs += p.x[(m0 + m) * p.K + k];
      for (int i = 0; i < 4; ++i) {
        y[m][i] = _mm512_fmadd_ps(s[m][i], sc.v[i], y[m][i]);
        if (p.has_offset) y[m][i] = _mm512_fmadd_ps(_mm512_set1_ps(xs), off.v[i], y[m][i]);
      }
    }
  }
  for (int64_t m = 0; m < mr; ++m)
    for (int i = 0; i < 4; ++i)
      _mm512_mask_storeu_ps(p.y + (m0 + m) * p.N + b * kCols + 16 * i, lane_mask(nc, i),
                            y[m][i]);
}

// Panel b for every row of x: a dequantized tile of kTileRows rows at a time, then a 4 x 64
// register-blocked kernel (16 accumulators) per chunk of 4 rows.
void panel_tiled(const Problem& p, int64_t b, std::vector<float>& tile, std::vector<float>& acc) {
  const int64_t nc = p.cols(b);
  const __mmask64 mask = byte_mask(nc);
  tile.resize(kTileRows * kCols);
  acc.assign(p.M * kCols, 0.f);
  for (int64_t k0 = 0; k0 < p.K; k0 += kTileRows) {
    const int64_t kt = std::min(kTileRows, p.K - k0);
    for (int64_t r = 0; r < kt; ++r) {
      const int64_t k = k0 + r, g = k / p.group;
      Wide w, hi;
      if (p.four_bit) {
        const int64_t k32 = k & ~int64_t(31), j = k - k32;
        codes_at(p, b, k32 / 2 + (j & 15), mask, w, hi);
        if (j >= 16) w = hi;
      } else {
        codes_at(p, b, k, mask, w, hi);
      }
      const int64_t at = p.param_at(b, g);
      const Wide sc = load_params(p.scale, p.scale_f16, at, nc);
      float* t = tile.data() + r * kCols;
      if (p.has_offset) {
        const Wide off = load_params(p.offset, p.scale_f16, at, nc);
        for (int i = 0; i < 4; ++i)
          _mm512_storeu_ps(t + 16 * i, _mm512_fmadd_ps(w.v[i], sc.v[i], off.v[i]));
      } else {
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(t + 16 * i, _mm512_mul_ps(w.v[i], sc.v[i]));
      }
    }
    int64_t m = 0;
    for (; m + 4 <= p.M; m += 4) {
      __m512 c[4][4];
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) c[q][i] = _mm512_loadu_ps(acc.data() + (m + q) * kCols + 16 * i);
      const float* x0 = p.x + m * p.K + k0;
      for (int64_t r = 0; r < kt; ++r) {
        const float* t = tile.data() + r * kCols;
        const __m512 w0 = _mm512_loadu_ps(t), w1 = _mm512_loadu_ps(t + 16),
                     w2 = _mm512_loadu_ps(t + 32), w3 = _mm512_loadu_ps(t + 48);
        for (int q = 0; q < 4; ++q) {
          const __m512 a = _mm512_set1_ps(x0[q * p.K + r]);
          c[q][0] = _mm512_fmadd_ps(a, w0, c[q][0]);
          c[q][1] = _mm512_fmadd_ps(a, w1, c[q][1]);
          c[q][2] = _mm512_fmadd_ps(a, w2, c[q][2]);
          c[q][3] = _mm512_fmadd_ps(a, w3, c[q][3]);
        }
      }
      for (int q = 0; q < 4; ++q)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc.data() + (m + q) * kCols + 16 * i, c[q][i]);
    }
    for (; m < p.M; ++m) {
      __m512 c[4];
      for (int i = 0; i < 4; ++i) c[i] = _mm512_loadu_ps(acc.data() + m * kCols + 16 * i);
      const float* x0 = p.x + m * p.K + k0;
      for (int64_t r = 0; r < kt; ++r) {
        const __m512 a = _mm512_set1_ps(x0[r]);
        const float* t = tile.data() + r * kCols;
        for (int i = 0; i < 4; ++i) c[i] = _mm512_fmadd_ps(a, _mm512_loadu_ps(t + 16 * i), c[i]);
      }
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc.data() + m * kCols + 16 * i, c[i]);
    }
  }
  for (int64_t m = 0; m < p.M; ++m)
    std::memcpy(p.y + m * p.N + b * kCols, acc.data() + m * kCols, nc * sizeof(float));
}
#endif

void run_panel(const Problem& p, int64_t b, std::vector<float>& tile, std::vector<float>& acc) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (p.M <= 4) {
    panel_direct(p, b, 0, p.M);
  } else {
    panel_tiled(p, b, tile, acc);
  }
#else
  panel_portable(p, b, tile, acc);
#endif
}

// Shared by the calling thread and pool tasks; heap-held so a task that starts after the work
// is done (and finds nothing to claim) never touches a dead stack frame.
struct Shared {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> active{0};
};

void work(const std::shared_ptr<Shared>& sh, const Problem& p, int64_t panels) {
  std::vector<float> tile, acc;
  for (int64_t b = sh->next.fetch_add(1); b < panels; b = sh->next.fetch_add(1))
    run_panel(p, b, tile, acc);
}

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer codes,
                        ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                        ffi::Result<ffi::AnyBuffer> y, bool is_signed) {
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions(),
       yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("expected x [M, K] and y [M, N]");
  Problem p;
  p.M = xd[0];
  p.K = xd[1];
  p.N = yd[1];
  p.panels = cd.size() == 3;
  if (p.panels) {  // [N / 64, rows, 64] and [N / 64, G, 64], N padded to 64
    if (sd.size() != 3 || cd[2] != kCols || sd[2] != kCols || cd[0] != sd[0] ||
        cd[0] * kCols < p.N)
      return ffi::Error::InvalidArgument("panels: codes [P, rows, 64], scale [P, G, 64]");
    p.code_rows = cd[1];
    p.groups = sd[1];
  } else {
    if (cd.size() != 2 || sd.size() != 2 || cd[1] != p.N || sd[1] != p.N)
      return ffi::Error::InvalidArgument("expected codes [rows, N] and scale [G, N]");
    p.code_rows = cd[0];
    p.groups = sd[0];
  }
  if (p.groups <= 0 || p.K % p.groups)
    return ffi::Error::InvalidArgument("scale must have K / group rows");
  p.group = p.K / p.groups;
  if (p.code_rows == p.K) {
    p.four_bit = false;
  } else if (p.code_rows * 2 == p.K && p.K % 32 == 0 && p.group % 32 == 0) {
    p.four_bit = true;
  } else {
    return ffi::Error::InvalidArgument("codes rows must be K (8-bit) or K / 2 (4-bit)");
  }
  const auto st = scale.element_type();
  if (st != ffi::DataType::F16 && st != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("scale must be float16 or float32");
  p.scale_f16 = st == ffi::DataType::F16;
  p.has_offset = offset.element_count() > 0;
  if (p.has_offset && (offset.element_type() != st ||
                       offset.element_count() != scale.element_count()))
    return ffi::Error::InvalidArgument("offset must match scale (or be empty)");
  p.is_signed = is_signed;
  p.codes = static_cast<const uint8_t*>(codes.untyped_data());
  p.scale = scale.untyped_data();
  p.offset = offset.untyped_data();
  const auto xt = x.element_type();
  if (y->element_type() != xt || (xt != ffi::DataType::F32 && xt != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("x and y must both be float32 or bfloat16");
  std::vector<float> xf, yf;
  if (xt == ffi::DataType::F32) {
    p.x = static_cast<const float*>(x.untyped_data());
    p.y = static_cast<float*>(y->untyped_data());
  } else {
    const auto* xb = static_cast<const uint16_t*>(x.untyped_data());
    xf.resize(p.M * p.K);
    for (int64_t i = 0; i < p.M * p.K; ++i) xf[i] = bf16_to_float(xb[i]);
    yf.resize(p.M * p.N);
    p.x = xf.data();
    p.y = yf.data();
  }
  const int64_t panels = (p.N + kCols - 1) / kCols;
  auto sh = std::make_shared<Shared>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), panels - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([sh, p, panels] {
      sh->active.fetch_add(1);
      work(sh, p, panels);
      sh->active.fetch_sub(1);
    });
  }
  work(sh, p, panels);
  while (sh->active.load() > 0) std::this_thread::yield();
  if (xt == ffi::DataType::BF16) {
    auto* yb = static_cast<uint16_t*>(y->untyped_data());
    for (int64_t i = 0; i < p.M * p.N; ++i) yb[i] = float_to_bf16(yf[i]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxPackedMatmulCpu, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()   // x [M, K] f32 / bf16
                                  .Arg<ffi::AnyBuffer>()   // codes (canonical or panels)
                                  .Arg<ffi::AnyBuffer>()   // scale (f16 / f32)
                                  .Arg<ffi::AnyBuffer>()   // offset (as scale) or [0]
                                  .Ret<ffi::AnyBuffer>()   // y [M, N]
                                  .Attr<bool>("is_signed"));
