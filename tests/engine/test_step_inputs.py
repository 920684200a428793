"""`build_step_inputs`' decode path (`_decode_inputs`: one token and one sampled row per
sequence, block tables on the device) builds exactly the arrays of the general path, over
random decode steps: sequences of random lengths and tables (new rows, grown tables,
rewritten tables), pending tokens, 1 to 64 sequences and their buckets' padding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pagedjax.worker.step_inputs as step_inputs
from pagedjax.core.scheduler import PENDING_TOKEN, ScheduledSeq
from pagedjax.worker.input_batch import InputBatch
from pagedjax.worker.shapes import ShapePlan

BS, M = 8, 32


def _same(a: step_inputs.StepInputs, b: step_inputs.StepInputs) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "meta":
            for g in dataclasses.fields(x):
                u, v = getattr(x, g.name), getattr(y, g.name)
                if u is None or v is None:
                    assert u is v, g.name
                else:
                    np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=g.name)
                    assert np.asarray(u).dtype == np.asarray(v).dtype, g.name
        elif isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y, err_msg=f.name)
            assert x.dtype == y.dtype, f.name
        elif f.name != "table_source":
            assert x == y, f.name


@pytest.mark.parametrize("seed", range(6))
def test_decode_path_builds_the_general_paths_arrays(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    plan = ShapePlan(64, 512, M, fixed_width=False, block_size=BS)
    fast = InputBatch(M, max_rows=128, device_tables=True)
    slow = InputBatch(M, max_rows=128, device_tables=True)
    tables: dict[int, list[int]] = {}
    versions: dict[int, int] = {}
    fast_calls = []
    real = step_inputs._decode_inputs

    def counted(*a, **k):
        fast_calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(step_inputs, "_decode_inputs", counted)
    for _ in range(12):
        n = int(rng.integers(1, 65))
        ids = rng.choice(200, n, replace=False).tolist()
        scheduled = []
        for sid in ids:
            start = int(rng.integers(0, M * BS - 1))
            need = start // BS + 1
            table = tables.get(sid)
            if table is None or rng.random() < 0.2:  # new, or rewritten (copy-on-write)
                table = [int(b) for b in rng.integers(1, 5000, need)]
                versions[sid] = versions.get(sid, 0) + 1
            while len(table) < need:  # grown: appended blocks, the same version
                table.append(int(rng.integers(1, 5000)))
            tables[sid] = table
            tok = PENDING_TOKEN if rng.random() < 0.3 else int(rng.integers(0, 1000))
            scheduled.append(ScheduledSeq(sid, f"r{sid}", [tok], start, table, True,
                                          versions[sid], ()))
        got = step_inputs.build_step_inputs(scheduled, BS, M, [1] * n, None, plan=plan,
                                            batch=fast, num_tokens=n)
        # rows_per_seq None (one row per sampling entry): the general path.
        want = step_inputs.build_step_inputs(scheduled, BS, M, None, None, plan=plan, batch=slow,
                                             num_tokens=n)
        _same(got, want)
        assert got.shape_key[:2] == (plan.decode(n)[0],) * 2 and got.meta.decode_only
        np.testing.assert_array_equal(fast.take_deltas()[1], slow.take_deltas()[1])
    assert len(fast_calls) == 12  # every step took the decode path on the first batch only
