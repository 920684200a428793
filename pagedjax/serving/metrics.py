"""Prometheus metrics of one server, fed by `AsyncEngine` callbacks.

Each server owns its own `CollectorRegistry` (no process-global state), so several servers or
tests in one process never collide; gRPC and HTTP front doors export the same registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app

from pagedjax.serving.async_engine import AsyncEngine, RequestMetrics
from pagedjax.serving.errors import REFUSAL_KINDS
from pagedjax.serving.http_limits import BoundServer, HttpLimits

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class ServingMetrics:
    """Request counters and latency histograms plus engine gauges, all prefixed `pagedjax_`."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.requests = Counter("pagedjax_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("pagedjax_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("pagedjax_generation_tokens",
                                         "Generated tokens of finished requests", registry=r)
        self.ttft = Histogram("pagedjax_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pagedjax_time_per_output_token_seconds",
                              "Mean time per output token after the first", buckets=_TOKEN_BUCKETS,
                              registry=r)
        self.e2e = Histogram("pagedjax_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("pagedjax_num_requests_running", "Sequence groups running", registry=r)
        self.waiting = Gauge("pagedjax_num_requests_waiting", "Sequence groups waiting", registry=r)
        self.swapped = Gauge("pagedjax_num_requests_swapped", "Sequence groups swapped out", registry=r)
        self.kv_usage = Gauge("pagedjax_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.preemptions = Gauge("pagedjax_num_preemptions_total", "Preemptions since start", registry=r)
        # Errors, so that a failing engine is visible: refusals by kind (finished requests that
        # failed inside the engine are pagedjax_requests_total{finish_reason="error"}).
        self.refused = Counter("pagedjax_requests_refused", "Requests refused before running, by "
                               "error kind", ["kind"], registry=r)
        for kind in REFUSAL_KINDS:  # exported at 0 from the start: a rate over them needs a base
            self.refused.labels(kind)
        self.step_failures = Gauge("pagedjax_engine_step_failures_total", "Engine steps (or the "
                                   "scheduling of one request) that raised", registry=r)
        self.cache_rebuilds = Gauge("pagedjax_kv_cache_rebuilds_total", "Device KV caches lost in "
                                    "a failed step and rebuilt", registry=r)
        self.healthy = Gauge("pagedjax_engine_healthy", "1 while serving, 0 while a lost KV cache "
                             "is being rebuilt", registry=r)
        # Speculative decoding (vLLM's spec_decode_* counters, as gauges of engine totals).
        self.spec_drafts = Gauge("pagedjax_spec_decode_num_drafts", "Steps of a sequence that "
                                 "carried draft tokens", registry=r)
        self.spec_draft_tokens = Gauge("pagedjax_spec_decode_num_draft_tokens",
                                       "Draft tokens scored by the target model", registry=r)
        self.spec_accepted = Gauge("pagedjax_spec_decode_num_accepted_tokens",
                                   "Draft tokens accepted", registry=r)
        self.spec_accepted_pos = Gauge("pagedjax_spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted at each position of a proposal",
                                       ["position"], registry=r)
        self.spec_drafted_pos = Gauge("pagedjax_spec_decode_num_draft_tokens_per_pos",
                                      "Proposals with a draft token at each position (n-gram "
                                      "proposals may be shorter than num_speculative_tokens)",
                                      ["position"], registry=r)

        self.vllm = VllmMetrics(r, model_name) if model_name is not None else None

    def attach(self, engine: AsyncEngine, model_name: str | None = None) -> ServingMetrics:
        """Feed the metrics from ``engine``; the vLLM-named ones are labelled ``model_name``
        (default: the engine's model id)."""
        if self.vllm is None:
            self.vllm = VllmMetrics(self.registry, model_name or engine.engine.model_name)
        engine.on_request_done(self.observe_request)
        engine.on_stats(self.observe_stats)
        engine.on_refused(lambda err: self.refused.labels(err.kind).inc())
        self.observe_stats(engine.get_stats())
        return self

    def observe_request(self, m: RequestMetrics) -> None:
        if self.vllm is not None:
            self.vllm.observe_request(m)
        self.requests.labels(m.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.completion_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)

    def observe_stats(self, s) -> None:
        if self.vllm is not None:
            self.vllm.observe_stats(s)
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.swapped.set(s.num_swapped)
        self.kv_usage.set(s.kv_cache_usage)
        self.preemptions.set(s.num_preemptions_total)
        self.step_failures.set(getattr(s, "num_step_failures", 0))
        self.cache_rebuilds.set(getattr(s, "num_cache_rebuilds", 0))
        self.healthy.set(1 if getattr(s, "healthy", True) else 0)
        self.spec_drafts.set(getattr(s, "spec_num_drafts", 0))
        self.spec_draft_tokens.set(getattr(s, "spec_num_draft_tokens", 0))
        self.spec_accepted.set(getattr(s, "spec_num_accepted_tokens", 0))
        for pos, n in enumerate(getattr(s, "spec_accepted_per_position", ())):
            self.spec_accepted_pos.labels(str(pos)).set(n)
        for pos, n in enumerate(getattr(s, "spec_drafted_per_position", ())):
            self.spec_drafted_pos.labels(str(pos)).set(n)

    async def serve(self, port: int, host: str = "127.0.0.1", limits: HttpLimits | None = None) -> int:
        """Expose `/metrics` on the running event loop; returns the bound port (0 → ephemeral).

        uvicorn under the HTTP port's `limits` (header timeout, connection cap) rather than
        `prometheus_client.start_http_server`, which spends an OS thread per connection and never
        times out an idle one."""
        self._server = BoundServer(make_asgi_app(self.registry), host, port, limits or HttpLimits(),
                                   grace_s=1)
        return await self._server.start()

    async def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            await server.stop()


class VllmMetrics:
    """The same measurements under vLLM's metric names and meanings (`vllm:*`, labelled
    `model_name`), so dashboards and routers written for vLLM read this server unchanged.
    Mapping and differences: docs/serving-parity.md."""

    def __init__(self, r: CollectorRegistry, model_name: str):
        lab = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(model_name)

        def counter(name, doc, extra=()):
            return Counter(name, doc, lab + list(extra), registry=r)

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting (swapped out "
                             "included)")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions").labels(model_name)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests") \
            .labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens") \
            .labels(model_name)
        self.success = counter("vllm:request_success", "Finished requests by finish reason",
                               ["finished_reason"])
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up "
                                      "in the prefix cache").labels(model_name)
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache").labels(model_name)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token",
                         _LATENCY_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between two output tokens "
                        "of a request", _TOKEN_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                        _LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Time from arrival to first "
                          "scheduled", _LATENCY_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request",
                               _COUNT_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Generated tokens per request",
                            _COUNT_BUCKETS)
        self.req_max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens of "
                                   "each request", _COUNT_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Time from first scheduled "
                            "to first token", _LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Time from first to last "
                           "token", _LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "Time from first "
                              "scheduled to last token (prefill + decode)", _LATENCY_BUCKETS)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative proposals") \
            .labels(model_name)
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Draft tokens proposed").labels(model_name)
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted").labels(model_name)
        self.spec_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted per position", ["position"])
        self._last: dict[str, float] = {}  # engine totals seen, for the counters' increments

    def _delta(self, key: str, total: float) -> float:
        d = total - self._last.get(key, 0)
        self._last[key] = total
        return max(d, 0)

    def observe_stats(self, s) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting + s.num_swapped)
        self.kv_usage.set(s.kv_cache_usage)
        self.preemptions.inc(self._delta("preempt", s.num_preemptions_total))
        self.spec_drafts.inc(self._delta("drafts", getattr(s, "spec_num_drafts", 0)))
        self.spec_draft_tokens.inc(self._delta("dtok", getattr(s, "spec_num_draft_tokens", 0)))
        self.spec_accepted.inc(self._delta("acc", getattr(s, "spec_num_accepted_tokens", 0)))
        for pos, n in enumerate(getattr(s, "spec_accepted_per_position", ())):
            self.spec_pos.labels(self.model_name, str(pos)).inc(self._delta(f"pos{pos}", n))

    def observe_request(self, m: RequestMetrics) -> None:
        self.success.labels(self.model_name, m.finish_reason or "abort").inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.completion_tokens)
        self.prefix_queries.inc(m.prompt_tokens)
        self.prefix_hits.inc(m.cached_tokens)
        self.req_prompt.observe(m.prompt_tokens)
        self.req_gen.observe(m.completion_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for gap in m.itls:
            self.itl.observe(gap)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.max_tokens is not None:
            self.req_max_tokens.observe(m.max_tokens)
        # Requests that produced a token and had been scheduled (aborted ones may not).
        for hist_, value in ((self.prefill, m.prefill_time), (self.decode, m.decode_time),
                             (self.inference, m.inference_time)):
            if value is not None:
                hist_.observe(value)
