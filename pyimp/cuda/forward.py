"""The device backend of :func:`pyimp.forward.forward`: :class:`DeviceForward`, the
``device="cuda"`` steps of the one forward pass.

Weights are uploaded once, still quantized (the GGUF rows as uint8), with the norms as
float32. Activations, the KV cache (:class:`pyimp.cuda.kvcache.DeviceKVCache`),
``importance_`` and the anchors stay on the device. A prefill chunk copies its token ids and
RoPE rows to the device and runs the step-by-step kernels of :mod:`pyimp.cuda.linear`,
:mod:`pyimp.cuda.ops` and :mod:`pyimp.cuda.attention`. A one-token decode step runs the fused
step of :mod:`pyimp.cuda.decode` (:class:`~pyimp.cuda.decode.DecodePlan`): six launches a
layer, the token id in and the logits row out, replayed as a CUDA graph on hardware; the steps
below hand their work to the plan when ``self.fused`` is set.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops as host_ops
from . import attention, device, linear
from . import ops as dops
from .decode import DecodePlan


class DeviceLinear:
    """A weight matrix on the device: its stored rows (uint8 [n_out, row_bytes]) and type."""

    def __init__(self, raw: np.ndarray, qtype, n_in: int, n_out: int):
        self.raw = device.to_device(np.ascontiguousarray(raw))
        self.qtype, self.n_in, self.n_out = qtype, n_in, n_out

    @classmethod
    def of(cls, lin) -> DeviceLinear:
        return cls(lin.raw, lin.qtype, lin.n_in, lin.n_out)

    def __call__(self, x, out) -> None:
        """out float32 [T, n_out] = x float32 [T, n_in] @ W.T."""
        if x.shape[0] == 1:
            linear.matvec(self.raw, self.qtype, self.n_in, x[0], out[0])
        else:
            linear.matmul(self.raw, self.qtype, self.n_in, x, out)


class DeviceForward:
    """The model's weights on the device and the forward's steps over them."""

    def __init__(self, engine):
        cfg, W = engine.cfg, engine.weights
        self.engine, self.cfg, self.arch = engine, cfg, W.arch
        self.eps = np.float32(cfg.rms_eps)
        # numerics and rotation: EngineOptions.validate checked them (pyimp.capabilities)

        def vec(a):
            return None if a is None else device.to_device(np.ascontiguousarray(a, np.float32))

        t = W.token_embd
        self.embd = DeviceLinear(t.raw, t.qtype, t.shape[0], t.n_rows)
        self.output = self.embd if cfg.tied_output else DeviceLinear.of(W.output)
        self.output_norm = vec(W.output_norm)
        self.layers = []
        for lw in W.layers:
            self.layers.append({
                "attn_norm": vec(lw.attn_norm), "ffn_norm": vec(lw.ffn_norm),
                "attn_q_norm": vec(lw.attn_q_norm), "attn_k_norm": vec(lw.attn_k_norm),
                "post_attention_norm": vec(lw.post_attention_norm),
                "post_ffw_norm": vec(lw.post_ffw_norm),
                **{name: vec(getattr(lw, name)) for name in
                   ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_output_bias")},
                **{name: DeviceLinear.of(getattr(lw, name)) for name in
                   ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
            })
        self.scratch = attention.Scratch()
        self._bufs = attention.Scratch()
        self.plan = None             # the fused decode step's buffers, made by build()
        self.fused = False           # this step runs the fused decode (pyimp.cuda.decode)

    def _buf(self, name: str, *shape):
        return self._bufs.get(name, shape, np.float32)

    @staticmethod
    def _residual(x, o, post_norm, eps) -> None:
        """x += o, with o RMS-normed in place first where the architecture has post-norms."""
        if post_norm is not None:
            dops.rms_norm(o, post_norm, eps, o)
        dops.add(x, o)

    # the steps of pyimp.forward.forward; activations stay on the device
    def begin(self, step) -> None:
        self.cache, self.sparse = self.engine.cache, self.engine.sparse
        self.fused = self.plan is not None and step.fused and step.decode and step.T == 1
        if self.fused:
            self.plan.start(step, self._graph_key(step))

    def _graph_key(self, step):
        """The buffers a captured decode step names, when every launch of ``step`` is the
        fused dense one (logits asked for, a float cache, no sparse layer, importance without
        observers); else None (the step launches eagerly)."""
        c, sp = self.cache, self.sparse
        if not step.logits or c.quantized or any(step.sparse) or \
                (sp is not None and not sp.fused_ok()):
            return None
        return (id(c.k_store), id(c.v_store),
                None if sp is None else id(sp.importance_dev))

    def abort(self) -> None:
        """A forward that raised: the fused step's capture, if one was under way, ends."""
        if self.fused:
            self.plan.abort()

    def embed(self, step):
        if self.fused:
            self.plan.embed()
            return self.plan.xa
        E = self.cfg.n_embd
        x = self._buf("x", step.T, E)
        linear.get_rows(self.embd.raw, self.embd.qtype, E,
                        device.to_device(np.asarray(step.tokens, np.int64)), x)
        if self.arch.embd_scale:
            dops.scale(x, np.float32(math.sqrt(E)))
        return x

    def _h(self, rows: int, step):
        """The norm output buffer's last ``rows`` rows."""
        return self._buf("h", step.T, self.cfg.n_embd)[step.T - rows:]

    def norm_in(self, x, il, step):
        if self.fused:                      # the next launch's prologue normalizes
            return None
        h = self._h(x.shape[0], step)
        dops.rms_norm(x, self.layers[il]["attn_norm"], self.eps, h)
        return h

    def qkv(self, il, h, step):
        cfg, T, lw = self.cfg, step.T, self.layers[il]
        Hq, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        if self.fused:
            self.plan.qkv(il, first=il == 0)
            return None, None, self.plan.v3
        q = self._buf("q", T, Hq * D)
        k = self._buf("k", T, Hkv * D)
        v = self._buf("v", T, Hkv * D)
        for name, y in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
            lw[name](h, y)
            if lw[name + "_bias"] is not None:
                dops.add_rows(y, lw[name + "_bias"])
        return q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)

    def qk_rope(self, il, q3, k3, step):
        if self.fused:
            c = self.cache
            store = not c.quantized
            kc, vc = (c.k_layer(il), c.v_layer(il)) if store else (None, None)
            anchors = self.sparse.fused_anchors(il) if self.sparse is not None else None
            self.plan.rope_store(il, kc, vc, c.bt_dev, store, anchors)
            return self.plan.q3, self.plan.k3
        cfg, A, T, lw = self.cfg, self.arch, step.T, self.layers[il]
        Hq, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        if A.qk_norm:
            qn = self._buf("qn", T * Hq, D)
            kn = self._buf("kn", T * Hkv, D)
            dops.rms_norm(q3.reshape(T * Hq, D), lw["attn_q_norm"], self.eps, qn)
            dops.rms_norm(k3.reshape(T * Hkv, D), lw["attn_k_norm"], self.eps, kn)
            q3, k3 = qn.reshape(T, Hq, D), kn.reshape(T, Hkv, D)
        args = cfg.layer_rope(il)
        key = ("rope",) + tuple(args.values())
        if key not in step.memo:
            cos, sin = host_ops.rope_cache(step.pos, cfg.rope_dim,
                                           freq_factors=self.engine.weights.rope_freqs, **args)
            step.memo[key] = (device.to_device(cos), device.to_device(sin))
        cos, sin = step.memo[key]
        dops.rope(q3, cos, sin, A.rope_neox)
        dops.rope(k3, cos, sin, A.rope_neox)
        if A.q_prescale:
            dops.scale(q3, np.float32(1.0 / math.sqrt(D)))
        return q3, k3

    def attention(self, il, q3, k3, v3, step):
        cfg, cache, sp, T = self.cfg, self.cache, self.sparse, step.T
        if self.fused:
            return self._fused_attention(il, q3, k3, v3, step)
        cache.write(il, k3, v3, step.pos0)
        window = step.windows[il]
        kc, vc, bt = cache.k_layer(il), cache.v_layer(il), cache.bt_dev
        att = self._buf("att", T, cfg.n_head * cfg.head_dim)
        att3 = att.reshape(T, cfg.n_head, cfg.head_dim)
        if step.decode:
            if sp is not None:
                sp.decode_attention(il, q3, step.pos0 + 1, step.kq_scale, window, att3,
                                    step.sparse[il])
            else:
                attention.decode(q3, kc, vc, bt, step.pos0 + 1, step.kq_scale, window, att3,
                                 scratch=self.scratch)
        else:
            imp = None if sp is None else sp.importance_dev[il]
            attention.prefill(q3, kc, vc, bt, step.pos0, step.kq_scale, window, att3,
                              importance=imp, obs_start=step.obs_start, scratch=self.scratch)
        return att

    def _fused_attention(self, il, q3, k3, v3, step):
        """Decode attention after the fused step's rope_store launch: the fused attention
        launch where the step is dense over a float cache, else the step-by-step kernels."""
        cache, sp, plan, p = self.cache, self.sparse, self.plan, step.pos0
        window, scale = step.windows[il], step.kq_scale
        if cache.quantized:
            cache.write(il, k3, v3, p)
        else:                                  # rope_store stored the row: the host's record
            cache.slot_pos[0, il, p] = p
        # after the write: a quantized side's operand names the tail block the write left
        kc, vc, bt = cache.k_layer(il), cache.v_layer(il), cache.bt_dev
        sparse = bool(step.sparse and step.sparse[il])
        fusable = not cache.quantized and (sp is None or sp.fused_ok())
        if fusable and sp is None:
            plan.attend(kc, vc, bt, scale, window, None)
        elif fusable and not sparse:
            sp.dense_step(il, q3, p + 1, scale, window,
                          lambda: plan.attend(kc, vc, bt, scale, window, sp.importance_dev[il]),
                          sp.fused_anchors(il) is not None)
        elif fusable:
            sp.sparse_step(il, q3, p + 1, scale, window,
                           lambda sel, cnt: plan.attend(kc, vc, bt, scale, window,
                                                        sp.importance_dev[il], sel, cnt),
                           sp.fused_anchors(il) is not None)
        elif sp is not None:
            sp.decode_attention(il, q3, p + 1, scale, window, plan.att3, sparse)
        else:
            attention.decode(q3, kc, vc, bt, p + 1, scale, window, plan.att3,
                             scratch=self.scratch)
        return plan.att

    def attn_output(self, il, att, step):
        if self.fused:
            self.plan.o_proj(il)
            return self.plan.o
        o = self._buf("o", step.T, self.cfg.n_embd)
        self.layers[il]["attn_output"](att, o)
        if self.layers[il]["attn_output_bias"] is not None:
            dops.add_rows(o, self.layers[il]["attn_output_bias"])
        return o

    def residual_attn(self, il, x, o, last, step):
        if self.fused:                      # the gate / up launch adds the residual
            return x, None
        self._residual(x, o, self.layers[il]["post_attention_norm"], self.eps)
        if last and step.T > 1:
            x = x[step.T - 1:step.T]                            # the last row only
        h = self._h(x.shape[0], step)
        dops.rms_norm(x, self.layers[il]["ffn_norm"], self.eps, h)
        return x, h

    def ffn(self, il, h, step):
        if self.fused:
            self.plan.gate_up(il)
            self.plan.down(il)
            return self.plan.f
        n, F, lw = h.shape[0], self.cfg.n_ff, self.layers[il]
        g = self._buf("g", n, F)
        u = self._buf("u", n, F)
        lw["ffn_gate"](h, g)
        lw["ffn_up"](h, u)
        dops.glu(g, u, g, self.arch.ffn_act)
        f = self._buf("f", step.T, self.cfg.n_embd)[step.T - n:]
        lw["ffn_down"](g, f)
        return f

    def residual_ffn(self, il, x, f, step):
        if self.fused:                      # the next layer's qkv launch (or the head) adds it
            return x, None
        self._residual(x, f, self.layers[il]["post_ffw_norm"], self.eps)
        if il + 1 < self.cfg.n_layer:
            return x, self.norm_in(x, il + 1, step)
        if not step.logits:
            return x, None
        h = self._h(x.shape[0], step)
        dops.rms_norm(x, self.output_norm, self.eps, h)
        return x, h

    def head(self, h, step):
        if self.fused:
            return self.plan.head()
        out = self._buf("logits", h.shape[0], self.cfg.n_vocab)
        self.output(h, out)
        if self.cfg.final_softcap:
            dops.softcap(out, np.float32(self.cfg.final_softcap))
        return device.to_host(out)


def build(engine):
    """(cache, sparse state or None, backend) of a device="cuda" engine: the KV cache,
    importance_ and anchors on the GPU and the weights uploaded (raises
    :class:`pyimp.cuda.DeviceUnavailable` naming what is missing)."""
    from . import require
    require()
    from .kvcache import DeviceKVCache
    from .sparse_state import DeviceSparseState
    cfg, opts = engine.cfg, engine.options
    # quantized K/V on the device: V stored by token (the cache refuses v_layout="channel")
    engine.cache = DeviceKVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, engine.n_ctx,
                                 block_len=opts.block_len, type_k=opts.type_k,
                                 type_v=opts.type_v, v_layout=opts.v_layout)
    engine.sparse = (DeviceSparseState(opts.sparse, cfg, engine.cache)
                     if opts.sparse.active else None)
    fwd = DeviceForward(engine)
    fwd.plan = DecodePlan(fwd, engine.n_ctx, engine.cache.max_blocks, opts.block_len)
    return engine.cache, engine.sparse, fwd
