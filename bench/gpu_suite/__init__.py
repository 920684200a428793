"""The GPU suite: what a session with a lent GPU runs (``python -m bench.gpu_suite``).

Stages ``kernels``, ``bench``, ``e2e``, ``paper`` (docs/gpu.md): each fits 9 minutes on an H100,
writes ``<stage>.json`` into ``--out`` as it goes, and adds rows to one summary table.
"""
