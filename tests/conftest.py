import os
import sys

# tools/ holds oracle bindings and fixture fetchers shared by tests and scripts.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest


@pytest.fixture(scope="session")
def gemma_path() -> str:
    """The embedded default model (Gemma 3 270M Q4_K_M), written to the cache once."""
    try:
        from pyimp.default_model import DefaultModelError, default_model_path
        return str(default_model_path())
    except DefaultModelError as e:
        pytest.skip(f"default model unavailable: {e}")
