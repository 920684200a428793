"""bench/serve.py's two clients report in one shape: our records (`summarize`) and aiperf's
export (`aiperf_summary`, units converted), with throughput over the same window."""

from __future__ import annotations

import pytest

from bench.serve import Record, aiperf_summary, summarize


def test_summaries_agree_on_one_set_of_timings():
    recs = []
    for sent, gaps in ((0.0, [0.1, 0.05, 0.05]), (0.5, [0.2, 0.05])):
        r = Record(sent)
        t = sent
        for g in gaps:
            t += g
            r.times.append(t)
            r.tokens += 1
        r.end = t
        recs.append(r)
    ours = summarize(recs, wall=1.0)
    assert ours["output_tokens"] == 5 and ours["span_s"] == pytest.approx(0.75)
    assert ours["throughput_tok_s_span"] == pytest.approx(5 / 0.75)
    assert ours["ttft_s"]["p50"] == pytest.approx(0.15)
    raw = {  # aiperf 0.13's export keys and units for the same requests
        "request_count": {"unit": "requests", "avg": 2},
        "request_throughput": {"unit": "requests/sec", "avg": 2 / 0.75},
        "output_token_throughput": {"unit": "tokens/sec", "avg": 5 / 0.75},
        "benchmark_duration": {"unit": "sec", "avg": 0.75},
        "output_sequence_length": {"unit": "tokens", "avg": 2.5, "sum": 5},
        "input_sequence_length": {"unit": "tokens", "avg": 4},
        "time_to_first_token": {"unit": "ms", "avg": 150, "p50": 150, "p90": 190, "p99": 199},
        "inter_token_latency": {"unit": "ms", "avg": 50, "p50": 50, "p90": 50, "p99": 50},
        "request_latency": {"unit": "ms", "avg": 225, "p50": 225, "p90": 245, "p99": 249},
    }
    theirs = aiperf_summary(raw)
    assert theirs["ttft_s"]["p50"] == pytest.approx(ours["ttft_s"]["p50"])
    assert theirs["itl_s"]["p50"] == pytest.approx(ours["itl_s"]["p50"])
    assert theirs["e2e_s"]["p50"] == pytest.approx(ours["e2e_s"]["p50"])
    assert theirs["throughput_tok_s_span"] == pytest.approx(ours["throughput_tok_s_span"])
    assert theirs["output_tokens"] == ours["output_tokens"]
