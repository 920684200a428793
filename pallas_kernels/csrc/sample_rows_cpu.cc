// Sampled tokens for float32 logits rows, as an XLA FFI call
// (`pallas_kernels.cpu_native.sample_rows_cpu`, behind `pagedjax.sampler.sample(native=True)`):
// for each listed row of the step's logits, the logits processing (penalties, logit bias,
// bans, allowed-token bitmask), then temperature, top-k, top-p, min-p and a Gumbel-max draw
// with the row's threefry key, and the chosen token's raw logprob and rank with the raw row's
// max and log-sum-exp (no [B, V] gather or log-softmax is written: XLA's took ~55 ms of a
// 256-row call on this project's 2-core host, the gather ~23 and the two reductions ~31).
//
// Why native code: XLA has only batch-wide control flow, so one row whose nucleus is wider than
// the sampler's top-128 candidates sends every row of the step to an exact threshold search
// (32 bisection passes over [B, V]) and to Gumbel noise over the whole vocabulary (threefry
// and two logs per entry): ~100 ms of a 64-row step on this project's 2-core host, where the
// model takes ~110. Here each row pays for itself only: its threshold comes from a histogram of
// the row's probability mass (one pass, then a sort of the few values near the cut), and noise
// is drawn only for entries that are kept and could still win the draw (a Gumbel value lies in
// [-4.47, 15.95], so an entry 16 or more below the best score so far cannot win).
//
// XLA also spent ~11 ms of a penalised 64-row step on the processing: two [B, V] scratch
// arrays scattered into (counts, seen) and passes over them; here only the listed tokens of a
// row change, in a private copy of the row that the cut and the draw then read from L2.
//
// Same definitions as `pagedjax.sampler.sample` (whose tokens the tests compare): the row is
// processed in its order (`penalize`, then bias, bans, bitmask); greedy rows
// (temperature < eps) take the first maximum of the processed row; the others scale by
// 1 / temperature, keep values >= the largest of the k-th largest value (top-k), the smallest
// value v with mass(> v) < top_p * mass(top-k) <= mass(>= v) (top-p; ties of v are kept), and
// row max + log(min_p) (min-p); and take the first index maximising kept + Gumbel noise, the
// noise being `jax.random.gumbel(key, (V,))`'s: threefry2x32(key, (0, i)), both words xored,
// as `jax.random.uniform` turns bits into floats. The masses are summed in double here and in
// float by XLA, and the logs differ by an ulp, so a row whose cut or draw is decided within
// float rounding may differ; elsewhere the tokens are the same. A row holding a NaN takes its
// first NaN (as greedy rows do), a row of all -inf index 0.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "row_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerItem = 1;  // a sampled row: ~20-150 us
constexpr int64_t kMinRowsForHelpers = 2;
// Mass histogram over d = row max - value: kBins bins of width 1 / kScale, the last one
// holding every d past (kBins - 1) / kScale (mass below e^-31 of the maximum's).
constexpr int kScale = 128;
constexpr int kBins = 4096;
// Bounds of the float Gumbel values: u in [tiny, 1 - 2^-23] gives -log(-log(u)) in
// [-4.4699, 15.9424]; the margins cover the logs' rounding.
constexpr float kGumbelMax = 16.0f;

// A [B, W] int32 or float32 per-row list (W may be 0: absent).
template <class T>
struct List {
  const T* data;
  int64_t width;
  const T* row(int64_t m) const { return data + m * width; }
};

struct Rows {
  int64_t B, V;
  const float* x;      // the step's logits [T, V]
  const int32_t* src;  // [B]: the logits row each sampled row reads, in [0, T)
  const float* temp;
  const int32_t* top_k;
  const float* top_p;
  const float* log_min_p;
  const uint32_t* keys;  // [B, 2]
  // What changes the logits before the cut, in `sample`'s order: penalties over the prompt
  // and output ids, logit bias, banned ids, an allowed-token bitmask; -1 ids are padding.
  List<int32_t> prompt_ids, output_ids, bias_ids, banned_ids, bitmask;
  List<float> bias_values;
  const float* presence;
  const float* frequency;
  const float* repetition;
  float greedy_eps;
  int32_t* tok;
  float* lp;
  int32_t* rank;
  // The raw rows' max and log(sum(exp(x - max))): with them XLA computes top logprobs the way
  // the chosen token's is computed here, (x - max) - lse.
  float* raw_max;
  float* raw_lse;
};

inline const float* raw_row(const Rows& p, int64_t m) { return p.x + int64_t(p.src[m]) * p.V; }

inline uint32_t ordered(float f) {  // unsigned keys that order like the floats (NaN excepted)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

inline float unordered(uint32_t k) {
  const uint32_t u = (k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The k-th largest value of xs[0, V) (1 <= k <= V), by radix selection over its ordered keys:
// three passes of 11, 11 and 10 bits, each counting the entries that share the prefix found.
float kth_largest(const float* xs, int64_t V, int64_t k, std::vector<uint32_t>& count) {
  uint32_t prefix = 0, prefix_mask = 0;
  int64_t left = k;  // rank still to find among entries matching the prefix
  const int shifts[3] = {21, 10, 0};
  const int widths[3] = {11, 11, 10};
  for (int pass = 0; pass < 3; ++pass) {
    const int sh = shifts[pass];
    const uint32_t nb = 1u << widths[pass];
    count.assign(nb, 0);
    for (int64_t i = 0; i < V; ++i) {
      const uint32_t key = ordered(xs[i]);
      if ((key & prefix_mask) == prefix) ++count[(key >> sh) & (nb - 1)];
    }
    uint32_t b = nb;
    while (b-- > 0) {
      if (int64_t(count[b]) >= left) break;
      left -= count[b];
    }
    prefix |= b << sh;
    prefix_mask |= (nb - 1) << sh;
  }
  return unordered(prefix);
}

// exp(v - top) for v <= top, in float: the vector polynomial where there is one, so that the
// histogram and the walk below give a value the same mass.
inline float mass_of(float v, float top) {
#if defined(__AVX512F__)
  return _mm512_cvtss_f32(pagedjax_rows::exp_nonpositive(_mm512_set1_ps(v - top)));
#else
  return std::exp(v - top);
#endif
}

// The top-p cut: the smallest value v with mass(> v) < p * total <= mass(>= v), each value's
// mass exp(v - top), values under `floor` (top-k's cut) having none. A histogram of the mass
// over d = top - v in bins of 1 / kScale finds the bin holding the cut (every value of a bin
// exceeds every value of the next); that bin's values, sorted, give it.
float top_p_cut(const float* xs, int64_t V, float top, float floor, float top_p,
                std::vector<double>& mass, std::vector<float>& near) {
  mass.assign(kBins, 0.0);
  auto bin = [top](float v) {
    const float d = (top - v) * float(kScale);
    return d < float(kBins - 1) ? int(d) : kBins - 1;
  };
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(top), f = _mm512_set1_ps(floor);
  alignas(64) float e[16];
  alignas(64) int32_t bi[16];
  for (int64_t v = 0; v < V; v += 16) {
    const __m512 xv = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                           pagedjax_rows::tail_mask(V - v), xs + v);
    const __mmask16 kept = _mm512_cmp_ps_mask(xv, f, _CMP_GE_OQ);
    if (!kept) continue;
    _mm512_store_ps(e, _mm512_maskz_mov_ps(kept, pagedjax_rows::exp_nonpositive(
                                                     _mm512_sub_ps(xv, t))));
    const __m512 d = _mm512_min_ps(_mm512_mul_ps(_mm512_sub_ps(t, xv), _mm512_set1_ps(kScale)),
                                   _mm512_set1_ps(float(kBins - 1)));
    _mm512_store_si512(bi, _mm512_cvttps_epi32(d));
    for (int l = 0; l < 16; ++l) mass[bi[l]] += e[l];
  }
#else
  for (int64_t i = 0; i < V; ++i)
    if (xs[i] >= floor) mass[bin(xs[i])] += mass_of(xs[i], top);
#endif
  double total = 0.0;
  for (int b = 0; b < kBins; ++b) total += mass[b];
  const double want = double(top_p) * total;
  double above = 0.0;  // mass of the bins before b
  int b = 0;
  for (; b < kBins - 1; ++b) {
    if (above + mass[b] >= want) break;
    above += mass[b];
  }
  near.clear();
  for (int64_t i = 0; i < V; ++i)
    if (xs[i] >= floor && bin(xs[i]) == b) near.push_back(xs[i]);
  std::sort(near.begin(), near.end(), [](float a, float c) { return a > c; });
  for (size_t i = 0; i < near.size();) {
    const float v = near[i];
    size_t j = i;
    while (j < near.size() && near[j] == v) ++j;
    const double tied = double(j - i) * mass_of(v, top);
    if (above + tied >= want) return v;  // and above < want: the mass of everything before v
    above += tied;
    i = j;
  }
  return near.empty() ? floor : near.back();  // rounding left the cut past the bin
}

#if defined(__AVX512F__)
inline __m512i rotl(__m512i x, int r) {
  switch (r) {  // vprold takes an immediate
    case 13: return _mm512_rol_epi32(x, 13);
    case 15: return _mm512_rol_epi32(x, 15);
    case 26: return _mm512_rol_epi32(x, 26);
    case 6: return _mm512_rol_epi32(x, 6);
    case 17: return _mm512_rol_epi32(x, 17);
    case 29: return _mm512_rol_epi32(x, 29);
    case 16: return _mm512_rol_epi32(x, 16);
    default: return _mm512_rol_epi32(x, 24);
  }
}

// threefry2x32(key, (0, i)) for 16 consecutive i: both output words xored, as
// `jax.random.bits` gives them with partitionable keys.
inline __m512i threefry_bits(uint32_t k0, uint32_t k1, __m512i i) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  const uint32_t ks[3] = {k0, k1, k2};
  static constexpr int rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  __m512i x0 = _mm512_set1_epi32(int(k0));
  __m512i x1 = _mm512_add_epi32(i, _mm512_set1_epi32(int(k1)));
  for (int g = 0; g < 5; ++g) {
    for (int r = 0; r < 4; ++r) {
      x0 = _mm512_add_epi32(x0, x1);
      x1 = _mm512_xor_si512(rotl(x1, rot[g & 1][r]), x0);
    }
    x0 = _mm512_add_epi32(x0, _mm512_set1_epi32(int(ks[(g + 1) % 3])));
    x1 = _mm512_add_epi32(x1, _mm512_set1_epi32(int(ks[(g + 2) % 3] + uint32_t(g + 1))));
  }
  return _mm512_xor_si512(x0, x1);
}

// `jax.random.gumbel`'s values from the bits: a float in [1, 2) minus one, zero raised to
// float's smallest normal, then -log(-log(u)).
inline __m512 gumbel(__m512i bits) {
  const __m512 f = _mm512_sub_ps(
      _mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(bits, 9),
                                          _mm512_set1_epi32(0x3F800000))),
      _mm512_set1_ps(1.0f));
  const __m512 u = _mm512_max_ps(f, _mm512_set1_ps(std::numeric_limits<float>::min()));
  const __m512 nlog = _mm512_sub_ps(_mm512_setzero_ps(), pagedjax_rows::log_positive(u));
  return _mm512_sub_ps(_mm512_setzero_ps(), pagedjax_rows::log_positive(nlog));
}

// The first index maximising xs + noise over kept values (>= cut), drawing noise only for
// 16-value chunks where some kept value could still reach the best score.
int32_t draw(const float* xs, int64_t V, float cut, uint32_t k0, uint32_t k1) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float best = ninf;
  int32_t best_i = 0;
  __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 c = _mm512_set1_ps(cut);
  for (int64_t v = 0; v < V; v += 16, at = _mm512_add_epi32(at, _mm512_set1_epi32(16))) {
    const __m512 xv = _mm512_mask_loadu_ps(_mm512_set1_ps(ninf), pagedjax_rows::tail_mask(V - v),
                                           xs + v);
    // Could win: kept, and its best possible score not below the best (ties go to the first
    // index, so an equal later score cannot win either; rounding is monotone).
    const __mmask16 live =
        _mm512_cmp_ps_mask(xv, c, _CMP_GE_OQ) &
        _mm512_cmp_ps_mask(_mm512_add_ps(xv, _mm512_set1_ps(kGumbelMax)), _mm512_set1_ps(best),
                           _CMP_GT_OQ);
    if (!live) continue;
    const __m512 score = _mm512_mask_add_ps(_mm512_set1_ps(ninf), live, xv,
                                            gumbel(threefry_bits(k0, k1, at)));
    const float top = _mm512_reduce_max_ps(score);
    if (top > best) {
      best = top;
      const __mmask16 hit = _mm512_cmp_ps_mask(score, _mm512_set1_ps(top), _CMP_EQ_OQ);
      best_i = int32_t(v) + int32_t(__builtin_ctz(uint32_t(hit)));
    }
  }
  return best_i;
}
#else
uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

int32_t draw(const float* xs, int64_t V, float cut, uint32_t k0, uint32_t k1) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  const uint32_t ks[3] = {k0, k1, k2};
  static constexpr int rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  float best = -std::numeric_limits<float>::infinity();
  int32_t best_i = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (!(xs[i] >= cut) || !(xs[i] + kGumbelMax > best)) continue;
    uint32_t x0 = k0, x1 = uint32_t(i) + k1;
    for (int g = 0; g < 5; ++g) {
      for (int r = 0; r < 4; ++r) {
        x0 += x1;
        x1 = rotl32(x1, rot[g & 1][r]) ^ x0;
      }
      x0 += ks[(g + 1) % 3];
      x1 += ks[(g + 2) % 3] + uint32_t(g + 1);
    }
    const uint32_t bits = ((x0 ^ x1) >> 9) | 0x3F800000u;
    float f;
    std::memcpy(&f, &bits, 4);
    const float u = std::max(f - 1.0f, std::numeric_limits<float>::min());
    const float s = xs[i] + -std::log(-std::log(u));
    if (s > best) {
      best = s;
      best_i = int32_t(i);
    }
  }
  return best_i;
}
#endif

struct Scratch {
  std::vector<float> xs;
  std::vector<uint32_t> count;
  std::vector<double> mass;
  std::vector<float> near;
  std::vector<int32_t> seen;     // per token: output count + 1 once seen, else 0 (kept zeroed)
  std::vector<int32_t> touched;  // the tokens whose `seen` entry this row set
};

// vLLM's penalties, as `pagedjax.sampler.apply_penalties` applies them: repetition over the
// prompt and output ids (divide a positive logit, multiply a negative one), then frequency
// times the output count and presence once over the output ids. Only the listed tokens
// change, so the cost is the lists', not the vocabulary's.
void penalize(const Rows& p, int64_t m, float* xs, Scratch& s) {
  const int64_t V = p.V;
  int32_t* seen = s.seen.data();
  s.touched.clear();
  const int32_t* out = p.output_ids.row(m);
  for (int64_t j = 0; j < p.output_ids.width; ++j) {
    const int32_t t = out[j];
    if (t < 0 || t >= V) continue;
    if (seen[t] == 0) {
      s.touched.push_back(t);
      seen[t] = 1;
    }
    ++seen[t];
  }
  const int32_t* prompt = p.prompt_ids.row(m);
  for (int64_t j = 0; j < p.prompt_ids.width; ++j) {
    const int32_t t = prompt[j];
    if (t < 0 || t >= V || seen[t]) continue;
    s.touched.push_back(t);
    seen[t] = 1;
  }
  const float rep = p.repetition[m], freq = p.frequency[m], pres = p.presence[m];
  for (const int32_t t : s.touched) {
    const float count = float(seen[t] - 1);
    const float v = xs[t];
    const float r = v > 0.0f ? v / rep : v * rep;
    const float f = freq * count;
    const float q = pres * (count > 0.0f ? 1.0f : 0.0f);
    xs[t] = (r - f) - q;
    seen[t] = 0;
  }
}

// The row's processed logits into xs: penalties, bias, bans, then the bitmask.
void process(const Rows& p, int64_t m, float* xs, Scratch& s) {
  const float ninf = -std::numeric_limits<float>::infinity();
  std::memcpy(xs, raw_row(p, m), sizeof(float) * p.V);
  if (p.output_ids.width || p.prompt_ids.width) penalize(p, m, xs, s);
  for (int64_t j = 0; j < p.bias_ids.width; ++j) {
    const int32_t t = p.bias_ids.row(m)[j];
    if (t >= 0 && t < p.V) xs[t] += p.bias_values.row(m)[j];
  }
  for (int64_t j = 0; j < p.banned_ids.width; ++j) {
    const int32_t t = p.banned_ids.row(m)[j];
    if (t >= 0 && t < p.V) xs[t] = ninf;
  }
  if (p.bitmask.width) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(p.bitmask.row(m));
    for (int64_t t = 0; t < p.V; ++t)
      if (!((words[t >> 5] >> (t & 31)) & 1u)) xs[t] = ninf;
  }
}

int32_t first_max(const float* x, int64_t V, float& top) {
#if defined(__AVX512F__)
  int32_t idx = 0;
  pagedjax_rows::first_max(x, V, idx, top);
  return idx;
#else
  top = -std::numeric_limits<float>::infinity();
  int32_t arg = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (x[i] != x[i]) {
      top = x[i];
      return int32_t(i);
    }
    if (x[i] > top) {
      top = x[i];
      arg = int32_t(i);
    }
  }
  return arg;
#endif
}

// The raw row's max and lse = log(sum(exp(x - max))) (summed in double: closer to the exact
// value than XLA's float tree sum, ~1e-7 apart), then the raw logprob of token t,
// (x_t - max) - lse, and its rank: one more than the number of raw logprobs above it, each
// computed with the same two float subtractions as `log_softmax`'s (the barriers keep the
// compiler from folding them into x - (max + lse)). A row holding a NaN, or whose maximum is
// infinite, gets a NaN lse, as XLA's formula gives.
void logprob_and_rank(const Rows& p, int64_t m) {
  const float* x = raw_row(p, m);
  float mx;
  double sum;
#if defined(__AVX512F__)
  int32_t unused;
  if (pagedjax_rows::first_max(x, p.V, unused, mx)) {
    sum = pagedjax_rows::sum_exp_below(x, p.V, mx);
  } else {
    mx = sum = std::numeric_limits<float>::quiet_NaN();
  }
#else
  mx = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < p.V; ++i) {
    nan |= x[i] != x[i];
    mx = std::max(mx, x[i]);
  }
  if (nan) mx = std::numeric_limits<float>::quiet_NaN();  // and the sum below is NaN
  sum = 0.0;
  for (int64_t i = 0; i < p.V; ++i) sum += std::exp(double(x[i] - mx));
#endif
  const float lse = float(std::log(sum));
  p.raw_max[m] = mx;
  p.raw_lse[m] = lse;
  const int32_t t = p.tok[m];
  float shifted = x[t] - mx;
  asm("" : "+x"(shifted));
  const float lp = shifted - lse;
  p.lp[m] = lp;
  int64_t above = 0;
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx), vlse = _mm512_set1_ps(lse), vlp = _mm512_set1_ps(lp);
  for (int64_t v = 0; v < p.V; v += 16) {
    const __mmask16 k = pagedjax_rows::tail_mask(p.V - v);
    __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + v), vmx);
    asm("" : "+v"(d));
    above += __builtin_popcount(
        uint32_t(_mm512_mask_cmp_ps_mask(k, _mm512_sub_ps(d, vlse), vlp, _CMP_GT_OQ)));
  }
#else
  for (int64_t i = 0; i < p.V; ++i) {
    float d = x[i] - mx;
    asm("" : "+x"(d));
    above += (d - lse) > lp;
  }
#endif
  p.rank[m] = int32_t(above + 1);
}

void sample_row(const Rows& p, int64_t m, Scratch& s) {
  const float t = p.temp[m];
  const bool plain = !p.output_ids.width && !p.prompt_ids.width && !p.bias_ids.width &&
                     !p.banned_ids.width && !p.bitmask.width;
  const float* x = raw_row(p, m);
  float* xs = s.xs.data();
  if (!plain) {
    process(p, m, xs, s);
    x = xs;
  }
  float top;
  if (!(t >= p.greedy_eps)) {  // greedy: the processed row's first maximum
    p.tok[m] = first_max(x, p.V, top);
    return;
  }
  for (int64_t i = 0; i < p.V; ++i) xs[i] = x[i] / t;
  const int32_t arg = first_max(xs, p.V, top);
  if (std::isnan(top) || top == -std::numeric_limits<float>::infinity() ||
      top == std::numeric_limits<float>::infinity()) {
    p.tok[m] = arg;  // a NaN, all -inf, or an infinite logit: the first of them
    return;
  }
  const int64_t k = std::clamp<int64_t>(p.top_k[m], 1, p.V);
  float cut = k < p.V ? kth_largest(xs, p.V, k, s.count)
                      : -std::numeric_limits<float>::infinity();
  if (p.top_p[m] < 1.0f) cut = top_p_cut(xs, p.V, top, cut, p.top_p[m], s.mass, s.near);
  cut = std::max(cut, top + p.log_min_p[m]);
  p.tok[m] = draw(xs, p.V, cut, p.keys[2 * m], p.keys[2 * m + 1]);
}

void row(const Rows& p, int64_t m, Scratch& s) {
  sample_row(p, m, s);
  logprob_and_rank(p, m);
}

ffi::Error SampleRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> src,
                     ffi::Buffer<ffi::F32> temp,
                     ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p,
                     ffi::Buffer<ffi::F32> log_min_p, ffi::Buffer<ffi::U32> keys,
                     ffi::Buffer<ffi::S32> prompt_ids, ffi::Buffer<ffi::S32> output_ids,
                     ffi::Buffer<ffi::F32> presence, ffi::Buffer<ffi::F32> frequency,
                     ffi::Buffer<ffi::F32> repetition, ffi::Buffer<ffi::S32> bias_ids,
                     ffi::Buffer<ffi::F32> bias_values, ffi::Buffer<ffi::S32> banned_ids,
                     ffi::Buffer<ffi::S32> bitmask, float greedy_eps,
                     ffi::Result<ffi::Buffer<ffi::S32>> tok, ffi::Result<ffi::Buffer<ffi::F32>> lp,
                     ffi::Result<ffi::Buffer<ffi::S32>> rank,
                     ffi::Result<ffi::Buffer<ffi::F32>> raw_max,
                     ffi::Result<ffi::Buffer<ffi::F32>> raw_lse) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("expected logits [T, V]");
  const int64_t T = xd[0], V = xd[1];
  if (V < 1) return ffi::Error::InvalidArgument("logits need at least one column");
  if (src.dimensions().size() != 1) return ffi::Error::InvalidArgument("expected rows [B]");
  const int64_t B = src.dimensions()[0];
  for (int64_t m = 0; m < B; ++m)
    if (src.typed_data()[m] < 0 || src.typed_data()[m] >= T)
      return ffi::Error::InvalidArgument("rows must lie in [0, T), the logits' rows");
  auto is_rows = [B](auto dims) { return dims.size() == 1 && dims[0] == B; };
  if (!is_rows(temp.dimensions()) || !is_rows(top_k.dimensions()) ||
      !is_rows(top_p.dimensions()) || !is_rows(log_min_p.dimensions()) ||
      !is_rows(tok->dimensions()) || keys.dimensions().size() != 2 ||
      keys.dimensions()[0] != B || keys.dimensions()[1] != 2)
    return ffi::Error::InvalidArgument(
        "expected temperature, top_k, top_p, log_min_p and tokens [B], keys [B, 2]");
  if (!is_rows(presence.dimensions()) || !is_rows(frequency.dimensions()) ||
      !is_rows(repetition.dimensions()) || !is_rows(raw_max->dimensions()) ||
      !is_rows(raw_lse->dimensions()) || !is_rows(lp->dimensions()) ||
      !is_rows(rank->dimensions()))
    return ffi::Error::InvalidArgument("expected penalties, raw max and lse, logprobs and "
                                       "ranks [B]");
  auto is_list = [B](auto dims) { return dims.size() == 2 && dims[0] == B; };
  if (!is_list(prompt_ids.dimensions()) || !is_list(output_ids.dimensions()) ||
      !is_list(bias_ids.dimensions()) || !is_list(bias_values.dimensions()) ||
      !is_list(banned_ids.dimensions()) || !is_list(bitmask.dimensions()) ||
      bias_values.dimensions()[1] != bias_ids.dimensions()[1])
    return ffi::Error::InvalidArgument("expected id lists, bias values and bitmask [B, W]");
  if (bitmask.dimensions()[1] && bitmask.dimensions()[1] * 32 < V)
    return ffi::Error::InvalidArgument("the bitmask needs V / 32 words a row");
  auto list = [](auto& b) {
    return List<std::remove_const_t<std::remove_pointer_t<decltype(b.typed_data())>>>{
        b.typed_data(), b.dimensions()[1]};
  };
  const Rows p{B, V, x.typed_data(), src.typed_data(), temp.typed_data(), top_k.typed_data(),
               top_p.typed_data(), log_min_p.typed_data(), keys.typed_data(),
               list(prompt_ids), list(output_ids), list(bias_ids), list(banned_ids),
               list(bitmask), list(bias_values), presence.typed_data(),
               frequency.typed_data(), repetition.typed_data(), greedy_eps, tok->typed_data(),
               lp->typed_data(), rank->typed_data(), raw_max->typed_data(),
               raw_lse->typed_data()};
  pagedjax_rows::for_rows(pool, B, kRowsPerItem, kMinRowsForHelpers, [p] {
    auto s = std::make_shared<Scratch>();
    s->xs.resize(p.V);
    if (p.output_ids.width || p.prompt_ids.width) s->seen.assign(p.V, 0);
    return [p, s](int64_t m) { row(p, m, *s); };
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxSampleRowsCpu, SampleRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // the step's logits [T, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows sampled [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // temperature [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // top_k [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // top_p [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // log(min_p) [B]
                                  .Arg<ffi::Buffer<ffi::U32>>()  // threefry keys [B, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // prompt ids [B, Lp]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // output ids [B, Lo]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // presence penalty [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // frequency penalty [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // repetition penalty [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // logit bias ids [B, Wb]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logit bias values [B, Wb]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // banned ids [B, S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // allowed bitmask [B, W]
                                  .Attr<float>("greedy_eps")
                                  .Ret<ffi::Buffer<ffi::S32>>()   // tokens [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // their raw logprobs [B]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // their ranks [B]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // raw rows' max [B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // raw rows' lse [B]
