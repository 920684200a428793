// How fast this host's memory answers the CPU attention's access pattern: chunks of CHUNK
// bytes (a 4 KiB K or V block per (layer, head) at the demo model's shapes) at random places
// in a 1.5 GB buffer (a KV cache), STREAMS chunks read side by side per thread (K and V: 2),
// on 4 KiB or 2 MiB pages. The figures in docs/v1-core.md ("The attention's memory") came
// from this program.
//
//   g++ -O3 -march=native -std=c++17 -pthread bench/memory_read.cc -o /tmp/memory_read
//   /tmp/memory_read CHUNK STREAMS THREADS HUGE   (e.g. 4096 2 2 1)

#include <immintrin.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s CHUNK STREAMS THREADS HUGE(0|1)\n", argv[0]);
    return 2;
  }
  const size_t total = size_t(3) << 29;  // 1.5 GiB
  const int64_t chunk = std::atol(argv[1]);
  const int streams = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  const bool huge = std::atoi(argv[4]) != 0;
  float* buf = static_cast<float*>(std::aligned_alloc(size_t(2) << 20, total));
  if (huge) madvise(buf, total, MADV_HUGEPAGE);
  for (size_t i = 0; i < total / 4; i += 1024) buf[i] = 1.f;  // fault every page in
  const int64_t chunks = total / chunk, per_thread = (int64_t(800) << 20) / chunk / threads;
  std::vector<double> gbs(threads);
  std::vector<float> sink(threads);
  auto work = [&](int t) {
    std::mt19937_64 rng(t);
    std::vector<int64_t> at(per_thread);
    for (auto& x : at) x = static_cast<int64_t>(rng() % chunks);
    __m512 acc = _mm512_setzero_ps();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i + streams <= per_thread; i += streams)
      for (int64_t off = 0; off < chunk / 4; off += 16)
        for (int s = 0; s < streams; ++s)
          acc = _mm512_add_ps(acc, _mm512_loadu_ps(buf + at[i + s] * (chunk / 4) + off));
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gbs[t] = double(per_thread / streams * streams) * chunk / dt / 1e9;
    sink[t] = _mm512_reduce_add_ps(acc);
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, t);
  for (auto& th : pool) th.join();
  double sum = 0;
  for (double g : gbs) sum += g;
  std::printf("chunk %ld B, %d streams/thread, %d threads, %s pages: %.1f GB/s (%g)\n",
              static_cast<long>(chunk), streams, threads, huge ? "2 MiB" : "4 KiB", sum,
              double(sink[0]));
  std::free(buf);
  return 0;
}
