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


def test_no_module_imports_itself_through_others():
    """No cycle among the modules of pyimp and loaders, function-level imports included: the
    strongly connected components of the import graph are single modules."""
    grimp = pytest.importorskip("grimp", reason="grimp (import-linter's graph) is not installed")
    g = grimp.build_graph("pyimp", "loaders")
    # Tarjan's algorithm over the direct imports, iteratively
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in sorted(g.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(g.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.find_modules_directly_imported_by(w)))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    cycles = [c for c in comps if len(c) > 1]
    assert len(comps) == len(g.modules)
    assert cycles == [], f"import cycles: {cycles}"
