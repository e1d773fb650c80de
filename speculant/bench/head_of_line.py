"""Head-of-line blocking: a short request's latency alone vs. while a long prompt prefills.

    python -m speculant.bench.head_of_line [--long-tokens 8000] [--short-tokens 16]
        [--max-prefill-chunk-decoding 64] [--threads 2]

Runs the engine in-process (no HTTP): first the short request alone, then the long prompt, and
the short request added right after the long prompt's first chunk. Prints both latencies and
their ratio; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from speculant.engine.config import EngineConfig
from speculant.engine.engine import Engine
from speculant.engine.sampling_params import SamplingParams

SHORT_PROMPT = "Count from one to twenty:"


def short_latency(engine: Engine, params: SamplingParams, long_ids: list[int] | None) -> float:
    """Seconds from adding the short request to its last token (behind `long_ids` if given)."""
    long = None
    if long_ids is not None:
        long = engine.add_request(long_ids, SamplingParams(max_tokens=1, temperature=0.0))
        engine.step()  # the long prompt is prefilling when the short request arrives
    t0 = time.perf_counter()
    short = engine.add_request(SHORT_PROMPT, params)
    while not short.is_finished:
        engine.step()
    latency = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    for seq in (short, long):
        if seq is not None:
            engine.release(seq)
    return latency


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--max-prefill-chunk-decoding", type=int,
                   default=EngineConfig().max_prefill_chunk_decoding)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    engine = Engine(EngineConfig(max_num_seqs=4, num_threads=args.threads,
                                 max_prefill_chunk_decoding=args.max_prefill_chunk_decoding))
    rng = random.Random(0)
    long_ids = [rng.randrange(100, 40000) for _ in range(args.long_tokens)]
    params = SamplingParams(max_tokens=args.short_tokens, temperature=0.0, ignore_eos=True)
    short_latency(engine, params, None)  # warm-up
    alone = short_latency(engine, params, None)
    behind = short_latency(engine, params, long_ids)
    ratio = behind / alone
    print(f"short request ({args.short_tokens} tokens): alone {alone:.3f} s, behind a "
          f"{args.long_tokens}-token prefill {behind:.3f} s, ratio {ratio:.1f}x "
          f"(max_prefill_chunk_decoding {args.max_prefill_chunk_decoding})")
    print(json.dumps({"alone_s": round(alone, 4), "behind_long_prefill_s": round(behind, 4),
                      "latency_ratio": round(ratio, 2), "long_tokens": args.long_tokens,
                      "short_tokens": args.short_tokens,
                      "max_prefill_chunk_decoding": args.max_prefill_chunk_decoding}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
