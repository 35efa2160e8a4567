"""paxengine: an LLM inference engine in JAX."""

__version__ = "0.1.0"

from paxengine.client import EngineClient, ModelInfo
from paxengine.config import EngineConfig
from paxengine.errors import EngineDead, EngineError, EngineOverloaded, InvalidRequest
from paxengine.sampling_params import SamplingParams
from paxengine.structured import StructuredOutputs


def __getattr__(name):
    # These pull in JAX and the model code: import them lazily so `import paxengine` stays light.
    if name == "LLM":
        from paxengine.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from paxengine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)


__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineClient",
    "ModelInfo",
    "EngineConfig",
    "SamplingParams",
    "StructuredOutputs",
    "EngineError",
    "InvalidRequest",
    "EngineOverloaded",
    "EngineDead",
    "__version__",
]
