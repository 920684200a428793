"""Penalty histories kept on the device and extended by deltas
(`pagedjax/worker/device_histories.py`): the engine's outputs equal the engine's that packs
every penalised row's history on the host, to the bit, under preemption by swap and
recompute, prefix-cache hits, chunked prefill, n > 1, beams, min_tokens, async scheduling on
and off and speculative decoding; with every slot's content poisoned when its sequence ends,
so a slot reused by a shorter sequence reads nothing of the last one; a failed gather forgets
every slot; and the slot bookkeeping, run against a simulated device copy over random
operations, always gathers exactly the packed histories."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.config import ModelConfig
from models.weights import assemble_params
from pagedjax import LLM, SamplingParams
from pagedjax.worker import device_histories as dh
from pagedjax.worker.device_deltas import CHUNK
from tests.engine.test_async_scheduling import _key, _logprobs
from tests.engine.test_device_tables import serve_randomly
from tests.engine.test_speculative import SPEC, _prompts
from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
from tests.parallel.tp_script import NoTokenizer


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    return config, assemble_params(config, random_hf_tensors(config, seed=5).get)


def _penalised(rng: np.random.Generator) -> SamplingParams:
    kind = int(rng.integers(0, 6))
    m = int(rng.integers(1, 30))
    rep = float(rng.choice([1.0, 1.3, 0.8]))
    if kind == 0:  # beams rank raw logprobs; their forks are new sequences, written whole
        return SamplingParams(use_beam_search=True, best_of=int(rng.integers(2, 4)),
                              temperature=0, max_tokens=m, ignore_eos=True,
                              repetition_penalty=1.2)
    if kind == 1:  # fan-out: the samples share a fresh prompt's slot until they fork
        return SamplingParams(temperature=0.9, n=2, best_of=int(rng.integers(2, 4)),
                              seed=int(rng.integers(0, 1000)), max_tokens=m,
                              frequency_penalty=0.7, repetition_penalty=rep)
    if kind == 2:  # greedy with penalties: the argmax moves with the history
        return SamplingParams(temperature=0, max_tokens=m, presence_penalty=1.5,
                              frequency_penalty=1.0, repetition_penalty=rep, min_tokens=min(3, m))
    if kind == 3:  # unpenalised rows in the same batch: no slot
        return SamplingParams(temperature=0.8, seed=int(rng.integers(0, 1000)), max_tokens=m)
    return SamplingParams(temperature=0.7, seed=int(rng.integers(0, 1000)), max_tokens=m,
                          presence_penalty=float(rng.uniform(-1, 2)),
                          repetition_penalty=rep, logprobs=int(rng.integers(0, 4)))


def _poison_released(engine, rng: np.random.Generator) -> list[int]:
    """Fill each slot with random ids when its sequence ends (a stale tail the next holder
    must never read); returns the slots poisoned."""
    slots, dev = engine.history_slots, engine.runner.device_histories
    real = slots.release
    poisoned = []

    def release(seq_ids):
        seq_ids = list(seq_ids)
        gone = [slots._at[s][0] for s in seq_ids if s in slots._at]
        real(seq_ids)
        if gone:
            junk = rng.integers(0, 200, (len(gone), dev.shape[1])).astype(np.int32)
            dev.array = dev.array.at[np.array(gone)].set(jnp.asarray(junk))
            poisoned.extend(gone)

    slots.release = release
    return poisoned


def _run(config, params, on_device: bool, mode: str, prefix_caching: bool, seed: int,
         async_scheduling: bool, spec: dict | None = None):
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=28, block_size=8,
                          max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                          preemption_mode=mode, enable_prefix_caching=prefix_caching,
                          enable_chunked_prefill=True, swap_space_gb=0.01,
                          async_scheduling=async_scheduling, device_penalty_histories=on_device,
                          speculative_config=spec)
    engine = llm.engine
    assert (engine.history_slots is not None) is on_device
    assert (engine.runner.device_histories is not None) is on_device
    rng = np.random.default_rng(seed)
    poisoned = writes = None
    if on_device:
        dev = engine.runner.device_histories
        junk = np.random.default_rng(seed + 9).integers(0, 200, dev.shape).astype(np.int32)
        dev.array = jnp.asarray(junk)  # what the slots hold before their first write
        poisoned = _poison_released(engine, np.random.default_rng(seed + 7))
        writes = []
        real = dev.write

        def spy(array, idx, val):
            writes.append(int((np.asarray(idx) < dev.size).sum()))
            return real(array, idx, val)

        dev.write = spy
    if spec is None:
        shared = [int(t) for t in rng.integers(3, config.vocab_size, 40)]
        prompts = []
        for i in range(36):
            prompt = [int(t) for t in rng.integers(3, config.vocab_size,
                                                   int(rng.integers(1, 60)))]
            prompts.append(shared + prompt[:20] if i % 3 == 0 else prompt)
    else:  # repeated spans: the n-gram proposer drafts
        prompts = _prompts(config.vocab_size, 24, seed=seed)
    requests = [(f"r{i}", p, _penalised(rng)) for i, p in enumerate(prompts)]
    if spec is not None:  # no beams; half greedy rewarding repeats: drafts (copied from the
        # history) are accepted, and each accepted draft's count moves the next argmax
        light = SamplingParams(temperature=0, max_tokens=30, frequency_penalty=-0.6,
                               ignore_eos=True)
        requests = [(r, p, light if i % 2 else sp) for i, (r, p, sp) in enumerate(requests)
                    if not sp.use_beam_search]
    outputs = serve_randomly(engine, requests, seed + 1)
    if on_device:
        assert len(engine.history_slots) == 0, "slots of finished sequences were kept"
    return outputs, engine, poisoned, writes


@pytest.mark.parametrize("mode,prefix_caching,seed,async_scheduling,spec",
                         [("swap", True, 0, True, None), ("recompute", True, 1, False, None),
                          ("recompute", False, 2, True, None), ("recompute", True, 3, True, SPEC),
                          ("swap", False, 4, False, SPEC)])
def test_device_histories_equal_host_packing(tiny, mode, prefix_caching, seed,
                                             async_scheduling, spec):
    config, params = tiny
    host, e_host, _, _ = _run(config, params, False, mode, prefix_caching, seed,
                              async_scheduling, spec)
    dev, e_dev, poisoned, writes = _run(config, params, True, mode, prefix_caching, seed,
                                        async_scheduling, spec)
    assert set(host) == set(dev) and len(host) >= 20
    for rid in host:  # same rows, same histories: the same bits
        assert _key(dev[rid]) == _key(host[rid]), rid
        np.testing.assert_array_equal(_logprobs(dev[rid]), _logprobs(host[rid]))
    assert poisoned, "no slot was released and poisoned"
    assert len(set(poisoned)) < len(poisoned), "no slot was reused after poisoning"
    assert e_dev.history_slots.num_full_writes > 0
    assert writes and max(writes) > 0, "no sequence overflowed into `write`"
    if spec is not None:
        assert e_dev.get_stats().spec_num_accepted_tokens > 0
    else:
        assert e_host.get_stats().num_preemptions_total > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_steady_cohorts_equal_host_packing(tiny, async_scheduling):
    """Requests decoding side by side (steady cohorts, cut as they end): the steps served by
    `HistorySlots.steady` and the pending tokens fed without a pass over the rows give the
    bits the host-packed histories give, with every released slot poisoned."""
    config, params = tiny
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(3, config.vocab_size, int(rng.integers(4, 30)))]
               for _ in range(8)]
    sps = [SamplingParams(temperature=0.8, seed=i, max_tokens=20 + 7 * i, ignore_eos=True,
                          presence_penalty=1.2, frequency_penalty=0.5,
                          repetition_penalty=1.3 if i % 2 else 1.0, logprobs=i % 3)
           if i != 3 else SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
           for i in range(8)]
    got = {}
    for on_device in (False, True):
        llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=64, block_size=8,
                              max_num_seqs=8, max_model_len=128,
                              async_scheduling=async_scheduling,
                              device_penalty_histories=on_device)
        feeds = {"all": 0, "by rows": 0}
        if on_device:
            engine = llm.engine
            poisoned = _poison_released(engine, np.random.default_rng(3))
            merge, by_rows = engine.runner.merge_pending_history, engine._feed_pending_history

            def count(key, f, feeds=feeds):
                def call(*a, **k):
                    feeds[key] += 1
                    return f(*a, **k)
                return call

            engine.runner.merge_pending_history = count("all", merge)
            engine._feed_pending_history = count("by rows", by_rows)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)
        got[on_device] = [(_key(o), _logprobs(o)) for o in outs]
    slots = llm.engine.history_slots
    assert slots.num_steady_steps >= 40 and poisoned and len(slots) == 0
    if async_scheduling:  # most pending tokens fed from the steady rows, not row by row
        assert feeds["all"] - feeds["by rows"] >= 40, feeds
    for (k_host, lp_host), (k_dev, lp_dev) in zip(got[False], got[True], strict=True):
        assert k_dev == k_host
        np.testing.assert_array_equal(lp_dev, lp_host)


def test_penalties_change_tokens(tiny):
    """The workload above is not vacuous: without the histories (all -1) greedy penalised
    rows pick other tokens."""
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=28, block_size=8,
                          max_num_seqs=4, max_model_len=128)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, config.vocab_size, 30)]
    sp = SamplingParams(temperature=0, max_tokens=20, presence_penalty=1.5,
                        frequency_penalty=1.0, repetition_penalty=1.3)
    with_pen = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids
    plain = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].token_ids
    assert with_pen != plain
    dev = llm.engine.runner.device_histories
    real = dev._gather

    def empty(self_, array, idx, val, lens, patch):  # histories gathered as nothing
        array, out, prompt = real(array, idx, val, lens, patch)
        return array, jnp.full_like(out, -1), jnp.full_like(prompt, -1)

    dev._gather = empty.__get__(dev)
    assert llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0].token_ids != with_pen


def test_failed_gather_forgets_every_slot(tiny, monkeypatch):
    config, params = tiny
    llm = LLM.from_params(config, params, NoTokenizer(), num_gpu_blocks=28, block_size=8,
                          max_num_seqs=4, max_model_len=128, async_scheduling=False)
    engine = llm.engine
    slots, dev = engine.history_slots, engine.runner.device_histories
    sp = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.4,
                        ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6], [9, 9, 8]]
    want = [o.outputs[0].token_ids
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", None, sp, prompt_token_ids=p)
    engine.step()
    engine.step()
    assert len(slots) == 2
    real = dev._gather
    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise RuntimeError("device lost")

    monkeypatch.setattr(dev, "_gather", boom)
    outs = engine.step()  # the failed step fails its requests, not the engine
    assert calls and len(slots) == 0
    assert all(o.finished for o in outs)
    monkeypatch.setattr(dev, "_gather", real)
    written = slots.num_full_writes
    got = [o.outputs[0].token_ids
           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert got == want and slots.num_full_writes == written + 2


def _packed(lists: dict[int, list[int]], b: int, w: int) -> np.ndarray:
    out = np.full((b, w), -1, np.int32)
    for r, ids in lists.items():
        out[r, : len(ids)] = ids
    return out


class _Seq:
    def __init__(self, seq_id: int, prompt: list[int]) -> None:
        self.seq_id, self.prompt_token_ids, self.output_token_ids = seq_id, prompt, []


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_slots_gather_the_packed_histories(data):
    """Random steps over live sequences (new ones, outputs appended, releases, missed
    releases, invalidations): every gather equals the host-packed histories, with drafts
    patched in, whatever junk the slots held before."""
    w, n_slots, b = 48, 6, 4
    dev = dh.DeviceHistories(n_slots, w, spec_tokens=2, device=jax.devices("cpu")[0])
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    dev.array = jnp.asarray(rng.integers(0, 500, dev.shape).astype(np.int32))
    slots = dh.HistorySlots(n_slots, w)
    live: list[_Seq] = []
    next_id = 0
    for _ in range(data.draw(st.integers(1, 12))):
        op = data.draw(st.sampled_from(["add", "grow", "grow", "release", "invalidate"]))
        if op == "add" or not live:
            live.append(_Seq(next_id, [int(t) for t in rng.integers(0, 500, rng.integers(0, 30))]))
            next_id += 1
        elif op == "grow":
            for s in live:
                room = w - len(s.prompt_token_ids) - len(s.output_token_ids) - 2
                s.output_token_ids += [int(t) for t in rng.integers(0, 500,
                                                                    rng.integers(0, max(1, room)))]
        elif op == "release":
            gone = live.pop(int(rng.integers(0, len(live))))
            if data.draw(st.booleans()):  # else missed: swept when slots run out
                slots.release([gone.seq_id])
        else:
            slots.invalidate()
            dev.reset()
        if not live:
            live.append(_Seq(next_id, [1, 2]))
            next_id += 1
        picked = [live[i] for i in rng.integers(0, len(live), int(rng.integers(1, b + 1)))]
        rows = [s if rng.random() < 0.8 else None for s in picked]
        rep = rng.random(b) < 0.5
        got_slots, p_lens, o_lens, idx, val = slots.step(rows, b)
        patches, want_out = [], {}
        for r, s in enumerate(rows):
            if s is None:
                continue
            extra = [int(t) for t in rng.integers(0, 500, rng.integers(0, 2))]
            if len(s.prompt_token_ids) + len(s.output_token_ids) + len(extra) > w:
                extra = []
            n = len(s.output_token_ids)
            patches += [(r, n + i, t) for i, t in enumerate(extra)]
            want_out[r] = s.output_token_ids + extra
        out, prompt = dev.gather(got_slots, p_lens, o_lens, rep, idx, val, patches)
        want_prompt = {r: s.prompt_token_ids for r, s in enumerate(rows)
                       if s is not None and rep[r]}
        np.testing.assert_array_equal(np.asarray(out), _packed(want_out, b, w))
        np.testing.assert_array_equal(np.asarray(prompt), _packed(want_prompt, b, w))
        assert len(slots) <= n_slots


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_steady_rows_gather_the_packed_histories(data):
    """Keyed steps (`HistorySlots.steady`: a steady cohort's rows served from the last
    call's arrays) between general steps, releases and invalidations, the kept sequences
    growing by 0, 1 or 2 outputs a step (2: the general path's): every gather equals the
    host-packed histories, whatever junk the slots held before."""
    w, n_slots, b = 40, 6, 5
    dev = dh.DeviceHistories(n_slots, w, spec_tokens=0, device=jax.devices("cpu")[0])
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    dev.array = jnp.asarray(rng.integers(0, 500, dev.shape).astype(np.int32))
    slots = dh.HistorySlots(n_slots, w)
    seqs = [_Seq(i, [int(t) for t in rng.integers(0, 500, rng.integers(0, 12))])
            for i in range(4)]
    key = 0
    rows = [seqs[0], None, seqs[1], seqs[2], None]
    steady = 0
    for _ in range(data.draw(st.integers(2, 16))):
        op = data.draw(st.sampled_from(["keyed"] * 6 + ["general", "release", "invalidate",
                                                        "new key"]))
        for s in seqs:  # what the host learned since the last step
            if len(s.prompt_token_ids) + len(s.output_token_ids) + 2 <= w:
                s.output_token_ids += [int(t) for t in rng.integers(0, 500, data.draw(
                    st.sampled_from([0, 1, 1, 1, 2])))]
        step_rows, k = rows, key
        if op == "general":
            step_rows, k = [seqs[3], seqs[0], None, None, None], None
        elif op == "release":
            slots.release([seqs[int(rng.integers(0, 3))].seq_id])
        elif op == "invalidate":
            slots.invalidate()
            dev.reset()
        elif op == "new key":
            key += 1
            k = key
        before = slots.num_steady_steps
        got = slots.steady(k, b) if k is not None else None
        if got is None:
            got = slots.step(step_rows, b, k)
        steady += slots.num_steady_steps - before
        rep = rng.random(b) < 0.5
        out, prompt = dev.gather(*got[:3], rep, *got[3:])
        want_out = {r: s.output_token_ids for r, s in enumerate(step_rows) if s is not None}
        want_prompt = {r: s.prompt_token_ids for r, s in enumerate(step_rows)
                       if s is not None and rep[r]}
        np.testing.assert_array_equal(np.asarray(out), _packed(want_out, b, w))
        np.testing.assert_array_equal(np.asarray(prompt), _packed(want_prompt, b, w))
        np.testing.assert_array_equal(got[2], [len(want_out.get(r, [])) for r in range(b)])
        kept = slots.steady_rows(k) if k is not None else None
        assert kept is None or list(kept) == [0, 2, 3]


def test_steady_rows_take_the_fast_path():
    """The property test above is not vacuous: a cohort's steps of one new output each are
    served by `steady`, one write per row at the right place; two outputs in one step, a
    release or a general step in between fall back."""
    w = 32
    dev = dh.DeviceHistories(4, w, spec_tokens=0, device=jax.devices("cpu")[0])
    dev.array = jnp.full(dev.shape, 77, jnp.int32)
    slots = dh.HistorySlots(4, w)
    a, c = _Seq(0, [1, 2, 3]), _Seq(1, [4])
    rows = [a, None, c]
    assert slots.steady(7, 4) is None
    got = slots.step(rows, 4, key=7)
    for i in range(3):
        a.output_token_ids.append(10 + i)
        c.output_token_ids.append(20 + i)
        got = slots.steady(7, 4)
        assert got is not None and slots.num_steady_steps == i + 1
        assert got[3].tolist() == [slots._at[0][0] * w + 3 + i, slots._at[1][0] * w + 1 + i]
        assert got[4].tolist() == [10 + i, 20 + i]
        out, _ = dev.gather(*got[:3], np.zeros(4, bool), *got[3:])
        np.testing.assert_array_equal(np.asarray(out)[[0, 2], : i + 1],
                                      [[10 + j for j in range(i + 1)], [20 + j for j in range(i + 1)]])
    a.output_token_ids += [50, 51]
    assert slots.steady(7, 4) is None  # two new: the general step
    assert slots.steady(8, 4) is None and slots.steady(7, 2) is None  # another key, width
    slots.step(rows, 4, key=7)
    c.output_token_ids.append(30)
    assert slots.steady(7, 4) is not None
    slots.release([1])
    assert slots.steady(7, 4) is None and slots.steady_rows(7) is None
    assert slots._at[0][2] == 5  # the kept count written back before the release


def test_long_new_sequences_spill_into_write_calls():
    """A new sequence longer than a call carries goes ahead in `CHUNK`-entry writes."""
    w = 3 * CHUNK
    dev = dh.DeviceHistories(2, w, spec_tokens=0, device=jax.devices("cpu")[0])
    slots = dh.HistorySlots(2, w)
    s = _Seq(0, list(range(1, 2 * CHUNK + 100)))
    s.output_token_ids = [7] * 50
    calls = []
    real = dev.write
    dev.write = lambda *a: calls.append(1) or real(*a)
    got, p_lens, o_lens, idx, val = slots.step([s], 4)
    out, prompt = dev.gather(got, p_lens, o_lens, np.ones(4, bool), idx, val)
    assert len(calls) == 3  # 2 x 2048 + 99 prompt ids and 50 outputs, 4 carried: 4241 ahead
    np.testing.assert_array_equal(np.asarray(prompt)[0, : len(s.prompt_token_ids)],
                                  s.prompt_token_ids)
    assert (np.asarray(prompt)[1:] == -1).all()
    np.testing.assert_array_equal(np.asarray(out)[0, :50], [7] * 50)
    assert (np.asarray(out)[0, 50:] == -1).all()
    with pytest.raises(ValueError, match="max_model_len"):
        slots.step([_Seq(1, [1] * (w + 1))], 4)
