"""`pagedjax serve` takes `vllm serve`'s command line: the model positional, --port for HTTP,
--grpc-port, --served-model-name, --tokenizer, --chat-template, --generation-config,
--max-model-len defaulting to the model's own; `python -m pagedjax` works; /version,
/tokenize and /detokenize answer as vLLM's do."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from models.loader import read_config
from pagedjax.cli import build_parser, serve_options
from pagedjax.engine import LLMEngine
from pagedjax.serving.server import generation_defaults


def test_serve_options_like_vllm(demo_gguf):
    args = build_parser().parse_args([
        "serve", str(demo_gguf), "--port", "9000", "--grpc-port", "0", "--served-model-name",
        "smol", "--tokenizer", "/tok", "--chat-template", "{{ 'x' }}", "--generation-config",
        "vllm", "--max-num-seqs", "8"])
    o = serve_options(args)
    assert (o.model, o.http_port, o.port, o.served_model_name, o.tokenizer) == \
        (str(demo_gguf), 9000, 0, "smol", "/tok")
    assert o.chat_template == "{{ 'x' }}" and o.generation_config == "vllm"
    # The model's own context length, not the Python API's cap.
    assert o.engine_kwargs == {"max_num_seqs": 8, "max_model_len":
                               read_config(demo_gguf).max_position_embeddings}
    o = serve_options(build_parser().parse_args(["serve", "--model", str(demo_gguf),
                                                 "--max-model-len", "512"]))
    assert o.http_port == 8000 and o.port is None and o.engine_kwargs == {"max_model_len": 512}
    # The former flag name still works.
    assert serve_options(build_parser().parse_args(
        ["serve", str(demo_gguf), "--http-port", "0"])).http_port == 0
    # vLLM's scheduling policy flag reaches the engine's config.
    o = serve_options(build_parser().parse_args(
        ["serve", str(demo_gguf), "--scheduling-policy", "priority", "--max-model-len", "64"]))
    assert o.engine_kwargs == {"scheduling_policy": "priority", "max_model_len": 64}
    # usage.prompt_tokens_details: off unless asked, as vLLM's flag.
    assert o.enable_prompt_tokens_details is False
    assert serve_options(build_parser().parse_args(
        ["serve", str(demo_gguf), "--enable-prompt-tokens-details", "--max-model-len", "64"])
    ).enable_prompt_tokens_details is True


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "pagedjax", "serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--served-model-name" in out.stdout
    assert "--grpc-port" in out.stdout and "MODEL" in out.stdout


def test_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
         "max_new_tokens": 7, "eos_token_id": [1, 2]}))
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert generation_defaults("auto", str(tmp_path)) == want
    assert generation_defaults(str(tmp_path), "elsewhere.gguf") == want
    assert generation_defaults("vllm", str(tmp_path)) == {}
    assert generation_defaults("auto", str(tmp_path / "model.gguf")) == {}
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert generation_defaults("auto", str(tmp_path)) == {}
    with pytest.raises(ValueError, match="generation_config"):
        generation_defaults(str(tmp_path / "missing"), "m")


def test_tokenizer_chat_template_and_name_overrides(demo_gguf, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    eng = LLMEngine.from_model(str(demo_gguf), "float32", chat_template=str(tpl),
                               served_model_name="smol", num_gpu_blocks=16, max_model_len=128)
    assert eng.model_name == "smol"
    text = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tokenize=False)
    assert text == "<<hi>>"
    tok_dir = tmp_path / "tok"
    eng.tokenizer.save_pretrained(tok_dir)
    other = LLMEngine.from_model(str(demo_gguf), "float32", tokenizer=str(tok_dir),
                                 num_gpu_blocks=16, max_model_len=128)
    assert other.tokenizer.chat_template.startswith("{% for m in messages %}")


def test_version_tokenize_detokenize(server, demo_tokenizer):
    server.client  # noqa: B018 - waits until serving
    url = f"http://127.0.0.1:{server.ports['http_port']}"
    from pagedjax import __version__

    assert httpx.get(f"{url}/version").json() == {"version": __version__}
    r = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == demo_tokenizer("Hello world").input_ids
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": msgs}).json()
    text = demo_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == demo_tokenizer(text, add_special_tokens=False).input_ids
    back = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == demo_tokenizer.decode(r["tokens"])
    for route, body, field in [("/detokenize", {"tokens": [10**8]}, "tokens"),
                               ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                               ("/tokenize", {"prompt": "a", "model": "other"}, "model")]:
        resp = httpx.post(url + route, json=body)
        assert resp.status_code in (400, 404), resp.text
        assert field in resp.json()["error"]["message"]
