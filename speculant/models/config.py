"""Architecture hyper-parameters of a Llama-family model, read from GGUF metadata or config.json."""
from __future__ import annotations

from dataclasses import dataclass

# Architectures we run, and the variant flags each implies. Anything else is refused by name.
SUPPORTED_ARCHITECTURES = {
    # name (GGUF `general.architecture` or HF `model_type`): (qkv_bias, qk_norm)
    "llama": (False, False),
    "mistral": (False, False),
    "smollm2": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}

HF_ARCHITECTURE_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedArchitectureError(ValueError):
    pass


# Hybrid families (recurrent layers beside attention): their own config, `hybrid_config.py`.
HYBRID_ARCHITECTURES = ("lfm2", "qwen3_next")


def check_architecture(arch: str) -> str:
    if arch not in SUPPORTED_ARCHITECTURES:
        hint = (" (a hybrid family: it loads from a Hugging Face folder, through HybridConfig)"
                if arch in HYBRID_ARCHITECTURES else "")
        raise UnsupportedArchitectureError(
            f"unsupported model architecture {arch!r}{hint}; speculant runs: "
            f"{', '.join(sorted((*SUPPORTED_ARCHITECTURES, *HYBRID_ARCHITECTURES)))}"
        )
    return arch


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        self._check_architecture()
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    def _check_architecture(self) -> None:
        check_architecture(self.architecture)

    @property
    def is_hybrid(self) -> bool:
        """Recurrent layers beside attention: per-sequence state besides the KV cache."""
        return self.architecture in HYBRID_ARCHITECTURES

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> "ModelConfig":
        """`fields`: GGUF metadata key -> python value."""
        arch = check_architecture(str(fields["general.architecture"]))
        p = arch + "."
        hidden = int(fields[p + "embedding_length"])
        num_heads = int(fields[p + "attention.head_count"])
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        head_dim = int(fields.get(p + "attention.key_length", hidden // num_heads))
        return cls(
            architecture=arch,
            num_layers=int(fields[p + "block_count"]),
            hidden_size=hidden,
            intermediate_size=int(fields[p + "feed_forward_length"]),
            num_heads=num_heads,
            num_kv_heads=int(fields.get(p + "attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            vocab_size=int(fields.get(p + "vocab_size", len(fields.get("tokenizer.ggml.tokens", [])))),
            max_position_embeddings=int(fields.get(p + "context_length", 4096)),
            rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
            rms_norm_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            tie_word_embeddings=True,  # corrected by the loader when output.weight exists
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        arch = cfg.get("model_type") or HF_ARCHITECTURE_NAMES.get(
            (cfg.get("architectures") or [""])[0], (cfg.get("architectures") or ["?"])[0])
        arch = check_architecture(str(arch))
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if arch in ("llama", "mistral") and cfg.get("attention_bias"):
            qkv_bias = True
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or {}
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise UnsupportedArchitectureError(
                f"unsupported rope scaling {scaling!r} (only default RoPE is implemented)")
        return cls(
            architecture=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
        )
