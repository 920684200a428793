"""pagedjax: PagedAttention serving engine on JAX."""
