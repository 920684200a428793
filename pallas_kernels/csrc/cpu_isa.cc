// Which vector paths this build of the native CPU kernels holds. The library is compiled with
// -march=native, so the build host's instruction sets choose each kernel's path at compile
// time; Python asks here where the choice of kernel depends on it
// (`pallas_kernels.cpu_native.compiled_isa`): the bfloat16-screened LM head pays only with a
// vector path (AVX512-BF16's `vdpbf16ps` or AVX2's FMAs); its portable loop ran a batch-1
// step at half the speed of the float32 head (docs/v1-core.md "AVX2 hosts"). AVX512-VNNI
// picks the 8-bit screen (`lm_head_screen_kind`).

extern "C" int PagedjaxCpuIsa() {
  int bits = 0;
#if defined(__AVX512F__)
  bits |= 1;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  bits |= 2;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  bits |= 4;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  bits |= 8;  // the LM head's 8-bit screen
#endif
  return bits;
}
