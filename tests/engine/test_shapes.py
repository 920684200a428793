"""`ShapePlan`: every step the scheduler can emit pads to a shape in the warmed set."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedjax.core.scheduler import ScheduledSeq
from pagedjax.worker.shapes import ShapePlan
from pagedjax.worker.step_inputs import build_step_inputs


@settings(max_examples=300, deadline=None)
@given(max_num_seqs=st.sampled_from([1, 3, 8, 64]), budget=st.sampled_from([16, 40, 64, 512]),
       block_size=st.sampled_from([8, 16]), max_len=st.sampled_from([64, 256, 1000]),
       fixed=st.booleans(), seed=st.integers(0, 2**31 - 1), logprob_rows=st.booleans(),
       spec=st.sampled_from([0, 0, 2, 4]))
def test_every_step_pads_to_a_planned_shape(max_num_seqs, budget, block_size, max_len, fixed,
                                           seed, logprob_rows, spec):
    rng = np.random.default_rng(seed)
    max_blocks = -(-max_len // block_size)
    plan = ShapePlan(max_num_seqs, budget, max_blocks, fixed_width=fixed, block_size=block_size,
                     spec_tokens=spec)
    planned = set(plan.step_shapes())
    # A batch the scheduler could emit: <= max_num_seqs sequences, <= budget tokens, each
    # sequence's context within max_len.
    n = int(rng.integers(1, max_num_seqs + 1))
    decode = rng.random() < 0.5
    seqs, tokens, rows, spec_lens = [], 0, [], []
    for i in range(n):
        q = 1 if decode else min(max_len, int(rng.integers(1, max(2, budget // n + 1))))
        drafts = int(rng.integers(0, spec + 1)) if spec and rng.random() < 0.5 else 0
        q += drafts  # a drafted sequence: its last token, its drafts, a sampled row each
        if tokens + q > budget or q > max_len:
            break
        start = int(rng.integers(0, max_len - q + 1))
        blocks = -(-(start + q) // block_size)
        seqs.append(ScheduledSeq(i, "r", [1] * q, start, list(range(blocks)), True))
        tokens += q
        rows.append(1 + drafts)
        spec_lens.append(drafts)
    if not seqs:
        return
    extra = None
    if logprob_rows and not any(spec_lens) and not all(len(s.token_ids) == 1 for s in seqs):
        extra = list(range(min(tokens, 3)))
    inputs = build_step_inputs(seqs, block_size, max_blocks, rows_per_seq=rows,
                               extra_rows=extra, plan=plan, spec_lens=spec_lens)
    assert inputs.shape_key in planned
    t, s, m, r, _ = inputs.shape_key
    assert s >= len(seqs) and t >= tokens and m * block_size >= max(
        x.start_pos + len(x.token_ids) for x in seqs)
    assert r >= sum(rows) + len(extra or ())
    assert plan.sample_cap >= sum(rows)  # the sampler's batch and the async token feed


def test_plan_sizes():
    plan = ShapePlan(64, 2048, 256, fixed_width=False, block_size=16)
    assert plan.seq_buckets == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert plan.token_buckets == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert plan.widths == [4, 16, 64, 256]
    assert ShapePlan(64, 2048, 256, fixed_width=True).widths == [256]
    assert plan.decode(5) == (8, 8, 8) and plan.decode(33) == (40, 40, 40)
    big = ShapePlan(300, 2048, 64, fixed_width=True)
    assert big.seq_buckets[-4:] == [240, 256, 288, 320] and big.seq_cap == 320
    assert plan.mixed(100, 3, 0) == (128, 64, 64) and plan.mixed(100, 3, 5) == (128, 64, 192)
