"""Write a transformers LFM2 / Qwen3-Next model to GGUF the way llama.cpp's `convert_hf_to_gguf.py`
does (classes `LFM2Model`, `Qwen3NextModel`): its metadata keys, its tensor names (mapped through
gguf's `TensorNameMap`, as the converter maps them) and its value transforms, so a test loading
the file proves the loader undoes every one. A tiny byte-level BPE vocabulary (512 tokens) makes
the file usable end to end (tokenizer included)."""
from __future__ import annotations

import gguf
import numpy as np
import torch

ARCHS = {"lfm2": gguf.MODEL_ARCH.LFM2, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT}


def write_gguf(model, path, qtype: str = "F32", arch_name: str | None = None, edit=None,
               mtp_block: bool = False) -> str:
    """model: a transformers Lfm2ForCausalLM / Qwen3NextForCausalLM. qtype: the GGML type of
    its matrices ("F32", "F16", "BF16", "Q8_0"; see `stored_as`). `arch_name` overrides
    `general.architecture`; `edit(name, array)` returns the array to write instead, or None to
    leave the tensor out (broken files). `mtp_block` (Qwen3-Next): write as newer converters
    do, with per-layer `attention.recurrent_layers` flags and an MTP block after the trunk."""
    cfg = model.config
    arch = ARCHS[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch_name or gguf.MODEL_ARCH_NAMES[arch])
    if cfg.model_type == "lfm2":
        _lfm2_metadata(writer, cfg)
        tensors = _lfm2_tensors(model.state_dict())
    else:
        _qwen3_next_metadata(writer, cfg, mtp_block)
        tensors = _qwen3_next_tensors(model.state_dict(), cfg)
        if mtp_block:
            tensors = [*tensors, *_mtp_block(model.state_dict(), cfg)]
    _add_vocab(writer, cfg.vocab_size)
    names = gguf.TensorNameMap(arch, cfg.num_hidden_layers)
    for hf_name, tensor in tensors:
        name = hf_name if hf_name.startswith("blk.") else names.get_name(
            hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"llama.cpp has no name for {hf_name}"
        data = tensor.detach().float().numpy()
        data = edit(name, data) if edit else data
        if data is not None:
            _add_tensor(writer, name, data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def stored_as(shape: tuple[int, ...], qtype: str) -> str:
    """The type a tensor is written in: `qtype` for matrices whose rows split into 32-blocks,
    F32 for vectors (norms, biases, ssm_a: the converter keeps those F32) and conv kernels."""
    return qtype if len(shape) >= 2 and shape[-1] % 32 == 0 else "F32"


def _add_tensor(writer, name: str, data: np.ndarray, qtype: str) -> None:
    q = gguf.GGMLQuantizationType[stored_as(data.shape, qtype)]
    if q == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, q), raw_dtype=q)


# ---- LFM2 (llama.cpp conversion/lfm2.py, LFM2Model) --------------------------------------------

def _lfm2_metadata(writer, cfg) -> None:
    kv = cfg.num_key_value_heads
    _common_metadata(writer, cfg, [kv if t != "conv" else 0 for t in cfg.layer_types])
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_shortconv_l_cache(cfg.conv_L_cache)
    writer.add_feed_forward_length(_lfm2_ff_dim(cfg))


def _lfm2_ff_dim(cfg) -> int:
    # the converter's rule (transformers' Lfm2MLP sizes its matrices the same way)
    hp = cfg.to_dict()  # the converter reads config.json's keys
    ff = hp.get("block_ff_dim") or hp["intermediate_size"]
    if hp["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        if hp.get("block_ffn_dim_multiplier") is not None:
            ff = int(hp["block_ffn_dim_multiplier"] * ff)
        multiple = hp["block_multiple_of"]
        ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def _lfm2_tensors(state: dict):
    for name, t in state.items():
        if "conv.conv" in name:  # depthwise kernel [hidden, 1, K] -> [hidden, K]
            t = t.squeeze(1)
        yield name, t


# ---- Qwen3-Next (llama.cpp conversion/qwen.py, Qwen3NextModel over Qwen2MoeModel) --------------

def _qwen3_next_metadata(writer, cfg, mtp_block: bool) -> None:
    _common_metadata(writer, cfg, cfg.num_key_value_heads, cfg.num_hidden_layers + mtp_block)
    if mtp_block:  # the MTP block counts as one more block, and is not recurrent
        writer.add_nextn_predict_layers(1)
        writer.add_array(f"{writer.arch}.attention.recurrent_layers",
                         [t == "linear_attention" for t in cfg.layer_types] + [False])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if cfg.num_experts > 0:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    writer.add_full_attention_interval(getattr(cfg, "full_attention_interval", None) or 4)
    factor = (cfg.rope_parameters or {}).get("partial_rotary_factor", 0.25)
    writer.add_rope_dimension_count(int(cfg.head_dim * factor))


def _qwen3_next_tensors(state: dict, cfg):
    for name, t in state.items():
        if name.startswith("mtp."):
            continue
        if name.endswith(".A_log"):
            yield name, -torch.exp(t)
        elif name.endswith(".dt_bias"):
            yield name.replace(".dt_bias", ".dt_proj.bias"), t
        elif "conv1d" in name:
            yield name, t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            yield name, t + 1
        elif name.endswith("in_proj_qkvz.weight"):
            yield from _split_qkvz(name, t, cfg)
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 * ff, hidden]: gate rows first
            gate, up = t.chunk(2, dim=1)
            yield name.replace("gate_up_proj", "gate_proj.weight"), gate
            yield name.replace("gate_up_proj", "up_proj.weight"), up
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", t
        elif ".mlp." in name and name.endswith("_proj.weight") and ".shared_expert." not in name:
            # a dense MLP: llama.cpp's converter cannot map it (it writes MoE Qwen3-Next only,
            # its loader refuses zero experts); these are the names its graph's dense branch reads
            layer, kind = name.split(".")[2], name.split(".")[-2].removesuffix("_proj")
            yield f"blk.{layer}.ffn_{kind}.weight", t
        else:
            yield name, t


def _mtp_block(state: dict, cfg):
    """An MTP block as `blk.{num_layers}`: the nextn projections and norms, and a decoder layer
    (a copy of the last one's tensors: their values do not matter, the target never reads them)."""
    last, mtp = cfg.num_hidden_layers - 1, cfg.num_hidden_layers
    h = cfg.hidden_size
    yield f"blk.{mtp}.nextn.eh_proj.weight", torch.zeros(h, 2 * h)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        yield f"blk.{mtp}.nextn.{norm}.weight", torch.ones(h)
    names = gguf.TensorNameMap(ARCHS["qwen3_next"], mtp + 1)
    for name, t in _qwen3_next_tensors(state, cfg):
        mapped = name if name.startswith("blk.") else names.get_name(
            name, try_suffixes=(".weight", ".bias"))
        if mapped and mapped.startswith(f"blk.{last}."):
            yield f"blk.{mtp}." + mapped[len(f"blk.{last}."):], t


def _split_qkvz(name: str, t: torch.Tensor, cfg):
    """Rows per key head q | k | v | z -> attn_qkv (all q | all k | all v) and attn_gate (all z)."""
    layer = int(name.split(".")[2])
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    vz = cfg.linear_num_value_heads // hk * cfg.linear_value_head_dim
    q, k, v, z = t.reshape(hk, -1, t.shape[1]).split([dk, dk, vz, vz], dim=1)
    flat = [x.reshape(-1, t.shape[1]) for x in (q, k, v, z)]
    yield f"blk.{layer}.attn_qkv.weight", torch.cat(flat[:3])
    yield f"blk.{layer}.attn_gate.weight", flat[3]


# ---- shared ------------------------------------------------------------------------------------

def _common_metadata(writer, cfg, head_count_kv, block_count: int | None = None) -> None:
    writer.add_block_count(block_count or cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(head_count_kv)
    writer.add_rope_freq_base((cfg.rope_parameters or {}).get("rope_theta", 10000.0))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _add_vocab(writer, vocab_size: int) -> None:
    """Byte-level BPE ("gpt2"): the 256 byte symbols, letter-pair merges, an end-of-text token."""
    symbols = _byte_symbols()
    letters = "etaoinshrdlucmfw"
    pairs = [(a, b) for a in letters for b in letters][: vocab_size - len(symbols) - 1]
    tokens = symbols + [a + b for a, b in pairs] + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(False)


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table: printable bytes stand for themselves, the
    others are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return [table[b] for b in range(256)]
