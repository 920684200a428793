"""The paper's baselines (§6), kept out of the production core's way.

Orca-style contiguous KV reservations over a buddy allocator (`contiguous`, `buddy_allocator`)
and FasterTransformer-style request-level batching (`static_batching`). They exist to be
measured against the paged engine (`bench/paper/`); `EngineConfig.kv_policy` selects them
through `pagedjax.core.policies`. Pure Python, like `pagedjax.core`.
"""
