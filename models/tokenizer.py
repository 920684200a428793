"""Tokenizers through `transformers.AutoTokenizer`.

HF directories load directly. For GGUF files, transformers' own GGUF reader imports torch
(not a dependency here), so we read the metadata with the `gguf` package and build the
tokenizer it describes: byte-level BPE ("gpt2": SmolLM2, Qwen, Llama 3) with the `tokenizers`
library, and SentencePiece-style vocabularies ("llama": Gemma, Llama 2) with transformers'
GGUF tokenizer converter, which needs no torch. The result is saved beside the model once and
loaded with AutoTokenizer. Tests check the token ids against HF's GGUF tokenizer (goldens in
tests/data).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from models.gguf_loader import field_value
from models.weights import WeightError

CONTROL_TOKEN = 3  # llama.cpp token type


def tokenizer_dir_for_gguf(gguf_path: Path) -> Path:
    return gguf_path.with_name(gguf_path.name + ".tokenizer")


# Gemma GGUFs carry no chat template; this is Gemma's turn format (system text goes at the
# start of the first user turn, as Gemma has no system role).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ prefix if loop.first else '' }}{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def _spm_backend(reader: gguf.GGUFReader) -> Tokenizer:
    """A SentencePiece-style vocabulary through transformers' GGUF tokenizer converter."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:  # the converter moved between transformers releases
        raise WeightError("this transformers version has no GGUF tokenizer converter usable "
                          f"without torch ({e}); use an HF directory with tokenizer.json") from e
    fields = {name: field_value(reader, f"tokenizer.{key}")
              for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()}
    fields = {k: v for k, v in fields.items() if v is not None}
    backend, _ = convert_gguf_tokenizer(field_value(reader, "general.architecture"), fields)
    return backend


def build_tokenizer_from_gguf(gguf_path: Path, out_dir: Path) -> None:
    reader = gguf.GGUFReader(str(gguf_path))
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise WeightError(
            f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
            "SentencePiece-style 'llama' are); use an HF directory with tokenizer.json instead")
    if kind == "llama":
        _save_spm_tokenizer(reader, gguf_path, out_dir)
        return
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    merges = field_value(reader, "tokenizer.ggml.merges") or []
    types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types) if ty == CONTROL_TOKEN]
    tok.add_special_tokens(specials)

    def token(key: str) -> str | None:
        idx = field_value(reader, f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
    )
    template = field_value(reader, "tokenizer.chat_template")
    if template:
        fast.chat_template = template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    (out_dir / "pagedjax_source.json").write_text(json.dumps({"gguf": gguf_path.name}))


def _save_spm_tokenizer(reader: gguf.GGUFReader, gguf_path: Path, out_dir: Path) -> None:
    tok = _spm_backend(reader)
    tokens = field_value(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        idx = field_value(reader, f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and int(idx) < len(tokens) else None

    bos = token("bos_token_id")
    add_bos = field_value(reader, "tokenizer.ggml.add_bos_token")
    if bos is not None and add_bos is not False:  # llama.cpp's default for these vocabularies
        bos_id = int(field_value(reader, "tokenizer.ggml.bos_token_id"))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos,
                                   eos_token=token("eos_token_id"),
                                   unk_token=token("unknown_token_id"),
                                   pad_token=token("padding_token_id"))
    template = field_value(reader, "tokenizer.chat_template")
    arch = str(field_value(reader, "general.architecture") or "")
    if template:
        fast.chat_template = template
    elif arch.startswith("gemma"):
        fast.chat_template = GEMMA_CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    (out_dir / "pagedjax_source.json").write_text(json.dumps({"gguf": gguf_path.name}))


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    """Tokenizer for a GGUF file, HF directory, or converted pagedjax checkpoint directory."""
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        tdir = tokenizer_dir_for_gguf(path)
        if not (tdir / "tokenizer.json").is_file():
            build_tokenizer_from_gguf(path, tdir)
        return AutoTokenizer.from_pretrained(str(tdir))
    if path.is_dir():
        for cand in (path, path / "tokenizer"):
            if (cand / "tokenizer.json").is_file() or (cand / "tokenizer_config.json").is_file():
                return AutoTokenizer.from_pretrained(str(cand))
    raise FileNotFoundError(f"no tokenizer found for {model_path}")
