// How close the native panel matmul's inner loop comes to this host's limits at a batched
// decode step's rows, outside XLA: the floor under the batched throughput target
// (docs/v1-core.md, "How far fp32 can go here").
//
// It compiles the kernel's own source (`pallas_kernels/csrc/dense_matmul_cpu.cc`, included
// below, so nothing here is a copy of it) and calls its `rows` on the demo model's weight
// panels (30 layers of q/k/v [576 -> 960], o [576 -> 576], gate/up [576 -> 3072], down
// [1536 -> 576], then the LM head [576 -> 49152]: 538 MB of fp32, on 2 MiB pages), M rows:
//
// - `hot`: one thread, every call on the same panel (held in L2): the register block alone;
// - `streamed`: one thread over every panel in turn, each pulled from memory once, with the
//   kernel's prefetch of the next panel: what one core gets;
// - `streamed_2_threads`: two threads at once, each over every other panel (as the kernel's
//   own lists split them): what both cores get when they share the memory bus;
// - `hot_2_threads`: two threads, each on its own panel held in L2: both cores' compute.
//
// The four run interleaved, REPS rounds, and each reports its best round (this VM changes
// speed for seconds at a time: a variant run in one block could meet a slow spell alone);
// GFLOP/s = 2 x M x (weights). In the engine the same matmuls also pay XLA's calls, thread
// hand-offs and the work split at the end of each call (`bench/native_ab.py --kind matmul`
// times them there).
//
//   g++ -O3 -march=native -std=c++17 -pthread -I$(python -c 'import jax; print(jax.ffi.include_dir())') \
//       bench/panel_stream.cc -o /tmp/panel_stream
//   /tmp/panel_stream [M=64] [REPS=5]

#include "../pallas_kernels/csrc/dense_matmul_cpu.cc"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

namespace {

struct Matrix {
  int64_t K, panels;
  const float* w;
};

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Panels t, t + step, ... of every matrix, M rows each, through the kernel's `rows` (with
// its prefetch of the panel this thread takes next); `hot`: always panel t of the first
// matrix of the same depth (the work is the same, the panel stays in L2).
void pass(const std::vector<Matrix>& mats, const float* x, float* y, int64_t M, int64_t t,
          int64_t step, bool hot) {
  for (const Matrix& m : mats) {
    const Matrix& src = hot ? *std::find_if(mats.begin(), mats.end(), [&](const Matrix& o) {
      return o.K == m.K;
    }) : m;
    const Dense p{M, src.K, src.panels * kCols, src.panels, x, src.w, y, src.panels * kCols};
    for (int64_t b = t; b < m.panels; b += step) {
      const int64_t pb = hot ? t : b, next = hot ? -1 : b + step;
      rows(p, pb, 0, M, next < src.panels ? next : -1);
    }
  }
}

double two_threads(const std::vector<Matrix>& mats, const float* x, float* y0, float* y1,
                   int64_t M, bool hot) {
  return seconds_of([&] {
    std::thread helper([&] { pass(mats, x, y1, M, 1, 2, hot); });
    pass(mats, x, y0, M, 0, 2, hot);
    helper.join();
  });
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t M = argc > 1 ? std::atoll(argv[1]) : 64;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (K, panels)
  for (int l = 0; l < 30; ++l) shapes.insert(shapes.end(), {{576, 15}, {576, 9}, {576, 48}, {1536, 9}});
  shapes.push_back({576, 768});
  int64_t total = 0;
  double flop = 0;
  for (auto& [k, n] : shapes) {
    total += k * n * kCols;
    flop += 2.0 * M * k * n * kCols;
  }
  const size_t bytes = total * sizeof(float);
  auto* w = static_cast<float*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (w == MAP_FAILED) return 1;
  madvise(w, bytes, MADV_HUGEPAGE);
  for (int64_t i = 0; i < total; ++i) w[i] = float(i % 97) * 0.01f;
  std::vector<Matrix> mats;
  int64_t off = 0;
  for (auto& [k, n] : shapes) {
    mats.push_back({k, n, w + off});
    off += k * n * kCols;
  }
  std::vector<float> x(M * 1536, 0.5f), y0(M * 49152), y1(M * 49152);
  double hot = 1e30, one = 1e30, two = 1e30, hot2 = 1e30;
  for (int r = 0; r < reps; ++r) {
    hot = std::min(hot, seconds_of([&] { pass(mats, x.data(), y0.data(), M, 0, 1, true); }));
    one = std::min(one, seconds_of([&] { pass(mats, x.data(), y0.data(), M, 0, 1, false); }));
    two = std::min(two, two_threads(mats, x.data(), y0.data(), y1.data(), M, false));
    hot2 = std::min(hot2, two_threads(mats, x.data(), y0.data(), y1.data(), M, true));
  }
  std::printf("{\"rows\": %lld, \"weights_mb\": %.1f, \"reps\": %d, \"hot_ms\": %.2f, "
              "\"streamed_ms\": %.2f, \"streamed_2_threads_ms\": %.2f, "
              "\"hot_2_threads_ms\": %.2f, \"hot_gflop_per_s\": %.1f, "
              "\"streamed_gflop_per_s\": %.1f, \"streamed_2_threads_gflop_per_s\": %.1f, "
              "\"hot_2_threads_gflop_per_s\": %.1f}\n",
              static_cast<long long>(M), bytes / 1e6, reps, 1e3 * hot, 1e3 * one, 1e3 * two,
              1e3 * hot2, flop / hot / 1e9, flop / one / 1e9, flop / two / 1e9,
              flop / hot2 / 1e9);
  munmap(w, bytes);
  return 0;
}
