"""`speculant` command line: generate, bench, serve, distill.

The flags of `generate` and `bench` and the fields of their `--json` output are a contract used
by automation: extend them, never rename or drop them.
"""
from __future__ import annotations

import argparse
import os
import sys

from speculant.kernels.thread_policy import prefer_kernel_pool

# Before anything imports torch: libgomp reads OMP_WAIT_POLICY when it loads, and the kernels'
# own thread pool is the faster one where libgomp's threads sleep (kernels/thread_policy.py).
prefer_kernel_pool(os.environ, sys.modules)

from speculant.cli.options import add_engine_args, add_sampling_args  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculant", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a prompt or a prompt file")
    gen.add_argument("prompt", nargs="?", default=None, help="prompt text (chat template applied unless --raw)")
    gen.add_argument("--prompts", default=None, help="JSONL prompt file (shared/data schema)")
    gen.add_argument("--categories", default=None, help="with --prompts: comma-separated categories")
    gen.add_argument("--limit", type=int, default=None, help="with --prompts: prompts per category")
    gen.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    gen.add_argument("--raw", action="store_true", help="send PROMPT as raw text, no chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    add_engine_args(gen)
    add_sampling_args(gen)

    bench = sub.add_parser("bench", help="prefill / decode tokens/s, plain and speculative")
    from speculant.bench.options import add_bench_args

    add_bench_args(bench)
    add_engine_args(bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from speculant.cli.serve import add_serve_args

    add_serve_args(serve)
    add_engine_args(serve)

    distill = sub.add_parser("distill", help="train a small draft model from the target's outputs")
    from speculant.training.distill import add_distill_args

    add_distill_args(distill)

    train_head = sub.add_parser("train-head", help="train an EAGLE-3 or MTP draft head on the target's features")
    from speculant.training.head_trainer import add_train_head_args

    add_train_head_args(train_head)

    demo = sub.add_parser("demo", help="one prompt, plain vs speculative, side by side")
    from speculant.cli.demo import add_demo_args

    add_demo_args(demo)
    add_engine_args(demo)

    parity = sub.add_parser("parity", help="logit deviation and identical greedy outputs vs transformers")
    from speculant.cli.parity import add_parity_args

    add_parity_args(parity)

    pair = sub.add_parser("bench-pair", help="two methods of one bench JSON, paired prompt by prompt")
    from speculant.bench.pair import add_pair_args

    add_pair_args(pair)

    tune = sub.add_parser("tune", help="search draft limits on a prompt set; write --spec-params FILE")
    from speculant.cli.tune import add_tune_args

    add_tune_args(tune)
    add_engine_args(tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            from speculant.cli.generate import run_generate

            return run_generate(args)
        if args.command == "serve":
            from speculant.cli.serve import run_serve

            return run_serve(args)
        if args.command == "distill":
            from speculant.training.distill import run_distill

            return run_distill(args)
        if args.command == "train-head":
            from speculant.training.head_trainer import run_train_head

            return run_train_head(args)
        if args.command == "demo":
            from speculant.cli.demo import run_demo

            return run_demo(args)
        if args.command == "parity":
            from speculant.cli.parity import run_parity

            return run_parity(args)
        if args.command == "bench":
            from speculant.bench.benchmark import run_bench

            return run_bench(args)
        if args.command == "bench-pair":
            from speculant.bench.pair import run_pair

            return run_pair(args)
        if args.command == "tune":
            from speculant.cli.tune import run_tune

            return run_tune(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"speculant: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
