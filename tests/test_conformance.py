"""The conformance suite (pyimp.testing): pyimp's kernels pass it, seeded mutants fail it.

Each mutant is the Numba backend with one minimal, realistic bug in one function; the suite
must name that function's check as failed. The mutants are the bugs the design notes list
for block-sparse KV caches (docs/kvcache.md section 9) plus two classic kernel slips.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from loaders.ggml_types import FP16_FIELDS

pytest.importorskip("hypothesis")

from pyimp.testing import reference, suite
from pyimp.testing.backends import numba as nb

EXAMPLES = 25          # the CLI's default


def _failed(results, name):
    (r,) = [r for r in results if r.check == name]
    return not r.passed and not r.skipped, r


def test_numba_backend_passes_the_suite():
    results = suite.run_suite(nb, max_examples=EXAMPLES)
    bad = [f"{r.check}: {r.detail}" for r in results if not r.passed]
    assert not bad, "\n".join(bad)
    assert len(results) == len(suite.checks())          # every check ran, none skipped


def test_reference_passes_and_exports_every_name():
    assert all(callable(getattr(reference, n)) for n in reference.NAMES)
    assert {c.function for c in suite.checks()} == set(reference.NAMES)
    results = suite.run_suite(reference, max_examples=10)
    assert all(r.passed for r in results), suite.table(results)


# ----------------------------------------------------------------- mutants


def _mutant(**fns) -> types.SimpleNamespace:
    """The Numba backend with some functions replaced."""
    base = {n: getattr(nb, n) for n in reference.NAMES}
    base.update(fns)
    return types.SimpleNamespace(FP16="float16", **base)


def _interleaved_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window, out):
    """GQA mapping bug: query head h reads kv head h % Hkv instead of h // G."""
    Hkv = k_cache.shape[0]
    lse = np.empty(q.shape[0], np.float32)
    for h in range(q.shape[0]):
        kv = h % Hkv
        o = np.empty((1, q.shape[1]), np.float32)
        lse[h] = nb.attention_decode(q[h:h + 1].copy(), k_cache[kv:kv + 1].copy(),
                                     v_cache[kv:kv + 1].copy(), block_table, n_ctx, scale,
                                     window, o)[0]
        out[h] = o[0]
    return lse


def _truncating_update(importance, block_table, new, pos_lo=0, decay=1.0):
    """fp16 store bug: the float32 sum is truncated toward zero instead of rounded to nearest."""
    B = importance.shape[1]
    p = np.arange(new.shape[1])
    rows = p if decay != 1.0 else p[p >= pos_lo]
    pb, t = block_table[rows // B], rows % B
    add = new.T[rows].astype(np.float32) * (rows >= pos_lo)[:, None]
    old = importance[pb, t].astype(np.float32)
    x = np.minimum((np.float32(decay) * old if decay != 1.0 else old) + add, np.float32(65504))
    y = x.astype(np.float16)
    up = np.abs(y.astype(np.float32)) > np.abs(x)
    y[up] = np.nextafter(y[up], np.float16(0))
    importance[pb, t] = y


def _tail_dropping_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window, out):
    """Block count bug: a tail block holding a single token is not attended."""
    B = k_cache.shape[2] // q.shape[1]
    if n_ctx > 1 and n_ctx % B == 1:
        n_ctx -= 1
    return nb.attention_decode(q, k_cache, v_cache, block_table, n_ctx, scale, window, out)


def _quest_at_kv_index(anchor_type, k_cache, blocks, n_valid, anchor, importance=None):
    """The public reference's QUEST bug: each kv head's bound is written into query-head slot
    kv_head (not into its G query heads' slots); the other slots keep what they held."""
    if anchor_type != "quest":
        return nb.compute_anchors(anchor_type, k_cache, blocks, n_valid, anchor, importance)
    full = anchor.copy()
    nb.compute_anchors(anchor_type, k_cache, blocks, n_valid, full, importance)
    Hkv = k_cache.shape[0]
    G = anchor.shape[2] // Hkv
    for kvh in range(Hkv):
        anchor[blocks, :, kvh] = full[blocks, :, kvh * G]


MUTANTS = {
    "interleaved GQA mapping": (dict(attention_decode=_interleaved_decode), "attention_decode"),
    "fp16 truncation": (dict(importance_update=_truncating_update), "importance_update"),
    "dropped one-token tail": (dict(attention_decode=_tail_dropping_decode), "attention_decode"),
    "QUEST bound at the kv-head index": (dict(compute_anchors=_quest_at_kv_index),
                                         "compute_anchors[quest]"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_suite_catches_the_mutant(mutant):
    fns, check = MUTANTS[mutant]
    name = next(iter(fns))
    results = suite.run_suite(_mutant(**fns), names=[name], max_examples=EXAMPLES)
    failed, r = _failed(results, check)
    assert failed, f"the suite let the {mutant} mutant through: {r}"
    assert "raised" not in r.detail, r.detail        # a wrong answer, not a crash
    # every other check of that function still passes: the suite points at the bug
    others = [x for x in results if x.check != check]
    assert all(x.passed for x in others), suite.table(others)


def test_mutants_are_minimal():
    """Each mutant agrees with the reference on the cases its bug does not touch (so the suite
    catches it by its case coverage, not because the mutant is broken everywhere)."""
    rng = np.random.default_rng(0)
    Hkv, G, D, B, n = 1, 1, 8, 4, 6          # one kv head, no one-token tail
    k = rng.standard_normal((Hkv, 2, B * D)).astype(np.float16)
    v = rng.standard_normal((Hkv, 2, D * B)).astype(np.float16)
    bt = np.array([1, 0], np.int32)
    q = rng.standard_normal((Hkv * G, D)).astype(np.float32)
    for fn in (_interleaved_decode, _tail_dropping_decode):
        o1, o2 = np.empty_like(q), np.empty_like(q)
        fn(q, k, v, bt, n, 0.3, 0, o1)
        reference.attention_decode(q, k, v, bt, n, 0.3, 0, o2)
        np.testing.assert_allclose(o1, o2, rtol=0, atol=1e-5)   # float32 order effects only
    imp = np.zeros((2, B, 1), np.float16)
    imp2 = imp.copy()
    new = np.full((1, n), 0.5, np.float32)                  # exact in fp16: no rounding
    _truncating_update(imp, bt, new)
    reference.importance_update(imp2, bt, new)
    assert np.array_equal(imp, imp2)


# ----------------------------------------------------------------- the command line


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pyimp.testing", *args], capture_output=True,
                          text=True, timeout=600)


def test_cli_table_and_json():
    p = _cli("--backend", "pyimp.testing.backends.numba", "--check", "select_blocks",
             "--check", "dequantize[Q4_K]", "--examples", "5")
    assert p.returncode == 0, p.stderr
    assert "select_blocks" in p.stdout and "PASS" in p.stdout and "FAIL" not in p.stdout
    assert "2 passed, 0 failed" in p.stdout
    p = _cli("--backend", "pyimp.testing.reference", "--check", "select_blocks", "--json",
             "--examples", "3")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["results"][0]["check"] == "select_blocks" and doc["results"][0]["passed"]


def test_cli_fails_on_a_mutant(tmp_path):
    mod = tmp_path / "tail_mutant.py"
    mod.write_text("from pyimp.testing.backends.numba import attention_decode as _d\n"
                   "def attention_decode(q, k, v, bt, n, scale, window, out):\n"
                   "    B = k.shape[2] // q.shape[1]\n"
                   "    return _d(q, k, v, bt, n - 1 if n > 1 and n % B == 1 else n, scale,"
                   " window, out)\n")
    p = subprocess.run([sys.executable, "-m", "pyimp.testing", "--backend", "tail_mutant",
                        "--no-shrink"], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "attention_decode" in p.stdout and "FAIL" in p.stdout
    assert "skip" in p.stdout                         # the functions it does not export


@pytest.mark.parametrize("args, code, needle", [
    (("--backend", "no_such_module_xyz"), 1, "cannot import backend 'no_such_module_xyz'"),
    (("--backend", "pyimp.testing.reference", "--check", "nope"), 2, "no check or function"),
    (("--backend", "pyimp.testing.reference", "--types", "Q9_9"), 2, "unknown or unsupported"),
    (("--backend", "pyimp.testing.reference", "--examples", "0"), 2, "--examples must be >= 1"),
])
def test_cli_bad_input_is_one_line(args, code, needle):
    p = _cli(*args)
    assert p.returncode == code
    assert needle in p.stderr and "Traceback" not in p.stderr


def _cli_with(tmp_path, source: str, *args):
    """The command line against a backend module of ``source``, run in ``tmp_path``."""
    (tmp_path / "user_backend.py").write_text(source)
    return subprocess.run([sys.executable, "-m", "pyimp.testing", "--backend", "user_backend",
                           *args], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})


def test_cli_leaves_no_hypothesis_folder_in_the_working_directory(tmp_path):
    # hypothesis writes its cache of the constants in the backend's source when a check fails
    p = _cli_with(tmp_path, "from pyimp.testing.reference import select_blocks as _s\n"
                            "def select_blocks(*args):\n"
                            "    sel, cnt = _s(*args)\n"
                            "    return sel, cnt + 1\n",
                  "--check", "select_blocks", "--examples", "3")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "0 passed, 1 failed" in p.stdout
    assert sorted(x.name for x in tmp_path.iterdir() if x.name != "__pycache__") == \
        ["user_backend.py"]


def test_cli_interrupted_is_one_line_and_130(tmp_path):
    p = _cli_with(tmp_path, "def select_blocks(*args):\n    raise KeyboardInterrupt\n",
                  "--check", "select_blocks")
    assert p.returncode == 130, p.stdout + p.stderr
    assert p.stderr.strip() == "pyimp.testing: interrupted"


@pytest.mark.parametrize("source, args", [
    ("", ()),                                                         # exports nothing
    ("", ("--check", "select_blocks")),
    ("from pyimp.testing.reference import matvec\n", ("--check", "select_blocks")),
])
def test_cli_nothing_checked_is_an_error(tmp_path, source, args):
    p = _cli_with(tmp_path, source, *args)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and "nothing checked" in p.stderr, p.stderr


def test_cli_backend_calling_sys_exit_fails(tmp_path):
    p = _cli_with(tmp_path, "import sys\ndef select_blocks(*args):\n    sys.exit(0)\n",
                  "--check", "select_blocks", "--examples", "3")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL" in p.stdout and "sys.exit(0)" in p.stdout and "0 passed, 1 failed" in p.stdout
    p = _cli_with(tmp_path, "import sys\nsys.exit(0)\n", "--check", "select_blocks")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "cannot import backend" in p.stderr and "sys.exit(0)" in p.stderr
    assert "Traceback" not in p.stderr


def _wrong_matvec(qtype, raw, n, x):
    return np.append(nb.matvec(qtype, raw, n, x), np.float32(0))


def _f64_dequantize(qtype, raw, n):
    return nb.dequantize(qtype, raw, n).astype(np.float64)


def _one_array_select(*args):
    return nb.select_blocks(*args)[0]


def _int64_select(*args):
    sel, cnt = nb.select_blocks(*args)
    return sel.astype(np.int64), cnt


def _transposed_scores(*args):
    return nb.block_scores(*args).T.copy()


def _list_lse(*args):
    return list(nb.attention_decode(*args))


@pytest.mark.parametrize("fns, check, needles", [
    (dict(matvec=_wrong_matvec), "matvec[Q4_K]", ["matvec", "expected float32[", "got float32["]),
    (dict(dequantize=_f64_dequantize), "dequantize[Q4_K]",
     ["dequantize", "expected float32[", "got float64["]),
    (dict(select_blocks=_one_array_select), "select_blocks",
     ["select_blocks", "expected a pair (sel, cnt)", "got int32["]),
    (dict(select_blocks=_int64_select), "select_blocks",
     ["select_blocks sel", "expected int32[", "got int64["]),
    (dict(block_scores=_transposed_scores), "block_scores", ["block_scores", "expected float32["]),
    (dict(attention_decode=_list_lse), "attention_decode",
     ["attention_decode lse", "expected float32[", "got list"]),
])
def test_wrong_output_shape_or_dtype_is_named(fns, check, needles):
    name = next(iter(fns))
    results = suite.run_suite(_mutant(**fns), names=[check], max_examples=5, shrink=False,
                              types=["Q4_K"])
    failed, r = _failed(results, check)
    assert failed, r
    assert "raised" not in r.detail and "Error" not in r.detail, r.detail
    assert all(n in r.detail for n in needles), r.detail
    assert r.detail.startswith(name), r.detail


def test_run_suite_refuses_a_backend_that_exports_nothing_checked():
    with pytest.raises(ValueError, match="nothing checked"):
        suite.run_suite(types.SimpleNamespace())
    with pytest.raises(ValueError, match="nothing checked"):
        suite.run_suite(types.SimpleNamespace(matvec=nb.matvec), names=["select_blocks"])


# ----------------------------------------------------------------- the strategies


def test_strategies_draw_what_they_promise():
    """The edge cases the mutants need are drawn, and the data are what the docs say."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from pyimp.testing import strategies as S
    seen = {"one_tail": 0, "gqa": 0, "zero_scale": 0, "extreme_scale": 0, "near_max": 0}

    @settings(max_examples=100, deadline=None, database=None, derandomize=True)
    @given(S.paged_caches(), st.sampled_from(S.TYPES).flatmap(
        lambda t: st.tuples(st.just(t), S.quant_rows(t))))
    def probe(c, q):
        sh, B, n = c["shape"], c["shape"]["B"], c["n_ctx"]
        bt = c["block_table"]
        assert len(set(bt.tolist())) == bt.size                 # distinct physical blocks
        if c["k_cache"].shape[1] > 1:
            assert not np.array_equal(bt, np.arange(bt.size))   # never the identity
        seen["one_tail"] += n % B == 1 or B == 1
        seen["gqa"] += sh["Hkv"] >= 2 and sh["G"] >= 2
        qtype, (raw, nel) = q
        w = reference.dequantize(qtype, raw, nel)
        assert np.isfinite(w).all()                             # NaN- and inf-free
        for off in FP16_FIELDS.get(QT[qtype], ()):
            ts = GGML_QUANT_SIZES[QT[qtype]][1]
            d = raw.reshape(-1, ts)[:, off:off + 2].copy().view(np.float16)
            seen["zero_scale"] += bool((d == 0).any())
            seen["extreme_scale"] += bool((np.abs(d) == 65504).any())

    probe()
    assert seen["one_tail"] >= 5 and seen["gqa"] >= 10, seen
    assert seen["zero_scale"] >= 1 and seen["extreme_scale"] >= 1, seen

    @settings(max_examples=40, deadline=None, database=None, derandomize=True)
    @given(S.importance_buffers(3, 4, 2))
    def imp_probe(x):
        assert x.dtype == np.float16 and x.shape == (3, 4, 2) and np.isfinite(x).all()
        seen["near_max"] += bool((x > 65000).any())

    imp_probe()
    assert seen["near_max"] >= 3, seen


def test_fp16_ulps_compare_takes_nan_as_nan():
    """A NaN matches a NaN of another payload or sign (a GPU writes its canonical 0x7FFF where
    the CPU keeps 0x7E00 / 0xFE00), never a number; numbers keep their ulp tolerance."""
    want = np.uint16([0x3C00, 0xFE00, 0x7E00]).view(np.float16)
    suite._ulps16("x", np.uint16([0x3C01, 0x7FFF, 0x7FFF]).view(np.float16), want, 1)
    with pytest.raises(suite.Mismatch, match="NaN on one side"):
        suite._ulps16("x", np.uint16([0x3C00, 0x3C00, 0x7E00]).view(np.float16), want, 1)
    with pytest.raises(suite.Mismatch, match="NaN on one side"):
        suite._ulps16("x", want, np.uint16([0x3C00, 0xFE00, 0x3C00]).view(np.float16), 1)
    with pytest.raises(suite.Mismatch, match="2 fp16 ulps"):
        suite._ulps16("x", np.uint16([0x3C02, 0x7FFF, 0x7FFF]).view(np.float16), want, 1)
