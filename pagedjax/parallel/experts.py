"""Expert parallelism: whole experts per device instead of a slice of every expert.

Tensor parallelism splits each expert along its width (`mesh._layer_spec`): every device runs
every assignment at ``1/N`` of the width. With ``EngineConfig(enable_expert_parallel=True)``
(vLLM's flag; the expert-parallel group is the tensor-parallel group) device ``d`` holds
experts ``[d E/N, (d+1) E/N)`` whole. Activations are replicated under tensor parallelism, so
every device routes every token itself (the router is tiny) and computes only the assignments
to its own experts, with weight 0 for the rest; one all-reduce sums the experts' outputs — the
same collective, of the same size, as the width split's. No all-to-all is needed while
activations are replicated.

Which split wins depends on the matmul: the width split keeps the work balanced whatever the
routing but narrows each expert to ``I/N`` columns; the expert split keeps experts wide (fewer,
larger GEMMs) but a device's work follows how many tokens picked its experts. With jax 0.12's
dense `ragged_dot` lowering both do the same FLOPs; `bench/moe_parallel.py` measures them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.moe import expert_outputs, route, use_gather
from pagedjax.parallel.mesh import AXIS

EXPERTS = P(AXIS, None, None)  # [E, ., .] split on experts


@dataclasses.dataclass(frozen=True)
class ExpertParallelMoE:
    """Drop-in for `models.moe.moe_mlp` with expert weights split on the expert axis."""

    mesh: Mesh

    def __call__(self, x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                 w_down: jax.Array, *, top_k: int, renormalize: bool,
                 act: Callable[[jax.Array], jax.Array], gather: bool | None = None) -> jax.Array:
        num_experts = router.shape[-1]
        n = self.mesh.shape[AXIS]
        if gather is None:
            gather = use_gather(x.shape[0], top_k, num_experts)

        def local(x, router, w_gate, w_up, w_down):
            per = w_gate.shape[0]
            weights, ids = route(x, router, top_k, renormalize)
            ids = ids - jax.lax.axis_index(AXIS) * per
            mine = (ids >= 0) & (ids < per)
            # Other devices' assignments: weight 0, id `per` (sorts last, in no group).
            weights = jnp.where(mine, weights, 0.0)
            ids = jnp.where(mine, ids, per)
            out = expert_outputs(x, weights, ids, w_gate, w_up, w_down, act, gather)
            return jax.lax.psum(out.astype(jnp.float32), AXIS).astype(x.dtype)

        if num_experts % n:
            raise ValueError(f"enable_expert_parallel: {num_experts} experts do not split over "
                             f"{n} devices")
        fn = jax.shard_map(local, mesh=self.mesh,
                           in_specs=(P(), P(), EXPERTS, EXPERTS, EXPERTS), out_specs=P(),
                           check_vma=False)
        return fn(x, router, w_gate, w_up, w_down)
