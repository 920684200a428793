// This host's fp32 FMA peak: what no fp32 matmul on it can beat, so the floor under a batched
// decode step whose time is its weight matmuls (docs/v1-core.md, "How far fp32 can go here").
// Each thread runs ACC independent chains of 16-lane AVX-512 FMAs (8-lane AVX2 ones on a host
// without AVX-512) on registers (enough chains to cover the FMA latency on both pipes),
// nothing read from memory; GFLOP/s = 2 x lanes x FMAs.
//
//   g++ -O2 -march=native -std=c++17 -pthread bench/fma_peak.cc -o /tmp/fma_peak
//   /tmp/fma_peak THREADS SECONDS [bf16|int8]   (e.g. 1 2, then 2 2)
//
// With `bf16` (an AVX512-BF16 host): the same chains of `vdpbf16ps`, two bfloat16 products
// per lane and instruction (GFLOP/s = 2 x 32 x instructions), the instruction the screened
// LM head runs on (`pallas_kernels/csrc/lm_head_greedy_cpu.cc`). With `int8` (AVX512-VNNI):
// chains of `vpdpbusd`, four u8 x s8 products per lane and instruction (GOP/s = 2 x 64 x
// instructions), to see whether an 8-bit screen would outrun the bfloat16 one.

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kAcc = 12;  // independent accumulators: latency 4 x 2 pipes, with margin

// One round: kAcc FMAs per inner iteration, `iters` iterations. The multiplier is just below
// 1 and the addend tiny, so values stay finite and normal whatever the count.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float lane_sum(Vec v) { return _mm512_reduce_add_ps(v); }
#else  // AVX2 + FMA hosts (AMD Zen 2-3, Intel without AVX-512): 8-lane vectors
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float lane_sum(Vec v) {
  alignas(32) float o[8];
  _mm256_store_ps(o, v);
  float s = 0.f;
  for (float x : o) s += x;
  return s;
}
#endif

template <int kMode>  // 0 fp32 FMA, 1 vdpbf16ps, 2 vpdpbusd
float run(int64_t iters, float seed) {
  constexpr bool kBf16 = kMode == 1;
  Vec acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = splat(seed + i);
  const Vec m = splat(0.999999f), a = splat(1e-7f);
#if defined(__AVX512BF16__)
  // bfloat16 pairs (1, 1) and (1e-7, 1e-7): each instruction adds ~2e-7 per lane.
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const __m512bh y = (__m512bh)_mm512_set1_epi32(0x33d633d6);
#endif
#if defined(__AVX512VNNI__)
  if constexpr (kMode == 2) {
    __m512i ai[kAcc];
    for (int i = 0; i < kAcc; ++i) ai[i] = _mm512_set1_epi32(int(seed) + i);
    const __m512i u = _mm512_set1_epi32(0x01010101), v = _mm512_set1_epi32(0x01ff01ff);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < kAcc; ++i) ai[i] = _mm512_dpbusd_epi32(ai[i], u, v);
    }
    __m512i t = ai[0];
    for (int i = 1; i < kAcc; ++i) t = _mm512_add_epi32(t, ai[i]);
    return float(_mm512_reduce_add_epi32(t));
  }
#endif
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kAcc; ++i) {
      if constexpr (kBf16) {
#if defined(__AVX512BF16__)
        acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
#endif
      } else {
        acc[i] = fma(acc[i], m, a);
      }
    }
  }
  Vec s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = s + acc[i];
  return lane_sum(s);
}

}  // namespace

int main(int argc, char** argv) {
  const bool bf16 = argc == 4 && std::string(argv[3]) == "bf16";
  const bool int8 = argc == 4 && std::string(argv[3]) == "int8";
  if (argc != 3 && !bf16 && !int8) {
    std::fprintf(stderr, "usage: %s THREADS SECONDS [bf16|int8]\n", argv[0]);
    return 2;
  }
#if !defined(__AVX512BF16__)
  if (bf16) {
    std::fprintf(stderr, "this build has no AVX512-BF16\n");
    return 2;
  }
#endif
#if !defined(__AVX512VNNI__)
  if (int8) {
    std::fprintf(stderr, "this build has no AVX512-VNNI\n");
    return 2;
  }
#endif
  const int threads = std::atoi(argv[1]);
  const double seconds = std::atof(argv[2]);
  const int64_t chunk = int64_t(1) << 22;  // iterations between clock checks
  std::atomic<bool> stop{false};
  std::vector<int64_t> fmas(threads, 0);
  std::vector<float> sink(threads, 0.f);
  std::vector<std::thread> pool;
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      while (!stop.load(std::memory_order_relaxed)) {
        sink[t] += int8 ? run<2>(chunk, 1.f + t) : bf16 ? run<1>(chunk, 1.f + t) : run<0>(chunk, 1.f + t);
        fmas[t] += chunk * kAcc;
      }
    });
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  stop = true;
  for (auto& th : pool) th.join();
  const double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t total = 0;
  float s = 0.f;
  for (int t = 0; t < threads; ++t) {
    total += fmas[t];
    s += sink[t];
  }
  const double flop = (int8 ? 2.0 * 64 : bf16 ? 2.0 * 32 : 2.0 * kLanes) * total / el / 1e9;
  std::printf("threads %d  %.1f G%s/s %s (%.1f per thread)  [checksum %g]\n", threads, flop,
              int8 ? "OP" : "FLOP", int8 ? "int8 dot (vpdpbusd)" : bf16 ? "bf16 dot (vdpbf16ps)" : "fp32",
              flop / threads, s);
  return 0;
}
