"""paxengine: an LLM inference engine in JAX."""
__version__ = "0.1.0"
