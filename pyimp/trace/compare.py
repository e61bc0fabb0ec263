"""``pyimp-compare A B``: tensor by tensor, where two tensor dumps (:mod:`pyimp.trace.dump`) differ.

A and B are pyimp dumps (``pyimp-dump``) or llama.cpp traces (``python -m
tools.llamacpp_trace``), paired by name (``<llama.cpp name>[#k]@step``). Per paired tensor:

    nmse     sum((a - b)^2) / sum(a^2), llama.cpp test-backend-ops' metric (float64 sums)
    max_abs  max |a - b|
    max_rel  max |a - b| / max |a|
    cos      a.b / (|a| |b|)

Integer tensors (token ids, block selections) are compared by exact equality. The first
divergent tensor is the first in A's graph order (its ``pyimp.trace.dump.order``) whose shape
differs, whose NMSE exceeds ``--nmse`` or, for integers, whose values differ. Tensors present
in one file only are listed (grouped by name, e.g. llama.cpp's ``kq`` which pyimp does not
produce) and are no divergence. A warning names dumps of different models (their
``model_fingerprint``) or of different prompts (their ``inp_tokens@0``): tensors of such dumps
differ by construction.

The default threshold, 1e-4: NMSE is (RMS error / RMS value)^2, so 1e-4 is a 1% RMS error.
float32 summation order alone stays below 1e-6 (measured: at most 3.2e-7 on a synthetic F32
llama against llama.cpp, every tensor of 2 layers and 3 steps), a fault (a wrong norm weight,
RoPE mode, bias or cache block) gives 1e-2..1 where it happens. Between those, a quantized
model's activations rounding one step apart in the two engines (Q8 activations, f16 caches)
grow layer by layer: on the default model the NMSE crosses 1e-4 in the second layer and
reaches 1e-3..5e-2 in the last ones (README), so there the first divergence says where the
noise passes 1%; a fault shows as a jump of orders of magnitude over its neighbours.

Exit code 0 after a comparison (divergent or not: ``--json``'s ``first_divergence`` says which),
1 for a file that cannot be read as a dump, 2 for a usage error.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

DEFAULT_NMSE = 1e-4
EXIT_ERROR = 1


def metrics(a: np.ndarray, b: np.ndarray) -> dict:
    """nmse, max_abs, max_rel, cos of b against a (same shape), in float64."""
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        same = np.array_equal(x, y, equal_nan=True)
        return {"nmse": 0.0 if same else math.inf, "max_abs": 0.0 if same else math.inf,
                "max_rel": 0.0 if same else math.inf, "cos": 1.0 if same else math.nan,
                "non_finite": True}
    d = x - y
    den = float(np.dot(x, x))
    err = float(np.dot(d, d))
    nmse = err / den if den > 0 else (0.0 if err == 0 else math.inf)
    max_abs = float(np.max(np.abs(d))) if d.size else 0.0
    amax = float(np.max(np.abs(x))) if x.size else 0.0
    max_rel = max_abs / amax if amax > 0 else (0.0 if max_abs == 0 else math.inf)
    ny = float(np.dot(y, y))
    cos = float(np.dot(x, y) / math.sqrt(den * ny)) if den > 0 and ny > 0 else \
        (1.0 if den == ny == 0 else 0.0)
    return {"nmse": nmse, "max_abs": max_abs, "max_rel": max_rel, "cos": cos}


def _trim(shape) -> tuple:
    from .record import ggml_shape
    return ggml_shape(shape)


def _group(names) -> list:
    """[(base name, count)] of a list of dump names (``kq-3#1@2`` counts under ``kq``)."""
    from .record import split_name
    counts: dict = {}
    for n in names:
        parts = split_name(n)
        base = parts[0] if parts else n
        counts[base] = counts.get(base, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def input_difference(a, b) -> str | None:
    """How the prompts of two dumps differ (their first step's token ids, else the prompt
    text where both record one), or None where they agree or cannot be told apart."""
    name = "inp_tokens@0"
    if name in a and name in b:
        x = np.asarray(a.tensor(name)).ravel().astype(np.int64)
        y = np.asarray(b.tensor(name)).ravel().astype(np.int64)
        if x.size != y.size:
            return f"{name}: a prompt of {x.size} tokens in A, {y.size} in B"
        diff = np.flatnonzero(x != y)
        if diff.size:
            i = int(diff[0])
            return (f"{name}: {diff.size} of {x.size} token ids differ, the first at index {i} "
                    f"({x[i]} in A, {y[i]} in B)")
        return None
    pa, pb = a.meta.get("prompt", ""), b.meta.get("prompt", "")
    if pa and pb and pa != pb:
        return "the prompt texts differ"
    return None


def compare(a, b, threshold: float = DEFAULT_NMSE) -> dict:
    """Compare two :class:`pyimp.trace.dump.Dump` objects; the result ``--json`` prints."""
    rows = []
    first = None
    only_a = [n for n in a.order if n not in b]
    only_b = [n for n in b.order if n not in a]
    mismatched = []
    for name in a.order:
        if name not in b:
            continue
        x, y = a.tensor(name), b.tensor(name)
        row = {"name": name, "shape": list(_trim(x.shape)[::-1])}     # ggml order (ne)
        if _trim(x.shape) != _trim(y.shape):
            row.update(status="shape mismatch", shape_b=list(_trim(y.shape)[::-1]))
            mismatched.append(name)
            rows.append(row)
            if first is None:
                first = row
            continue
        x, y = np.asarray(x).reshape(_trim(x.shape)), np.asarray(y).reshape(_trim(y.shape))
        if x.dtype.kind in "iub" or y.dtype.kind in "iub":
            diff = int(np.count_nonzero(x.astype(np.int64) != y.astype(np.int64)))
            row.update(status="equal" if diff == 0 else "differ", differing=diff)
            divergent = diff > 0
        else:
            m = metrics(x, y)
            row.update(m)
            divergent = not m["nmse"] <= threshold
            row["status"] = "diverged" if divergent else "ok"
        rows.append(row)
        if divergent and first is None:
            first = row
    worst = max((r for r in rows if "nmse" in r), key=lambda r: r["nmse"], default=None)
    inputs = input_difference(a, b)
    return {"a": a.path, "b": b.path, "producer_a": a.meta.get("producer", ""),
            "producer_b": b.meta.get("producer", ""), "threshold_nmse": threshold,
            "same_model": a.meta.get("model_fingerprint") == b.meta.get("model_fingerprint"),
            "same_input": inputs is None, "input_difference": inputs,
            "paired": len(rows), "tensors": rows, "only_in_a": only_a, "only_in_b": only_b,
            "shape_mismatch": mismatched, "first_divergence": first, "worst": worst}


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.3e}"
    return str(v)


def _json_safe(obj):
    if isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def format_table(res: dict, diverged_only: bool = False) -> str:
    """The text report: one row per paired tensor, then the summary."""
    lines = []
    w = max([len(r["name"]) for r in res["tensors"]] + [6])
    lines.append(f"{'tensor':<{w}}  {'ne':<16} {'nmse':>10} {'max_abs':>10} {'max_rel':>10} "
                 f"{'cos':>10}  status")
    for r in res["tensors"]:
        if diverged_only and r["status"] in ("ok", "equal"):
            continue
        shape = "x".join(map(str, r["shape"]))
        if r["status"] == "shape mismatch":
            lines.append(f"{r['name']:<{w}}  {shape:<16} shape mismatch: B has "
                         f"{'x'.join(map(str, r['shape_b']))}")
        elif "differing" in r:
            lines.append(f"{r['name']:<{w}}  {shape:<16} {'':>10} {'':>10} {'':>10} {'':>10}  "
                         f"{r['status']}" + (f" ({r['differing']} values)" if r["differing"] else ""))
        else:
            lines.append(f"{r['name']:<{w}}  {shape:<16} {_fmt(r['nmse']):>10} "
                         f"{_fmt(r['max_abs']):>10} {_fmt(r['max_rel']):>10} "
                         f"{r['cos']:>10.6f}  {r['status']}")
    lines.append("")
    lines.append(f"A {res['a']} ({res['producer_a']}), B {res['b']} ({res['producer_b']})"
                 + ("" if res["same_model"] else "; WARNING: the dumps are of different models "
                    "(model_fingerprint)"))
    if not res["same_input"]:
        lines.append(f"WARNING: the dumps are of different inputs ({res['input_difference']}): "
                     f"their tensors differ from the first one on")
    lines.append(f"paired {res['paired']} tensors")
    for side, key in (("A", "only_in_a"), ("B", "only_in_b")):
        names = res[key]
        if names:
            groups = ", ".join(f"{n} ({c})" for n, c in _group(names))
            lines.append(f"only in {side} ({len(names)}, not compared): {groups}")
    if res["shape_mismatch"]:
        lines.append(f"shape mismatches ({len(res['shape_mismatch'])}): "
                     f"{', '.join(res['shape_mismatch'][:8])}"
                     + (" ..." if len(res["shape_mismatch"]) > 8 else ""))
    f, t = res["first_divergence"], res["threshold_nmse"]
    if f is None:
        worst = res["worst"]
        tail = f" (largest: {worst['name']} nmse {_fmt(worst['nmse'])})" if worst else ""
        lines.append(f"no divergence: every paired tensor within nmse {t:g}{tail}")
    elif f["status"] == "shape mismatch":
        lines.append(f"first divergence (A's graph order): {f['name']}: shape mismatch "
                     f"(A {'x'.join(map(str, f['shape']))}, B {'x'.join(map(str, f['shape_b']))})")
    elif "differing" in f:
        lines.append(f"first divergence (A's graph order): {f['name']}: {f['differing']} "
                     f"values differ")
    else:
        lines.append(f"first divergence (A's graph order, nmse > {t:g}): {f['name']} nmse "
                     f"{_fmt(f['nmse'])}, max_abs {_fmt(f['max_abs'])}, max_rel "
                     f"{_fmt(f['max_rel'])}, cos {f['cos']:.6f}")
    return "\n".join(lines)


def _threshold(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nmse must be a number, got {s!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"--nmse must be a finite number >= 0, got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ..cli.common import HelpFormatter, Parser
    p = Parser(prog="pyimp-compare", formatter_class=HelpFormatter,
                description="Compare two tensor dumps (pyimp-dump, tools.llamacpp_trace): NMSE, "
                            "max abs / relative error and cosine per tensor, and the first tensor "
                            "in A's graph order where they diverge.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("a", metavar="A", help="tensor dump (its graph order decides 'first')")
    p.add_argument("b", metavar="B", help="tensor dump")
    p.add_argument("--nmse", type=_threshold, default=DEFAULT_NMSE,
                   help="divergence threshold on the NMSE (see pyimp.trace.compare's documentation "
                        "for why this default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--diverged-only", action="store_true",
                   help="table rows only for tensors over the threshold (the summary stays)")
    return p


def main(argv=None) -> int:
    from . import record as trace
    args = build_parser().parse_args(argv)
    try:
        a = trace.read(args.a)
        b = trace.read(args.b)
        res = compare(a, b, args.nmse)
    except trace.DumpError as e:
        print(f"pyimp-compare: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    try:
        if args.json:
            json.dump(_json_safe(res), sys.stdout)
            sys.stdout.write("\n")
        else:
            print(format_table(res, args.diverged_only))
        sys.stdout.flush()
    except BrokenPipeError:
        from ..cli.common import quiet_stdout
        quiet_stdout()
    return 0


if __name__ == "__main__":
    sys.exit(main())
