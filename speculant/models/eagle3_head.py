"""The EAGLE-3 draft head: one Llama decoder layer that reads the target's own hidden states.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") drafts from features of the target rather than from tokens alone:

    fused   = fc(concat(h_a, h_b, h_c))          # [T, d]: target features of three layers
    x       = concat(input_layernorm(embed(token)), hidden_norm(fused))   # [T, 2d]
    q, k, v = q_proj(x), k_proj(x), v_proj(x)    # attention reads 2d, writes d
    r       = fused + o_proj(attention(q, k, v)) # the residual carries the fused hidden
    h_out   = r + mlp(post_attention_layernorm(r))
    logits  = lm_head(norm(h_out))               # over the draft vocabulary only

A draft chain feeds h_out back as the next step's `fused` (no fc then). A head of N > 1 layers
(`num_hidden_layers`) runs N - 1 plain Llama decoder layers on h_out before the final norm
(`layers.1.*` ... in the checkpoint, the convention that calls the first layer `layers.0`, our
`midlayer`); the last layer's output is what it feeds back. The draft vocabulary is
the `draft_vocab_size` tokens the target generates most: `d2t[i]` maps draft id i to target id
`i + d2t[i]`, `t2d` [vocab] marks the target ids it contains.

Checkpoints use the published layout that vLLM, SGLang, SpecForge and the EAGLE repository read
(safetensors keys `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`, and a
config.json with `architectures: ["LlamaForCausalLMEagle3"]`), so a head trained elsewhere for a
Llama-family target loads here and ours loads there.

Layer ids: the published `eagle_aux_hidden_state_layer_ids` name the target layers whose INPUT is
captured (default 2, L/2, L-3); speculant's engine captures the residual stream AFTER a layer, so
the head asks the engine for layer id - 1 (`capture_layers`).
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

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EMBED_KEY = "embed_tokens.weight"
INIT_STD = 0.02  # Llama's initializer_range
MAX_LAYERS = 8  # decoder layers a head may stack (a drafter deeper than that is a draft model)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default: the inputs of target layers 2, L//2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)


def aux_to_capture_layers(aux_layer_ids) -> tuple[int, ...]:
    """Published ids (input of layer i) -> speculant capture ids (output of layer i - 1)."""
    if any(i < 1 for i in aux_layer_ids):
        raise ValueError(f"eagle3 head: aux layer ids {list(aux_layer_ids)} include the "
                         f"embedding (id 0), which the engine does not capture")
    return tuple(i - 1 for i in aux_layer_ids)


def capture_to_aux_layers(capture_layers) -> tuple[int, ...]:
    """speculant capture ids (output of layer i) -> published ids (input of layer i + 1)."""
    return tuple(i + 1 for i in capture_layers)


@dataclass(slots=True)
class Eagle3Config:
    """A head's hyper-parameters: the fields of its config.json."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # published convention: the input of these target layers
    num_layers: int = 1  # decoder layers: the midlayer, then num_layers - 1 plain ones

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if not 1 <= self.num_layers <= MAX_LAYERS:
            raise ValueError(f"eagle3 config: num_hidden_layers must be in [1, {MAX_LAYERS}], "
                             f"got {self.num_layers}")
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)) or not self.aux_layer_ids:
            raise ValueError(f"eagle3 config: aux layer ids must be ascending and distinct, "
                             f"got {list(self.aux_layer_ids)}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"eagle3 config: draft_vocab_size {self.draft_vocab_size} not in "
                             f"[1, vocab_size {self.vocab_size}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"eagle3 config: num_heads {self.num_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, aux_layer_ids=None,
                   intermediate_size: int | None = None, num_layers: int = 1) -> "Eagle3Config":
        """A head shaped like one layer of `target` (EAGLE-3 copies the target's widths); a
        wider MLP (`intermediate_size`) keeps the published layout, so vLLM/SGLang load it;
        `num_layers` > 1 stacks plain decoder layers after the first."""
        return cls(
            hidden_size=target.hidden_size, num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            intermediate_size=intermediate_size or target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            aux_layer_ids=aux_layer_ids or default_aux_layer_ids(target.num_layers),
            num_layers=num_layers)

    @property
    def num_features(self) -> int:
        return len(self.aux_layer_ids)

    def to_hf(self) -> dict:
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": float(f"{self.rms_norm_eps:.6g}"), "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "num_hidden_layers": self.num_layers, "target_hidden_size": self.target_hidden_size,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
        }

    @classmethod
    def from_hf(cls, hf: dict, target: ModelConfig) -> "Eagle3Config":
        """Read a published config.json; missing aux ids take EAGLE-3's default for `target`."""
        arch = (hf.get("architectures") or ["?"])[0]
        if "eagle3" not in arch.lower():
            raise ValueError(f"eagle3 head: config.json architecture {arch!r} is not an "
                             f"EAGLE-3 head (expected {ARCHITECTURE})")
        num_layers = int(hf.get("num_hidden_layers", 1))
        if not 1 <= num_layers <= MAX_LAYERS:
            raise ValueError(f"eagle3 head: config.json has {num_layers} decoder layers "
                             f"(num_hidden_layers); supported: 1 to {MAX_LAYERS}")
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", target.rope_theta)),
            max_position_embeddings=int(hf.get("max_position_embeddings",
                                               target.max_position_embeddings)),
            vocab_size=int(hf["vocab_size"]),
            draft_vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]),
            target_hidden_size=int(hf.get("target_hidden_size") or hidden),
            aux_layer_ids=aux or default_aux_layer_ids(target.num_layers),
            num_layers=num_layers)

    def check_fits(self, target: ModelConfig) -> None:
        """ValueError naming the first way this head does not fit `target`."""
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"eagle3 head: target_hidden_size {self.target_hidden_size} does "
                             f"not match the target's hidden size {target.hidden_size}")
        if self.hidden_size != target.hidden_size:
            raise ValueError(f"eagle3 head: hidden_size {self.hidden_size} does not match the "
                             f"target's hidden size {target.hidden_size} (the head reads the "
                             f"target's embedding)")
        # id L (the last layer's output, before the final norm) is speculant's own extension:
        # vLLM and SGLang capture layer inputs only, so such a head runs here and not there
        if self.aux_layer_ids[0] < 1 or self.aux_layer_ids[-1] > target.num_layers:
            raise ValueError(f"eagle3 head: aux layer ids {list(self.aux_layer_ids)} do not fit "
                             f"a target of {target.num_layers} layers (valid: 1..."
                             f"{target.num_layers})")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"eagle3 head: vocab_size {self.vocab_size} does not match the "
                             f"target's vocabulary size {target.vocab_size}")


class Eagle3Head(nn.Module):
    """The head's weights and its pure per-step maths; the caller owns the attention (a paged
    KV cache at inference, `ttt_attention` in training).

    Parameters (published names): fc [d, n_feat * d]; midlayer norms [d] (input_layernorm
    on the embedding, hidden_norm on the hidden); q_proj [H * hd, 2d], k_proj / v_proj
    [KV * hd, 2d], o_proj [d, H * hd]; MLP gate/up [I, d], down [d, I]; norm [d];
    lm_head [draft_vocab, d]; with more layers, layers.i.* (i >= 1) as a Llama decoder layer
    (q/k/v read d). Buffers: d2t [draft_vocab] int64, t2d [vocab] bool. The token embedding
    [vocab, d] is the target's (`use_target_embedding`) unless the checkpoint has one.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        d, two_d = c.hidden_size, 2 * c.hidden_size
        self.fc = nn.Linear(c.num_features * c.target_hidden_size, d, bias=False)
        self.midlayer = _decoder_layer(c, two_d, hidden_norm=True)
        # layers.1 ... : nn.ModuleDict keyed "1".. so the checkpoint names read layers.i.*
        self.layers = nn.ModuleDict({str(i): _decoder_layer(c, d) for i in range(1, c.num_layers)})
        self.norm = _Norm(d, c.rms_norm_eps)
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # only when the checkpoint carries one
        self._target_embed = None  # [vocab, d] tensor or an object with .embed(ids)
        cos, sin = rope_cos_sin(c.head_dim, c.rope_theta, c.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_positions, hd]
        self.register_buffer("rope_sin", sin, persistent=False)

    # ---- construction and IO ------------------------------------------------------------------

    @classmethod
    def random(cls, target_config: ModelConfig, draft_vocab_ids, seed: int = 0,
               aux_layer_ids=None, intermediate_size: int | None = None,
               num_layers: int = 1) -> "Eagle3Head":
        """A randomly initialised head (Llama's N(0, 0.02), unit norms) whose draft vocabulary
        is `draft_vocab_ids` (target ids; sorted here, as published heads keep them); its MLP
        is the target's width unless `intermediate_size` says otherwise; `num_layers` decoder
        layers."""
        ids = torch.as_tensor(draft_vocab_ids, dtype=torch.int64).unique()  # sorted
        head = cls(Eagle3Config.for_target(target_config, len(ids), aux_layer_ids,
                                           intermediate_size, num_layers))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * INIT_STD)
        head.set_draft_vocab(ids)
        return head

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """target_ids [draft_vocab] ascending -> d2t offsets and the t2d mask."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64)
        if ids.shape != self.d2t.shape or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"eagle3 head: draft vocabulary must be {self.d2t.shape[0]} "
                             f"ascending distinct target ids")
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    @classmethod
    def load(cls, path: str, target_config: ModelConfig, embedding=None) -> "Eagle3Head":
        """A head folder (config.json + model.safetensors, published layout) checked against
        the target; ValueError names the first mismatch. `embedding`: the target's token
        embedding (tensor [vocab, d] or an object with `.embed(ids)`), used unless the
        checkpoint carries its own."""
        from safetensors.torch import load_file

        try:
            with open(os.path.join(path, CONFIG_FILE)) as f:
                hf = json.load(f)
        except OSError as exc:
            raise FileNotFoundError(f"eagle3 head: cannot read {path}/{CONFIG_FILE}: "
                                    f"{exc.strerror}") from exc
        config = Eagle3Config.from_hf(hf, target_config)
        config.check_fits(target_config)
        tensors = load_file(_weights_file(path))
        head = cls(config)
        head._load_tensors(tensors, path)
        if embedding is not None:
            head.use_target_embedding(embedding)
        return head.eval()

    def _load_tensors(self, tensors: dict, path: str) -> None:
        expected = dict(self.state_dict())
        embed = tensors.pop(EMBED_KEY, None)
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise ValueError(f"eagle3 head {path}: missing tensors {missing}")
        for key, want in expected.items():
            if tuple(tensors[key].shape) != tuple(want.shape):
                raise ValueError(f"eagle3 head {path}: {key} has shape "
                                 f"{list(tensors[key].shape)}, expected {list(want.shape)}")
        self.load_state_dict({k: tensors[k].to(v.dtype) for k, v in expected.items()})
        if embed is not None:
            self.embed_tokens = nn.Embedding.from_pretrained(embed.float(), freeze=True)

    def save(self, path: str, dtype: torch.dtype = torch.float16) -> int:
        """Write config.json and model.safetensors (float weights in `dtype`, d2t int64, t2d
        bool); the target's embedding is not stored. Returns the weights file's size in bytes."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
                   for k, v in self.state_dict().items()}
        if self.embed_tokens is not None:
            tensors[EMBED_KEY] = self.embed_tokens.weight.detach().to(dtype).contiguous()
        file = os.path.join(path, WEIGHTS_FILE)
        save_file(tensors, file, metadata={"format": "pt"})
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(self.config.to_hf(), f, indent=1)
        return os.path.getsize(file)

    def use_target_embedding(self, embedding) -> None:
        """The target's token embedding: a [vocab, d] tensor (dequantized; frozen) or an object
        with `.embed(ids)` (a packed GGUF embedding)."""
        if isinstance(embedding, torch.Tensor):
            embedding = embedding.detach().float()
        self._target_embed = embedding

    # ---- the per-step maths --------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers whose output the engine captures, ascending, in the order fc reads."""
        return aux_to_capture_layers(self.config.aux_layer_ids)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] target ids -> [T, d] embeddings."""
        if self.embed_tokens is not None:
            return self.embed_tokens(token_ids)
        if self._target_embed is None:
            raise RuntimeError("eagle3 head: no embedding; call use_target_embedding(target's)")
        if isinstance(self._target_embed, torch.Tensor):
            return F.embedding(token_ids, self._target_embed)
        return self._target_embed.embed(token_ids)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        # features [T, n_feat * d_tgt], the captured layers concatenated in capture_layers order
        return self.fc(features)  # [T, d]

    def project_qkv(self, embeds: torch.Tensor, hidden: torch.Tensor):
        # embeds [T, d] token embeddings; hidden [T, d] fused target feature or previous h_out
        """-> q [T, H, hd], k [T, KV, hd], v [T, KV, hd] (not rotated), residual [T, d]."""
        c, m = self.config, self.midlayer
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)  # [T, 2d]
        a = m.self_attn
        num_tokens = x.shape[0]
        q = a.q_proj(x).view(num_tokens, c.num_heads, c.head_dim)
        k = a.k_proj(x).view(num_tokens, c.num_kv_heads, c.head_dim)
        v = a.v_proj(x).view(num_tokens, c.num_kv_heads, c.head_dim)
        return q, k, v, hidden  # the residual carries the hidden, not the embedding

    def project_qkv_at(self, layer: int, embeds: torch.Tensor, hidden: torch.Tensor):
        # embeds [T, d] (read by layer 0 only); hidden [T, d] what the layer reads
        """Layer `layer`'s q, k, v and residual: layer 0 is `project_qkv`, a further layer reads
        the output of the one before (a Llama decoder layer's input norm, residual = hidden)."""
        if layer == 0:
            return self.project_qkv(embeds, hidden)
        c, m = self.config, self.layers[str(layer)]
        x = m.input_layernorm(hidden)  # [T, d]
        a = m.self_attn
        num_tokens = x.shape[0]
        q = a.q_proj(x).view(num_tokens, c.num_heads, c.head_dim)
        k = a.k_proj(x).view(num_tokens, c.num_kv_heads, c.head_dim)
        v = a.v_proj(x).view(num_tokens, c.num_kv_heads, c.head_dim)
        return q, k, v, hidden

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, heads, hd]; positions [T] -> [T, heads, hd], HF rotate_half (kernels.rope)
        cos = self.rope_cos[positions].unsqueeze(1)  # [T, 1, hd]
        sin = self.rope_sin[positions].unsqueeze(1)
        return apply_rope(x, cos, sin)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # attn [T, H * hd] attention output; residual [T, d] -> h_out [T, d] (pre final norm)
        return self.finish_at(0, attn, residual)

    def finish_at(self, layer: int, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # attn [T, H * hd]; residual [T, d] -> layer `layer`'s output [T, d]
        m = self.midlayer if layer == 0 else self.layers[str(layer)]
        r = residual + m.self_attn.o_proj(attn)
        x = m.post_attention_layernorm(r)
        return r + m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))

    def packed_layer(self):
        """The decoder layer on the target's fused native kernels (`eagle3_layer.py`) once
        the linears are packed and the kernels run; None otherwise."""
        from speculant.kernels import native_available
        from speculant.models.eagle3_layer import PackedEagle3Layer

        if self.rope_cos.device.type != "cpu" or not native_available():
            return None
        return PackedEagle3Layer.of(self)

    def draft_logits(self, h_out: torch.Tensor) -> torch.Tensor:
        # h_out [T, d] -> [T, draft_vocab]
        return self.lm_head(self.norm(h_out))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (same shape)."""
        return draft_ids + self.d2t[draft_ids]

    def extra_repr(self) -> str:
        c = self.config
        return (f"aux_layer_ids={list(c.aux_layer_ids)}, draft_vocab={c.draft_vocab_size}, "
                f"hidden={c.hidden_size}")


class _Norm(nn.Module):
    """Llama RMSNorm in fp32 (the published parameter is `.weight`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _decoder_layer(c: Eagle3Config, in_dim: int, hidden_norm: bool = False) -> nn.Module:
    """A Llama decoder layer's parameters (published names) whose q/k/v read `in_dim`; the
    midlayer's `hidden_norm` too (registered in the published order: a head's parameters, and
    so a seed's random init and an optimizer checkpoint, keep their order)."""
    d = c.hidden_size
    m = nn.Module()
    m.input_layernorm = _Norm(d, c.rms_norm_eps)
    if hidden_norm:
        m.hidden_norm = _Norm(d, c.rms_norm_eps)
    m.post_attention_layernorm = _Norm(d, c.rms_norm_eps)
    m.self_attn = nn.Module()
    m.self_attn.q_proj = nn.Linear(in_dim, c.num_heads * c.head_dim, bias=False)
    m.self_attn.k_proj = nn.Linear(in_dim, c.num_kv_heads * c.head_dim, bias=False)
    m.self_attn.v_proj = nn.Linear(in_dim, c.num_kv_heads * c.head_dim, bias=False)
    m.self_attn.o_proj = nn.Linear(c.num_heads * c.head_dim, d, bias=False)
    m.mlp = nn.Module()
    m.mlp.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
    m.mlp.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
    m.mlp.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
    return m


def run_layers(head, embeds: torch.Tensor, hidden: torch.Tensor, attend) -> torch.Tensor:
    # embeds [T, d] token embeddings; hidden [T, d] fused feature or previous output
    """A head's decoder layers over T rows -> h_out [T, d] (before the final norm).
    `attend(layer, q, k, v)` -> [T, H * hd] is the caller's attention for that layer (its own
    keys: a paged cache's layer at inference, the unrolled steps' in training; q and k not
    rotated yet). Heads without `num_layers` (MTP) have one."""
    if getattr(head, "num_layers", 1) == 1:
        q, k, v, residual = head.project_qkv(embeds, hidden)
        return head.finish(attend(0, q, k, v), residual)
    for layer in range(head.num_layers):
        q, k, v, residual = head.project_qkv_at(layer, embeds, hidden)
        hidden = head.finish_at(layer, attend(layer, q, k, v), residual)
    return hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [..., d] -> [..., d]; HF LlamaRMSNorm: normalise in fp32, then scale
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _weights_file(path: str) -> str:
    """model.safetensors, or the single .safetensors file of a published head folder."""
    file = os.path.join(path, WEIGHTS_FILE)
    if os.path.exists(file):
        return file
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if len(found) != 1:
        raise FileNotFoundError(f"eagle3 head: {path} has no {WEIGHTS_FILE} "
                                f"(found {found or 'no .safetensors files'})")
    return os.path.join(path, found[0])
