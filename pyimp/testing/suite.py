"""The conformance suite: every interface function a backend exports, against the reference.

A check draws cases from :mod:`pyimp.testing.strategies`, runs the backend's function and
the reference on copies of the same arrays, and compares them with the tolerance stated in
its ``tolerance`` field (the justification is in the comment beside each comparison). The
suite runs under hypothesis with a fixed seed (``derandomize``), so a run is repeatable and
a failure shrinks to a small case, which the result reports.

    from pyimp.testing import run_suite
    results = run_suite(my_backend_module)            # list[Result]
    assert all(r.passed for r in results if not r.skipped)
"""
from __future__ import annotations

import dataclasses
import io
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.reporting import with_reporter

from pyimp.choices import ANCHOR_TYPES, RETRIEVAL_TYPES, AnchorType
from pyimp.sparse.anchors import min_anchor_num
from pyimp.sparse.retrieval import ORDERED_ANCHORS

from . import reference as ref
from . import strategies as S

U32 = 2.0 ** -24        # float32 unit roundoff
EXACT_ANCHORS = ("block_max", "quest")          # maxima and minima: no rounding to disagree on


class Mismatch(AssertionError):
    """A backend's result differs from the reference beyond the check's tolerance."""


class BackendExit(Exception):
    """The backend raised SystemExit (called sys.exit) inside a check."""


@dataclass
class Check:
    name: str                       # e.g. "matvec[Q4_K]"
    function: str                   # the interface name it calls
    tolerance: str                  # as printed in the table
    cases: Callable                 # () -> hypothesis strategy of case dicts
    run: Callable                   # (backend function, case, fp16 mode) -> None, raises Mismatch


@dataclass
class Result:
    check: str
    function: str
    tolerance: str
    examples: int = 0
    passed: bool = False
    skipped: bool = False
    detail: str = ""
    case: str = ""                  # the (shrunk) failing case, described


# ----------------------------------------------------------------- helpers


def _fp16(a, mode: str):
    """The array as the backend takes fp16 buffers (float16, or its uint16 view)."""
    if isinstance(a, np.ndarray) and a.dtype == np.float16 and mode == "uint16":
        return a.view(np.uint16)
    return a


def _copy(case: dict, *names) -> list:
    return [None if case[n] is None else np.array(case[n], copy=True) for n in names]


def _at(i: int, shape) -> tuple:
    return tuple(int(x) for x in np.unravel_index(i, shape)) if len(shape) else ()


def _fail(what: str, got, want, err, tol) -> None:
    i = int(np.argmax(err > tol)) if np.ndim(err) else 0
    g, w = float(np.ravel(got)[i]), float(np.ravel(want)[i])
    t = np.ravel(np.broadcast_to(tol, np.shape(err)))[i] if np.ndim(err) else tol
    raise Mismatch(f"{what}: element {_at(i, np.shape(got))} is {g:.7g}, reference {w:.7g} "
                   f"(|diff| {abs(g - w):.3g} > tolerance {float(t):.3g}); "
                   f"{int(np.sum(err > tol))} of {np.size(err)} differ")


def describe(case) -> str:
    """A case in one line: arrays by dtype and shape, scalars by value."""
    if isinstance(case, dict):
        items = [(k, v) for k, v in case.items() if k != "rng"]
        return " ".join(f"{k}={describe(v)}" for k, v in items)
    if isinstance(case, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in case) + ")"
    if isinstance(case, np.ndarray):
        return f"{case.dtype}{list(case.shape)}"
    if isinstance(case, (float, np.floating)):
        return f"{float(case):.4g}"
    return str(case)


def _kind(x) -> str:
    """What a backend returned, for a message: dtype[shape] of an array, else the type's name."""
    if isinstance(x, np.ndarray):
        return f"{x.dtype}{list(x.shape)}"
    return type(x).__name__


def _returned(what: str, got, want: np.ndarray) -> np.ndarray:
    """A backend's returned array, which must have the dtype and shape of the reference's
    ``want`` (a NumPy array or scalar, as the interface states); Mismatch naming both if not."""
    want = np.asarray(want)
    if isinstance(got, np.generic) and not want.shape:
        got = np.asarray(got)
    if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
        raise Mismatch(f"{what}: expected {_kind(want)}, got {_kind(got)}")
    return got


def _pair(what: str, got) -> tuple:
    """A backend's (sel, cnt) result; Mismatch when it is not a pair."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        n = f" of {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise Mismatch(f"{what}: expected a pair (sel, cnt), got {_kind(got)}{n}")
    return tuple(got)


def _close(what: str, got, want, tol) -> None:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise Mismatch(f"{what}: shape {got.shape}, reference {want.shape}")
    both_inf = np.isinf(got) & np.isinf(want) & (np.sign(got) == np.sign(want))
    err = np.where(both_inf, 0.0, np.abs(got - want))
    err = np.where(np.isnan(err), np.inf, err)
    if np.any(err > tol):
        _fail(what, got, want, err, tol)


def _f16_order(a: np.ndarray) -> np.ndarray:
    """fp16 values as integers in value order (consecutive fp16 values differ by 1; +0 == -0)."""
    b = np.asarray(a, np.float16).view(np.uint16).astype(np.int64)
    return np.where(b & 0x8000, -(b & 0x7FFF), b)


def _ulps16(what: str, got, want, ulps: int) -> None:
    """fp16 arrays within ``ulps`` steps of each other. A NaN must be a NaN on both sides, with
    any payload or sign: a GPU's float -> fp16 conversion writes its canonical NaN (0x7FFF)
    where a CPU keeps the payload (an empty block's CUBOID_MEAN center is -inf + inf)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise Mismatch(f"{what}: shape {got.shape}, reference {want.shape}")
    nan_g, nan_w = np.isnan(np.asarray(got, np.float16)), np.isnan(np.asarray(want, np.float16))
    if np.any(nan_g != nan_w):
        i = int(np.argmax(nan_g != nan_w))
        idx = _at(i, got.shape)
        raise Mismatch(f"{what}: element {idx} is {float(got[idx]):.5g}, reference "
                       f"{float(want[idx]):.5g} (NaN on one side only); "
                       f"{int(np.sum(nan_g != nan_w))} of {got.size} differ so")
    d = np.where(nan_w, 0, np.abs(_f16_order(got) - _f16_order(want)))
    if np.any(d > ulps):
        i = int(np.argmax(d > ulps))
        idx = _at(i, got.shape)
        raise Mismatch(f"{what}: element {idx} is {float(got[idx]):.5g}, reference "
                       f"{float(want[idx]):.5g} "
                       f"({int(d[idx])} fp16 ulps apart, tolerance {ulps}); "
                       f"{int(np.sum(d > ulps))} of {d.size} differ")


def _equal(what: str, got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype and got.dtype.kind != want.dtype.kind:
        raise Mismatch(f"{what}: {got.dtype}{list(got.shape)}, reference "
                       f"{want.dtype}{list(want.shape)}")
    if not np.array_equal(got, want):
        i = tuple(int(x) for x in np.argwhere(got != want)[0])
        raise Mismatch(f"{what}: element {i} is {got[i].item()!r}, "
                       f"reference {want[i].item()!r} (exact comparison); "
                       f"{int(np.sum(got != want))} of {got.size} differ")


# ----------------------------------------------------------------- quantized weights


def _dequantize_check(qtype: str) -> Check:
    def run(fn, case, mode):
        raw, n = case
        want = ref.dequantize(qtype, raw, n)
        got = _returned(f"dequantize {qtype}", fn(qtype, raw.copy(), n), want)
        # exact: a block's value is one or two float32 operations on its fields, which ggml
        # (and gguf.quants) define; bit patterns compared, so -0.0 vs 0.0 counts
        _equal(f"dequantize {qtype}", got.view(np.uint32), want.view(np.uint32))
    return Check(f"dequantize[{qtype}]", "dequantize", "exact (bit patterns)",
                 lambda: S.quant_rows(qtype), run)


def _matvec_check(qtype: str) -> Check:
    def run(fn, case, mode):
        (raw, n), seed = case
        x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
        w = ref.dequantize(qtype, raw, n).astype(np.float64)
        want = w @ x.astype(np.float64)
        got = _returned(f"matvec {qtype}", fn(qtype, raw.copy(), n, x.copy()),
                        np.empty(raw.shape[0], np.float32)).astype(np.float64)
        # a float32 dot product of n exact terms, summed in any order (FMA or not), is within
        # (n + 2) u sum |w_j x_j| of the exact value (u = 2^-24); the float64 reference is exact
        # to far below that
        mag = np.abs(w) @ np.abs(x.astype(np.float64))
        tol = (n + 2) * U32 * mag
        # rows with sum |w x| near the float32 limit may overflow in some summation orders
        # (F32 / BF16 rows hold +-3.4e38): their float32 result is not defined, not compared
        ok = mag < 1e37
        _close(f"matvec {qtype}", got[ok], want[ok], tol[ok])
    return Check(f"matvec[{qtype}]", "matvec", "(n+2)*2^-24*sum|w*x| per row",
                 lambda: st.tuples(S.quant_rows(qtype, max_rows=4), st.integers(0, 2 ** 32 - 1)),
                 run)


# ----------------------------------------------------------------- attention


def _scores_bound(q, K, scale, D):
    """Error bound of float32 scores scale * q.k: (D + 2) u scale max sum_d |q_d k_d|."""
    return (D + 2) * U32 * abs(scale) * float(np.max(np.abs(q) @ np.abs(K).T, initial=0.0))


def _attention_tol(q, k_cache, v_cache, bt, n, scale, D):
    """Tolerances (out, lse) for attention over n cached tokens.

    A float32 softmax over n terms is within about (n + 16) * 2u of exact per probability
    (exp, the running max rescale and the sum), and every score error delta moves each
    probability by at most 2 delta relatively; the output is a convex combination of values,
    so its error is at most max|V| times the probability error."""
    from pyimp.attention.attend import gather_kv
    K, V = gather_kv(k_cache.astype(np.float32), v_cache.astype(np.float32), bt, n, D)
    ds = _scores_bound(q.reshape(-1, D), K.reshape(-1, D), scale, D)
    p_err = (n + 16) * 2 * U32 + 2 * ds
    vmax = float(np.max(np.abs(V), initial=0.0))
    return p_err * max(vmax, 1e-30) + 1e-30, p_err + ds


@st.composite
def _decode_cases(draw, sparse: bool = False):
    c = draw(S.paged_caches())
    sh, rng = c["shape"], c["rng"]
    n, B = c["n_ctx"], sh["B"]
    c["q"] = rng.standard_normal((sh["Hq"], sh["D"])).astype(np.float32)
    c["scale"] = float(draw(st.sampled_from((1.0 / math.sqrt(sh["D"]), 1.0, 0.3))))
    c["window"] = draw(st.sampled_from((0, 0, 1, B, n, max(1, n - 1), max(1, n // 2))))
    n_lb = -(-n // B)
    if sparse:
        nsets = draw(st.sampled_from((1, sh["Hkv"], sh["Hq"])))
        K = draw(st.integers(1, n_lb))
        sel = np.full((nsets, K), -1, np.int32)
        cnt = np.zeros(nsets, np.int32)
        for i in range(nsets):
            k = draw(st.integers(1, K))
            # the query's own block always, then any others
            rest = rng.permutation(np.arange(n_lb - 1))[:k - 1]
            sel[i, :k] = np.sort(np.concatenate([rest, [n_lb - 1]]))
            cnt[i] = k
        c["sel"], c["cnt"] = sel, cnt
        NB = c["k_cache"].shape[1]
        c["importance"] = (draw(S.importance_buffers(NB, B, sh["Hq"]))
                           if draw(st.booleans()) else None)
    return c


def _decode_run(fn, c, mode):
    out_ref = np.empty_like(c["q"])
    lse_ref = ref.attention_decode(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                   c["n_ctx"], c["scale"], c["window"], out_ref)
    out = np.full_like(c["q"], np.nan)
    k, v, q, bt = _copy(c, "k_cache", "v_cache", "q", "block_table")
    lse = _returned("attention_decode lse", fn(q, _fp16(k, mode), _fp16(v, mode), bt, c["n_ctx"],
                                               c["scale"], c["window"], out), lse_ref)
    tol_o, tol_l = _attention_tol(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                  c["n_ctx"], c["scale"], c["q"].shape[1])
    _close("attention_decode out", out, out_ref, tol_o)
    _close("attention_decode lse", lse, lse_ref, tol_l + tol_l * np.abs(lse_ref))


@st.composite
def _prefill_cases(draw):
    c = draw(S.paged_caches())
    sh, rng, n = c["shape"], c["rng"], c["n_ctx"]
    T = draw(st.integers(1, n))
    c["pos0"] = n - T
    c["q"] = rng.standard_normal((T, sh["Hq"], sh["D"])).astype(np.float32)
    c["scale"] = float(draw(st.sampled_from((1.0 / math.sqrt(sh["D"]), 1.0))))
    c["window"] = draw(st.sampled_from((0, 0, 1, sh["B"], max(1, n // 2))))
    NB = c["k_cache"].shape[1]
    c["importance"] = (draw(S.importance_buffers(NB, sh["B"], sh["Hq"]))
                       if draw(st.booleans()) else None)
    c["obs_start"] = draw(st.integers(0, n))
    return c


def _importance_within_one_ulp(what, got, want) -> None:
    # the probabilities of two correct kernels differ by float32 rounding (~1e-6 relative), so
    # the fp16 sum they store may land on either side of a rounding boundary: one fp16 ulp
    _ulps16(what, got, want, 1)


def _prefill_run(fn, c, mode):
    T = c["q"].shape[0]
    out_ref = np.empty_like(c["q"])
    imp_ref = None if c["importance"] is None else c["importance"].copy()
    lse_ref = ref.attention_prefill(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                    c["pos0"], c["scale"], c["window"], out_ref, imp_ref,
                                    c["obs_start"])
    out = np.full_like(c["q"], np.nan)
    k, v, q, bt, imp = _copy(c, "k_cache", "v_cache", "q", "block_table", "importance")
    lse = _returned("attention_prefill lse",
                    fn(q, _fp16(k, mode), _fp16(v, mode), bt, c["pos0"], c["scale"], c["window"],
                       out, _fp16(imp, mode), c["obs_start"]), lse_ref)
    tol_o, tol_l = _attention_tol(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                  c["pos0"] + T, c["scale"], c["q"].shape[2])
    _close("attention_prefill out", out, out_ref, tol_o)
    _close("attention_prefill lse", lse, lse_ref, tol_l + tol_l * np.abs(lse_ref))
    if imp is not None:
        _importance_within_one_ulp("attention_prefill importance", imp, imp_ref)


def _sparse_run(fn, c, mode):
    out_ref = np.empty_like(c["q"])
    imp_ref = None if c["importance"] is None else c["importance"].copy()
    lse_ref = ref.sparse_attention_decode(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                          c["n_ctx"], c["scale"], c["window"], c["sel"],
                                          c["cnt"], out_ref, imp_ref)
    out = np.full_like(c["q"], np.nan)
    k, v, q, bt, sel, cnt, imp = _copy(c, "k_cache", "v_cache", "q", "block_table", "sel", "cnt",
                                       "importance")
    lse = _returned("sparse_attention_decode lse",
                    fn(q, _fp16(k, mode), _fp16(v, mode), bt, c["n_ctx"], c["scale"], c["window"],
                       sel, cnt, out, _fp16(imp, mode)), lse_ref)
    tol_o, tol_l = _attention_tol(c["q"], c["k_cache"], c["v_cache"], c["block_table"],
                                  c["n_ctx"], c["scale"], c["q"].shape[1])
    # a head whose selected blocks the window hides entirely attends to nothing: out 0, lse -inf
    _close("sparse_attention_decode out", out, out_ref, tol_o)
    _close("sparse_attention_decode lse", lse, lse_ref,
           tol_l + tol_l * np.abs(np.where(np.isfinite(lse_ref), lse_ref, 0.0)))
    if imp is not None:
        _importance_within_one_ulp("sparse_attention_decode importance", imp, imp_ref)


# ----------------------------------------------------------------- importance


@st.composite
def _update_cases(draw):
    sh = draw(S.gqa_shapes())
    c = draw(S.paged_caches(shape=sh))
    NB, B, Hq, n = c["k_cache"].shape[1], sh["B"], sh["Hq"], c["n_ctx"]
    rng = c["rng"]
    kind = draw(st.sampled_from(("probs", "large", "tiny")))
    new = rng.random((Hq, n)) * {"probs": 1.0, "large": 3000.0, "tiny": 1e-3}[kind]
    return dict(importance=draw(S.importance_buffers(NB, B, Hq)), block_table=c["block_table"],
                new=new.astype(np.float32), pos_lo=draw(st.integers(0, n)),
                decay=float(draw(st.sampled_from((1.0, 1.0, 0.5, 0.9, 0.999)))))


def _update_run(fn, c, mode):
    imp_ref = c["importance"].copy()
    ref.importance_update(imp_ref, c["block_table"], c["new"], c["pos_lo"], c["decay"])
    imp, bt, new = _copy(c, "importance", "block_table", "new")
    fn(_fp16(imp, mode), bt, new, c["pos_lo"], c["decay"])
    # exact: one float32 multiply (decay), one add, the clamp and one round-to-nearest-even
    # to fp16 are each correctly rounded, so any correct implementation gives these bits
    _equal("importance_update", imp.view(np.uint16), imp_ref.view(np.uint16))


# ----------------------------------------------------------------- anchors and retrieval


@st.composite
def _anchor_cases(draw, anchor_type: str):
    c = draw(S.paged_caches())
    sh, rng = c["shape"], c["rng"]
    NB, B = c["k_cache"].shape[1], sh["B"]
    lo = min_anchor_num(AnchorType(anchor_type))
    A = draw(st.integers(lo, max(lo, min(B, 4))))
    n_lb = c["block_table"].size
    blocks = c["block_table"].astype(np.int64)
    n_valid = np.minimum(B, c["n_ctx"] - np.arange(n_lb) * B).astype(np.int64)
    if draw(st.booleans()):                     # an empty block among them sometimes
        spare = np.setdiff1d(np.arange(NB), blocks)
        if spare.size:
            blocks = np.append(blocks, spare[0])
            n_valid = np.append(n_valid, 0)
    imp = None
    if anchor_type == "dynamic":
        # distinct importances within each block, so "the A most important" has one answer
        imp = np.stack([rng.permutation(B) for _ in range(NB * sh["Hq"])]).reshape(
            NB, sh["Hq"], B).transpose(0, 2, 1).astype(np.float16)
    anchor = np.full((NB, A, sh["Hq"], sh["D"]), 7.0, np.float16)
    return dict(c, blocks=blocks, n_valid=n_valid, anchor=anchor, importance=imp)


def _anchor_check(anchor_type: str) -> Check:
    def run(fn, c, mode):
        a_ref = c["anchor"].copy()
        ref.compute_anchors(anchor_type, c["k_cache"], c["blocks"], c["n_valid"], a_ref,
                            c["importance"])
        a, k, blocks, n_valid, imp = _copy(c, "anchor", "k_cache", "blocks", "n_valid",
                                           "importance")
        fn(anchor_type, _fp16(k, mode), blocks, n_valid, _fp16(a, mode), _fp16(imp, mode))
        # maxima / minima (rounded outward to fp16 for quest) are exact; means and sums of
        # float32 keys in another order may round to the neighbouring fp16 value
        _ulps16(f"compute_anchors {anchor_type}", a, a_ref,
                0 if anchor_type in EXACT_ANCHORS else 1)
    tol = "exact (fp16 bits)" if anchor_type in EXACT_ANCHORS else "1 fp16 ulp"
    return Check(f"compute_anchors[{anchor_type}]", "compute_anchors", tol,
                 lambda: _anchor_cases(anchor_type), run)


@st.composite
def _score_cases(draw, integer: bool = False):
    sh = draw(S.gqa_shapes())
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    n_lb = draw(st.integers(1, 8))
    NB = n_lb + draw(st.integers(0, 2))
    bt = rng.permutation(NB)[:n_lb].astype(np.int32)
    A = draw(st.integers(1, 3))
    shp_a, shp_q = (NB, A, sh["Hq"], sh["D"]), (sh["Hq"], sh["D"])
    if integer:     # small integers: every score is exact in float32, so rankings are too
        anchor = rng.integers(-4, 5, shp_a).astype(np.float16)
        q = rng.integers(-3, 4, shp_q).astype(np.float32)
    else:
        anchor = rng.standard_normal(shp_a).astype(np.float16)
        q = rng.standard_normal(shp_q).astype(np.float32)
    lb_start = draw(st.integers(0, n_lb - 1))
    return dict(sh=sh, anchor=anchor, q=q, block_table=bt, A=A, lb_start=lb_start,
                lb_end=draw(st.integers(lb_start, n_lb)), n_slots=draw(st.integers(1, A)),
                rng=rng, n_lb=n_lb)


def _scores_run(fn, c, mode):
    G = c["sh"]["G"]
    want = ref.block_scores(c["q"], c["anchor"], c["block_table"], c["lb_start"], c["lb_end"],
                            c["n_slots"], G)
    q, a, bt = _copy(c, "q", "anchor", "block_table")
    got = _returned("block_scores", fn(q, _fp16(a, mode), bt, c["lb_start"], c["lb_end"],
                                       c["n_slots"], G), want)
    # a float32 sum of D exact-ish products (each max_a a*q is one rounding): within
    # (D + 2) u sum_d max_a |a q| of the float64 value
    an = c["anchor"][c["block_table"][c["lb_start"]:c["lb_end"]], :c["n_slots"]].astype(np.float64)
    tol = (c["q"].shape[1] + 2) * U32 * np.abs(an * c["q"][None, None]).max(axis=1).sum(axis=-1)
    _close("block_scores", got, want, tol)


@st.composite
def _select_cases(draw):
    B = draw(st.sampled_from((1, 2, 4, 8)))
    n_ctx = draw(st.integers(1, 12 * B))
    init, pick, local = (draw(st.integers(0, 3)) for _ in range(3))
    F = n_ctx // B
    from pyimp.sparse.retrieval import n_candidates
    C = n_candidates(n_ctx, B, init, local) if F > init + pick + local else 0
    nsets = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    # integer-valued scores: ties on purpose (the lower block wins), and a NaN now and then
    scores = rng.integers(-3, 4, (C, nsets)).astype(np.float32)
    if C and draw(st.booleans()):
        scores[rng.integers(0, C), rng.integers(0, nsets)] = np.nan
    return dict(scores=scores, n_ctx=n_ctx, B=B, init=init, pick=pick, local=local)


def _select_run(fn, c, mode):
    want = ref.select_blocks(c["scores"], c["n_ctx"], c["B"], c["init"], c["pick"], c["local"])
    got = _pair("select_blocks", fn(c["scores"].copy(), c["n_ctx"], c["B"], c["init"], c["pick"],
                                    c["local"]))
    _equal("select_blocks sel", _returned("select_blocks sel", got[0], want[0]), want[0])
    _equal("select_blocks cnt", _returned("select_blocks cnt", got[1], want[1]), want[1])


@st.composite
def _retrieve_cases(draw):
    c = draw(_score_cases(integer=True))
    sh = c["sh"]
    B = draw(st.sampled_from((1, 2, 4)))
    c["anchor_type"] = draw(st.sampled_from(ANCHOR_TYPES))
    if AnchorType(c["anchor_type"]) in ORDERED_ANCHORS:
        if c["A"] < 2:
            c["anchor"] = np.concatenate([c["anchor"]] * 2, axis=1)
        hi = np.maximum(c["anchor"][:, 0], c["anchor"][:, 1])  # slot 0 >= slot 1, as stored
        lo = np.minimum(c["anchor"][:, 0], c["anchor"][:, 1])
        c["anchor"][:, 0], c["anchor"][:, 1] = hi, lo
    if c["anchor_type"] != "dynamic":           # shared: one value per GQA group
        G = sh["G"]
        c["anchor"] = np.repeat(c["anchor"][:, :, ::G], G, axis=2)
    c["n_ctx"] = draw(st.integers((c["n_lb"] - 1) * B + 1, c["n_lb"] * B))
    c["B"] = B
    c["retrieval_type"] = draw(st.sampled_from(RETRIEVAL_TYPES))
    c["init"], c["pick"], c["local"] = (draw(st.integers(0, 2)) for _ in range(3))
    return c


def _retrieve_run(fn, c, mode):
    args = (c["n_ctx"], c["B"], c["sh"]["Hkv"], c["retrieval_type"], c["init"], c["pick"],
            c["local"], c["anchor_type"])
    want = ref.retrieve_blocks(c["q"], c["anchor"], c["block_table"], *args)
    q, a, bt = _copy(c, "q", "anchor", "block_table")
    got = _pair("retrieve_blocks", fn(q, _fp16(a, mode), bt, *args))
    # exact: integer anchors and queries make every score exact, so the ranking (ties to the
    # lower block) has one answer
    _equal("retrieve_blocks sel", _returned("retrieve_blocks sel", got[0], want[0]), want[0])
    _equal("retrieve_blocks cnt", _returned("retrieve_blocks cnt", got[1], want[1]), want[1])


# ----------------------------------------------------------------- the suite


def checks(types=None) -> list[Check]:
    """Every check, in interface order; ``types``: the ggml type names of the weight checks
    (default: every supported type)."""
    types = list(types or S.TYPES)
    out = [_dequantize_check(t) for t in types] + [_matvec_check(t) for t in types]
    out += [
        Check("attention_decode", "attention_decode", "out: max|V| * p_err; lse: p_err + score",
              _decode_cases, _decode_run),
        Check("attention_prefill", "attention_prefill",
              "as decode; importance within 1 fp16 ulp", _prefill_cases, _prefill_run),
        Check("sparse_attention_decode", "sparse_attention_decode",
              "as decode; importance within 1 fp16 ulp", lambda: _decode_cases(sparse=True),
              _sparse_run),
        Check("importance_update", "importance_update", "exact (fp16 bits)", _update_cases,
              _update_run),
    ]
    out += [_anchor_check(a) for a in ANCHOR_TYPES]
    out += [
        Check("block_scores", "block_scores", "(D+2)*2^-24*sum|a*q| per score", _score_cases,
              _scores_run),
        Check("select_blocks", "select_blocks", "exact", _select_cases, _select_run),
        Check("retrieve_blocks", "retrieve_blocks", "exact (integer-valued data)",
              _retrieve_cases, _retrieve_run),
    ]
    return out


def run_check(check: Check, fn, fp16: str = "float16", max_examples: int = 25,
              shrink: bool = True) -> Result:
    """Run one check against ``fn``; the Result says whether it passed and, if not, the
    smallest failing case hypothesis found and the mismatch."""
    res = Result(check.name, check.function, check.tolerance)
    phases = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if shrink else ())

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
              phases=phases, suppress_health_check=list(HealthCheck), print_blob=False)
    @given(check.cases())
    def probe(case):
        res.examples += 1
        res.case = describe(case)
        with np.errstate(all="ignore"):     # inf / NaN in a result are compared, not warned of
            try:
                check.run(fn, case, fp16)
            except SystemExit as e:
                raise BackendExit(f"called sys.exit({e.code!r}) (SystemExit) in "
                                  f"{check.function}") from None

    log = io.StringIO()
    try:
        with with_reporter(lambda s: log.write(str(s) + "\n")):
            probe()
        res.passed = True
        res.case = ""
    except (Mismatch, BackendExit) as e:
        res.detail = str(e)
    except Exception as e:      # a backend that raises fails the check, with its error
        tb = traceback.extract_tb(e.__traceback__)[-1]
        res.detail = f"raised {type(e).__name__}: {e} ({tb.filename}:{tb.lineno})"
    return res


def run_suite(backend, names=None, max_examples: int = 25, shrink: bool = True,
              types=None) -> list[Result]:
    """Check every interface function ``backend`` (a module or any object with attributes)
    exports; functions it does not export are reported as skipped, and a ValueError says
    when that leaves nothing to check. ``names``: only the checks whose name or function is
    listed. The backend may set ``FP16 = "uint16"`` to receive fp16
    arrays as uint16 views."""
    fp16 = getattr(backend, "FP16", "float16")
    if fp16 not in ("float16", "uint16"):
        raise ValueError(f"backend FP16 must be 'float16' or 'uint16', got {fp16!r}")
    out = []
    for chk in checks(types):
        if names and chk.name not in names and chk.function not in names:
            continue
        fn = getattr(backend, chk.function, None)
        if fn is None:
            out.append(Result(chk.name, chk.function, chk.tolerance, skipped=True,
                              detail="not exported"))
            continue
        out.append(run_check(chk, fn, fp16, max_examples, shrink))
    if not out:
        raise ValueError(f"no check or function is named {', '.join(names)}: nothing checked")
    if all(r.skipped for r in out):
        which = ", ".join(sorted({r.function for r in out}))
        raise ValueError(f"exports none of the functions checked ({which}): nothing checked")
    return out


def table(results: list[Result]) -> str:
    """A pass / fail table of results, one line each."""
    rows = [("check", "result", "examples", "tolerance", "detail")]
    for r in results:
        status = "skip" if r.skipped else ("PASS" if r.passed else "FAIL")
        detail = r.detail + (f" [case: {r.case}]" if r.case and not r.passed else "")
        rows.append((r.check, status, str(r.examples) if not r.skipped else "-", r.tolerance,
                     detail))
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(row[:4])) + ("  " + row[4] if row[4]
                                                                       else "") for row in rows]
    n_fail = sum(1 for r in results if not r.skipped and not r.passed)
    n_pass = sum(1 for r in results if r.passed)
    lines.append(f"{n_pass} passed, {n_fail} failed, {sum(r.skipped for r in results)} skipped")
    return "\n".join(lines)


def as_dicts(results: list[Result]) -> list[dict]:
    return [dataclasses.asdict(r) for r in results]
