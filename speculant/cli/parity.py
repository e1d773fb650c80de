"""`speculant parity`: how close our numerics are to Hugging Face transformers on the same weights.

For each requested weight type (`--dtypes auto,float32`: the GGUF's own quantized weights through
our kernels, and the same weights inflated to fp32) it reports

- the max absolute logit deviation from transformers' fp32 forward over every position of the
  prompts (transformers dequantizes the GGUF itself, so fp32 should agree to rounding, while
  quantized weights plus int8 activation blocks deviate by what quantization costs), and
- how many greedy continuations of `--max-tokens` equal transformers' greedy output token for
  token, and the mean length of the common prefix where they differ.

Prompts: the first turn of `--limit` dev prompts from each of `--categories`.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

DEFAULT_CATEGORIES = "mt_bench,qa,summarization,code_completion,gsm8k"


@dataclass(slots=True)
class ParityResult:
    dtype: str
    num_prompts: int
    max_abs_logit_dev: float  # over all prompt positions of all prompts
    mean_abs_logit_dev: float
    num_identical: int  # greedy outputs equal to transformers' token for token
    mean_common_prefix: float  # tokens, over the outputs that differ (0 when none differ)


def add_parity_args(p) -> None:
    from speculant.training.distill import DEFAULT_PROMPTS

    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL prompt file")
    p.add_argument("--categories", default=DEFAULT_CATEGORIES, help="comma-separated categories")
    p.add_argument("--limit", type=int, default=2, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens compared per prompt")
    p.add_argument("--dtypes", default="auto,float32",
                   help="weight types compared: auto (GGUF as shipped), float32, float16, q8_0, q4_0")
    p.add_argument("--model", default="default", help="GGUF file, HF folder, or 'default'")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def run_parity(args) -> int:
    import torch

    from speculant.bench.hf_peer import load_hf_model
    from speculant.llm import LLM
    from speculant.models.loader import resolve_model
    from speculant.data.prompt_set import first_turn_prompt, read_prompts

    if args.limit < 1 or args.max_tokens < 1:
        raise ValueError("parity: --limit and --max-tokens must be >= 1")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = resolve_model(args.model).path
    records = read_prompts(args.prompts, [c.strip() for c in args.categories.split(",")], args.limit)
    if not records:
        raise ValueError(f"parity: no prompts of {args.categories!r} in {args.prompts!r}")
    hf_model, _ = load_hf_model(model_path)
    refs = None
    results = []
    for dtype in dtypes:
        llm = LLM(model_path, dtype=dtype, max_num_seqs=len(records), num_threads=args.threads)
        prompts = [first_turn_prompt(r, llm.tokenizer) for r in records]
        ids = [llm.tokenizer.encode(p) for p in prompts]
        if refs is None:
            refs = _hf_reference(hf_model, ids, args.max_tokens)
        results.append(_compare(llm, dtype, ids, refs, args.max_tokens))
        print(_row(results[-1]), file=sys.stderr)
    _print_table(results, model_path, args.max_tokens)
    print(json.dumps({"model": model_path, "max_tokens": args.max_tokens,
                      "results": [asdict(r) for r in results]}))
    return 0


def _hf_reference(hf_model, ids: list[list[int]], max_tokens: int) -> list[tuple]:
    """Per prompt: transformers' fp32 logits at every prompt position [T, V] and its greedy
    continuation."""
    import torch
    from tqdm import tqdm

    refs = []
    for p in tqdm(ids, desc="transformers fp32", file=sys.stderr):
        x = torch.tensor([p])
        with torch.no_grad():
            logits = hf_model(x).logits[0]
            out = hf_model.generate(x, max_new_tokens=max_tokens, do_sample=False,
                                    attention_mask=torch.ones_like(x), pad_token_id=0,
                                    eos_token_id=hf_model.generation_config.eos_token_id)
        refs.append((logits, out[0, x.shape[1]:].tolist()))
    return refs


def _compare(llm, dtype: str, ids: list[list[int]], refs: list[tuple], max_tokens: int) -> ParityResult:
    import torch

    from speculant.engine.sampling_params import SamplingParams, SpecParams
    from speculant.speculators.ngram_match import common_prefix_len

    t0 = time.perf_counter()
    devs = [(prompt_logits(llm.engine.model, p) - ref_logits).abs()
            for p, (ref_logits, _) in zip(ids, refs)]
    outs = llm.generate(ids,
                        SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                       spec=SpecParams(enabled=False)))
    same = [o.token_ids == ref for o, (_, ref) in zip(outs, refs)]
    prefixes = [common_prefix_len(o.token_ids, ref) for o, (_, ref), s in zip(outs, refs, same) if not s]
    all_devs = torch.cat([d.flatten() for d in devs])
    print(f"[parity] {dtype}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return ParityResult(dtype, len(ids), round(all_devs.max().item(), 6),
                        round(all_devs.mean().item(), 6), sum(same),
                        round(sum(prefixes) / len(prefixes), 1) if prefixes else 0.0)


def prompt_logits(model, ids: list[int], kv_dtype=None, num_prompt_tokens: int | None = None):
    """Our logits at every position of `ids` [T, V], in a KV cache of their own (float32, or
    kv_dtype: an engine's gives, row for row, the logits its own steps compute, the kernels
    being batch-invariant). The first `num_prompt_tokens` (all by default) run as the engine
    runs a prompt, the rest as generated positions (kernels/attention.py)."""
    import torch

    from speculant.engine.forward_batch import SeqChunk, build_forward_batch

    from speculant.kernels.kv_layout import TILE_BLOCK, is_tile_layout

    block_size = TILE_BLOCK if is_tile_layout(kv_dtype) else 16
    cache = model.new_kv_cache(num_blocks=len(ids) // block_size + 1, block_size=block_size,
                               dtype=kv_dtype or torch.float32)
    cache.allocate(0)
    num_prompt = len(ids) if num_prompt_tokens is None else num_prompt_tokens
    batch = build_forward_batch(cache, [SeqChunk(0, 0, ids, num_logits=len(ids),
                                                 num_prompt_tokens=num_prompt)])
    return model.forward(batch, cache).logits


def _row(r: ParityResult) -> str:
    return (f"| {r.dtype} | {r.max_abs_logit_dev:.2e} | {r.mean_abs_logit_dev:.2e} | "
            f"{r.num_identical}/{r.num_prompts} | {r.mean_common_prefix} |")


def _print_table(results: list[ParityResult], model_path: str, max_tokens: int) -> None:
    print(f"Parity with transformers fp32 ({model_path}; greedy, {max_tokens} tokens)")
    print("| weights | max abs logit dev | mean abs logit dev | identical outputs | "
          "common prefix where different |")
    print("|---|---|---|---|---|")
    for r in results:
        print(_row(r))
