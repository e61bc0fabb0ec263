"""The suite's CI rules (tests/conftest.py): under CI=true only machine facts may skip."""
from __future__ import annotations

import os

import pytest

from conftest import ROOT, ci_skip_allowed

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("reason, allowed", [
    ("Skipped: default model unavailable: no network", False),
    ("libggml oracle unavailable: llama_cpp not importable", False),
    ("Skipped: llama.cpp peer unavailable: SIGILL", False),
    ("llama-cpp-python (test extra) is not installed", False),
    ("Skipped: could not import 'dask.distributed': No module named 'dask'", False),
    ("this host has AVX-512: the 512-bit step compiles", True),
    ("Skipped: this host lacks part of the znver3 target's instruction set", True),
    ("no integer dot products on this host (none)", True),
    ("needs 2 Numba threads", True),
    ("Skipped: this machine has a GPU", True),
])
def test_which_skips_ci_allows(reason, allowed):
    assert ci_skip_allowed(reason) is allowed


def test_a_skip_for_a_missing_dependency_fails_under_ci(pytester, monkeypatch):
    """The hook itself, in a pytest of its own: the same two skips pass as skips without CI
    and, under CI=true, the one for a missing dependency is a failure naming its reason."""
    pytester.makeconftest(f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(ROOT, "tests", "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_runtest_makereport = suite.pytest_runtest_makereport
""")
    pytester.makepyfile("""
import pytest

def test_missing():
    pytest.skip("default model unavailable: offline")

@pytest.mark.skipif(True, reason="needs 2 Numba threads")
def test_machine():
    pass
""")
    monkeypatch.delenv("CI", raising=False)
    r = pytester.runpytest_subprocess("-rs")
    r.assert_outcomes(skipped=2)
    monkeypatch.setenv("CI", "true")
    r = pytester.runpytest_subprocess("-rf")
    r.assert_outcomes(failed=1, skipped=1)
    r.stdout.fnmatch_lines(["*not a fact of the machine*default model unavailable: offline*"])
