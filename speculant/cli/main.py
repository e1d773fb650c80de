"""`speculant` command line: generate, bench, serve, distill.

The flags of `generate` and `bench` and the fields of their `--json` output are a contract used
by automation: extend them, never rename or drop them.
"""
from __future__ import annotations

import argparse
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default", help="GGUF file, HF folder, or 'default' (SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "q8_0", "q4_0"],
                   help="weights: auto keeps GGUF quantization; float32 inflates to fp32")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    g.add_argument("--kv-cache-tokens", type=int, default=32768, help="KV cache capacity in tokens")
    g.add_argument("--kv-dtype", default="auto", choices=["auto", "float16", "float32"],
                   help="KV cache element type: float16 halves its memory and attention's reads; "
                        "auto = float32 with --dtype float32, else float16")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per forward")
    s = p.add_argument_group("speculation")
    s.add_argument("--spec-type", default="none",
                   help="speculators, comma separated: ngram_simple,ngram_map_k,ngram_map_k4v,"
                        "ngram_mod,ngram_cache,suffix,draft (or 'none')")
    s.add_argument("--spec-n-max", type=int, default=16, help="longest draft")
    s.add_argument("--spec-n-min", type=int, default=0, help="drop drafts shorter than this")
    s.add_argument("--spec-p-min", type=float, default=0.0, help="stop drafting below this confidence")
    s.add_argument("--draft-model", default=None, help="draft model for --spec-type draft")
    s.add_argument("--spec-option", action="append", default=[], metavar="TYPE.KEY=VALUE",
                   help="speculator option, e.g. ngram_mod.n_match=16 (repeatable)")
    s.add_argument("--spec-synth-rates", default=None, metavar="R1,R2,...",
                   help="synthetic acceptance per draft position (benchmarking; output invalid)")


def engine_options(args, max_num_seqs: int) -> dict:
    from speculant.engine_config import parse_spec_types

    return dict(
        dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens, kv_dtype=args.kv_dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max_num_seqs, spec_type=parse_spec_types(args.spec_type),
        spec_n_max=args.spec_n_max, spec_n_min=args.spec_n_min, spec_p_min=args.spec_p_min,
        draft_model=args.draft_model, spec_options=parse_spec_options(args.spec_option),
        spec_synth_rates=[float(x) for x in args.spec_synth_rates.split(",")]
        if args.spec_synth_rates else None,
    )


def parse_spec_options(items: list[str]) -> dict:
    out: dict[str, dict] = {}
    for item in items:
        key, sep, value = item.partition("=")
        name, dot, field = key.partition(".")
        if not sep or not dot or not name or not field:
            raise ValueError(f"--spec-option {item!r}: expected TYPE.KEY=VALUE")
        out.setdefault(name.replace("-", "_"), {})[field] = _literal(value)
    return out


def _literal(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="generate max_tokens regardless of EOS")
    g.add_argument("--verify", default="auto", choices=["auto", "greedy", "match", "rejection"],
                   help="verification: auto = greedy at temperature 0, else sample-and-match")


def sampling_params(args, **over):
    from speculant.sampling_params import SamplingParams, SpecParams

    spec = SpecParams(verify=args.verify)
    kw = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repeat_penalty,
              seed=args.seed, stop=list(args.stop), ignore_eos=args.ignore_eos, spec=spec)
    kw.update(over)
    return SamplingParams(**kw)


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
    from speculant.bench import add_bench_args

    add_bench_args(bench)
    add_engine_args(bench)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from speculant.server.serve_cmd import add_serve_args

    add_serve_args(serve)
    add_engine_args(serve)

    distill = sub.add_parser("distill", help="train a small draft model from the target's outputs")
    from speculant.distill import add_distill_args

    add_distill_args(distill)

    demo = sub.add_parser("demo", help="one prompt, plain vs speculative, side by side")
    from speculant.demo_cmd import add_demo_args

    add_demo_args(demo)
    add_engine_args(demo)

    parity = sub.add_parser("parity", help="logit deviation and identical greedy outputs vs transformers")
    from speculant.parity_cmd import add_parity_args

    add_parity_args(parity)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            from speculant.generate_cmd import run_generate

            return run_generate(args)
        if args.command == "serve":
            from speculant.server.serve_cmd import run_serve

            return run_serve(args)
        if args.command == "distill":
            from speculant.distill import run_distill

            return run_distill(args)
        if args.command == "demo":
            from speculant.demo_cmd import run_demo

            return run_demo(args)
        if args.command == "parity":
            from speculant.parity_cmd import run_parity

            return run_parity(args)
        if args.command == "bench":
            from speculant.bench import run_bench

            return run_bench(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"speculant: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
