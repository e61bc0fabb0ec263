import contextlib
import os
import sys

# tools/ holds oracle bindings and fixture fetchers shared by tests and scripts.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# pytest runs the engine in-process: set what pyimp's own programs set before any kernel runs
from pyimp.runtime import configure_process  # noqa: E402

configure_process()

import pytest  # noqa: E402


def pytest_ignore_collect(collection_path, config):
    # the simulator tests need NUMBA_ENABLE_CUDASIM=1 before numba is imported: tests/test_cuda.py
    # runs them in a process of their own
    if (collection_path.name == "cuda" and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
            and os.environ.get("PYIMP_CUDA_HW") != "1"):
        return True
    return None


def in_ci() -> bool:
    """CI=true: what a test needs must be there; a skip would hide a missing comparison."""
    return os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def gemma_path() -> str:
    """The embedded default model (Gemma 3 270M Q4_K_M), written to the cache once."""
    try:
        from pyimp.default_model import DefaultModelError, default_model_path
        return str(default_model_path())
    except DefaultModelError as e:
        pytest.skip(f"default model unavailable: {e}")


def pytest_collection_modifyitems(config, items):
    # Under CI a peer that cannot run fails the whole run once, with its reason, before any
    # test starts (instead of the comparisons being skipped, or a crash killing pytest).
    if in_ci() and any("peer" in getattr(item, "fixturenames", ()) for item in items):
        from tools import llamacpp_peer
        ok, why = llamacpp_peer.probe()
        if not ok:
            pytest.exit(f"CI=true and the llama.cpp peer cannot run: {why}", returncode=1)


@pytest.fixture(scope="session")
def peer():
    """The llama.cpp peer (tools.llamacpp_peer), probed once in a subprocess; skip when it cannot run."""
    from tools import llamacpp_peer
    ok, why = llamacpp_peer.probe()
    if not ok:
        pytest.skip(f"llama.cpp peer unavailable: {why}")
    return llamacpp_peer


@contextlib.contextmanager
def prefill_path(path: str):
    """Force the dense prefill onto the flash-style kernel ("kernel") or the tiled BLAS path
    ("tiled") whatever the chunk's size (pyimp.attention.TILED_MIN_KEYS)."""
    from pyimp import attention
    old = attention.TILED_MIN_KEYS
    attention.TILED_MIN_KEYS = 0 if path == "tiled" else 1 << 60
    try:
        yield
    finally:
        attention.TILED_MIN_KEYS = old
