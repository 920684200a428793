"""Pallas kernels for the paged KV cache."""
