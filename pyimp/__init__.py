"""pyimp: reference engine for importance-guided KV caching over GGUF models."""

__version__ = "0.1.0"
