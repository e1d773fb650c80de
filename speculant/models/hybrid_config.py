"""Hyper-parameters of a hybrid model (recurrent layers beside attention), read from config.json.

Two families: LFM2 (`Lfm2ForCausalLM`: gated short-convolution layers + GQA attention) and the
gated-DeltaNet hybrid of Qwen3-Next (`Qwen3NextForCausalLM`: linear-attention layers with a
causal conv window and a recurrent state, plus gated full attention, dense or MoE MLPs). What
each layer keeps between forwards is its *kind*:

    "attention"  K/V rows in the paged KV cache (rolled back by length, as for Llama)
    "conv"       LFM2 short convolution: the last `conv_kernel - 1` inputs (conv window)
    "deltanet"   gated DeltaNet: conv window + recurrent state [v_heads, k_head_dim, v_head_dim]

Anything else (another layer type, another rope, Qwen3.5's split projections, LFM2-MoE) is
refused here, by name, so it never loads as a silently wrong model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from speculant.models.config import ModelConfig, UnsupportedArchitectureError

# HF `model_type` -> the layer kinds its `layer_types` names map to.
HYBRID_LAYER_KINDS = {
    "lfm2": {"full_attention": "attention", "conv": "conv"},
    "qwen3_next": {"full_attention": "attention", "linear_attention": "deltanet"},
}
HYBRID_ARCHITECTURE_NAMES = {"Lfm2ForCausalLM": "lfm2", "Qwen3NextForCausalLM": "qwen3_next"}
STATE_KINDS = ("conv", "deltanet")


@dataclass(slots=True)
class HybridConfig(ModelConfig):
    layer_kinds: tuple[str, ...] = ()  # [num_layers] "attention" | "conv" | "deltanet"
    conv_kernel: int = 3  # taps of the causal depthwise convolution (window = conv_kernel - 1)
    conv_bias: bool = False
    rotary_dim: int = 0  # leading features of each head RoPE rotates (Qwen3-Next: head_dim / 4)
    attn_output_gate: bool = False  # Qwen3-Next: q_proj also yields a sigmoid gate per feature
    norm_offset: float = 0.0  # Qwen3-Next norms scale by (1 + w): folded into w at load
    # gated DeltaNet (Qwen3-Next "linear_attention" layers)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # mixture of experts (Qwen3-Next): num_experts == 0 means every MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = field(default=())  # layers whose MLP is the sparse MoE block

    def _check_architecture(self) -> None:
        if self.architecture not in HYBRID_LAYER_KINDS:
            raise UnsupportedArchitectureError(
                f"unsupported hybrid architecture {self.architecture!r}; speculant runs: "
                f"{', '.join(sorted(HYBRID_LAYER_KINDS))}")

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"{self.architecture}: {len(self.layer_kinds)} layer types for "
                             f"{self.num_layers} layers")
        if self.conv_kernel < 2:  # a 1-tap conv keeps no window: no such model exists
            raise UnsupportedArchitectureError(
                f"{self.architecture}: conv kernel {self.conv_kernel} (need >= 2 taps)")
        if "deltanet" in self.layer_kinds and (
                self.linear_num_key_heads < 1
                or self.linear_num_value_heads % self.linear_num_key_heads):
            raise UnsupportedArchitectureError(
                f"{self.architecture}: linear_num_value_heads ({self.linear_num_value_heads}) must "
                f"be a multiple of linear_num_key_heads ({self.linear_num_key_heads})")

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "attention"]

    @property
    def state_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k in STATE_KINDS]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def conv_channels(self, layer: int) -> int:
        """Channels of layer `layer`'s conv window: the hidden size (LFM2), or q|k|v (DeltaNet)."""
        if self.layer_kinds[layer] == "deltanet":
            return 2 * self.linear_key_dim + self.linear_value_dim
        return self.hidden_size

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "HybridConfig":
        arch = hybrid_architecture(cfg)
        if arch is None:
            raise UnsupportedArchitectureError(f"not a hybrid architecture: {_arch_name(cfg)!r}")
        _check_rope(cfg)
        common = _common_fields(cfg, arch)
        if arch == "lfm2":
            return cls(**common, conv_kernel=int(cfg.get("conv_L_cache", 3)),
                       conv_bias=bool(cfg.get("conv_bias", False)), rotary_dim=common["head_dim"])
        return cls(**common, **_qwen3_next_fields(cfg, common))


def hybrid_architecture(cfg: dict) -> str | None:
    """The hybrid family a config.json describes, or None when it is not one of ours."""
    arch = cfg.get("model_type") or HYBRID_ARCHITECTURE_NAMES.get(_arch_name(cfg))
    return arch if arch in HYBRID_LAYER_KINDS else None


def _arch_name(cfg: dict) -> str:
    return (cfg.get("architectures") or ["?"])[0]


def _check_rope(cfg: dict) -> None:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default"):
        raise UnsupportedArchitectureError(
            f"{cfg.get('model_type')}: unsupported rope {kind!r} (only default RoPE is implemented)")


def _layer_kinds(cfg: dict, arch: str, num_layers: int) -> tuple[str, ...]:
    names = cfg.get("layer_types")
    if names is None and arch == "lfm2":
        full = cfg.get("full_attn_idxs")
        full = range(num_layers) if full is None else full
        names = ["full_attention" if i in full else "conv" for i in range(num_layers)]
    if names is None:  # Qwen3-Next: every `full_attention_interval`-th layer is attention
        interval = int(cfg.get("full_attention_interval", 4))
        names = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(num_layers)]
    kinds = HYBRID_LAYER_KINDS[arch]
    for i, name in enumerate(names):
        if name not in kinds:
            raise UnsupportedArchitectureError(
                f"{arch}: layer {i} has type {name!r}; speculant runs {sorted(kinds)} there")
    return tuple(kinds[name] for name in names)


def _common_fields(cfg: dict, arch: str) -> dict:
    hidden = int(cfg["hidden_size"])
    num_heads = int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    rope = cfg.get("rope_parameters") or {}
    return dict(
        architecture=arch, num_layers=num_layers, hidden_size=hidden,
        intermediate_size=int(cfg.get("block_ff_dim") or cfg["intermediate_size"]),
        num_heads=num_heads, num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rms_norm_eps=float(cfg.get("norm_eps") or cfg.get("rms_norm_eps") or 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_embedding", cfg.get("tie_word_embeddings", False))),
        qk_norm=True, layer_kinds=_layer_kinds(cfg, arch, num_layers))


def _qwen3_next_fields(cfg: dict, common: dict) -> dict:
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError("qwen3_next: attention_bias=True is not implemented")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError(
            f"qwen3_next: hidden_act {cfg['hidden_act']!r} is not implemented (only silu)")
    rope = cfg.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    num_experts = int(cfg.get("num_experts", 0))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    moe = tuple(i for i in range(common["num_layers"])
                if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    return dict(
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        rotary_dim=int(common["head_dim"] * factor), attn_output_gate=True, norm_offset=1.0,
        linear_num_key_heads=int(cfg["linear_num_key_heads"]),
        linear_num_value_heads=int(cfg["linear_num_value_heads"]),
        linear_key_head_dim=int(cfg["linear_key_head_dim"]),
        linear_value_head_dim=int(cfg["linear_value_head_dim"]),
        num_experts=num_experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), moe_layers=moe)
