"""Paper-reproduction benchmarks (vLLM SOSP'23 §6–7) against contiguous-KV baselines."""
