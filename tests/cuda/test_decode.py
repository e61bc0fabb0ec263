"""The fused decode step's kernels (pyimp.cuda.decode) against NumPy: the prologue matvecs
(residual + norms + rows of three weight types), the gate / up kernel, q / k norms + RoPE + the
cache store at the record's position, the attention with its in-launch merge and importance
update, and the head with its soft-cap and the record's advance. Tiny shapes (the simulator
runs a Python thread per CUDA thread)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loaders.ggml_types import QT
from quant_oracle import dequantize, quantize

from pyimp import ops as host_ops
from pyimp.attention.attend import add_block_mass, attention_decode_ref, sparse_attention_decode_ref
from pyimp.cuda import decode, device, linear
from pyimp.cuda import sparse as dsparse
from pyimp.sparse.anchors import AnchorType, compute_anchors
from test_attention import _selection

# f32 sums of at most a few hundred terms in another order than the float64 reference, and
# the simulator's exp / tanh against NumPy's: ~1e-6 relative; a wrong row, head, slot or norm
# moves results by 1e-1 or more
RTOL = 2e-5
EPS = np.float32(1e-6)


def _raw(qtype, rows, n, rng):
    w = rng.standard_normal((rows, n)).astype(np.float32)
    if qtype == QT.F16:
        return w.astype(np.float16).view(np.uint8).reshape(rows, -1), w.astype(np.float16).astype(np.float64)
    raw = np.ascontiguousarray(quantize(w, qtype)).view(np.uint8).reshape(rows, -1)
    return raw, dequantize(raw, qtype).reshape(rows, n).astype(np.float64)


def _rms(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x) + float(EPS)) * w


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


@pytest.mark.parametrize("mode,bias", [(0, False), (1, True), (2, False), (2, True)])
def test_qkv_prologue_matches_numpy(mode, bias):
    """Three weight types in one launch; x as the embedding (scaled), plus a residual, plus a
    post-normed residual with the output projection's bias."""
    rng = np.random.default_rng(mode * 2 + bias)
    E, nq, nk, nv = 64, 6, 3, 5
    x = rng.standard_normal(E).astype(np.float32)
    delta = rng.standard_normal(E).astype(np.float32)
    dbias = rng.standard_normal(E).astype(np.float32) if bias else np.zeros(0, np.float32)
    post = (1 + rng.random(E)).astype(np.float32)
    norm = (1 + rng.random(E)).astype(np.float32)
    (rq, wq), (rk, wk), (rv, wv) = (_raw(QT.Q8_0, nq, E, rng), _raw(QT.Q5_0, nk, E, rng),
                                    _raw(QT.F16, nv, E, rng))
    obias = rng.standard_normal(nq + nk + nv).astype(np.float32)
    scale = np.float32(8.0) if mode == 0 else np.float32(1.0)
    d = delta + (dbias if bias else 0)
    want_x = {0: x * scale, 1: x + d, 2: x + _rms(d, post)}[mode]
    want = np.concatenate([wq, wk, wv]) @ _rms(want_x, norm) + obias
    kern = decode._qkv_kernel(linear._DECODERS[QT.Q8_0], linear._DECODERS[QT.Q5_0],
                              linear._DECODERS[QT.F16])
    dev = [device.to_device(a) for a in (x, delta, dbias, post, norm, rq, rk, rv, obias)]
    xout = device.zeros((E,), np.float32)
    out = device.zeros((nq + nk + nv,), np.float32)
    device.launch(kern, 2, 8, dev[0], scale, dev[1], dev[2], dev[3], np.int32(mode), dev[4],
                  EPS, xout, dev[5], dev[6], dev[7], np.int32(nq), np.int32(nk), dev[8], out,
                  shared=4 * E)
    _close(device.to_host(out), want)
    _close(device.to_host(xout), want_x)            # block 0 wrote the residual stream


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gate_up_matches_numpy(act):
    rng = np.random.default_rng(5)
    E, F = 64, 7
    x, o = (rng.standard_normal(E).astype(np.float32) for _ in range(2))
    post, norm = ((1 + rng.random(E)).astype(np.float32) for _ in range(2))
    (rg, wg), (ru, wu) = _raw(QT.Q8_0, F, E, rng), _raw(QT.Q4_0, F, E, rng)
    xn = x + _rms(o, post)
    h = _rms(xn, norm)
    g, u = wg @ h, wu @ h
    fn = {"silu": lambda v: v / (1 + np.exp(-v)),
          "gelu_tanh": lambda v: 0.5 * v * (1 + np.tanh(0.7978845608 * v * (1 + 0.044715 * v * v)))}
    want = fn[act](g) * u
    kern = decode._gate_up_kernel(linear._DECODERS[QT.Q8_0], linear._DECODERS[QT.Q4_0], act)
    dx, do, dp, dn, dg, du = (device.to_device(a) for a in (x, o, post, norm, rg, ru))
    xout = device.zeros((E,), np.float32)
    out = device.zeros((F,), np.float32)
    device.launch(kern, 2, 8, dx, do, device.zeros((0,), np.float32), dp, np.int32(2), dn, EPS,
                  xout, dg, du, out, shared=4 * E)
    _close(device.to_host(out), want)
    _close(device.to_host(xout), xn)


@pytest.mark.parametrize("neox,qk_norm,n_rot,atype", [(True, True, 16, AnchorType.QUEST),
                                                      (False, False, 16, AnchorType.BLOCK_MEAN),
                                                      (True, False, 8, None)])
def test_rope_store_matches_numpy(neox, qk_norm, n_rot, atype):
    """q / k norms, RoPE at the record's position (partial rotary: the rest copied), q's
    scale, and K / V stored at that slot through a permuted block table (f16); with an
    anchor type, the anchors of the block the key joined (its earlier keys random) are the
    CPU anchor code's over its keys so far, and no other block's anchors are written."""
    rng = np.random.default_rng(7)
    Hq, Hkv, D, B, NB, n_ctx = 4, 2, 16, 4, 5, 20
    p = 13
    qkv = rng.standard_normal((Hq + 2 * Hkv) * D).astype(np.float32)
    qn, kn = ((1 + rng.random(D)).astype(np.float32) for _ in range(2))
    cos, sin = host_ops.rope_cache(np.arange(n_ctx), n_rot, base=10000.0, freq_scale=1.0)
    bt = rng.permutation(NB).astype(np.int32)
    kc = np.zeros((Hkv, NB, B * D), np.float16)
    vc = np.zeros((Hkv, NB, D * B), np.float16)
    p_b, p_t = bt[p // B], p % B
    kc[:, p_b, :p_t * D] = rng.standard_normal((Hkv, p_t * D))   # the block's earlier keys
    q_scale = np.float32(0.25)
    heads = qkv.reshape(-1, D)
    q, k, v = heads[:Hq], heads[Hq:Hq + Hkv], heads[Hq + Hkv:]
    if qk_norm:
        q = np.stack([_rms(h, qn) for h in heads[:Hq]])
        k = np.stack([_rms(h, kn) for h in heads[Hq:Hq + Hkv]])
    want_q = host_ops.rope_ref(q[None].astype(np.float32), cos[p:p + 1], sin[p:p + 1], neox)[0]
    want_k = host_ops.rope_ref(k[None].astype(np.float32), cos[p:p + 1], sin[p:p + 1], neox)[0]
    want_q = want_q * q_scale
    d = [device.to_device(a) for a in (qkv, qn, kn, cos, sin, bt, kc, vc)]
    rec = device.to_device(np.array([p, 0, 0, 0], np.int32))
    qo = device.zeros((Hq, D), np.float32)
    ko = device.zeros((Hkv, D), np.float32)
    anchor = device.to_device(np.full((NB, 2, Hkv, D), 7, np.float16))
    akind = -1 if atype is None else dsparse.anchor_code(atype)
    device.launch(decode._rope_store, Hq + Hkv, 8, d[0], np.int32(Hq), np.int32(Hkv),
                  np.int32(D), d[1], d[2], np.int32(qk_norm), EPS, d[3], d[4], np.int32(neox),
                  q_scale, rec, d[5], d[6], d[7], np.int32(1), qo, ko, np.int32(akind), anchor,
                  shared=8 * D)
    got_a = device.to_host(anchor)
    want_a = np.full_like(got_a, 7)
    if atype is not None:
        compute_anchors(atype, device.to_host(d[6]), np.array([p_b]), np.array([p_t + 1]),
                        want_a, backend="numpy")
        assert not np.array_equal(want_a[p_b], np.full_like(want_a[p_b], 7))
    np.testing.assert_array_equal(got_a, want_a)
    _close(device.to_host(qo), want_q)
    _close(device.to_host(ko), want_k)
    got_k, got_v = device.to_host(d[6]), device.to_host(d[7])
    pb, t = bt[p // B], p % B
    np.testing.assert_allclose(got_k[:, pb, t * D:(t + 1) * D].astype(np.float32),
                               want_k.astype(np.float16).astype(np.float32), rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(got_v[:, pb, t::B], v.astype(np.float16))
    kc_other = got_k.copy()
    kc_other[:, pb, :(t + 1) * D] = 0
    vc_other = got_v.copy()
    vc_other[:, pb, t::B] = 0
    assert not kc_other.any() and not vc_other.any()          # nothing else written


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("window", [0, 9])
def test_attend_merges_in_launch_and_adds_importance(dtype, window):
    """Two steps in a row through the same partials and counter: outputs and importance as
    the reference's, the counter left at zero for the next launch."""
    rng = np.random.default_rng(11)
    Hkv, G, D, B, NB = 2, 2, 16, 4, 9
    Hq = Hkv * G
    kc = rng.standard_normal((Hkv, NB, B * D)).astype(dtype)
    vc = rng.standard_normal((Hkv, NB, D * B)).astype(dtype)
    bt = rng.permutation(NB).astype(np.int32)
    imp = (rng.random((NB, B, Hq)) * 3).astype(np.float16)
    nsplit = 3
    parts = (device.zeros((1, Hq, nsplit), np.float32), device.zeros((1, Hq, nsplit), np.float32),
             device.zeros((1, Hq, nsplit, D), np.float32), device.zeros((Hkv,), np.int32),
             device.zeros((Hq, NB, B), np.float32), device.zeros((Hq, NB), np.float32))
    dk, dv, dbt, dimp = (device.to_device(a) for a in (kc, vc, bt, imp))
    imp_want = imp.copy()
    for pos in (25, 26):
        q = rng.standard_normal((Hq, D)).astype(np.float32)
        want = np.empty((Hq, D), np.float32)
        attention_decode_ref(q, kc, vc, bt, pos + 1, 0.25, window, want, imp_want)
        out = device.zeros((Hq, D), np.float32)
        rec = device.to_device(np.array([pos, 0, 0, 0], np.int32))
        decode.attend(device.to_device(q), dk, dv, dbt, rec, 0.25, window, out, nsplit, parts,
                      dimp, True)
        _close(device.to_host(out), want)
        assert not device.to_host(parts[3]).any()           # the counter is reset
    g, w = device.to_host(dimp).astype(np.float32), imp_want.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(w)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - w) <= ulp)          # one fp16 rounding of P apart at most


@settings(deadline=None, max_examples=12)
@given(Hkv=st.sampled_from([1, 2]), G=st.sampled_from([1, 2, 4]),
       granularity=st.sampled_from(["layer", "kvhead", "qhead"]), seed=st.integers(0, 2**16),
       window=st.sampled_from([0, 7]), nsplit=st.sampled_from([1, 2, 3]))
def test_attend_selection_matches_reference(Hkv, G, granularity, seed, window, nsplit):
    """The fused launch over LAYER / KVHEAD / QHEAD selections (query head h reads kv head
    h // G and set h // (Hq // nsets)), merged in the launch, with the importance of the
    attended tokens; a set the window hides entirely gives zeros."""
    rng = np.random.default_rng(seed)
    D, B, NB = 8, 4, 8
    Hq = Hkv * G
    nsets = {"layer": 1, "kvhead": Hkv, "qhead": Hq}[granularity]
    kc = rng.standard_normal((Hkv, NB, B * D)).astype(np.float16)
    vc = rng.standard_normal((Hkv, NB, D * B)).astype(np.float16)
    bt = rng.permutation(NB).astype(np.int32)
    n_ctx = int(rng.integers(B + 1, NB * B + 1))
    n_lb = -(-n_ctx // B)
    K = min(n_lb, 4)
    sel, cnt = _selection(rng, nsets, n_lb, K)
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    imp = (rng.random((NB, B, Hq)) * 2).astype(np.float16)
    want = np.empty((Hq, D), np.float32)
    probs = np.empty((Hq, K, B), np.float32)
    lse = sparse_attention_decode_ref(q, kc, vc, bt, n_ctx, 0.5, window, sel, cnt, want, probs)
    imp_want = imp.copy()
    add_block_mass(imp_want, bt, sel, cnt, probs, n_ctx, 1.0, backend="numpy")
    parts = (device.zeros((1, Hq, nsplit), np.float32), device.zeros((1, Hq, nsplit), np.float32),
             device.zeros((1, Hq, nsplit, D), np.float32), device.zeros((Hq,), np.int32),
             device.zeros((Hq, NB, B), np.float32), device.zeros((Hq, NB), np.float32))
    dq, dk, dv, dbt, dsel, dcnt, dimp = (device.to_device(a) for a in (q, kc, vc, bt, sel, cnt, imp))
    rec = device.to_device(np.array([n_ctx - 1, 0, 0, 0], np.int32))
    out = device.zeros((Hq, D), np.float32)
    decode.attend(dq, dk, dv, dbt, rec, 0.5, window, out, nsplit, parts, dimp, True, dsel, dcnt)
    got = device.to_host(out)
    live = np.isfinite(lse)
    if live.any():
        _close(got[live], want[live])
    assert np.all(got[~live] == 0)
    assert not device.to_host(parts[3]).any()               # the counters are reset
    g, w = device.to_host(dimp).astype(np.float32), imp_want.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(w)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - w) <= ulp)


def test_head_softcap_and_record():
    rng = np.random.default_rng(13)
    E, V = 64, 9
    x, f = (rng.standard_normal(E).astype(np.float32) for _ in range(2))
    norm = (1 + rng.random(E)).astype(np.float32)
    raw, w = _raw(QT.Q8_0, V, E, rng)
    cap = np.float32(3.0)
    want = np.tanh((w @ _rms(x + f, norm)) / 3.0) * 3.0
    kern = decode._head_kernel(linear._DECODERS[QT.Q8_0])
    dx, df, dn, dr = (device.to_device(a) for a in (x, f, norm, raw))
    empty = device.zeros((0,), np.float32)
    rec = device.to_device(np.array([41, 0, 0, 0], np.int32))
    out = device.zeros((V,), np.float32)
    device.launch(kern, 2, 8, dx, df, empty, empty, np.int32(1), dn, EPS, dr,
                  np.float32(1) / cap, cap, out, rec, shared=4 * E)
    _close(device.to_host(out), want)
    assert device.to_host(rec)[0] == 42                     # advanced once, not per block
