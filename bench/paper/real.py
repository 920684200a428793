"""Real execution: the trace served by the demo-model engine in wall-clock time."""

from __future__ import annotations

import time

from bench.paper.engine_setup import set_policy
from bench.paper.metrics import RunStats, memory_snapshot
from bench.paper.trace import TraceReq, prompt_ids
from pagedjax.sampling_params import SamplingParams
from pagedjax.worker.compile_stats import num_backend_compiles


def sampling_params(r: TraceReq, sampling: tuple[str, int]) -> SamplingParams:
    """Forced-length params for a trace request: greedy, n samples (temperature 1) or w beams."""
    mode, k = sampling
    if mode == "parallel":
        return SamplingParams(n=k, max_tokens=r.output_len, ignore_eos=True, temperature=1.0, seed=r.index)
    if mode == "beam":
        return SamplingParams(n=1, best_of=k, use_beam_search=True, max_tokens=r.output_len,
                              ignore_eos=True, temperature=0.0)
    return SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)


def run_real(engine, policy: str, trace: list[TraceReq], cost=None, *,
             sampling: tuple[str, int] = ("single", 1), prefix_caching: bool = False,
             preemption_mode: str | None = None, max_model_len: int | None = None) -> tuple[dict, list]:
    """Serve ``trace`` with ``policy``; returns (summary, measured steps for cost-model fitting).

    Steps that triggered an XLA compile are left out of the calibration steps. With ``cost``
    given, their compile stall (measured time minus the cost model's estimate for the step)
    is also cut out of the clock that arrivals and latencies use: a one-off compile of a new
    shape bucket is not serving latency. The number of such steps and the total stall removed
    are reported.
    """
    set_policy(engine, policy, prefix_caching=prefix_caching, preemption_mode=preemption_mode,
               max_model_len=max_model_len)
    vocab = engine.model_config.vocab_size
    stats = RunStats()
    captured = []
    orig = engine.scheduler.schedule

    def schedule():
        out = orig()
        captured.append((out, memory_snapshot(engine.scheduler, engine.scheduler.config.max_model_len)))
        return out

    engine.scheduler.schedule = schedule
    calib = []
    pending = sorted(trace, key=lambda r: r.arrival)
    by_id = {str(r.index): r for r in trace}
    t0 = time.monotonic()
    i, stall, compile_steps = 0, 0.0, 0
    counts = dict.fromkeys(("blocks_copied", "blocks_swapped_out", "blocks_swapped_in", "preemptions"), 0)
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - t0 - stall
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            engine.add_request(str(r.index), None, sampling_params(r, sampling),
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
        dt = s1 - s0
        compiled = num_backend_compiles() != c0
        step_out = captured[0][0] if captured else None
        if step_out is not None:
            counts["blocks_copied"] += len(step_out.blocks_to_copy)
            counts["blocks_swapped_out"] += len(step_out.blocks_to_swap_out)
            counts["blocks_swapped_in"] += len(step_out.blocks_to_swap_in)
            counts["preemptions"] += len(step_out.preempted)
        if compiled and step_out is not None and not step_out.is_empty:
            compile_steps += 1
            if cost is not None:
                est = cost.step_time(step_out)
                stall += max(0.0, dt - est)
                dt = min(dt, est)
        for o in outs:
            if o.finished:
                r = by_id[o.request_id]
                stats.latencies.append((s1 - t0 - stall - r.arrival, r.output_len))
        if step_out is not None and not step_out.is_empty:
            stats.record_step(step_out, dt, captured[0][1])
            if not compiled:
                calib.append(stats.steps[-1])
    engine.scheduler.schedule = orig
    summary = stats.summary()
    summary["wall_s"] = time.monotonic() - t0
    summary["compile_steps"] = compile_steps
    summary["compile_stall_removed_s"] = stall
    summary.update(counts)
    return summary, calib
