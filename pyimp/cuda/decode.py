"""The fused one-token decode step of the GPU path: six launches a layer, no per-token
allocation, no per-token copy to the device besides the token id.

:class:`DecodePlan` is made once per device engine. It holds every buffer a decode step
touches, sized at load for the context (activations, the split partials of the attention, the
stored probabilities of the importance update), the RoPE tables of every position of the
context (one pair per distinct set of RoPE arguments), and a small device *step record*
``rec`` (int32: ``rec[0]`` the position of the token being decoded). The kernels read the
position from the record and the step's last kernel advances it, so the launches of a decode
step, their grids and their arguments are the same from one token to the next (what a captured
CUDA graph needs). The host uploads the record only when its own position and the record's
differ (after a prefill, a rewind or a reset), and the block table only when the cache takes a
new block (one int32 a ``block_len`` tokens).

The residual stream lives in two buffers, ``xa`` and ``xb``: a kernel that adds a residual
reads one and writes the other, so no thread block reads what another block of the same launch
writes. Norms are computed where their output is consumed: every thread block of a matvec
recomputes the (cheap, ``n_embd``-long) residual sum and RMSNorm of its input into shared
memory before it multiplies its weight rows with it (the *prologue*).

A decode step, per layer (Gemma 3's order; the others skip what they do not have):

1. ``qkv``: prologue (x += post_ffw_norm(f) of the previous layer, or the scaled embedding;
   h = attn_norm(x)); the q, k and v rows (three weight types in one launch) + biases.
2. ``rope_store``: one block per head: q / k RMSNorm, RoPE at ``rec[0]`` from the tables,
   q's scale; K and V stored into the float cache at slot ``rec[0]`` (a quantized cache is
   written by :meth:`pyimp.cuda.kvcache.DeviceKVCache.write` instead); on a layer with
   key-only anchors, the anchors of the block the key joined recomputed (so a retrieving
   layer adds one launch, scoring and selection: :func:`pyimp.cuda.sparse.retrieve_blocks`).
3. ``attend``: flash-decoding splits over the visible blocks; the last split of a head to
   finish (counted with an atomic) merges the partials, writes the output and adds the step's
   probabilities to ``importance_``; a block-sparse step attends its selection (dense and
   block-sparse steps over a float cache with nobody observing; quantized caches and
   observed steps take :func:`pyimp.cuda.attention.decode`).
4. ``o``: the output projection (a plain matvec).
5. ``gate_up``: prologue (x += post_attention_norm(o + bias); h = ffn_norm(x)); g = act(gate)
   * up, both rows in one pass.
6. ``down``: the down projection (a plain matvec).

Plus one ``embed`` launch (the token's row; its scale is the first prologue's) and one
``head`` launch (prologue with the output norm, the vocabulary rows, the soft-cap, and the
record's advance) a token.

The arithmetic is the step-by-step path's (:mod:`pyimp.cuda.ops`, :mod:`pyimp.cuda.linear`,
:mod:`pyimp.cuda.attention`): the same float32 operations in the same order within a thread,
with block-wide sums over other thread counts; tests compare each kernel with NumPy and the
whole step with the CPU engine.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float32, int32

from .. import ops as host_ops
from . import device, linear
from .attention import (_shared_bytes, accumulate_v_fn, attend_shared, fold_block, merge_splits,
                        prob, score_block_fn, split_blocks, store_mass)
from .ops import _ACTS, rope_index, rope_pair
from .sparse import _anchor_body

_float_anchor = _anchor_body("float")
_score_float = score_block_fn("float")
_accumulate_float = accumulate_v_fn("float")

NEG_INF = -math.inf
MAX_UNIT_HEADS = 16
ATT_THREADS = 8 if device.SIMULATOR else 128
_MAX_THREADS = linear.MV_MAX_THREADS


def _grid(rows: int) -> int:
    """Thread blocks of a prologue matvec over ``rows`` rows: every row its own block up to
    1024 (each block pays the prologue once; more rows loop), two on the simulator."""
    return min(rows, 2) if device.SIMULATOR else max(1, min(rows, 1024))


# ---------------------------------------------------------------- device functions

@cuda.jit(device=True)
def _rms_norm_inplace(vs, n, w, eps, red):
    """vs[0:n] = RMSNorm(vs[0:n]) * w in place, the block's threads striding over n (as
    :func:`pyimp.cuda.ops.rms_norm` computes a row). Ends with a barrier."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    ss = float32(0.0)
    for d in range(tid, n, nt):
        v = vs[d]
        ss += v * v
    tot = device.block_sum(ss, red)
    sc = float32(1.0) / float32(math.sqrt(tot / float32(n) + eps))
    for d in range(tid, n, nt):
        vs[d] = (vs[d] * sc) * w[d]
    cuda.syncthreads()


@cuda.jit(device=True)
def _prologue(xin, in_scale, delta, dbias, post_w, mode, norm_w, eps, xout, xs, red):
    """xs = RMSNorm(x) * norm_w with x = xin * in_scale (mode 0), xin + delta + dbias
    (mode 1), or xin + RMSNorm(delta + dbias) * post_w (mode 2); dbias is read when it has
    xin's length. Block 0 writes x to xout when xout has xin's length. Ends with a barrier."""
    n = xin.shape[0]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    has_bias = dbias.shape[0] == n
    if mode == 2:
        ss = float32(0.0)
        for i in range(tid, n, nt):
            d = delta[i]
            if has_bias:
                d = d + dbias[i]
            ss += d * d
        tot = device.block_sum(ss, red)
        sc = float32(1.0) / float32(math.sqrt(tot / float32(n) + eps))
        for i in range(tid, n, nt):
            d = delta[i]
            if has_bias:
                d = d + dbias[i]
            xs[i] = xin[i] + (d * sc) * post_w[i]
    elif mode == 1:
        for i in range(tid, n, nt):
            d = delta[i]
            if has_bias:
                d = d + dbias[i]
            xs[i] = xin[i] + d
    else:
        for i in range(tid, n, nt):
            xs[i] = xin[i] * in_scale
    if cuda.blockIdx.x == 0 and xout.shape[0] == n:
        for i in range(tid, n, nt):
            xout[i] = xs[i]
    _rms_norm_inplace(xs, n, norm_w, eps, red)


# ---------------------------------------------------------------- prologue matvecs

@functools.cache
def _qkv_kernel(dec_q, dec_k, dec_v):
    """norm + the q, k, v rows (one decoder each) + bias into out[nq + nk + nv]."""

    @cuda.jit
    def qkv(xin, in_scale, delta, dbias, post_w, mode, norm_w, eps, xout,
            rq, rk, rv, nq, nk, bias, out):
        red = cuda.shared.array(_MAX_THREADS, float32)
        xs = cuda.shared.array(0, float32)
        _prologue(xin, in_scale, delta, dbias, post_w, mode, norm_w, eps, xout, xs, red)
        n_in = xin.shape[0]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        n_out = out.shape[0]
        r = cuda.blockIdx.x
        while r < n_out:
            acc = float32(0.0)
            if r < nq:
                for e in range(tid, n_in, nt):
                    acc += dec_q(rq, r, e) * xs[e]
            elif r < nq + nk:
                for e in range(tid, n_in, nt):
                    acc += dec_k(rk, r - nq, e) * xs[e]
            else:
                for e in range(tid, n_in, nt):
                    acc += dec_v(rv, r - nq - nk, e) * xs[e]
            s = device.block_sum(acc, red)
            if tid == 0:
                if bias.shape[0] == n_out:
                    s = s + bias[r]
                out[r] = s
            r += cuda.gridDim.x

    return qkv


@functools.cache
def _gate_up_kernel(dec_g, dec_u, act_name: str):
    """norm + out[r] = act(gate row r . h) * (up row r . h)."""
    act = _ACTS[act_name]

    @cuda.jit
    def gate_up(xin, delta, dbias, post_w, mode, norm_w, eps, xout, rg, ru, out):
        red = cuda.shared.array(_MAX_THREADS, float32)
        xs = cuda.shared.array(0, float32)
        _prologue(xin, float32(1.0), delta, dbias, post_w, mode, norm_w, eps, xout, xs, red)
        n_in = xin.shape[0]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        r = cuda.blockIdx.x
        while r < out.shape[0]:
            ag = float32(0.0)
            au = float32(0.0)
            for e in range(tid, n_in, nt):
                h = xs[e]
                ag += dec_g(rg, r, e) * h
                au += dec_u(ru, r, e) * h
            g = device.block_sum(ag, red)
            u = device.block_sum(au, red)
            if tid == 0:
                out[r] = act(g) * u
            r += cuda.gridDim.x

    return gate_up


@functools.cache
def _head_kernel(dec):
    """norm + the vocabulary rows (+ soft-cap when cap != 0); block 0 advances rec[0]."""

    @cuda.jit
    def head(xin, delta, nothing, post_w, mode, norm_w, eps, raw, inv, cap, out, rec):
        red = cuda.shared.array(_MAX_THREADS, float32)
        xs = cuda.shared.array(0, float32)
        _prologue(xin, float32(1.0), delta, nothing, post_w, mode, norm_w, eps, nothing, xs,
                  red)
        n_in = xin.shape[0]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        r = cuda.blockIdx.x
        while r < out.shape[0]:
            acc = float32(0.0)
            for e in range(tid, n_in, nt):
                acc += dec(raw, r, e) * xs[e]
            s = device.block_sum(acc, red)
            if tid == 0:
                if cap != 0.0:
                    s = float32(math.tanh(s * inv)) * cap
                out[r] = s
            r += cuda.gridDim.x
        if cuda.blockIdx.x == 0 and tid == 0:
            rec[0] = rec[0] + 1

    return head


# ---------------------------------------------------------------- q / k norms, RoPE, store

@cuda.jit(device=True)
def _rotate(vs, out, cos, sin, p, neox):
    """out[0:D] = vs rotated at position p (tables cos / sin [n_ctx, n_rot/2]); channels past
    n_rot copied."""
    D = vs.shape[0]
    half = cos.shape[1]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(tid, half, nt):
        i0, i1 = rope_index(i, half, neox)
        out[i0], out[i1] = rope_pair(vs[i0], vs[i1], cos[p, i], sin[p, i])
    for d in range(2 * half + tid, D, nt):
        out[d] = vs[d]


@cuda.jit
def _rope_store(qkv, Hq, Hkv, D, q_norm, k_norm, qk_norm, eps, cos, sin, neox, q_scale,
                rec, bt, kc, vc, store, qo, ko, akind, anchor):
    """Block h < Hq: query head h -> qo[h]; block Hq + j: kv head j's key -> ko[j] and, with
    store, key and value into the float cache at slot rec[0] (K token-major, V transposed);
    with ``akind >= 0`` (an anchor type's code, :func:`pyimp.cuda.sparse.anchor_code`) the
    anchors of kv head j of the block the key joined are then recomputed over its tokens so
    far, so a layer's anchors stay fresh without a launch of their own."""
    red = cuda.shared.array(_MAX_THREADS, float32)
    sh = cuda.shared.array(0, float32)
    vs = sh[0:D]
    rot = sh[D:2 * D]
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    p = rec[0]
    is_q = b < Hq
    base = b * D if is_q else Hq * D + (b - Hq) * D
    for d in range(tid, D, nt):
        vs[d] = qkv[base + d]
    cuda.syncthreads()
    if qk_norm != 0:
        if is_q:
            _rms_norm_inplace(vs, D, q_norm, eps, red)
        else:
            _rms_norm_inplace(vs, D, k_norm, eps, red)
    _rotate(vs, rot, cos, sin, p, neox)
    cuda.syncthreads()
    if is_q:
        for d in range(tid, D, nt):
            v = rot[d]
            if q_scale != 1.0:
                v = v * q_scale
            qo[b, d] = v
    else:
        j = b - Hq
        for d in range(tid, D, nt):
            ko[j, d] = rot[d]
        if store != 0:
            B = kc.shape[2] // D
            pb = bt[p // B]
            t = p % B
            vbase = (Hq + Hkv) * D + j * D
            for d in range(tid, D, nt):
                kc[j, pb, t * D + d] = rot[d]
                vc[j, pb, d * B + t] = qkv[vbase + d]
            if akind >= 0:
                cuda.syncthreads()                   # the block's keys, this one included
                _float_anchor(akind, kc, kc, -1, B, pb, t + 1, j, anchor)


# ---------------------------------------------------------------- attention

@cuda.jit
def _attend(q, kc, vc, bt, rec, scale, window, sel, cnt, dense, nh, m_part, l_part, o_part,
            counter, out, store, probs, bmax, importance):
    """Decode attention of q [Hq, D] (position rec[0]) over a float cache: every visible block
    (dense) or the blocks of each head's set (sel int32 [nsets, K], cnt [nsets]; head h uses
    set h // (Hq / nsets)), split over gridDim.x / (Hq / nh) work items per unit of nh query
    heads (partials m_part / l_part [1, Hq, nsplit], o_part [1, Hq, nsplit, D]); the last split
    of a unit to finish merges them into out [1, Hq, D] and, with store, adds the probabilities
    to importance [NB][B][Hq] (decay 1)."""
    Hq, D = q.shape
    Hkv = kc.shape[0]
    B = kc.shape[2] // D
    G = Hq // Hkv
    hps = Hq // sel.shape[0]
    units = Hq // nh
    nsplit = cuda.gridDim.x // units
    bid = cuda.blockIdx.x
    sp = bid % nsplit
    u = bid // nsplit
    h0 = u * nh
    kvh = h0 // G
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    sc = float32(scale)
    n_ctx = rec[0] + 1
    lo = 0
    if window > 0:
        lo = max(0, n_ctx - window)
    si = h0 // hps
    lb_first, n_blocks, k_beg, k_end = split_blocks(n_ctx, lo, B, dense != 0, cnt, si, nsplit,
                                                    sp)
    qs, o, s, red, vs = attend_shared(nh, D, B)
    ticket = cuda.shared.array(1, int32)
    m = cuda.local.array(MAX_UNIT_HEADS, float32)
    l = cuda.local.array(MAX_UNIT_HEADS, float32)
    alpha = cuda.local.array(MAX_UNIT_HEADS, float32)
    part = cuda.local.array(MAX_UNIT_HEADS, float32)
    for i in range(tid, nh * D, nt):
        qs[i] = q[h0 + i // D, i % D]
        o[i] = float32(0.0)
    for g in range(nh):
        m[g] = float32(NEG_INF)
        l[g] = float32(0.0)
    cuda.syncthreads()

    for k in range(k_beg, k_end):
        lb = lb_first + k if dense != 0 else sel[si, k]
        pb = bt[lb]
        base = lb * B
        t0 = max(lo - base, 0)
        t1 = max(min(n_ctx - base, B), t0)     # a block the masks hide is an empty range
        ntok = t1 - t0
        _score_float(qs, kc, kc, -1, kvh, pb, t0, t1, nh, D, sc, s, B, part, red)
        cuda.syncthreads()
        fold_block(s, B, t0, t1, nh, m, l, alpha, red)
        _accumulate_float(vc, vc, -1, kvh, pb, t0, t1, nh, D, B, s, alpha, o, vs)
        if store != 0:
            for i in range(tid, nh * ntok, nt):
                g = i // ntok
                t = t0 + i % ntok
                probs[h0 + g, k, t] = s[g * B + t]
            for g in range(tid, nh, nt):
                bmax[h0 + g, k] = m[g]
        cuda.syncthreads()

    for i in range(tid, nh * D, nt):
        o_part[0, h0 + i // D, sp, i % D] = o[i]
    for g in range(tid, nh, nt):                # a unit may have more heads than threads
        m_part[0, h0 + g, sp] = m[g]
        l_part[0, h0 + g, sp] = l[g]

    # the last split of this unit to finish merges (the partials made visible first)
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        ticket[0] = cuda.atomic.add(counter, u, 1)
    cuda.syncthreads()
    if ticket[0] != nsplit - 1:
        return
    cuda.threadfence()
    for g in range(nh):
        m[g], l[g] = merge_splits(m_part, l_part, o_part, 0, h0 + g, out)
    if store != 0:
        for k in range(n_blocks):
            lb = lb_first + k if dense != 0 else sel[si, k]
            pb = bt[lb]
            base = lb * B
            t0 = max(lo - base, 0)
            t1 = min(n_ctx - base, B)
            for i in range(tid, B * nh, nt):
                t = i // nh
                g = i % nh
                h = h0 + g
                if t0 <= t < t1:
                    x = float32(importance[pb, t, h]) + prob(probs, bmax, m[g], l[g], h, k, t)
                    store_mass(importance, pb, t, h, x)
    if tid == 0:
        counter[u] = 0                       # ready for the next step


def attend(q, kc, vc, bt, rec, scale: float, window: int, out, nsplit: int, parts,
           importance, store: bool, sel=None, cnt=None, none=None) -> None:
    """Launch :func:`_attend` over q float32 [Hq, D] at position rec[0], float caches
    kc / vc [Hkv][NB][B*D], into out [Hq, D], in ``nsplit`` splits a unit (the query heads of
    one kv head that share a set). ``sel`` / ``cnt`` (device int32 [nsets, K] / [nsets]): the
    blocks each set attends; None: every visible block (``none``: a [1, 1] / [1] int32 pair
    the dense launch passes instead). ``parts``: (m_part, l_part [1, Hq, nsplit], o_part
    [1, Hq, nsplit, D], counter int32 [>= units] (zeros; the launch leaves them zero), probs
    [Hq, >= blocks, B], bmax [Hq, >= blocks]); with ``store`` the step's probabilities are
    added to ``importance`` float16 [NB][B][Hq]. ``out``: [Hq, D] or [1, Hq, D]."""
    Hq, D = (int(x) for x in q.shape)
    Hkv = int(kc.shape[0])
    B = int(kc.shape[2]) // D
    dense = sel is None
    if dense:
        sel, cnt = none if none is not None else (device.zeros((1, 1), np.int32),
                                                  device.zeros((1,), np.int32))
    nsets = int(sel.shape[0])
    nh = min(Hq // nsets, Hq // Hkv)
    if nh > MAX_UNIT_HEADS:
        raise ValueError(f"{nh} query heads per kv head exceed the decode kernel's "
                         f"{MAX_UNIT_HEADS}")
    nt = ATT_THREADS
    m_part, l_part, o_part, counter, probs, bmax = parts
    if len(out.shape) == 2:
        out = out.reshape(1, Hq, D)
    device.launch(_attend, (Hq // nh) * nsplit, nt, q, kc, vc, bt, rec, np.float32(scale),
                  np.int32(window), sel, cnt, np.int32(dense), np.int32(nh), m_part, l_part,
                  o_part, counter, out, np.int32(store), probs, bmax, importance,
                  shared=_shared_bytes(nh, D, B, nt))


# ---------------------------------------------------------------- the plan

class StepGraph:
    """A decode step captured once as a CUDA graph and replayed per token (hardware only).

    numba-cuda launches through NVIDIA's driver bindings; the step's launches are recorded on a
    stream of their own between ``cuStreamBeginCapture`` (relaxed mode) and
    ``cuStreamEndCapture``, instantiated, and replayed with one ``cuGraphLaunch``. Every
    argument of every launch is a buffer of the plan (fixed for its life) or a constant of the
    model, and the positions come from the step record, so one graph serves every token; a
    graph is remade when a buffer it names is replaced (``key``)."""

    def __init__(self):
        from cuda.bindings import driver
        self.drv = driver
        self.stream = cuda.stream()
        self.graph = self.exec = self.key = None

    def _ok(self, res, what: str):
        res = res if isinstance(res, tuple) else (res,)
        if int(res[0]) != 0:
            raise RuntimeError(f"{what} failed: {res[0]}")
        return res[1] if len(res) > 1 else None

    def begin(self) -> None:
        d = self.drv
        self._ok(d.cuStreamBeginCapture(
            self.stream.handle, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
            "cuStreamBeginCapture")

    def end(self, key) -> None:
        d = self.drv
        graph = self._ok(d.cuStreamEndCapture(self.stream.handle), "cuStreamEndCapture")
        self.drop()
        self.graph, self.key = graph, key
        self.exec = self._ok(d.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def abort(self) -> None:
        """End a capture cut short (its graph dropped)."""
        try:
            res = self.drv.cuStreamEndCapture(self.stream.handle)
            if int(res[0]) == 0 and res[1] is not None:
                self.drv.cuGraphDestroy(res[1])
        except Exception:
            pass

    def replay(self) -> None:
        self._ok(self.drv.cuGraphLaunch(self.exec, self.stream.handle), "cuGraphLaunch")

    def drop(self) -> None:
        if self.exec is not None:
            self.drv.cuGraphExecDestroy(self.exec)
        if self.graph is not None:
            self.drv.cuGraphDestroy(self.graph)
        self.graph = self.exec = self.key = None

    def fetch(self, d) -> np.ndarray:
        """A host copy of device array d once the replay has run."""
        out = d.copy_to_host(stream=self.stream)
        self.stream.synchronize()
        return out


class SimStepGraph:
    """:class:`StepGraph`'s emulation on the simulator: a capture records the step's launches
    with their arguments (:class:`pyimp.cuda.device.Recorder`) and a replay runs them as
    recorded, so a step that read anything but the plan's buffers and constants (a position or
    a length passed from the host) replays wrong, as a real graph would."""

    def __init__(self):
        self.stream = self.key = None
        self._recorded = None

    def begin(self) -> None:
        self.stream = device.Recorder()

    def end(self, key) -> None:
        self._recorded, self.key = self.stream, key

    def abort(self) -> None:
        self.stream = None

    def replay(self) -> None:
        self._recorded.replay()

    def fetch(self, d) -> np.ndarray:
        return device.to_host(d)


GRAPH_FLAGS = ("0", "1", "sim")


def graphs_wanted() -> bool:
    """Decode steps replay as CUDA graphs on hardware unless PYIMP_CUDA_GRAPHS=0; on the
    simulator only with PYIMP_CUDA_GRAPHS=sim (:class:`SimStepGraph`). Another value raises
    ValueError naming it (a device engine checks at load)."""
    import os
    flag = os.environ.get("PYIMP_CUDA_GRAPHS", "1")
    if flag not in GRAPH_FLAGS:
        raise ValueError(f"PYIMP_CUDA_GRAPHS={flag!r}: use 0 (eager launches), 1 (CUDA graphs, "
                         f"the default) or sim (the simulator's emulation of them)")
    if device.SIMULATOR:
        return flag == "sim"
    return not device.compiling() and flag != "0"


def _decoder(lin):
    return linear._DECODERS[linear._type_kernels(lin.qtype)[0]]


class DecodePlan:
    """The buffers, tables and kernels of the fused decode step of one device engine
    (:class:`pyimp.cuda.forward.DeviceForward` drives it; see the module docstring)."""

    def __init__(self, fwd, n_ctx: int, max_blocks: int, block_len: int):
        graphs_wanted()                             # a bad PYIMP_CUDA_GRAPHS fails the load
        cfg, A = fwd.cfg, fwd.arch
        self.fwd, self.cfg, self.arch = fwd, cfg, A
        E, F, V = cfg.n_embd, cfg.n_ff, cfg.n_vocab
        Hq, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.Hq, self.Hkv, self.D, self.B = Hq, Hkv, D, block_len
        f32 = np.float32
        self.tok = device.zeros((1,), np.int32)
        self.rec = device.zeros((4,), np.int32)
        self.rec_pos: int | None = None             # what rec[0] holds, as the host knows it
        self.emb = device.zeros((1, E), f32)
        self.xa = device.zeros((E,), f32)
        self.xb = device.zeros((E,), f32)
        self.qkv_out = device.zeros(((Hq + 2 * Hkv) * D,), f32)
        self.q = device.zeros((Hq, D), f32)
        self.k = device.zeros((Hkv, D), f32)
        self.att = device.zeros((Hq, D), f32)
        self.o = device.zeros((E,), f32)
        self.g = device.zeros((F,), f32)
        self.f = device.zeros((E,), f32)
        self.logits = device.zeros((1, V), f32)
        self.empty = device.zeros((0,), f32)
        # the step-by-step kernels' views of them (a quantized cache's write, sparse steps)
        self.q3, self.k3 = self.q.reshape(1, Hq, D), self.k.reshape(1, Hkv, D)
        self.v3 = self.qkv_out[(Hq + Hkv) * D:].reshape(1, Hkv, D)
        self.att3 = self.att.reshape(1, Hq, D)
        # attention: one unit per kv head, the splits fixed for the context
        self.nh = Hq // Hkv
        if self.nh > MAX_UNIT_HEADS:
            raise ValueError(f"{self.nh} query heads per kv head exceed the decode kernel's "
                             f"{MAX_UNIT_HEADS}")
        self.nsplit = 2 if device.SIMULATOR else max(1, min(max_blocks, -(-264 // Hkv)))
        self.m_part = device.zeros((1, Hq, self.nsplit), f32)
        self.l_part = device.zeros((1, Hq, self.nsplit), f32)
        self.o_part = device.zeros((1, Hq, self.nsplit, D), f32)
        self.counter = device.zeros((Hq,), np.int32)           # one per unit, at most Hq
        self.none = (device.zeros((1, 1), np.int32), device.zeros((1,), np.int32))
        self.probs = device.zeros((Hq, max_blocks, block_len), f32)
        self.bmax = device.zeros((Hq, max_blocks), f32)
        self.imp0 = device.zeros((1, 1, 1), np.float16)      # no importance: never written
        self.anchor0 = device.zeros((1, 1, 1, 1), np.float16)  # no anchors: never written
        # RoPE tables of every position, one pair per distinct argument set
        self.rope = []
        tables: dict = {}
        for il in range(cfg.n_layer):
            args = cfg.layer_rope(il)
            key = tuple(args.values())
            if key not in tables:
                cos, sin = host_ops.rope_cache(np.arange(n_ctx), cfg.rope_dim,
                                               freq_factors=fwd.engine.weights.rope_freqs,
                                               **args)
                tables[key] = (device.to_device(cos), device.to_device(sin))
            self.rope.append(tables[key])
        # per-layer constants
        self.layers = []
        for lw in fwd.layers:
            bias = [lw[n] for n in ("attn_q_bias", "attn_k_bias", "attn_v_bias")]
            if any(b is not None for b in bias):
                host = [np.zeros(n, f32) if b is None else device.to_host(b)
                        for b, n in zip(bias, (Hq * D, Hkv * D, Hkv * D))]
                qkv_bias = device.to_device(np.concatenate(host))
            else:
                qkv_bias = self.empty
            self.layers.append({
                "qkv": _qkv_kernel(_decoder(lw["attn_q"]), _decoder(lw["attn_k"]),
                                   _decoder(lw["attn_v"])),
                "gate_up": _gate_up_kernel(_decoder(lw["ffn_gate"]), _decoder(lw["ffn_up"]),
                                           A.ffn_act),
                "qkv_bias": qkv_bias,
                "o_bias": self.empty if lw["attn_output_bias"] is None else lw["attn_output_bias"],
            })
        self.head_kernel = _head_kernel(_decoder(fwd.output))
        self.threads = device.row_threads(E // 8, _MAX_THREADS)
        # CUDA graph of the all-dense fused step: "eager" | "capture" | "replay" this step
        self.mode = "eager"
        self.graph: StepGraph | None = None
        self.graph_error: str | None = None         # why graphs are off, once they failed
        self.eager_steps = 0
        self.replays = 0
        self.rope_threads = 8 if device.SIMULATOR else device.pow2_threads(D, 32, 256)

    # ------------------------------------------------------------------ host side
    def start(self, step, graph_key) -> None:
        """Before a step: its mode, then the token id in (and the record when the host's
        position differs), on the stream the step runs on. The mode: replay the captured graph
        (``graph_key`` not None: every launch of the step is the fused dense one, and the
        buffers it names are ``graph_key``), capture it (after one eager step has compiled
        every kernel), or launch eagerly."""
        self.mode = "eager"
        if graph_key is not None and self.graph_error is None and graphs_wanted():
            if self.graph is not None and self.graph.key == graph_key:
                self.mode = "replay"
            elif self.eager_steps >= 1:
                try:
                    if self.graph is None:
                        self.graph = SimStepGraph() if device.SIMULATOR else StepGraph()
                    self.mode = "capture"
                except Exception as e:                      # no driver bindings: eager
                    self.graph_error = f"{type(e).__name__}: {e}"
        graphed = self.mode != "eager" and isinstance(self.graph, StepGraph)
        stream = self.graph.stream if graphed else 0
        device.upload(self.tok, np.asarray(step.tokens[:1], np.int32), stream)
        if self.rec_pos != step.pos0:
            device.upload(self.rec, np.array([step.pos0, 0, 0, 0], np.int32), stream)
            self.rec_pos = step.pos0
        if self.mode != "capture":
            return
        try:
            self.graph.begin()
        except Exception as e:                              # capture refused: eager
            self.graph_error = f"{type(e).__name__}: {e}"
            self.mode = "eager"
            return
        self._key = graph_key
        self._on_stream = device.on_stream(self.graph.stream)
        self._on_stream.__enter__()

    def _launching(self) -> bool:
        return self.mode != "replay"

    # ------------------------------------------------------------------ launches
    def embed(self) -> None:
        if not self._launching():
            return
        e = self.fwd.embd
        linear.get_rows(e.raw, e.qtype, self.cfg.n_embd, self.tok, self.emb)

    def qkv(self, il: int, first: bool) -> None:
        """Launch 1 of layer il: (residual +) attention norm, q / k / v rows."""
        if not self._launching():
            return
        fw, lw, L = self.fwd, self.fwd.layers[il], self.layers[il]
        E = self.cfg.n_embd
        if first:
            xin, mode, delta, post = self.emb[0], 0, self.empty, self.empty
        else:
            prev = fw.layers[il - 1]
            xin, delta = self.xb, self.f
            post = prev["post_ffw_norm"]
            mode = 2 if post is not None else 1
            post = self.empty if post is None else post
        scale = np.float32(math.sqrt(E)) if first and self.arch.embd_scale else np.float32(1.0)
        q, k, v = lw["attn_q"], lw["attn_k"], lw["attn_v"]
        device.launch(L["qkv"], _grid(self.qkv_out.shape[0]), self.threads,
                      xin, scale, delta, self.empty, post, np.int32(mode), lw["attn_norm"],
                      fw.eps, self.xa, q.raw, k.raw, v.raw, np.int32(q.n_out),
                      np.int32(k.n_out), L["qkv_bias"], self.qkv_out, shared=4 * E)

    def rope_store(self, il: int, kc, vc, bt, store: bool, anchors=None) -> None:
        """Launch 2: q / k norms, RoPE, q's scale; K / V into the float cache when store;
        ``anchors`` (kind code, anchor storage ``[NB][A][Ha][D]``): the anchors of the block
        the key joined, recomputed after the store."""
        if not self._launching():
            return
        fw, lw, A = self.fwd, self.fwd.layers[il], self.arch
        D = self.D
        cos, sin = self.rope[il]
        qn = lw["attn_q_norm"] if A.qk_norm else self.empty
        kn = lw["attn_k_norm"] if A.qk_norm else self.empty
        q_scale = np.float32(1.0 / math.sqrt(D)) if A.q_prescale else np.float32(1.0)
        if not store:
            kc = vc = self.imp0
        akind, anchor = (-1, self.anchor0) if anchors is None or not store else anchors
        device.launch(_rope_store, self.Hq + self.Hkv, self.rope_threads,
                      self.qkv_out, np.int32(self.Hq), np.int32(self.Hkv), np.int32(D), qn, kn,
                      np.int32(A.qk_norm), fw.eps, cos, sin, np.int32(A.rope_neox), q_scale,
                      self.rec, bt, kc, vc, np.int32(store), self.q, self.k, np.int32(akind),
                      anchor, shared=8 * D)

    def attend(self, kc, vc, bt, scale: float, window: int, importance, sel=None,
               cnt=None) -> None:
        """Launch 3: attention over every visible block (or the selection sel / cnt), its
        merge, and the importance update when given."""
        if not self._launching():
            return
        attend(self.q, kc, vc, bt, self.rec, scale, window, self.att3, self.nsplit,
               (self.m_part, self.l_part, self.o_part, self.counter, self.probs, self.bmax),
               importance if importance is not None else self.imp0, importance is not None,
               sel, cnt, self.none)

    def o_proj(self, il: int) -> None:
        """Launch 4: the output projection (its bias joins the next prologue)."""
        if not self._launching():
            return
        w = self.fwd.layers[il]["attn_output"]
        linear.matvec(w.raw, w.qtype, w.n_in, self.att.reshape(self.Hq * self.D), self.o)

    def gate_up(self, il: int) -> None:
        """Launch 5: residual + post-attention norm + FFN norm, act(gate) * up."""
        if not self._launching():
            return
        fw, lw, L = self.fwd, self.fwd.layers[il], self.layers[il]
        post = lw["post_attention_norm"]
        mode = 2 if post is not None else 1
        device.launch(L["gate_up"], _grid(self.cfg.n_ff), self.threads,
                      self.xa, self.o, L["o_bias"], self.empty if post is None else post,
                      np.int32(mode), lw["ffn_norm"], fw.eps, self.xb, lw["ffn_gate"].raw,
                      lw["ffn_up"].raw, self.g, shared=4 * self.cfg.n_embd)

    def down(self, il: int) -> None:
        """Launch 6: the down projection."""
        if not self._launching():
            return
        w = self.fwd.layers[il]["ffn_down"]
        linear.matvec(w.raw, w.qtype, w.n_in, self.g, self.f)

    def head(self) -> np.ndarray:
        """The last residual, the output norm, the vocabulary rows, the soft-cap; advances
        the record. Returns the logits row on the host ([1, n_vocab])."""
        fw, cfg = self.fwd, self.cfg
        if self._launching():
            post = fw.layers[-1]["post_ffw_norm"]
            mode = 2 if post is not None else 1
            cap = np.float32(cfg.final_softcap or 0.0)
            inv = np.float32(1.0) / cap if cap else np.float32(0.0)
            device.launch(self.head_kernel, _grid(cfg.n_vocab), self.threads, self.xb, self.f,
                          self.empty, self.empty if post is None else post, np.int32(mode),
                          fw.output_norm, fw.eps, fw.output.raw, inv, cap, self.logits[0],
                          self.rec, shared=4 * cfg.n_embd)
        if self.mode == "capture":
            self._on_stream.__exit__(None, None, None)
            try:
                self.graph.end(self._key)
            except Exception as e:              # the step did not run: run it eagerly later
                self.graph_error = f"{type(e).__name__}: {e}"
                self.graph.abort()
                raise RuntimeError(f"device cuda: capturing the decode step as a CUDA graph "
                                   f"failed ({self.graph_error}); set PYIMP_CUDA_GRAPHS=0") \
                    from None
            self.mode = "replay"
        if self.mode == "replay":
            self.graph.replay()
            self.replays += 1
            out = self.graph.fetch(self.logits)
        else:
            self.eager_steps += 1
            out = device.to_host(self.logits)
        if self.rec_pos is not None:
            self.rec_pos += 1
        return out

    def abort(self) -> None:
        """A step cut short by an error: a capture in progress ends (the record is uploaded
        again by the next step)."""
        if self.mode == "capture":
            self._on_stream.__exit__(None, None, None)
            self.graph.abort()
            self.graph_error = "a step failed during capture"
        self.mode = "eager"
        self.rec_pos = None
