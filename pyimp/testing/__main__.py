"""``python -m pyimp.testing --backend MODULE``: the conformance suite against a backend."""
from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\npyimp.testing: interrupted", file=sys.stderr)
        return 130


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pyimp.testing",
        description="Check a backend module's functions against pyimp's NumPy references "
                    "(interface: pydoc pyimp.testing).")
    ap.add_argument("--backend", required=True, metavar="MODULE",
                    help="importable module exporting interface functions, e.g. "
                         "pyimp.testing.backends.numba")
    ap.add_argument("--check", action="append", metavar="NAME",
                    help="run only this check or function (repeatable), e.g. matvec[Q4_K] or matvec")
    ap.add_argument("--types", nargs="+", metavar="TYPE",
                    help="ggml types of the dequantize / matvec checks (default: all supported)")
    ap.add_argument("--examples", type=int, default=25, metavar="N",
                    help="hypothesis examples per check (default 25)")
    ap.add_argument("--no-shrink", action="store_true",
                    help="report the first failing case instead of shrinking it (faster)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    if args.examples < 1:
        ap.error(f"--examples must be >= 1, got {args.examples}")
    try:
        from pyimp.testing import suite
        from pyimp.testing.strategies import TYPES
    except ImportError as e:
        print(f"pyimp.testing: {e} (install it with: pip install 'pyimp[testing]')",
              file=sys.stderr)
        return 1
    if args.types:
        bad = [t for t in args.types if t not in TYPES]
        if bad:
            ap.error(f"--types: unknown or unsupported type {bad[0]!r} (supported: "
                     f"{', '.join(TYPES)})")
    known = {c.name for c in suite.checks()} | {c.function for c in suite.checks()}
    for name in args.check or ():
        if name not in known:
            ap.error(f"--check: no check or function named {name!r} (see the table of a full run)")
    try:
        backend = importlib.import_module(args.backend)
    except SystemExit as e:
        print(f"pyimp.testing: cannot import backend {args.backend!r}: it called "
              f"sys.exit({e.code!r})", file=sys.stderr)
        return 1
    except Exception as e:      # the user's module: its import error, in one line
        print(f"pyimp.testing: cannot import backend {args.backend!r}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    # hypothesis keeps files (constants it found in the backend's source) under its home
    # folder, by default ./.hypothesis: a temporary folder here, removed afterwards
    from hypothesis import configuration
    home = tempfile.mkdtemp(prefix="pyimp-testing-hypothesis-")
    configuration.set_hypothesis_home_dir(home)
    try:
        results = suite.run_suite(backend, args.check, args.examples, not args.no_shrink,
                                  args.types)
    except ValueError as e:
        print(f"pyimp.testing: backend {args.backend}: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if args.json:
        print(json.dumps({"backend": args.backend, "results": suite.as_dicts(results)}, indent=1))
    else:
        print(f"backend {args.backend}")
        print(suite.table(results))
    return 0 if all(r.passed or r.skipped for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
