import contextlib
import os
import sys

# tools/ holds oracle bindings and fixture fetchers shared by tests and scripts.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# pytest runs the engine in-process: set what pyimp's own programs set before any kernel runs
from pyimp.runtime.process import configure_process

configure_process()

# Numba's on-disk cache for the suite (set before numba is imported): outside the checkout, in
# pyimp's cache folder, where every checkout of the same sources finds the kernels another
# compiled (loaders.jit names them by their path inside the package and stamps them by the
# contents of every source they are built from), so a fresh clone does not compile them all
# again. A NUMBA_CACHE_DIR of your own wins; the tests that need a cold start make their own.
if "numba" not in sys.modules:
    from pyimp.runtime.default_model import cache_dir
    os.environ.setdefault("NUMBA_CACHE_DIR", str(cache_dir() / "numba"))


def numba_cache_for(setting: str) -> str:
    """A Numba cache folder of its own for subprocesses that compile under ``setting`` (bounds
    checks, another target's instruction set): Numba's cache key holds neither the bounds-check
    flag nor all of a target's options, so kernels compiled under one setting must never be
    loaded under another; kept beside the suite's cache, so a second run loads them."""
    from pyimp.runtime.default_model import cache_dir
    return str(cache_dir() / f"numba-{setting}")

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
        from pyimp.runtime.default_model import DefaultModelError, default_model_path
        return str(default_model_path())
    except DefaultModelError as e:
        pytest.skip(f"default model unavailable: {e}")


# Under CI=true a test may skip only for a fact of the machine the suite runs on: its
# instruction set, its Numba thread count, its operating system, a GPU. A skip whose reason
# starts with none of these (a missing model, oracle, peer, fixture or package) fails the
# test instead: CI installs everything the suite needs, so such a skip hides a comparison.
CI_MACHINE_SKIPS = (
    "this host",                         # instruction-set facts: "this host has AVX-512: ...",
                                         # "this host cannot run znver3's ...", "this host lacks ..."
    "no integer dot products on this host",
    "needs 2 Numba threads",             # a 1-vCPU machine
    "this machine has a GPU",            # the no-GPU error path cannot be shown on one
    "x86-64 targets are an x86 question",
    "needs /proc",
    "bit-exact comparison needs libggml-cpu built with",   # the peer's SIMD build follows the CPU
)


def ci_skip_allowed(reason: str) -> bool:
    """Whether a skip with ``reason`` may stand under CI=true (see CI_MACHINE_SKIPS)."""
    reason = reason.removeprefix("Skipped: ")
    return reason.startswith(CI_MACHINE_SKIPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if in_ci() and rep.skipped and isinstance(rep.longrepr, tuple) and not hasattr(rep, "wasxfail"):
        reason = str(rep.longrepr[2])
        if not ci_skip_allowed(reason):
            rep.outcome = "failed"
            rep.longrepr = (f"CI=true and this test skipped for a reason that is not a fact of "
                            f"the machine (tests/conftest.py CI_MACHINE_SKIPS): {reason}")


@pytest.hookimpl(trylast=True)          # after -k / -m deselection
def pytest_collection_modifyitems(config, items):
    # Under CI a peer that cannot run fails the whole run once, with its reason, before any
    # test starts (instead of the comparisons being skipped, or a crash killing pytest).
    if in_ci() and any("peer" in getattr(item, "fixturenames", ()) for item in items):
        from tools import llamacpp_peer
        ok, why = llamacpp_peer.probe()
        if not ok:
            pytest.exit(f"CI=true and the llama.cpp peer cannot run: {why}", returncode=1)
    # the simulator suite (one test, minutes long, one core: Python threads) starts now in a
    # process of its own and runs beside the rest; test_simulator_suite, moved to the end,
    # waits for its result
    sim = [item for item in items if item.nodeid.endswith("test_cuda.py::test_simulator_suite")]
    if sim:
        items[:] = [item for item in items if item not in sim] + sim
        import test_cuda
        test_cuda.start_simulator()


def pytest_sessionfinish(session, exitstatus):
    mod = sys.modules.get("test_cuda")
    if mod is not None:
        mod.stop_simulator()          # a session that ends early leaves no simulator running


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
    from pyimp.attention import attend as attention
    old = attention.TILED_MIN_KEYS
    attention.TILED_MIN_KEYS = 0 if path == "tiled" else 1 << 60
    try:
        yield
    finally:
        attention.TILED_MIN_KEYS = old


def count_sparse_steps(eng) -> list:
    """Make ``eng``'s block-sparse decode take the sparse kernels even where its selection
    covers every block (``SparseState.dense_fallback`` off), and return a list that gets one
    ``(layer, n_ctx)`` entry per decode attention that took the block-sparse path: a test of
    "sparse equals dense" asserts it is not empty, so it cannot compare dense with dense."""
    eng.sparse.dense_fallback = False
    ran: list = []
    eng.sparse.observe(lambda il, q, n_ctx, scale, window, sparse: sparse and ran.append((il, n_ctx)))
    return ran
