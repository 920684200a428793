"""Streamed steady rows (`OutputProcessor.stream_rows`): a steady step whose rows are plain
delta streams (and quiet final-only rows) is applied from the cohort's columns and its running
rows' outputs are made in one pass. Every step's outputs equal those of the general path
(`RequestState.stream_plain` off), with async scheduling on and off, under preemption, with
cohorts cut as requests end or are aborted, tokens ending inside a character (held back) and
skipped special tokens; the deltas add up to the whole decode; the block pool is whole after."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.core import Scheduler
from pagedjax.engine import LLMEngine
from pagedjax.output_processor import OutputProcessor, RequestState
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors


@pytest.fixture(scope="module")
def wide(demo_tokenizer):
    """A tiny model over the demo tokenizer's whole vocabulary: its random tokens include
    multi-byte pieces (text held back inside a character) and special tokens."""
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "vocab_size": len(demo_tokenizer),
                                  "max_position_embeddings": 256})
    return config, assemble_params(config, random_hf_tensors(config, seed=4).get)


# Single bytes of multi-byte characters in the demo vocabulary (`Detokenizer.token_texts`
# None): favoured, they make text that ends inside a character and is held back.
SPLIT_BYTES = {i: 7.0 for i in range(111, 111 + 96)}
# The demo vocabulary's "y", "a", "b", "x", "ya", "ay": favoured, they make the stop
# strings "ya" and "bxbxbxbxbxbx" come within a few tokens, ended by tokens with and without
# the last character.
STOP_CHARS = {105: 30.0, 81: 29.0, 82: 28.0, 104: 30.0, 5488: 27.0, 341: 27.0}


def _requests(vocab: int, mixed: bool) -> list[tuple[str, list[int], SamplingParams, str]]:
    rng = np.random.default_rng(11)
    kinds = [dict(temperature=0, ignore_eos=True),
             dict(temperature=0.9, seed=3, top_p=0.8, skip_special_tokens=False),
             dict(temperature=0, stop_token_ids=[int(t) for t in rng.integers(3, vocab, 40)]),
             dict(temperature=1.0, seed=5, logit_bias=SPLIT_BYTES),
             dict(temperature=0, min_tokens=5, ignore_eos=True),
             # Stop strings: text held back while it may start one, stops found in it.
             dict(temperature=0.8, seed=2, stop=["ation", " the", "e"], min_tokens=14,
                  max_tokens=40),
             dict(temperature=0.8, seed=4, stop=["ss", "q"], include_stop_str_in_output=True)]
    out = []
    for i in range(24):
        kw = kinds[i % len(kinds)]
        kind = "final_only" if i % 7 == 0 and i else "delta"  # quiet rows among the streams
        if mixed == "listed_final":  # `LLM.generate`'s steps: quiet rows, listed ones
            kind = "final_only"
        if mixed == "listed_stops" and i % 3 == 1:
            # Listed rows whose stop strings come often (their characters favoured), at
            # and after `min_tokens`: `listed_rows` skips the search for a text without
            # a stop string's last character only where the last step searched.
            kw = dict(temperature=1.0, seed=i, logprobs=1 + i % 2, stop=["ya", "bxbxbxbxbxbx"],
                      min_tokens=8 + i % 10, max_tokens=60, logit_bias=STOP_CHARS)
        elif mixed == "stream_stops" and i % 4:  # `stream_rows`' rows with stop strings
            kw = dict(temperature=1.0, seed=i, stop=["ya", "bxbxbxbxbxbx"],
                      min_tokens=4 + i % 13, max_tokens=60, logit_bias=STOP_CHARS)
        elif mixed in ("listed", "listed_final") and i % 5 == 2:  # a few rows listed
            # (a stop string that never comes: its last 2 characters wait each step)
            kw = [dict(temperature=0.8, seed=i, logprobs=2, stop=["qzx"], max_tokens=60),
                  dict(temperature=0, logprobs=0, stop=["e", " a"], min_tokens=6),
                  dict(temperature=0.9, seed=i, logprobs=1, max_tokens=60,
                       logit_bias=SPLIT_BYTES)][i % 3]
        elif mixed in (True, "listed", "listed_final") and i % 8 == 3:  # rows the fast
            # path does not take: the general path's
            kw = dict(temperature=0, logprobs=1) if i % 16 == 3 else dict(n=2, seed=1)
        prompt = [int(t) for t in rng.integers(20, vocab, int(rng.integers(3, 30)))]
        kw = {"max_tokens": int(rng.integers(4, 40)), **kw}
        out.append((f"r{i}", prompt, SamplingParams(**kw), kind))
    return out


def _run(wide, tokenizer, *, fast: bool, async_scheduling: bool, blocks: int,
         mixed: bool | str, monkeypatch) -> tuple[list[list[tuple]], int]:
    made = [0]
    with monkeypatch.context() as m:
        if not fast:  # no row listed beside streamed ones: the general path's steps
            m.setattr(LLMEngine, "LISTED_MAX_SHARE", 0.0)
        real_steady = Scheduler.update_steady

        def steady(self, run, token_ids, pending, listed=None, logprobs=None):
            if listed:
                made[1] += 1
            return real_steady(self, run, token_ids, pending, listed, logprobs)

        m.setattr(Scheduler, "update_steady", steady)
        made.append(0)
        real_init, real_rows = RequestState.__post_init__, OutputProcessor.stream_rows

        def init(self):
            real_init(self)
            if not fast:
                self.stream_plain = False

        def rows(self, row_info, cohort, pipe=False):
            got = real_rows(self, row_info, cohort, pipe)
            made[0] += len(got[0])
            return got

        m.setattr(RequestState, "__post_init__", init)
        m.setattr(OutputProcessor, "stream_rows", rows)
        config, params = wide
        llm = LLM.from_params(config, params, tokenizer, num_gpu_blocks=blocks, block_size=8,
                              max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128,
                              async_scheduling=async_scheduling)
        engine = llm.engine
        pending = _requests(config.vocab_size, mixed)
        steps = []
        sent: dict[str, str] = {}
        while pending or engine.has_unfinished_requests():
            for _ in range(3):
                if pending:
                    rid, prompt, sp, kind = pending.pop(0)
                    engine.add_request(rid, None, sp, prompt_token_ids=prompt,
                                       output_kind=kind)
            if len(steps) == 9:
                engine.abort_request("r4")  # a cohort cut by an abort
            outs = engine.step()
            for o in outs:
                if o.outputs and o.outputs[0].index == 0 and len(o.outputs) == 1:
                    sent[o.request_id] = sent.get(o.request_id, "") + o.outputs[0].text
            # A running stream's released text (`DetokState`, kept in pieces) is what it has
            # sent, plus what a possible stop string's start holds back.
            for rid, req in engine._requests.items():
                if req.delta and len(req.group.seqs) == 1:
                    state = req.detok[req.group.seqs[0].seq_id]
                    text = state.text
                    assert state.length == len(text), rid
                    assert text.startswith(sent.get(rid, "")), rid
                    if not req.has_stop_strings:
                        assert text == sent.get(rid, ""), rid
                if req.delta and req.params.logprobs is not None:  # sent entries handed over
                    for sid, (n_sent, _) in req.sent.items():
                        assert req.logprobs[sid][:n_sent] == [None] * n_sent, rid
                        assert None not in req.logprobs[sid][n_sent:], rid
            # The first scheduled time is the clock's: only whether it is set is compared.
            steps.append(sorted(
                (o.request_id, o.finished, o.num_cached_tokens, o.first_scheduled_time is not None,
                 [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                   c.cumulative_logprob, c.logprobs) for c in o.outputs]) for o in outs))
        assert engine.block_manager.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
        return steps, made


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("blocks,mixed", [(200, False), (24, False), (200, True),
                                          (200, "listed"), (24, "listed"),
                                          (24, "listed_final"), (200, "listed_stops"),
                                          (200, "stream_stops")])
def test_streamed_rows_output_what_the_general_path_does(wide, demo_tokenizer, async_scheduling,
                                                         blocks, mixed, monkeypatch):
    """24 blocks of 8 tokens hold a few of the 16 sequences: preemption cuts cohorts.
    "listed": logprob rows (one with stop strings) among the streams, listed beside them
    (`LLMEngine._steady_classes`, `OutputProcessor.listed_rows`); "listed_final": the same
    rows final-only, beside quiet ones; "listed_stops" / "stream_stops": listed / streamed
    rows whose stop strings come often, at and after `min_tokens` (the search skipped where
    it cannot find one)."""
    _check_against_general_path(wide, demo_tokenizer, async_scheduling, blocks, mixed,
                                monkeypatch)


def test_streamed_rows_keep_text_pieces_whole(wide, demo_tokenizer, monkeypatch):
    """`stream_rows` inlines `DetokState.append`: with 5-character tails nearly every token
    makes a piece, and every running stream's text (joined from its pieces, checked after
    each step in `_run`) is still what it sent."""
    from pagedjax.detokenizer import DetokState

    monkeypatch.setattr(DetokState, "TAIL", 5)
    _check_against_general_path(wide, demo_tokenizer, True, 200, False, monkeypatch)


def _check_against_general_path(wide, demo_tokenizer, async_scheduling, blocks, mixed,
                                monkeypatch):
    kw = dict(async_scheduling=async_scheduling, blocks=blocks, mixed=mixed,
              monkeypatch=monkeypatch)
    want, (none, none_listed) = _run(wide, demo_tokenizer, fast=False, **kw)
    got, (made, listed) = _run(wide, demo_tokenizer, fast=True, **kw)
    assert none == 0 and none_listed == 0
    if mixed not in (True, "listed_final"):  # (True: rows that break steady steps)
        assert made > 50  # the steady steps did take the fast path
    if mixed in ("listed", "listed_final", "listed_stops"):
        assert listed > 10  # ... with the logprob rows listed beside the streamed ones
    assert got == want
    # The deltas add up to each stream's whole decode (up to a stop string, where one hit).
    texts: dict[str, str] = {}
    ids: dict[str, list[int]] = {}
    reasons: dict[str, object] = {}
    for step in got:
        for rid, _fin, _cached, _sched, comps in step:
            texts[rid] = texts.get(rid, "") + comps[0][1]
            ids.setdefault(rid, []).extend(comps[0][2])
            reasons[rid] = comps[0][4]
    params = {rid: sp for rid, _, sp, kind in _requests(len(demo_tokenizer), mixed)}
    checked = stopped = 0
    for rid, text in texts.items():
        sp = params[rid]
        if rid == "r4" or sp.n > 1:
            continue
        whole = demo_tokenizer.decode(ids[rid], skip_special_tokens=sp.skip_special_tokens)
        stop = reasons[rid]
        if isinstance(stop, str):  # cut at the stop string, which it holds or precedes
            stopped += 1
            assert whole.startswith(text), rid
            if sp.include_stop_str_in_output:
                assert text.endswith(stop), rid
            else:
                assert whole[len(text):].startswith(stop), rid
        else:
            assert text == whole, rid
        checked += 1
    assert checked > 10 and stopped >= 1


def test_token_texts_match_the_tokenizer(demo_tokenizer):
    """`Detokenizer.token_texts`: a token's text where it is whole characters, None where it
    ends inside one, "" for a skipped special token."""
    from pagedjax.detokenizer import Detokenizer

    det = Detokenizer(demo_tokenizer)
    assert det._texts is not None  # built with the byte table, before a server's gc.freeze
    plain, skipping = det.token_texts()
    gc.collect()  # ... and never scanned by the collector again
    assert not gc.is_tracked(plain) and not gc.is_tracked(skipping)
    special = set(demo_tokenizer.all_special_ids)
    held = 0
    for i in range(len(plain)):
        for skip, table in ((False, plain), (True, skipping)):
            want = demo_tokenizer.decode([i], skip_special_tokens=skip)
            if table[i] is None:
                held += 1
                assert want.endswith("\ufffd") or det._table.plain[i] is None
            else:
                assert table[i] == want, i
        if i in special:
            assert skipping[i] == ""
    assert 0 < held < len(plain) // 10


def test_streams_beside_a_text_free_row_take_the_general_path_whole(wide, demo_tokenizer,
                                                                   monkeypatch):
    """A text-free delta row (quiet; in one process no step streams it) ahead of a text
    stream and a listed logprob stream: such a step is neither quiet nor streamed, so it
    takes the general path whole (`LLMEngine._steady_classes`), each token processed once:
    the same outputs as with no row ever listed."""
    config, params = wide
    streams = (("a", "delta_ids", {}), ("b", "delta", {}), ("c", "delta", {"logprobs": 2}))

    def run(share: float) -> list:
        with monkeypatch.context() as m:
            m.setattr(LLMEngine, "LISTED_MAX_SHARE", share)
            llm = LLM.from_params(config, params, demo_tokenizer, num_gpu_blocks=64,
                                  block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
                                  max_model_len=128)
            engine = llm.engine
            for i, (rid, kind, kw) in enumerate(streams):
                engine.add_request(rid, None, SamplingParams(temperature=0, max_tokens=16,
                                                             ignore_eos=True, **kw),
                                   prompt_token_ids=[30 + i, 41, 52, 63], output_kind=kind)
            steps = []
            while engine.has_unfinished_requests():
                steps.append(sorted((o.request_id, [(c.text, c.token_ids, c.logprobs)
                                                    for c in o.outputs])
                                    for o in engine.step()))
            assert engine.block_manager.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
            return steps

    got = run(1.0)
    assert got == run(0.0)
    logprobs = [c[2] for step in got for rid, comps in step if rid == "c" for c in comps]
    assert sum(len(lp) for lp in logprobs) == 16  # one entry a token
