"""`LLMEngine`: request → scheduler → block manager → model runner → sampler → output.

One `step()` is one iteration of continuous batching (paper §4.5, thesis §4.2): the
scheduler picks Δ tokens per sequence, the runner executes them in one jitted call, the
sampler picks next tokens, and this module applies them: stop checks, incremental
detokenization, forking for n>1, finishing and freeing. Nothing here knows about networks.

Memory sharing (paper §4.4): an n>1 / best_of request computes its prompt once and forks the
samples from it (`Sequence.fork` + `Scheduler.fork_seq`), so they share the prompt's blocks
and copy-on-write only the partially filled last block. Beam search
(`SamplingParams(use_beam_search=True, best_of=W)`) gathers the logits rows of every live beam
of every beam request into `[G, W, V]` and picks candidates on device with one
`beam_candidates` call per step; the host forks surviving parents into children (sharing all
blocks) and frees dropped beams, so copies happen only for a shared partially filled block.
Beam EOS ids are the model's EOS plus the request's `stop_token_ids` (min_tokens and stop
strings do not apply to beams); the n best finished beams by length-penalised score are
returned, live beams joining the finished ones when `max_tokens` is reached.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from pagedjax.beam_search import (
    beam_candidates_from_rows,
    beam_candidates_numpy,
    length_penalized_score,
    should_stop,
    split_candidates,
)
from pagedjax.config import EngineConfig
from pagedjax.core import SchedulerConfig, Sequence, SequenceGroup
from pagedjax.core.block_manager import PrefixHandle
from pagedjax.core.policies import make_kv_manager, make_scheduler
from pagedjax.core.sequence import SequenceStatus
from pagedjax.detokenizer import Detokenizer, DetokState
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampler import SamplingMetadata, SeqSamplingState, prompt_logprobs, sample
from pagedjax.sampling_params import MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingParams
from pagedjax.worker.compile_stats import num_backend_compiles
from pagedjax.worker.model_runner import ModelRunner
from pagedjax.worker.shapes import pow2_at_least
from pagedjax.worker.step_inputs import build_step_inputs

MAX_REQUEST_ID_CHARS = 256
MAX_WARM_BEAM_WIDTH = 8
MAX_CHARS_PER_TOKEN = 64

logger = logging.getLogger(__name__)


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


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    group: SequenceGroup
    counter: int
    arrival_time: float
    seq_index: dict[int, int] = dataclasses.field(default_factory=dict)
    detok: dict[int, DetokState] = dataclasses.field(default_factory=dict)
    logprobs: dict[int, list[dict[int, float]]] = dataclasses.field(default_factory=dict)
    stop_reason: dict[int, int | str | None] = dataclasses.field(default_factory=dict)
    num_cached_tokens: int | None = None
    first_token_time: float | None = None
    final_only: bool = False  # output_kind "final_only": no per-step outputs
    # Beam search: finished hypotheses (score, seq) and logits rows of beams whose siblings
    # were not all computed in the same step (e.g. a token budget split the group).
    beam_finished: list[tuple[float, Sequence]] = dataclasses.field(default_factory=list)
    # Prompt logprobs by position p (the distribution that predicted prompt token p + 1).
    prompt_lp: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)
    beam_pending: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def is_beam(self) -> bool:
        return self.params.use_beam_search

    @property
    def num_samples(self) -> int:
        return self.params.best_of or self.params.n


FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class LLMEngine:
    CACHE_RETRY_S = 0.5  # pause between attempts to rebuild a lost KV cache

    def __init__(self, config: LlamaConfig, params: dict, tokenizer,
                 engine_config: EngineConfig | None = None,
                 dtype=jnp.float32, model_name: str = "model"):
        self.model_config = config
        self.tokenizer = tokenizer
        self.engine_config = ec = engine_config or EngineConfig()
        self.model_name = model_name
        self.dtype = dtype
        self.max_model_len = ec.max_model_len or min(config.max_position_embeddings, 4096)
        self._param_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        self.runner = ModelRunner(config, params, ec, dtype, self.max_model_len)
        self.detokenizer = Detokenizer(tokenizer)
        # kv_policy "paged" is the paper's design; the others are the contiguous-cache
        # baselines of its evaluation (same engine, same kernels, different memory manager).
        self.block_manager = make_kv_manager(
            ec.kv_policy, self.runner.num_gpu_blocks, self.runner.num_cpu_blocks, ec.block_size,
            enable_prefix_caching=ec.enable_prefix_caching, max_model_len=self.max_model_len)
        self.scheduler = make_scheduler(ec.kv_policy, SchedulerConfig(
            max_model_len=self.max_model_len, max_num_seqs=ec.max_num_seqs,
            max_num_batched_tokens=ec.max_num_batched_tokens,
            enable_chunked_prefill=ec.enable_chunked_prefill, preemption_mode=ec.preemption_mode,
            policy=ec.scheduling_policy), self.block_manager)
        self.eos_token_ids = set(config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(tokenizer.eos_token_id))
        # Fixed widths of the sampler's ban lists and penalty histories (see sampler.py):
        # every request fits, so their shapes never depend on requests.
        self._ban_width = pow2_at_least(MAX_STOP_TOKEN_IDS + len(self.eos_token_ids))
        warm = ec.warmup if ec.warmup is not None else jax.default_backend() != "cpu"
        if warm:
            self.warmup()
        self._requests: dict[str, _Request] = {}
        self._pending: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self._request_counter = itertools.count()
        self._weights_version = 0
        self.num_steps = 0
        self.num_cache_rebuilds = 0
        self.num_step_failures = 0  # steps (or scheduling of a group) that raised
        self._cache_broken = False
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_step_tokens = 0

    @classmethod
    def from_model(cls, model: str = "smollm2", dtype=None, **kwargs) -> LLMEngine:
        from models.loader import load_model, read_config, resolve_dtype
        from models.tokenizer import load_tokenizer

        engine_config = EngineConfig(**kwargs)  # validated before loading weights
        tp = engine_config.tensor_parallel_size
        if tp > 1:  # a bad split fails here, not after minutes of loading
            from pagedjax.parallel import validate_tp

            validate_tp(read_config(model), tp)
        config, params, path = load_model(model, dtype, tensor_parallel_size=tp)
        return cls(config, params, load_tokenizer(path), engine_config, resolve_dtype(dtype), str(model))

    # ---- warm-up -----------------------------------------------------------
    def warmup(self) -> int:
        """Compile everything serving can run, so no request ever waits on a compile: the
        step at every shape of the runner's `ShapePlan`, block copies and swaps, and for every
        logits shape the sampler (plain and penalised/banned variants), prompt logprobs and
        beam candidate selection. Returns the number of XLA compilations it took."""
        before = num_backend_compiles()
        plan = self.runner.shape_plan
        with_prompt_lp = not self.engine_config.enable_prefix_caching
        shapes = self.runner.warmup(prompt_logprobs=with_prompt_lp)
        vocab = self.model_config.vocab_size
        dummy = SamplingParams(max_tokens=1)
        full = SamplingParams(max_tokens=2, min_tokens=1, repetition_penalty=1.1)
        dev = jax.local_devices()[0]  # the step's logits are committed there: same jit key
        for _t, s, _m, r, decode in shapes:
            logits = jax.device_put(jnp.zeros((r, vocab), jnp.float32), dev)
            for b in {self._sample_batch(1, s, decode), plan.seq_cap}:
                for p in (dummy, full):
                    meta = self._sampling_metadata([(p, SeqSamplingState([0], []))], b)
                    jax.block_until_ready(sample(logits, meta, num_logprobs=MAX_LOGPROBS,
                                                 rows=np.zeros(b, np.int32)))
            if r > s:
                jax.block_until_ready(prompt_logprobs(logits, np.zeros(r, np.int32), MAX_LOGPROBS,
                                                      rows=np.zeros(r, np.int32)))
        # Beam selection per (batch, groups, width) bucket: padded widths up to 8 (wider beams
        # compile on first use) and groups * width <= 4 * batch, which covers every mix of
        # groups whose live beams fill the batch (padding each of groups and width at most 2x).
        for b in plan.sample_buckets:
            lp = jax.device_put(jnp.zeros((b, vocab), jnp.float32), dev)
            w = 2
            while w <= min(b, MAX_WARM_BEAM_WIDTH):
                g = 1
                while g * w <= 4 * b:
                    z = np.zeros((g, w), np.int32)
                    jax.block_until_ready(beam_candidates_from_rows(
                        lp, z, z.astype(np.float32), z.astype(bool), 2 * w))
                    g *= 2
                w *= 2
        n = num_backend_compiles() - before
        logger.info("warm-up: %d step shapes, %d compilations", len(shapes), n)
        return n

    # ---- requests ----------------------------------------------------------
    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt text accepted: far more than `max_model_len` tokens can hold, so
        nothing valid is refused, but a 10 MB prompt is refused before tokenizing it (which
        took 12-17 s and stalled every stream)."""
        return MAX_CHARS_PER_TOKEN * self.max_model_len

    def check_prompt_text(self, prompt, field: str = "prompt") -> None:
        """Checks a prompt's text before any tokenization: type, emptiness, size, Unicode."""
        if not isinstance(prompt, str):
            raise ValueError(f"{field}: expected text or token ids")
        if not prompt:
            raise ValueError(f"{field}: empty prompt")
        if len(prompt) > self.max_prompt_chars:
            raise ValueError(f"{field}: {len(prompt)} characters, at most {self.max_prompt_chars} "
                             f"({MAX_CHARS_PER_TOKEN} per token of max_model_len)")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{field}: not valid Unicode text (unpaired surrogate at "
                             f"character {e.start})") from None

    def _validate_prompt(self, prompt: str | None, prompt_token_ids) -> list[int]:
        if prompt_token_ids is None:
            self.check_prompt_text(prompt)
            prompt_token_ids = self.tokenizer(prompt).input_ids
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt: empty prompt")
        vocab = self.model_config.vocab_size
        for t in ids:
            if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab:
                raise ValueError(f"prompt_token_ids: token id {t!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, must be shorter than max_model_len="
                             f"{self.max_model_len}")
        return [int(t) for t in ids]

    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | dict | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None,
                    output_kind: str = "cumulative", strict_limits: bool = False) -> None:
        """Queue a request. Raises ValueError naming the bad field; the engine is unaffected.

        `output_kind` (vLLM's `RequestOutputKind`): "cumulative" returns the request's whole
        output after every step that advanced it (streaming); "final_only" returns one output
        when it finishes, which saves copying growing outputs every step (offline batches).

        `strict_limits` (the servers pass True): refuse a request whose prompt + `max_tokens`
        exceeds `max_model_len` (as vLLM's OpenAI server does) or whose samples, all grown to
        that length, would need more KV blocks than the whole cache (`check_growth`), instead
        of running it for seconds and cutting it short. Without it (the Python API) such a
        request runs and ends with finish_reason "length" where it hits the limit."""
        if output_kind not in ("cumulative", "final_only"):
            raise ValueError(f"output_kind: must be 'cumulative' or 'final_only'; got {output_kind!r}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
            # Ids reach logs and metrics labels: bounded, and no newlines to forge log lines.
            raise ValueError(f"request_id: must be at most {MAX_REQUEST_ID_CHARS} printable "
                             "characters")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if isinstance(prompt, (list, tuple)) and prompt_token_ids is None:
            prompt, prompt_token_ids = None, list(prompt)
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        elif not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: expected SamplingParams or dict")
        ids = self._validate_prompt(prompt, prompt_token_ids)
        if params.prompt_logprobs is not None and self.engine_config.enable_prefix_caching:
            # Cached prefix tokens are never computed, so they would have no logprobs.
            raise ValueError("prompt_logprobs: not available with enable_prefix_caching=True")
        samples = params.best_of or params.n
        if samples > self.engine_config.max_num_seqs:
            raise ValueError(f"n: {samples} samples exceed max_num_seqs={self.engine_config.max_num_seqs}")
        if strict_limits:
            self.check_growth(len(ids), params.max_tokens, samples)
        seq = Sequence(next(self._seq_ids), ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = SequenceGroup(request_id, [seq], arrival, max_tokens=params.max_tokens, n=samples,
                              model_id=self.model_id)
        self.scheduler.add_seq_group(group)  # raises ValueError for impossible requests
        req = _Request(request_id, prompt, ids, params, group, next(self._request_counter), arrival,
                       final_only=output_kind == "final_only")
        self._register_seq(req, seq, 0)
        self._requests[request_id] = req

    def check_growth(self, prompt_len: int, max_tokens: int, samples: int = 1) -> None:
        """Admission control for growth: ValueError naming `max_tokens` unless the prompt plus
        `max_tokens` fits `max_model_len` and `samples` sequences of that length fit the cache."""
        if prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len={self.max_model_len}; at most {self.max_model_len - prompt_len}")
        bm = self.block_manager
        need = bm.worst_case_blocks(prompt_len, prompt_len + max_tokens, samples)
        if need > bm.growth_capacity:
            fit = self.max_output_tokens(prompt_len, samples)
            what = f"{samples} sequences" if samples > 1 else "the sequence"
            raise ValueError(
                f"max_tokens: {what} of prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) "
                f"could need {need} KV blocks, the cache holds {bm.growth_capacity}; lower "
                f"max_tokens (at most {fit} here)" + (" or n/best_of" if samples > 1 else ""))

    def max_output_tokens(self, prompt_len: int, samples: int = 1) -> int:
        """The largest `max_tokens` that `check_growth` accepts (0 if none): the default for
        clients that set none (OpenAI chat), so a default never asks for the impossible."""
        bm = self.block_manager
        lo, hi = 0, max(0, self.max_model_len - prompt_len)
        while lo < hi:  # the block need grows with the length: bisect
            mid = (lo + hi + 1) // 2
            if bm.worst_case_blocks(prompt_len, prompt_len + mid, samples) <= bm.growth_capacity:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def model_id(self) -> str:
        """Part of every prefix-cache key: KV computed with other weights is never reused."""
        return f"{self.model_name}@{self._weights_version}"

    def register_prefix(self, token_ids: list[int]) -> PrefixHandle:
        """Pin the cached full blocks of a prefix (see `LLM.register_prefix`, which runs it first)."""
        return self.block_manager.register_prefix(token_ids, model_id=self.model_id)

    def unpin_prefix(self, handle: PrefixHandle) -> None:
        self.block_manager.unpin(handle)

    def _register_seq(self, req: _Request, seq: Sequence, index: int) -> None:
        req.seq_index[seq.seq_id] = index
        req.detok[seq.seq_id] = DetokState(prefix_offset=max(0, seq.num_prompt_tokens - 5),
                                           read_offset=seq.num_prompt_tokens)
        req.logprobs[seq.seq_id] = []

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort between steps: blocks are freed now, an 'abort' output comes from the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            req = self._requests.pop(rid, None)
            if req is None:
                continue
            self.scheduler.abort_seq_group(rid)
            for seq in req.group.seqs:
                if not seq.status.is_finished:
                    seq.status = SequenceStatus.FINISHED_ABORTED
            self._pending.append(self._make_output(req, final=True))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- step --------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """False while the device KV cache is lost and not yet rebuilt (health checks say
        NOT_SERVING then); every `step` tries to rebuild it first."""
        return not self._cache_broken

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._cache_broken and not self._try_reset_cache():
            return outputs
        try:
            sched = self.scheduler.schedule()
        except Exception as exc:  # a bug: the scheduler guards each group, this is a last resort
            logger.exception("schedule() failed")
            error = f"internal error while scheduling: {type(exc).__name__}: {exc}"
            for g in list(self.scheduler.running) + list(self.scheduler.swapped):
                req = self._requests.pop(g.request_id, None)
                self.scheduler.abort_seq_group(g.request_id)
                if req is not None:
                    outputs.append(self._fail(req, error))
            self.num_step_failures += 1
            return outputs
        for g, error in sched.failed:
            self.num_step_failures += 1
            req = self._requests.pop(g.request_id, None)
            if req is not None:
                outputs.append(self._fail(req, f"internal error while scheduling: {error}"))
        for g in sched.rejected:
            req = self._requests.pop(g.request_id, None)
            if req is not None:
                self.scheduler.abort_seq_group(g.request_id)
                outputs.append(self._cut_short(req))
        if sched.is_empty:
            return outputs
        try:
            self.runner.swap_out(sched.blocks_to_swap_out)
            self.runner.swap_in(sched.blocks_to_swap_in)
            self.runner.copy_blocks(sched.blocks_to_copy)
            sampled = self._execute(sched) if sched.scheduled else None
        except Exception as exc:  # one bad step fails its requests, never the engine
            logger.exception("step failed")
            self.num_step_failures += 1
            error = f"internal error: {type(exc).__name__}: {exc}"
            for g in sched.scheduled_groups:
                req = self._requests.pop(g.request_id, None)
                if req is not None:
                    self.scheduler.abort_seq_group(g.request_id)
                    outputs.append(self._fail(req, error))
            # Groups swapped out in this step may hold CPU blocks that were never written.
            swapped_now = {g.request_id for g in self.scheduler.swapped} & set(sched.preempted)
            for rid in swapped_now:
                req = self._requests.pop(rid, None)
                self.scheduler.abort_seq_group(rid)
                if req is not None:
                    outputs.append(self._fail(req, f"{error} (while swapping it out)"))
            if self.runner.cache_lost():
                outputs += self._rebuild_cache(error)
            return outputs
        self.num_steps += 1
        self.last_step_tokens = sched.num_batched_tokens
        self.scheduler.update_after_step(sched)
        for s in sched.scheduled:  # first chunk of a request: what the prefix cache skipped
            req = self._requests.get(s.request_id)
            if req is not None and req.num_cached_tokens is None:
                req.num_cached_tokens = s.start_pos
                self.prompt_tokens_total += len(req.prompt_token_ids)
        touched = self._apply_samples(sched, sampled) if sampled else set()
        self.scheduler.free_finished_seq_groups()
        for rid in touched:
            req = self._requests.get(rid)
            if req is None:
                continue
            done = req.group.is_finished()
            if done:
                del self._requests[rid]
            if done or not (req.final_only or req.is_beam
                            or (req.params.best_of and req.params.best_of > req.params.n)):
                outputs.append(self._make_output(req, final=done))
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
                outputs.append(self._fail(req, f"{error} (the KV cache was lost and rebuilt)"))
        self.block_manager.reset_prefix_cache()  # cached blocks held KV of the lost cache
        self._cache_broken = True
        self._try_reset_cache()
        return outputs

    def _try_reset_cache(self) -> bool:
        """Allocate a fresh device cache; on failure (e.g. the device is still out of memory)
        stay unhealthy and try again at the next step. Waiting and swapped requests wait."""
        try:
            self.runner.reset_cache()
        except Exception:
            logger.exception("rebuilding the KV cache failed; retrying at the next step")
            time.sleep(self.CACHE_RETRY_S)  # no busy loop while the device recovers
            return False
        self._cache_broken = False
        self.num_cache_rebuilds += 1
        logger.info("KV cache rebuilt; serving again")
        return True

    def _cut_short(self, req: _Request) -> RequestOutput:
        """A request the scheduler can no longer place (it outgrew the whole cache: n>1
        samples or beams recomputed without sharing, or pinned prefixes took the room) ends
        with finish_reason "length" and what it generated, rather than an error; one that
        generated nothing yet fails with a clear error."""
        if not any(s.output_token_ids for s in req.group.seqs):
            return self._fail(req, "request can never be scheduled in this KV cache: it needs "
                                   "more KV blocks than the whole cache holds")
        for seq in req.group.seqs:
            if seq.status in (SequenceStatus.FINISHED_IGNORED, SequenceStatus.FINISHED_ABORTED) \
                    or not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_LENGTH
                st = req.detok.get(seq.seq_id)
                if st is not None:
                    self.detokenizer.flush(seq.get_token_slice, seq.num_total_tokens, st,
                                           req.params.skip_special_tokens)
        logger.warning("request %s outgrew the KV cache: finished with 'length' after %d tokens",
                       req.request_id, max(s.num_output_tokens for s in req.group.seqs))
        return self._make_output(req, final=True)

    def _rows_for(self, sched) -> tuple[list[int], list[tuple], list[int]]:
        """Logits rows per scheduled sequence (1 if it samples, else 0), the sampled rows, and
        the logits row of each sampled row: a fresh prompt of an n>1 request has one logits
        row and fans out into n sampled rows, so the step's shape never depends on n."""
        rows_per_seq, row_info, row_src = [], [], []
        n_logits = 0
        for s in sched.scheduled:
            if not s.needs_logits:
                rows_per_seq.append(0)
                continue
            req = self._requests[s.request_id]
            group = req.group
            fan_out = (not req.is_beam and len(group.seqs) == 1 and req.num_samples > 1
                       and not group.seqs[0].output_token_ids)
            seq = next(q for q in group.seqs if q.seq_id == s.seq_id)
            for j in range(req.num_samples if fan_out else 1):
                row_info.append((req, seq, j if fan_out else req.seq_index[seq.seq_id], fan_out))
                row_src.append(n_logits)
            rows_per_seq.append(1)
            n_logits += 1
        return rows_per_seq, row_info, row_src

    def _prompt_rows(self, sched) -> tuple[list[int], list[tuple[_Request, int]]]:
        """Flat token rows whose logits score the next prompt token, for requests that asked
        for prompt logprobs; positions already scored (e.g. before a recompute) are skipped."""
        rows: list[int] = []
        plan: list[tuple[_Request, int]] = []
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
        return prompt_logprobs(logits, next_ids, MAX_LOGPROBS, rows=rows)

    def _record_prompt_logprobs(self, plan, scored) -> None:
        for i, (req, pos) in enumerate(plan):
            k = req.params.prompt_logprobs
            entry = {int(t): float(v) for t, v in zip(scored.topk_ids[i][:k], scored.topk_logprobs[i][:k])}
            entry[req.prompt_token_ids[pos + 1]] = float(scored.token_logprobs[i])
            req.prompt_lp[pos] = entry

    def _sample_batch(self, num_rows: int, seq_pad: int, decode_only: bool) -> int:
        """Padded sampler batch: the step's sequence bucket for decodes; the largest bucket
        for steps with prefill or fan-out (a fresh prompt may fan out into up to
        max_num_seqs samples), so a logits shape meets at most two sampler batch sizes."""
        return seq_pad if decode_only and num_rows <= seq_pad else self.runner.shape_plan.seq_cap

    def _sampling_metadata(self, rows: list[tuple], pad_to: int) -> SamplingMetadata:
        meta = SamplingMetadata.from_params(
            rows, pad_to=pad_to, vocab_size=self.model_config.vocab_size,
            eos_token_ids=sorted(self.eos_token_ids), engine_seed=self.engine_config.seed,
            history_width=self.max_model_len, ban_width=self._ban_width)
        want = any(p.logprobs for p, _ in rows)
        return meta.replace(want_topk=np.bool_(want))

    def _execute(self, sched):
        rows_per_seq, row_info, row_src = self._rows_for(sched)
        p_rows, p_plan = self._prompt_rows(sched)
        inputs = build_step_inputs(sched.scheduled, self.engine_config.block_size,
                                   self.runner.max_blocks_per_seq, rows_per_seq, p_rows,
                                   plan=self.runner.shape_plan)
        logits = self.runner.execute(inputs)
        scored = self._score_prompt(logits, sum(rows_per_seq), p_plan) if p_plan else None
        if not row_info:
            if scored is not None:
                self._record_prompt_logprobs(p_plan, jax.device_get(scored))
            return None
        b_pad = self._sample_batch(len(row_info), inputs.shape_key[1], inputs.meta.decode_only)
        src = np.zeros(b_pad, np.int32)
        src[: len(row_src)] = row_src
        rows = [(req.params, SeqSamplingState(seq.prompt_token_ids, seq.output_token_ids,
                                              req.counter, index)) for req, seq, index, _ in row_info]
        meta = self._sampling_metadata(rows, b_pad)
        out = sample(logits, meta, num_logprobs=MAX_LOGPROBS, rows=src)
        beams = self._beam_candidates(out.raw_logprobs, row_info)
        # The step's one host sync (sampled tokens and beam candidates together).
        small, cands, scored = jax.device_get(
            (out._replace(raw_logprobs=None), beams[1] if beams else None, scored))
        if scored is not None:
            self._record_prompt_logprobs(p_plan, scored)
        if beams:
            cands = [jax.tree.map(lambda x, g=g: x[g], cands) for g in range(len(beams[0]))]
            cands += beams[2]
        return row_info, small, (beams[0] + beams[3], cands) if beams else None

    def _beam_candidates(self, logprobs: jax.Array, row_info: list[tuple]):
        """Launch on-device candidate selection for every beam group whose live beams all have
        logprobs rows in this step (rows of the sampler's raw log-softmax ``[B, V]``).

        Returns ``(groups, device candidates, host candidates, host groups)`` or None; a group
        whose beams were split over steps by the token budget is finished on the host.
        """
        rows: dict[str, dict[int, int]] = {}
        for r, (req, seq, _index, _fan) in enumerate(row_info):
            if req.is_beam:
                rows.setdefault(req.request_id, {})[seq.seq_id] = r
        if not rows:
            return None
        ready: list[tuple[_Request, list[Sequence], list[int]]] = []
        host_groups: list[tuple[_Request, list[Sequence]]] = []
        host_cands = []
        for rid, by_seq in rows.items():
            req = self._requests[rid]
            live = req.group.get_unfinished_seqs()
            if all(s.seq_id in by_seq for s in live):
                ready.append((req, live, [by_seq[s.seq_id] for s in live]))
                continue
            # Split group (rare): keep these rows on the host until the siblings arrive.
            got = np.asarray(jax.device_get(logprobs[np.asarray(list(by_seq.values()))]))
            for sid, row in zip(by_seq, got):
                req.beam_pending[sid] = row
            if all(s.seq_id in req.beam_pending for s in live):
                lp = np.stack([req.beam_pending.pop(s.seq_id) for s in live])
                host_cands.append(beam_candidates_numpy(
                    lp, [s.cumulative_logprob for s in live], 2 * req.params.beam_width))
                host_groups.append((req, live))
        if not ready and not host_groups:
            return None
        groups = [(req, live) for req, live, _ in ready]
        if not ready:
            return groups, None, [jax.tree.map(lambda x: x[0], c) for c in host_cands], host_groups
        # Candidates come from 2 * width columns: at least twice the widest beam_width (on
        # the first step a group has one live beam but needs 2 * beam_width candidates).
        width = pow2_at_least(max(max(len(cols), req.params.beam_width) for req, _, cols in ready))
        g_pad = pow2_at_least(len(ready))
        idx = np.zeros((g_pad, width), np.int32)
        live_mask = np.zeros((g_pad, width), bool)
        cum = np.zeros((g_pad, width), np.float32)
        for g, (_req, live, cols) in enumerate(ready):
            idx[g, : len(cols)] = cols
            live_mask[g, : len(cols)] = True
            cum[g, : len(cols)] = [s.cumulative_logprob for s in live]
        cands = beam_candidates_from_rows(logprobs, idx, cum, live_mask, 2 * width)
        return groups, cands, [jax.tree.map(lambda x: x[0], c) for c in host_cands], host_groups

    def _apply_samples(self, sched, sampled) -> set[str]:
        row_info, out, beams = sampled
        touched = {s.request_id for s in sched.scheduled}
        children: dict[int, Sequence] = {}
        for r, (req, seq, index, fan_out) in enumerate(row_info):
            target = seq
            if fan_out and index > 0:
                target = seq.fork(next(self._seq_ids))
                self.scheduler.fork_seq(seq, target)
                req.group.add(target)
                self._register_seq(req, target, index)
                children[r] = target
        token_ids, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
        appended = []
        for r, (req, seq, _index, _fan) in enumerate(row_info):
            if req.is_beam:
                continue
            target = children.get(r, seq)
            appended.append(self._append_token(req, target, token_ids[r], logprobs[r],
                                               out.topk_ids[r], out.topk_logprobs[r]))
        self._check_stops(appended)
        if beams is not None:
            groups, cands = beams
            for (req, live), c in zip(groups, cands):
                k = 2 * req.params.beam_width  # the top 2W of the padded width's candidates
                self._advance_beams(req, live, c.parent[:k], c.token_ids[:k],
                                    c.cum_logprobs[:k], c.valid[:k])
        return touched

    def _advance_beams(self, req: _Request, live: list[Sequence], parents, tokens, cums, valid) -> None:
        """One beam step on the host: finish EOS hypotheses, free dropped beams, fork survivors."""
        p = req.params
        width = p.beam_width
        eos = set() if p.ignore_eos else self.eos_token_ids | set(p.stop_token_ids)
        new_live, new_fin = split_candidates(parents, tokens, cums, width, eos, valid)
        for c in new_fin:
            parent = live[c.parent]
            done = parent.fork(next(self._seq_ids))  # history only: a finished beam holds no blocks
            done.append_token(c.token_id, c.cum_logprob - parent.cumulative_logprob)
            done.cumulative_logprob = c.cum_logprob
            done.status = SequenceStatus.FINISHED_STOPPED
            score = length_penalized_score(c.cum_logprob, parent.num_total_tokens, p.length_penalty)
            req.beam_finished.append((score, done))
        # Free dropped beams BEFORE forking: the contiguous baselines give each fork its own
        # region from the buddy allocator, and on a full pool only a dropped beam's region (same
        # size) can take it. Paged forks share the parent's blocks, and a dropped beam is never a
        # parent, so the order changes nothing there.
        parents = {live[c.parent].seq_id for c in new_live}
        for s in live:
            if s.seq_id not in parents:  # no surviving candidate: drop the beam and its blocks
                self.scheduler.free_seq(s)
                s.status = SequenceStatus.FINISHED_ABORTED
                req.group.remove(s.seq_id)
                for d in (req.seq_index, req.detok, req.logprobs):
                    d.pop(s.seq_id, None)
        used: set[int] = set()
        assigned: list[tuple[Sequence, float, int]] = []
        for c in new_live:  # fork before any append: children copy the parent's pre-step state
            parent = live[c.parent]
            if parent.seq_id in used:
                target = parent.fork(next(self._seq_ids))
                self.scheduler.fork_seq(parent, target)  # paged: shares every block, CoW on next write
                req.group.add(target)
                self._register_seq(req, target, len(req.seq_index))
            else:
                used.add(parent.seq_id)
                target = parent
            assigned.append((target, c.cum_logprob, c.token_id))
        for target, cum, token in assigned:
            target.append_token(token, cum - target.cumulative_logprob)
            target.cumulative_logprob = cum
            self.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        survivors = [t for t, _, _ in assigned]
        if not survivors:
            return
        best = survivors[0]  # candidates are sorted best-first
        at_limit = (best.num_output_tokens >= p.max_tokens
                    or best.num_total_tokens >= self.max_model_len)
        if at_limit:  # the live beams are hypotheses too
            for s in survivors:
                s.status = SequenceStatus.FINISHED_LENGTH
                score = length_penalized_score(s.cumulative_logprob, s.num_total_tokens, p.length_penalty)
                req.beam_finished.append((score, s))
        elif should_stop([sc for sc, _ in req.beam_finished], best.cumulative_logprob,
                         best.num_total_tokens, width, p.length_penalty, p.early_stopping,
                         min(best.num_prompt_tokens + p.max_tokens, self.max_model_len)):
            for s in survivors:
                s.status = SequenceStatus.FINISHED_ABORTED  # not returned: cannot beat the finished

    def _append_token(self, req: _Request, seq: Sequence, token: int, logprob: float,
                      topk_ids, topk_logprobs) -> tuple:
        """Append a sampled token and decide the stops that need no text (EOS, stop ids);
        text-based stops follow for the whole step at once (`_check_stops`)."""
        p = req.params
        seq.append_token(token, logprob)
        self.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if p.logprobs is not None:
            entry = {int(i): float(v)
                     for i, v in zip(topk_ids[: p.logprobs], topk_logprobs[: p.logprobs])}
            entry[token] = logprob
            req.logprobs[seq.seq_id].append(entry)
        n_out = seq.num_output_tokens
        status, reason = None, None
        if token in self.eos_token_ids and not p.ignore_eos and n_out > p.min_tokens - 1:
            status = SequenceStatus.FINISHED_STOPPED
        elif p.stop_token_ids and token in p.stop_token_ids and n_out > p.min_tokens - 1:
            status, reason = SequenceStatus.FINISHED_STOPPED, token
        return req, seq, status, reason

    def _check_stops(self, appended: list[tuple]) -> None:
        """Detokenize every sequence that got a token (one batched decode), then apply stop
        strings and length limits, and flush the text of those that finished."""
        items = [(seq.get_token_slice, seq.num_total_tokens, req.detok[seq.seq_id],
                  req.params.skip_special_tokens) for req, seq, _, _ in appended]
        old_lens = [len(st.text) for _, _, st, _ in items]
        self.detokenizer.step(items)
        for (req, seq, status, reason), (get, total, state, skip), old in zip(
                appended, items, old_lens):
            p = req.params
            n_out = seq.num_output_tokens
            if status is None and p.stop_strings and n_out >= p.min_tokens:
                hit = self._find_stop(state, p, old)
                if hit is not None:
                    status, reason = SequenceStatus.FINISHED_STOPPED, hit
            if status is None and (n_out >= p.max_tokens or total >= self.max_model_len):
                status = SequenceStatus.FINISHED_LENGTH
            if status is not None:
                if reason is None or not isinstance(reason, str):
                    self.detokenizer.flush(get, total, state, skip)
                seq.status = status
                req.stop_reason[seq.seq_id] = reason

    @staticmethod
    def _find_stop(state: DetokState, p: SamplingParams, old_len: int) -> str | None:
        """The first stop string (in the request's order, as vLLM) found in the text released
        this step or spanning into it: only that tail is searched, so the cost does not grow
        with the output, and text released before `min_tokens` never stops a sequence later."""
        start = max(0, old_len - max(len(x) for x in p.stop_strings) + 1)
        for stop in p.stop_strings:
            idx = state.text.find(stop, start)
            if idx >= 0:
                end = idx + len(stop) if p.include_stop_str_in_output else idx
                state.text = state.text[:end]
                return stop
        return None

    # ---- outputs -----------------------------------------------------------
    def _completion(self, req: _Request, seq: Sequence, index: int) -> CompletionOutput:
        return CompletionOutput(
            index=index, text=req.detok[seq.seq_id].text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(req.logprobs[seq.seq_id]) if req.params.logprobs is not None else None,
            finish_reason=FINISH_REASON.get(seq.status), stop_reason=req.stop_reason.get(seq.seq_id))

    def _beam_completions(self, req: _Request) -> list[CompletionOutput]:
        """The n best hypotheses by length-penalised score (live beams if none finished, e.g. abort)."""
        p = req.params
        pool = req.beam_finished or [
            (length_penalized_score(s.cumulative_logprob, s.num_total_tokens, p.length_penalty), s)
            for s in req.group.seqs]
        best = sorted(pool, key=lambda x: -x[0])[: p.n]
        comps = []
        for i, (_score, s) in enumerate(best):
            ids = list(s.output_token_ids)
            comps.append(CompletionOutput(
                index=i, text=self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
                if self.tokenizer is not None else "", token_ids=ids,
                cumulative_logprob=s.cumulative_logprob,
                finish_reason=FINISH_REASON.get(s.status, "abort")))
        return comps

    def _make_output(self, req: _Request, final: bool) -> RequestOutput:
        if req.is_beam:
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                                 self._beam_completions(req), finished=final,
                                 num_cached_tokens=req.num_cached_tokens or 0)
        seqs = sorted(req.group.seqs, key=lambda s: req.seq_index[s.seq_id])
        if final and req.params.best_of and req.params.best_of > req.params.n:
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: req.params.n]
            comps = [self._completion(req, s, i) for i, s in enumerate(seqs)]
        else:
            comps = [self._completion(req, s, req.seq_index[s.seq_id]) for s in seqs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, finished=final,
                             num_cached_tokens=req.num_cached_tokens or 0,
                             prompt_logprobs=self._prompt_logprobs_out(req))

    @staticmethod
    def _prompt_logprobs_out(req: _Request) -> list[dict[int, float] | None] | None:
        """vLLM's shape: None for the first prompt token, then one dict per later token."""
        if req.params.prompt_logprobs is None:
            return None
        return [None] + [req.prompt_lp.get(p) for p in range(len(req.prompt_token_ids) - 1)]

    def _fail(self, req: _Request, error: str) -> RequestOutput:
        for seq in req.group.seqs:
            seq.status = SequenceStatus.FINISHED_ABORTED
        out = self._make_output(req, final=True)
        out.error = error
        return out

    # ---- weights and stats -------------------------------------------------
    def update_params(self, new_params: dict) -> None:
        """Swap weights in place: same shapes/dtypes, so no recompilation and the KV cache stays.

        All KV was computed with the old weights: in-flight requests are preempted and
        recomputed (tokens generated so far are kept), the prefix cache is reset, and new
        block hashes carry the new weights version, so old KV is never reused."""
        old = jax.tree.map(lambda x: (x.shape, x.dtype), self._param_spec)
        new = jax.tree.map(lambda x: (x.shape, x.dtype), new_params)
        if jax.tree.structure(old) != jax.tree.structure(new) or old != new:
            raise ValueError("params: new params must have the same structure, shapes and dtypes")
        self.scheduler.recompute_all()
        self.runner.params = self.runner.place_params(new_params)
        self._weights_version += 1
        self.block_manager.reset_prefix_cache()

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
            healthy=self.healthy)
