"""EAGLE-3 speculation (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"): a one-layer head fuses the target's residual streams
after three of its layers (`fc`) and drafts from them with a reduced draft vocabulary
(`d2t`). The drafting machinery is `FeatureDrafter`'s; this names the head.
"""
from __future__ import annotations

from speculant.speculators.base import TargetView
from speculant.speculators.feature_drafter import FeatureDrafter, TargetEmbedding


class Eagle3Speculator(FeatureDrafter):
    name = "eagle3"
    # Heads shipped with the repository, by the file name of the target they were trained for.
    shipped_heads = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m-eagle3"}

    @classmethod
    def load_head(cls, path: str, target: TargetView):
        from speculant.models.eagle3_head import Eagle3Head

        return Eagle3Head.load(path, target.config, embedding=TargetEmbedding(target))
