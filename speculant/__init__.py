"""speculant: a speculative-decoding LLM inference engine and server on PyTorch."""
from speculant.engine.sampling_params import SamplingParams, SpecParams

__all__ = ["LLM", "SamplingParams", "SpecParams", "Engine", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import speculant` stays cheap for the CLI's --help and for tools that only need params.
    if name == "LLM":
        from speculant.llm import LLM
        return LLM
    if name == "Engine":
        from speculant.engine.engine import Engine
        return Engine
    if name == "EngineConfig":
        from speculant.engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
