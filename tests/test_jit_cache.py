"""loaders.jit: cached kernels go stale when any module they are built from changes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from loaders import jit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HELPER = """
from loaders import jit
jit.kernel_module(__file__)

@jit.njit(inline="always")
def value():
    return {value}
"""

KERNEL = """
from loaders import jit
import helper
jit.kernel_module(__file__, helper)

@jit.njit
def kernel(x):
    return x + helper.value()
"""

SPECIALIZED = """
from loaders import jit
import helper
jit.kernel_module(__file__, helper)

@jit.njit(inline="always")
def _driver(x, k):
    return x * k + helper.value()

for _k in (2, 3):
    jit.specialize(globals(), f"kernel{_k}", "x", f"return _driver(x, {_k})")
kernel = kernel3
"""

PLAIN_HELPER = """
from numba import njit

@njit(cache=True, inline="always")
def value():
    return {value}
"""

PLAIN_KERNEL = """
from numba import njit
import helper

@njit(cache=True)
def kernel(x):
    return x + helper.value()
"""


def _run(folder, cache_dir) -> tuple[int, int, int]:
    """(kernel(10), cache hits, cache misses) in a fresh process."""
    code = ("import kernel; r = kernel.kernel(10); "
            "print(r, sum(kernel.kernel.stats.cache_hits.values()), "
            "sum(kernel.kernel.stats.cache_misses.values()))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), ROOT]), NUMBA_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return tuple(int(v) for v in r.stdout.split())


def _write(folder, helper_src, kernel_src, value):
    (folder / "helper.py").write_text(textwrap.dedent(helper_src.format(value=value)))
    (folder / "kernel.py").write_text(textwrap.dedent(kernel_src))
    # a later edit must not hide behind an equal mtime on coarse file systems
    st = os.stat(folder / "helper.py")
    os.utime(folder / "helper.py", ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000 * value))


def test_editing_a_dependency_recompiles_the_kernel(tmp_path):
    _write(tmp_path, HELPER, KERNEL, 1)
    assert _run(tmp_path, tmp_path / "cache") == (11, 0, 1)       # compiled, saved
    assert _run(tmp_path, tmp_path / "cache") == (11, 1, 0)       # loaded from the cache
    _write(tmp_path, HELPER, KERNEL, 2)                           # only the helper changes
    assert _run(tmp_path, tmp_path / "cache") == (12, 0, 1)       # stale entry not used
    assert _run(tmp_path, tmp_path / "cache") == (12, 1, 0)


def test_specialized_kernels_are_cached_and_go_stale(tmp_path):
    # per-type kernels defined from a table row: cached like hand-written ones
    _write(tmp_path, HELPER, SPECIALIZED, 1)
    assert _run(tmp_path, tmp_path / "cache") == (31, 0, 1)
    assert _run(tmp_path, tmp_path / "cache") == (31, 1, 0)
    _write(tmp_path, HELPER, SPECIALIZED, 2)
    assert _run(tmp_path, tmp_path / "cache") == (32, 0, 1)
    assert _run(tmp_path, tmp_path / "cache") == (32, 1, 0)


def test_specialize_refuses_a_name_in_use():
    ns = {"__file__": __file__, "__name__": "m", "taken": 1}
    with pytest.raises(ValueError, match="taken"):
        jit.specialize(ns, "taken", "x", "return x")
    with pytest.raises(ValueError, match="not a new identifier"):
        jit.specialize(ns, "no good", "x", "return x")


def test_plain_numba_cache_is_what_goes_stale(tmp_path):
    # the failure mode loaders.jit exists for: Numba's own stamp covers only kernel.py
    _write(tmp_path, PLAIN_HELPER, PLAIN_KERNEL, 1)
    assert _run(tmp_path, tmp_path / "cache")[0] == 11
    _write(tmp_path, PLAIN_HELPER, PLAIN_KERNEL, 2)
    assert _run(tmp_path, tmp_path / "cache")[0] == 11           # stale: the helper now says 2


def test_closure_and_stamp(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.py", "b.py", "c.py"))
    for f in (a, b, c):
        f.write_text("x = 1\n")
    jit.kernel_module(a, str(b))
    jit.kernel_module(b, str(c))
    assert jit.closure(a) == sorted(os.path.realpath(f) for f in (a, b, c))
    before = jit.sources_stamp(a)
    assert jit.sources_stamp(a) == before
    c.write_text("x = 2\n")
    assert jit.sources_stamp(a) != before                         # a transitive edit counts
    assert jit.sources_stamp(c) != before


def test_undeclared_module_and_fastmath_are_refused():
    with pytest.raises(RuntimeError, match="kernel_module"):
        ns = {}
        exec(compile("def f(x):\n    return x\n", "/nonexistent/undeclared.py", "exec"), ns)
        jit.njit(ns["f"])
    with pytest.raises(ValueError, match="fastmath"):
        jit.njit(fastmath=True)


def test_two_checkouts_of_the_same_sources_share_a_cache_dir(tmp_path):
    """Under NUMBA_CACHE_DIR a kernel compiled from one folder is loaded from another holding
    the same sources (a fresh clone elsewhere), and an edit in one of them is still a miss."""
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        _write(folder, HELPER, KERNEL, 1)
    assert _run(a, tmp_path / "cache") == (11, 0, 1)             # compiled in a, saved
    assert _run(b, tmp_path / "cache") == (11, 1, 0)             # b loads a's kernel
    _write(b, HELPER, KERNEL, 2)
    assert _run(b, tmp_path / "cache") == (12, 0, 1)             # b's helper differs: compiled


def test_portable_name_is_the_path_inside_the_package():
    assert jit.portable_name(jit.__file__) == os.path.join("loaders", "jit.py")
