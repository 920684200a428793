"""Host time per decode step of the whole engine, device work excluded (issue 15 target: <= 1 ms
p99 at 256 sequences).

    .venv/bin/python bench/host_overhead.py [--seqs 32,128,256,1024] [--steps 200]
    .venv/bin/python bench/host_overhead.py --compare-gc 2 --seqs 256,1024   # gc.freeze A/B
    .venv/bin/python bench/host_overhead.py --phases --seqs 256   # ms per step, by stage
    .venv/bin/python bench/host_overhead.py --calls --seqs 256   # Python calls per step
    .venv/bin/python bench/host_overhead.py --compare-gc-threshold 10000 --reps 3 --seqs 256

`LLMEngine.step()` runs for real (scheduling, block tables, step input arrays, sampling
metadata, applying tokens, stop checks, incremental detokenization with the demo tokenizer,
building outputs), but the two device calls return at once: the runner's step hands back a
ready logits array and the sampler hands back tokens drawn beforehand from the demo
vocabulary. What is left is exactly the host work that sits on every step's critical path.
Steady state: N requests with 128-token prompts decode together, EOS ignored, the heap frozen
after start-up as the server does (`--no-gc-freeze`: not), then `SETTLE_STEPS` untimed steps
(the freeze's one full collection leaves the caches cold); the median and p99 over `--steps`
decode steps are reported (with 200, p99 is the second slowest), for each sampling mix (`greedy`: all greedy;
`mixed`: half the requests with top-p, penalties and logprobs; `sampled`: every request at
temperature 0.7 and top-p 0.95, as most chat clients send; `sampled_stops`: the same with a
stop string each; `sampled_lp`: with 2 logprobs each; `sampled_one_lp`: the same, one
of them with 2 logprobs, which used to take every row off the streamed fast path) and
output kind (`cumulative`: an output per request per step, as a library caller streaming;
`delta`: an output per request per step holding only what is new, as the HTTP and gRPC
servers ask; `final_only`: as
`LLM.generate`; `engine_process`: the servers' deltas as `pagedjax serve --engine-process`
asks for them, text-free (`delta_ids`, stop strings left to the front end), plus turning each
step's outputs into the pipe's message, running deltas made as rows (`LLMEngine.pipe_rows`);
`engine_process_objects`: the same with every output made as a `RequestOutput` first, the
A/B baseline of those rows; `--kinds` picks). An `engine_process` row also times the
parent's side of its steps (`front_end`: unpickling and `decode_outputs`, as sent and as one
tuple per row), which runs in the other process, off the child's step.

Where the tail comes from. This VM changes speed for seconds at a time (a plain Python loop
runs 1.3-1.6x slower in its slow spells, whatever runs), so after each timed step, outside
the step's time, a fixed Python loop is timed as a speed probe (`PROBE`). Each row reports
the probe's median and 10th percentile, the steps' p99 with every step scaled by (probe's
10th percentile / its own probe: `p99_speed_adjusted_ms`, the tail the engine would have at
the host's fast speed), and the young-generation and older collections that ran during the
timed steps with the longest one (`gc_collections`, `gc_max_ms`): an engine tail (a
collection, a block-boundary step) shows in the adjusted p99, a slow spell of the host
mostly does not. The probe under-corrects: in one long slow spell the steps ran ~1.8x slower
and the probe ~1.35x, so the adjusted p99 is an upper bound on the fast-speed tail.
`--trace FILE` writes every timed step's time and probe.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _Runner:
    """The engine's view of a runner, with no device work."""

    def __init__(self, config, params, engine_config, dtype, max_model_len, *a, **k) -> None:
        from pagedjax.worker.host_heap import keep_freed_memory
        from pagedjax.worker.model_runner import kv_layout
        from pagedjax.worker.shapes import ShapePlan

        # As the CPU runner does once its weights are placed: freed heap memory stays in the
        # process, so a step's large host arrays (penalty histories: [rows, max_model_len])
        # are not page-faulted in anew every step.
        keep_freed_memory()

        self.num_gpu_blocks = engine_config.num_gpu_blocks
        self.num_cpu_blocks = 0
        self.block_size = engine_config.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.shape_plan = ShapePlan(engine_config.max_num_seqs, engine_config.max_num_batched_tokens,
                                    self.max_blocks_per_seq, fixed_width=False,
                                    block_size=self.block_size)
        self.compiled_shapes: set = set()
        self.vocab = config.vocab_size
        # No device: by default every step's tokens are applied at once (synchronous). With
        # `--engine-arg async_scheduling=true` the engine runs as a CPU engine does by
        # default: each step scheduled and launched before the last one's tokens are applied.
        self.feed_tokens = engine_config.async_scheduling is True
        self.native_greedy = False  # the stub samplers below stand in for all three
        self.native_sampler = False
        self.chunked_top_k = False
        # As a CPU runner of an unrolled fp32 model: greedy rows without logprobs take the
        # screened head (`sample_greedy_hidden`, stubbed below) from `execute_hidden`.
        self.head_outside = True
        self.head_screen: dict = {}
        self.head_panels = None
        self.kv_scales = None  # a float cache: nothing to calibrate
        self.kv_dtype = np.dtype(np.float32)
        self.kv_layout = kv_layout(config, engine_config)
        self.num_kv_groups = self.kv_layout.num_groups
        self.params = params
        self.mesh = None  # one device: the engine keeps the block tables on it
        self.device_tables = None
        try:
            from pagedjax.worker.model_runner import read_in_place
        except ImportError:  # an earlier tree (`host_overhead_ab.py --base`): `device_get`
            read_in_place = None
        self.fetch = read_in_place  # as a one-CPU runner's (the stub's outputs are numpy)

    def enable_device_tables(self, rows: int) -> None:
        self.device_tables = rows  # the host's part only: `execute` takes the queued writes

    def enable_device_histories(self, slots: int, width: int) -> None:
        self.device_histories = None  # the host's part (`HistorySlots.step`) runs in the engine
        self._no_history = np.full((self.shape_plan.sample_cap, width), -1, np.int32)

    def gather_histories(self, slots, *a, **k):
        out = self._no_history[: len(slots)]  # never read: the stub samplers ignore them
        return out, out

    def _take(self, inputs) -> None:
        self.compiled_shapes.add(inputs.shape_key)
        if inputs.table_source is not None:
            inputs.table_source.take_deltas()

    def execute(self, inputs):
        self._take(inputs)
        return np.zeros((len(inputs.logits_indices), 1), np.float32)  # never read

    def execute_hidden(self, inputs):
        self._take(inputs)
        return np.zeros((len(inputs.logits_indices), 1), np.float32)  # never read

    def cache_lost(self) -> bool:
        return False

    def sampled_tokens(self, tokens):
        return tokens  # async scheduling: the next step's inputs would read them (unused)

    def merge_pending_history(self, history, *a, **k):
        return history  # the stub samplers never read the histories

    def warmup(self, *a, **k) -> None: ...
    def warmup_token_feed(self, *a, **k) -> None: ...
    def swap_out(self, pairs) -> None: ...
    def swap_in(self, pairs) -> None: ...
    def copy_blocks(self, pairs) -> None: ...


ENGINE_ARGS: dict = {}  # `--engine-arg`: EngineConfig fields for every engine measured
# `--baton IN,OUT` (file descriptors; `host_overhead_ab.py --lockstep`): each timed step
# waits for a byte on IN and reports on OUT once done, so a referee can run two engines'
# steps in turn, each while the other waits, and both meet the host's speed of the moment.
BATON: tuple[int, int] | None = None


def _baton_wait() -> None:
    if BATON is not None and os.read(BATON[0], 1) != b"g":
        raise RuntimeError("the lockstep referee went away")


def _baton_pass(signal: bytes) -> None:
    if BATON is not None:
        os.write(BATON[1], signal)


SETTLE_STEPS = 8  # untimed decode steps between start-up (heap frozen) and the timed ones
# The speed probe timed after each step: ~60 us of plain Python (a generator, integer
# arithmetic), the same kind of work as the step's host code and none of its data.
PROBE = 1000


def _probe_us() -> float:
    t = time.perf_counter()
    sum(i * i for i in range(PROBE))
    return 1e6 * (time.perf_counter() - t)


def _tail(times: list[float], probes: list[float], collections: list[tuple[int, float]]) -> dict:
    """The tail figures of a row (see the module doc): the probe, the p99 at the host's fast
    speed, and the collections of the timed steps."""
    fast = float(np.percentile(probes, 10))
    adjusted = sorted(t * fast / p for t, p in zip(times, probes, strict=True))
    gens: dict[str, int] = {}
    for gen, _ in collections:
        gens[str(gen)] = gens.get(str(gen), 0) + 1
    return {"probe_us_median": statistics.median(probes), "probe_us_p10": fast,
            "p99_speed_adjusted_ms": 1e3 * adjusted[min(len(adjusted) - 1,
                                                          int(0.99 * len(adjusted)))],
            "gc_collections": gens,
            "gc_max_ms": 1e3 * max((d for _, d in collections), default=0.0)}

# (owner, attribute, label): the stages `--phases` times; nested ones are indented, so a
# stage's own time is its total less its children's.
PHASES = [
    ("pagedjax.core.scheduler:Scheduler", "schedule", "schedule"),
    ("pagedjax.engine:LLMEngine", "_launch", "launch"),
    ("pagedjax.engine:LLMEngine", "_rows_for", "  sampled rows"),
    ("pagedjax.engine", "build_step_inputs", "  step inputs"),
    # Steady decode steps build theirs from columns (stop 61): the same stage.
    ("pagedjax.engine", "steady_decode_inputs", "  step inputs"),
    ("pagedjax.engine:LLMEngine", "_sampling_metadata", "  sampling metadata"),
    # A steady cohort's, kept across its steps (stop 77): the same stage.
    ("pagedjax.worker.cohort_metadata:CohortMetadata", "get", "  sampling metadata"),
    # Sampled rows with penalties: their histories' deltas and gather (stop 76).
    ("pagedjax.engine:LLMEngine", "_device_histories", "  device histories"),
    ("pagedjax.engine:LLMEngine", "_feed_pending_history", "  history feed"),
    # A steady step's, from the rows as arrays (stop 79): the same stage.
    ("pagedjax.engine:LLMEngine", "_feed_steady_history", "  history feed"),
    # Async scheduling: the tokens a launched step samples made pending, and the rows that
    # feed the last step's pending tokens to this one.
    ("pagedjax.engine:LLMEngine", "_mark_pending", "  pending tokens"),
    ("pagedjax.engine:LLMEngine", "_feed_pending", "  token feed"),
    ("pagedjax.core.scheduler:Scheduler", "update_after_step", "update_after_step"),
    ("pagedjax.engine:LLMEngine", "_finish", "finish"),
    ("jax", "device_get", "  device_get"),
    # A one-CPU runner's results read in place instead (`ModelRunner.fetch`, stop 63).
    ("pagedjax.worker.model_runner", "read_in_place", "  device_get"),
    ("pagedjax.engine:LLMEngine", "_apply_samples", "  apply samples"),
    ("pagedjax.core.scheduler:Scheduler", "update_from_output", "    update_from_output"),
    # Plain decode steps apply their rows here instead (stop 59): the same stage.
    ("pagedjax.core.scheduler:Scheduler", "update_from_rows", "    update_from_output"),
    # And steady steps of quiet rows here (stop 63).
    ("pagedjax.core.scheduler:Scheduler", "update_steady", "    update_from_output"),
    ("pagedjax.output_processor:OutputProcessor", "process", "    output processing"),
    # A steady step's running listed rows (stop 79): the same stage.
    ("pagedjax.output_processor:OutputProcessor", "listed_rows", "    output processing"),
    # A steady cohort's streamed rows (stop 62; pipe rows stop 71).
    ("pagedjax.output_processor:OutputProcessor", "stream_rows", "    stream rows"),
    ("pagedjax.detokenizer:Detokenizer", "step", "      detokenization"),
    ("pagedjax.detokenizer:Detokenizer", "append_token", "      detokenization"),
    ("pagedjax.core.scheduler:Scheduler", "free_finished_seq_groups", "  free finished"),
    ("pagedjax.output_processor:OutputProcessor", "make_output", "  RequestOutputs"),
]


class _Phases:
    """Wraps each stage of `PHASES` to add its wall time while `on` (the timed steps)."""

    def __init__(self) -> None:
        import importlib

        self.on, self._undo = False, []
        self.ms = {label: 0.0 for *_, label in PHASES}  # a label may time several functions
        for owner, attr, label in PHASES:
            mod, _, cls = owner.partition(":")
            obj = importlib.import_module(mod)
            obj = getattr(obj, cls) if cls else obj
            f = obj.__dict__[attr]
            self._undo.append((obj, attr, f))
            setattr(obj, attr, self._timed(f, label))

    def _timed(self, f, label):
        def timed(*a, **k):
            if not self.on:
                return f(*a, **k)
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.ms[label] += 1e3 * (time.perf_counter() - t)
        return timed

    def restore(self) -> None:
        for obj, attr, f in self._undo:
            setattr(obj, attr, f)


class _Calls:
    """Counts the Python-level function calls (C functions included) of the timed steps with
    cProfile while `on`: a measure of host work per step that a host's speed does not move.
    The VM this benchmark runs on switches between speed modes ~1.5x apart within minutes,
    which makes small timing A/Bs of the host step unreliable; calls per step are exact."""

    def __init__(self) -> None:
        import cProfile

        self.profile, self._on = cProfile.Profile(), False

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, value: bool) -> None:
        self._on = value
        (self.profile.enable if value else self.profile.disable)()

    def per_step(self, steps: int, top: int = 12) -> dict:
        import pstats

        st = pstats.Stats(self.profile)
        rows = sorted(((v[1], f"{Path(k[0]).name}:{k[2]}") for k, v in st.stats.items()),
                      reverse=True)[:top]
        return {"calls_per_step": st.total_calls / steps,
                "top_calls_per_step": {name: n / steps for n, name in rows}}


def _commit() -> str:
    """The tree measured: its HEAD, and "+changes" when it differs from HEAD."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True,
                              text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def measure(num_seqs: int, steps: int, mix: str, tokenizer, config,
            output_kind: str = "cumulative", freeze_gc: bool = True,
            phases: _Phases | _Calls | None = None, gc_threshold: int | None = None,
            trace: list | None = None, messages: list | None = None) -> dict:
    """One row: ``steps`` timed decode steps of ``num_seqs`` sequences; ``trace``, if given,
    gets each timed step's (ms, probe us); ``messages`` (an `engine_process` kind) each
    timed step's outputs as pickled for the pipe."""
    import gc

    import pagedjax.engine as eng_mod
    from pagedjax.config import EngineConfig
    from pagedjax.sampler import SamplerOutput
    from pagedjax.sampling_params import SamplingParams
    from pagedjax.serving.engine_process import encode_outputs, front_end_split

    rng = np.random.default_rng(0)
    vocab_ids = rng.integers(200, 20000, 1 << 16).astype(np.int32)  # ordinary text tokens
    state = {"i": 0}

    def fake_sample(logits, meta, num_logprobs=0, rows=None, native=False, chunked=False):
        b = len(rows)
        state["calls"] = state.get("calls", 0) + 1
        i = state["i"]
        state["i"] = (i + b) % (len(vocab_ids) - 2 * b)
        toks = vocab_ids[i : i + b]
        k = num_logprobs
        return SamplerOutput(toks, np.full(b, -1.0, np.float32), np.ones(b, np.int32),
                             np.full((b, k), -2.0, np.float32),
                             np.tile(np.arange(k, dtype=np.int32), (b, 1)), None)

    def fake_sample_greedy(logits, rows, num_logprobs=0, native=False):
        return fake_sample(logits, None, num_logprobs, rows)

    def fake_sample_greedy_hidden(hidden, rows, screen, panels, num_logprobs=0):
        return fake_sample(hidden, None, num_logprobs, rows)

    # Every sampler: greedy batches take `sample_greedy` or `sample_greedy_hidden`, which on
    # the stub's zeros would draw token 0 (a special token, skipped by detokenization) every
    # step.
    names = ("ModelRunner", "sample", "sample_greedy", "sample_greedy_hidden")
    orig = [getattr(eng_mod, n) for n in names]
    for n, f in zip(names, (_Runner, fake_sample, fake_sample_greedy, fake_sample_greedy_hidden),
                    strict=True):
        setattr(eng_mod, n, f)
    thresholds = gc.get_threshold()  # restored however the round ends
    try:
        max_len = 128 + steps + 256  # outlives the prefill of the last request
        blocks = num_seqs * -(-max_len // 16) + 16
        ec = EngineConfig(num_gpu_blocks=blocks, max_num_seqs=num_seqs,
                          max_num_batched_tokens=max(2048, num_seqs), max_model_len=max_len,
                          warmup=False, **ENGINE_ARGS)
        engine = eng_mod.LLMEngine(config, {}, tokenizer, ec)
        for i in range(num_seqs):
            if mix == "mixed" and i % 2:
                sp = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.2,
                                    repetition_penalty=1.1, logprobs=2, max_tokens=steps + 200,
                                    ignore_eos=True, stop=["\n\n\n\n"])
            elif mix == "sampled_lp":  # 2 logprobs on every stream
                sp = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=steps + 200,
                                    ignore_eos=True, logprobs=2)
            elif mix == "sampled_stops":  # a chat client's stop string on every stream
                sp = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=steps + 200,
                                    ignore_eos=True, stop=["\n\nUser:"])
            elif mix == "sampled" or mix == "sampled_one_lp" and i:
                sp = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=steps + 200,
                                    ignore_eos=True)
            elif mix == "sampled_one_lp":  # one request of them with logprobs
                sp = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=steps + 200,
                                    ignore_eos=True, logprobs=2)
            else:
                sp = SamplingParams(temperature=0, max_tokens=steps + 200, ignore_eos=True)
            kind = output_kind
            if output_kind.startswith("engine_process"):  # as `EngineProcess` asks for deltas
                split = front_end_split(sp)
                kind, sp = ("delta", sp) if split is None else ("delta_ids", split[0])
            engine.add_request(f"r{i}", None, sp, output_kind=kind,
                               prompt_token_ids=[int(t) for t in vocab_ids[i : i + 128]])
        while engine.scheduler.waiting or any(  # prefill everything first
                s.num_computed_tokens < s.num_prompt_tokens
                for g in engine.scheduler.running for s in g.seqs):
            engine.step()
        if freeze_gc:  # as `pagedjax serve` does once loaded (LLMEngine.freeze_gc)
            engine.freeze_gc()
        if gc_threshold is not None:  # the young generation's size, whatever freeze_gc set
            gc.set_threshold(gc_threshold, *gc.get_threshold()[1:])
        gen0 = gc.get_threshold()[0]
        # The full collection inside the freeze walks the whole heap once and leaves the
        # caches cold: the next few steps ran 1.2-2x slower (1.5-1.8 ms, then 1.2, 1.1 at 256
        # sequences). A server freezes once, at start-up; so does this, then lets
        # `SETTLE_STEPS` untimed steps pass before the steady state it times.
        for _ in range(SETTLE_STEPS):
            engine.step()
        times = []
        if phases is not None:
            phases.on = True
        ipc = output_kind.startswith("engine_process")
        engine.pipe_rows = output_kind == "engine_process"  # as the engine process's child
        sent: set[str] = set()
        engine._memory = {}  # fixed for a real engine's life, computed once; the stub has none
        probes: list[float] = []
        collections: list[tuple[int, float]] = []  # (generation, seconds) in the timed steps
        started = [0.0]

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                collections.append((info["generation"], time.perf_counter() - started[0]))

        gc.callbacks.append(on_gc)
        _baton_pass(b"r")  # ready: the referee starts the timed steps once both are
        try:
            for _ in range(steps):
                _baton_wait()
                t0 = time.perf_counter()
                outs = engine.step()
                if ipc:  # what the engine process adds: its outputs made ready for the pipe
                    msg = pickle.dumps(("step", encode_outputs(outs, sent), engine.get_stats(),
                                        0, True), protocol=pickle.HIGHEST_PROTOCOL)
                times.append(time.perf_counter() - t0)
                if ipc and messages is not None:
                    messages.append(msg)
                probes.append(_probe_us())
                _baton_pass(b"d")
        finally:
            gc.callbacks.remove(on_gc)
        if phases is not None:
            phases.on = False
        assert len(engine.scheduler.running) == num_seqs
        # Every token came from the stub (ordinary text tokens), none from a real sampler.
        outs = [s.output_token_ids for g in engine.scheduler.running for s in g.seqs]
        # (async scheduling: the last step's tokens are still pending, not applied)
        assert all(len(o) >= steps + SETTLE_STEPS and min(o) >= 200 for o in outs), \
            sorted({len(o) for o in outs})
    finally:
        for n, f in zip(names, orig, strict=True):
            setattr(eng_mod, n, f)
        gc.set_threshold(*thresholds)
    if trace is not None:
        trace.extend((1e3 * t, p) for t, p in zip(times, probes, strict=True))
    tail = _tail(times, probes, collections)
    times.sort()
    if freeze_gc:
        gc.unfreeze()  # the next engine starts from a clean heap
    return {"num_seqs": num_seqs, "mix": mix, "output_kind": output_kind, "steps": steps,
            "gc_frozen": freeze_gc, "gc_gen0_threshold": gen0,
            "untimed_steps_after_start_up": SETTLE_STEPS,
            "median_ms": 1e3 * statistics.median(times),
            "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))],
            "max_ms": 1e3 * times[-1], **tail}


def front_end(messages: list[bytes], reps: int = 5) -> dict:
    """The engine process's parent's share of each step: unpickling its message and
    `decode_outputs`, ms per step, for the messages as the child sent them (steady steps'
    running rows as a `pipe_block`) and for the same outputs as one tuple per row (the
    format before blocks: `encode_outputs` of the decoded `RequestOutput`s), alternated.
    The parent's prompts are made up (one per request, as its first output would have left
    them): decoding reads them, their contents cost nothing."""
    import pagedjax.serving.engine_process as ep
    from pagedjax.serving.engine_process import decode_outputs, encode_outputs

    # (A tree before blocks, as `host_overhead_ab.py`'s base: its prompts are text and ids.)
    kept_fields = ("prompt", [1, 2, 3], 0, 0, 1.0)[:5 if hasattr(ep, "_expand_block") else 2]
    pairs = []
    for m in messages:
        rows = pickle.loads(m)[1]
        rids = {rid for r in rows for rid in (r[1] if r[0] is None else (r[0],))}
        prompts = {rid: kept_fields for rid in rids}
        outs = decode_outputs(rows, dict(prompts))
        as_rows = pickle.dumps(("step", encode_outputs(outs, set(rids)), *pickle.loads(m)[2:]),
                               protocol=pickle.HIGHEST_PROTOCOL)
        pairs.append((m, as_rows, prompts))
    times: dict[str, list[float]] = {"as_sent": [], "as_rows": []}
    for _ in range(reps):
        for m, as_rows, prompts in pairs:
            for name, msg in (("as_sent", m), ("as_rows", as_rows)):
                kept = dict(prompts)
                t0 = time.perf_counter()
                decode_outputs(pickle.loads(msg)[1], kept)
                times[name].append(time.perf_counter() - t0)
    return {f"front_end_{k}_median_ms": 1e3 * statistics.median(v) for k, v in times.items()} | {
        "message_bytes_as_sent": statistics.median(len(m) for m, _, _ in pairs),
        "message_bytes_as_rows": statistics.median(len(r) for _, r, _ in pairs)}


def metadata_ab(num_rows: int, reps: int) -> dict:
    """Sampling metadata for ``num_rows`` rows (half greedy, half top-p with penalties and
    logprobs, 128 prompt + 100 output tokens each): `SamplingMetadata.from_params` row by row
    against `SamplingBatch.metadata` from slots written before, interleaved, ms per call."""
    import timeit

    from pagedjax.sampler import SamplingMetadata, SeqSamplingState
    from pagedjax.sampling_params import SamplingParams
    from pagedjax.worker.sampling_batch import SamplingBatch

    vocab = 49152
    mixed = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.2,
                           repetition_penalty=1.1, logprobs=2, max_tokens=300)
    greedy = SamplingParams(temperature=0, max_tokens=300)
    hist = np.arange(228, dtype=np.int32)
    rows = [(mixed if i % 2 else greedy, SeqSamplingState(hist[:128], hist[128:], i, 0))
            for i in range(num_rows)]
    keys = [(i, 0) for i in range(num_rows)]
    kw = dict(history_width=584, ban_width=16, bias_width=64, mask_width=0)
    batch = SamplingBatch(vocab, 4 * num_rows, eos_token_ids=[0])
    batch.metadata(rows, keys, num_rows, **kw)
    out = {"rows": num_rows, "from_params_ms": [], "sampling_batch_ms": []}
    for _ in range(reps):
        out["from_params_ms"].append(1e3 / 200 * timeit.timeit(
            lambda: SamplingMetadata.from_params(rows, num_rows, vocab, eos_token_ids=[0], **kw),
            number=200))
        out["sampling_batch_ms"].append(1e3 / 200 * timeit.timeit(
            lambda: batch.metadata(rows, keys, num_rows, **kw), number=200))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="32,128,256,1024")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kinds", default="cumulative,delta,final_only",
                    help="output kinds to measure, comma-separated")
    ap.add_argument("--mixes", default="greedy,mixed", help="sampling mixes, comma-separated")
    ap.add_argument("--reps", type=int, default=1, help="rounds of every configuration")
    ap.add_argument("--out", default=str(ROOT / "bench/results/cpu/host_overhead.json"))
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field, e.g. device_penalty_histories=false "
                         "(the stub's histories gather costs nothing: the device's work is "
                         "what this benchmark leaves out)")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="measure without gc.freeze() after start-up (the server freezes)")
    ap.add_argument("--compare-gc", type=int, default=0, metavar="REPS",
                    help="instead: REPS interleaved rounds of frozen / not frozen (greedy, "
                         "cumulative) at --seqs, written to host_overhead_gc.json")
    ap.add_argument("--compare-gc-threshold", type=int, default=0, metavar="GEN0",
                    help="instead: --reps interleaved rounds of the engine's own collector "
                         "thresholds / a young generation of GEN0 objects, --kinds x --mixes, "
                         "written to host_overhead_gc_threshold.json")
    ap.add_argument("--phases", action="store_true",
                    help="instead: ms per step by stage (each stage's wall time summed over "
                         "the timed steps; stages wrapped, so the total runs a little slower), "
                         "--kinds x --mixes, written to host_overhead_phases.json")
    ap.add_argument("--calls", action="store_true",
                    help="instead: Python function calls per step (cProfile; the host's speed "
                         "does not move it), --kinds x --mixes, written to "
                         "host_overhead_calls.json")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="also write every timed step's ms and speed probe (us), per row, "
                         "to FILE (JSON)")
    ap.add_argument("--baton", default=None, metavar="IN,OUT",
                    help="(`host_overhead_ab.py --lockstep`) inherited file descriptors: wait "
                         "for a byte on IN before each timed step, write one to OUT after it")
    ap.add_argument("--metadata", action="store_true",
                    help="instead: sampling metadata row by row vs from the persistent "
                         "SamplingBatch at --seqs rows, --reps rounds, written to "
                         "host_overhead_metadata.json")
    args = ap.parse_args()
    import ast

    if args.baton:
        global BATON
        fd_in, fd_out = map(int, args.baton.split(","))
        BATON = (fd_in, fd_out)

    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        ENGINE_ARGS[k] = ast.literal_eval(v.capitalize() if v.lower() in ("true", "false") else v)
    if args.metadata:
        load = os.getloadavg()[0]
        rows = [metadata_ab(n, max(args.reps, 3)) for n in map(int, args.seqs.split(","))]
        for r in rows:
            print(f"{r['rows']} rows: from_params "
                  f"{' '.join(f'{x:.3f}' for x in r['from_params_ms'])} ms, SamplingBatch "
                  f"{' '.join(f'{x:.3f}' for x in r['sampling_batch_ms'])} ms")
        json.dump({"what": "sampling metadata per call, row by row vs persistent slots "
                           "(bench/host_overhead.py --metadata), interleaved",
                   "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:]),
                   "load_avg_1m_at_start": load, "cpu_count": os.cpu_count(), "rows": rows},
                  open(Path(args.out).with_name("host_overhead_metadata.json"), "w"), indent=1)
        return
    from models.demo import ensure_demo_model
    from models.loader import read_config
    from models.tokenizer import load_tokenizer

    gguf = ensure_demo_model()
    config, tok = read_config(str(gguf)), load_tokenizer(gguf)
    load = os.getloadavg()[0]
    rows = []
    if args.compare_gc_threshold:  # A, B, A, B in one process: noise lands on both
        for rep in range(args.reps):
            for gen0 in (None, args.compare_gc_threshold):
                for kind in args.kinds.split(","):
                    for mix in args.mixes.split(","):
                        for n in map(int, args.seqs.split(",")):
                            r = {**measure(n, args.steps, mix, tok, config, kind, True,
                                           gc_threshold=gen0), "rep": rep}
                            rows.append(r)
                            print(f"rep {rep} gen0 {r['gc_gen0_threshold']:6d} {kind:10s} {mix:6s} "
                                  f"{n:5d} seqs: median {r['median_ms']:.2f} ms, p99 "
                                  f"{r['p99_ms']:.2f} ms", flush=True)
        json.dump({"what": "host ms per decode step with the engine's collector thresholds and "
                           "with a larger young generation, interleaved "
                           "(bench/host_overhead.py --compare-gc-threshold)",
                   "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:]),
                   "load_avg_1m_at_start": load, "cpu_count": os.cpu_count(), "rows": rows},
                  open(Path(args.out).with_name("host_overhead_gc_threshold.json"), "w"), indent=1)
        return
    if args.compare_gc:  # A, B, A, B in one process: noise lands on both
        for rep in range(args.compare_gc):
            for frozen in (True, False):
                for n in map(int, args.seqs.split(",")):
                    r = {**measure(n, args.steps, "greedy", tok, config, "cumulative", frozen),
                         "rep": rep}
                    rows.append(r)
                    print(f"rep {rep} gc frozen={frozen!s:5s} {n:5d} seqs: median "
                          f"{r['median_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms", flush=True)
        out = Path(args.out).with_name("host_overhead_gc.json")
        json.dump({"what": "host ms per decode step with and without gc.freeze after start-up, "
                           "interleaved (bench/host_overhead.py --compare-gc)",
                   "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:]),
                   "load_avg_1m_at_start": load, "cpu_count": os.cpu_count(), "rows": rows},
                  open(out, "w"), indent=1)
        return
    if args.calls:
        rows = []
        for kind in args.kinds.split(","):
            for mix in args.mixes.split(","):
                for n in map(int, args.seqs.split(",")):
                    calls = _Calls()
                    r = {**measure(n, args.steps, mix, tok, config, kind, not args.no_gc_freeze,
                                   calls), **calls.per_step(args.steps)}
                    rows.append(r)
                    print(f"{kind} {mix} {n} seqs: {r['calls_per_step']:.0f} calls per step")
        out = Path(args.out).with_name("host_overhead_calls.json")
        json.dump({"what": "Python function calls per decode step, device stubbed "
                           "(bench/host_overhead.py --calls; times are under the profiler)",
                   "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:]),
                   "commit": _commit(), "load_avg_1m_at_start": load,
                   "cpu_count": os.cpu_count(), "rows": rows},
                  open(out, "w"), indent=1)
        return
    if args.phases:
        rows = []
        for kind in args.kinds.split(","):
            for mix in args.mixes.split(","):
                for n in map(int, args.seqs.split(",")):
                    ph = _Phases()
                    try:
                        r = measure(n, args.steps, mix, tok, config, kind, not args.no_gc_freeze, ph)
                    finally:
                        ph.restore()
                    r["ms_per_step_by_stage"] = {k.strip(): v / args.steps for k, v in ph.ms.items()}
                    rows.append(r)
                    print(f"{kind} {mix} {n} seqs: step median {r['median_ms']:.2f} ms (stages wrapped)")
                    for label, v in ph.ms.items():
                        print(f"  {label:26s} {v / args.steps:6.3f} ms")
        out = Path(args.out).with_name("host_overhead_phases.json")
        json.dump({"what": "host ms per decode step by stage, device stubbed, per output kind "
                           "(bench/host_overhead.py --phases); nested stages are included in "
                           "their parent's time",
                   "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:]),
                   "load_avg_1m_at_start": load, "cpu_count": os.cpu_count(), "rows": rows},
                  open(out, "w"), indent=1)
        return
    # Streaming outputs every step (a library caller's default), deltas (what the HTTP and
    # gRPC servers ask for), or only the final one (LLM.generate).
    traces = []
    for rep in range(args.reps):  # whole rounds: a slow minute of the host lands on one rep
        for kind in args.kinds.split(","):
            for mix in args.mixes.split(","):
                for n in map(int, args.seqs.split(",")):
                    trace: list = []
                    # (Not in lockstep: an A/B times the child's steps only.)
                    msgs = [] if kind == "engine_process" and BATON is None else None
                    r = {**measure(n, args.steps, mix, tok, config, kind, not args.no_gc_freeze,
                                   trace=trace, messages=msgs), "rep": rep}
                    if msgs:  # the parent's side of the same steps, off the child's time
                        r |= front_end(msgs)
                        print(f"  front end: {r['front_end_as_sent_median_ms']:.3f} ms a step "
                              f"as sent, {r['front_end_as_rows_median_ms']:.3f} as rows",
                              flush=True)
                    rows.append(r)
                    traces.append({k: r[k] for k in ("rep", "output_kind", "mix", "num_seqs")}
                                  | {"step_ms_and_probe_us": trace})
                    print(f"rep {rep} {kind:10s} {mix:6s} {n:5d} seqs: median "
                          f"{r['median_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms (at the fast "
                          f"speed {r['p99_speed_adjusted_ms']:.2f}; probe median "
                          f"{r['probe_us_median']:.0f} us, p10 {r['probe_us_p10']:.0f}; "
                          f"collections {r['gc_collections']})", flush=True)
    if args.trace:
        json.dump(traces, open(args.trace, "w"))
    res = {"what": "host ms per decode step, device calls stubbed (bench/host_overhead.py)",
           "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:]),
           "load_avg_1m_at_start": load, "cpu_count": os.cpu_count(),
           "python": sys.version.split()[0], "engine_args": ENGINE_ARGS, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json.dump(res, open(out, "w"), indent=1)
    plot(res, out.with_suffix(".png"))


def plot(res: dict, path: Path) -> None:
    """Each configuration's median per rep (dots) and p99 (crosses), by output kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    configs = list(dict.fromkeys((r["output_kind"], r["mix"], r["num_seqs"]) for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(configs), 4))
    for x, cfg in enumerate(configs):
        mine = [r for r in rows if (r["output_kind"], r["mix"], r["num_seqs"]) == cfg]
        ax.scatter([x] * len(mine), [r["median_ms"] for r in mine], color="C0",
                   label="median per rep" if x == 0 else None)
        ax.scatter([x] * len(mine), [r["p99_ms"] for r in mine], color="C3", marker="x",
                   label="p99 per rep" if x == 0 else None)
    ax.set_xticks(range(len(configs)),
                  [f"{k}\n{m}, {n} seqs" for k, m, n in configs], fontsize=7)
    ax.set_ylabel("host ms per decode step (device stubbed)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"bench/host_overhead.py, load {res['load_avg_1m_at_start']:.2f} at start",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
