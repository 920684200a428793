"""Engines and invariants shared by the front-door fuzzers (tests/serving/test_fuzz_*.py).

`FuzzFakeEngine` is `FakeEngine` made safe to fuzz: a chat template (so chat requests get past
templating) and generation capped as the real engine caps it at `max_model_len` (a fuzzed
`max_tokens=2**40` must end). `tiny_engine` is a real `LLMEngine` over a tiny random Llama, for
the one invariant the fake cannot show: the KV block pool is whole after the fuzz.
"""

from __future__ import annotations

import copy
import time
import types

from hypothesis import strategies as st

from tests.serving.fake_engine import FakeEngine

FAKE_MAX_TOKENS = 4

# Sampling params the engine accepts (so a request reaches the scheduler, sampler and block
# pool); each fuzzed request adds at most one extreme value on top, so that one rejection does
# not hide everything else. Ranges fit the proto's int32/int64 fields.
SANE_PARAMS = {
    "max_tokens": st.integers(1, 6), "n": st.integers(1, 3),
    "temperature": st.one_of(st.just(0.0), st.floats(0.0, 2.0)), "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 200), "min_p": st.floats(0.0, 1.0), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "presence_penalty": st.floats(-2.0, 2.0), "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 3.0), "min_tokens": st.integers(0, 3), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 2**31 - 1), max_size=3), "logprobs": st.integers(0, 20),
    "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
}
# Beam search has its own constraints (greedy, best_of > 1): a separate family of sane params.
SANE_BEAM_PARAMS = st.fixed_dictionaries(
    {"use_beam_search": st.just(True), "temperature": st.just(0.0), "n": st.integers(1, 2),
     "best_of": st.integers(2, 4), "max_tokens": st.integers(1, 6)},
    optional={"length_penalty": st.floats(-2.0, 2.0),
              "early_stopping": st.sampled_from([True, False, "never"]),
              "stop_token_ids": st.lists(st.integers(0, 95), max_size=2)})
SANE_SAMPLING = st.one_of(st.fixed_dictionaries({}, optional=SANE_PARAMS), SANE_BEAM_PARAMS)


class ToyTokenizer:
    """Bytes → ids in [3, vocab): enough of a tokenizer for the engine, detokenizer and chat."""

    eos_token_id = 2

    def __init__(self, vocab: int = 96):
        self.vocab = vocab

    def __call__(self, text: str | list[str], add_special_tokens: bool = True):
        enc = lambda t: [3 + b % (self.vocab - 3) for b in t.encode()]
        ids = [enc(t) for t in text] if isinstance(text, list) else enc(text)  # a batch, or one
        return types.SimpleNamespace(input_ids=ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x20 + t % 0x5f) for t in ids)

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in conversation) + "<assistant>"


class FuzzFakeEngine(FakeEngine):
    tokenizer = ToyTokenizer(100)

    def add_request(self, request_id, prompt, params=None, prompt_token_ids=None, **kwargs):
        super().add_request(request_id, prompt, params, prompt_token_ids, **kwargs)
        sp = self._reqs[request_id]["sp"] = copy.copy(self._reqs[request_id]["sp"])
        sp.max_tokens = min(sp.max_tokens, FAKE_MAX_TOKENS)


def tiny_engine(**kwargs):
    """A real `LLMEngine` (tiny random Llama, CPU-sized pool) with a text tokenizer."""
    from models.config import ModelConfig
    from models.weights import assemble_params
    from pagedjax import LLM
    from tests.model.helpers import TINY_HF_CONFIG, random_hf_tensors

    config = ModelConfig.from_hf(TINY_HF_CONFIG)
    params = assemble_params(config, random_hf_tensors(config, seed=5).get)
    opts = dict(num_gpu_blocks=32, block_size=8, max_num_seqs=4, max_model_len=64, layer_loop="scan")
    llm = LLM.from_params(config, params, ToyTokenizer(config.vocab_size), model_name="tiny",
                          **{**opts, **kwargs})
    return llm.engine


def wait_idle(client, timeout: float = 10.0):
    """Stats once nothing is in flight (aborts of disconnected clients land at a step boundary)."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s.num_in_flight == 0:
            return s
        assert time.monotonic() < deadline, f"requests left in flight after the fuzz: {s}"
        time.sleep(0.05)


def assert_pool_whole(engine) -> None:
    """No request left and every KV block back in the free pool (allocator invariants hold)."""
    deadline = time.monotonic() + 10.0
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.has_unfinished_requests()
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == engine.runner.num_gpu_blocks
