"""Tensor parallelism: mesh and sharding plan, per-shard attention, multi-process steps."""

from pagedjax.parallel.mesh import (
                                    AXIS,
                                    TensorParallelError,
                                    kv_replication,
                                    make_mesh,
                                    param_specs,
                                    shard_params,
                                    sharded_config,
                                    validate_tp,
)

__all__ = ["AXIS", "TensorParallelError", "kv_replication", "make_mesh", "param_specs",
           "shard_params", "sharded_config", "validate_tp"]
