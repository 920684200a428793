"""Real execution: the trace served by the demo-model engine in wall-clock time."""

from __future__ import annotations

import time

from bench.paper.engine_setup import set_policy
from bench.paper.metrics import RunStats
from bench.paper.trace import TraceReq, prompt_ids
from pagedjax.sampling_params import SamplingParams
from pagedjax.worker.compile_stats import num_backend_compiles


def run_real(engine, policy: str, trace: list[TraceReq]) -> tuple[dict, list]:
    """Serve ``trace`` with ``policy``; returns (summary, measured steps for cost-model fitting).

    Steps that triggered an XLA compile are kept in the latencies (they happened) but left
    out of the returned calibration steps.
    """
    set_policy(engine, policy)
    vocab = engine.model_config.vocab_size
    stats = RunStats()
    captured = []
    orig = engine.scheduler.schedule

    def schedule():
        out = orig()
        captured.append(out)
        return out

    engine.scheduler.schedule = schedule
    calib = []
    pending = sorted(trace, key=lambda r: r.arrival)
    by_id = {str(r.index): r for r in trace}
    t0 = time.monotonic()
    i = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            engine.add_request(str(r.index), None, SamplingParams(max_tokens=r.output_len, ignore_eos=True,
                                                                  temperature=0.0),
                               prompt_token_ids=prompt_ids(r, vocab), arrival_time=t0 + r.arrival)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[i].arrival - now))
            continue
        captured.clear()
        c0 = num_backend_compiles()
        s0 = time.monotonic()
        outs = engine.step()
        s1 = time.monotonic()
        for o in outs:
            if o.finished:
                r = by_id[o.request_id]
                stats.latencies.append((s1 - t0 - r.arrival, r.output_len))
        if captured and not captured[0].is_empty:
            sched = engine.scheduler
            stats.record_step(captured[0], s1 - s0, engine.block_manager, sched.running,
                              len(sched.waiting), engine.max_model_len, sched.config.max_num_seqs)
            if num_backend_compiles() == c0:
                calib.append(stats.steps[-1])
    engine.scheduler.schedule = orig
    summary = stats.summary()
    summary["wall_s"] = time.monotonic() - t0
    return summary, calib
