"""A DeepSeek-style multi-token-prediction (MTP) module for a Llama-family target.

DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2: module k reads the target's last
hidden state h_p (the residual stream before the final norm) and the embedding of the token at
p + 1, and predicts the token at p + 2:

    x     = eh_proj(concat(enorm(embed(x_{p+1})), hnorm(h_p)))       # [T, d]
    h_out = decoder_block(x)                                          # one target-shaped layer
    logits = lm_head(shared_head_norm(h_out))                         # the target's LM head

Drafting further, h_out replaces h_p (the module feeds itself). The LM head is the target's,
either whole or restricted to the `draft_vocab_size` tokens the target writes most (rows
copied from the target; `d2t` maps a column to its target id as EAGLE-3 heads do).

The per-step API is the one `speculators/feature_drafter.py` drives (shared with EAGLE-3):
`capture_layers`, `embed`, `fuse`, `project_qkv`, `apply_rope`, `finish`, `draft_logits`, `d2t`.

Checkpoints: a folder (config.json + model.safetensors) with canonical names `mtp.*`
(Qwen3-Next's layout, which our trainer writes), DeepSeek's `model.layers.{L}.{enorm,hnorm,
eh_proj,shared_head.norm}` + the block's HF names, or a GGUF whose layer L has `nextn.*`
tensors (llama.cpp's naming). L is the index just after the target's last layer.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speculant.kernels.rope import apply_rope, rope_cos_sin
from speculant.models.config import ModelConfig
from speculant.models.eagle3_head import _Norm
from speculant.models.loader import HF_LAYER_NAMES

ARCHITECTURE = "SpeculantMTPHead"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# canonical (Qwen3-Next) name -> the module's parameter name
CANONICAL = {
    "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
    "mtp.fc.weight": "eh_proj.weight",
    "mtp.layers.0.input_layernorm.weight": "attn_norm.weight",
    "mtp.layers.0.self_attn.q_proj.weight": "q_proj.weight",
    "mtp.layers.0.self_attn.k_proj.weight": "k_proj.weight",
    "mtp.layers.0.self_attn.v_proj.weight": "v_proj.weight",
    "mtp.layers.0.self_attn.o_proj.weight": "o_proj.weight",
    "mtp.layers.0.post_attention_layernorm.weight": "ffn_norm.weight",
    "mtp.layers.0.mlp.gate_proj.weight": "gate_proj.weight",
    "mtp.layers.0.mlp.up_proj.weight": "up_proj.weight",
    "mtp.layers.0.mlp.down_proj.weight": "down_proj.weight",
    "mtp.norm.weight": "shared_head_norm.weight",
}
# DeepSeek's module-specific names (under model.layers.{L}.) and llama.cpp's (under blk.{L}.)
DEEPSEEK = {"enorm.weight": "mtp.pre_fc_norm_embedding.weight",
            "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
            "eh_proj.weight": "mtp.fc.weight", "shared_head.norm.weight": "mtp.norm.weight"}
GGUF_NEXTN = {"nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
              "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
              "nextn.eh_proj.weight": "mtp.fc.weight",
              "nextn.shared_head_norm.weight": "mtp.norm.weight"}
GGUF_BLOCK = {gguf: f"mtp.layers.0.{hf}" for hf, gguf in HF_LAYER_NAMES.items()}


@dataclass(slots=True)
class MtpConfig:
    """The module's hyper-parameters (a target-shaped layer) and its draft vocabulary."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int  # == vocab_size: the target's whole LM head
    target_num_layers: int

    @classmethod
    def for_target(cls, t: ModelConfig, draft_vocab_size: int | None = None) -> "MtpConfig":
        return cls(t.hidden_size, t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size,
                   t.rms_norm_eps, t.rope_theta, t.max_position_embeddings, t.vocab_size,
                   draft_vocab_size or t.vocab_size, t.num_layers)

    def to_hf(self) -> dict:
        return {"architectures": [ARCHITECTURE], "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "target_num_layers": self.target_num_layers, "num_nextn_predict_layers": 1}

    def check_fits(self, t: ModelConfig) -> None:
        """ValueError naming the first way this module does not fit target `t`."""
        for name, mine, theirs in (("hidden_size", self.hidden_size, t.hidden_size),
                                   ("vocab_size", self.vocab_size, t.vocab_size),
                                   ("target_num_layers", self.target_num_layers, t.num_layers)):
            if mine != theirs:
                raise ValueError(f"mtp head: {name} {mine} does not match the target's {theirs}")


class MtpHead(nn.Module):
    """Parameters: enorm, hnorm [d]; eh_proj [d, 2d]; the block's attn_norm [d], q/k/v/o
    projections, ffn_norm [d], gate/up [I, d], down [d, I]; shared_head_norm [d]; lm_head
    [draft_vocab, d] (rows of the target's, frozen; None = the target's whole head);
    buffer d2t [draft_vocab]."""

    def __init__(self, config: MtpConfig, target_lm_head=None):
        super().__init__()
        c = self.config = config
        d = c.hidden_size
        self.enorm, self.hnorm = _Norm(d, c.rms_norm_eps), _Norm(d, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.attn_norm, self.ffn_norm = _Norm(d, c.rms_norm_eps), _Norm(d, c.rms_norm_eps)
        self.q_proj = nn.Linear(d, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(d, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(d, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, d, bias=False)
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        self.shared_head_norm = _Norm(d, c.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.lm_head_rows: torch.Tensor | None = None  # [draft_vocab, d] when restricted
        self._target_lm_head = target_lm_head  # callable [R, d] -> [R, vocab]
        self._target_embed = None
        cos, sin = rope_cos_sin(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_positions, hd]
        self.register_buffer("rope_sin", sin, persistent=False)

    # ---- construction and IO ------------------------------------------------------------------

    @classmethod
    def random(cls, target: ModelConfig, seed: int = 0) -> "MtpHead":
        """Randomly initialised (N(0, 0.02), unit norms), scoring the whole vocabulary."""
        head = cls(MtpConfig.for_target(target))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                p.copy_(torch.ones_like(p) if name.endswith("norm.weight")
                        else torch.randn(p.shape, generator=gen) * 0.02)
        return head

    @classmethod
    def load(cls, path: str, target: ModelConfig, embedding=None, lm_head=None) -> "MtpHead":
        """An MTP module from a head folder, an HF checkpoint folder carrying MTP layers, or
        a GGUF with `nextn` tensors; checked against the target (ValueError names the first
        mismatch). `embedding` / `lm_head`: the target's (object with .embed(ids) / a
        callable with .select_rows(ids)), used unless the checkpoint restricts the head."""
        tensors, hf = _read_checkpoint(path, target)
        config = MtpConfig.for_target(target, int(hf.get("draft_vocab_size") or target.vocab_size))
        for key in ("hidden_size", "vocab_size", "target_num_layers"):
            if key in hf:
                setattr(config, key, int(hf[key]))
        config.check_fits(target)
        head = cls(config, lm_head)
        head._load_tensors(tensors, path)
        head._target_embed = embedding
        return head.eval()

    def _load_tensors(self, tensors: dict, path: str) -> None:
        params = dict(self.named_parameters())
        missing = sorted(k for k, name in CANONICAL.items() if k not in tensors)
        if missing:
            raise ValueError(f"mtp head {path}: missing tensors {missing}")
        with torch.no_grad():
            for key, name in CANONICAL.items():
                t = tensors[key].float()
                if tuple(t.shape) != tuple(params[name].shape):
                    raise ValueError(f"mtp head {path}: {key} has shape {list(t.shape)}, "
                                     f"expected {list(params[name].shape)}")
                params[name].copy_(t)
            if "d2t" in tensors:
                self.d2t.copy_(tensors["d2t"])
            if "lm_head.weight" in tensors:
                self.lm_head_rows = tensors["lm_head.weight"].float()

    def save(self, path: str, dtype: torch.dtype = torch.float16) -> int:
        """Write config.json and model.safetensors in the canonical `mtp.*` layout; a
        restricted LM head is stored (its rows and d2t), the whole one is the target's."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        params = dict(self.named_parameters())
        tensors = {key: params[name].detach().to(dtype).contiguous() for key, name in CANONICAL.items()}
        if self.lm_head_rows is not None:
            tensors["lm_head.weight"] = self.lm_head_rows.to(dtype).contiguous()
            tensors["d2t"] = self.d2t.clone()
        file = os.path.join(path, WEIGHTS_FILE)
        save_file(tensors, file, metadata={"format": "pt"})
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(self.config.to_hf(), f, indent=1)
        return os.path.getsize(file)

    def restrict_vocab(self, target_ids: torch.Tensor, target_lm_rows: torch.Tensor) -> None:
        """Score only `target_ids` (ascending) with these rows of the target's LM head."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64)
        self.config.draft_vocab_size = len(ids)
        self.d2t = ids - torch.arange(len(ids))
        self.lm_head_rows = target_lm_rows.float()

    def use_target(self, embedding, lm_head) -> None:
        """The target's embedding (object with .embed(ids)) and LM head (callable)."""
        self._target_embed, self._target_lm_head = embedding, lm_head

    # ---- the per-step maths --------------------------------------------------------------------

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.config.target_num_layers - 1,)  # the last layer's output, pre final norm

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._target_embed is None:
            raise RuntimeError("mtp head: no embedding; call use_target(...)")
        return self._target_embed.embed(token_ids)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        # features [T, d]: the target's last hidden state; MTP fuses it with the embedding
        # inside project_qkv (eh_proj), so nothing happens here
        return features

    def project_qkv(self, embeds: torch.Tensor, hidden: torch.Tensor):
        # embeds [T, d]; hidden [T, d] (target h_p or the module's previous h_out)
        """-> q [T, H, hd], k [T, KV, hd], v [T, KV, hd] (not rotated), residual x [T, d]."""
        c = self.config
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        a = self.attn_norm(x)
        n = x.shape[0]
        return (self.q_proj(a).view(n, c.num_heads, c.head_dim),
                self.k_proj(a).view(n, c.num_kv_heads, c.head_dim),
                self.v_proj(a).view(n, c.num_kv_heads, c.head_dim), x)

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, heads, hd]; positions [T] -> [T, heads, hd]
        return apply_rope(x, self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # attn [T, H * hd]; residual [T, d] -> h_out [T, d] (before the shared head norm)
        r = residual + self.o_proj(attn)
        x = self.ffn_norm(r)
        return r + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def draft_logits(self, h_out: torch.Tensor) -> torch.Tensor:
        # h_out [T, d] -> [T, draft_vocab]
        x = self.shared_head_norm(h_out)
        if self.lm_head_rows is not None:
            return x @ self.lm_head_rows.t()
        if self._target_lm_head is None:
            raise RuntimeError("mtp head: no LM head; call use_target(...)")
        return self._target_lm_head(x.contiguous())

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def _read_checkpoint(path: str, target: ModelConfig) -> tuple[dict, dict]:
    """Canonical tensors {mtp.* name: tensor} and the config dict of any supported layout."""
    if path.endswith(".gguf"):
        return _read_gguf_nextn(path, target), {}
    config_file = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_file) as f:
            hf = json.load(f)
    except OSError as exc:
        raise FileNotFoundError(f"mtp head: cannot read {config_file}: {exc.strerror}") from exc
    from safetensors.torch import load_file

    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    raw = {}
    for name in files:
        raw.update(load_file(os.path.join(path, name)))
    return _canonical(raw, target.num_layers), hf


def _canonical(raw: dict, num_layers: int) -> dict:
    """Rename DeepSeek-style `model.layers.{L}.*` MTP tensors to the canonical `mtp.*`."""
    prefix = f"model.layers.{num_layers}."
    out = {k: v for k, v in raw.items() if k.startswith("mtp.") or k in ("lm_head.weight", "d2t")}
    for key, t in raw.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        if rest in DEEPSEEK:
            out[DEEPSEEK[rest]] = t
        elif rest in HF_LAYER_NAMES:
            out[f"mtp.layers.0.{rest}"] = t
    return out


def _read_gguf_nextn(path: str, target: ModelConfig) -> dict:
    """llama.cpp's `blk.{L}.nextn.*` and the block's `blk.{L}.*` tensors, dequantized."""
    from speculant.models.loader import _gguf_weight, read_gguf_cached

    _, tensors = read_gguf_cached(path)
    prefix = f"blk.{target.num_layers}."
    out = {}
    for t in tensors:
        if not t.name.startswith(prefix):
            continue
        rest = t.name[len(prefix):]
        name = GGUF_NEXTN.get(rest) or GGUF_BLOCK.get(rest)
        if name is not None:
            w = _gguf_weight(t, target, "float32")
            out[name] = w if isinstance(w, torch.Tensor) else w.dequantize()
    if not out:
        raise ValueError(f"mtp head: {path} has no nextn tensors for layer {target.num_layers}")
    return out
