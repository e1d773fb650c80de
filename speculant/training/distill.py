"""`speculant distill`: train a small draft model from the target's own outputs and logits.

Knowledge distillation (Hinton et al. 2015) aimed at speculative decoding (DistillSpec, Zhou et
al. 2024): what makes a draft accepted is agreeing with the target on the target's own text, so
the draft learns from target continuations of the dev prompts, with the loss

    KL(p_tgt top-k || q_dft) + ce_weight * CE(q_dft, target token)

where p_tgt is the target's next-token distribution restricted to its top-k tokens (renormalized)
and q_dft the draft's full-vocabulary distribution. Prompts of the categories the draft is judged
on (mt_bench, qa, translation by default) never enter training; a sample of them is the held-out
set on which the draft's greedy agreement with the target is measured.

The draft is a Llama decoder with the target's tokenizer and width, initialised from N of the
target's layers (dequantized exactly), its embedding (frozen, tied to the LM head) and final norm.
It is saved as a Hugging Face folder in two fp16 shards: `model-layers.safetensors` (what
training produced) and `model-embed.safetensors` (the target's embedding, which
`--restore-embeddings` rewrites from the target, so a shipped draft needs only the first).

This module imports torch inside functions: `speculant --help` stays fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

from speculant.models.config import ModelConfig

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_PROMPTS = os.path.normpath(os.path.join(REPO_DIR, "..", "shared", "data", "prompts_dev.jsonl"))
JUDGED_CATEGORIES = ("mt_bench", "qa", "translation")
INIT_CHOICES = ("spaced", "first")
EMBED_KEY = "model.embed_tokens.weight"
EMBED_SHARD = "model-embed.safetensors"
LAYERS_SHARD = "model-layers.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEAD_TOKENS_KEY = "speculant_lm_head_tokens"  # config.json: the head size the draft was trained for
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
WARMUP_STEPS = 10
MIN_LR_FRACTION = 0.1  # the cosine schedule ends at this fraction of --lr
ACCEPT_N_MAX = (4, 8)  # draft lengths of the simulated greedy acceptance in the recipe


@dataclass(slots=True)
class DistillConfig:
    """Fields are the CLI flags of `speculant distill`."""

    out: str
    model: str = "default"  # the target
    layers: int = 4
    init: str = "spaced"  # target layers copied: evenly spaced (first and last kept) or the first N
    prompts: str = DEFAULT_PROMPTS
    exclude_categories: list[str] = field(default_factory=lambda: list(JUDGED_CATEGORIES))
    eval_prompts: int = 8  # held-out prompts per excluded category
    max_new_tokens: int = 256
    samples_per_prompt: int = 1  # the first continuation is greedy, the others sampled
    temperature: float = 0.8  # of the sampled continuations
    top_k: int = 32  # target logits kept per position
    steps: int = 0  # 0 = as many as the time budget allows
    seq_len: int = 512
    batch_size: int = 8  # rows of up to seq_len tokens per optimizer step
    lr: float = 1e-3
    # LM head and loss over the N tokens the target generates most (draft_vocab.json), as the
    # draft runs with `draft.lm_head_tokens=N`: the full 49152-row head is most of a training
    # step's arithmetic. 0 = the whole vocabulary.
    train_vocab: int = 8192
    ce_weight: float = 0.5
    threads: int | None = None
    time_budget_min: float = 45.0  # training stops cleanly (and saves) when it is spent
    seed: int = 0
    restore_embeddings: bool = False  # only rewrite the embedding shard and tokenizer of --out

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("distill: --out DIR is required")
        if self.init not in INIT_CHOICES:
            raise ValueError(f"distill: --init must be one of {INIT_CHOICES}, got {self.init!r}")
        for name, low in (("layers", 1), ("eval_prompts", 0), ("max_new_tokens", 1),
                          ("samples_per_prompt", 1), ("top_k", 1), ("steps", 0), ("seq_len", 16),
                          ("batch_size", 1), ("seed", 0), ("train_vocab", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"distill: --{name.replace('_', '-')} must be >= {low}, "
                                 f"got {getattr(self, name)}")
        if not 0.0 < self.temperature <= 2.0:
            raise ValueError(f"distill: --temperature must be in (0, 2], got {self.temperature}")
        if self.lr <= 0 or self.ce_weight < 0 or self.time_budget_min <= 0:
            raise ValueError("distill: --lr and --time-budget-min must be > 0, --ce-weight >= 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"distill: --threads must be >= 1, got {self.threads}")
        if not self.restore_embeddings and not os.path.isfile(self.prompts):
            raise FileNotFoundError(f"distill: prompts file not found: {self.prompts!r} "
                                    "(give --prompts FILE.jsonl)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DistillConfig":
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        values["exclude_categories"] = [c.strip() for c in args.exclude_categories.split(",")
                                        if c.strip()]
        return cls(**values)


def add_distill_args(p: argparse.ArgumentParser) -> None:
    d = DistillConfig.__dataclass_fields__
    p.add_argument("--out", required=True, help="output folder (HF model + recipe.json + data cache)")
    p.add_argument("--model", default="default", help="the target: GGUF, HF folder or 'default'")
    p.add_argument("--layers", type=int, default=d["layers"].default, help="draft layers")
    p.add_argument("--init", default="spaced", choices=INIT_CHOICES,
                   help="target layers to start from: evenly spaced or the first N")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="JSONL prompts (shared/data schema)")
    p.add_argument("--exclude-categories", default=",".join(JUDGED_CATEGORIES),
                   help="categories never trained on (the draft is judged on them); held out")
    p.add_argument("--eval-prompts", type=int, default=d["eval_prompts"].default,
                   help="held-out prompts per excluded category")
    p.add_argument("--max-new-tokens", type=int, default=d["max_new_tokens"].default,
                   help="target tokens generated per prompt")
    p.add_argument("--samples-per-prompt", type=int, default=d["samples_per_prompt"].default,
                   help="continuations per prompt: one greedy, the rest sampled")
    p.add_argument("--temperature", type=float, default=d["temperature"].default,
                   help="temperature of the sampled continuations")
    p.add_argument("--top-k", type=int, default=d["top_k"].default, help="target logits kept per token")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (0 = until the time budget)")
    p.add_argument("--seq-len", type=int, default=d["seq_len"].default, help="tokens per training row")
    p.add_argument("--batch-size", type=int, default=d["batch_size"].default, help="rows per step")
    p.add_argument("--lr", type=float, default=d["lr"].default, help="AdamW peak learning rate")
    p.add_argument("--train-vocab", type=int, default=d["train_vocab"].default,
                   help="LM head restricted to the N tokens the target generates most (the "
                        "draft then runs with draft.lm_head_tokens=N); 0 = whole vocabulary")
    p.add_argument("--ce-weight", type=float, default=d["ce_weight"].default,
                   help="weight of the cross-entropy on target tokens (KL weight is 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--time-budget-min", type=float, default=d["time_budget_min"].default,
                   help="training time limit in minutes (stops cleanly and saves)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restore-embeddings", action="store_true",
                   help="only (re)write --out's embedding shard and tokenizer files from the target")


def run_distill(args: argparse.Namespace) -> int:
    import torch

    from speculant.training.distill_data import load_or_generate
    from speculant.models.loader import load_model

    cfg = DistillConfig.from_args(args)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.restore_embeddings:
        restore_embeddings(cfg.out, cfg.model)
        return 0
    torch.manual_seed(cfg.seed)
    target = load_model(cfg.model)
    layer_ids = select_layers(_check_target(target.config), cfg.layers, cfg.init)
    # 1) data: target continuations + top-k logits (cached in --out)
    data, heldout, data_info = load_or_generate(cfg.model, _data_spec(cfg, target.files.path),
                                                cfg.out, cfg.threads)
    os.makedirs(cfg.out, exist_ok=True)
    vocab_file = write_generated_vocab(cfg.out, data, target.config.vocab_size)
    # 2) the draft, from the target's own weights
    draft = TrainableDraft.from_target(target.weights, target.config, layer_ids)
    if cfg.train_vocab and cfg.train_vocab < target.config.vocab_size:
        draft.restrict_head(_head_ids(vocab_file, cfg.train_vocab, target))
    del target
    agree_init = heldout_agreement(draft, heldout)
    # 3) train, 4) save, 5) measure
    train_info = train(draft, data, cfg)
    files = save_draft(draft, cfg.out, cfg.model)
    agree = heldout_agreement(draft, heldout)
    recipe = _recipe(cfg, layer_ids, data_info, train_info, agree_init, agree, files)
    with open(os.path.join(cfg.out, "recipe.json"), "w") as f:
        json.dump(recipe, f, indent=1)
    _print_recipe(recipe)
    return 0


def _check_target(config: ModelConfig) -> ModelConfig:
    if config.architecture not in ("llama", "smollm2", "mistral") or config.qkv_bias \
            or config.qk_norm or not config.tie_word_embeddings:
        raise ValueError(f"distill: the target must be a Llama-architecture model with tied "
                         f"embeddings, got {config.architecture!r}")
    return config


def _head_ids(vocab_file: str, num_tokens: int, target):
    """The draft's head tokens, chosen exactly as `draft.lm_head_tokens` chooses them."""
    from speculant.speculators.draft_vocab import head_token_ids, read_ranking
    from speculant.models.tokenizer import load_tokenizer

    eos = load_tokenizer(target.files).eos_token_id
    return head_token_ids(read_ranking(os.path.dirname(vocab_file)), num_tokens,
                          target.config.vocab_size, frozenset(() if eos is None else (eos,)))


def select_layers(config: ModelConfig, num_layers: int, init: str) -> list[int]:
    """Target layer indices the draft's layers start from."""
    total = config.num_layers
    if num_layers > total:
        raise ValueError(f"distill: --layers {num_layers}: the target has only {total} layers")
    if init == "first" or num_layers == 1:
        return list(range(num_layers))
    # Evenly spaced, keeping the first layer (reads embeddings) and the last (feeds the LM head).
    return [round(i * (total - 1) / (num_layers - 1)) for i in range(num_layers)]


def _data_spec(cfg: DistillConfig, model_path: str):
    from speculant.training.distill_data import DataSpec
    from speculant.models.loader import file_key

    model_key = file_key(model_path) if os.path.isfile(model_path) else os.path.abspath(model_path)
    return DataSpec(model_key=model_key, prompts=os.path.abspath(cfg.prompts),
                    prompts_key=file_key(cfg.prompts), exclude_categories=cfg.exclude_categories,
                    eval_prompts=cfg.eval_prompts, max_new_tokens=cfg.max_new_tokens,
                    samples_per_prompt=cfg.samples_per_prompt, temperature=cfg.temperature,
                    top_k=cfg.top_k, seq_len=cfg.seq_len, seed=cfg.seed)


# ---- the draft --------------------------------------------------------------------------------

class TrainableDraft:
    """A Llama decoder as a dict of HF-named fp32 tensors (the export format is the state).

    `params`: model.embed_tokens.weight [vocab, hidden] (frozen; tied LM head),
    model.layers.{i}.{input_layernorm, post_attention_layernorm}.weight [hidden],
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight [out, in] (Q/K rows in NeoX RoPE order, as
    HF and our loader use), model.layers.{i}.mlp.{gate,up,down}_proj.weight, model.norm.weight.
    Sequences are packed into one row: `doc_ids` keeps attention inside each sequence and
    `positions` restart at 0 for each.
    """

    def __init__(self, config: ModelConfig, params: dict):
        import torch

        self.config = config
        self.params = params
        # LM head restricted to these token ids [n] (column j = token head_ids[j]); None = all
        self.head_ids = None
        self.column_of = None  # [vocab] int64: column of each token id, -1 outside the head
        # NeoX-style rotary tables, as HF computes them: [max_positions, head_dim] each
        c = config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        freqs = torch.outer(torch.arange(c.max_position_embeddings).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos, self.rope_sin = emb.cos(), emb.sin()

    @classmethod
    def from_target(cls, weights: dict, target: ModelConfig, layer_ids: list[int]) -> "TrainableDraft":
        """Exact dequantization of the target's tensors (GGUF names) into draft tensors."""
        from speculant.kernels import PackedLinear
        from speculant.models.loader import _hf_to_gguf_name

        config = dataclasses.replace(target, num_layers=len(layer_ids))
        params = {}
        for key in hf_param_names(config):
            src = key
            if key.startswith("model.layers."):
                j, _, rest = key[len("model.layers."):].partition(".")
                src = f"model.layers.{layer_ids[int(j)]}.{rest}"
            w = weights[_hf_to_gguf_name(src)]
            w = w.dequantize() if isinstance(w, PackedLinear) else w.float()
            params[key] = w.clone().requires_grad_(key != EMBED_KEY)
        return cls(config, params)

    def trainable(self) -> list:
        return [t for t in self.params.values() if t.requires_grad]

    def hidden(self, token_ids, positions, doc_ids):
        """token_ids, positions, doc_ids [L] -> final-normed hidden states [L, hidden]."""
        import torch

        c, p = self.config, self.params
        causal = torch.ones(len(token_ids), len(token_ids), dtype=torch.bool).tril()
        mask = causal & (doc_ids[:, None] == doc_ids[None, :])  # [L, L], True = attend
        cos = self.rope_cos[positions].unsqueeze(1)  # [L, 1, head_dim]
        sin = self.rope_sin[positions].unsqueeze(1)
        h = p[EMBED_KEY][token_ids]  # [L, hidden]
        for i in range(c.num_layers):
            h = self._attention(h, f"model.layers.{i}.", cos, sin, mask)
            h = self._mlp(h, f"model.layers.{i}.")
        return _rms_norm(h, p["model.norm.weight"], c.rms_norm_eps)

    def restrict_head(self, head_ids) -> None:
        """Score only the tokens head_ids [n] (sorted int64), as the engine's restricted head."""
        import torch

        vocab = self.params[EMBED_KEY].shape[0]
        self.head_ids = head_ids
        self.column_of = torch.full((vocab,), -1, dtype=torch.long)
        self.column_of[head_ids] = torch.arange(len(head_ids))

    def logits(self, hidden):
        """hidden [n, hidden] -> [n, vocab] through the tied LM head ([n, len(head_ids)] when
        restricted)."""
        embed = self.params[EMBED_KEY]
        return hidden @ (embed if self.head_ids is None else embed[self.head_ids]).T

    def predict(self, hidden):
        """hidden [n, hidden] -> the draft's greedy token ids [n]."""
        cols = self.logits(hidden).argmax(-1)
        return cols if self.head_ids is None else self.head_ids[cols]

    def _attention(self, h, prefix: str, cos, sin, mask):
        import torch.nn.functional as F

        c, p = self.config, self.params
        n = h.shape[0]
        x = _rms_norm(h, p[prefix + "input_layernorm.weight"], c.rms_norm_eps)
        q = (x @ p[prefix + "self_attn.q_proj.weight"].T).view(n, c.num_heads, c.head_dim)
        k = (x @ p[prefix + "self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, c.head_dim)
        v = (x @ p[prefix + "self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, c.head_dim)
        q = _rope(q, cos, sin).transpose(0, 1)  # [heads, L, head_dim]
        k = _rope(k, cos, sin).transpose(0, 1)  # [kv_heads, L, head_dim]
        attn = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), attn_mask=mask,
                                              enable_gqa=True)  # [heads, L, head_dim]
        return h + attn.transpose(0, 1).reshape(n, c.q_size) @ p[prefix + "self_attn.o_proj.weight"].T

    def _mlp(self, h, prefix: str):
        import torch.nn.functional as F

        c, p = self.config, self.params
        x = _rms_norm(h, p[prefix + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate = x @ p[prefix + "mlp.gate_proj.weight"].T
        up = x @ p[prefix + "mlp.up_proj.weight"].T
        return h + (F.silu(gate) * up) @ p[prefix + "mlp.down_proj.weight"].T


# The engine's norm and RoPE run as native kernels without autograd; training needs these.
def _rms_norm(x, weight, eps: float):
    # x [..., dim]: HF's LlamaRMSNorm in fp32
    return weight * (x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt())


def _rope(x, cos, sin):
    # x [L, heads, head_dim]; cos, sin [L, 1, head_dim]: x * cos + rotate_half(x) * sin
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def hf_param_names(config: ModelConfig) -> list[str]:
    names = [EMBED_KEY]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{rest}" for rest in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    return names + ["model.norm.weight"]


# ---- training ---------------------------------------------------------------------------------

def distill_loss(logq, topk_ids, topk_logprobs, next_ids, ce_mask, column_of=None):
    """Summed losses over n positions: (KL(p_tgt top-k || q_dft), CE of the target tokens).

    logq [n, vocab] draft log-probs; topk_ids [n, k]; topk_logprobs [n, k] target log-probs
    (full-vocabulary softmax: renormalized here over the top-k); next_ids [n]; ce_mask [n] bool.
    With `column_of` [vocab] (a restricted head: logq is [n, head] and column_of maps token ids
    to its columns, -1 outside) p_tgt is renormalized over the top-k tokens inside the head and
    CE skips target tokens outside it: the draft can never propose those.
    """
    import torch

    cols, next_cols = topk_ids.long(), next_ids.long()
    logits_p = topk_logprobs.float()
    if column_of is not None:
        cols, next_cols = column_of[cols], column_of[next_cols]
        logits_p = logits_p.masked_fill(cols < 0, float("-inf"))
        ce_mask = ce_mask & (next_cols >= 0)
        keep = (cols >= 0).any(1)  # rows with at least one top-k token inside the head
        cols, logits_p, logq_kl = cols[keep].clamp(min=0), logits_p[keep], logq[keep]
    else:
        logq_kl = logq
    log_p = torch.log_softmax(logits_p, dim=-1)  # [n, k]
    p = log_p.exp()
    kl = torch.where(p > 0, p * (log_p - logq_kl.gather(1, cols)), 0.0).sum()
    ce = -logq[ce_mask].gather(1, next_cols[ce_mask].unsqueeze(1)).sum()
    return kl, ce


def pack_rows(windows: list[tuple[int, int]], seq_len: int) -> list[list[tuple[int, int]]]:
    """Windows (flat [start, end) ranges, each <= seq_len tokens) packed in order into rows of
    at most seq_len tokens."""
    rows, row, used = [], [], 0
    for start, end in windows:
        if used + end - start > seq_len and row:
            rows.append(row)
            row, used = [], 0
        row.append((start, end))
        used += end - start
    return rows + ([row] if row else [])


def lr_at(base_lr: float, step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_FRACTION as progress goes 0 -> 1."""
    if step < WARMUP_STEPS:
        return base_lr * (step + 1) / WARMUP_STEPS
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return base_lr * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def _row_stream(data, seq_len: int, seed: int):
    """Rows forever: (flat indices [L], positions [L], doc ids [L]); windows reshuffled each epoch."""
    import torch

    windows = data.windows(seq_len)
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(windows), generator=gen).tolist()
        for row in pack_rows([windows[i] for i in order], seq_len):
            yield (torch.cat([torch.arange(s, e) for s, e in row]),
                   torch.cat([torch.arange(e - s) for s, e in row]),
                   torch.cat([torch.full((e - s,), d) for d, (s, e) in enumerate(row)]))


def train(draft: TrainableDraft, data, cfg: DistillConfig) -> dict:
    """AdamW on the draft's layers and final norm until --steps or the time budget; Ctrl-C
    stops early and keeps what was learned."""
    import torch
    from tqdm import tqdm

    opt = torch.optim.AdamW(draft.trainable(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    kl_mask, ce_mask = data.kl_mask(), data.next_is_output
    next_ids = torch.roll(data.token_ids, -1)  # [N]; wrong only at region ends, masked there
    rows = _row_stream(data, cfg.seq_len, cfg.seed)
    budget_s = cfg.time_budget_min * 60
    bar = tqdm(total=100, desc="distill", unit="%", file=sys.stderr, dynamic_ncols=True,
               bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}")
    t0, step, tokens, stopped, history = time.perf_counter(), 0, 0, "steps", []

    def progress() -> float:  # 0 -> 1 towards whichever limit binds first
        return max(step / cfg.steps if cfg.steps else 0.0, (time.perf_counter() - t0) / budget_s)

    try:
        while cfg.steps == 0 or step < cfg.steps:
            elapsed = time.perf_counter() - t0
            if step and elapsed * (step + 1) / step > budget_s:  # the next step would overrun
                stopped = "time budget"
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg.lr, step, progress())
            batch = [next(rows) for _ in range(cfg.batch_size)]
            kl, ce = _train_step(draft, opt, data, batch, kl_mask, ce_mask, next_ids, cfg.ce_weight)
            step += 1
            tokens += sum(int(b[0].shape[0]) for b in batch)
            history.append((kl, ce))
            bar.n = min(100, round(100 * progress()))
            bar.set_postfix_str(f"step {step} kl {kl:.3f} ce {ce:.3f}")
    except KeyboardInterrupt:
        stopped = "interrupted"
    bar.close()
    return {"steps": step, "tokens": tokens, "time_s": round(time.perf_counter() - t0, 1),
            "stopped_by": stopped, "first_kl_ce": _mean_losses(history[:10]),
            "last_kl_ce": _mean_losses(history[-10:])}


def _train_step(draft, opt, data, batch, kl_mask, ce_mask, next_ids, ce_weight) -> tuple[float, float]:
    """One optimizer step over `batch` rows (gradients accumulated row by row); returns the
    batch's mean KL and CE per position."""
    import torch

    num_kl = max(1, sum(int(kl_mask[idx].sum()) for idx, _, _ in batch))
    num_ce = max(1, sum(int(ce_mask[idx].sum()) for idx, _, _ in batch))
    kl_total = ce_total = 0.0
    for idx, positions, doc_ids in batch:
        hidden = draft.hidden(data.token_ids[idx].long(), positions, doc_ids)
        sel = idx[kl_mask[idx]]
        logq = torch.log_softmax(draft.logits(hidden[kl_mask[idx]]), dim=-1)  # [n, vocab]
        kl, ce = distill_loss(logq, data.topk_ids[sel], data.topk_logprobs[sel], next_ids[sel],
                              ce_mask[sel], draft.column_of)
        (kl / num_kl + ce_weight * ce / num_ce).backward()
        kl_total += kl.item()
        ce_total += ce.item()
    torch.nn.utils.clip_grad_norm_(draft.trainable(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return kl_total / num_kl, ce_total / num_ce


def _mean_losses(history: list[tuple[float, float]]) -> list[float] | None:
    if not history:
        return None
    return [round(sum(h[i] for h in history) / len(history), 4) for i in (0, 1)]


# ---- evaluation -------------------------------------------------------------------------------

def heldout_agreement(draft: TrainableDraft, heldout) -> list[list[bool]]:
    """Per held-out sequence, at each generated token: does the draft's argmax, given the
    target's text so far, equal the token the target produced (greedy)?"""
    import torch

    out = []
    with torch.no_grad():
        for ids, num_prompt in zip(heldout.token_ids, heldout.num_prompt):
            tokens = torch.tensor(ids)
            n = len(ids)
            hidden = draft.hidden(tokens, torch.arange(n), torch.zeros(n, dtype=torch.long))
            pred = draft.predict(hidden[num_prompt - 1:n - 1])  # predicts ids[P:]
            out.append((pred == tokens[num_prompt:]).tolist())
    return out


def simulated_acceptance(agree: list[bool], n_max: int) -> tuple[int, int]:
    """Greedy speculative decoding replayed on one target continuation: each step drafts up to
    n_max tokens; the target accepts the leading run of agreeing positions and adds one token
    of its own. Returns (num_steps, num_accepted_tokens)."""
    i = num_steps = num_accepted = 0
    while i < len(agree):
        run = 0
        while run < n_max and i + run < len(agree) and agree[i + run]:
            run += 1
        num_steps += 1
        num_accepted += run
        i += run + 1
    return num_steps, num_accepted


def agreement_summary(agree: list[list[bool]]) -> dict:
    """Greedy agreement per position, and mean acceptance length (1 + accepted / steps) of
    simulated greedy speculation at each of ACCEPT_N_MAX."""
    positions = sum(len(a) for a in agree)
    summary = {"positions": positions,
               "agreement": round(sum(map(sum, agree)) / positions, 4) if positions else None}
    for n_max in ACCEPT_N_MAX:
        runs = [simulated_acceptance(a, n_max) for a in agree]
        steps = sum(r[0] for r in runs)
        summary[f"mean_accepted_length_n{n_max}"] = \
            round(1 + sum(r[1] for r in runs) / steps, 3) if steps else None
    return summary


# ---- export -----------------------------------------------------------------------------------

def write_generated_vocab(out: str, data, vocab_size: int) -> str:
    """draft_vocab.json: the tokens the target generated in the training data, most frequent
    first (what `--spec-option draft.lm_head_tokens=N` restricts the draft's LM head to)."""
    import torch

    from speculant.speculators.draft_vocab import write_draft_vocab

    generated = torch.roll(data.token_ids, -1)[data.next_is_output]  # [num generated]
    return write_draft_vocab(out, generated, vocab_size, "target tokens generated in distill data")


def save_draft(draft: TrainableDraft, out: str, target_model: str) -> dict:
    """Write the HF folder: config.json, the two fp16 shards and their index, tokenizer files."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in draft.params.items()}
    embed = {EMBED_KEY: tensors.pop(EMBED_KEY)}
    save_file(tensors, os.path.join(out, LAYERS_SHARD), metadata={"format": "pt"})
    save_file(embed, os.path.join(out, EMBED_SHARD), metadata={"format": "pt"})
    _write_index(out, tensors, embed)
    tokenizer = _copy_tokenizer(target_model, out)
    config = hf_config(draft.config, tokenizer)
    if draft.head_ids is not None:  # trained for a restricted head: the draft runs with it
        config[HEAD_TOKENS_KEY] = len(draft.head_ids)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return {name: round(os.path.getsize(os.path.join(out, name)) / 1e6, 1)
            for name in (LAYERS_SHARD, EMBED_SHARD)}


def restore_embeddings(out: str, target_model: str) -> None:
    """Rewrite `out`'s embedding shard (fp16 of the target's, as training froze it) and
    tokenizer files: a shipped draft carries only its trained shard."""
    import torch
    from safetensors.torch import save_file

    from speculant.models.loader import load_model

    try:
        with open(os.path.join(out, "config.json")) as f:
            hf = json.load(f)
    except OSError as exc:
        raise FileNotFoundError(f"distill: {out!r} has no config.json of a draft") from exc
    target = load_model(target_model)
    c = target.config
    if (hf.get("hidden_size"), hf.get("vocab_size")) != (c.hidden_size, c.vocab_size):
        raise ValueError(f"distill: draft {out!r} (hidden {hf.get('hidden_size')}, vocab "
                         f"{hf.get('vocab_size')}) does not match the target (hidden "
                         f"{c.hidden_size}, vocab {c.vocab_size})")
    embed = target.weights["token_embd.weight"].dequantize().to(torch.float16)
    save_file({EMBED_KEY: embed}, os.path.join(out, EMBED_SHARD), metadata={"format": "pt"})
    _copy_tokenizer(target_model, out)


def _write_index(out: str, *shards: dict) -> None:
    names = (LAYERS_SHARD, EMBED_SHARD)
    weight_map = {key: name for name, tensors in zip(names, shards) for key in tensors}
    total = sum(t.numel() * t.element_size() for tensors in shards for t in tensors.values())
    with open(os.path.join(out, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


def _copy_tokenizer(target_model: str, out: str):
    """Copy the target's tokenizer files (converted from its GGUF if need be) into `out`."""
    from speculant.models.loader import resolve_model
    from speculant.models.tokenizer import Tokenizer, _gguf_tokenizer_files, _hf_folder_files

    files = resolve_model(target_model)
    tok_files = _hf_folder_files(files.path) if files.kind == "hf" else _gguf_tokenizer_files(files.path)
    src = os.path.dirname(tok_files.tokenizer_json)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(out, name))
    return Tokenizer(tok_files)


def hf_config(c: ModelConfig, tokenizer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta, "rms_norm_eps": float(f"{c.rms_norm_eps:.6g}"),
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "torch_dtype": "float16",
    }


# ---- recipe -----------------------------------------------------------------------------------

def recipe_command(cfg: DistillConfig) -> str:
    """The command line that reproduces this run."""
    parts = ["speculant distill"]
    defaults = DistillConfig(out=cfg.out, restore_embeddings=True)  # (skips the prompts check)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "out" or (value != getattr(defaults, f.name) and f.name != "restore_embeddings"):
            shown = ",".join(value) if isinstance(value, list) else value
            parts.append(f"--{f.name.replace('_', '-')} {shown}")
    return " ".join(parts)


def _recipe(cfg, layer_ids, data_info, train_info, agree_init, agree, files) -> dict:
    held = agreement_summary(agree)
    return {
        "command": recipe_command(cfg),
        "config": dataclasses.asdict(cfg),
        "draft": {"layers": cfg.layers, "init_from_target_layers": layer_ids,
                  "files_mb": files, "trained": "layers and final norm (embedding frozen)"},
        "data": data_info,
        "train": train_info,
        "heldout": dict(held, categories=data_info.get("heldout_categories"),
                        prompts=data_info.get("heldout_prompts"),
                        agreement_init=agreement_summary(agree_init)["agreement"]),
        "use": f"--spec-type draft --draft-model {cfg.out} --spec-option draft.dtype=q8_0",
        "lm_head_tokens": cfg.train_vocab or None,
    }


def _print_recipe(r: dict) -> None:
    d, t, h = r["data"], r["train"], r["heldout"]
    cached = " (cached)" if d.get("cached") else f" in {d.get('generation_time_s')} s"
    print(f"recipe: {r['command']}")
    print(f"draft: {r['draft']['layers']} layers from target layers "
          f"{r['draft']['init_from_target_layers']}; files (MB) {r['draft']['files_mb']}")
    print(f"data{cached}: {d['train_prompts']} prompts of {','.join(d['train_categories'])} -> "
          f"{d['train_sequences']} sequences, {d['train_tokens']} tokens "
          f"({d['train_generated_tokens']} generated by the target)")
    print(f"train: {t['steps']} steps, {t['tokens']} tokens, {t['time_s']} s, stopped by "
          f"{t['stopped_by']}; kl, ce first {t['first_kl_ce']} -> last {t['last_kl_ce']}")
    if h["positions"]:
        accept = ", ".join(f"n_max={n}: {h[f'mean_accepted_length_n{n}']}" for n in ACCEPT_N_MAX)
        print(f"held-out ({','.join(h['categories'])}, {h['prompts']} prompts, {h['positions']} "
              f"positions): greedy agreement {h['agreement_init']} at init -> {h['agreement']}; "
              f"simulated mean accepted length {accept}")
    else:
        print("held-out: no prompts of the excluded categories in --prompts; not measured")
    print(f"use: speculant generate ... {r['use']}")
    print(json.dumps(r), flush=True)
