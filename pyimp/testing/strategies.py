"""Hypothesis strategies for the conformance suite and for property tests.

Every strategy draws its shapes and edge choices through hypothesis (so failures shrink to
small cases) and its bulk data from a NumPy generator seeded by a drawn integer (fast for
arrays of thousands of elements). Edge cases are drawn on purpose, not left to chance:

- :func:`quant_rows`: ggml blocks of every supported type whose fp16 scale / min fields take
  zero, subnormal, unit, random and extreme (+-65504) values; never NaN or inf;
- :func:`gqa_shapes`: Hkv, G (Hq = Hkv * G), head_dim D and block length B, with several kv
  heads *and* several query heads per group often enough to tell ``h // G`` from ``h % Hkv``;
- :func:`paged_caches`: a layer's paged K / V in fp16 or float32 with a non-identity block
  table, spare physical blocks and a partial tail whose fill is often exactly one token;
  slots past the context and the spare blocks hold large garbage, so a kernel that reads
  them is caught;
- :func:`importance_buffers`: fp16 importance from zero to near the fp16 limit (2048, where
  adding less than 1 is lost, and 65504, where it saturates).

Requires hypothesis (``pip install 'pyimp[testing]'``).
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from loaders.ggml_types import FP16_FIELDS, GGML_QUANT_SIZES, QT, SUPPORTED_TYPES

# a type's name -> its ggml type, in the order ggml numbers them
TYPES = tuple(t.name for t in sorted(SUPPORTED_TYPES, key=int))
GARBAGE = 3.0e4      # what unused cache slots hold (finite in fp16)

# fp16 scale values a block may carry: the edges first, then ordinary magnitudes
_EDGE_SCALES = (0.0, -0.0, 2.0 ** -24, 6.1e-5, 1.0, -1.0, 65504.0, -65504.0)


@st.composite
def fp16_scale(draw) -> np.float16:
    """A finite fp16 value: an edge value or a random one of any magnitude and sign."""
    if draw(st.booleans()):
        return np.float16(draw(st.sampled_from(_EDGE_SCALES)))
    mag = draw(st.floats(-24, 15.99))
    return np.float16(draw(st.sampled_from((1.0, -1.0))) * 2.0 ** mag)


@st.composite
def quant_rows(draw, qtype: str, max_rows: int = 3, max_blocks: int = 2):
    """(raw uint8 [rows, row_bytes], n) of ggml type ``qtype`` (its name, e.g. "Q4_K").

    Quantized types: random bytes with every fp16 field set from :func:`fp16_scale` (one value
    drawn for some blocks, all of a row zero sometimes). F32 / F16 / BF16: finite values
    including +-0, subnormals and the type's extremes."""
    qt = QT[qtype]
    bs, ts = GGML_QUANT_SIZES[qt]
    rows = draw(st.integers(1, max_rows))
    nblk = draw(st.integers(1, max_blocks))
    if bs == 1:                                  # float types: n elements per row
        nblk *= 32
    n = nblk * bs
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    if qt == QT.F32:
        vals = rng.standard_normal((rows, n)).astype(np.float32) * np.float32(draw(st.sampled_from(
            (1.0, 1e-30, 1e30))))
        vals.flat[:4] = np.array([0.0, -0.0, 1e-45, 3.4e38], np.float32)[:vals.size]
        return np.ascontiguousarray(vals).view(np.uint8).reshape(rows, -1), n
    if qt in (QT.F16, QT.BF16):
        bits = rng.integers(0, 1 << 16, (rows, n), dtype=np.uint32).astype(np.uint16)
        exp_mask, exp_all = (0x7C00, 0x7C00) if qt == QT.F16 else (0x7F80, 0x7F80)
        bad = (bits & exp_mask) == exp_all               # inf / NaN patterns: make them finite
        bits[bad] &= np.uint16(~(exp_mask & (exp_mask >> 1)) & 0xFFFF)
        return bits.view(np.uint8).reshape(rows, -1), n
    raw = rng.integers(0, 256, (rows * nblk, ts), dtype=np.uint8)
    for off in FP16_FIELDS[qt]:
        mode = draw(st.sampled_from(("random", "one", "edges")))
        if mode == "random":
            d = (rng.standard_normal(rows * nblk) * 0.05).astype(np.float16)
        elif mode == "one":
            d = np.full(rows * nblk, draw(fp16_scale()), np.float16)
        else:
            d = np.array([draw(fp16_scale()) for _ in range(rows * nblk)], np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, nblk * ts), n


@st.composite
def gqa_shapes(draw, max_kv: int = 3, groups=(1, 2, 4), head_dims=(4, 8, 16, 32),
               block_lens=(1, 2, 4, 8, 16)) -> dict:
    """dict(Hkv, G, Hq, D, B): about half the draws have Hkv >= 2 and G >= 2."""
    if draw(st.booleans()):
        Hkv = draw(st.integers(2, max(2, max_kv)))
        G = draw(st.sampled_from([g for g in groups if g >= 2] or [2]))
    else:
        Hkv = draw(st.integers(1, max_kv))
        G = draw(st.sampled_from(groups))
    return dict(Hkv=Hkv, G=G, Hq=Hkv * G, D=draw(st.sampled_from(head_dims)),
                B=draw(st.sampled_from(block_lens)))


@st.composite
def paged_caches(draw, shape: dict | None = None, max_blocks: int = 6, dtypes=("f16", "f32")):
    """dict(k_cache, v_cache, block_table, n_ctx, shape, rng): one layer's paged cache.

    ``n_ctx = (n_lb - 1) * B + tail`` with tail 1 (a one-token tail), B (no partial block) or
    anything between; the table maps the n_lb logical blocks to a random subset of NB >= n_lb
    physical blocks (never the identity when it has a choice). Keys and values are N(0, 1)
    with a few drawn scales; slots past n_ctx and unused blocks hold GARBAGE."""
    shape = shape or draw(gqa_shapes())
    Hkv, D, B = shape["Hkv"], shape["D"], shape["B"]
    n_lb = draw(st.integers(1, max_blocks))
    tail = draw(st.sampled_from(("one", "full", "any")))
    tail = {"one": 1, "full": B}.get(tail) or draw(st.integers(1, B))
    n_ctx = (n_lb - 1) * B + tail
    NB = n_lb + draw(st.integers(0, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    perm = rng.permutation(NB)
    if NB > 1 and (perm[:n_lb] == np.arange(n_lb)).all():
        perm = np.roll(perm, 1)
    bt = perm[:n_lb].astype(np.int32)
    dtype = np.float16 if draw(st.sampled_from(dtypes)) == "f16" else np.float32
    kscale = draw(st.sampled_from((1.0, 0.25, 4.0)))
    K = np.full((Hkv, NB, B, D), GARBAGE, np.float32)
    V = np.full((Hkv, NB, D, B), -GARBAGE, np.float32)
    p = np.arange(n_ctx)
    K[:, bt[p // B], p % B, :] = rng.standard_normal((Hkv, n_ctx, D)) * kscale
    V[:, bt[p // B], :, p % B] = rng.standard_normal((n_ctx, Hkv, D))
    return dict(k_cache=K.reshape(Hkv, NB, B * D).astype(dtype),
                v_cache=V.reshape(Hkv, NB, D * B).astype(dtype),
                block_table=bt, n_ctx=n_ctx, shape=shape, rng=rng)


@st.composite
def importance_buffers(draw, NB: int, B: int, Hq: int) -> np.ndarray:
    """fp16 [NB][B][Hq]: zeros, small values, values near 2048 or near the fp16 limit."""
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    kind = draw(st.sampled_from(("zero", "small", "near_2048", "near_max", "mixed")))
    base = {"zero": 0.0, "small": 0.0, "near_2048": 2040.0, "near_max": 65400.0}
    if kind == "mixed":
        x = rng.choice(np.array([0.0, 0.5, 2047.0, 65500.0]), (NB, B, Hq))
        x += rng.random((NB, B, Hq)) * 4
    else:
        x = base[kind] + (rng.random((NB, B, Hq)) * 4 if kind != "zero" else np.zeros((NB, B, Hq)))
    return np.minimum(x, 65504.0).astype(np.float16)
