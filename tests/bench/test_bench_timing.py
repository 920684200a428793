"""`bench.kernels.bench`, the GPU suite's timer: the pipelined mode times the device's work
per call without each call's wait, and the bandwidth helpers return a positive rate."""

import time

import jax
import jax.numpy as jnp
import pytest

from bench.kernels import bench, copy_bandwidth, read_bandwidth


class _Call:
    """A stand-in dispatch: counts calls and returns a distinct result each time."""

    def __init__(self, wait_s: float):
        self.calls, self.wait_s, self.results = 0, wait_s, []

    def __call__(self):
        self.calls += 1
        self.results.append(jnp.full((4,), self.calls, jnp.float32))
        return self.results[-1]


def test_pipelined_mode_waits_once_per_round(monkeypatch):
    call = _Call(0.002)
    waits = []
    real = jax.block_until_ready

    def slow_wait(x):
        waits.append(x)
        time.sleep(call.wait_s)
        return real(x)

    monkeypatch.setattr(jax, "block_until_ready", slow_wait)
    t = bench(call, 20, warmup=2)
    # 2 warm-up waits, then 4 rounds of 5 calls with one wait each, on the round's last result.
    assert call.calls == 22 and len(waits) == 6
    assert [w is call.results[i] for w, i in zip(waits[2:], (6, 11, 16, 21))] == [True] * 4
    assert t < call.wait_s / 2  # the wait is shared by a round's 5 calls
    waits.clear()
    bench(call, 3, warmup=0)  # few iterations still pipeline: 2 rounds of 4
    assert len(waits) == 2 and call.calls == 22 + 8
    waits.clear()
    t_sync = bench(call, 8, warmup=0, pipelined=False)
    assert len(waits) == 8 and t_sync >= call.wait_s


@pytest.mark.parametrize("nbytes", [1 << 16, (1 << 16) + 2])
def test_bandwidths_are_positive_rates(nbytes):
    assert read_bandwidth(nbytes, 4) > 0
    assert copy_bandwidth(nbytes, 4) > 0
