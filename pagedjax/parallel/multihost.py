"""Multi-process (multi-host) tensor parallelism: one scheduler, every process in the step.

The mesh spans all processes' devices after `jax.distributed.initialize()`; a jitted step
over it is a collective program that every process must enter with the same inputs. Only
process 0 (the leader) runs the engine's scheduler and block manager. Before each device
operation its `ModelRunner` broadcasts a small header (operation, shape bucket) and then the
step's int32 arrays with `multihost_utils.broadcast_one_to_all`, i.e. through JAX's own
collectives, no side channel. The other processes sit in `worker_loop`, receive the same
arrays and run the same jitted call. Logits come back replicated, so the leader samples from
its local copy and the workers discard theirs.

Why broadcast instead of running the same deterministic scheduler everywhere: the schedule
depends on request arrival, aborts and wall-clock (streaming servers), which only the leader
sees; broadcasting a few KB per step keeps the workers free of any engine state.

Every process must also compile the *same* program for each collective call, and the leader
and the workers reach the same jitted functions from different call stacks (`send_step`
versus `worker_loop`, `execute` versus `_execute_local`). JAX writes the caller's traceback
into each operation's location metadata, so the programs differed in that metadata. Since
jax 0.12.1 this deadlocks the CPU (gloo) collectives: the processes' first collective from
differing stacks never completes. `align_traced_programs` turns the traceback metadata off
for multi-process runs.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from pagedjax.worker.paged_attention import PagedMeta

logger = logging.getLogger(__name__)

OP_STOP, OP_STEP, OP_COPY = 0, 1, 2
_HEADER = 8


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader_of_many() -> bool:
    return jax.process_count() > 1 and jax.process_index() == 0


def align_traced_programs() -> None:
    """Multi-process runs: trace without caller tracebacks in the operations' locations, so
    every process compiles identical programs whichever stack reaches a jitted function.

    A process-wide JAX setting (``jax_traceback_in_locations_limit`` = 0), set before the
    runner traces anything: the leader and the workers trace the step, the broadcasts and
    the block copies from different call stacks, and with the tracebacks in the metadata
    their programs differ. With jax 0.12.1's CPU collectives that hangs the first such
    collective on every process (`tests/parallel/test_tensor_parallel.py`'s two-process run
    did, in CI and here). Error messages keep the operation's own source line."""
    if is_multiprocess() and jax.config.jax_traceback_in_locations_limit != 0:
        logger.info("multi-process run: tracing without caller tracebacks in op locations")
        jax.config.update("jax_traceback_in_locations_limit", 0)


def min_over_processes(value: int) -> int:
    """The smallest of an int across processes (KV blocks must fit on every host)."""
    return int(np.min(multihost_utils.process_allgather(np.int32(value))))


def _header(values: list[int] | None = None) -> np.ndarray:
    h = np.zeros(_HEADER, np.int32)
    if values is not None:
        h[: len(values)] = values
    return np.asarray(multihost_utils.broadcast_one_to_all(h))


def _arrays(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(a) for a in multihost_utils.broadcast_one_to_all(arrays)]


def _step_arrays(inputs) -> list[np.ndarray]:
    m = inputs.meta
    return [inputs.input_ids, inputs.positions, m.slot_mapping, m.kv_lens, m.block_tables,
            m.cu_q_lens, np.asarray(m.num_seqs, np.int32).reshape(1), inputs.logits_indices]


def send_step(inputs) -> None:
    """Leader: announce and broadcast one model step (shape key, then the arrays)."""
    t, s, m, r, decode_only = inputs.shape_key
    _header([OP_STEP, t, s, m, r, int(decode_only)])
    _arrays(_step_arrays(inputs))


def send_copy(mapping: np.ndarray) -> None:
    _header([OP_COPY, mapping.shape[0]])
    _arrays([mapping])


def send_stop() -> None:
    """Leader: release the workers from `worker_loop` (call once, after the last request)."""
    if is_leader_of_many():
        _header([OP_STOP])


def worker_loop(runner) -> int:
    """Non-leader processes: run the leader's device operations until it sends stop.

    Returns the number of steps run. `runner` is the `ModelRunner` of an engine built with the
    same model and `EngineConfig` as the leader's (its scheduler stays idle)."""
    from pagedjax.worker.step_inputs import StepInputs

    steps = 0
    while True:
        op, *rest = (int(x) for x in _header())
        if op == OP_STOP:
            return steps
        if op == OP_COPY:
            (mapping,) = _arrays([np.zeros((rest[0], 2), np.int32)])
            runner._copy_local(mapping)
            continue
        if op != OP_STEP:
            raise RuntimeError(f"unknown operation {op} from the leader")
        t, s, m, r, decode_only = rest[:5]
        g = runner.num_kv_groups  # hybrid models: one table and slot mapping per group
        lead = (g,) if g > 1 else ()
        shapes = [(t,), (t,), lead + (t,), (s,), lead + (s, m), (s + 1,), (1,), (r,)]
        ids, pos, slots, kv_lens, tables, cu, num_seqs, logits_idx = _arrays(
            [np.zeros(sh, np.int32) for sh in shapes])
        meta = PagedMeta(slots, kv_lens, tables, cu, np.int32(num_seqs[0]), bool(decode_only))
        inputs = StepInputs(ids, pos, meta, logits_idx, [], (t, s, m, r, bool(decode_only)))
        runner._execute_local(inputs)
        steps += 1
