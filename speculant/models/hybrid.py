"""The hybrid families by architecture name: one place that turns a loaded config into a model."""
from __future__ import annotations

from speculant.models.hybrid_config import HybridConfig
from speculant.models.hybrid_model import HybridModel
from speculant.models.lfm2 import Lfm2Model
from speculant.models.qwen3_next import Qwen3NextModel

HYBRID_MODELS = {"lfm2": Lfm2Model, "qwen3_next": Qwen3NextModel}


def hybrid_model(config: HybridConfig, weights: dict, device="cpu") -> HybridModel:
    return HYBRID_MODELS[config.architecture](config, weights, device)
