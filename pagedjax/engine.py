"""`LLMEngine`: request → scheduler → block manager → model runner → sampler → output.

One `step()` is one iteration of continuous batching (paper §4.5, thesis §4.2): the
scheduler picks Δ tokens per sequence, the runner executes them in one jitted call, the
sampler picks next tokens, and the engine applies them. The engine is the core loop only;
each other job has its own module:

- `input_processor.py`: validation, tokenization, admission control for growth;
- `core/`: the scheduler (Δ tokens, preemption) and the KV manager (blocks, CoW, prefix cache);
- `worker/`: the model runner and its device state (KV cache, step shapes);
- `sampler.py`: sampling on device; `beam_steps.py`: beam candidates and forks;
- `output_processor.py`: stop checks, incremental detokenization, `RequestOutput`s.
Nothing here knows about networks.

Memory sharing (paper §4.4): an n>1 / best_of request computes its prompt once and forks the
samples from it (`Sequence.fork` + `Scheduler.fork_seq`), so they share the prompt's blocks
and copy-on-write only the partially filled last block. Beam search
(`SamplingParams(use_beam_search=True, best_of=W)`) picks candidates for every live beam of
every beam request on device in one call per step; the host forks surviving parents into
children (sharing all blocks) and frees dropped beams, so copies happen only for a shared
partially filled block. Beam EOS ids are the model's EOS plus the request's `stop_token_ids`
(min_tokens and stop strings do not apply to beams); the n best finished beams by
length-penalised score are returned, live beams joining the finished ones when `max_tokens`
is reached.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from pagedjax.beam_search import beam_candidates_from_rows
from pagedjax.beam_steps import BeamSearcher, warm_selection_shapes
from pagedjax.config import EngineConfig
from pagedjax.core import (
    SampledToken,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
    SequenceGroup,
    TokenStops,
)
from pagedjax.core.block_manager import PrefixHandle
from pagedjax.core.policies import make_kv_manager, make_scheduler
from pagedjax.core.scheduler import PENDING_TOKEN, new_tuple
from pagedjax.core.sequence import SequenceStatus
from pagedjax.input_processor import OUTPUT_KINDS, InputProcessor, check_priority
from pagedjax.output_processor import OutputProcessor, RequestState
from pagedjax.outputs import RequestOutput
from pagedjax.sampler import (
    DeviceFill,
    SamplerOutput,
    SamplingMetadata,
    SeqSamplingState,
    prompt_logprobs,
    raw_logprob_rows,
    sample,
    sample_greedy,
    sample_greedy_hidden,
    take_rows,
)
from pagedjax.sampling_params import (
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from pagedjax.spec import NgramProposer, accepted_prefix
from pagedjax.spec.draft import DraftModelProposer
from pagedjax.structured.manager import StructuredOutputs
from pagedjax.worker.cohort_metadata import CohortMetadata
from pagedjax.worker.compile_stats import memory_maps, num_backend_compiles
from pagedjax.worker.device_histories import HistorySlots
from pagedjax.worker.host_heap import release_freed_memory
from pagedjax.worker.input_batch import InputBatch
from pagedjax.worker.model_runner import ModelRunner, kv_bytes_per_block
from pagedjax.worker.parallel_warmup import run_bounded, warmup_memory_budget, warmup_threads
from pagedjax.worker.sampling_batch import SamplingBatch
from pagedjax.worker.shapes import pow2_at_least
from pagedjax.worker.step_inputs import build_step_inputs, steady_decode_inputs

MAX_WARM_BEAM_WIDTH = 8
YOUNG_GC_THRESHOLD = 10_000  # `LLMEngine.freeze_gc`
WARMUP_TEMPS_PER_LOGIT = 4  # a sampler call's [rows, vocab] arrays, logits included (warm-up)
# Warm-up warns past this share of the process's memory-mapping limit: later compiles (beams
# wider than MAX_WARM_BEAM_WIDTH) need room too (`worker.compile_stats.memory_maps`). The
# full warm-up at max_num_seqs 256 leaves ~68 % of Linux's default limit on CPU.
MAX_MAP_SHARE = 0.8

logger = logging.getLogger(__name__)
# Plain greedy batches sample through `sample_greedy`; PAGEDJAX_GREEDY_FAST_PATH=0 sends them
# through `sample` (`bench/offline_throughput.py --engines pagedjax,pagedjax-sampler-full`).
GREEDY_FAST_PATH = os.environ.get("PAGEDJAX_GREEDY_FAST_PATH", "1") != "0"


def _warn_near_map_limit() -> bool:
    """Log a warning, and return True, when this process holds more than `MAX_MAP_SHARE` of
    its memory-mapping limit (after warm-up: compiled CPU code takes ~3 per kernel, and XLA
    aborts the process at the limit)."""
    maps = memory_maps()
    if maps is None or maps[0] <= MAX_MAP_SHARE * maps[1]:
        return False
    logger.warning(
        "warm-up left this process %d memory mappings of vm.max_map_count=%d: compiled CPU "
        "code takes ~3 per kernel, and XLA aborts the process at the limit. Raise it "
        "(sysctl -w vm.max_map_count=262144) or lower max_num_seqs / max_model_len.", *maps)
    return True


@functools.cache
def _identity_rows(b: int) -> np.ndarray:
    """Rows 0 .. b-1 in order (read-only, shared): `LLMEngine._sampler_rows`."""
    rows = np.arange(b, dtype=np.int32)
    rows.flags.writeable = False
    return rows


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks: int
    num_free_gpu_blocks: int
    kv_cache_usage: float
    num_preemptions_total: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int
    last_step_tokens: int
    num_compiles: int  # XLA compilations in this process so far
    num_cache_rebuilds: int = 0  # KV caches lost in a failed step and reallocated
    num_step_failures: int = 0  # steps, or the scheduling of one group, that raised
    healthy: bool = True  # False while a lost KV cache is not rebuilt yet
    # Speculative decoding (zero without it): draft tokens scored, accepted, and accepted per
    # draft position (index j: drafts accepted at position j + 1 of a step's proposal).
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_drafts: int = 0  # steps of a sequence that carried drafts
    spec_accepted_per_position: tuple[int, ...] = ()
    # Drafts proposed at each position (index j: steps whose proposal had a (j + 1)-th token).
    # n-gram proposals can be shorter than num_speculative_tokens, so the acceptance rate at
    # position j is accepted[j] / drafted[j], not accepted[j] / spec_num_drafts.
    spec_drafted_per_position: tuple[int, ...] = ()
    # Memory (README "Memory"): the KV cache's storage dtype, bytes one token's K and V take
    # over all layers, the whole cache's bytes, and the weights' bytes as held on the
    # device(s) (all of them together under tensor parallelism).
    kv_cache_dtype: str = ""
    kv_bytes_per_token: int = 0
    kv_cache_bytes: int = 0
    weights_bytes: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_num_accepted_tokens / max(1, self.spec_num_draft_tokens)

    @property
    def spec_acceptance_rate_per_position(self) -> tuple[float, ...]:
        return tuple(a / max(1, d) for a, d in zip(self.spec_accepted_per_position,
                                                   self.spec_drafted_per_position))

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a drafted sequence gained per step: accepted drafts + the target's one."""
        return 1 + self.spec_num_accepted_tokens / max(1, self.spec_num_drafts)



@dataclasses.dataclass
class _InFlight:
    """A step launched on the device whose results the host has not collected yet."""

    sched: SchedulerOutput
    row_info: list[tuple] | None = None  # (request, sequence, sample index, fan-out) per row
    out: SamplerOutput | None = None  # on the device until `_finish`
    scored: object = None  # prompt logprobs, on the device
    p_plan: list = dataclasses.field(default_factory=list)
    beam_groups: list = dataclasses.field(default_factory=list)
    beam_cands: object = None
    host_beam_cands: list = dataclasses.field(default_factory=list)
    num_device_beam_groups: int = 0
    tokens: jax.Array | None = None  # sampled ids padded for the next step's feed
    # Sequence id -> its row, for sequences given a pending token by this step.
    pending_rows: dict[int, int] = dataclasses.field(default_factory=dict)
    # Speculative decoding: sequence id -> (first row, drafts) of sequences with drafts.
    spec_rows: dict[int, tuple[int, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    # Of those, the sequences whose drafts follow a guess of their pending token (async).
    guessed: set[int] = dataclasses.field(default_factory=set)
    # Every row is the one token of a plain request's lone sequence (`LLMEngine._rows_for`):
    # its tokens take `_apply_plain`.
    plain: bool = False
    # The next step cannot be scheduled before this one's tokens are applied: beams and
    # fan-outs fork on the host. (Penalised rows get their pending token into the sampler's
    # history on the device: `ModelRunner.merge_pending_history`.)
    needs_sync: bool = False
    # The delta outputs `OutputProcessor.stream_rows` made while applying a steady step.
    made: list[RequestOutput] | None = None


class LLMEngine:
    CACHE_RETRY_S = 0.5  # pause between attempts to rebuild a lost KV cache
    output_kinds = OUTPUT_KINDS  # what `add_request` takes ("delta_ids": text-free deltas)
    _pipe_rows = False

    @property
    def pipe_rows(self) -> bool:
        """Set by the engine process's child: `step` returns a running text-free
        one-sequence delta as its pipe row (`OutputProcessor.delta_row`) instead of a
        `RequestOutput`."""
        return self._pipe_rows

    @pipe_rows.setter
    def pipe_rows(self, on: bool) -> None:
        self._pipe_rows = bool(on)
        # Steady cohorts were classified, and their columns made, for the other row kind.
        self._steady_kind = None
        if hasattr(self, "outputs"):
            self.outputs.forget_stream_columns()

    def __init__(self, config: ModelConfig, params: dict, tokenizer,
                 engine_config: EngineConfig | None = None,
                 dtype=jnp.float32, model_name: str = "model"):
        self.model_config = config
        self.tokenizer = tokenizer
        self.engine_config = ec = engine_config or EngineConfig()
        self.model_name = model_name
        self.dtype = dtype
        self.max_model_len = ec.max_model_len or min(config.max_position_embeddings, 4096)
        params = self._quantized(config, params, ec.quantization)
        self._param_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.runner = ModelRunner(config, params, ec, dtype, self.max_model_len)
        self.kv_scales = self._calibrate_kv_scales()
        self._memory: dict | None = None
        # kv_policy "paged" is the paper's design; the others are the contiguous-cache
        # baselines of its evaluation (same engine, same kernels, different memory manager).
        self.block_manager = make_kv_manager(
            ec.kv_policy, self.runner.num_gpu_blocks, self.runner.num_cpu_blocks, ec.block_size,
            enable_prefix_caching=ec.enable_prefix_caching, max_model_len=self.max_model_len,
            layout=self.runner.kv_layout, max_chunk_tokens=ec.max_num_batched_tokens)
        self.scheduler = make_scheduler(ec.kv_policy, SchedulerConfig(
            max_model_len=self.max_model_len, max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            enable_chunked_prefill=ec.enable_chunked_prefill, preemption_mode=ec.preemption_mode,
            policy=ec.scheduling_policy), self.block_manager)
        self.spec_config = ec.speculative_config
        self.draft: DraftModelProposer | None = None
        if self.spec_config is not None:
            sc = self.spec_config
            if sc.method == "draft_model":
                self.draft = self._draft_proposer(sc, config, dtype)
                self.scheduler.proposer = self.draft
            else:
                self.scheduler.proposer = NgramProposer(
                    sc.num_speculative_tokens, sc.prompt_lookup_min, sc.prompt_lookup_max)
        self._spec_drafted = self._spec_accepted = self._spec_steps = 0
        self.num_guessed_accepted = 0  # accepted drafts that followed a guessed pending token
        self._spec_by_pos = [0] * (self.spec_config.num_speculative_tokens
                                   if self.spec_config else 0)
        self._spec_drafted_by_pos = [0] * len(self._spec_by_pos)
        self.eos_token_ids = set(config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        # Fixed widths of the sampler's ban lists and penalty histories (see sampler.py):
        # every request fits, so their shapes never depend on requests.
        # Ban lists hold min_tokens' stop ids and EOS, and a bad word's last token (two
        # tokenizations each).
        self._ban_width = pow2_at_least(MAX_STOP_TOKEN_IDS + len(self.eos_token_ids)
                                        + 2 * MAX_BAD_WORDS)
        self._bias_width = pow2_at_least(MAX_LOGIT_BIAS)
        self.inputs = InputProcessor(tokenizer, config.vocab_size, self.max_model_len,
                                     ec.max_num_seqs, self.block_manager)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.structured = StructuredOutputs(tokenizer, config.vocab_size,
                                            ec.structured_outputs_config["backend"])
        self.beams = BeamSearcher(self.scheduler, self.outputs, self._new_seq_id)
        # Persistent per-sequence step state (block tables by deltas); rows of sequences that
        # end are released after each step, and rows it never hears about are swept.
        device_tables = (ec.device_block_tables if ec.device_block_tables is not None
                         else self.runner.mesh is None)
        if device_tables:
            # The batch's rows stay below 4 x max_num_seqs plus one step's new sequences
            # (it sweeps itself when it reaches 4 x).
            self.runner.enable_device_tables(rows=5 * ec.max_num_seqs)
        self.input_batch = InputBatch(self.runner.max_blocks_per_seq,
                                      max_rows=4 * ec.max_num_seqs,
                                      num_groups=self.runner.num_kv_groups,
                                      device_tables=device_tables)
        # Penalised sequences' prompt and output ids on the device, extended by deltas: two
        # slots per row of the largest sampler batch, so a slot is reused only after its
        # sequence ended or left the running batch for that long.
        device_hist = (ec.device_penalty_histories if ec.device_penalty_histories is not None
                       else self.runner.mesh is None)
        self.history_slots: HistorySlots | None = None
        if device_hist:
            slots = 2 * self.runner.shape_plan.sample_cap
            self.runner.enable_device_histories(slots, self.max_model_len)
            self.history_slots = HistorySlots(slots, self.max_model_len)
        # ... and their sampling parameters, written once per (sequence, sample index).
        self.sampling_batch = SamplingBatch(config.vocab_size, 4 * self.runner.shape_plan.seq_cap,
                                            eos_token_ids=sorted(self.eos_token_ids),
                                            engine_seed=ec.seed)
        # Its fixed-width ban, mask and bias arrays as device arrays, empty ones cached
        # (`DeviceFill`); a mesh keeps numpy arguments, which jit places on it.
        self._meta_fill = DeviceFill() if self.runner.mesh is None else None
        # A steady cohort's sampling metadata, kept across its steps where only the rows'
        # token counts change (`worker.cohort_metadata`).
        self.cohort_meta = CohortMetadata(config.vocab_size, self._meta_fill)
        # Sequence id -> its sampled row's (request, sequence, sample index, fan-out), for
        # plain sequences (`_rows_for`); dropped when they end, cleared when it outgrows
        # 4 x max_num_seqs (aborted ones are not dropped one by one).
        self._plain_rows: dict[int, tuple] = {}
        # Per steady cohort (`core.steady_decode`), keyed by `DecodeCohort.key`: its
        # `_rows_for` result, its `_plain_greedy` answer (when no row's min_tokens can change
        # it) and how its rows are applied (`_steady_classes`; which stays so).
        self._steady_rows: tuple[int, tuple] | None = None
        self._steady_plain: tuple[int, int] | None = None
        self._steady_kind: tuple[int, bool, bool, list[int]] | None = None
        self._steady_caps: tuple[int, list[int]] | None = None  # `_pending_caps`
        warm = ec.warmup if ec.warmup is not None else jax.default_backend() != "cpu"
        if warm:
            self.warmup()
        self._requests: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []
        self._inflight: _InFlight | None = None  # async scheduling: the step on the device
        self._seq_ids = itertools.count()
        self._request_counter = itertools.count()
        self._weights_version = 0
        self.num_steps = 0
        # Sampling defaults servers apply to requests that leave a field unset (`serve
        # --generation-config`); the Python API uses `SamplingParams`' own.
        self.default_sampling: dict = {}
        self.num_cache_rebuilds = 0
        self.num_step_failures = 0  # steps (or scheduling of a group) that raised
        self._cache_broken = False
        self.prompt_tokens_total = 0
        self.last_step_tokens = 0
        # Ids of requests not scheduled yet, and of requests that want prompt logprobs: the
        # step's passes for them run only while there are any (a decode step's 256 entries
        # would each be looked up for nothing). Pruned of departed requests as they are read.
        self._unscheduled: set[str] = set()
        self._prompt_lp_ids: set[str] = set()
        # Ids of requests with an output after every step that advances them (`streams`):
        # with none, a step's outputs are those of the groups it finished.
        self._streaming_ids: set[str] = set()

    # The KV manager and scheduler can be replaced on an idle engine (bench/paper swaps kv
    # policies); the modules that use them follow.
    @property
    def block_manager(self):
        return self._block_manager

    @block_manager.setter
    def block_manager(self, bm) -> None:
        self._block_manager = bm
        if hasattr(self, "inputs"):
            self.inputs.block_manager = bm

    @property
    def scheduler(self):
        return self._scheduler

    @scheduler.setter
    def scheduler(self, scheduler) -> None:
        self._scheduler = scheduler
        if hasattr(self, "beams"):
            self.beams.scheduler = scheduler

    @classmethod
    def from_model(cls, model: str = "smollm2", dtype=None, *, tokenizer: str | None = None,
                   chat_template: str | None = None, served_model_name: str | None = None,
                   **kwargs) -> LLMEngine:
        """Load ``model`` (GGUF file, HF folder, converted checkpoint or packaged name);
        ``tokenizer``: a tokenizer folder or file to use instead of the model's;
        ``chat_template``: a Jinja template (or a file holding one) replacing the tokenizer's;
        ``served_model_name``: the name clients address it by (default: ``model``); the other
        keywords are `EngineConfig` fields."""
        from models.loader import load_model, read_config, resolve_dtype
        from models.tokenizer import load_tokenizer

        engine_config = EngineConfig(**kwargs)  # validated before loading weights
        tp = engine_config.tensor_parallel_size
        if tp > 1:  # a bad split fails here, not after minutes of loading
            from pagedjax.parallel import validate_tp

            validate_tp(read_config(model), tp,
                        expert_parallel=engine_config.enable_expert_parallel)
        config, params, path = load_model(model, dtype, tensor_parallel_size=tp,
                                          quantization=engine_config.quantization)
        tok = load_tokenizer(tokenizer or path)
        if chat_template is not None:
            p = Path(chat_template)
            tok.chat_template = p.read_text() if p.is_file() else chat_template
        engine = cls(config, params, tok, engine_config, resolve_dtype(dtype),
                     served_model_name or str(model))
        del params  # the engine holds its own placed copy: give the loaded one back
        release_freed_memory()
        return engine

    # ---- warm-up -----------------------------------------------------------
    def warmup(self) -> int:
        """Compile everything serving can run, so no request ever waits on a compile: the
        step at every shape of the runner's `ShapePlan`, block copies and swaps, and for every
        logits shape the sampler (plain and penalised/banned variants), prompt logprobs and
        beam candidate selection. Returns the number of XLA compilations it took."""
        before, t0 = num_backend_compiles(), time.monotonic()
        threads = warmup_threads()
        try:
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                shapes = self._warmup_calls(pool)
        except Exception as e:
            # Side-by-side compilation is new on GPUs (Triton lowering, autotuning, memory
            # beside a full KV cache): a failure there falls back to the one-at-a-time order,
            # and an error that is not about concurrency fails again there and is raised.
            if threads == 1:
                raise
            logger.warning("parallel warm-up failed (%s: %s); warming up one call at a time",
                           type(e).__name__, e)
            threads = 1
            shapes = self._warmup_calls(None)
        n = num_backend_compiles() - before
        logger.info("warm-up: %d step shapes, %d compilations in %.1f s (%d threads)", len(shapes),
                    n, time.monotonic() - t0, threads)
        _warn_near_map_limit()
        return n

    def _warmup_calls(self, pool: concurrent.futures.Executor | None) -> list[tuple]:
        """Warm-up's compilations; returns the step shapes. Independent compilations run side by
        side in ``pool`` (XLA compiles with the GIL released; on a GPU one step shape of an 8B
        model compiles and autotunes for seconds, and the one-at-a-time warm-up of a 13B-like
        engine, 31 step shapes and ~500 sampler and beam variants, had not finished after 276 s
        on an H200: `worker.parallel_warmup`). Sampler and beam calls are pure, so they run in
        the pool as they are, admitted by their logits' bytes; the steps donate the KV cache, so
        the runner compiles them in the pool and then runs them one at a time
        (`ModelRunner.warmup`). ``pool`` None: one call at a time."""
        shapes = self.runner.warmup(prompt_logprobs=True, pool=pool)
        self.runner.warmup_token_feed(history_width=self.max_model_len)
        calls = self._warmup_sampler_calls(shapes)
        if pool is None:
            for _, thunk in calls:
                thunk()
        else:
            run_bounded(pool, calls, warmup_memory_budget())
        return shapes

    def _warmup_sampler_calls(self, shapes: list[tuple]) -> Iterator[tuple[int, Callable[[], object]]]:
        """(bytes, thunk) per sampler, prompt-logprob and beam-selection compilation of
        warm-up: each thunk runs its function once on zero logits it allocates itself (so only
        the calls in flight hold any), and ``bytes`` bounds what it allocates."""
        plan = self.runner.shape_plan
        vocab = self.model_config.vocab_size
        dummy = SamplingParams(max_tokens=1)
        full = SamplingParams(max_tokens=2, min_tokens=1, repetition_penalty=1.1)
        dev = jax.local_devices()[0]  # the step's logits are committed there: same jit key

        def call(n: int, f: Callable, *args, **kw) -> tuple[int, Callable[[], object]]:
            def thunk() -> object:
                zeros = jax.device_put(jnp.zeros((n, vocab), jnp.float32), dev)
                return jax.block_until_ready(f(zeros, *args, **kw))
            # The logits and a few [rows, vocab] temporaries (log-softmax, masks, top-k).
            return WARMUP_TEMPS_PER_LOGIT * 4 * n * vocab, thunk

        def screened(n: int, rows: np.ndarray) -> tuple[int, Callable[[], object]]:
            """`sample_greedy_hidden` on ``n`` hidden rows of ones (zeros would make every
            column a candidate: a slow first call for nothing)."""
            hidden_size = self.model_config.hidden_size

            def thunk() -> object:
                ones = jax.device_put(jnp.ones((n, hidden_size), jnp.float32), dev)
                return jax.block_until_ready(sample_greedy_hidden(
                    ones, rows, self.runner.head_screen, self.runner.head_panels,
                    num_logprobs=MAX_LOGPROBS))
            return 4 * n * hidden_size, thunk

        sampled: set[int] = set()  # batch sizes whose `sample` variants are compiled
        for _t, s, _m, r, _decode in shapes:
            # Speculative steps sample up to one row per logits row, plus a fresh n>1
            # prompt's fan-out: more rows than sequences.
            most = pow2_at_least(r + plan.max_num_seqs) if plan.spec_tokens else 0
            spec_batches = [b for b in plan.sample_buckets if plan.seq_cap < b <= most]
            for b in {self._sample_batch(1, s), plan.seq_cap, *spec_batches}:
                rows = np.zeros(b, np.int32)
                yield call(r, sample_greedy, rows, num_logprobs=MAX_LOGPROBS,
                           native=self.runner.native_greedy)
                if self.runner.head_screen is not None:
                    yield screened(r, rows)
                if r != b:  # `sample` takes gathered rows (`_sampler_rows`)
                    yield call(r, take_rows, rows)
                if b in sampled:
                    continue
                sampled.add(b)
                if self.runner.native_sampler:  # beams' raw rows (`raw_logprob_rows`)
                    yield call(b, raw_logprob_rows, rows)
                for p in (dummy, full):
                    meta = self._sampling_metadata([(p, SeqSamplingState([0], []))], b)
                    if p is full and self.history_slots is not None:
                        # Histories gathered on the device (`_device_histories`): both
                        # committed arrays, another jit key than the host-packed ones.
                        meta = meta.replace(**{k: jax.device_put(getattr(meta, k), dev)
                                               for k in ("output_token_ids",
                                                         "prompt_token_ids")})
                        yield call(b, sample, meta, num_logprobs=MAX_LOGPROBS, rows=rows,
                                   native=self.runner.native_sampler,
                                   chunked=self.runner.chunked_top_k)
                        continue
                    yield call(b, sample, meta, num_logprobs=MAX_LOGPROBS, rows=rows,
                               native=self.runner.native_sampler,
                               chunked=self.runner.chunked_top_k)
                    if p is full and self.runner.feed_tokens:
                        # Async scheduling writes pending tokens into the histories on the
                        # device (`merge_pending_history`): a committed array is another
                        # jit key than the host one.
                        meta = meta.replace(output_token_ids=jax.device_put(
                            meta.output_token_ids, dev))
                        yield call(b, sample, meta, num_logprobs=MAX_LOGPROBS, rows=rows,
                                   native=self.runner.native_sampler,
                                   chunked=self.runner.chunked_top_k)
            if r > s:
                rows = np.zeros(r, np.int32)
                yield call(r, prompt_logprobs, rows, MAX_LOGPROBS, rows=rows,
                           chunked=self.runner.chunked_top_k)
        # Beam selection per (batch, groups, width) bucket, beam widths up to 8 (wider beams
        # compile on first use): every shape `BeamSearcher.candidates` can give.
        for b, g, w in warm_selection_shapes(plan.seq_buckets, MAX_WARM_BEAM_WIDTH,
                                             plan.max_num_seqs):
            z = np.zeros((g, w), np.int32)  # beams never run with speculation: seq buckets
            yield call(b, beam_candidates_from_rows, z, z.astype(np.float32), z.astype(bool), 2 * w)

    # ---- requests ----------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | dict | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    output_kind: str = "cumulative", strict_limits: bool = False,
                    priority: int = 0) -> None:
        """Queue a request. Raises ValueError naming the bad field; the engine is unaffected.

        `priority` (vLLM's): with `scheduling_policy="priority"`, lower values run first and
        may preempt running requests of a higher value; any other policy takes only 0.

        `output_kind` (vLLM's `RequestOutputKind`): "cumulative" returns the request's whole
        output after every step that advanced it (streaming); "delta" returns, after every
        such step, only what is new since its last output (tokens, text, logprobs: per step
        work that does not grow with the output; with stop strings the text's last
        `len(longest stop) - 1` characters wait, since a stop string may still cut them);
        "final_only" returns one output when it finishes (offline batches); "delta_ids" is
        "delta" without text, never detokenized here (a front end in another process decodes
        the ids, `EngineProcess`), for requests without stop strings or beams (best_of > n:
        its one output at the end, the chosen samples' whole ids).

        `strict_limits` (the servers pass True): refuse a request whose prompt + `max_tokens`
        exceeds `max_model_len` (as vLLM's OpenAI server does) or whose samples, all grown to
        that length, would need more KV blocks than the whole cache (`check_growth`), instead
        of running it for seconds and cutting it short. Without it (the Python API) such a
        request runs and ends with finish_reason "length" where it hits the limit."""
        if isinstance(request_id, str) and request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        check_priority(priority, self.engine_config.scheduling_policy)
        r = self.inputs.process(request_id, prompt, params, prompt_token_ids, output_kind,
                                strict_limits)
        if self.spec_config is not None and r.params.use_beam_search:
            raise ValueError("use_beam_search: not supported with speculative decoding "
                             "(speculative_config is set on this engine)")
        p = r.params
        grammar = self.structured.compile(p.guided_decoding) if p.guided_decoding else None
        allowed, bad_words = self._token_rules(p)
        seq = Sequence(self._new_seq_id(), r.prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stops = TokenStops(frozenset() if p.ignore_eos else frozenset(self.eos_token_ids),
                           frozenset(p.stop_token_ids or ()), p.min_tokens)
        group = SequenceGroup(request_id, [seq], arrival, max_tokens=p.max_tokens,
                              n=r.num_samples, model_id=self.model_id, stops=stops,
                              request_priority=int(priority),
                              # Prompt logprobs need every position computed: such a request
                              # takes no prefix-cache hits (its blocks are still published).
                              read_prefix_cache=p.prompt_logprobs is None)
        self.scheduler.add_seq_group(group)  # raises ValueError for impossible requests
        req = RequestState(request_id, r.prompt, r.prompt_token_ids, r.params, group,
                           next(self._request_counter), arrival,
                           final_only=output_kind == "final_only",
                           delta=output_kind in ("delta", "delta_ids"),
                           text_free=output_kind == "delta_ids", grammar=grammar,
                           allowed_mask=allowed, bad_words=bad_words)
        req.register(seq, 0)
        self._requests[request_id] = req
        self._unscheduled.add(request_id)
        if p.prompt_logprobs is not None:
            self._prompt_lp_ids.add(request_id)
        if req.streams:
            self._streaming_ids.add(request_id)

    def _token_rules(self, p: SamplingParams) -> tuple[np.ndarray | None, list[list[int]]]:
        """`allowed_token_ids` as a packed bitmask, and `bad_words` as token sequences (each
        word alone and after a space, as vLLM tokenizes them); token ids checked against
        the vocabulary."""
        vocab = self.model_config.vocab_size
        for name, ids in (("logit_bias", p.logit_bias or ()), ("allowed_token_ids",
                                                               p.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name}: token ids {bad[:5]} are not below the vocabulary "
                                 f"size {vocab}")
        allowed = None
        if p.allowed_token_ids:
            bits = np.zeros(self.structured.mask_width * 32, np.uint8)
            bits[p.allowed_token_ids] = 1
            allowed = np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little") \
                .view("<u4").ravel().view(np.int32)
        words: list[list[int]] = []
        if p.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: this engine has no tokenizer")
            for w in p.bad_words:
                for text in (w.lstrip(), " " + w.lstrip()):
                    ids = self.tokenizer.encode(text, add_special_tokens=False)
                    if ids and ids not in words:
                        words.append(ids)
        return allowed, words

    # Checks the front doors run before queueing (see `InputProcessor`).
    @property
    def max_prompt_chars(self) -> int:
        return self.inputs.max_prompt_chars

    def check_prompt_text(self, prompt, field: str = "prompt") -> None:
        self.inputs.check_prompt_text(prompt, field)

    def check_growth(self, prompt_len: int, max_tokens: int, samples: int = 1) -> None:
        self.inputs.check_growth(prompt_len, max_tokens, samples)

    def max_output_tokens(self, prompt_len: int, samples: int = 1) -> int:
        return self.inputs.max_output_tokens(prompt_len, samples)

    @property
    def generation_tokens_total(self) -> int:
        return self.outputs.generation_tokens_total

    @property
    def model_id(self) -> str:
        """Part of every prefix-cache key: KV computed with other weights is never reused."""
        return f"{self.model_name}@{self._weights_version}"

    def register_prefix(self, token_ids: list[int]) -> PrefixHandle:
        """Pin the cached full blocks of a prefix (see `LLM.register_prefix`, which runs it first)."""
        return self.block_manager.register_prefix(token_ids, model_id=self.model_id)

    def unpin_prefix(self, handle: PrefixHandle) -> None:
        self.block_manager.unpin(handle)

    def abort_request(self, request_id: str | Iterable[str], withdraw: bool = False) -> None:
        """Abort between steps: blocks are freed now, an 'abort' output comes from the next step.

        ``withdraw``: no output at all, for a request whose admission the caller undid (a
        sibling prompt was refused): nobody listens for it, and a new request may already
        reuse its id before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.abort_seq_group(rid)
            for seq in req.group.seqs:
                if not seq.status.is_finished:
                    seq.status = SequenceStatus.FINISHED_ABORTED
            if not withdraw:
                self._pending.append(self.outputs.make_output(req, final=True))

    def stop_samples(self, stops: Iterable[tuple[str, int, str]]) -> None:
        """Finish single samples ``(request_id, output index, stop string)`` between steps, for
        a stop string found outside the engine: `EngineProcess`'s front end decodes n > 1
        streams itself (vLLM V1 finds stop strings in its front end too). The sample's blocks
        are freed by the next step and a token it has on the device is dropped; its siblings
        run on. Stopping a request's last live sample ends the request, with its final output
        in the next step. Unknown requests and finished samples are ignored: the request may
        have ended in the engine before the front end's word arrived."""
        for rid, index, reason in stops:
            req = self._requests.get(rid)
            if req is None or req.is_beam:
                continue
            seq = next((s for s in req.group.seqs
                        if req.seq_index.get(s.seq_id) == index and not s.status.is_finished),
                       None)
            if seq is None:
                continue
            req.stop_reason[seq.seq_id] = reason
            if len(req.group.get_unfinished_seqs()) > 1:
                self.scheduler.stop_seq(seq, SequenceStatus.FINISHED_STOPPED, rid)
                continue
            # The last one: the request ends as an abort does, every sample's status kept.
            seq.status = SequenceStatus.FINISHED_STOPPED
            self.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- step --------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """False while the device KV cache is lost and not yet rebuilt (health checks say
        NOT_SERVING then); every `step` tries to rebuild it first."""
        return not self._cache_broken

    def step(self) -> list[RequestOutput]:
        """One iteration. With async scheduling (`EngineConfig.async_scheduling`) the step
        that the previous call launched is still running on the device: this call schedules
        and launches the next one first, then collects the previous one's tokens and builds
        its outputs while the new step runs, so the host's work hides behind the device's.
        Outputs then come one call later; they are identical either way."""
        outputs, self._pending = self._pending, []
        prev, self._inflight = self._inflight, None
        if prev is not None and (prev.needs_sync or not self.runner.feed_tokens):
            outputs += self._finish(prev)
            prev = None
        if self._cache_broken and not self._try_reset_cache():
            return outputs + (self._finish(prev) if prev is not None else [])
        new = self._schedule_and_launch(outputs, prev)
        if prev is not None:
            outputs += self._finish(prev)
        if new is not None:
            if self.runner.feed_tokens:
                self._inflight = new
            else:
                outputs += self._finish(new)
        return outputs

    def _drain(self) -> None:
        """Finish the step still on the device (before changing weights or the KV manager);
        its outputs come with the next `step`."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._pending += self._finish(prev)

    def _schedule_and_launch(self, outputs: list[RequestOutput], prev: _InFlight | None
                             ) -> _InFlight | None:
        """Schedule a step and launch it on the device (no host sync); requests that failed
        or could not be placed get their outputs in `outputs`."""
        try:
            if self.draft is not None:
                self._prepare_drafts()
            sched = self.scheduler.schedule()
        except Exception as exc:  # a bug: the scheduler guards each group, this is a last resort
            logger.exception("schedule() failed")
            error = f"internal error while scheduling: {type(exc).__name__}: {exc}"
            for g in list(self.scheduler.running) + list(self.scheduler.swapped):
                req = self._requests.pop(g.request_id, None)
                self.scheduler.abort_seq_group(g.request_id)
                if req is not None:
                    outputs.append(self.outputs.fail(req, error))
            self.num_step_failures += 1
            return None
        for g, error in sched.failed:
            self.num_step_failures += 1
            req = self._requests.pop(g.request_id, None)
            if req is not None:
                outputs.append(self.outputs.fail(req, f"internal error while scheduling: {error}"))
        for g in sched.rejected:
            req = self._requests.pop(g.request_id, None)
            if req is not None:
                self.scheduler.abort_seq_group(g.request_id)
                outputs.append(self.outputs.cut_short(req))
        if sched.is_empty:
            return None
        try:
            self.runner.swap_out(sched.blocks_to_swap_out)
            self.runner.swap_in(sched.blocks_to_swap_in)
            self.runner.copy_blocks(sched.blocks_to_copy)
            launched = (self._launch(sched, prev) if sched.steady is not None or sched.scheduled
                        else None)
        except Exception as exc:  # one bad step fails its requests, never the engine
            outputs += self._step_failed(sched, exc)
            return None
        self.num_steps += 1
        self.last_step_tokens = sched.num_batched_tokens
        self.scheduler.update_after_step(sched)
        if self._unscheduled and sched.steady is None:  # a steady run's were scheduled before
            self._first_chunks(sched)
        return launched

    def _first_chunks(self, sched) -> None:
        """Requests scheduled for the first time: what the prefix cache skipped, and when."""
        new, requests = self._unscheduled, self._requests
        for s in sched.scheduled:
            if s.request_id in new:
                new.discard(s.request_id)
                req = requests.get(s.request_id)
                if req is not None and req.num_cached_tokens is None:
                    req.num_cached_tokens = s.start_pos
                    req.first_scheduled_time = time.monotonic()
                    self.prompt_tokens_total += len(req.prompt_token_ids)
        new.intersection_update(requests.keys())

    def _step_failed(self, sched, exc: Exception, *, swapped: bool = True) -> list[RequestOutput]:
        """A step raised (launching it, or collecting its results): its requests fail, the
        engine goes on, and a lost KV cache is rebuilt."""
        logger.error("step failed", exc_info=exc)
        self.num_step_failures += 1
        error = f"internal error: {type(exc).__name__}: {exc}"
        outputs = []
        for g in sched.scheduled_groups:
            req = self._requests.pop(g.request_id, None)
            if req is not None:
                self.scheduler.abort_seq_group(g.request_id)
                outputs.append(self.outputs.fail(req, error))
        if swapped:  # groups swapped out in this step may hold CPU blocks never written
            swapped_now = {g.request_id for g in self.scheduler.swapped} & set(sched.preempted)
            for rid in swapped_now:
                req = self._requests.pop(rid, None)
                self.scheduler.abort_seq_group(rid)
                if req is not None:
                    outputs.append(self.outputs.fail(req, f"{error} (while swapping it out)"))
        if self.runner.cache_lost():
            outputs += self._rebuild_cache(error)
        return outputs

    def _finish(self, fl: _InFlight) -> list[RequestOutput]:
        """Collect a launched step's results (the step's one host sync), apply its tokens,
        free what finished and build the outputs of the requests it advanced."""
        outputs: list[RequestOutput] = []
        try:
            small, cands, scored = self.runner.fetch((fl.out, fl.beam_cands, fl.scored))
        except Exception as exc:  # a device error surfaces here, at the sync
            return self._step_failed(fl.sched, exc, swapped=False)
        if scored is not None:
            self.outputs.record_prompt_logprobs(fl.p_plan, scored)
        touched = set()
        if fl.row_info:
            beams = None
            if fl.beam_groups:
                cands = [jax.tree.map(lambda x, g=g: x[g], cands)
                         for g in range(fl.num_device_beam_groups)] + fl.host_beam_cands
                beams = (fl.beam_groups, cands)
            touched = self._apply_samples(fl, small, beams)
        done = self.scheduler.free_finished_seq_groups()
        ended = [s.seq_id for g in done for s in g.seqs] + self.beams.take_dropped()
        if ended:
            plain = self._plain_rows
            for sid in ended:
                plain.pop(sid, None)
            self.input_batch.release(ended)
            self.sampling_batch.release(ended)
            if self.history_slots is not None:
                self.history_slots.release(ended)
            if self.draft is not None:
                self.draft.release(ended)
        if len(self.structured):  # finished, aborted or failed sequences' matchers
            self.structured.retain({s.seq_id for req in self._requests.values()
                                    if req.grammar is not None for s in req.group.seqs
                                    if not s.is_finished()})
        requests, make_output = self._requests, self.outputs.make_output
        rows, delta_row = self.pipe_rows, OutputProcessor.delta_row
        streaming = self._streaming_ids
        if streaming:
            streaming.intersection_update(requests.keys())
        if fl.made:
            outputs.extend(fl.made)
        if not streaming:
            # Only final outputs: those of the advanced requests this step finished, each
            # in `done` (`LLM.generate`'s steps, without a pass over every request).
            touched = [g.request_id for g in done if g.request_id in touched]
        for rid in touched:
            req = requests.get(rid)
            if req is None:
                continue
            final = req.group.is_finished()
            if final:
                del requests[rid]
            elif not req.streams:
                continue
            if rows and req.sent and req.pipe_row:
                outputs.append(delta_row(req, final))
            else:
                outputs.append(make_output(req, final))
        return outputs

    def _rebuild_cache(self, error: str) -> list[RequestOutput]:
        """The failed call deleted the donated KV cache: allocate a fresh one so later steps
        work. Requests holding KV on the device lose it and fail; waiting requests (no KV yet)
        and swapped ones (their KV is in host memory) go on."""
        logger.error("the device KV cache was lost in a failed step: rebuilding it")
        outputs = []
        for g in list(self.scheduler.running):
            req = self._requests.pop(g.request_id, None)
            self.scheduler.abort_seq_group(g.request_id)
            if req is not None:
                outputs.append(self.outputs.fail(req, f"{error} (the KV cache was lost and rebuilt)"))
        self.block_manager.reset_prefix_cache()  # cached blocks held KV of the lost cache
        self._cache_broken = True
        self._try_reset_cache()
        return outputs

    def _try_reset_cache(self) -> bool:
        """Allocate a fresh device cache; on failure (e.g. the device is still out of memory)
        stay unhealthy and try again at the next step. Waiting and swapped requests wait."""
        try:
            self.runner.reset_cache()
            self.input_batch.invalidate()  # the device's block tables are zeros again
            if self.history_slots is not None:  # ... and its penalty histories
                self.history_slots.invalidate()
        except Exception:
            logger.exception("rebuilding the KV cache failed; retrying at the next step")
            time.sleep(self.CACHE_RETRY_S)  # no busy loop while the device recovers
            return False
        self._cache_broken = False
        self.num_cache_rebuilds += 1
        logger.info("KV cache rebuilt; serving again")
        return True

    def _rows_for(self, sched) -> tuple[list[int], list[tuple], list[int], bool]:
        """Logits rows per scheduled sequence (1 if it samples, else 0), the sampled rows, the
        logits row of each sampled row, and whether every row is plain (`_apply_plain`): a
        fresh prompt of an n>1 request has one logits row and fans out into n sampled rows,
        so the step's shape never depends on n. A steady step's (`SchedulerOutput.steady`)
        are its cohort's first step's when they were plain: the same sequences, in the same
        order, each row kept by sequence id anyway (below)."""
        run = sched.steady
        if run is None:
            return self._rows_for_entries(sched)
        c = run.cohort
        kept = self._steady_rows
        if kept is not None:
            if kept[0] == c.key:
                return kept[1]
            if c.parent is not None and kept[0] == c.parent[0]:  # cut down: rows cut alike
                old = kept[1][1]
                row_info = [old[i] for i in c.parent[1]]
                n = len(row_info)
                res = ([1] * n, row_info, list(range(n)), True)
                self._steady_rows = (c.key, res)
                return res
        res = self._rows_for_entries(sched)
        if res[3]:
            self._steady_rows = (c.key, res)
        return res

    def _rows_for_entries(self, sched) -> tuple[list[int], list[tuple], list[int], bool]:
        """`_rows_for` from the step's `ScheduledSeq` entries."""
        # A decode step at scale: one sampled row per entry, each one sequence's one sample
        # (`RequestState.plain_row`), else the general pass below. A plain sequence's row is
        # the same every step (it never forks), so it is kept by sequence id
        # (`_plain_rows`, dropped when the sequence ends) and a step's rows are looked up;
        # only a sequence's first plain step takes the loop below.
        scheduled = sched.scheduled
        cache = self._plain_rows
        if len(cache) > 4 * self.engine_config.max_num_seqs:  # ends that were never dropped
            cache.clear()
        get = cache.get
        if sched.num_decode_run == len(scheduled):  # one token each, no drafts: all sample
            row_info = [get(s.seq_id) for s in scheduled]
        else:
            row_info = []
            for s in scheduled:
                if not s.needs_logits or s.spec_token_ids:
                    return (*self._rows_for_general(sched), False)
                row_info.append(get(s.seq_id))
        if None in row_info:
            requests = self._requests
            for i, s in enumerate(scheduled):
                if row_info[i] is None:
                    req = requests[s.request_id]
                    seqs = req.group.seqs
                    if not (req.plain_row and len(seqs) == 1):
                        return (*self._rows_for_general(sched), False)
                    seq = seqs[0]
                    row_info[i] = cache[s.seq_id] = (req, seq, req.seq_index[seq.seq_id], False)
        n = len(row_info)
        return [1] * n, row_info, list(range(n)), True

    def _rows_for_general(self, sched) -> tuple[list[int], list[tuple], list[int]]:
        """`_rows_for` for any step: prefill chunks, fan-outs, several sequences, drafts."""
        rows_per_seq, row_info, row_src = [], [], []
        add_info, add_src, add_rows = row_info.append, row_src.append, rows_per_seq.append
        n_logits = 0
        requests = self._requests
        for s in sched.scheduled:
            if not s.needs_logits:
                add_rows(0)
                continue
            req = requests[s.request_id]
            seqs = req.group.seqs
            if req.one_sample and len(seqs) == 1 and not s.spec_token_ids:
                # The common row: one sequence, one sample (the hot path of a decode step).
                seq = seqs[0]
                add_info((req, seq, req.seq_index[seq.seq_id], False))
                add_src(n_logits)
                add_rows(1)
                n_logits += 1
                continue
            fan_out = (not req.is_beam and len(seqs) == 1 and req.num_samples > 1
                       and not seqs[0].output_token_ids)
            seq = next(q for q in seqs if q.seq_id == s.seq_id)
            if s.spec_token_ids:  # one row per position: the last known token and each draft
                k = len(s.spec_token_ids)
                for j in range(k + 1):
                    row_info.append((req, seq, req.seq_index[seq.seq_id], False))
                    row_src.append(n_logits + j)
                rows_per_seq.append(k + 1)
                n_logits += k + 1
                continue
            for j in range(req.num_samples if fan_out else 1):
                row_info.append((req, seq, j if fan_out else req.seq_index[seq.seq_id], fan_out))
                row_src.append(n_logits)
            rows_per_seq.append(1)
            n_logits += 1
        return rows_per_seq, row_info, row_src

    def _prompt_rows(self, sched) -> tuple[list[int], list[tuple[RequestState, int]]]:
        """Flat token rows whose logits score the next prompt token, for requests that asked
        for prompt logprobs; positions already scored (e.g. before a recompute) are skipped."""
        rows: list[int] = []
        plan: list[tuple[RequestState, int]] = []
        if not self._prompt_lp_ids:
            return rows, plan
        self._prompt_lp_ids.intersection_update(self._requests.keys())
        offset = 0
        for s in sched.scheduled:
            req = self._requests.get(s.request_id)
            n = len(s.token_ids)
            if req is not None and req.params.prompt_logprobs is not None \
                    and req.seq_index.get(s.seq_id) == 0:
                last = min(s.start_pos + n, len(req.prompt_token_ids) - 1)
                for pos in range(s.start_pos, last):
                    if pos not in req.prompt_lp:
                        rows.append(offset + pos - s.start_pos)
                        plan.append((req, pos))
            offset += n
        return rows, plan

    def _score_prompt(self, logits: jax.Array, first_row: int, plan) -> jax.Array:
        """Launch prompt-logprob scoring on device for rows `first_row...` (no sync here).
        Shapes follow the step's logits only: top-`MAX_LOGPROBS`, sliced per request."""
        next_ids = np.zeros(logits.shape[0], np.int32)
        rows = np.zeros(logits.shape[0], np.int32)
        for i, (req, pos) in enumerate(plan):
            next_ids[i] = req.prompt_token_ids[pos + 1]
            rows[i] = first_row + i
        return prompt_logprobs(logits, next_ids, MAX_LOGPROBS, rows=rows,
                               chunked=self.runner.chunked_top_k)

    def _sample_batch(self, num_rows: int, seq_pad: int) -> int:
        """Padded sampler batch: the step's sequence bucket when the sampled rows fit it (one
        row per sequence), else the largest bucket (a fresh n>1 prompt fans out into up to
        max_num_seqs rows), so a logits shape meets at most two sampler batch sizes. Prefill
        steps used to sample at the largest bucket too, paying a 256-row sampler for a lone
        prompt's one row on its first step."""
        if num_rows <= seq_pad:
            return seq_pad
        # Speculative steps score up to 1 + k rows per sequence.
        return max(self.runner.shape_plan.seq_cap, pow2_at_least(num_rows))

    def _sampling_metadata(self, rows: list[tuple], pad_to: int,
                           masks: dict[int, np.ndarray] | None = None,
                           bans: dict[int, list[int]] | None = None,
                           keys: list[tuple[int, int]] | None = None,
                           pack_histories: bool = True) -> SamplingMetadata:
        """The step's sampling metadata; with ``keys`` (each row's sequence id and sample
        index) from the parameters kept across steps (`SamplingBatch`), else row by row.
        ``pack_histories`` False: penalty histories left None for the device to gather."""
        widths = dict(history_width=self.max_model_len, ban_width=self._ban_width,
                      masks=masks, mask_width=self.structured.mask_width,
                      bias_width=self._bias_width, extra_bans=bans, fill=self._meta_fill)
        if keys is not None:
            meta = self.sampling_batch.metadata(rows, keys, pad_to, pack_histories=pack_histories,
                                                **widths)
        else:
            meta = SamplingMetadata.from_params(
                rows, pad_to=pad_to, vocab_size=self.model_config.vocab_size,
                eos_token_ids=sorted(self.eos_token_ids), engine_seed=self.engine_config.seed,
                **widths)
        want = any(p.logprobs for p, _ in rows)
        return meta.replace(want_topk=np.bool_(want))

    def _launch(self, sched, prev: _InFlight | None) -> _InFlight:
        """Build the step's inputs, run the model and the sampler on the device; no sync.
        Tokens this step samples become the sequences' pending tokens, so the next step can
        be scheduled before they are known (`needs_sync` says when it cannot)."""
        rows_per_seq, row_info, row_src, plain_rows = self._rows_for(sched)
        p_rows, p_plan = self._prompt_rows(sched)
        spec_lens = ([len(s.spec_token_ids) for s in sched.scheduled]
                     if self.spec_config is not None else None)
        run = sched.steady
        if (run is not None and plain_rows and not p_rows and self.input_batch.device_tables
                and self.runner.num_kv_groups == 1 and spec_lens is None):
            inputs = steady_decode_inputs(sched, self.engine_config.block_size,
                                          self.runner.shape_plan, self.input_batch)
        else:
            inputs = build_step_inputs(sched.scheduled, self.engine_config.block_size,
                                       self.runner.max_blocks_per_seq, rows_per_seq, p_rows,
                                       plan=self.runner.shape_plan, batch=self.input_batch,
                                       num_groups=self.runner.num_kv_groups,
                                       spec_lens=spec_lens, num_tokens=sched.num_batched_tokens)
        steady_src = self._feed_pending(sched, inputs, prev) if self.runner.feed_tokens else None
        kept = self._steady_plain
        if run is not None and kept is not None and (
                kept[0] == run.cohort.key
                # cut down: every row of the cohort it came from could take the screened head
                or kept[1] == 2 and run.cohort.parent is not None
                and kept[0] == run.cohort.parent[0]):
            plain = kept[1]
            self._steady_plain = (run.cohort.key, plain)
        else:
            plain = self._plain_greedy(row_info) if row_info else 0
            if run is not None and plain_rows and not any(info[0].min_tokens
                                                          for info in row_info):
                self._steady_plain = (run.cohort.key, plain)  # from fixed flags only
        if plain == 2 and not p_plan and self.runner.head_screen is not None:
            # Greedy rows that want no logprob: tokens from the hidden states through the
            # screened LM head, no [R, V] logits (`sample_greedy_hidden`).
            hidden = self.runner.execute_hidden(inputs)
            out = sample_greedy_hidden(hidden, self._sample_src(len(row_info), row_src, inputs),
                                       self.runner.head_screen, self.runner.head_panels,
                                       num_logprobs=MAX_LOGPROBS)
            fl = _InFlight(sched, scored=None, p_plan=p_plan, plain=plain_rows)
            fl.row_info, fl.out = row_info, out
            return self._mark_pending(fl, out) if self.runner.feed_tokens else fl
        logits = self.runner.execute(inputs)
        scored = self._score_prompt(logits, sum(rows_per_seq), p_plan) if p_plan else None
        fl = _InFlight(sched, scored=scored, p_plan=p_plan, plain=plain_rows)
        if not row_info:
            return fl
        src = self._sample_src(len(row_info), row_src, inputs)
        b_pad = len(src)
        if plain:
            out = sample_greedy(logits, src, num_logprobs=MAX_LOGPROBS,
                                native=self.runner.native_greedy)
            fl.row_info, fl.out = row_info, out
            return self._mark_pending(fl, out) if self.runner.feed_tokens else fl
        steady = run is not None and plain_rows and self.spec_config is None
        meta = self.cohort_meta.get(run.cohort, b_pad, run.cohort.pending) if steady else None
        if meta is None:
            meta = self._step_metadata(row_info, rows_per_seq, sched, b_pad, fl)
            if steady and not self.cohort_meta.refused(run.cohort):
                self._keep_metadata(run.cohort, row_info, b_pad, meta)
        meta = self._with_histories(meta, row_info, fl, prev, steady_src)
        # Beams rank candidates from `sample`'s raw log-softmax rows; speculative steps keep
        # the one sampler they were verified with. (Plain rows are never beams.)
        beamed = not plain_rows and any(info[0].is_beam for info in row_info)
        if (GREEDY_FAST_PATH and meta.plain_greedy and not meta.want_topk
                and self.spec_config is None and not beamed):
            out = sample_greedy(logits, src, num_logprobs=MAX_LOGPROBS,
                                native=self.runner.native_greedy)
        else:
            x, picked = self._sampler_rows(logits, src)
            out = sample(x, meta, num_logprobs=MAX_LOGPROBS, rows=picked,
                         native=self.runner.native_sampler,
                         chunked=self.runner.chunked_top_k)
            if out.raw_logprobs is None and beamed:
                # The native sampler leaves out the [B, V] log-softmax; beams rank from it.
                out = out._replace(raw_logprobs=raw_logprob_rows(x, picked))
        beams = (self.beams.candidates(out.raw_logprobs, row_info, self._requests)
                 if beamed else None)
        fl.row_info, fl.out = row_info, out._replace(raw_logprobs=None)
        if beams:
            fl.beam_groups = beams[0] + beams[3]
            fl.beam_cands, fl.host_beam_cands = beams[1], beams[2]
            fl.num_device_beam_groups = len(beams[0])
            fl.needs_sync = True
        if not self.runner.feed_tokens:
            return fl  # the step is finished before the next is scheduled: nothing pending
        return self._mark_pending(fl, out)

    def _keep_metadata(self, cohort, row_info: list[tuple], b_pad: int,
                       meta: SamplingMetadata) -> None:
        """Offer a steady step's metadata to `cohort_meta` for the cohort's next steps: kept
        when every row's sampling is fixed (`RequestState.fixed_sampling`; a penalised row's
        too where its histories are kept on the device and gathered each step) and past its
        ``min_tokens`` (bans lifted: they do not come back); the cohort refused for good when a
        row's is not fixed; else offered again next step."""
        wants = []
        # Penalty histories packed into it (on the host, each step), not left to the device.
        packed = meta.output_token_ids is not None
        for req, seq, _index, _fan_out in row_info:
            if not req.fixed_sampling or packed and req.penalised:
                self.cohort_meta.keep(cohort, b_pad, meta, [], None)
                return
            min_tokens = req.min_tokens
            if min_tokens and len(seq.output_token_ids) + seq.num_pending < min_tokens:
                return
            wants.append(bool(req.params.logprobs))
        self.cohort_meta.keep(cohort, b_pad, meta,
                              [info[1].output_token_ids for info in row_info], wants)

    def _step_metadata(self, row_info: list[tuple], rows_per_seq: list[int], sched, b_pad: int,
                       fl: _InFlight) -> SamplingMetadata:
        """The step's sampling metadata from its rows: parameters, token masks and bans,
        drafted rows, penalty histories packed here (else None: kept on the device, for
        `_with_histories`)."""
        # Penalty histories: kept on the device (`worker.device_histories`), else packed on
        # the host from buffers grown by deltas (`InputBatch.histories`).
        on_device = self.history_slots is not None
        hist = self.input_batch.histories
        rows = [(req.params, SeqSamplingState(
                    *(hist(seq) if not on_device and req.penalised
                      else (seq.prompt_token_ids, seq.output_token_ids)),
                    req.counter, index, seq.num_pending))
                for req, seq, index, _ in row_info]
        if self.spec_config is not None:
            fl.spec_rows = self._spec_rows(sched, rows_per_seq)
            for r0, drafts in fl.spec_rows.values():
                # Row j scores draft j: the j drafts before it count as outputs (penalties,
                # min_tokens, the random key's step), as if they had been sampled already.
                # A pending token (async scheduling) comes first: a placeholder column that
                # `_feed_pending_history` fills on the device, as for row 0.
                params, st = rows[r0]
                if st.num_pending:
                    fl.guessed.add(row_info[r0][1].seq_id)
                head = [np.asarray(st.output_token_ids, np.int32),
                        np.zeros(st.num_pending, np.int32)]
                for j in range(1, len(drafts) + 1):
                    rows[r0 + j] = (params, st._replace(num_pending=0, output_token_ids=(
                        np.concatenate(head + [np.asarray(drafts[:j], np.int32)]))))
        masks, bans = self._token_masks(row_info, rows, fl)
        return self._sampling_metadata(rows, b_pad, masks, bans,
                                       [(seq.seq_id, index) for _, seq, index, _ in row_info],
                                       pack_histories=not on_device)

    def _with_histories(self, meta: SamplingMetadata, row_info: list[tuple], fl: _InFlight,
                        prev: _InFlight | None, steady_src: np.ndarray | None = None
                        ) -> SamplingMetadata:
        """``meta`` with the penalty histories kept on the device gathered for its rows, and
        each penalised row's pending token written in after its known ones. ``steady_src``:
        each row's row in the previous step's tokens, when every row's token is pending and
        the rows are a steady cohort's (`_feed_pending`)."""
        o_lens = None
        if meta.output_token_ids is None:
            meta, o_lens = self._device_histories(meta, row_info, fl)
        if self.runner.feed_tokens and meta.output_token_ids.shape[1]:
            rows = (self.history_slots.steady_rows(self._history_key(fl))
                    if steady_src is not None and o_lens is not None else None)
            if rows is not None:
                meta = self._feed_steady_history(meta, rows, o_lens, steady_src, prev)
            else:
                meta = self._feed_pending_history(meta, row_info, prev)
        return meta

    def _feed_steady_history(self, meta: SamplingMetadata, rows: np.ndarray, o_lens: np.ndarray,
                             src: np.ndarray, prev: _InFlight) -> SamplingMetadata:
        """`_feed_pending_history` for steady rows whose tokens are all pending: each
        penalised row (``rows``) gets its pending token, at row ``src`` of the previous
        step's tokens, after its known outputs (``o_lens``, the lengths just gathered): the
        same arrays, without a pass over the rows."""
        b = meta.output_token_ids.shape[0]
        cols, srcs = np.full(b, -1, np.int32), np.zeros(b, np.int32)
        cols[rows], srcs[rows] = o_lens[rows], src[rows]
        return meta.replace(output_token_ids=self.runner.merge_pending_history(
            meta.output_token_ids, cols, srcs, prev.tokens))

    @staticmethod
    def _history_key(fl: _InFlight) -> int | None:
        """The key `HistorySlots` keeps a step's rows by: a steady step of plain rows samples
        its cohort's sequences in the cohort's order, one row each, so the cohort's key
        names its rows (None: any other step)."""
        run = fl.sched.steady
        return run.cohort.key if run is not None and fl.plain and not fl.spec_rows else None

    @staticmethod
    def _sampler_rows(logits: jax.Array, src: np.ndarray) -> tuple[jax.Array, np.ndarray]:
        """`sample`'s logits and rows for a batch of ``len(src)`` rows: the step's logits as
        they are when they have one row per batch row (decode steps), else the rows gathered
        first (`take_rows`; prefill steps with prompt-logprob rows, fan-out, speculation) and
        picked in order. So `sample` sees ``[b, V]`` logits whatever the step's shape and is
        compiled once per batch bucket: per (logits rows, batch) pair, warm-up at
        max_num_seqs 256 took 159 of them, ~52 000 memory mappings on CPU, past Linux's
        default limit of 65 530 with the steps' (`worker.compile_stats.memory_maps`)."""
        b = len(src)
        if logits.shape[0] == b:
            return logits, src
        return take_rows(logits, src), _identity_rows(b)

    def _sample_src(self, n: int, row_src: list[int], inputs) -> np.ndarray:
        """The logits row of each sampled row, padded to the step's sampler batch."""
        src = np.zeros(self._sample_batch(n, inputs.shape_key[1]), np.int32)
        src[: len(row_src)] = row_src
        return src

    def _plain_greedy(self, row_info: list[tuple]) -> int:
        """Whether every sampled row is plain greedy (`RequestState.plain_greedy`, past its
        `min_tokens`): then `sample_greedy` decides the tokens from the logits alone, and the
        step skips the sampling metadata, which `sample` would need (launching a 256-row step
        took 0.56 ms of host time with it, 0.24 without, `bench/host_overhead.py --phases`).
        Same tokens as through `sample` (`tests/engine/test_greedy_fast_path.py`).

        0: no; 1: yes; 2: yes, and no row wants a logprob (``logprobs=None``; its output then
        reports no cumulative logprob, as vLLM V1's) and each request samples one sequence
        (n > 1 ranks its samples by cumulative logprob), so the tokens may come from the
        screened LM head (`ModelRunner.head_screen`, `RequestState.screenable`)."""
        if not GREEDY_FAST_PATH or self.spec_config is not None:
            return 0
        screen = 2
        for info in row_info:  # flags set once per request: this runs for every row
            req = info[0]
            if not req.plain_greedy:
                return 0
            min_tokens = req.min_tokens
            if min_tokens:
                seq = info[1]
                if len(seq.output_token_ids) + seq.num_pending < min_tokens:
                    return 0  # its stop tokens are banned until then
            if not req.screenable:
                screen = 1
        return screen

    def _mark_pending(self, fl: _InFlight, out: SamplerOutput) -> _InFlight:
        """Async scheduling: the tokens this step samples become their sequences' pending
        tokens, so the next step can be scheduled before they are known (`needs_sync` says
        when it cannot)."""
        row_info = fl.row_info
        fl.tokens = self.runner.sampled_tokens(out.token_ids)
        spec_rows, pending_rows, max_len = fl.spec_rows, fl.pending_rows, self.max_model_len
        if fl.plain and not spec_rows:  # no fork, beam or draft: a row's cap decides
            r = 0
            for (_, seq, _, _), cap in zip(row_info, self._pending_caps(fl.sched.steady, row_info)):
                n = seq.num_pending + 1
                if len(seq.output_token_ids) + n < cap:  # else certainly its last token
                    seq.num_pending = n
                    pending_rows[seq.seq_id] = r
                r += 1
            return fl
        for r, (req, seq, _index, fan_out) in enumerate(row_info):
            if fan_out or req.params.use_beam_search:  # forks are decided on the host
                fl.needs_sync = True
                continue
            if seq.seq_id in spec_rows:
                # How many tokens it gains is decided on the host, and the next drafts follow
                # them: the step after a drafted one waits for its results (the n-gram and
                # draft-model proposers draft from known tokens on the host; thesis §4.6.1's
                # fully overlapped form needs a proposer on the device).
                fl.needs_sync = True
                continue
            n_out = len(seq.output_token_ids) + seq.num_pending + 1  # outputs after this step
            if n_out >= req.params.max_tokens or len(seq.prompt_token_ids) + n_out >= max_len:
                continue  # certainly its last token: nothing to schedule after it
            seq.num_pending += 1
            pending_rows[seq.seq_id] = r
        return fl

    def _pending_caps(self, run, row_info: list[tuple]) -> list[int]:
        """Per plain row, the output count its sequence ends at (`max_tokens`, or what
        `max_model_len` leaves after its prompt): a token that reaches it is certainly the
        last. Fixed per request, so kept per steady cohort (``run``: the step's
        `SteadyRun`) and cut with it, as `_rows_for` keeps the rows."""
        kept = self._steady_caps
        if run is not None and kept is not None:
            c = run.cohort
            if kept[0] == c.key:
                return kept[1]
            if c.parent is not None and kept[0] == c.parent[0]:
                caps = [kept[1][i] for i in c.parent[1]]
                self._steady_caps = (c.key, caps)
                return caps
        max_len = self.max_model_len
        caps = [min(req.params.max_tokens, max_len - len(seq.prompt_token_ids))
                for req, seq, _, _ in row_info]
        if run is not None:
            self._steady_caps = (run.cohort.key, caps)
        return caps

    def _token_masks(self, row_info, rows, fl: _InFlight
                     ) -> tuple[dict[int, np.ndarray] | None, dict[int, list[int]] | None]:
        """Per sampled row: the allowed-token bitmask (a grammar's next tokens, and/or
        `allowed_token_ids`) and the banned last tokens of bad words the output is about to
        complete. Both follow the tokens sampled so far, so a step with such rows is awaited
        before the next is scheduled (async scheduling)."""
        masks: dict[int, np.ndarray] | None = None
        bans: dict[int, list[int]] | None = None
        wanted: list[tuple[int, object, tuple[int, ...]]] = []  # grammar rows to fill
        firsts: list[tuple[int, np.ndarray | None]] = []  # (first row, allowed_token_ids)
        for r, (req, seq, _index, _fan_out) in enumerate(row_info):
            if req.grammar is not None or req.allowed_mask is not None:
                masks = masks if masks is not None else {}
                if req.grammar is None:
                    masks[r] = req.allowed_mask  # fixed: it does not follow the tokens
                elif r not in masks:  # a drafted sequence's rows are all filled at its first
                    spec = fl.spec_rows.get(seq.seq_id)
                    drafts = spec[1] if spec is not None else ()
                    wanted.append((seq.seq_id, req.grammar, drafts))
                    firsts.append((r, req.allowed_mask))
                    for j in range(1 + len(drafts)):
                        masks[r + j] = None  # placeholder, filled below
                    fl.needs_sync = True
            if req.bad_words:
                out = rows[r][1].output_token_ids
                ids = [w[-1] for w in req.bad_words
                       if len(w) == 1 or (len(out) >= len(w) - 1
                                          and list(out[len(out) - len(w) + 1:]) == w[:-1])]
                if ids:
                    bans = bans if bans is not None else {}
                    bans[r] = ids
                fl.needs_sync = True
        if wanted:
            for (r, allowed), block in zip(firsts, self.structured.fill_rows(wanted),
                                           strict=True):
                if allowed is not None:
                    block &= allowed
                for j, row in enumerate(block):
                    masks[r + j] = row
        return masks, bans

    def _draft_proposer(self, sc, config: ModelConfig, dtype) -> DraftModelProposer:
        """The draft model's runner: its own cache (as many blocks as the target's, of its
        own size), one block table for all its layers, the target's kernels and budgets."""
        import dataclasses as dc

        from models.loader import load_model

        dconfig, dparams, _ = load_model(sc.model, dtype)
        if dconfig.vocab_size != config.vocab_size:
            raise ValueError(f"speculative_config.model: vocabulary of {dconfig.vocab_size} "
                             f"tokens, the target has {config.vocab_size}")
        n = sc.draft_num_layers
        if n is not None and n < dconfig.num_layers:  # a truncated copy: the first n layers
            windows = dconfig.layer_windows[:n] if dconfig.layer_windows else ()
            dconfig = dc.replace(dconfig, num_layers=n, layer_windows=windows)
            dparams = {**dparams, "layers": jax.tree.map(lambda x: x[:n], dparams["layers"])}
        ec = self.engine_config
        dec = EngineConfig(block_size=ec.block_size, num_gpu_blocks=self.runner.num_gpu_blocks,
                           max_num_seqs=ec.max_num_seqs,
                           max_num_batched_tokens=ec.max_num_batched_tokens,
                           attention_backend=ec.attention_backend, layer_loop=ec.layer_loop,
                           async_scheduling=False, warmup=False, swap_space_gb=0,
                           disable_hybrid_kv_cache_manager=True)
        runner = ModelRunner(dconfig, dparams, dec, dtype, self.max_model_len)
        return DraftModelProposer(runner, sc.num_speculative_tokens)

    def _prepare_drafts(self) -> None:
        """Draft-model speculation: draft for every decoding sequence before the scheduler
        plans the step (batched over them; the scheduler takes what fits)."""
        seqs = [s for g in self.scheduler.running for s in g.seqs
                if s.status is SequenceStatus.RUNNING and (s.output_token_ids or s.num_pending)
                and s.num_pending <= 1 and s.num_uncomputed_tokens == 1]
        if seqs:
            self.draft.prepare(seqs)

    @staticmethod
    def _spec_rows(sched, rows_per_seq: list[int]) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Sequence id -> (its first sampled row, its drafts) for the step's drafted sequences
        (their rows are consecutive: `_rows_for`)."""
        out, r = {}, 0
        for s, n in zip(sched.scheduled, rows_per_seq, strict=True):
            if s.spec_token_ids:
                out[s.seq_id] = (r, s.spec_token_ids)
            r += n
        return out

    def _device_histories(self, meta: SamplingMetadata, row_info, fl: _InFlight
                          ) -> tuple[SamplingMetadata, np.ndarray]:
        """The step's penalty histories gathered on the device: the ids the host learned
        since the last step are written into each penalised sequence's slot, and a drafted
        sequence's rows 1..k get their drafts after its outputs (and its pending token, which
        `_feed_pending_history` writes in next), as the host-packed rows hold them. Also
        returns each row's output length on the host. A steady cohort's next step reuses
        the rows kept by its last (`HistorySlots.steady`)."""
        b = meta.temperature.shape[0]
        key = self._history_key(fl)
        got = self.history_slots.steady(key, b) if key is not None else None
        if got is None:
            seqs = [seq if req.penalised else None for req, seq, _, _ in row_info]
            got = self.history_slots.step(seqs, b, key)
        slots, p_lens, o_lens, idx, val = got
        patches = []
        for r0, drafts in fl.spec_rows.values():
            seq = seqs[r0]
            if seq is None:
                continue
            at = int(o_lens[r0]) + seq.num_pending
            for j in range(1, len(drafts) + 1):
                patches.extend((r0 + j, at + i, drafts[i]) for i in range(j))
        try:
            out, prompt = self.runner.gather_histories(
                slots, p_lens, o_lens, meta.repetition_penalty != 1.0, idx, val, patches)
        except Exception:
            self.history_slots.invalidate()  # the runner reset the device copy
            raise
        return meta.replace(output_token_ids=out, prompt_token_ids=prompt), o_lens

    def _feed_pending_history(self, meta: SamplingMetadata, row_info, prev: _InFlight | None
                              ) -> SamplingMetadata:
        """Write each penalised row's pending token (sampled by the step still in flight) into
        its output history on the device, after the tokens the host knows."""
        cols = None
        for r, (req, seq, _index, _fan_out) in enumerate(row_info):
            if not (seq.num_pending and req.penalised):
                continue
            src = prev.pending_rows.get(seq.seq_id) if prev is not None else None
            if src is None:
                raise RuntimeError(f"sequence {seq.seq_id} has a pending token that no "
                                   f"launched step samples")
            if cols is None:
                b = meta.output_token_ids.shape[0]
                cols, srcs = np.full(b, -1, np.int32), np.zeros(b, np.int32)
            cols[r], srcs[r] = seq.num_output_tokens, src
        if cols is None:
            return meta
        return meta.replace(output_token_ids=self.runner.merge_pending_history(
            meta.output_token_ids, cols, srcs, prev.tokens))

    def _feed_pending(self, sched, inputs, prev: _InFlight | None) -> np.ndarray | None:
        """Point each pending token of the step at its row in the previous step's sampled
        tokens, which stay on the device (`ModelRunner._make_serve_step`). Returns those
        rows by sequence when the step is steady and every token pending
        (`_steady_feed`), else None."""
        rows = self._steady_feed(sched, inputs, prev)
        if rows is not None:
            inputs.prev_rows, inputs.prev_tokens = rows, prev.tokens
            return rows[: len(sched.steady.starts)]
        cu = inputs.meta.cu_q_lens
        for i, s in enumerate(sched.scheduled):
            at = -1 - len(s.spec_token_ids)  # drafts follow a pending token
            if s.token_ids[at] != PENDING_TOKEN:
                continue
            if prev is None or s.seq_id not in prev.pending_rows:
                raise RuntimeError(f"sequence {s.seq_id} has a pending token that no "
                                   f"launched step samples")
            if rows is None:
                rows = np.full(inputs.input_ids.shape, -1, np.int32)
            rows[cu[i + 1] + at] = prev.pending_rows[s.seq_id]
        if rows is not None:
            inputs.prev_rows, inputs.prev_tokens = rows, prev.tokens
        return None

    @staticmethod
    def _steady_feed(sched, inputs, prev: _InFlight | None) -> np.ndarray | None:
        """`_feed_pending`'s rows for a steady step that follows a steady step of the same
        cohort, or of the cohort it was cut from, without a pass over the entries: every
        sequence's token is pending (`SteadyRun.token_ids` None: the cohort's sequences each
        had one, and one only, from the step before) and that step sampled the cohort's
        sequences in its order, one row each; so the row of sequence i is i, or its index in
        the cohort it was cut from. None: the general pass."""
        run = sched.steady
        if run is None or run.token_ids is not None or prev is None:
            return None
        before = prev.sched.steady
        if before is None:
            return None
        c, n = run.cohort, len(run.starts)
        if before.cohort is c:
            src = np.arange(n, dtype=np.int32)
        elif c.parent is not None and c.parent[0] == before.cohort.key:
            src = np.asarray(c.parent[1], np.int32)
        else:
            return None
        rows = np.full(inputs.input_ids.shape, -1, np.int32)
        rows[:n] = src
        return rows

    def _apply_samples(self, fl: _InFlight, out, beams) -> set[str]:
        """Hand the step's tokens to the scheduler, which owns request state and appends
        them (forks, token stops, lengths); the output processor then detokenizes, finds
        stop strings and reports those stops back. Beam groups advance on the host."""
        row_info = fl.row_info
        run = fl.sched.steady
        touched = ({s.request_id for s in fl.sched.scheduled} if run is None
                   else run.cohort.request_ids)
        if fl.plain and beams is None and not fl.spec_rows:
            ended = self._apply_plain(fl, out)
            return touched if ended is None else ended
        token_ids, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
        pending = fl.pending_rows
        sampled: list[SampledToken] = []
        rows: list[tuple[RequestState, int]] = []
        add_sampled, add_row = sampled.append, rows.append
        spec = fl.spec_rows
        # A drafted sequence's j-th token goes in round j: every stop (token, length, stop
        # string) is then found after the same token as without speculation, and the tokens
        # after it are never appended.
        later: list[tuple[list[SampledToken], list[tuple[RequestState, int]]]] = []
        requests = self._requests
        forks = grammars = False  # whether the rarer passes below have anything to do
        for r, (req, seq, index, fan_out) in enumerate(row_info):
            if req.is_beam or requests.get(req.request_id) is not req:
                continue  # beams: below; gone: aborted or failed while the step ran
            if fan_out:
                forks = True
            if req.grammar is not None:
                grammars = True
            if spec and seq.seq_id in spec:  # drafted: its first row takes all its accepted tokens
                r0, drafts = spec[seq.seq_id]
                if r == r0:
                    a = self._accept(drafts, token_ids[r0 : r0 + len(drafts) + 1])
                    if seq.seq_id in fl.guessed:
                        self.num_guessed_accepted += a
                    sampled.append(SampledToken(req.request_id, seq, token_ids[r0], logprobs[r0],
                                                rejected=len(drafts) - a))
                    rows.append((req, r0))
                    for j in range(1, a + 1):
                        if len(later) < j:
                            later.append(([], []))
                        later[j - 1][0].append(SampledToken(req.request_id, seq,
                                                            token_ids[r0 + j], logprobs[r0 + j]))
                        later[j - 1][1].append((req, r0 + j))
                continue
            add_sampled(new_tuple(SampledToken, (
                req.request_id, seq, token_ids[r], logprobs[r], index if fan_out else 0,
                bool(pending) and pending.get(seq.seq_id) == r, 0)))
            add_row((req, r))
        for tokens, token_rows in [(sampled, rows), *later]:
            applied = self.scheduler.update_from_output(tokens, self._new_seq_id)
            for a in applied if forks else ():
                if a.forked:
                    req, r = token_rows[a.index]
                    req.register(a.seq, row_info[r][2])
                    if req.grammar is not None:  # before the parent takes this step's token
                        self.structured.fork(tokens[a.index].seq.seq_id, a.seq.seq_id,
                                             req.grammar)
            for a in applied if grammars else ():
                req = token_rows[a.index][0]
                if req.grammar is not None and not a.seq.is_finished() and \
                        self.structured.advance(a.seq.seq_id, req.grammar, tokens[a.index].token_id):
                    self.scheduler.stop_seq(a.seq, SequenceStatus.FINISHED_STOPPED, req.request_id)
            for req, seq in self.outputs.process(applied, token_rows, out):
                self.scheduler.stop_seq(seq, SequenceStatus.FINISHED_STOPPED, req.request_id)
        if beams is not None:
            groups, cands = beams
            for (req, live_beams), c in zip(groups, cands):
                if self._requests.get(req.request_id) is not req:
                    continue
                k = 2 * req.params.beam_width  # the top 2W of the padded width's candidates
                self.beams.advance(req, live_beams, c.parent[:k], c.token_ids[:k],
                                    c.cum_logprobs[:k], c.valid[:k])
        return touched

    # A steady step's rows other than its quiet and streamed ones (`_steady_classes`) are
    # listed and processed one by one while they are at most this share of the step. Since
    # `listed_rows` reads columns, it is the faster path at any share: 256 rows, every one
    # listed, host ms per step with a share of 0.5 (the general path) / 1, in lockstep
    # (`bench/host_overhead_ab.py`, stop 80, `host_overhead_ab_listed_share_lockstep_xeon_
    # stop80.json`): `final_only` with a stop string each 1.32 / 0.85, with 2 logprobs each
    # 0.99 / 0.81; `delta` with 2 logprobs 2.11 / 1.49; the engine process's child 1.66 /
    # 0.93. (Tests set 0 to compare with the general path.)
    LISTED_MAX_SHARE = 1.0

    def _apply_plain(self, fl: _InFlight, out) -> set[str] | None:
        """`_apply_samples` for a step of plain rows (most decode steps): no fork, draft,
        grammar or beam, so the scheduler takes the rows as they are
        (`Scheduler.update_from_rows`), without a `SampledToken` made and checked for each.
        Returns the requests left for `_finish` to output when the step made its running
        rows' outputs itself (`fl.made`), else None (every request the step advanced)."""
        row_info = fl.row_info
        run = fl.sched.steady
        streamed = False
        listed: list[int] = []
        if run is None:
            quiet = all(info[0].quiet for info in row_info)
        else:
            quiet, streamed, listed = self._steady_classes(run.cohort, row_info)
        if run is not None and (quiet or streamed):  # rows are the cohort's sequences, in order
            applied, num_applied = self.scheduler.update_steady(
                run, out.token_ids.tolist(), fl.pending_rows, listed,
                out.logprobs.tolist() if listed else None)
        else:
            applied, num_applied = self.scheduler.update_from_rows(
                row_info, out.token_ids.tolist(), out.logprobs.tolist(), fl.pending_rows,
                ended_only=quiet)
        stop_seq = self.scheduler.stop_seq
        for req, seq in self.outputs.process(applied, None, out, row_info, num_applied):
            stop_seq(seq, SequenceStatus.FINISHED_STOPPED, req.request_id)
        took, made = (), None
        if listed:  # (the ended ones are among the applied)
            # A streamed step's running listed delta streams get their outputs there too,
            # pipe rows included (`_finish` then makes the others' only).
            made = [] if streamed else None
            stopped, took = self.outputs.listed_rows(row_info, run.cohort, listed, out, made,
                                                     self._pipe_rows)
            for req, seq in stopped:
                stop_seq(seq, SequenceStatus.FINISHED_STOPPED, req.request_id)
        if not streamed:
            return None
        fl.made, stopped = self.outputs.stream_rows(row_info, run.cohort, self._pipe_rows)
        if made:
            fl.made.extend(made)
        for req, seq in stopped:
            stop_seq(seq, SequenceStatus.FINISHED_STOPPED, req.request_id)
        # `_finish` makes the outputs of the ended rows and of the listed ones.
        ended = {row_info[a.index][0].request_id for a in applied}
        ended.update(req.request_id for req, _ in stopped)
        ended.update(took)
        return ended

    def _steady_classes(self, c, row_info: list[tuple]) -> tuple[bool, bool, list[int]]:
        """How a steady step of cohort ``c`` applies its rows: (quiet, streamed, listed).

        Quiet rows (`RequestState.quiet`) need output processing only when they finish: of
        them, only the rows that end are entered in the applied list. A request stays quiet
        once it is. Streamed: every row quiet and final-only, a plain delta stream past its first
        token (`RequestState.stream_plain`) or, in the engine process's child, a pipe row
        past its first output (`RequestState.pipe_plain`): `stream_rows` outputs them.
        Listed: the rows that are neither (logprobs, text-producing final-only rows with
        stop strings), past their first token, at most `LISTED_MAX_SHARE` of the step: the
        scheduler lists their tokens (`Scheduler.update_steady`'s ``listed``) and
        `OutputProcessor.listed_rows` applies them from its own columns and makes the
        running streams' outputs (the others are `_finish`'s), while the others are applied
        from the cohort's columns. A listed stream makes the step not quiet, so that its
        outputs are made there even when every other row is quiet. Before, one such row sent the whole
        step down the general path: a request with logprobs among 255 plain streams took the
        256-row `delta` step 0.64 -> 1.26 ms (`bench/host_overhead.py --mixes
        sampled_one_lp`). Neither quiet nor streamed: the general path.

        Kept per cohort while settled (none of it changes then), and cut with it."""
        kept = self._steady_kind
        if kept is not None:
            if kept[0] == c.key:
                return kept[1], kept[2], kept[3]
            if c.parent is not None and kept[0] == c.parent[0]:  # cut down: rows cut alike
                listed = kept[3]
                if listed:
                    was = set(listed)
                    listed = [j for j, i in enumerate(c.parent[1]) if i in was]
                self._steady_kind = (c.key, kept[1], kept[2], listed)
                return kept[1], kept[2], listed
        pipe = self._pipe_rows
        quiet = streamed = True
        piped = False
        settled = True  # False: a pipe row before its first output; ask again next step
        listed: list[int] = []
        limit = int(len(row_info) * self.LISTED_MAX_SHARE)
        for r, info in enumerate(row_info):
            req = info[0]
            if not req.quiet:
                if req.first_token_time is None or pipe and req.pipe_plain:
                    return False, False, []  # not settled yet / a pipe row `stream_rows` makes
                if not req.stream_plain:
                    listed.append(r)
                    if len(listed) > limit:
                        return False, False, []
                    if req.streams:  # its outputs are `listed_rows`' (a delta stream's,
                        quiet = False  # a pipe row's) or `_finish`'s: not a quiet step
                    continue
                quiet = False
            elif req.streams:
                if pipe and req.pipe_plain and req.sent:
                    piped = True
                    continue
                streamed = False  # text-free deltas: output as quiet rows
                if pipe and req.pipe_plain:
                    settled = False
                if not quiet:
                    return False, False, []
        if piped and streamed:
            quiet = False
        streamed = streamed and not quiet
        if not (quiet or streamed):  # e.g. streams beside a text-free delta row, which no
            return False, False, []  # step streams in one process: the general path, whole
        if quiet and settled or streamed:
            self._steady_kind = (c.key, quiet, streamed, listed)
        return quiet, streamed, listed

    def _accept(self, drafts: tuple[int, ...], sampled: list[int]) -> int:
        """Accepted drafts (`pagedjax.spec.verify`), counted for the metrics."""
        a = accepted_prefix(drafts, sampled)
        self._spec_steps += 1
        self._spec_drafted += len(drafts)
        self._spec_accepted += a
        for j in range(a):
            self._spec_by_pos[j] += 1
        for j in range(len(drafts)):
            self._spec_drafted_by_pos[j] += 1
        return a

    def _new_seq_id(self) -> int:
        return next(self._seq_ids)

    @staticmethod
    def _quantized(config: ModelConfig, params: dict, quantization: str | None) -> dict:
        """``params`` as `EngineConfig.quantization` asks (in-memory params; `from_model`
        quantizes while loading): "int8" packs float dense weights per channel, "gguf" needs
        params loaded packed from a GGUF file."""
        from models.qlinear import is_packed

        if quantization == "int8":
            from models.weights import quantize_params_int8

            return quantize_params_int8(config, params)
        if quantization == "gguf" and not is_packed(params["embed"]) and not any(
                is_packed(v) for v in params["layers"].values()):
            raise ValueError("quantization: 'gguf' needs params loaded packed from a GGUF file "
                             "(models.gguf_loader.load_gguf(path, packed=True))")
        return params

    def _calibrate_kv_scales(self) -> np.ndarray | None:
        """A quantized KV cache's static scales, from one full-precision pass over the
        calibration prompt (`worker.kv_calibration`); None for a float cache."""
        if self.runner.kv_scales is None:
            return None
        from pagedjax.worker.kv_calibration import calibration_ids

        ids = calibration_ids(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        scales = self.runner.calibrate_kv_scales(ids)
        logger.info("KV cache %s: scales calibrated on %d tokens (K %.3g-%.3g, V %.3g-%.3g)",
                    self.runner.kv_dtype.name, len(ids), scales[:, 0].min(), scales[:, 0].max(),
                    scales[:, 1].min(), scales[:, 1].max())
        return scales

    # ---- outputs -----------------------------------------------------------
    # ---- weights and stats -------------------------------------------------
    def update_params(self, new_params: dict) -> None:
        """Swap weights in place: same shapes/dtypes, so no recompilation and the KV cache stays.

        All KV was computed with the old weights: in-flight requests are preempted and
        recomputed (tokens generated so far are kept), the prefix cache is reset, and new
        block hashes carry the new weights version, so old KV is never reused."""
        new_params = self._quantized(self.model_config, new_params,
                                     self.engine_config.quantization)
        old = jax.tree.map(lambda x: (x.shape, x.dtype), self._param_spec)
        new = jax.tree.map(lambda x: (x.shape, x.dtype), new_params)
        if jax.tree.structure(old) != jax.tree.structure(new) or old != new:
            raise ValueError("params: new params must have the same structure, shapes and dtypes")
        self._drain()
        self.scheduler.recompute_all()
        self.runner.params = self.runner.place_params(new_params)
        self.kv_scales = self._calibrate_kv_scales()  # new weights: new K/V magnitudes
        self._weights_version += 1
        self.block_manager.reset_prefix_cache()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`), e.g. so a benchmark's
        repeated prompts are computed again. Safe with requests in flight: they keep their
        blocks and stop publishing them. Registered prefixes are unpinned. Returns True (vLLM
        returns False when blocks are in use; here that case is handled)."""
        self.block_manager.reset_prefix_cache()
        return True

    @staticmethod
    def freeze_gc() -> None:
        """Move every object alive now out of the cyclic collector's reach (`gc.freeze`), as
        vLLM does once its engine has started: the weights' wrappers, compiled executables and
        the tokenizer live as long as the process, and without this every full collection
        during serving scans them (the p99 host step time at 256 sequences was such pauses).
        Process-wide and permanent, so servers call it once after loading, not every engine.

        Also widens the young generation to `YOUNG_GC_THRESHOLD` objects: a decode step at 256
        sequences allocates a few thousand tracked objects (scheduled entries, tokens to
        apply, outputs), so CPython's default of 700 ran a young collection once or twice a
        step and an older one every few steps. Measured side by side (`bench/host_overhead.py
        --compare-gc-threshold 10000`, `host_overhead_gc_threshold.json`): host ms per step at
        256 sequences, final-only 0.91-0.96 -> 0.88-0.89 (p99 1.03-1.82 -> 0.98-1.03), delta
        1.64-1.68 -> 1.53-1.54."""
        gc.collect()
        gc.freeze()
        gen0, *older = gc.get_threshold()
        gc.set_threshold(max(gen0, YOUNG_GC_THRESHOLD), *older)

    def get_stats(self) -> EngineStats:
        s = self.scheduler.get_stats()
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, num_swapped=s.num_swapped,
            num_gpu_blocks=self.runner.num_gpu_blocks, num_free_gpu_blocks=s.num_free_gpu_blocks,
            kv_cache_usage=s.kv_cache_usage, num_preemptions_total=s.num_preemptions_total,
            num_steps=self.num_steps, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            last_step_tokens=self.last_step_tokens, num_compiles=num_backend_compiles(),
            num_cache_rebuilds=self.num_cache_rebuilds, num_step_failures=self.num_step_failures,
            healthy=self.healthy, spec_num_draft_tokens=self._spec_drafted,
            spec_num_accepted_tokens=self._spec_accepted, spec_num_drafts=self._spec_steps,
            spec_accepted_per_position=tuple(self._spec_by_pos),
            spec_drafted_per_position=tuple(self._spec_drafted_by_pos),
            **self._memory_stats())

    def _memory_stats(self) -> dict:
        if self._memory is None:  # fixed for the engine's life (a weight swap keeps shapes)
            r = self.runner
            per_block = kv_bytes_per_block(r.config, r.block_size, r.kv_dtype, r.kv_layout,
                                           r.token_scales)
            weights = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(r.params))
            self._memory = dict(kv_cache_dtype=r.kv_dtype.name,
                                kv_bytes_per_token=per_block // r.block_size,
                                kv_cache_bytes=per_block * r.num_gpu_blocks,
                                weights_bytes=weights)
        return self._memory
