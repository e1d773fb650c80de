"""Hugging Face transformers as a peer: the same prompts through `generate`, timed the same way."""
from __future__ import annotations

import os
import statistics
import time


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


def hf_decode_rate(model_path: str, prompts: list[str], max_tokens: int, repeats: int = 1) -> dict:
    """Greedy decode tok/s at batch 1: (N - 1) / (time(N tokens) - time(1 token)) per prompt."""
    import torch

    model, tok = load_hf_model(model_path)
    rates = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            t_first = _timed_generate(model, ids, 1)
            t_all = min(_timed_generate(model, ids, max_tokens) for _ in range(repeats))
            if t_all > t_first:
                rates.append((max_tokens - 1) / (t_all - t_first))
    return {"decode_tok_s": round(statistics.median(rates), 2) if rates else 0.0,
            "prefill_tok_s": 0.0, "num_prompts": len(prompts), "dtype": "float32"}


def _timed_generate(model, ids, n: int) -> float:
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   attention_mask=ids.new_ones(ids.shape), pad_token_id=0)
    return time.perf_counter() - t0
