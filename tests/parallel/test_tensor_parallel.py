"""Tensor parallelism on forced host devices: TP=N must reproduce TP=1.

Every TP run happens in a subprocess with `--xla_force_host_platform_device_count=8` (this
process keeps its single CPU device). Tolerance: greedy tokens identical; logits and top-k
logprobs within 1e-4 absolute (tiny model) / 1e-3 (demo model): sharded matmuls only
reorder fp32 sums (all-reduce of per-shard partial products).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from models.config import ModelConfig
from pagedjax.parallel import TensorParallelError, validate_tp
from tests.model.helpers import TINY_HF_CONFIG

ROOT = Path(__file__).resolve().parents[2]
# Compile-time savings (most of these tests' time is XLA:CPU compiling each shape bucket).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _run_script(module: str, *args: str, devices: int = 8, timeout: int = 600) -> None:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _scenario(tmp_path_factory, mode: str) -> dict:
    out = tmp_path_factory.mktemp(mode) / "out.json"
    _run_script("tests.parallel.tp_script", mode, str(out))
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    return _scenario(tmp_path_factory, "tiny")


def _assert_matches(ref: dict, got: dict, atol: float) -> None:
    n = len(got["tokens"][0])
    assert [t[:n] for t in ref["tokens"][: len(got["tokens"])]] == got["tokens"]
    np.testing.assert_allclose(got["logits"], ref["logits"], atol=atol, rtol=0)
    for lp_ref, lp in zip(ref["logprobs"], got["logprobs"]):
        np.testing.assert_allclose(lp, lp_ref[:n], atol=atol, rtol=0)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tiny_model_matches_tp1(tiny, tp):
    _assert_matches(tiny["tp1"], tiny[f"tp{tp}"], atol=1e-4)
    assert tiny[f"tp{tp}"]["free_blocks_ok"]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    return _scenario(tmp_path_factory, "families")


@pytest.mark.parametrize("name,tp", [("qwen2_moe", 2), ("qwen2_moe", 4), ("qwen3_moe", 2),
                                     ("gemma2", 2)])
def test_families_match_tp1(families, name, tp):
    """MoE experts split by width (routing replicated, no extra collectives), KV-replicated
    biases, soft-capped windowed attention: TP=N equals TP=1."""
    _assert_matches(families[f"{name}-tp1"], families[f"{name}-tp{tp}"], atol=1e-4)
    assert families[f"{name}-tp{tp}"]["free_blocks_ok"]
    total, per_device = families[f"{name}-tp{tp}"]["param_bytes"]
    assert per_device < total  # the weights really are split


@pytest.mark.parametrize("name,tp", [("qwen2_moe", 2), ("qwen2_moe", 4), ("qwen3_moe", 2)])
def test_expert_parallel_matches_tp1(families, name, tp):
    """Whole experts per device (`enable_expert_parallel`): routing replicated, each device
    computes its own experts' assignments, one all-reduce sums them: TP=1's tokens and
    logprobs, experts split on the expert axis, weights really split."""
    ep = families[f"{name}-ep{tp}"]
    _assert_matches(families[f"{name}-tp1"], ep, atol=1e-4)
    assert ep["free_blocks_ok"]
    assert ep["expert_spec"] == "P(None, 'tp', None, None)"
    assert families[f"{name}-tp{tp}"]["expert_spec"] == "P(None, None, None, 'tp')"
    total, per_device = ep["param_bytes"]
    assert per_device < total
    if tp == 2:  # no all-to-all: activations are replicated, one all-reduce sums the experts
        coll = ep["collectives"]["per_layer"]
        assert set(coll) == {"all-reduce"}, coll


def test_int8_kv_cache_tp2_matches_tp1(tiny):
    """Quantized bytes and their scales split by KV head: TP=2 (swapping int8 blocks to a
    host pool of per-head shards) reproduces TP=1's tokens; logits within 1e-3 (a K value a
    float reassociation moves across a rounding boundary is one int8 step away)."""
    ref, got = tiny["tp1_int8"], tiny["tp2_int8"]
    assert ref["cache_dtype"] == got["cache_dtype"] == "int8"
    _assert_matches(ref, got, atol=1e-3)
    assert got["preemptions"] > 0 and got["free_blocks_ok"]


def test_int8_weights_tp2_match_tp1(tiny):
    """Packed int8 weights under TP=2 (sharded where their blocks split whole) reproduce
    TP=1's tokens and logits (the native kernel there, XLA's dequantization here: float
    reassociation only)."""
    _assert_matches(tiny["tp1_q8w"], tiny["tp2_q8w"], atol=1e-4)
    assert tiny["tp2_q8w"]["free_blocks_ok"] and tiny["tp2_q8w"]["preemptions"] > 0
    assert tiny["tp2_q8w"]["param_bytes"][0] < tiny["tp2"]["param_bytes"][0] / 3


def test_preemption_and_prefix_caching_were_exercised(tiny):
    for tp in (1, 2, 4):
        assert tiny[f"tp{tp}"]["preemptions"] > 0, tp  # TP=2 swapped, TP=1/4 recomputed
        assert tiny[f"tp{tp}"]["cached_tokens"] >= 16, tp  # the shared 16-token prefix


def test_kv_cache_split_by_head_with_replication(tiny):
    assert tiny["tp2"]["cache_spec"] == "P(None, 'tp')"
    assert tiny["tp2"]["cache_heads"] == 2  # 2 KV heads, one per device
    assert tiny["tp4"]["cache_heads"] == 4  # each of 2 KV heads replicated twice
    assert tiny["tp8"]["cache_heads"] == 8


def test_per_device_param_bytes(tiny):
    """Every tensor except the two norms is split: per device ≈ total / N."""
    for tp in (2, 4, 8):
        total, per_device = tiny[f"tp{tp}"]["param_bytes"]
        assert total / tp <= per_device <= total / tp * 1.05, (tp, total, per_device)


def test_communication_is_two_all_reduces_per_layer(tiny):
    """Megatron: all-reduce after o_proj and down_proj; once per step, the vocab-split
    embedding lookup's all-reduce and the [R, V] logits all-gather (never the LM head)."""
    coll = tiny["tp2"]["collectives"]
    assert coll["per_layer"] == {"all-reduce": 2}
    assert coll["outside_layers"] == {"all-reduce": 1, "all-gather": 1}


@pytest.mark.parametrize("tp", [2, 4])
def test_unrolled_layers_match_tp1_with_no_resharding(tiny, tp):
    """The unrolled loop's fused q/k/v and gate/up are grouped per shard (`split_fused`), so
    each device multiplies its own heads' columns: the same Megatron all-reduces as the scan,
    one pair per layer, and nothing that moves a fused projection between devices."""
    got = tiny[f"tp{tp}_unrolled"]
    _assert_matches(tiny["tp1"], got, atol=1e-4)
    assert got["free_blocks_ok"]
    if tp == 2:
        layers = TINY_HF_CONFIG["num_hidden_layers"]
        coll = got["collectives"]
        assert coll["per_layer"] == {}  # no scan body
        assert coll["outside_layers"] == {"all-reduce": 2 * layers + 1, "all-gather": 1}


def test_demo_model_tp3_matches_tp1(tmp_path_factory):
    """SmolLM2-135M: 9 query / 3 KV heads, TP=3 splits without replication."""
    demo = _scenario(tmp_path_factory, "demo")
    _assert_matches(demo["tp1"], demo["tp3"], atol=1e-3)
    assert demo["tp3"]["preemptions"] > 0 and demo["tp3"]["cached_tokens"] >= 16
    total, per_device = demo["tp3"]["param_bytes"]
    assert per_device <= total / 3 * 1.01


def test_pallas_backend_tp2_matches_tp1(tiny):
    """The Pallas kernels (interpret mode) inside shard_map, on per-shard views."""
    _assert_matches(tiny["tp1"], tiny["tp2_pallas"], atol=1e-4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_two_devices_each(tmp_path):
    """jax.distributed on localhost (gloo CPU collectives): TP=4 over 2 processes == TP=1.

    The leader and the worker reach the step, the broadcasts and the copies from different
    call stacks; `multihost.align_traced_programs` keeps their programs identical (with jax
    0.12.1 this run hung in its first collective without it). Each process's log is shown if
    either fails or hangs (the script dumps its stacks and exits after ``hang_s``)."""
    hang_s = 240
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = []
    for i in range(2):
        with open(logs[i], "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.parallel.multihost_script", str(i), port,
                 str(tmp_path / f"p{i}.json"), str(hang_s)], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT))
    deadline = time.monotonic() + hang_s + 60
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    shown = "\n".join(f"--- process {i} (exit {p.returncode}):\n{logs[i].read_text()[-4000:]}"
                      for i, p in enumerate(procs))
    assert all(p.returncode == 0 for p in procs), shown
    leader = json.loads((tmp_path / "p0.json").read_text())
    worker = json.loads((tmp_path / "p1.json").read_text())
    assert leader["tp4"] == leader["tp1"]
    assert worker["worker_steps"] == leader["leader_steps"] > 0
    assert leader["locations_limit"] == worker["locations_limit"] == 0


# ---- configuration errors (no devices needed: validated from the config alone) ------------

DEMO_LIKE = ModelConfig.from_hf({**TINY_HF_CONFIG, "num_attention_heads": 9,
                                 "num_key_value_heads": 3, "intermediate_size": 144})


@pytest.mark.parametrize("n, match", [
    (2, "must divide the number of attention heads"),
    (4, "must divide the number of attention heads"),
    (16, "exceeds the 8 available"),
])
def test_bad_tp_size_is_rejected(n, match):
    with pytest.raises(TensorParallelError, match=match):
        validate_tp(DEMO_LIKE, n, num_devices=8)


def test_kv_heads_neither_dividing_nor_multiple():
    cfg = ModelConfig.from_hf({**TINY_HF_CONFIG, "num_attention_heads": 12,
                               "num_key_value_heads": 4, "intermediate_size": 96})
    with pytest.raises(TensorParallelError, match="KV heads"):
        validate_tp(cfg, 6, num_devices=8)
    validate_tp(cfg, 2, num_devices=8)  # divides 4 KV heads
    validate_tp(DEMO_LIKE, 9, num_devices=16)  # 3 KV heads replicated 3 times


def test_engine_rejects_more_devices_than_available():
    """In this process there is one CPU device: the runner fails before placing anything."""
    from pagedjax import LLM

    with pytest.raises(TensorParallelError, match="exceeds the 1 available"):
        LLM.from_params(DEMO_LIKE, {}, None, dtype=np.float32, tensor_parallel_size=3)
