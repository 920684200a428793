"""`SamplingBatch` (sampling parameters kept per sequence across steps) gives exactly the
metadata `SamplingMetadata.from_params` builds row by row, over random requests and steps in
which sequences grow, come and go; slots are written once, released and swept."""

from __future__ import annotations

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as hst

from pagedjax.sampler import DeviceFill, SamplingMetadata, SeqSamplingState
from pagedjax.sampling_params import SamplingParams
from pagedjax.worker.sampling_batch import SamplingBatch

VOCAB, EOS = 64, (2, 7)
WIDTHS = dict(history_width=48, ban_width=8, bias_width=4)


@hst.composite
def params(draw) -> SamplingParams:
    sampled = draw(hst.booleans())
    penalised = draw(hst.booleans())
    return SamplingParams(
        temperature=draw(hst.sampled_from([0.5, 1.0, 1.3])) if sampled else 0.0,
        top_k=draw(hst.sampled_from([-1, 1, 5, 200])), top_p=draw(hst.sampled_from([1.0, 0.7])),
        min_p=draw(hst.sampled_from([0.0, 0.1])),
        seed=draw(hst.none() | hst.integers(0, 2**33)),
        min_tokens=draw(hst.integers(0, 4)), max_tokens=40,
        stop_token_ids=draw(hst.sampled_from([None, [5], [5, 9]])),
        ignore_eos=draw(hst.booleans()),
        presence_penalty=0.3 if penalised else 0.0,
        repetition_penalty=draw(hst.sampled_from([1.0, 1.2])) if penalised else 1.0,
        logit_bias=draw(hst.sampled_from([None, {3: 1.5}, {4: -2.0, 6: 0.5}])))


def _leaves_equal(a: SamplingMetadata, b: SamplingMetadata) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@settings(max_examples=60, deadline=None)
@given(hst.lists(params(), min_size=1, max_size=8), hst.integers(0, 2**31), hst.data())
def test_equals_from_params_over_steps(reqs, seed, data):
    rng = np.random.default_rng(seed)
    batch = SamplingBatch(VOCAB, max_slots=64, eos_token_ids=EOS, engine_seed=11)
    # The same with the ban, mask and bias arrays on the device (`DeviceFill`).
    on_device = SamplingBatch(VOCAB, max_slots=64, eos_token_ids=EOS, engine_seed=11)
    fill = DeviceFill()
    # Live sequences: (seq id, sample index, params, request counter, prompt, outputs).
    live, next_id = [], 0
    for _step in range(6):
        while len(live) < len(reqs) and rng.random() < 0.7:  # arrivals (fan-outs: index > 0)
            p = reqs[len(live)]
            live.append((next_id, int(rng.integers(0, 3)), p, next_id * 3 + 1,
                         [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 6)))], []))
            next_id += 1
        if not live:
            continue
        for *_, out in live:
            out.extend(int(t) for t in rng.integers(0, VOCAB, int(rng.integers(0, 3))))
        rows = [(p, SeqSamplingState(prompt, list(out), counter, index,
                                     int(rng.integers(0, 2))))
                for _sid, index, p, counter, prompt, out in live]
        keys = [(sid, index) for sid, index, *_ in live]
        bans = {i: [1] for i in range(len(rows)) if rng.random() < 0.2}
        pad = len(rows) + int(rng.integers(0, 3))
        want = SamplingMetadata.from_params(rows, pad, VOCAB, eos_token_ids=EOS, engine_seed=11,
                                            extra_bans=bans, **WIDTHS)
        got = batch.metadata(rows, keys, pad, extra_bans=bans, **WIDTHS)
        _leaves_equal(got, want)
        dev = on_device.metadata(rows, keys, pad, extra_bans=bans, fill=fill, **WIDTHS)
        _leaves_equal(dev, want)
        for name in DEVICE_FIELDS:
            assert isinstance(getattr(dev, name), jax.Array), name
        if rng.random() < 0.3:  # a sequence ends
            gone = live.pop(int(rng.integers(0, len(live))))
            batch.release([gone[0]])
            on_device.release([gone[0]])
        assert len(batch) == len(live) == len(on_device)


DEVICE_FIELDS = ("banned_token_ids", "allowed_bitmask", "bias_token_ids", "bias_values")


def test_device_fill_reuses_empty_arrays_and_writes_the_rest():
    """An empty ban, mask or bias array is one cached device array per shape; one with
    something in it is made for the step and holds it, and the cached empty ones are still
    empty after a step that wrote its own."""
    fill = DeviceFill()
    plain = [(SamplingParams(temperature=0.7, presence_penalty=0.5),
              SeqSamplingState([1, 2], [3]))] * 3
    kw = dict(history_width=16, ban_width=8, bias_width=4, mask_width=2, fill=fill)
    a = SamplingMetadata.from_params(plain, 4, VOCAB, **kw)
    b = SamplingMetadata.from_params(plain, 4, VOCAB, **kw)
    for name in DEVICE_FIELDS:
        assert getattr(a, name) is getattr(b, name), name  # cached, not rebuilt
        assert not getattr(a, name).committed  # placed by jit like a numpy argument
    biased = plain[:2] + [(SamplingParams(temperature=0.7, presence_penalty=0.5,
                                          logit_bias={5: 2.0}, min_tokens=3,
                                          stop_token_ids=[9]), SeqSamplingState([1], []))]
    mask = np.array([0x0F, 0], np.int32)
    c = SamplingMetadata.from_params(biased, 4, VOCAB, masks={1: mask}, **kw)
    np.testing.assert_array_equal(np.asarray(c.bias_token_ids)[2], [5, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(c.bias_values)[2], [2.0, 0, 0, 0])
    assert 9 in np.asarray(c.banned_token_ids)[2].tolist()
    np.testing.assert_array_equal(np.asarray(c.allowed_bitmask)[1], mask)
    for name in DEVICE_FIELDS:
        assert getattr(c, name) is not getattr(a, name)
        blank = np.asarray(getattr(a, name))
        assert (blank == (0 if name == "bias_values" else -1)).all(), name
    _leaves_equal(c, SamplingMetadata.from_params(biased, 4, VOCAB, masks={1: mask},
                                                  **{**kw, "fill": None}))


def test_slots_are_written_once_released_and_swept():
    batch = SamplingBatch(VOCAB, max_slots=6)
    p = SamplingParams(temperature=0.8, seed=3)
    rows = [(p, SeqSamplingState([1], [], 5, j)) for j in range(3)]
    for _ in range(4):  # one write per (sequence, sample index), then gathers only
        batch.metadata(rows, [(10, j) for j in range(3)], 4)
    assert batch.num_writes == 3 and len(batch) == 3
    batch.release([10])
    assert len(batch) == 0
    for sid in range(3):  # sequences it is never told about, e.g. dropped beams
        batch.metadata(rows[:2], [(sid, 0), (sid, 1)], 2)
    assert len(batch) <= 6  # swept down to the step's own rows when over max_slots
    meta = batch.metadata(rows[:2], [(2, 0), (2, 1)], 2)
    np.testing.assert_array_equal(meta.seed, [3, 4])  # seed + sample index, as from_params


def test_engine_samples_the_same_with_the_persistent_batch(monkeypatch):
    """The engine's metadata comes from its `SamplingBatch` (written once per sequence and
    sample, released when requests end); forcing the row-by-row build gives the same tokens
    and logprobs for seeded, penalised, n > 1 and min_tokens requests under preemption."""
    from models.config import ModelConfig
    from models.weights import assemble_params
    from pagedjax import LLM
    from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors
    from tests.parallel.tp_script import NoTokenizer

    config = ModelConfig.from_hf({**TINY_HF_CONFIG, "max_position_embeddings": 128})
    weights = assemble_params(config, random_hf_tensors(config, seed=9).get)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, config.vocab_size, int(rng.integers(2, 30)))]
               for _ in range(7)]
    # logprobs=0 where no logprobs are otherwise asked: cumulative logprobs are reported
    # only then (vLLM V1), and they are compared below.
    sps = [SamplingParams(temperature=0.9, seed=5, max_tokens=10, n=2, logprobs=0),
           SamplingParams(temperature=0.7, max_tokens=9, presence_penalty=0.5,
                          repetition_penalty=1.2, logprobs=2),
           SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[4]),
           SamplingParams(temperature=1.1, top_k=5, top_p=0.8, max_tokens=12, logprobs=0),
           SamplingParams(temperature=0.8, min_p=0.1, max_tokens=7, logit_bias={5: 3.0}),
           SamplingParams(temperature=0, max_tokens=11, frequency_penalty=0.4),
           SamplingParams(temperature=1.0, seed=77, max_tokens=10)]

    def run(persistent: bool):
        llm = LLM.from_params(config, weights, NoTokenizer(), num_gpu_blocks=12, block_size=8,
                              max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
        eng = llm.engine
        if not persistent:
            real = eng._sampling_metadata
            monkeypatch.setattr(eng, "_sampling_metadata",
                                lambda rows, pad, masks=None, bans=None, keys=None,
                                pack_histories=True:
                                real(rows, pad, masks, bans, pack_histories=pack_histories))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)
        assert len(eng.sampling_batch) == 0  # every slot released with its request
        return outs, eng.sampling_batch.num_writes, eng.get_stats().num_preemptions_total

    (a, writes, pre), (b, none, _) = run(True), run(False)
    assert writes >= sum(sp.n for sp in sps) and none == 0 and pre > 0
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            if cy.cumulative_logprob is None:  # logprobs=None: none reported (as vLLM V1)
                assert cx.cumulative_logprob is None
            else:
                np.testing.assert_allclose(cx.cumulative_logprob, cy.cumulative_logprob,
                                           rtol=1e-6)
            assert cx.logprobs == cy.logprobs
