"""Deviceless ahead-of-time compilation for NVIDIA GPUs, from a CPU-only host.

jax's compile-only GPU topologies (``jax.experimental.topologies.get_topology_desc`` with a
``GpuTargetConfig``) run the whole pipeline, Pallas -> Triton -> LLVM -> PTX -> ptxas cubin,
for a GPU that is not there. That turns shared-memory overflow, register spills and ptxas
errors into CI failures instead of surprises on the day a GPU is lent.

Needs jax's CUDA plugin and NVIDIA's compiler wheels next to a CPU jax (the ``aot`` extra,
installed in ``.venv-aot`` by ``make test``), and ``JAX_PLATFORMS=cpu``. Run
``python -m pagedjax.aot --help``; the report lands in ``bench/results/aot-<target>/``.
"""
