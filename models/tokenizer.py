"""Tokenizers through `transformers.AutoTokenizer`.

HF directories load directly. For GGUF files, transformers' own GGUF reader imports torch
(not a dependency here), so we build the same byte-level BPE tokenizer from the GGUF metadata
with the `tokenizers` library, save it beside the model once, and load that with AutoTokenizer.
Tests check the token ids against HF's GGUF tokenizer (goldens in tests/data).
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


def build_tokenizer_from_gguf(gguf_path: Path, out_dir: Path) -> None:
    reader = gguf.GGUFReader(str(gguf_path))
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise WeightError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
            "use an HF directory with tokenizer.json instead")
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
