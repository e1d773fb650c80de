"""Hugging Face transformers as a peer: the same prompts through `generate`, timed the same way.

Decode rate excludes prefill, as the engine's does: per prompt, `generate` of N tokens and of
1 token both pay the same prefill, so (N - 1) / (time(N) - time(1)) is the decode rate; a
category's rate pools its prompts (tokens and times summed). N is forced with
`min_new_tokens`. Methods, one request at a time (batch 1):

- `hf_transformers_fp32`: plain greedy `generate`;
- `hf_prompt_lookup_<n>`: prompt lookup decoding (`prompt_lookup_num_tokens=n`, Saxena 2023);
- `hf_assistant`: assisted generation (`assistant_model`, Leviathan et al. 2023), when a draft
  model is given.

Per prompt the methods interleave (plain, lookup, assistant, plain, ...) so that drift on a
shared machine hits them alike; every call is watched for CPU interference (bench/timing.py).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from speculant.bench.report import PeerResult


def load_hf_model(model_path: str):
    """The same weights in transformers, fp32 (a GGUF is dequantized by transformers itself)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_path.endswith(".gguf"):
        folder, name = os.path.dirname(model_path), os.path.basename(model_path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_path)
    return model.eval(), tok


@dataclass(slots=True)
class HfMethod:
    name: str  # the peer's name in the report
    method: str  # "plain" | "prompt_lookup" | "assistant"
    kwargs: dict = field(default_factory=dict)  # extra `generate` arguments


def hf_methods(prompt_lookup: int, assistant=None) -> list[HfMethod]:
    methods = [HfMethod("hf_transformers_fp32", "plain")]
    if prompt_lookup > 0:
        methods.append(HfMethod(f"hf_prompt_lookup_{prompt_lookup}", "prompt_lookup",
                                {"prompt_lookup_num_tokens": prompt_lookup}))
    if assistant is not None:
        methods.append(HfMethod("hf_assistant", "assistant", {"assistant_model": assistant}))
    return methods


@dataclass(slots=True)
class _Tally:
    """One method on one category: per repeat, decode tokens and seconds; prefill totals."""

    decode_tokens: list[int]
    decode_time_s: list[float]
    generated: int = 0
    prompt_tokens: int = 0
    first_token_s: float = 0.0
    interference: bool = False


def run_hf_peer(model_path: str, groups: dict[str, list[str]], max_tokens: int, repeats: int,
                prompt_lookup: int = 10, draft_model: str | None = None, threads: int = 1,
                max_reruns: int = 0, tolerance: float = 0.25) -> list[PeerResult]:
    """Every method on every category of `groups` (category -> prompt texts)."""
    import torch
    from tqdm import tqdm

    model, tok = load_hf_model(model_path)
    assistant = load_hf_model(draft_model)[0] if draft_model else None
    methods = hf_methods(prompt_lookup, assistant)
    bar = tqdm(total=len(methods) * sum(map(len, groups.values())), desc="hf peer", unit="gen",
               file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    out = []
    with torch.inference_mode():
        shortest = min((p for ps in groups.values() for p in ps), key=len)
        warm_ids = tok(shortest, return_tensors="pt", add_special_tokens=False).input_ids
        for m in methods:  # untimed: first-call costs would inflate time(1 token)
            _timed_generate(model, warm_ids, 4, m.kwargs)
        for category, prompts in groups.items():
            tallies = {m.name: _Tally([0] * repeats, [0.0] * repeats) for m in methods}
            for prompt in prompts:
                ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
                _measure_prompt(model, ids, methods, tallies, max_tokens, repeats,
                                (threads, max_reruns, tolerance), f"hf {category}")
                bar.update(len(methods))
            out += [_peer_result(m, category, len(prompts), tallies[m.name], draft_model)
                    for m in methods]
    bar.close()
    return out


def _measure_prompt(model, ids, methods: list[HfMethod], tallies: dict[str, _Tally],
                    max_tokens: int, repeats: int, watch: tuple, label: str) -> None:
    """time(1 token) once per method, then `repeats` rounds of time(N tokens), interleaved."""
    first = {m.name: _watched(model, ids, 1, m, watch, label) for m in methods}
    for i in range(repeats):
        for m in methods:
            t_all, n, interfered = _watched(model, ids, max_tokens, m, watch, label)
            t = tallies[m.name]
            t.interference |= interfered
            t_first = first[m.name][0]
            if n > 1 and t_all > t_first:
                t.decode_tokens[i] += n - 1
                t.decode_time_s[i] += t_all - t_first
            if i == 0:
                t.generated += n
                t.prompt_tokens += ids.shape[1]
                t.first_token_s += t_first
    for m in methods:
        tallies[m.name].interference |= first[m.name][2]


def _watched(model, ids, n: int, m: HfMethod, watch: tuple, label: str) -> tuple[float, int, bool]:
    """(seconds, tokens generated, interfered) of one `generate`, re-run on interference."""
    from speculant.bench.timing import run_with_reruns

    threads, max_reruns, tolerance = watch
    (seconds, num), usage, _ = run_with_reruns(lambda: _timed_generate(model, ids, n, m.kwargs),
                                               threads, max_reruns, f"{label} {m.name}", tolerance,
                                               warn=_warn)
    return seconds, num, usage.interference


def _timed_generate(model, ids, n: int, kwargs: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         attention_mask=ids.new_ones(ids.shape), pad_token_id=0, **kwargs)
    return time.perf_counter() - t0, out.shape[1] - ids.shape[1]


def _peer_result(m: HfMethod, category: str, num_prompts: int, t: _Tally,
                 draft_model: str | None) -> PeerResult:
    detail = {"dtype": "float32"}
    if m.method == "assistant":
        detail["draft_model"] = draft_model
    # time(1 token) is the prefill plus one step: close enough for a prefill rate.
    prefill = round(t.prompt_tokens / t.first_token_s, 1) if t.first_token_s else 0.0
    return PeerResult(m.name, "hf", m.method, category, num_prompts, t.generated,
                      t.decode_tokens, t.decode_time_s, prefill_tok_s=prefill,
                      interference=t.interference, detail=detail)


def _warn(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)
