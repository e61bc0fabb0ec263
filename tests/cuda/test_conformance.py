"""pyimp's CUDA kernels through the conformance suite (pyimp.testing), as any other backend
would run it: every exported interface function against the NumPy references."""
import pytest

from pyimp.testing import reference, suite
from pyimp.testing.backends import cuda as backend

# the simulator runs one Python thread per CUDA thread: 8 examples per check keeps the run
# near a minute (25, the command line's default, takes ~2.5 min); on a GPU use the default
EXAMPLES = 8


# every check of an exported function; importance_update has no standalone device kernel
# (the attention checks cover it), as the next test asserts
EXPORTED = [c.name for c in suite.checks() if c.function != "importance_update"]


@pytest.mark.parametrize("check", EXPORTED)
def test_cuda_backend_conforms(check):
    (r,) = suite.run_suite(backend, names=[check], max_examples=EXAMPLES)
    assert r.passed, f"{r.check}: {r.detail}"


def test_a_run_of_only_the_unexported_function_is_nothing_checked():
    with pytest.raises(ValueError, match="nothing checked"):
        suite.run_suite(backend, names=["importance_update"], max_examples=EXAMPLES)


def test_cuda_backend_exports_the_interface():
    missing = [n for n in reference.NAMES if not hasattr(backend, n)]
    assert missing == ["importance_update"]
