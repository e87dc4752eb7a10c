"""radixserve command line: serve | generate | make-tiny-model | simulate | bench {one-batch, offline, serving}."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from radixserve.server_args import ServerArgs


def _cmd_generate(args: argparse.Namespace) -> int:
    from radixserve.engine import Engine

    server_args = ServerArgs.from_cli_args(args)
    engine = Engine(**vars(server_args))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    if args.stream:
        printed = 0
        for chunk in engine.generate(prompt, sp, stream=True):
            sys.stdout.write(chunk["text"][printed:])
            sys.stdout.flush()
            printed = len(chunk["text"])
        sys.stdout.write("\n")
        return 0
    out = engine.generate(prompt, sp)
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        print(out["text"])
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from radixserve.launch import launch_server

    return launch_server(ServerArgs.from_cli_args(args))


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from radixserve.tiny_model import make_tiny_model

    path = make_tiny_model(args.out_dir)
    print(f"wrote the tiny model to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the HTTP server (SGLang-native and OpenAI APIs); no flags: the tiny model on 127.0.0.1:30000",
    )
    ServerArgs.add_cli_args(serve)
    serve.set_defaults(func=_cmd_serve)

    gen = sub.add_parser("generate", help="generate text for one prompt, offline (no server)")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print the whole SGLang-shaped result")
    ServerArgs.add_cli_args(gen)
    gen.set_defaults(func=_cmd_generate)

    tiny = sub.add_parser("make-tiny-model", help="write the embedded tiny model as a Hugging Face directory")
    tiny.add_argument("out_dir")
    tiny.set_defaults(func=_cmd_make_tiny_model)

    bench = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from radixserve.bench import offline, one_batch, serving

    one_batch.add_parser(bench_sub)
    offline.add_parser(bench_sub)
    serving.add_parser(bench_sub)

    from radixserve.sim import command as simulate

    simulate.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s %(name)s] %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:  # bad flags or a model that cannot load: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if type(e).__name__ == "LoadError":
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
