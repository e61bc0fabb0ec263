"""Quantized KV on the device: the device quantizer is byte-identical to the CPU's (and to
gguf's, through ``quant_oracle``: gguf's where it is installed), the device cache stores the host cache's bytes and tails, rewinds as the host
does, and every attention / anchor kernel over quantized layers matches the NumPy reference
its CPU twin is tested against.

Quantized K needs a head dim that is a multiple of 32: D = 32 here (the smallest), B = 4,
a few blocks. Host layers come from :class:`pyimp.kv.cache.KVCache` (written in chunks so the
last block sits in the float tail) and are uploaded with ``DeviceQuantizedKV.from_host``.
"""
import numpy as np
import pytest
import quant_oracle as gq
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders.quantize import quantize_rows
from pyimp.attention.attend import attention_decode_ref, attention_prefill_ref
from pyimp.cuda import attention as CA
from pyimp.cuda import device, kvblocks
from pyimp.cuda import sparse as cs
from pyimp.cuda.kvcache import DeviceKVCache
from pyimp.kv.cache import QUANT_TYPES, KVCache, QuantizedKV, as_float
from pyimp.sparse import AnchorType, compute_anchors
from pyimp.sparse.anchors import group_shared
from pyimp.attention.attend import add_block_mass, sparse_attention_decode_ref

QTYPES = sorted(QUANT_TYPES)
D, B = 32, 4

# Attention tolerance. Kernel and reference read the same float32 values: the device decoders
# are bit-identical to gguf.quants.dequantize (test_linear.py checks them bit for bit; the
# NumPy references dequantize through gguf), the tail is the same float32 array. What is left
# is float32 summation order over <= 32 keys and another exp: outputs agree to ~1e-6 relative,
# the same as for float caches (tests/cuda/test_attention.py), so the same 2e-5 on values of
# order 1; a block read from the wrong place (the stale bytes under the tail, a wrong type's
# decoder, another head) moves outputs by ~1e-1.
ATOL = 2e-5

# (K type, V type) pairs: every quantized type on both sides, mixed types, float on one side
PAIRS = [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("q4_1", "q5_1"), ("q5_0", "q4_1"),
         ("q5_1", "q5_0"), ("q8_0", "f16"), ("f32", "q4_1")]


def _rotate(configs):
    """Each pair with one of the configs in turn (every config on two or three pairs): the
    configs (tail lengths, windows, observation windows) are type-independent code paths, and
    every case reads full quantized blocks of both its types besides."""
    return [(*pair, *configs[i % len(configs)]) for i, pair in enumerate(PAIRS)]


def _imp_close(got, want):
    """importance within one fp16 ulp (the per-entry P differs in the last bits of exp, which
    can flip one rounding to fp16)."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(w)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - w) <= ulp), np.max(np.abs(g - w) / ulp)


def _host_cache(rng, tk, tv, n, Hkv=2, splits=(), n_ctx=40, scale=1.0):
    """A host cache with n tokens written in chunks cut at ``splits``, after another sequence
    took blocks first (physical != logical order)."""
    c = KVCache(1, Hkv, D, n_ctx, block_len=B, type_k=tk, type_v=tv, n_seq=2)
    c.reserve(9, seq=1)
    k = (rng.standard_normal((n, Hkv, D)) * scale).astype(np.float32)
    v = (rng.standard_normal((n, Hkv, D)) * scale).astype(np.float32)
    c.reserve(n)
    cuts = [0] + sorted(s for s in set(splits) if 0 < s < n) + [n]
    for a, b in zip(cuts[:-1], cuts[1:]):
        c.write(0, k[a:b], v[a:b], a)
    c.commit(n)
    return c


def _up(layer):
    """A host layer on the device: a QuantizedKV uploaded, a float array copied."""
    if isinstance(layer, QuantizedKV):
        return kvblocks.DeviceQuantizedKV.from_host(layer)
    return device.to_device(layer)


def _tail_of(n):
    return "none" if n % B == 0 else ("one token" if n % B == 1 else "partial")


# --------------------------------------------------------------------------
# the quantizer
# --------------------------------------------------------------------------


def _quantizer_rows(rng):
    """Rows of 32-value blocks that reach every branch of the reference quantizers (and stay
    where they are defined: |x| < 65520, and a scale whose inverse is finite)."""
    rows = [rng.standard_normal(64) * s for s in (1e-35, 1e-6, 1e-3, 1.0, 1e3)]
    rows.append(np.clip(rng.standard_normal(64) * 3e4, -65519, 65519))
    rows.append(np.zeros(64))                                    # d = 0: inverse 0
    rows.append(np.full(64, -2.5))                               # all equal: max - min = 0
    r = rng.standard_normal(64)
    r[3], r[17] = 4.0, -4.0                                      # signed max: the first of a tie
    rows.append(r)
    r = rng.standard_normal(64)
    r[5], r[40] = -7.0, 7.0
    rows.append(r)
    # Q8_0 at exact halves: amax 127 makes d = 1, so x = k + 0.5 rounds half away from zero
    half = np.concatenate([np.arange(-15.5, 16.5, 1.0), np.arange(-15.5, 16.5, 1.0)])
    half[0], half[32] = 127.0, -127.0
    rows.append(half)
    r = rng.standard_normal(64)
    r[[0, 9, 33, 50]] = [1e-40, -3e-42, 1e-45, -1e-39]            # float32 subnormals
    rows.append(r)
    rows.append(np.concatenate([np.full(32, 65504.0), rng.uniform(-65519, 65519, 32)]))
    return np.array(rows, np.float32)


@pytest.mark.parametrize("kv_type", QTYPES)
def test_device_quantizer_is_byte_identical(kv_type):
    """kvblocks.quantize_block (device) == loaders.quantize (CPU) == gguf.quants, byte for byte,
    on rows that reach every branch: zero and constant blocks, ties for the signed maximum,
    exact halves, subnormals, values next to the fp16 limit."""
    x = _quantizer_rows(np.random.default_rng(QTYPES.index(kv_type)))
    got = kvblocks.quantize_rows(x, kv_type)
    cpu = quantize_rows(x, QUANT_TYPES[kv_type])
    ref = gq.quantize(x, QUANT_TYPES[kv_type])
    np.testing.assert_array_equal(cpu, ref)
    np.testing.assert_array_equal(got, cpu)



@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kv_type", QTYPES)
def test_blocks_of_subnormal_values_decode_to_zero(kv_type):
    """Where the scale's inverse overflows (every |x| below ~1e-36) the references convert an
    infinite quotient to an integer, which C leaves undefined, so the quant bytes may differ;
    the fp16 scale (and minimum) is 0 on both sides, so the block decodes to zeros either way."""
    x = (np.random.default_rng(2).standard_normal((2, 32)) * 1e-40).astype(np.float32)
    got = kvblocks.quantize_rows(x, kv_type)
    cpu = quantize_rows(x, QUANT_TYPES[kv_type])
    for b in (got, cpu):
        np.testing.assert_array_equal(gq.dequantize(b, QUANT_TYPES[kv_type]), 0.0)


@pytest.mark.parametrize("kv_type", QTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, 7e4])
def test_values_the_host_refuses_store_nan_blocks(kv_type, bad):
    """A block holding a value the host cache refuses (NaN, inf, |x| >= 65520) is stored with
    NaN scales, so everything read from it is NaN (and the engine's logits check reports it);
    the other block of the row is quantized as usual."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    x[0, 7] = bad
    got = kvblocks.quantize_rows(x, kv_type)
    vals = gq.dequantize(got, QUANT_TYPES[kv_type])[0]
    assert np.isnan(vals[:32]).all()
    bsz = got.shape[1] // 2
    np.testing.assert_array_equal(got[0, bsz:], quantize_rows(x[:, 32:], QUANT_TYPES[kv_type])[0])


# --------------------------------------------------------------------------
# the device cache
# --------------------------------------------------------------------------


# the order the twins' pools hand out blocks (pop() takes the last): not the identity
_POOL = [4, 9, 0, 6, 2, 8, 1, 5, 3, 7]


def _twins(tk, tv, Hkv=2, n_ctx=40):
    """A host and a device cache (two layers) with the same non-identity block tables."""
    caches = [KVCache(2, Hkv, D, n_ctx, block_len=B, type_k=tk, type_v=tv),
              DeviceKVCache(2, Hkv, D, n_ctx, block_len=B, type_k=tk, type_v=tv)]
    for c in caches:
        assert c.max_blocks == len(_POOL)
        c._free = [list(_POOL) for _ in range(c.n_layer)]
    return caches


def _write_both(host, dev, k, v, a, b):
    host.reserve(b - a)
    dev.reserve(b - a)
    for il in range(host.n_layer):
        host.write(il, k[a:b] + il, v[a:b] - il, a)
        dev.write(il, device.to_device(k[a:b] + il), device.to_device(v[a:b] - il), a)
    host.commit(b - a)
    dev.commit(b - a)


def _assert_same_storage(host, dev):
    n = int(host.cache_seqlens[0])
    assert np.array_equal(host.table(0), dev.table(0))
    assert host.table(0)[0] == _POOL[-1]
    for side, t in (("k", host.type_k), ("v", host.type_v)):
        name = f"{side}_cache_{'fp16' if t == 'f16' else t}_"
        assert np.array_equal(getattr(host, name), device.to_host(getattr(dev, name))), name
        if t not in QUANT_TYPES:
            continue
        assert np.array_equal(host._tail_block[side], dev._tail_block[side])
        if n % B:      # the tail's valid tokens (what lies past them is never read)
            ht, dt = host._tail[side][0], device.to_host(dev._tail[side])[0]
            idx = np.arange(n % B)
            sl = (idx[:, None] * D + np.arange(D) if side == "k"
                  else np.arange(D)[:, None] * B + idx)
            assert np.array_equal(ht[:, :, sl], dt[:, :, sl]), side
    for il in range(host.n_layer):
        for a, b in zip(host.gather(il), dev.gather(il)):
            assert np.array_equal(a, b)


@settings(deadline=None, max_examples=25)
@given(tk=st.sampled_from(QTYPES + ["f16"]), tv=st.sampled_from(QTYPES + ["f32"]),
       n=st.integers(1, 37), splits=st.lists(st.integers(1, 36), max_size=4),
       seed=st.integers(0, 2**31 - 1))
def test_device_cache_stores_the_host_bytes(tk, tv, n, splits, seed):
    """Written in the same chunks (one token, within a block, across several blocks), the device
    cache holds the host cache's quantized bytes in every block, the same tail tokens and tail
    blocks, and gathers the same keys and values."""
    rng = np.random.default_rng(seed)
    host, dev = _twins(tk, tv)
    k = rng.standard_normal((n, 2, D)).astype(np.float32) * 2
    v = rng.standard_normal((n, 2, D)).astype(np.float32)
    cuts = [0] + sorted(s for s in set(splits) if s < n) + [n]
    for a, b in zip(cuts[:-1], cuts[1:]):
        _write_both(host, dev, k, v, a, b)
    _assert_same_storage(host, dev)


@pytest.mark.parametrize("tk,tv", [("q8_0", "q5_1"), ("q4_1", "f16"), ("f32", "q4_0")])
def test_rewind_matches_the_host(tk, tv):
    """truncate with a checkpoint restores the tails exactly; without one, cutting inside a
    quantized block dequantizes it into the tail (on the device) as the host does, and writing
    on from there stores the same bytes."""
    rng = np.random.default_rng(1)
    host, dev = _twins(tk, tv)
    k = rng.standard_normal((34, 2, D)).astype(np.float32)
    v = rng.standard_normal((34, 2, D)).astype(np.float32)
    _write_both(host, dev, k, v, 0, 10)
    ck_h, ck_d = host.checkpoint(), dev.checkpoint()
    _write_both(host, dev, k, v, 10, 23)             # completes block 2, ends inside block 5
    for c, ck in ((host, ck_h), (dev, ck_d)):
        c.truncate(10, checkpoint=ck)
    _assert_same_storage(host, dev)
    _write_both(host, dev, k, v, 10, 23)
    for c in (host, dev):
        c.truncate(13)                               # inside block 3, quantized by now
    for side, t in (("k", tk), ("v", tv)):
        if t in QUANT_TYPES:
            assert dev.layer(side, 1).tail_block == host.table(1)[3]
    _assert_same_storage(host, dev)
    _write_both(host, dev, k[::-1].copy(), v, 13, 34)
    _assert_same_storage(host, dev)


def test_channel_layout_is_refused_on_the_device():
    with pytest.raises(ValueError, match="v_layout='channel'.*device='cpu'"):
        DeviceKVCache(1, 1, 32, 64, block_len=32, type_k="q8_0", type_v="q4_0",
                      v_layout="channel")
    with pytest.raises(ValueError, match="head dim 16 .*multiple of 32"):
        DeviceKVCache(1, 1, 16, 64, type_k="q8_0", type_v="f16")


# --------------------------------------------------------------------------
# attention kernels on quantized layers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("tk,tv,n,window", _rotate([(21, 0), (24, 0), (22, 9)]))
def test_decode_dense_matches_reference(tk, tv, n, window):
    """Dense decode (with importance) over quantized layers, tails of one token, none and two
    tokens, and a sliding window."""
    rng = np.random.default_rng([PAIRS.index((tk, tv)), n])
    c = _host_cache(rng, tk, tv, n, splits=(7, n - 1))
    kq, vq, bt = c.k_layer(0), c.v_layer(0), c.table(0)
    if tk in QUANT_TYPES:
        assert kq.tail_block == (-1 if _tail_of(n) == "none" else bt[n // B])
    Hq = 4
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    imp = (rng.random((c.max_blocks, B, Hq)) * 3).astype(np.float16)
    want = np.empty((Hq, D), np.float32)
    imp_want = imp.copy()
    lse = attention_decode_ref(q, kq, vq, bt, n, 0.25, window, want, imp_want)
    dimp = device.to_device(imp)
    out = device.zeros((1, Hq, D), np.float32)
    M, L = CA.decode(device.to_device(q[None]), _up(kq), _up(vq), device.to_device(bt), n, 0.25,
                     window, out, importance=dimp, nsplit=2)
    np.testing.assert_allclose(device.to_host(out)[0], want, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(device.to_host(M)[0] + np.log(device.to_host(L)[0]), lse,
                               atol=ATOL, rtol=ATOL)
    _imp_close(device.to_host(dimp), imp_want)


@pytest.mark.parametrize("granularity", ["layer", "kvhead", "qhead"])
@pytest.mark.parametrize("tk,tv", PAIRS[:5])
def test_sparse_decode_matches_reference(tk, tv, granularity):
    """Block-sparse decode over a subset that includes the tail block, per set granularity,
    with the importance of the attended tokens."""
    rng = np.random.default_rng([PAIRS.index((tk, tv)), len(granularity)])
    n = 26                                            # 6 full blocks and a tail of 2
    c = _host_cache(rng, tk, tv, n, splits=(5,))
    kq, vq, bt = c.k_layer(0), c.v_layer(0), c.table(0)
    Hkv, G = 2, 2
    Hq = Hkv * G
    nsets = {"layer": 1, "kvhead": Hkv, "qhead": Hq}[granularity]
    n_lb = -(-n // B)
    sel = np.full((nsets, 4), -1, np.int32)
    cnt = np.zeros(nsets, np.int32)
    for si in range(nsets):
        pick = rng.permutation(n_lb - 1)[:int(rng.integers(1, 4))]
        row = np.concatenate([pick, [n_lb - 1]]) if si % 2 == 0 else pick   # the tail block
        sel[si, :row.size] = rng.permutation(row)
        cnt[si] = row.size
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    imp = (rng.random((c.max_blocks, B, Hq)) * 2).astype(np.float16)
    want = np.empty((Hq, D), np.float32)
    probs = np.empty((Hq, sel.shape[1], B), np.float32)
    lse = sparse_attention_decode_ref(q, kq, vq, bt, n, 0.5, 0, sel, cnt, want, probs)
    imp_want = imp.copy()
    add_block_mass(imp_want, bt, sel, cnt, probs, n, 1.0, backend="numpy")
    dimp = device.to_device(imp)
    out = device.zeros((1, Hq, D), np.float32)
    M, L = CA.decode(device.to_device(q[None]), _up(kq), _up(vq), device.to_device(bt), n, 0.5,
                     0, out, sel=device.to_device(sel), cnt=device.to_device(cnt),
                     importance=dimp)
    np.testing.assert_allclose(device.to_host(out)[0], want, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(device.to_host(M)[0] + np.log(device.to_host(L)[0]), lse,
                               atol=ATOL, rtol=ATOL)
    _imp_close(device.to_host(dimp), imp_want)


@pytest.mark.parametrize("tk,tv,window,obs_start,decay",
                         _rotate([(0, 0, 1.0), (0, 9, 0.5), (5, 4, 1.0)]))
def test_prefill_matches_reference(tk, tv, window, obs_start, decay):
    """Prefill of a second chunk (its keys already cached, the last block in the tail) with
    the prefill-importance kernel (observation window, decay)."""
    rng = np.random.default_rng([PAIRS.index((tk, tv)), window, obs_start])
    pos0, T = 5, 10
    c = _host_cache(rng, tk, tv, pos0 + T, splits=(pos0,))
    kq, vq, bt = c.k_layer(0), c.v_layer(0), c.table(0)
    Hq = 4
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    imp = (rng.random((c.max_blocks, B, Hq)) * 2).astype(np.float16)
    want = np.empty((T, Hq, D), np.float32)
    imp_want = imp.copy()
    lse = attention_prefill_ref(q, kq, vq, bt, pos0, 0.35, window, want, imp_want, obs_start,
                                decay)
    dimp = device.to_device(imp)
    out = device.zeros((T, Hq, D), np.float32)
    M, L = CA.prefill(device.to_device(q), _up(kq), _up(vq), device.to_device(bt), pos0, 0.35,
                      window, out, importance=dimp, obs_start=obs_start, decay=decay)
    np.testing.assert_allclose(device.to_host(out), want, atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(device.to_host(M) + np.log(device.to_host(L)), lse, atol=ATOL,
                               rtol=ATOL)
    _imp_close(device.to_host(dimp), imp_want)


def test_stale_bytes_under_the_tail_are_never_read():
    """The quantized bytes of the tail block (stale, here NaN scales) and of the blocks past
    the context must not reach the output: the tail block is read from the tail."""
    rng = np.random.default_rng(5)
    n = 18                                            # a tail of 2 in block 4
    c = _host_cache(rng, "q4_0", "q8_0", n, splits=(9,))
    kq, vq, bt = c.k_layer(0), c.v_layer(0), c.table(0)
    q = device.to_device(rng.standard_normal((1, 4, D)).astype(np.float32))
    outs = []
    for poison in (False, True):
        dk, dv = _up(kq), _up(vq)
        if poison:
            for side in (kq, vq):
                data = side.data.copy()
                data[:, bt[n // B]] = 0xFF
                (dk if side is kq else dv).data = device.to_device(data)
        out = device.zeros((1, 4, D), np.float32)
        CA.decode(q, dk, dv, device.to_device(bt), n, 0.3, 0, out)
        outs.append(device.to_host(out))
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[1], outs[0])


# --------------------------------------------------------------------------
# anchors of quantized K layers
# --------------------------------------------------------------------------

EPS32 = 2.0 ** -24


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("tk", QTYPES)
@pytest.mark.parametrize("atype", list(AnchorType))
def test_anchors_of_quantized_keys_match_cpu(atype, tk):
    """Device anchors of a quantized K layer == the CPU's (QuantizedKV: the dequantized keys,
    the tail block's from the tail), over full blocks, the partial tail block and an empty
    block. MAX / QUEST are a max / min and one (directed) rounding: exact (up to the sign of a
    zero). The summing types add
    float32 keys in token order on both sides; the tolerance allows another order (at most B
    terms of magnitude <= 2 max|k|: 2 B eps32 (2 B max|k|)) plus one fp16 step."""
    rng = np.random.default_rng([QTYPES.index(tk), list(AnchorType).index(atype)])
    n = 22                                             # 5 full blocks, a tail of 2
    c = _host_cache(rng, tk, "f16", n, splits=(6, 21))
    kq, bt = c.k_layer(0), c.table(0)
    Hkv, G, A = 2, 2, 3
    Hq = Hkv * G
    Ha = Hkv if group_shared(atype) else Hq
    lbs = np.array([0, 2, 3, 5])                       # 5: the tail block
    # and a block of the other sequence with no valid token
    blocks = np.append(bt[lbs], c.table(0, seq=1)[0]).astype(np.int32)
    n_valid = np.append(np.minimum(n - lbs * B, B), 0).astype(np.int32)
    imp = rng.integers(0, 3, (c.max_blocks, B, Hq)).astype(np.float16)
    anchor0 = rng.standard_normal((c.max_blocks, A, Ha, D)).astype(np.float16)
    ref = anchor0.copy()
    compute_anchors(atype, kq, blocks, n_valid, ref, imp)
    d_anchor = device.to_device(anchor0)
    cs.compute_anchors(atype, _up(kq), device.to_device(blocks), device.to_device(n_valid),
                       d_anchor, device.to_device(imp))
    got = device.to_host(d_anchor)
    if atype in (AnchorType.BLOCK_MAX, AnchorType.QUEST):
        # exact values; the sign of a zero may differ: dequantized keys hold both -0 (d < 0
        # times a zero quant) and +0, and which of the two a max returns is the reduction's
        # choice (NumPy's, the device loop's)
        np.testing.assert_array_equal(got, ref)
        return
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert np.array_equal(got[np.isinf(got)], ref[np.isinf(ref)])
    # largest |key| per block and channel: [Hkv, NB, D]
    keys = np.abs(as_float(kq).astype(np.float64)).reshape(Hkv, -1, B, D).max(axis=2)
    slack = np.zeros(got.shape)
    slack[:] = np.repeat(2 * B * EPS32 * 2 * B * keys.transpose(1, 0, 2), Ha // Hkv,
                         axis=1)[:, None]
    fin = np.isfinite(ref)
    g64, r64 = got[fin].astype(np.float64), ref[fin].astype(np.float64)
    ulp = np.maximum(np.spacing(np.abs(got[fin])), np.spacing(np.abs(ref[fin]))).astype(np.float64)
    assert np.all(np.abs(g64 - r64) <= ulp + slack[fin]), np.abs(g64 - r64).max()
    # the tail block's anchors come from the tail (exact floats), not the block's stale bytes
    assert kq.tail_block == bt[n // B]
