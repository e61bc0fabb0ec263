"""Packaging: every Python package folder of the project ships in a non-editable install."""
from __future__ import annotations

import os

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_is_listed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for top in ("pyimp", "loaders"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                found.add(os.path.relpath(dirpath, ROOT).replace(os.sep, "."))
    assert found == listed
