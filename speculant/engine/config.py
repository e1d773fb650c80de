"""Engine configuration: one validated dataclass whose field names are the CLI flags."""
from __future__ import annotations

from dataclasses import dataclass, field

from speculant.engine.kv_cache import KV_DTYPES
from speculant.kernels.kv_layout import TILE_BLOCK
from speculant.kernels.native import tile_kv_cache
from speculant.engine.state_checkpoint import CKPT_MODES
from speculant.models.loader import DTYPES


def parse_spec_types(value) -> list[str]:
    """'ngram_mod,suffix' or ['ngram_mod', 'suffix'] -> ['ngram_mod', 'suffix']; 'none' -> []."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [s.strip().replace("-", "_") for s in items if s and s.strip()]
    return [] if names in ([], ["none"]) else names


def auto_kv_dtype(dtype: str, device: str) -> str:
    """float32 with float32 weights (reference numerics, as transformers computes); else
    bfloat16 where the CPU attends a cache in the AMX tiles' layout natively, on AMX-BF16 tiles
    or AVX512_BF16 dot products (its logits sit as close to an fp32 cache's as fp16's do, and a
    verified row's attention costs a fraction: docs/kernels.md), else float16."""
    if dtype == "float32":
        return "float32"
    if device == "cpu" and tile_kv_cache():
        return "bfloat16"
    return "float16"


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    dtype: str = "auto"  # auto keeps GGUF quantized weights; float32 inflates them
    device: str = "cpu"
    num_threads: int | None = None  # torch threads; None = all cores
    max_num_seqs: int = 16  # sequences decoded together
    max_num_batched_tokens: int = 512  # tokens per forward (prefill chunks are cut to fit)
    # Longest chunk of one prompt in a step while other sequences run: bounds the time a long
    # prompt adds to every other sequence's next token (~2-3 ms per prompt token at long
    # contexts on 2 CPU cores: a 32-token chunk keeps a decode step around 0.1 s).
    max_prefill_chunk_decoding: int = 32
    max_model_len: int | None = None  # None = the model's context length
    kv_cache_tokens: int = 32768  # KV capacity shared by all sequences
    # KV cache element type: float16 (llama.cpp's default too), float32, or bfloat16 (in the AMX
    # tiles' layout, attended on AMX-BF16 tiles or AVX512_BF16 dot products: CPUs with
    # avx512_bf16); auto: auto_kv_dtype
    kv_dtype: str = "auto"
    block_size: int = 0  # positions per cache block; 0 = the cache's own: 16, 32 for bfloat16
    # Speculation: speculators loaded (the chain), and the default draft limits per request.
    spec_type: list[str] = field(default_factory=list)
    spec_n_max: int = 16
    spec_n_min: int = 0
    spec_p_min: float = 0.0
    spec_options: dict = field(default_factory=dict)  # speculator name -> its config overrides
    # Hybrid (recurrent) models: how a round's rejected rows leave the recurrent state
    # (engine/state_checkpoint.py): per_step snapshots, reeval (restore + re-run), or auto
    spec_ckpt_mode: str = "auto"
    max_queue: int = 256  # waiting requests beyond the running ones
    # Online tuner of the draft limit from measured goodput (engine/tuner.py); requests that
    # set their own n_max are not tuned.
    spec_tune: bool = False
    # set when kv_dtype came from auto: an engine whose model cannot use the tiles' layout
    # (head_dim) then keeps float16 instead of refusing (Engine._resolve_kv_dtype)
    kv_dtype_auto: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.spec_type = parse_spec_types(self.spec_type)
        if self.kv_dtype not in ("auto", *KV_DTYPES):
            raise ValueError(f"kv_dtype must be auto or one of {tuple(KV_DTYPES)}, "
                             f"got {self.kv_dtype!r}")
        if self.kv_dtype == "auto":
            self.kv_dtype, self.kv_dtype_auto = auto_kv_dtype(self.dtype, self.device), True
        if self.block_size == 0:
            self.block_size = TILE_BLOCK if self.kv_dtype == "bfloat16" else 16
        if self.kv_dtype == "bfloat16" and self.block_size % TILE_BLOCK:
            if not self.kv_dtype_auto:
                raise ValueError(f"kv_dtype bfloat16 needs block_size a multiple of "
                                 f"{TILE_BLOCK}, got {self.block_size}")
            self.kv_dtype = "float16"  # auto, with a block size chosen for another cache
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk_decoding",
                     "kv_cache_tokens", "block_size", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 <= self.spec_n_max <= 256:
            raise ValueError(f"spec_n_max must be in [0, 256], got {self.spec_n_max}")
        if not 0 <= self.spec_n_min <= max(self.spec_n_max, 1):
            raise ValueError(f"spec_n_min must be in [0, spec_n_max], got {self.spec_n_min}")
        if not 0.0 <= self.spec_p_min <= 1.0:
            raise ValueError(f"spec_p_min must be in [0, 1], got {self.spec_p_min}")
        if self.spec_ckpt_mode not in ("auto", *CKPT_MODES):
            raise ValueError(f"spec_ckpt_mode must be auto or one of {CKPT_MODES}, "
                             f"got {self.spec_ckpt_mode!r}")
        if not isinstance(self.spec_options, dict) or not all(
                isinstance(v, dict) for v in self.spec_options.values()):
            raise ValueError(f"spec_options must map speculator names to option dicts, "
                             f"got {self.spec_options!r}")
