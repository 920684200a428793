"""Command line: `pagedjax generate|chat|convert|fetch-demo|serve|client`."""

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
    llm = LLM(args.model, dtype=args.dtype)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for each prompt")
    g.add_argument("prompt", nargs="+")
    g.add_argument("--raw", action="store_true",
                   help="complete the raw text instead of applying the chat template")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert", help="convert a model to a pagedjax (orbax) checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32")
    c.set_defaults(func=cmd_convert)

    f = sub.add_parser("fetch-demo", help="fetch the demo model into the cache")
    f.set_defaults(func=cmd_fetch_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
