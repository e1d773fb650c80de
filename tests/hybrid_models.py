"""Randomly initialised hybrid models (LFM2, Qwen3-Next) saved by transformers, and helpers to
run them through speculant's forward one chunk list at a time."""
from __future__ import annotations

import torch

from speculant.engine.forward_batch import SeqChunk, build_forward_batch
from speculant.models.hybrid import hybrid_model
from speculant.models.loader import load_model

VOCAB = 512


def hf_config(family: str, num_layers: int = 4, hidden: int = 256, **overrides):
    """A transformers config of `family` at a realistic width (hidden 256, GQA 8/2 heads)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=num_layers,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.05,
                  tie_word_embeddings=False)
    if family == "lfm2":
        # attention at layers 1 and 3 (the real LFM2 interleaves likewise)
        kw = dict(common, intermediate_size=768, full_attn_idxs=[1, 3][: num_layers // 2])
        return transformers.Lfm2Config(**{**kw, **overrides})
    kw = dict(common, intermediate_size=512, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              num_experts=0, rms_norm_eps=1e-6)
    return transformers.Qwen3NextConfig(**{**kw, **overrides})


def save_hf_model(folder, family: str, seed: int = 0, **overrides):
    """Build, randomise and save a transformers model; returns it (eval, fp32)."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    cls = transformers.Lfm2ForCausalLM if family == "lfm2" else transformers.Qwen3NextForCausalLM
    model = cls(cfg).eval()
    with torch.no_grad():  # norms start at their identity: perturb them so a misread one shows
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def load_ours(folder):
    loaded = load_model(str(folder))
    return hybrid_model(loaded.config, loaded.weights)


class Runner:
    """A hybrid model with its two caches; feeds chunk lists and keeps sequences allocated."""

    def __init__(self, model, num_blocks: int = 256, num_slots: int = 8, block_size: int = 16):
        self.model = model
        self.kv = model.new_kv_cache(num_blocks, block_size, num_state_slots=num_slots)
        self.states = self.kv.states

    def add(self, seq_id: int) -> None:
        self.kv.allocate(seq_id)  # and its state slot

    def run(self, chunks: list[SeqChunk], keep_steps=frozenset()):
        """One forward; commits every chunk's tokens to the KV length. Returns the output."""
        batch = build_forward_batch(self.kv, chunks)
        out = self.model.forward(batch, self.kv, self.states.batch(
            [c.seq_id for c in chunks], keep_steps))
        for c in chunks:
            self.kv.set_length(c.seq_id, c.start_pos + len(c.token_ids))
        return out


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]  # [n, vocab]
