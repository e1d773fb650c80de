"""What differs between the head kinds `train-head` fits; everything else is shared.

`head_fit.py` owns what every kind does alike: the training-time-test unrolling (both heads
expose the per-step API `speculators/feature_drafter.py` drives), the loss against the target's
distribution on the draft vocabulary, AdamW with warm-up and cosine, time budget, checkpoints and
held-out figures. A `HeadKind` says only which target layers its head reads and how a head starts:

- `eagle3` (Li et al. 2025): reads the residuals after target layers aux - 1 (EAGLE-3's inputs
  of layers 2, L/2, L-3), fused by `fc`; starts from Llama's random init, with the target's final
  norm and LM-head rows of the draft vocabulary, all trained.
- `mtp` (DeepSeek-V3's multi-token prediction): reads the last layer's residual (before the final
  norm); starts from the same random init as EAGLE-3 (as DeepSeek trains its MTP modules), with
  the target's final norm as `shared_head_norm`; the LM head is the target's, frozen (DeepSeek
  shares it between the model and its MTP modules), restricted to the draft vocabulary's rows
  unless that is the whole vocabulary. A copy of the target's last layer as the block was
  measured and is not used: on the default model's cached data (2 shards, 8192-token draft
  vocabulary, 2 unrolled steps, 6,305 held-out positions) it reached held-out first-token
  agreement 0.133 / 0.194 after 60 / 200 steps against 0.158 / 0.212 from random (the copied
  layer expects the target's residual scale, ~30 RMS, and agrees on 0.0-2% at init whatever
  `eh_proj` starts as).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculant.models.eagle3_head import Eagle3Head, aux_to_capture_layers, default_aux_layer_ids
from speculant.models.mtp_head import MtpHead


@dataclass(frozen=True, slots=True)
class TargetParts:
    """The target's pieces a head trains against, dense fp32 and never trained."""

    embed: torch.Tensor  # [vocab, d] token embedding
    lm_head: torch.Tensor  # [vocab, d] output layer (the embedding when tied)
    final_norm: torch.Tensor  # [d]

    @classmethod
    def of(cls, target) -> "TargetParts":
        """From a loaded target (`models.loader.LoadedModel`)."""
        w = target.weights
        embed = dense(w["token_embd.weight"])
        lm_head = dense(w["output.weight"]) if "output.weight" in w else embed
        return cls(embed, lm_head, dense(w["output_norm.weight"]))


class HeadKind(ABC):
    """One kind of head `train-head` can fit (see the module docstring)."""

    name: str

    @abstractmethod
    def capture_layers(self, cfg, target_config) -> tuple[int, ...]:
        """Target layers (residual after the layer) the head reads, as its `capture_layers`."""

    @abstractmethod
    def new_head(self, cfg, target_config, parts: TargetParts, draft_ids: torch.Tensor,
                 intermediate_size: int | None = None, num_layers: int = 1):
        """The head at the start of training; `draft_ids` [draft_vocab] ascending target ids;
        `intermediate_size` its MLP's width where the kind has `mlp_rows` (None: the target's);
        `num_layers` its decoder layers (a kind with `deepens` only; else 1)."""

    @abstractmethod
    def describe(self, head) -> dict:
        """Kind-specific facts about a trained head, for recipe.json."""

    @abstractmethod
    def load_head(self, path: str, target_config, parts: TargetParts):
        """A trained head of this kind from a folder (a warm start, `--init-head`)."""

    # parameters with one row per draft-vocabulary token (remapped, not copied, on a warm start)
    vocab_rows: tuple[str, ...] = ()
    # the parameter whose columns are one block per captured target layer (remapped by layer on
    # a warm start whose head reads other layers), or None
    layer_columns: str | None = None
    # the MLP's parameters with one row / one column per hidden unit: a kind that names them
    # takes --head-intermediate, and a warm start may widen them (`head_fit.widen_units`)
    mlp_rows: tuple[str, ...] = ()
    mlp_columns: tuple[str, ...] = ()
    # whether the kind stacks decoder layers (--head-layers; a warm start may deepen)
    deepens: bool = False


class Eagle3Kind(HeadKind):
    name = "eagle3"

    def capture_layers(self, cfg, target_config) -> tuple[int, ...]:
        aux = cfg.aux_layers or default_aux_layer_ids(target_config.num_layers)
        return aux_to_capture_layers(aux)

    def new_head(self, cfg, target_config, parts: TargetParts, draft_ids: torch.Tensor,
                 intermediate_size: int | None = None, num_layers: int = 1) -> Eagle3Head:
        head = Eagle3Head.random(target_config, draft_ids, cfg.seed, cfg.aux_layers,
                                 intermediate_size, num_layers)
        head.use_target_embedding(parts.embed)
        with torch.no_grad():  # start from the target's own output layer on the draft vocabulary
            head.lm_head.weight.copy_(parts.lm_head[draft_ids])
            head.norm.weight.copy_(parts.final_norm)
        return head

    def describe(self, head: Eagle3Head) -> dict:
        return {"aux_layer_ids": list(head.config.aux_layer_ids),
                "intermediate_size": int(head.config.intermediate_size),
                "num_layers": int(head.num_layers),
                "lm_head": "draft-vocabulary rows, trained from the target's"}

    def load_head(self, path: str, target_config, parts: TargetParts) -> Eagle3Head:
        return Eagle3Head.load(path, target_config, parts.embed)

    vocab_rows = ("lm_head.weight",)
    layer_columns = "fc.weight"
    mlp_rows = ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight")
    mlp_columns = ("midlayer.mlp.down_proj.weight",)
    deepens = True


class MtpKind(HeadKind):
    name = "mtp"

    def capture_layers(self, cfg, target_config) -> tuple[int, ...]:
        return (target_config.num_layers - 1,)  # as MtpHead.capture_layers

    def new_head(self, cfg, target_config, parts: TargetParts, draft_ids: torch.Tensor,
                 intermediate_size: int | None = None, num_layers: int = 1) -> MtpHead:
        head = MtpHead.random(target_config, cfg.seed)
        with torch.no_grad():
            head.shared_head_norm.weight.copy_(parts.final_norm)
        if len(draft_ids) < target_config.vocab_size:
            head.restrict_vocab(draft_ids, parts.lm_head[draft_ids].contiguous())
        head.use_target(DenseEmbedding(parts.embed), lambda x: x @ parts.lm_head.T)
        return head

    def describe(self, head: MtpHead) -> dict:
        restricted = head.lm_head_rows is not None
        return {"lm_head": ("the target's draft-vocabulary rows, frozen (stored)" if restricted
                            else "the target's, frozen (not stored)")}

    def load_head(self, path: str, target_config, parts: TargetParts) -> MtpHead:
        return MtpHead.load(path, target_config, DenseEmbedding(parts.embed),
                            lambda x: x @ parts.lm_head.T)


HEAD_KINDS: dict[str, HeadKind] = {k.name: k for k in (Eagle3Kind(), MtpKind())}


class DenseEmbedding:
    """A dense [vocab, d] embedding with the `.embed(ids)` heads call."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # [vocab, d]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)  # [T, d]


def dense(weight) -> torch.Tensor:
    """A target weight as a dense fp32 tensor (packed GGUF weights dequantized exactly)."""
    if hasattr(weight, "dequantize"):
        return weight.dequantize().float()
    return torch.as_tensor(weight).float()
