"""MTP speculation (DeepSeek-V3's multi-token prediction module, applied recursively): the
module reads the target's last hidden state and the next token's embedding and scores the
target's own LM head (or a restricted copy of it). The drafting machinery is
`FeatureDrafter`'s; this names the module.
"""
from __future__ import annotations

from speculant.speculators.base import TargetView
from speculant.speculators.feature_drafter import FeatureDrafter, TargetEmbedding


class MtpSpeculator(FeatureDrafter):
    name = "mtp"
    shipped_heads = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m-mtp"}

    @classmethod
    def load_head(cls, path: str, target: TargetView):
        from speculant.models.mtp_head import MtpHead

        return MtpHead.load(path, target.config, embedding=TargetEmbedding(target),
                            lm_head=target.lm_head)
