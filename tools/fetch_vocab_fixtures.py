"""llama.cpp's tokenizer conformance files, extracted once into the user cache.

llama.cpp ships vocabulary-only GGUF files with test strings and expected ids
(``models/ggml-vocab-*.gguf`` plus ``.inp``/``.out``). The llama-cpp-python
0.3.36 source distribution on PyPI vendors that tree; this script fetches the
sdist (or uses a local copy), extracts only those files into
``<cache>/vocab-fixtures/`` and returns that folder. The extraction happens once:
it is written to a temporary folder and renamed into place, so a crash or a
concurrent run never leaves a half-filled folder behind.

    python -m tools.fetch_vocab_fixtures [--sdist PATH]

``<cache>`` is ``$PYIMP_CACHE``, else ``$XDG_CACHE_HOME/pyimp``, else
``~/.cache/pyimp``. ``$PYIMP_LLAMA_CPP_SDIST`` may name a local copy of the
sdist (same as ``--sdist``).

This runs in the install step (README, ``.ci/run``), never during the tests:
the tests call :func:`locate_fixtures`, which only looks. The files are not
vendored into the repository: llama.cpp's MIT license would allow it, but the
vocabulary GGUFs of 0.3.36 are 75 MB (the largest 15.8 MB); only the
``.inp``/``.out`` test texts are small (~2 kB each).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from pyimp.runtime.default_model import cache_dir

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
PYPI_JSON = f"https://pypi.org/pypi/{PACKAGE}/{VERSION}/json"
PYPI_PROJECT_JSON = f"https://pypi.org/pypi/{PACKAGE}/json"
MEMBER_DIR = "/vendor/llama.cpp/models/"
MEMBER_PREFIX = "ggml-vocab-"
STAMP = ".complete"
FETCH_COMMAND = "python -m tools.fetch_vocab_fixtures"


class FixtureError(RuntimeError):
    """The fixtures cannot be provided; the message says why."""


def _sdist_url() -> tuple[str, str]:
    """(url, sha256) of the source distribution, from PyPI's JSON API."""
    errors = []
    for api in (PYPI_JSON, PYPI_PROJECT_JSON):
        try:
            with urllib.request.urlopen(api, timeout=60) as r:
                info = json.load(r)
        except (OSError, ValueError) as e:
            errors.append(f"{api}: {e}")
            continue
        files = info.get("urls") if api == PYPI_JSON else info.get("releases", {}).get(VERSION)
        for f in files or []:
            if f.get("packagetype") == "sdist":
                # mirrors may list the file relative to the API address
                return urllib.parse.urljoin(api, f["url"]), f.get("digests", {}).get("sha256", "")
        errors.append(f"{api}: no source distribution listed for {VERSION}")
    raise FixtureError("cannot locate the sdist on PyPI (" + "; ".join(errors) + ")")


def _download(url: str, sha256: str, dest: Path) -> None:
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as r, open(dest, "wb") as f:
            for chunk in iter(lambda: r.read(1 << 20), b""):
                h.update(chunk)
                f.write(chunk)
    except OSError as e:
        raise FixtureError(f"download of {url} failed: {e}") from None
    if sha256 and h.hexdigest() != sha256:
        raise FixtureError(f"{url}: sha256 {h.hexdigest()} does not match PyPI's {sha256}")


def _extract(sdist: Path, into: Path) -> int:
    """Copy the ggml-vocab-* members of ``sdist`` into ``into``; returns their count."""
    n = 0
    try:
        with tarfile.open(sdist, "r:*") as tar:
            for m in tar:
                name = m.name
                i = name.find(MEMBER_DIR)
                if i < 0 or not m.isfile():
                    continue
                base = name[i + len(MEMBER_DIR):]
                if "/" in base or not base.startswith(MEMBER_PREFIX):
                    continue
                src = tar.extractfile(m)
                with open(into / base, "wb") as f:
                    shutil.copyfileobj(src, f)
                n += 1
    except (OSError, tarfile.TarError) as e:
        raise FixtureError(f"cannot read {sdist}: {e}") from None
    return n


def fixtures_location() -> Path:
    """Where the fixtures are (or will be) extracted: ``<cache>/vocab-fixtures``."""
    return cache_dir() / "vocab-fixtures"


def locate_fixtures() -> Path | None:
    """The fixture folder when a complete extraction is there, else None.

    Only looks: never downloads or writes (the tests use this; fetching is the
    install step's job, ``FETCH_COMMAND``).
    """
    dest = fixtures_location()
    return dest if (dest / STAMP).is_file() else None


def fixtures_dir(sdist: str | os.PathLike | None = None) -> Path:
    """Folder holding ``ggml-vocab-*.gguf`` (+ ``.inp``/``.out``); fetched on first use.

    ``sdist``: a local llama-cpp-python 0.3.36 source tarball to extract from
    instead of downloading it (also ``$PYIMP_LLAMA_CPP_SDIST``).
    """
    found = locate_fixtures()
    if found is not None:
        return found
    dest = fixtures_location()
    sdist = sdist or os.environ.get("PYIMP_LLAMA_CPP_SDIST") or None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".vocab-fixtures-") as tmp:
        tmp = Path(tmp)
        if sdist is None:
            url, sha256 = _sdist_url()
            archive = tmp / "sdist.tar.gz"
            _download(url, sha256, archive)
        else:
            archive = Path(sdist)
            if not archive.is_file():
                raise FixtureError(f"{archive}: no such file")
        out = tmp / "vocab-fixtures"
        out.mkdir()
        if _extract(archive, out) == 0:
            raise FixtureError(f"{archive}: holds no {MEMBER_DIR}{MEMBER_PREFIX}* files")
        (out / STAMP).write_text(f"{PACKAGE}=={VERSION}\n")
        if dest.exists() and not (dest / STAMP).exists():
            shutil.rmtree(dest, ignore_errors=True)  # leftover of an older, interrupted layout
        try:
            os.replace(out, dest)
        except OSError:
            if not (dest / STAMP).exists():  # not a concurrent run that finished first
                raise
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdist", help="local llama-cpp-python 0.3.36 source tarball to use instead of PyPI")
    a = p.parse_args(argv)
    try:
        d = fixtures_dir(a.sdist)
    except FixtureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
