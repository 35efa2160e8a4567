"""paxengine: an LLM inference engine in JAX."""
__version__ = "0.1.0"

from paxengine.config import EngineConfig
from paxengine.sampling_params import SamplingParams


def __getattr__(name):
    # LLM pulls in JAX and the model code: import it lazily so `import paxengine` stays light.
    if name == "LLM":
        from paxengine.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "EngineConfig", "SamplingParams", "__version__"]
