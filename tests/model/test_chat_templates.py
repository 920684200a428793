"""Chat templates and end-of-turn ids of each model family, through the public loading path.

Each family's test folder holds its random weights (`write_family`), a `generation_config.json`
whose `eos_token_id` list carries the family's end-of-turn token, and a small real HF fast
tokenizer (one token per character plus the family's special tokens) whose
`tokenizer_config.json` carries a short Jinja template in the family's turn format. The
folder is loaded with `pagedjax.LLM(model=folder)`, as users load a Hub download; checked:

- `LLM.chat` renders exactly the family's prompt (the literal string, and the ids HF's own
  `apply_chat_template` gives) with one BOS where the family has one, and the OpenAI server's
  renderer (/v1/chat/completions, /tokenize) gives the same text and ids;
- the end-of-turn id from `generation_config.json` stops generation (finish_reason "stop",
  not in the text), also under `min_tokens`, even where the tokenizer's own EOS is another id.
"""

from __future__ import annotations

import dataclasses
import json
import string

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from pagedjax import LLM, SamplingParams
from pagedjax.serving.http import _render_chat
from tests.model.test_families import write_family

# One token per character: with at most a dozen special tokens, within the families' 128 ids.
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
# The same characters as byte-level BPE writes them (GPT-2's byte-to-unicode table: bytes below
# "!" move up by 256, so " " is "Ġ" and "\n" is "Ċ").
BYTE_CHARS = [c if ord(c) > 32 else chr(256 + ord(c)) for c in CHARS]

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Sum 2+2?"}]


@dataclasses.dataclass(frozen=True)
class FamilyChat:
    weights: str            # family in tests/data/family_goldens.json
    specials: tuple         # ids 0.. in order; id 2 is the tokenizer's EOS (config.json's too)
    bos: str | None         # the tokenizer adds it when asked for special tokens
    end_of_turn: str        # listed in generation_config.json's eos_token_id
    template: str
    expected: str           # MESSAGES rendered with add_generation_prompt=True
    template_file: bool = False  # chat_template.jinja (newer Hub layout), not tokenizer_config
    byte_level: bool = False  # byte-level BPE (Llama 3, Qwen) rather than SentencePiece-style

    @property
    def eos(self) -> str:
        return self.specials[2]


LLAMA3 = FamilyChat(
    weights="llama3",
    specials=("<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
              "<|end_header_id|>", "<|eot_id|>"),
    bos="<|begin_of_text|>", end_of_turn="<|eot_id|>",
    template=(
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim"
        " + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"),
    expected=("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nSum 2+2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    byte_level=True)

CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_EXPECTED = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                   "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nSum 2+2?<|im_end|>\n"
                   "<|im_start|>assistant\n")
QWEN_SPECIALS = ("<unk>", "<|fim_pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")

MISTRAL = FamilyChat(
    weights="mistral", specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), bos="<s>",
    end_of_turn="</s>",
    # No system role: its text opens the first user turn.
    template=(
        "{{ bos_token }}{% set sys = messages[0]['content'] + '\n\n' "
        "if messages[0]['role'] == 'system' else '' %}"
        "{% for m in messages if m['role'] != 'system' %}"
        "{% if m['role'] == 'user' %}{{ '[INST] ' + (sys if loop.first else '') + m['content']"
        " + ' [/INST]' }}{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"),
    expected="<s>[INST] Be brief.\n\nHi! [/INST]Hello.</s>[INST] Sum 2+2? [/INST]")

PHI3 = FamilyChat(
    weights="phi3",
    specials=("<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
              "<|end|>"),
    bos="<s>", end_of_turn="<|end|>",
    template=(
        "{{ bos_token }}{% for m in messages %}"
        "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"),
    expected=("<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\nHello.<|end|>\n"
              "<|user|>\nSum 2+2?<|end|>\n<|assistant|>\n"))

GEMMA_TEMPLATE = (  # no system role: its text opens the first user turn
    "{{ bos_token }}{% set sys = messages[0]['content'] + '\n\n' "
    "if messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{{ (sys if loop.first else '') + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
GEMMA_EXPECTED = ("<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
                  "<start_of_turn>model\nHello.<end_of_turn>\n"
                  "<start_of_turn>user\nSum 2+2?<end_of_turn>\n<start_of_turn>model\n")
GEMMA_SPECIALS = ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")

FAMILIES = {
    "llama3": LLAMA3,
    # qwen2-window: Qwen2 weights with a 256-token context (the plain qwen2 test model has 24)
    # (transformers loads model_type qwen2 folders with its own byte-level Qwen2Tokenizer.)
    "qwen2": FamilyChat("qwen2-window", QWEN_SPECIALS, None, "<|im_end|>", CHATML_TEMPLATE,
                        CHATML_EXPECTED, byte_level=True),
    "qwen3": FamilyChat("qwen3", QWEN_SPECIALS, None, "<|im_end|>", CHATML_TEMPLATE,
                        CHATML_EXPECTED, template_file=True, byte_level=True),
    "mistral": MISTRAL,
    "phi3": PHI3,
    "gemma2": FamilyChat("gemma2", GEMMA_SPECIALS, "<bos>", "<end_of_turn>", GEMMA_TEMPLATE,
                         GEMMA_EXPECTED),
    "gemma3": FamilyChat("gemma3", GEMMA_SPECIALS, "<bos>", "<end_of_turn>", GEMMA_TEMPLATE,
                         GEMMA_EXPECTED, template_file=True),
}


def save_family_tokenizer(path, fam: FamilyChat) -> None:
    """A real HF fast tokenizer (tokenizer.json + tokenizer_config.json) with the family's
    special tokens, BOS added on plain encodes where the family's tokenizer adds one, and the
    chat template where the Hub keeps it (tokenizer_config.json, or chat_template.jinja)."""
    chars = BYTE_CHARS if fam.byte_level else CHARS
    vocab = {t: i for i, t in enumerate(fam.specials + tuple(chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=fam.specials[0]))
    if fam.byte_level:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
    else:
        tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fam.specials])
    if fam.bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam.bos} $A", pair=f"{fam.bos} $A {fam.bos} $B",
            special_tokens=[(fam.bos, vocab[fam.bos])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=fam.bos, eos_token=fam.eos,
                                   unk_token=fam.specials[0])
    fast.save_pretrained(str(path))
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (path / "chat_template.jinja").unlink(missing_ok=True)
    if fam.template_file:
        (path / "chat_template.jinja").write_text(fam.template)
    else:
        cfg["chat_template"] = fam.template
    cfg_path.write_text(json.dumps(cfg, indent=1))


def write_chat_family(path, fam: FamilyChat) -> None:
    write_family(fam.weights, path)
    save_family_tokenizer(path, fam)
    eos = list(dict.fromkeys([2, fam.specials.index(fam.end_of_turn)]))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def chat_llm(request, tmp_path_factory):
    fam = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(f"chat-{request.param}")
    write_chat_family(path, fam)
    llm = LLM(model=str(path), dtype="float32", num_gpu_blocks=24, block_size=16,
              max_model_len=192, max_num_seqs=2)
    return fam, llm


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def test_chat_renders_the_family_prompt(chat_llm):
    """The prompt `LLM.chat` sends is the family's turn format, one BOS, system text included;
    the same ids as HF's `apply_chat_template` and as the OpenAI server's renderer."""
    fam, llm = chat_llm
    tok = llm.tokenizer
    assert tok.chat_template == fam.template  # from the folder, not a built-in fallback
    out = llm.chat(MESSAGES, _greedy(max_tokens=1), use_tqdm=False)[0]
    want_ids = tok(fam.expected, add_special_tokens=False).input_ids
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False) == fam.expected
    assert out.prompt == fam.expected and out.prompt_token_ids == want_ids
    hf = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    hf_ids = hf["input_ids"] if isinstance(hf, dict) or hasattr(hf, "keys") else hf
    assert list(hf_ids) == want_ids
    if fam.bos is not None:
        bos = tok.convert_tokens_to_ids(fam.bos)
        assert want_ids[0] == bos and want_ids.count(bos) == 1
        # A plain encode adds BOS: tokenizing the rendered text that way would double it.
        assert tok(fam.expected).input_ids[:2] == [bos, bos]
    # /v1/chat/completions and /tokenize render through this function.
    assert _render_chat(tok, MESSAGES, True) == (fam.expected, want_ids)
    assert _render_chat(tok, MESSAGES, False)[0] == tok.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=False)


def test_generation_config_end_of_turn_stops(chat_llm):
    """The end-of-turn id listed in generation_config.json ends the reply (forced here by a
    logit bias): finish_reason "stop", the token kept out of the text; with min_tokens it is
    banned until then, as the tokenizer's own EOS is."""
    fam, llm = chat_llm
    tok = llm.tokenizer
    eot = tok.convert_tokens_to_ids(fam.end_of_turn)
    assert eot in llm.engine.eos_token_ids
    if fam.end_of_turn != fam.eos:  # only generation_config.json names it
        assert tok.eos_token_id != eot
    out = llm.chat(MESSAGES, _greedy(max_tokens=8, logit_bias={eot: 100.0}),
                   use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([eot], "", "stop")
    x = tok.convert_tokens_to_ids("x")
    out = llm.chat(MESSAGES, _greedy(max_tokens=8, min_tokens=2, logit_bias={eot: 100.0, x: 50.0}),
                   use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason) == ([x, x, eot], "xx", "stop")


def test_openai_server_uses_the_family_template(tmp_path):
    """In-process HTTP server on a Llama 3 folder: /tokenize with messages gives the family's
    prompt ids, and /v1/chat/completions stops on <|eot_id|> from generation_config.json."""
    import httpx

    from tests.serving.inproc import InProcessServer

    fam = LLAMA3
    write_chat_family(tmp_path, fam)
    llm = LLM(model=str(tmp_path), dtype="float32", num_gpu_blocks=24, block_size=16,
              max_model_len=192, max_num_seqs=2)
    tok = llm.tokenizer
    eot, x = tok.convert_tokens_to_ids(fam.end_of_turn), tok.convert_tokens_to_ids("x")
    srv = InProcessServer(llm.engine, tmp_path, http_port=0).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.ports['http_port']}",
                          timeout=60) as http:
            r = http.post("/tokenize", json={"messages": MESSAGES})
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == tok(fam.expected, add_special_tokens=False).input_ids
            r = http.post("/v1/chat/completions", json={
                "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "min_tokens": 2,
                "logit_bias": {str(eot): 100, str(x): 50}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] == "xx"
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["usage"]["prompt_tokens"] == len(
                tok(fam.expected, add_special_tokens=False).input_ids)
            assert body["usage"]["completion_tokens"] == 3
    finally:
        assert srv.close() == 0
