"""Hybrid models (LFM2, Qwen3-Next) read from GGUF files as llama.cpp's converter writes them.

llama.cpp (`convert_hf_to_gguf.py`, arch `lfm2` and `qwen3next`) renames every tensor
(`blk.{i}.shortconv.in_proj.weight`, `blk.{i}.ssm_conv1d.weight`, ...) and changes some values on
the way. This module reads such a file back into what the Hugging Face path produces: a
`HybridConfig` from the metadata, and the weights under their Hugging Face names and layouts,
fp32 (quantized tensors dequantized), so `Lfm2Model` and `Qwen3NextModel` run them unchanged.

What the converter changed, and how it is undone here:

    lfm2       conv.conv [hidden, 1, K] squeezed to [hidden, K]          -> unsqueezed
               the final norm (model.embedding_norm) is named token_embd_norm
               which layers attend: head_count_kv, one entry per layer, 0 for conv layers
    qwen3next  A_log stored as ssm_a = -exp(A_log)                       -> A_log = log(-ssm_a)
               dt_bias stored as ssm_dt.bias
               conv1d [C, 1, K] squeezed to [C, K]                       -> unsqueezed
               every `*norm.weight` except the DeltaNet's stored as 1 + w -> kept: the config
                   says norm_offset = 0 (the HF path adds that 1 at load instead)
               in_proj_qkvz (rows per key head: q | k | v | z) split into attn_qkv (all q |
                   all k | all v) and attn_gate (all z)                   -> regrouped
                   (files from older converters keep it whole, HF layout, as ssm_in)
               per-expert matrices stacked into ffn_{gate,up,down}_exps [E, ., .] (or
                   gate|up fused as ffn_gate_up_exps)                   -> the fused 3-D
                   `experts.gate_up_proj` / `experts.down_proj` the HF path reads
               an MTP block appended as extra blocks (`nextn_predict_layers`) -> not loaded
               (the HF path drops `mtp.*` likewise)
               which layers attend: `attention.recurrent_layers` (newer converters) or
                   `full_attention_interval`, as llama.cpp decides

Anything that does not fit (another architecture, a missing tensor, a tensor of the wrong shape,
a tensor nothing reads, metadata we do not implement) is refused at load, by name.
"""
from __future__ import annotations

import numpy as np
import torch

from speculant.models.config import UnsupportedArchitectureError
from speculant.models.hybrid_config import HybridConfig

# GGUF `general.architecture` -> our architecture name (HF `model_type`)
GGUF_HYBRID_ARCHITECTURES = {"lfm2": "lfm2", "qwen3next": "qwen3_next"}
_REQUIRED = object()


def gguf_hybrid_architecture(fields: dict) -> str | None:
    """Our name for the hybrid family a GGUF's metadata describes, or None if not one of ours."""
    return GGUF_HYBRID_ARCHITECTURES.get(str(fields.get("general.architecture")))


def read_hybrid_gguf(fields: dict, tensors: list, dtype: str = "auto") -> tuple[HybridConfig, dict]:
    """`fields`: GGUF metadata; `tensors`: the file's tensors (`loader.RawTensor`: name, qtype,
    data, torch-order shape). Returns the config and the weights under HF names, fp32."""
    gguf_arch = str(fields.get("general.architecture"))
    if gguf_arch not in GGUF_HYBRID_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"not a hybrid GGUF architecture: {gguf_arch!r}")
    if dtype not in ("auto", "float32"):
        raise ValueError(f"{GGUF_HYBRID_ARCHITECTURES[gguf_arch]} models run in float32; dtype "
                         f"{dtype!r} is not supported for them")
    meta, store = GgufMetadata(fields, gguf_arch), GgufTensors(tensors, gguf_arch)
    read_config, read_weights = _FAMILIES[gguf_arch]
    config = read_config(meta, store)
    weights = read_weights(config, meta, store)
    store.check_all_read(config.num_layers)
    return config, weights


class GgufMetadata:
    """`{arch}.*` metadata keys, read as the type we need; a missing required key is refused."""

    def __init__(self, fields: dict, arch: str):
        self.fields, self.arch = fields, arch

    def value(self, key: str, default=_REQUIRED):
        full = f"{self.arch}.{key}"
        if full not in self.fields:
            if default is _REQUIRED:
                raise ValueError(f"GGUF {self.arch}: metadata key {full!r} is missing")
            return default
        return self.fields[full]

    def int(self, key: str, default=_REQUIRED) -> int:
        value = self.value(key, default)
        if isinstance(value, (list, tuple)):
            raise ValueError(f"GGUF {self.arch}: {self.arch}.{key} is a per-layer array; "
                             "speculant reads one value for it")
        return int(value)

    def float(self, key: str, default=_REQUIRED) -> float:
        return float(self.value(key, default))


class GgufTensors:
    """The file's tensors by name. Each is read once (`take`), checked against the shape the
    config implies and dequantized to fp32; `check_all_read` refuses tensors nothing read."""

    def __init__(self, tensors: list, arch: str):
        self.raw = {t.name: t for t in tensors}
        self.arch = arch
        self.read: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.raw

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._raw(name).shape)

    def take(self, name: str, *shapes: tuple[int, ...]) -> torch.Tensor:
        """The tensor, fp32, in the first of `shapes` (torch order) its size matches."""
        t = self._raw(name)
        if tuple(t.shape) not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise ValueError(f"GGUF {self.arch}: tensor {name!r} has shape {list(t.shape)}, "
                             f"expected {want}")
        self.read.add(name)
        return _dequantize(t)

    def take_optional(self, name: str, *shapes: tuple[int, ...]) -> torch.Tensor | None:
        return self.take(name, *shapes) if self.has(name) else None

    def check_all_read(self, num_layers: int) -> None:
        # blocks past the model's own (an appended MTP block) are not part of the target
        unread = sorted(n for n in self.raw if n not in self.read and _block(n) < num_layers)
        if unread:
            raise ValueError(f"GGUF {self.arch}: tensors speculant does not implement: "
                             f"{', '.join(unread[:5])}{' ...' if len(unread) > 5 else ''}")

    def _raw(self, name: str):
        if name not in self.raw:
            raise ValueError(f"GGUF {self.arch}: missing tensor {name!r}")
        return self.raw[name]


def _block(name: str) -> int:
    """The block index of a `blk.{i}.*` tensor name; -1 for global tensors."""
    if not name.startswith("blk."):
        return -1
    return int(name.split(".")[1])


def _dequantize(t) -> torch.Tensor:
    import gguf

    try:
        values = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType[t.qtype])
    except (KeyError, NotImplementedError) as exc:
        raise ValueError(f"tensor {t.name!r}: cannot dequantize GGML type {t.qtype}") from exc
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(t.shape)  # a copy: writable


# ---- metadata -> HybridConfig ----------------------------------------------------------------

def _common_fields(meta: GgufMetadata, store: GgufTensors, num_layers: int) -> dict:
    _check_rope_scaling(meta)
    hidden = meta.int("embedding_length")
    num_heads = meta.int("attention.head_count")
    head_dim = meta.int("attention.key_length", hidden // num_heads)
    if meta.int("attention.value_length", head_dim) != head_dim:
        raise UnsupportedArchitectureError(
            f"GGUF {meta.arch}: attention.value_length differs from key_length ({head_dim})")
    return dict(
        architecture=GGUF_HYBRID_ARCHITECTURES[meta.arch], num_layers=num_layers,
        hidden_size=hidden, num_heads=num_heads, head_dim=head_dim,
        vocab_size=store.shape("token_embd.weight")[0],
        max_position_embeddings=meta.int("context_length", 4096),
        rope_theta=meta.float("rope.freq_base", 10000.0),
        rms_norm_eps=meta.float("attention.layer_norm_rms_epsilon", 1e-6),
        tie_word_embeddings=not store.has("output.weight"), qk_norm=True)


def _check_rope_scaling(meta: GgufMetadata) -> None:
    kind = meta.value("rope.scaling.type", "none")
    if kind not in ("none", ""):
        raise UnsupportedArchitectureError(
            f"GGUF {meta.arch}: unsupported rope scaling {kind!r} (only default RoPE)")


def _lfm2_config(meta: GgufMetadata, store: GgufTensors) -> HybridConfig:
    num_layers = meta.int("block_count")
    common = _common_fields(meta, store, num_layers)
    kv = meta.value("attention.head_count_kv", common["num_heads"])
    kv_per_layer = list(kv) if isinstance(kv, (list, tuple)) else [int(kv)] * num_layers
    if len(kv_per_layer) != num_layers:
        raise ValueError(f"GGUF lfm2: head_count_kv has {len(kv_per_layer)} entries for "
                         f"{num_layers} layers")
    # llama.cpp: a layer with no KV heads is a short-convolution layer
    kinds = tuple("attention" if n > 0 else "conv" for n in kv_per_layer)
    conv_layers = [i for i, k in enumerate(kinds) if k == "conv"]
    return HybridConfig(
        **common, intermediate_size=meta.int("feed_forward_length"),
        num_kv_heads=max(kv_per_layer) or common["num_heads"], layer_kinds=kinds,
        conv_kernel=meta.int("shortconv.l_cache"),
        conv_bias=any(store.has(f"blk.{i}.shortconv.conv.bias") for i in conv_layers),
        rotary_dim=common["head_dim"])


def _qwen3next_config(meta: GgufMetadata, store: GgufTensors) -> HybridConfig:
    # an MTP block, when the converter kept it, is counted in block_count
    num_layers = meta.int("block_count") - meta.int("nextn_predict_layers", 0)
    common = _common_fields(meta, store, num_layers)
    kinds = _qwen3next_layer_kinds(meta, num_layers)
    num_v_heads, inner = meta.int("ssm.time_step_rank"), meta.int("ssm.inner_size")
    if inner % num_v_heads:
        raise ValueError(f"GGUF qwen3next: ssm.inner_size {inner} is not a multiple of "
                         f"ssm.time_step_rank {num_v_heads}")
    num_experts = meta.int("expert_count", 0)
    moe = tuple(i for i in range(num_layers) if store.has(f"blk.{i}.ffn_gate_inp.weight"))
    if moe:
        _check_routing(meta, num_experts)
    return HybridConfig(
        **common, num_kv_heads=meta.int("attention.head_count_kv", common["num_heads"]),
        intermediate_size=meta.int("feed_forward_length", 0)
        or meta.int("expert_feed_forward_length"),
        layer_kinds=kinds, conv_kernel=meta.int("ssm.conv_kernel"),
        rotary_dim=meta.int("rope.dimension_count", common["head_dim"] // 4),
        attn_output_gate=True, norm_offset=0.0,  # the converter already stored 1 + w
        linear_num_key_heads=meta.int("ssm.group_count"), linear_num_value_heads=num_v_heads,
        linear_key_head_dim=meta.int("ssm.state_size"),
        linear_value_head_dim=inner // num_v_heads,
        num_experts=num_experts if moe else 0,
        num_experts_per_tok=meta.int("expert_used_count", 0) if moe else 0,
        norm_topk_prob=bool(meta.value("expert_weights_norm", True)), moe_layers=moe)


def _qwen3next_layer_kinds(meta: GgufMetadata, num_layers: int) -> tuple[str, ...]:
    """llama.cpp's rule: the per-block flags `attention.recurrent_layers` when present (newer
    converters; entries past the trunk belong to MTP blocks), else every
    `full_attention_interval`-th layer attends and the others are DeltaNet layers."""
    recurrent = meta.value("attention.recurrent_layers", None)
    if recurrent is None:
        interval = meta.int("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
    elif not isinstance(recurrent, (list, tuple)):
        recurrent = [recurrent] * num_layers
    if len(recurrent) < num_layers:
        raise ValueError(f"GGUF qwen3next: attention.recurrent_layers has {len(recurrent)} "
                         f"entries for {num_layers} layers")
    return tuple("deltanet" if r else "attention" for r in recurrent[:num_layers])


def _check_routing(meta: GgufMetadata, num_experts: int) -> None:
    """Our SparseMoe: softmax router, top-k weights (renormalised or not), no extra scale."""
    if num_experts < 1 or meta.int("expert_used_count", 0) < 1:
        raise ValueError("GGUF qwen3next: MoE tensors but no expert_count / expert_used_count")
    if meta.int("expert_gating_func", 1) != 1:  # llama.cpp: 1 softmax, 2 sigmoid
        raise UnsupportedArchitectureError("GGUF qwen3next: only a softmax expert router is "
                                           "implemented (expert_gating_func != softmax)")
    if meta.float("expert_weights_scale", 1.0) not in (0.0, 1.0):
        raise UnsupportedArchitectureError("GGUF qwen3next: expert_weights_scale != 1 is not "
                                           "implemented")


# ---- tensors -> HF names and layouts ---------------------------------------------------------

def _output_weights(c: HybridConfig, store: GgufTensors, final_norm: str, hf_norm: str) -> dict:
    shape = (c.vocab_size, c.hidden_size)
    w = {"model.embed_tokens.weight": store.take("token_embd.weight", shape),
         hf_norm: store.take(final_norm, (c.hidden_size,))}
    if store.has("output.weight"):
        w["lm_head.weight"] = store.take("output.weight", shape)
    return w


def _renamed(store: GgufTensors, i: int, hf_prefix: str, names: dict) -> dict:
    """names: HF suffix -> (GGUF suffix, shape) of block i."""
    return {f"model.layers.{i}.{hf_prefix}{hf}": store.take(f"blk.{i}.{gg}", shape)
            for hf, (gg, shape) in names.items()}


def _attention_names(c: HybridConfig, q_rows: int, q_norm: str, k_norm: str,
                     out: str) -> dict:
    h, kv = c.hidden_size, c.num_kv_heads * c.head_dim
    return {"q_proj.weight": ("attn_q.weight", (q_rows, h)),
            "k_proj.weight": ("attn_k.weight", (kv, h)),
            "v_proj.weight": ("attn_v.weight", (kv, h)),
            out: ("attn_output.weight", (h, c.num_heads * c.head_dim)),
            q_norm: ("attn_q_norm.weight", (c.head_dim,)),
            k_norm: ("attn_k_norm.weight", (c.head_dim,))}


def _lfm2_weights(c: HybridConfig, meta: GgufMetadata, store: GgufTensors) -> dict:
    h, ff = c.hidden_size, c.intermediate_size
    w = _output_weights(c, store, "token_embd_norm.weight", "model.embedding_norm.weight")
    for i, kind in enumerate(c.layer_kinds):
        w.update(_renamed(store, i, "", {
            "operator_norm.weight": ("attn_norm.weight", (h,)),
            "ffn_norm.weight": ("ffn_norm.weight", (h,)),
            "feed_forward.w1.weight": ("ffn_gate.weight", (ff, h)),
            "feed_forward.w3.weight": ("ffn_up.weight", (ff, h)),
            "feed_forward.w2.weight": ("ffn_down.weight", (h, ff))}))
        if kind == "attention":
            w.update(_renamed(store, i, "self_attn.", _attention_names(
                c, c.num_heads * c.head_dim, "q_layernorm.weight", "k_layernorm.weight",
                "out_proj.weight")))
        else:
            w.update(_lfm2_conv(c, store, i))
    return w


def _lfm2_conv(c: HybridConfig, store: GgufTensors, i: int) -> dict:
    h, g, p = c.hidden_size, f"blk.{i}.shortconv.", f"model.layers.{i}.conv."
    w = {p + "in_proj.weight": store.take(g + "in_proj.weight", (3 * h, h)),
         p + "out_proj.weight": store.take(g + "out_proj.weight", (h, h)),
         # [hidden, K] -> HF's depthwise Conv1d layout [hidden, 1, K]
         p + "conv.weight": store.take(g + "conv.weight", (h, c.conv_kernel)).unsqueeze(1)}
    optional = {"in_proj.bias": 3 * h, "out_proj.bias": h, "conv.bias": h}
    for name, size in optional.items():
        bias = store.take_optional(g + name, (size,))
        if bias is not None:
            w[p + name] = bias
    return w


def _qwen3next_weights(c: HybridConfig, meta: GgufMetadata, store: GgufTensors) -> dict:
    h = c.hidden_size
    w = _output_weights(c, store, "output_norm.weight", "model.norm.weight")
    for i, kind in enumerate(c.layer_kinds):
        w.update(_renamed(store, i, "", {
            "input_layernorm.weight": ("attn_norm.weight", (h,)),
            "post_attention_layernorm.weight": ("post_attention_norm.weight", (h,))}))
        if kind == "attention":
            w.update(_renamed(store, i, "self_attn.", _attention_names(
                c, 2 * c.num_heads * c.head_dim, "q_norm.weight", "k_norm.weight",
                "o_proj.weight")))
        else:
            w.update(_deltanet(c, store, i))
        w.update(_sparse_moe(c, meta, store, i) if i in c.moe_layers else _renamed(
            store, i, "mlp.", _swiglu_names(h, c.intermediate_size, "")))
    return w


def _deltanet(c: HybridConfig, store: GgufTensors, i: int) -> dict:
    h, hv, key_dim, value_dim = (c.hidden_size, c.linear_num_value_heads, c.linear_key_dim,
                                 c.linear_value_dim)
    g, p = f"blk.{i}.", f"model.layers.{i}.linear_attn."
    ssm_a = store.take(g + "ssm_a", (hv,))
    if (ssm_a >= 0).any():
        raise ValueError(f"GGUF qwen3next: {g}ssm_a has entries >= 0; llama.cpp stores "
                         "-exp(A_log) there, which is always negative")
    return {p + "in_proj_qkvz.weight": _in_proj_qkvz(c, store, g),
            p + "in_proj_ba.weight": store.take(g + "ssm_ba.weight", (2 * hv, h)),
            p + "conv1d.weight": store.take(g + "ssm_conv1d.weight", (
                c.conv_channels(i), c.conv_kernel)).unsqueeze(1),  # -> [C, 1, K]
            p + "A_log": torch.log(-ssm_a), p + "dt_bias": store.take(g + "ssm_dt.bias", (hv,)),
            p + "norm.weight": store.take(g + "ssm_norm.weight", (c.linear_value_head_dim,)),
            p + "out_proj.weight": store.take(g + "ssm_out.weight", (h, value_dim))}


def _in_proj_qkvz(c: HybridConfig, store: GgufTensors, g: str) -> torch.Tensor:
    h, key_dim, value_dim = c.hidden_size, c.linear_key_dim, c.linear_value_dim
    if store.has(g + "ssm_in.weight"):  # older converters: HF's grouped layout, unchanged
        return store.take(g + "ssm_in.weight", (2 * key_dim + 2 * value_dim, h))
    qkv = store.take(g + "attn_qkv.weight", (2 * key_dim + value_dim, h))
    z = store.take(g + "attn_gate.weight", (value_dim, h))
    return group_qkvz(qkv, z, c.linear_num_key_heads)


def group_qkvz(qkv: torch.Tensor, z: torch.Tensor, num_k_heads: int) -> torch.Tensor:
    """qkv [2 * Hk * dk + Hv * dv, hidden] (all q | all k | all v) and z [Hv * dv, hidden] ->
    HF's in_proj_qkvz rows: per key head, its q | k | v | z (v and z of the value heads it
    serves). Inverse of llama.cpp's split."""
    hidden = qkv.shape[1]
    key_dim = (qkv.shape[0] - z.shape[0]) // 2
    q, k, v = qkv.split([key_dim, key_dim, z.shape[0]])
    per_head = [t.reshape(num_k_heads, -1, hidden) for t in (q, k, v, z)]
    return torch.cat(per_head, dim=1).reshape(-1, hidden)


def _swiglu_names(h: int, ff: int, tag: str) -> dict:
    """HF gate/up/down_proj <- GGUF ffn_{gate,up,down}{tag} ("" dense, "_shexp" shared)."""
    return {"gate_proj.weight": (f"ffn_gate{tag}.weight", (ff, h)),
            "up_proj.weight": (f"ffn_up{tag}.weight", (ff, h)),
            "down_proj.weight": (f"ffn_down{tag}.weight", (h, ff))}


def _sparse_moe(c: HybridConfig, meta: GgufMetadata, store: GgufTensors, i: int) -> dict:
    h, e, g, p = c.hidden_size, c.num_experts, f"blk.{i}.", f"model.layers.{i}.mlp."
    # llama.cpp's defaults when the sizes are not in the metadata
    ff = meta.int("expert_feed_forward_length", c.intermediate_size // c.num_experts_per_tok)
    shared_ff = meta.int("expert_shared_feed_forward_length", c.intermediate_size)
    if store.has(g + "ffn_gate_up_exps.weight"):  # gate rows first, then up (llama.cpp's split)
        gate_up = store.take(g + "ffn_gate_up_exps.weight", (e, 2 * ff, h))
    else:
        gate_up = torch.cat([store.take(g + "ffn_gate_exps.weight", (e, ff, h)),
                             store.take(g + "ffn_up_exps.weight", (e, ff, h))], dim=1)
    w = {p + "gate.weight": store.take(g + "ffn_gate_inp.weight", (e, h)),
         p + "experts.gate_up_proj": gate_up,  # [E, 2 * ff, hidden]
         p + "experts.down_proj": store.take(g + "ffn_down_exps.weight", (e, h, ff)),
         p + "shared_expert_gate.weight": store.take(
             g + "ffn_gate_inp_shexp.weight", (1, h), (h,)).reshape(1, h)}
    w.update(_renamed(store, i, "mlp.shared_expert.", _swiglu_names(h, shared_ff, "_shexp")))
    return w


_FAMILIES = {"lfm2": (_lfm2_config, _lfm2_weights),
             "qwen3next": (_qwen3next_config, _qwen3next_weights)}
