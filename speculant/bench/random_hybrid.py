"""A random-weight hybrid model of the default model's size, to benchmark the checkpoint modes.

No hybrid checkpoint ships in a package we can install, so the per_step / reeval comparison runs
on a randomly initialised LFM2 or Qwen3-Next built by transformers from a config shaped like
SmolLM2-135M (hidden 576, 30 layers, 9 query / 3 KV heads of 64, MLP 1536, its 49,152-token
vocabulary), saved as an HF folder together with the default model's tokenizer, so dev prompts
tokenize as for the default model:

    python -m speculant.bench.random_hybrid --arch qwen3_next --out /tmp/qwen3next-135m
    speculant bench --model /tmp/qwen3next-135m --dtype float32 --spec-type synthetic \\
        --spec-synth-rates 0.8 --spec-ckpt-mode per_step ...

Its text is noise; with synthetic drafts (forced acceptance) only the cost of a round matters.
"""
from __future__ import annotations

import argparse
import os
import shutil

ARCHS = ("qwen3_next", "lfm2")
DEFAULT_SHAPE = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                     max_position_embeddings=8192, tie_word_embeddings=True)


def hybrid_config(arch: str, **overrides):
    """A transformers config of `arch` at the default model's size.
    qwen3_next: full attention every 4th layer (7 of 30, as Qwen3-Next), DeltaNet with 4 key /
    8 value heads of 64. lfm2: attention at the real LFM2's share (10 of 30), short convs else."""
    import transformers

    shape = {**DEFAULT_SHAPE, **overrides}
    if arch == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **shape, head_dim=64, full_attention_interval=4, linear_num_key_heads=4,
            linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4, num_experts=0, rms_norm_eps=1e-6)
    if arch == "lfm2":
        return transformers.Lfm2Config(
            **shape, full_attn_idxs=list(range(2, shape["num_hidden_layers"], 3)))
    raise ValueError(f"--arch must be one of {ARCHS}, got {arch!r}")


def write_random_hybrid(arch: str, out: str, seed: int = 0, **overrides) -> str:
    """Build, randomise (seeded) and save the model plus the default model's tokenizer files
    (`overrides`: config fields, e.g. fewer layers for a test)."""
    import torch
    import transformers

    from speculant.models.loader import default_model_path
    from speculant.models.tokenizer import gguf_tokenizer_folder

    cfg = hybrid_config(arch, **overrides)
    torch.manual_seed(seed)
    cls = transformers.Qwen3NextForCausalLM if arch == "qwen3_next" else transformers.Lfm2ForCausalLM
    cls(cfg).eval().save_pretrained(out)
    tokenizer_folder = gguf_tokenizer_folder(default_model_path())
    for name in os.listdir(tokenizer_folder):
        shutil.copy(os.path.join(tokenizer_folder, name), os.path.join(out, name))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculant.bench.random_hybrid",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--out", required=True, help="folder to write (config, weights, tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_random_hybrid(args.arch, args.out, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
