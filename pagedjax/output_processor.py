"""Output processing: what the engine does with sampled tokens on the host.

The scheduler appends each sampled token and applies the stops that need no text (EOS, stop
token ids, lengths: `Scheduler.update_from_output`); this module then records logprobs,
detokenizes every sequence that got a token in one batched call (`Detokenizer`), finds stop
strings (reported back to the scheduler, which owns sequence state) and builds the
`RequestOutput`s clients see (cumulative text, logprobs, prompt logprobs, beam hypotheses by
score). It holds no device state and never touches blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from pagedjax.beam_search import length_penalized_score
from pagedjax.core import AppliedToken, Sequence, SequenceGroup
from pagedjax.core.sequence import _FIRST_FINISHED, SequenceStatus
from pagedjax.core.steady_decode import DecodeCohort
from pagedjax.detokenizer import Detokenizer, DetokState
from pagedjax.outputs import CompletionOutput, RequestOutput, running_delta
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

def top_entry(ids: list[int], lps: list[float], k: int) -> dict[int, float]:
    """A row's top-``k`` logprob entry from its top-k lists (as wide as the step's widest
    request asks, so maybe wider than ``k``). Literals for the common small counts: ~0.1 us
    a row against ~0.5 for dict(zip()) of two slices, for every logprob row of every step."""
    if k == 1:
        return {ids[0]: lps[0]}
    if k == 2:
        return {ids[0]: lps[0], ids[1]: lps[1]}
    return dict(zip(ids[:k], lps[:k]) if k < len(ids) else zip(ids, lps))


def pipe_block(rids: list[str], tokens: list[int], logprobs: tuple | None = None) -> tuple:
    """A steady step's running pipe rows (the engine process's child, `LLMEngine.pipe_rows`)
    as columns: ``(None, rids, tokens, logprobs)``, one new token per row; ``logprobs``:
    None, or per row ``(cumulative logprobs, logprob counts, top-k ids, top-k logprobs,
    sampled token logprobs)``. What a `delta_row` of each would carry, less what is fixed
    after a request's first output (its prompt, index, cached-token count, first scheduled
    time: the front end keeps them from that output, `decode_outputs`) and with the logprob
    entries left to the front end to build (`top_entry`), as vLLM V1's engine core sends
    arrays, not dictionaries. A None where a row's request id would be marks it.

    Pickling 256 rows as tuples (a list and two tuples each) cost ~0.15 ms of the child's
    step and building a logprob row's entry ~0.5 us; a block is a few flat lists."""
    return (None, rids, tokens, logprobs)


def _hand_over(entries: list, a: int, b: int) -> list:
    """``entries[a:b]``, a delta's logprob entries, with the engine's references to them
    dropped (None in their place): once sent they are the client's (a delta only ever reads
    the entries past its last output), so they are freed with its outputs instead of living
    as long as the request. CPython counts every allocation of a container toward the
    collector's young generation, dictionaries it does not track included, until it is
    freed: 128 logprob streams' kept entries set off a gen-0 collection (~1 ms) every ~80
    steps at 256 rows."""
    got = entries[a:b]
    for i in range(a, b):
        entries[i] = None
    return got


# `OutputProcessor._stream_columns`' row kinds: a text stream without stop strings, one
# with them, an engine-process pipe row.
_PLAIN, _STOPS, _PIPE = 0, 1, 2


@dataclasses.dataclass
class RequestState:
    """The host-side state of one request next to its `SequenceGroup`: per-sequence output
    index, incremental detokenization, logprobs and stop reasons, and beam hypotheses."""

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
    delta: bool = False  # output_kind "delta": each output holds only what is new
    # output_kind "delta_ids": deltas without text; the text is decoded in the front end.
    text_free: bool = False
    # output_kind "delta": per sequence, (tokens, characters) already in an output.
    sent: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # Beam search: finished hypotheses (score, seq) and logits rows of beams whose siblings
    # were not all computed in the same step (e.g. a token budget split the group).
    beam_finished: list[tuple[float, Sequence]] = dataclasses.field(default_factory=list)
    # Prompt logprobs by position p (the distribution that predicted prompt token p + 1).
    prompt_lp: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)
    beam_pending: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    first_scheduled_time: float | None = None  # monotonic; the end of its queue time
    grammar: str | None = None  # structured outputs: the compiled grammar (`pagedjax.structured`)
    allowed_mask: np.ndarray | None = None  # allowed_token_ids, packed as the sampler's bitmask
    bad_words: list[list[int]] = dataclasses.field(default_factory=list)  # token sequences

    def __post_init__(self) -> None:
        p = self.params
        # An output after every step that advances it (else only the final one): asked for
        # every request of every step, so decided once.
        self.streams = not (self.final_only or p.use_beam_search
                            or (p.best_of is not None and p.best_of > p.n))
        self.has_stop_strings = p.has_stop_strings  # read for every token
        self.is_beam = p.use_beam_search
        self.penalised = p.uses_penalties  # read for every row of a sampled step
        # Set by `OutputProcessor.process` once its first token is in: no text, no logprobs,
        # so a token of a running sequence of it needs no output processing.
        self.quiet = False
        self.min_tokens = p.min_tokens
        # Its sampling metadata row is the same at every step once past `min_tokens`, but
        # for a penalty history (gathered apart, `worker.cohort_metadata`): no grammar or bad
        # words to follow.
        self.fixed_sampling = not (self.bad_words or self.is_beam or self.grammar is not None)
        # Nothing reads its text before its final output (no per-step output, no stop
        # string to find): each sequence is decoded once, when it finishes or the output is
        # made, not a token at a time, which takes detokenization off every step's host time.
        self.lazy_text = ((self.final_only or self.text_free) and not self.has_stop_strings
                          and not self.is_beam)
        # Its rows need nothing but the argmax (`sample_greedy`), once past `min_tokens`:
        # a batch of such rows skips building sampling metadata (`LLMEngine._plain_greedy`).
        self.plain_greedy = (p.is_greedy and not p.uses_penalties and not p.logit_bias
                             and not p.logprobs and not p.use_beam_search
                             and self.grammar is None and self.allowed_mask is None
                             and not self.bad_words)
        # And wants no logprob at all, one sample: its tokens may come from the screened LM
        # head, which computes none (`LLMEngine._plain_greedy`).
        self.screenable = self.plain_greedy and p.logprobs is None and self.num_samples == 1
        self.one_sample = self.num_samples == 1  # n and best_of never change
        # Its decode rows take the engine's plain path (`LLMEngine._apply_plain`): one sample,
        # no beam, no grammar to advance, so a token only ever appends to its one sequence.
        self.plain_row = self.one_sample and not self.is_beam and self.grammar is None
        # Its deltas may go to the engine process's pipe as rows (`OutputProcessor.delta_row`).
        self.pipe_row = (self.text_free and self.num_samples == 1 and not self.is_beam
                         and p.prompt_logprobs is None)
        # A delta stream of text and token ids (most servers' streams): one sequence, no
        # logprobs or prompt logprobs, stop strings or not. Its running rows
        # of a steady step are applied and output from the step's columns
        # (`OutputProcessor.stream_rows`), once its first token is in.
        self.stream_plain = (self.delta and not self.text_free and self.plain_row
                             and p.logprobs is None and p.prompt_logprobs is None)
        # A pipe row without logprobs: the engine process's running rows of a steady step
        # are made from the step's columns too (`OutputProcessor.stream_rows`), once its
        # first output went (`sent`).
        self.pipe_plain = self.pipe_row and self.plain_row and p.logprobs is None

    @property
    def num_samples(self) -> int:
        return self.params.best_of or self.params.n

    def register(self, seq: Sequence, index: int) -> None:
        """Track a new sequence of this request (the prompt's, a fork's) as output `index`."""
        self.seq_index[seq.seq_id] = index
        self.detok[seq.seq_id] = DetokState(prefix_offset=max(0, seq.num_prompt_tokens - 5),
                                            read_offset=seq.num_prompt_tokens)
        self.logprobs[seq.seq_id] = []

    def forget(self, seq: Sequence) -> None:
        """Stop tracking a dropped beam."""
        for d in (self.seq_index, self.detok, self.logprobs):
            d.pop(seq.seq_id, None)


class OutputProcessor:
    """Stops, detokenization and `RequestOutput`s for the engine's requests."""

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.generation_tokens_total = 0
        # `_stream_columns`: the cohort's key, its per-row columns (None: a quiet row, else
        # (kind, column)), and of those the text streams' without stop strings and with
        # them, and the pipe rows'.
        self._stream_cols: tuple = (0, [], [], [], [])
        # `listed_rows`: the cohort's key, its listed row indices, their columns and the
        # widest logprob count among them.
        self._listed_cols: tuple = (0, [], [], 0)

    def forget_stream_columns(self) -> None:
        """Drop the cached columns (the engine's row kinds changed: `LLMEngine.pipe_rows`)."""
        self._stream_cols = (0, [], [], [], [])
        self._listed_cols = (0, [], [], 0)

    def process(self, applied: list[AppliedToken], rows: list[tuple[RequestState, int]] | None,
                out, row_info: list[tuple] | None = None, num_tokens: int | None = None
                ) -> list[tuple[RequestState, Sequence]]:
        """The host side of tokens the scheduler appended (`Scheduler.update_from_output`):
        logprobs, first-token times, one batched detokenization of every sequence that got a
        token, then stop strings. Returns the sequences a stop string finished, for the
        scheduler to stop; records every finished sequence's stop reason. ``rows`` holds each
        token's request and sampler row; None: token i is row i, of ``row_info[i]``'s request
        (`Scheduler.update_from_rows`). ``num_tokens``: the step's applied tokens, when
        ``applied`` lists only some (the others quiet, `RequestState.quiet`)."""
        plain = rows is None
        now = time.monotonic()
        items = []
        # (item, token, request, released length before): sequences with stop strings or no
        # longer running (maybe finished), the only ones the second pass needs to look at.
        check = []
        top = None  # the step's top-k ids / logprobs as lists, made once if a row wants them
        self.generation_tokens_total += len(applied) if num_tokens is None else num_tokens
        running = SequenceStatus.RUNNING
        append_token = self.detokenizer.append_token
        for a in applied:
            if plain:  # no (request, row) pair made per token
                r = a.index
                req = row_info[r][0]
            else:
                req, r = rows[a.index]
            seq = a.seq
            p = req.params
            if req.first_token_time is None:
                req.first_token_time = now
                # From its second token on, a running sequence of it needs nothing here.
                req.quiet = req.lazy_text and p.logprobs is None
            if p.logprobs is not None:
                if top is None:
                    width = max((row_info if plain else rows)[b.index][0].params.logprobs or 0
                                for b in applied)
                    top = (out.topk_ids[:, :width].tolist(), out.topk_logprobs[:, :width].tolist(),
                           out.token_ids.tolist(), out.logprobs.tolist())
                entry = top_entry(top[0][r], top[1][r], p.logprobs)
                # This row's token (a speculative step appends several per sequence).
                entry[top[2][r]] = top[3][r]
                req.logprobs[seq.seq_id].append(entry)
            if req.lazy_text and seq.status is running:
                continue  # no text, no stop string: nothing to do before it finishes
            state = req.detok[seq.seq_id]
            out_ids = seq.output_token_ids
            total = len(seq.prompt_token_ids) + len(out_ids)
            skip = p.skip_special_tokens
            if req.has_stop_strings or seq.status is not running:
                check.append((a, req, state, state.length, total, skip))
            if req.lazy_text:
                continue  # decoded once it finishes (below) or its output is made
            if not append_token(state, out_ids[-1], total, skip):
                # A window to decode: all of them in one call below.
                items.append((seq.get_token_slice, total, state, skip))
        if items:
            self.detokenizer.step(items)
        stopped = []
        length_cap = SequenceStatus.FINISHED_LENGTH
        for a, req, state, old, total, skip in check:
            seq = a.seq
            status, reason = seq.status, a.stop_reason
            finished = status.is_finished
            # A stop string wins over a length limit reached by the same token (vLLM's order:
            # EOS / stop ids, then stop strings, then lengths).
            if req.has_stop_strings and (not finished or status is length_cap):
                p = req.params
                if len(seq.output_token_ids) >= p.min_tokens:
                    hit = self.find_stop(state, p, old)
                    if hit is not None:
                        stopped.append((req, seq))
                        finished, reason = True, hit
            if finished:
                if not isinstance(reason, str) and not req.text_free:
                    self.detokenizer.flush(seq.get_token_slice, total, state, skip)
                req.stop_reason[seq.seq_id] = reason
        return stopped

    def listed_rows(self, row_info: list[tuple], cohort: DecodeCohort, listed: list[int], out,
                    made: list | None = None, pipe: bool = False
                    ) -> tuple[list[tuple[RequestState, Sequence]], list[str]]:
        """`process` for a steady step's running listed rows (`LLMEngine._steady_classes`:
        rows with logprobs, text-producing final-only rows with stop strings), whose tokens
        `Scheduler.update_steady` appended: their logprob entries, incremental text and
        stop strings. Rows that ended take `process` (the scheduler lists them in its
        applied entries). Returns the sequences a stop string finished, for the scheduler to
        stop, their stop reasons recorded, and the ids of the requests whose rows it took
        and whose outputs are still to make. With ``made``, the running one-sequence delta
        streams' outputs are made here, as `make_output` makes them, and appended to it;
        with ``pipe`` too (the engine process's child, `LLMEngine.pipe_rows`), the pipe rows
        past their first output with one token since the last go as one `pipe_block`, their
        logprob entries left to the front end; another pipe row as `delta_row` makes it.

        The same work as `process`, less what is fixed for a row's life: its request's
        flags, detokenizer state, output and logprob lists and prompt length come from
        columns made once per cohort and cut with it, so the loop reads no dictionary and
        tests no flag it need not (~2.2 us a row against ~3.5 in `process`, `--phases` of
        `bench/host_overhead.py --mixes mixed`). Equal to `process` step by step
        (`tests/engine/test_stream_rows.py`'s listed cases)."""
        key, rows, cols, width = self._listed_cols
        if key != cohort.key:
            if cohort.parent is not None and cohort.parent[0] == key:
                at = {r: j for j, r in enumerate(rows)}
                cols = [cols[at[i]] for i in cohort.parent[1] if i in at]
            if len(cols) != len(listed) or cohort.parent is None or cohort.parent[0] != key:
                # (A cut's rows are the engine's listed ones cut alike: a mismatch would mean
                # they were classified afresh, so the columns are made afresh too.)
                cols = []
                texts = self.detokenizer.token_texts() or ([], [])
                for r in listed:
                    req, seq = row_info[r][0], row_info[r][1]
                    p, sid = req.params, seq.seq_id
                    # A running delta stream's output fields fixed past its first token.
                    stream = ((req.request_id, req.prompt, req.prompt_token_ids,
                               req.seq_index[sid], req.sent, sid, req.num_cached_tokens or 0,
                               req.first_scheduled_time, req.pipe_row)
                              if req.delta and p.prompt_logprobs is None
                              and len(req.group.seqs) == 1 else None)
                    cols.append((req, seq, req.detok[sid], seq.output_token_ids,
                                 len(seq.prompt_token_ids),
                                 None if p.logprobs is None else req.logprobs[sid],
                                 p.logprobs, req.lazy_text,
                                 (p.stops, p.longest_stop - 1, p.min_tokens, p,
                                  "".join({stop[-1]: None for stop in p.stops}))
                                 if req.has_stop_strings else None,
                                 p.skip_special_tokens, texts[p.skip_special_tokens], stream))
            width = max((c[6] or 0 for c in cols), default=0)
            self._listed_cols = (cohort.key, listed, cols, width)
        first_finished = _FIRST_FINISHED
        items, check, took, streams, entries = [], [], [], [], []
        # The engine process's child: running text-free pipe rows with logprobs, one token
        # since their last output, go as one `pipe_block` (their entries built by the front
        # end; a None keeps each logprob list as long as the outputs, `delta_row` slicing
        # past it).
        blocked = made is not None and pipe
        b_rows: list[int] = []
        b_rids: list[str] = []
        b_toks: list[int] = []
        b_cums: list[float] = []
        b_ks: list[int] = []
        top = None  # the step's top-k columns as lists, made once if a row reads them
        for r, (req, seq, state, outs, plen, lp_list, k, lazy, stops, skip, table,
                stream) in zip(listed, cols):
            if seq.status._value_ >= first_finished:
                continue  # ended: `process` does it
            if made is not None and stream is not None:
                if lp_list is not None and not lazy:
                    # A text stream with logprobs, one token since its last output, whose
                    # token completes its text (`token_texts`) and whose text the stop-string
                    # search can skip (as below): its entry, text and output in this one
                    # pass, the entry handed over as it is made (`_hand_over`'s None left in
                    # its list). The general loops below took ~2.7 us such a row at 256
                    # rows (`bench/host_overhead.py --kinds delta --mixes sampled_lp`).
                    sent, sid = stream[4], stream[5]
                    n = len(outs)
                    total = plen + n
                    tok = outs[-1]
                    first, chars_sent = sent.get(sid, (0, 0))
                    # (Without stop strings every output sent all the text released.)
                    if (first == n - 1 and state.read_offset == total - 1 and tok < len(table)
                            and (stops is not None or chars_sent == state.length)):
                        text = table[tok]
                        if text is not None and (stops is None or n > stops[2] and not any(
                                [last in text for last in stops[4]])):
                            if top is None:
                                top = (out.topk_ids[:, :width].tolist(),
                                       out.topk_logprobs[:, :width].tolist(),
                                       out.token_ids.tolist(), out.logprobs.tolist())
                            entry = top_entry(top[0][r], top[1][r], k)
                            entry[top[2][r]] = top[3][r]
                            lp_list.append(None)
                            state.release(text, total)
                            if stops is not None:  # a possible stop string's start waits
                                visible = max(chars_sent, state.length - stops[1])
                                text = state.tail(chars_sent)[:visible - chars_sent]
                            else:
                                visible = state.length
                            sent[sid] = (n, visible)
                            made.append(running_delta(
                                stream[0], stream[1], stream[2], stream[3], text, [tok],
                                stream[6], stream[7], seq.cumulative_logprob, [entry]))
                            continue
                if blocked and stream[8] and lp_list is not None and lazy:
                    sent, sid = stream[4], stream[5]
                    n = len(outs)
                    if sent and sent[sid][0] == n - 1:
                        sent[sid] = (n, 0)
                        lp_list.append(None)
                        b_rows.append(r)
                        b_rids.append(stream[0])
                        b_toks.append(outs[-1])
                        b_cums.append(seq.cumulative_logprob)
                        b_ks.append(k)
                        continue
                streams.append((seq, state, outs, lp_list, stops, stream))
            else:
                took.append(req.request_id)
            if lp_list is not None:
                entries.append((r, lp_list, k))
            if lazy:
                continue  # no text, no stop string: nothing more before it finishes
            total = plen + len(outs)
            # `Detokenizer.append_token`, from the whole-character texts (`token_texts`,
            # as `stream_rows`): a token ending inside a character takes the window.
            tok = outs[-1]
            if state.read_offset == total - 1 and tok < len(table):
                text = table[tok]
                if text is not None:
                    if stops is None:
                        state.release(text, total)
                        continue
                    old = state.length
                    state.release(text, total)
                    if len(outs) <= stops[2]:  # the last step's text was not searched
                        check.append((req, seq, state, old, stops, outs))
                        continue
                    # The last step searched the text up to here as far back as `find_stop`
                    # reaches now, so a stop string found now ends in this text: one
                    # without any stop string's last character stops nothing.
                    for last in stops[4]:
                        if last in text:
                            check.append((req, seq, state, old, stops, outs))
                            break
                    continue
            if stops is not None:
                check.append((req, seq, state, state.length, stops, outs))
            items.append((seq.get_token_slice, total, state, skip))
        if entries:
            if top is None:
                top = (out.topk_ids[:, :width].tolist(), out.topk_logprobs[:, :width].tolist(),
                       out.token_ids.tolist(), out.logprobs.tolist())
            tids, tlps, ttok, tlp = top
            for r, lp_list, k in entries:
                entry = top_entry(tids[r], tlps[r], k)
                entry[ttok[r]] = tlp[r]
                lp_list.append(entry)
        if b_rows:
            made.append(pipe_block(b_rids, b_toks, (
                b_cums, b_ks, out.topk_ids[b_rows, :width].tolist(),
                out.topk_logprobs[b_rows, :width].tolist(), out.logprobs[b_rows].tolist())))
        if items:
            self.detokenizer.step(items)
        stopped = []
        for req, seq, state, old, (strings, back, min_tokens, p, _), outs in check:
            if len(outs) < min_tokens:
                continue
            # Only a tail that holds a stop string takes the search (`find_stop`), which
            # picks the first in the request's order and cuts the text.
            tail = state.tail(old - back)
            for stop in strings:
                if stop in tail:
                    hit = self.find_stop(state, p, old)
                    stopped.append((req, seq))
                    req.stop_reason[seq.seq_id] = hit
                    break
        if streams:
            gone = {id(seq) for _, seq in stopped}
            for seq, state, outs, lp_list, stops, (rid, prompt, ids, index, sent, sid, cached,
                                                     scheduled, pipe_row) in streams:
                if gone and id(seq) in gone:  # stopped: `_finish` makes its final output
                    took.append(rid)
                    continue
                if pipe and pipe_row:
                    if not sent:  # its first output is `make_output`'s
                        took.append(rid)
                        continue
                    # `delta_row` of a running sequence.
                    n = len(outs)
                    n_sent = sent[sid][0]
                    sent[sid] = (n, 0)  # a text-free state releases no text
                    comp = ((index, "", outs[n_sent:n], None, None, None, None)
                            if lp_list is None else
                            (index, "", outs[n_sent:n], seq.cumulative_logprob,
                             _hand_over(lp_list, n_sent, n), None, None))
                    made.append((rid, None, [comp], False, None, cached, None, scheduled))
                    continue
                # `_delta_fields` of a running sequence: text that may still start a stop
                # string waits.
                n_sent, chars_sent = sent.get(sid, (0, 0))
                visible = state.length
                text = state.tail(chars_sent)
                if stops is not None:
                    visible = max(chars_sent, visible - stops[1])
                    text = text[:visible - chars_sent]
                n = len(outs)
                sent[sid] = (n, visible)
                made.append(running_delta(
                    rid, prompt, ids, index, text, outs[n_sent:n], cached, scheduled,
                    None if lp_list is None else seq.cumulative_logprob,
                    None if lp_list is None else _hand_over(lp_list, n_sent, n)))
        return stopped, took

    @staticmethod
    def find_stop(state: DetokState, p: SamplingParams, old_len: int) -> str | None:
        """The first stop string (in the request's order, as vLLM) found in the text released
        this step or spanning into it: only that tail is searched, so the cost does not grow
        with the output, and text released before `min_tokens` never stops a sequence later."""
        start = max(0, old_len - p.longest_stop + 1)
        tail = state.tail(start)
        for stop in p.stops:
            idx = tail.find(stop)
            if idx >= 0:
                end = start + idx + (len(stop) if p.include_stop_str_in_output else 0)
                state.text = state.text[:end]
                return stop
        return None

    @staticmethod
    def completion(req: RequestState, seq: Sequence, index: int) -> CompletionOutput:
        sid = seq.seq_id
        if req.delta:
            return OutputProcessor._delta(req, seq, index)
        return CompletionOutput(
            index, req.detok[sid].text, seq.output_token_ids[:],
            seq.cumulative_logprob if req.params.logprobs is not None else None,
            req.logprobs[sid][:] if req.params.logprobs is not None else None,
            FINISH_REASON.get(seq.status), req.stop_reason.get(sid))

    @staticmethod
    def _delta(req: RequestState, seq: Sequence, index: int) -> CompletionOutput:
        """What is new since the sequence's last output (output_kind "delta"). While it runs
        with stop strings its text's last `longest_stop - 1` characters wait: a stop string
        completed later starts after them at the earliest (it was not found earlier), so the
        text sent is never cut afterwards."""
        return CompletionOutput(index, *OutputProcessor._delta_fields(req, seq))

    @staticmethod
    def _delta_fields(req: RequestState, seq: Sequence) -> tuple:
        """`_delta`'s fields after the index."""
        sid = seq.seq_id
        state = req.detok[sid]
        tokens_sent, chars_sent = req.sent.get(sid, (0, 0))
        visible = state.length
        text = state.tail(chars_sent)
        if req.has_stop_strings and seq.status._value_ < _FIRST_FINISHED:
            visible = max(chars_sent, visible - req.params.longest_stop + 1)
            text = text[:visible - chars_sent]
        out = seq.output_token_ids
        n = len(out)
        req.sent[sid] = (n, visible)
        if req.params.logprobs is None:
            return (text, out[tokens_sent:n], None, None, FINISH_REASON.get(seq.status),
                    req.stop_reason.get(sid))
        return (text, out[tokens_sent:n], seq.cumulative_logprob,
                _hand_over(req.logprobs[sid], tokens_sent, n), FINISH_REASON.get(seq.status),
                req.stop_reason.get(sid))

    def beam_completions(self, req: RequestState) -> list[CompletionOutput]:
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

    def make_output(self, req: RequestState, final: bool) -> RequestOutput:
        if req.lazy_text and not req.text_free:  # an abort or failure before it finished
            for seq in req.group.seqs:
                st = req.detok.get(seq.seq_id)
                if st is not None and st.read_offset < seq.num_total_tokens:
                    self.detokenizer.flush(seq.get_token_slice, seq.num_total_tokens, st,
                                           req.params.skip_special_tokens)
        if req.is_beam:
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                                 self.beam_completions(req), finished=final,
                                 num_cached_tokens=req.num_cached_tokens or 0,
                                 first_scheduled_time=req.first_scheduled_time)
        seqs = req.group.seqs
        if len(seqs) == 1:  # one sequence (n == 1): every streamed step of most requests
            seq = seqs[0]
            index = req.seq_index[seq.seq_id]
            if req.delta and not final and req.params.prompt_logprobs is None:
                # A running stream's step (one with logprobs or stop strings, which
                # `stream_rows` leaves here): built without the dataclass calls.
                text, ids, cum, lps, reason, stop = self._delta_fields(req, seq)
                if reason is None and stop is None:
                    return running_delta(req.request_id, req.prompt, req.prompt_token_ids,
                                         index, text, ids, req.num_cached_tokens or 0,
                                         req.first_scheduled_time, cum, lps)
                comps = [CompletionOutput(index, text, ids, cum, lps, reason, stop)]
            else:
                comps = [self._delta(req, seq, index) if req.delta
                         else self.completion(req, seq, index)]
        else:
            seqs = sorted(seqs, key=lambda s: req.seq_index[s.seq_id])
            if final and req.params.best_of and req.params.best_of > req.params.n:
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: req.params.n]
                comps = [self.completion(req, s, i) for i, s in enumerate(seqs)]
            else:
                comps = [self.completion(req, s, req.seq_index[s.seq_id]) for s in seqs]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, final,
                             self.prompt_logprobs_out(req)
                             if req.params.prompt_logprobs is not None else None,
                             req.num_cached_tokens or 0, None, req.first_scheduled_time)

    def stream_rows(self, row_info: list[tuple], cohort: DecodeCohort, pipe: bool = False
                    ) -> tuple[list, list[tuple[RequestState, Sequence]]]:
        """The delta outputs of a steady step's running `stream_plain` rows, whose tokens the
        scheduler has appended (`Scheduler.update_steady`), and the sequences a stop string
        finished (for the scheduler to stop; their final outputs come from `make_output`, as
        do those of rows that ended, which went through `process`). A row whose one new
        token completes its text (`Detokenizer.token_texts`) releases that text and, without
        stop strings, makes its output in one pass over the cohort's columns
        (`_stream_columns`). The others take the batched `Detokenizer.step` (a token ending
        inside a character, a window held back before), then the stop-string search and
        `make_output` (which holds back a possible stop string's start). The same text,
        token ids, offsets and stops as `process` + `make_output`
        (`tests/engine/test_stream_rows.py`). With ``pipe`` (the engine process's child,
        `LLMEngine.pipe_rows`), running `pipe_plain` rows come out as one `pipe_block`
        (a row with more than one token since its last output: as `delta_row` makes it;
        `tests/engine/test_pipe_rows.py`)."""
        made: list = []
        slow: list[tuple[RequestState, Sequence]] = []
        check: list[tuple[RequestState, Sequence, DetokState, int]] = []
        first_finished = _FIRST_FINISHED
        tail_max = DetokState.TAIL
        plain, stops, pipes = self._stream_columns(row_info, cohort, pipe)
        # Rows without stop strings: most streams. Every output of such a row sent all the
        # text released before it, so its delta is this token's text. The loop is the
        # steady in-process stream's main host cost (~1.2 us a row at 256 rows), so what is
        # fixed for the row's life comes from its column and `DetokState.release` is inlined.
        for (req, seq, state, out, plen, table, ntab, sent, sid, index, rid, prompt, ids,
             cached, scheduled) in plain:
            if seq.status._value_ >= first_finished:
                continue  # ended: `process` did it. (A sequence preempted while its token
                # was on the device, async scheduling, streams that token.)
            n = len(out)
            tok = out[-1]
            if tok >= ntab or state.read_offset != plen + n - 1:
                slow.append((req, seq))
                continue
            text = table[tok]
            if text is None:  # ends inside a character, or a special token
                slow.append((req, seq))
                continue
            # state.release(text, plen + n), inlined (a call is ~0.05 us of ~1 us a row):
            tail = state._tail + text
            state.length += len(text)
            if len(tail) < tail_max:
                state._tail = tail
            else:
                state._tail = ""
                state._parts.append(tail)
            state.prefix_offset = plen + n - 1
            state.read_offset = plen + n
            first = sent[sid][0]
            sent[sid] = (n, state.length)
            # One token since the last output, as a steady row has: a literal, not a slice.
            made.append(running_delta(rid, prompt, ids, index, text,
                                      [tok] if first == n - 1 else out[first:n], cached,
                                      scheduled))
        # Rows with stop strings. One whose text the stop-string search can skip (as in
        # `listed_rows`: past `min_tokens`, no stop string's last character in its new text)
        # makes its output here too, as `make_output` would: the last ``back`` characters,
        # which may start a stop string, wait. The others take the search and `make_output`.
        for (req, seq, state, out, plen, table, sent, sid, index, rid, prompt, ids, cached,
             scheduled, min_tokens, lasts, back) in stops:
            if seq.status._value_ >= first_finished:
                continue
            old = state.length
            n = len(out)
            tok = out[-1]
            if state.read_offset != plen + n - 1 or tok >= len(table) or table[tok] is None:
                check.append((req, seq, state, old))
                slow.append((req, seq))
                continue
            text = table[tok]
            state.release(text, plen + n)
            if n <= min_tokens:  # the last step's text was not searched
                check.append((req, seq, state, old))
                continue
            for last in lasts:
                if last in text:
                    check.append((req, seq, state, old))
                    break
            else:
                first, chars_sent = sent[sid]
                visible = max(chars_sent, state.length - back)
                sent[sid] = (n, visible)
                made.append(running_delta(
                    rid, prompt, ids, index, state.tail(chars_sent)[:visible - chars_sent],
                    [tok] if first == n - 1 else out[first:n], cached, scheduled))
        if pipes:
            rids: list[str] = []
            toks: list[int] = []
            for req, seq, out, sent, sid, index, rid in pipes:
                if seq.status._value_ >= first_finished:
                    continue  # ended: its final row is `delta_row`'s
                n = len(out)
                first = sent[sid][0]
                sent[sid] = (n, 0)  # a text-free state releases no text
                if first == n - 1:  # one token since its last output, as steady rows have
                    rids.append(rid)
                    toks.append(out[-1])
                    continue
                made.append((rid, None, [(index, "", out[first:n], None, None, None, None)],
                             False, None, req.num_cached_tokens or 0, None,
                             req.first_scheduled_time))
            if rids:
                made.append(pipe_block(rids, toks))
        if slow:
            self.detokenizer.step([(seq.get_token_slice, seq.num_total_tokens,
                                    req.detok[seq.seq_id], req.params.skip_special_tokens)
                                   for req, seq in slow])
            made.extend([self.make_output(req, False) for req, _ in slow
                         if not req.has_stop_strings])
        stopped: list[tuple[RequestState, Sequence]] = []
        for req, seq, state, old in check:
            p = req.params
            if len(seq.output_token_ids) >= p.min_tokens:
                hit = self.find_stop(state, p, old)
                if hit is not None:
                    req.stop_reason[seq.seq_id] = hit
                    stopped.append((req, seq))
                    continue
            made.append(self.make_output(req, False))
        return made, stopped

    def _stream_columns(self, row_info: list[tuple], cohort: DecodeCohort, pipe: bool
                        ) -> tuple[list[tuple], list[tuple], list[tuple]]:
        """What `stream_rows` reads of the cohort's `stream_plain` rows (those without stop
        strings, then those with) and, with ``pipe``, of its `pipe_plain` rows, fixed for
        the sequence's life: made once per cohort and cut with it, as
        `DecodeCohort.columns` (per row, None for a quiet row). The request's id, prompt,
        cached-token count and first scheduled time are among them: a streamed row is past
        its first token, and the last two are set once, when it is first scheduled."""
        key, cols, plain, stops, pipes = self._stream_cols
        if key != cohort.key:
            if cohort.parent is not None and cohort.parent[0] == key:
                cols = [cols[i] for i in cohort.parent[1]]
            else:
                texts = None  # the token-text tables (built once, ~10 ms): text streams only
                cols = []
                for info in row_info:
                    req, seq = info[0], info[1]
                    sid = seq.seq_id
                    if req.stream_plain:
                        if texts is None:
                            texts = self.detokenizer.token_texts() or ([], [])
                        table = texts[req.params.skip_special_tokens]
                        p = req.params
                        if req.has_stop_strings:
                            cols.append((_STOPS, (
                                req, seq, req.detok[sid], seq.output_token_ids,
                                len(seq.prompt_token_ids), table, req.sent, sid,
                                req.seq_index[sid], req.request_id, req.prompt,
                                req.prompt_token_ids, req.num_cached_tokens or 0,
                                req.first_scheduled_time, p.min_tokens,
                                "".join({stop[-1]: None for stop in p.stops}),
                                p.longest_stop - 1)))
                        else:
                            cols.append((_PLAIN, (
                                req, seq, req.detok[sid], seq.output_token_ids,
                                len(seq.prompt_token_ids), table, len(table), req.sent, sid,
                                req.seq_index[sid], req.request_id, req.prompt,
                                req.prompt_token_ids, req.num_cached_tokens or 0,
                                req.first_scheduled_time)))
                    elif pipe and req.pipe_plain:
                        cols.append((_PIPE, (req, seq, seq.output_token_ids, req.sent, sid,
                                             req.seq_index[sid], req.request_id)))
                    else:
                        cols.append(None)
            rows = [c for c in cols if c is not None]
            plain = [c for kind, c in rows if kind == _PLAIN]
            stops = [c for kind, c in rows if kind == _STOPS]
            pipes = [c for kind, c in rows if kind == _PIPE]
            self._stream_cols = (cohort.key, cols, plain, stops, pipes)
        return plain, stops, pipes

    @staticmethod
    def delta_row(req: RequestState, final: bool) -> tuple:
        """`make_output` of a text-free one-sequence delta after its first output, built
        straight as `encode_outputs`' row (the engine process's pipe format): no
        `RequestOutput` / `CompletionOutput` objects to make and take apart again, ~2 us a
        request a step. Its prompt went with the first output; the text is the front end's."""
        seq = req.group.seqs[0]
        sid = seq.seq_id
        out = seq.output_token_ids
        n = len(out)
        sent = req.sent[sid][0]
        req.sent[sid] = (n, 0)  # a text-free state releases no text
        if req.params.logprobs is None:
            comp = (req.seq_index[sid], "", out[sent:n], None, None,
                    FINISH_REASON.get(seq.status), req.stop_reason.get(sid))
        else:
            comp = (req.seq_index[sid], "", out[sent:n], seq.cumulative_logprob,
                    _hand_over(req.logprobs[sid], sent, n), FINISH_REASON.get(seq.status),
                    req.stop_reason.get(sid))
        return (req.request_id, None, [comp], final, None, req.num_cached_tokens or 0, None,
                req.first_scheduled_time)

    @staticmethod
    def prompt_logprobs_out(req: RequestState) -> list[dict[int, float] | None] | None:
        """vLLM's shape: None for the first prompt token, then one dict per later token."""
        if req.params.prompt_logprobs is None:
            return None
        return [None] + [req.prompt_lp.get(p) for p in range(len(req.prompt_token_ids) - 1)]

    def fail(self, req: RequestState, error: str) -> RequestOutput:
        for seq in req.group.seqs:
            seq.status = SequenceStatus.FINISHED_ABORTED
        out = self.make_output(req, final=True)
        out.error = error
        return out

    def cut_short(self, req: RequestState) -> RequestOutput:
        """A request the scheduler can no longer place (it outgrew the whole cache: n>1
        samples or beams recomputed without sharing, or pinned prefixes took the room) ends
        with finish_reason "length" and what it generated, rather than an error; one that
        generated nothing yet fails with a clear error."""
        if not any(s.output_token_ids for s in req.group.seqs):
            return self.fail(req, "request can never be scheduled in this KV cache: it needs "
                                   "more KV blocks than the whole cache holds")
        for seq in req.group.seqs:
            if seq.status in (SequenceStatus.FINISHED_IGNORED, SequenceStatus.FINISHED_ABORTED) \
                    or not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_LENGTH
                st = req.detok.get(seq.seq_id)
                if st is not None and not req.text_free:
                    self.detokenizer.flush(seq.get_token_slice, seq.num_total_tokens, st,
                                           req.params.skip_special_tokens)
        logger.warning("request %s outgrew the KV cache: finished with 'length' after %d tokens",
                       req.request_id, max(s.num_output_tokens for s in req.group.seqs))
        return self.make_output(req, final=True)

    def record_prompt_logprobs(self, plan, scored) -> None:
        for i, (req, pos) in enumerate(plan):
            k = req.params.prompt_logprobs
            entry = {int(t): float(v) for t, v in zip(scored.topk_ids[i][:k], scored.topk_logprobs[i][:k])}
            entry[req.prompt_token_ids[pos + 1]] = float(scored.token_logprobs[i])
            req.prompt_lp[pos] = entry
