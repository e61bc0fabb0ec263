"""The import contract of pyproject.toml ([tool.importlinter]): loaders never imports pyimp, the
layers (commands above the engine above attention, sparse and the KV cache above the kernels)
and no import cycles, function-level imports included. Checked by import-linter's
``lint-imports``, run from the repository root."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

# the lint-imports console script, run by this interpreter
LINT_IMPORTS = ("import sys; from importlinter.cli import lint_imports_command; "
                "sys.exit(lint_imports_command())")


def test_the_import_contract_holds():
    pytest.importorskip("importlinter", reason="import-linter (test extra) is not installed")
    r = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"lint-imports failed:\n{r.stdout}\n{r.stderr}"
    assert "0 broken" in r.stdout, r.stdout
