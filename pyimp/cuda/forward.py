"""The forward pass on the device: :class:`DeviceForward`, the ``device="cuda"`` twin of
:meth:`pyimp.engine.Engine._forward`.

Weights are uploaded once, still quantized (the GGUF rows as uint8), with the norms as
float32. Activations, the KV cache (:class:`pyimp.cuda.kvcache.DeviceKVCache`),
``importance_`` and the anchors stay on the device; a step copies the token ids and the RoPE
tables (and a changed block table) to the device and the logits row back, nothing else.
The layer reads top to bottom like the CPU forward; the kernels are those of
:mod:`pyimp.cuda.linear`, :mod:`pyimp.cuda.ops` and :mod:`pyimp.cuda.attention`.
"""
from __future__ import annotations

import math

import numpy as np

from .. import ops as host_ops
from . import attention, device, linear
from . import ops as dops


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
    """The model's weights on the device and the forward pass over them."""

    def __init__(self, engine):
        cfg, W = engine.cfg, engine.weights
        self.cfg, self.arch = cfg, W.arch
        if engine.options.numerics != "fp32":
            raise ValueError("device cuda computes with fp32 numerics only (--numerics fp32)")
        if engine.options.kv_rotate:
            raise ValueError("device cuda does not rotate the KV cache (--kv-rotate runs on the CPU)")
        for il, lw in enumerate(W.layers):
            for name in ("attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_output_bias"):
                if getattr(lw, name) is not None:
                    raise ValueError(f"device cuda: layer {il} has {name.replace('_bias', '.bias')}, "
                                     f"which the device forward does not support yet")

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
                **{name: DeviceLinear.of(getattr(lw, name)) for name in
                   ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")},
            })
        self.scratch = attention.Scratch()
        self._bufs = attention.Scratch()

    def _buf(self, name: str, *shape):
        return self._bufs.get(name, shape, np.float32)

    @staticmethod
    def _residual(x, o, post_norm, eps) -> None:
        """x += o, with o RMS-normed in place first where the architecture has post-norms."""
        if post_norm is not None:
            dops.rms_norm(o, post_norm, eps, o)
        dops.add(x, o)

    def forward(self, engine, tokens: np.ndarray, decode: bool, prompt_end: int | None,
                all_logits: bool, logits: bool) -> np.ndarray | None:
        """One forward of ``tokens`` after the cached ones (the engine reserved their blocks and
        will commit them); returns host logits as :meth:`Engine._forward` does."""
        cfg, A = self.cfg, self.arch
        eps = np.float32(cfg.rms_eps)
        T = len(tokens)
        E, Hq, Hkv, D, F = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff
        cache, sp = engine.cache, engine.sparse
        pos0 = int(cache.cache_seqlens[0])
        pos = np.arange(pos0, pos0 + T)
        kq_scale = 1.0 if A.q_prescale else 1.0 / math.sqrt(D)
        tables: dict = {}

        x = self._buf("x", T, E)
        linear.get_rows(self.embd.raw, self.embd.qtype, E, device.to_device(np.asarray(tokens, np.int64)), x)
        if A.embd_scale:
            dops.scale(x, np.float32(math.sqrt(E)))
        h = self._buf("h", T, E)
        q = self._buf("q", T, Hq * D)
        k = self._buf("k", T, Hkv * D)
        v = self._buf("v", T, Hkv * D)
        qn = self._buf("qn", T * Hq, D)
        kn = self._buf("kn", T * Hkv, D)
        att = self._buf("att", T, Hq * D)
        o = self._buf("o", T, E)
        for il, lw in enumerate(self.layers):
            dops.rms_norm(x, lw["attn_norm"], eps, h)
            lw["attn_q"](h, q)
            lw["attn_k"](h, k)
            lw["attn_v"](h, v)
            q3, k3, v3 = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
            if A.qk_norm:
                dops.rms_norm(q.reshape(T * Hq, D), lw["attn_q_norm"], eps, qn)
                dops.rms_norm(k.reshape(T * Hkv, D), lw["attn_k_norm"], eps, kn)
                q3, k3 = qn.reshape(T, Hq, D), kn.reshape(T, Hkv, D)
            key = (cfg.layer_rope_base(il), cfg.layer_rope_scale(il))
            if key not in tables:
                cos, sin = host_ops.rope_cache(pos, cfg.rope_dim, key[0], key[1],
                                               engine.weights.rope_freqs)
                tables[key] = (device.to_device(cos), device.to_device(sin))
            cos, sin = tables[key]
            dops.rope(q3, cos, sin, A.rope_neox)
            dops.rope(k3, cos, sin, A.rope_neox)
            if A.q_prescale:
                dops.scale(q3, np.float32(1.0 / math.sqrt(D)))
            cache.write(il, k3, v3, pos0)
            window = cfg.sliding_window if cfg.is_swa(il) else 0
            kc, vc, bt = cache.k_layer(il), cache.v_layer(il), cache.bt_dev
            att3 = att.reshape(T, Hq, D)
            if decode:
                if sp is not None:
                    sp.decode_attention(il, q3, pos0 + 1, kq_scale, window, att3)
                else:
                    attention.decode(q3, kc, vc, bt, pos0 + 1, kq_scale, window, att3,
                                     scratch=self.scratch)
            else:
                imp = None if sp is None else sp.importance_dev[il]
                obs = 0 if sp is None else sp.obs_start(pos0 + T if prompt_end is None else prompt_end)
                attention.prefill(q3, kc, vc, bt, pos0, kq_scale, window, att3, importance=imp,
                                  obs_start=obs, scratch=self.scratch)
            lw["attn_output"](att, o)
            self._residual(x, o, lw["post_attention_norm"], eps)
            if il == cfg.n_layer - 1 and not all_logits and T > 1:
                x, h, o = x[T - 1:T], h[T - 1:T], o[T - 1:T]          # the last row only
            n = x.shape[0]
            dops.rms_norm(x, lw["ffn_norm"], eps, h)
            g = self._buf("g", n, F)
            u = self._buf("u", n, F)
            lw["ffn_gate"](h, g)
            lw["ffn_up"](h, u)
            dops.glu(g, u, g, A.ffn_act)
            lw["ffn_down"](g, o)
            self._residual(x, o, lw["post_ffw_norm"], eps)
        if not logits:
            return None
        dops.rms_norm(x, self.output_norm, eps, h)              # h has x's rows
        out = self._buf("logits", x.shape[0], cfg.n_vocab)
        self.output(h, out)
        if cfg.final_softcap:
            dops.softcap(out, np.float32(cfg.final_softcap))
        return device.to_host(out)
