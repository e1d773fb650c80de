"""Speculators (drafters) and the chain that arbitrates between them."""
from speculant.spec.base import (
    CommittedTokens,
    Draft,
    DraftParams,
    DraftRequest,
    Speculator,
    SpeculatorContext,
    SpeculatorStats,
    register,
    registered_names,
    speculator_class,
)

__all__ = [
    "CommittedTokens", "Draft", "DraftParams", "DraftRequest", "Speculator",
    "SpeculatorContext", "SpeculatorStats", "register", "registered_names", "speculator_class",
]
