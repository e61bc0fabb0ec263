"""pyimp: reference engine for importance-guided KV caching over GGUF models.

``pyimp.load(path=None, **options) -> Engine`` (None = the embedded default model).
The engine is imported on first use, so light entry points (pyimp-tokenize,
``--help``) do not pay for Numba.
"""

__version__ = "0.1.0"
__all__ = ["load", "Engine", "EngineOptions", "EngineBusyError", "SamplingParams"]


def __getattr__(name):
    if name in ("load", "Engine", "EngineOptions", "EngineBusyError"):
        from . import engine
        return getattr(engine, name)
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'pyimp' has no attribute {name!r}")
