// A zero-filled buffer whose interior is advised MADV_HUGEPAGE before its pages are first
// touched, as an XLA FFI call (`pallas_kernels.cpu_native.zeros_on_huge_pages`): the CPU
// engine's KV cache.
//
// Why: a decode step's attention reads each sequence's K and V blocks, 4 KiB each per (layer,
// head) at the demo model's shapes, from wherever the block table puts them. On 4 KiB pages
// every block is its own page, so each costs a TLB miss and the hardware prefetchers stop at
// its end; reading random 4 KiB chunks from a 1.5 GB buffer (two streams per thread, two
// threads; `bench/memory_read.cc`) drew 16.8-19.1 GB/s on this project's host, 19.7-23.0 GB/s
// on 2 MiB pages (docs/v1-core.md). The cache must be XLA's own buffer, since the step donates
// it and XLA aliases only buffers it allocated (a view of a mapping of ours, as the weights
// use, would be copied on every step): so the output buffer XLA hands this call is advised
// here, before the zero fill faults its pages in, 2 MiB at a time.

#include <sys/mman.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr uintptr_t kHugePage = uintptr_t(2) << 20;
constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE (Linux 6.1), absent from older headers

ffi::Error ZerosHugePages(ffi::Result<ffi::AnyBuffer> out) {
  char* p = static_cast<char*>(out->untyped_data());
  const size_t n = out->size_bytes();
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHugePage - 1);
#ifdef MADV_HUGEPAGE
  // Only the buffer's own whole huge pages; a refusal (no THP) leaves 4 KiB pages.
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
  std::memset(p, 0, n);
  // A buffer malloc carved from memory touched before (below its mmap threshold, up to
  // 32 MiB) already has 4 KiB pages, which the advice does not replace: collapse them now
  // (a no-op for pages that are already huge; an older kernel just refuses).
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, kMadvCollapse);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxZerosHugePagesCpu, ZerosHugePages,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
