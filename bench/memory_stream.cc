// How fast this host streams a buffer the size of the demo model's fp32 weights (538 MB) once
// per pass, as a batch-1 decode step reads them: THREADS threads each read their half (or
// share) front to back with AVX-512 loads (AVX2 ones on a host without AVX-512), on 2 MiB
// pages, with no software prefetch (0), prefetcht0 (1) or prefetchnta (2) 4 KiB ahead;
// prints the median pass after 5 untimed ones.
// The host's figure moves with the hour (53-84 GB/s on 2026-11-27; docs/v1-core.md).
//
//   g++ -O3 -march=native -std=c++17 -pthread bench/memory_stream.cc -o /tmp/memory_stream
//   /tmp/memory_stream MIB THREADS PREFETCH PASSES   (e.g. 538 2 0 40)

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s MIB THREADS PREFETCH(0|1|2) PASSES\n", argv[0]);
    return 2;
  }
  const size_t total = size_t(std::atol(argv[1])) << 20;
  const int threads = std::atoi(argv[2]), mode = std::atoi(argv[3]), passes = std::atoi(argv[4]);
  if (threads < 1 || passes < 6 || total < (size_t(threads) << 20)) return 2;
  float* buf = static_cast<float*>(std::aligned_alloc(size_t(2) << 20, total));
  madvise(buf, total, MADV_HUGEPAGE);
  for (size_t i = 0; i < total / 4; i += 1024) buf[i] = 1.f;  // fault every page in
  const size_t share = total / 4 / threads / 64 * 64;        // floats per thread
  std::vector<double> secs;
  std::vector<float> sink(threads);
  for (int p = 0; p < passes; ++p) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        const float* b = buf + t * share;
#if defined(__AVX512F__)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#else  // AVX2 hosts: two 8-lane loads per 16 floats
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#endif
        for (size_t i = 0; i < share; i += 64) {
          if (mode != 0 && i + 1024 < share) {
            const char* q = reinterpret_cast<const char*>(b + i + 1024);
            for (int l = 0; l < 4; ++l) {
              if (mode == 2)
                _mm_prefetch(q + 64 * l, _MM_HINT_NTA);
              else
                _mm_prefetch(q + 64 * l, _MM_HINT_T0);
            }
          }
#if defined(__AVX512F__)
          a0 = _mm512_add_ps(a0, _mm512_load_ps(b + i));
          a1 = _mm512_add_ps(a1, _mm512_load_ps(b + i + 16));
          a2 = _mm512_add_ps(a2, _mm512_load_ps(b + i + 32));
          a3 = _mm512_add_ps(a3, _mm512_load_ps(b + i + 48));
        }
        sink[t] += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
          for (int h = 0; h < 64; h += 32) {
            a0 = _mm256_add_ps(a0, _mm256_load_ps(b + i + h));
            a1 = _mm256_add_ps(a1, _mm256_load_ps(b + i + h + 8));
            a2 = _mm256_add_ps(a2, _mm256_load_ps(b + i + h + 16));
            a3 = _mm256_add_ps(a3, _mm256_load_ps(b + i + h + 24));
          }
        }
        alignas(32) float o[8];
        _mm256_store_ps(o, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (float x : o) sink[t] += x;
#endif
      });
    for (auto& th : pool) th.join();
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(secs.begin() + 5, secs.end());
  const double med = secs[5 + (passes - 5) / 2];
  const double bytes = double(share) * 4 * threads;
  std::printf("%.0f MB, %d threads, prefetch %s: median pass %.2f ms = %.1f GB/s (%g)\n",
              bytes / 1e6, threads, mode == 0 ? "none" : mode == 1 ? "t0" : "nta", med * 1e3,
              bytes / med / 1e9, double(sink[0]));
  std::free(buf);
  return 0;
}
