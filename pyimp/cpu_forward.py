"""The CPU backend of :func:`pyimp.forward.forward`: NumPy arrays and Numba kernels.

A one-token step (``step.fused``) runs the small ops between the matvecs as fused kernels, in
place (ops.qk_norm_rope_fused; ops.add_norm_fused, which also makes the next norm), and the matvecs
that read the same input (q, k, v; gate, up) as grouped calls where their types match: the
same bits as the separate ops (tests/test_ops_kernels.py, tests/test_engine.py). Otherwise
every op runs on its own and hands its result to the tap, which records llama.cpp-named
tensors while :meth:`pyimp.engine.Engine.trace` runs.
"""
from __future__ import annotations

import math

import numpy as np

from loaders import quants

from . import ops
from .attention import attend as attention
from .attention.attend import decode_over_blocks, every_block

# the weight argument of a fused op whose norm the architecture does not have
NO_WEIGHT = np.zeros(0, np.float32)


def no_tap(name: str, il: int, x: np.ndarray) -> None:
    """The tap while no trace runs: records nothing (see :meth:`pyimp.engine.Engine.trace`)."""


class CPUForward:
    """The forward's steps on the host over an engine's weights, cache and sparse state."""

    def __init__(self, engine):
        self.engine = engine
        self.cfg, self.W, self.A = engine.cfg, engine.weights, engine.weights.arch
        self.num = engine.options.numerics
        self.eps = engine.cfg.rms_eps
        self.rot = ops.hadamard(engine.cfg.head_dim) if engine.options.kv_rotate else None
        self.tap = no_tap
        # per layer: (memo key, rope_cache arguments); layers with the same arguments share tables
        self.rope_args = [(("rope",) + tuple(a.values()), a) for a in
                          (engine.cfg.layer_rope(il) for il in range(engine.cfg.n_layer))]

    def begin(self, step) -> None:
        self.tap = self.engine._tap
        self.cache, self.sparse = self.engine.cache, self.engine.sparse

    def abort(self) -> None:
        """A forward that raised: nothing of a step outlives it here."""

    # ------------------------------------------------------------------ steps
    def embed(self, step) -> np.ndarray:
        x = self.W.embed(step.tokens, scaled=False)                    # [T, E]
        self.tap("embd", -1, x)
        if self.A.embd_scale:
            x = self.W.scale_embd(x)
            self.tap("inp_scaled", -1, x)
        return x

    def norm_in(self, x, il, step) -> np.ndarray:
        h = ops.rms_norm(x, self.W.layers[il].attn_norm, self.eps)
        self.tap("attn_norm", il, h)
        return h

    def qkv(self, il, h, step):
        lw, cfg, T, tap = self.W.layers[il], self.cfg, step.T, self.tap
        q, k, v = lw.project((lw.attn_q, lw.attn_k, lw.attn_v), h, self.num, grouped=step.fused)
        if lw.fused_qkv and tap is not no_tap:          # one fused product, as llama.cpp's
            tap("wqkv", il, np.concatenate([q, k, v], axis=1))
        for name, y, bias in (("Qcur", q, lw.attn_q_bias), ("Kcur", k, lw.attn_k_bias),
                              ("Vcur", v, lw.attn_v_bias)):
            if not lw.fused_qkv:
                tap(name, il, y)
            if bias is not None:
                y += bias
                tap(name, il, y)
        q = q.reshape(T, cfg.n_head, cfg.head_dim)
        k = k.reshape(T, cfg.n_head_kv, cfg.head_dim)
        v = v.reshape(T, cfg.n_head_kv, cfg.head_dim)
        tap("Qcur", il, q)
        tap("Kcur", il, k)
        tap("Vcur", il, v)
        return q, k, v

    def _rope_tables(self, il, step):
        """cos, sin of layer il at the step's positions; layers sharing base and scale share one."""
        key, args = self.rope_args[il]
        if key not in step.memo:
            step.memo[key] = ops.rope_cache(step.pos, self.cfg.rope_dim,
                                            freq_factors=self.W.rope_freqs, **args)
        return step.memo[key]

    def _qk_fused(self, il, q, k, cos, sin) -> None:
        """One token's q / k norms, RoPE and q prescale, in place (ops.qk_norm_rope_fused)."""
        lw, A = self.W.layers[il], self.A
        ops.qk_norm_rope_fused(q[0], k[0], lw.attn_q_norm if A.qk_norm else NO_WEIGHT,
                          lw.attn_k_norm if A.qk_norm else NO_WEIGHT, self.eps, cos[0], sin[0],
                          A.rope_neox, A.qk_norm, np.float32(1.0 / math.sqrt(self.cfg.head_dim)),
                          A.q_prescale)

    def qk_rope(self, il, q, k, step):
        lw, A, tap = self.W.layers[il], self.A, self.tap
        cos, sin = self._rope_tables(il, step)
        if step.fused:
            self._qk_fused(il, q, k, cos, sin)
            return q, k
        if A.qk_norm:                                  # per-head q / k norms (gemma3)
            q = ops.rms_norm(q, lw.attn_q_norm, self.eps)
            k = ops.rms_norm(k, lw.attn_k_norm, self.eps)
            tap("Qcur_normed", il, q)
            tap("Kcur_normed", il, k)
        ops.rope(q, cos, sin, A.rope_neox)
        ops.rope(k, cos, sin, A.rope_neox)
        tap("Qcur", il, q)
        tap("Kcur", il, k)
        if A.q_prescale:
            q *= np.float32(1.0 / math.sqrt(self.cfg.head_dim))
            tap("Qcur_scaled", il, q)
        return q, k

    def attention(self, il, q, k, v, step) -> np.ndarray:
        """Store k, v in the layer's next slots, then attend over everything it holds: slot
        space, where a compacted layer's window is a first visible slot (kvcache docs)."""
        cfg, cache, sp, T = self.cfg, self.cache, self.sparse, step.T
        if self.rot is not None:            # q.k and the attention output are unchanged
            q, k, v = q @ self.rot, k @ self.rot, v @ self.rot
        s0 = cache.slot_count(il)
        cache.write(il, k, v, step.pos0)
        bt = cache.table(il)
        positions = cache.positions(il, n=s0 + T) if cache.compacted(il) else None
        window = step.windows[il]
        att = np.empty((T, cfg.n_head, cfg.head_dim), dtype=np.float32)
        kc, vc = cache.k_layer(il), cache.v_layer(il)
        if step.decode:
            n = s0 + 1
            window = attention.slot_window(positions, n, window)
            n_read = min(n, window or n)                              # keys and values read
            # serial or parallel as measured per doubling of the bytes read
            sparse = bool(step.sparse) and step.sparse[il]
            # layers that read as much share a choice (Gemma 3's 15 sliding-window layers one,
            # not 15: each choice times its first calls both ways, slow ones included)
            choice = quants.thread_choice(("decode_attention", sparse, int(
                cache.layer_token_bytes() * n_read).bit_length()))
            if sp is not None:
                choice.run(sp.decode_attention, il, q[0], n, step.kq_scale, window, att[0],
                           sparse)
            else:      # the arguments are the engine's own: attention_decode less its checks
                key = ("blocks", n, window)    # one block list per slot count and window
                if key not in step.memo:
                    step.memo[key] = every_block(n, cache.block_len, window)
                sel, cnt = step.memo[key]
                choice.run(decode_over_blocks, q[0], kc, vc, bt, n, step.kq_scale, window, sel,
                           cnt, att[0], None, 1.0, None, 8, cache.bias(il))
        else:
            imp = None if sp is None else sp.importance_[il]
            imp2 = None if step.obs_start2 < 0 else sp.importance2_[il]
            attention.attention_prefill(q, kc, vc, bt, s0, step.kq_scale, window, att,
                                        importance=imp, obs_start=step.obs_start,
                                        positions=positions, bias=cache.bias(il),
                                        importance2=imp2, obs_start2=step.obs_start2)
        if self.rot is not None:
            att = att @ self.rot                                       # H is its own inverse
        self.tap("kqv", il, att.transpose(1, 0, 2))                   # [Hq, T, D] as ggml's kqv
        self.tap("kqv_out", il, att.reshape(T, cfg.n_head * cfg.head_dim))
        return att

    def attn_output(self, il, att, step) -> np.ndarray:
        lw = self.W.layers[il]
        o = lw.attn_output(att.reshape(step.T, -1), self.num)
        if lw.attn_output_bias is not None:
            self.tap("kqv_wo", il, o)
            o += lw.attn_output_bias
        return o

    def _add_norm_fused(self, x, y, post, nxt, h) -> None:
        """x += post-norm(y) (the architecture's post norm, else y itself), h = rms_norm(x) * nxt,
        for one token (ops.add_norm_fused)."""
        A = self.A
        ops.add_norm_fused(x[0], y[0], post if A.post_norms else NO_WEIGHT, A.post_norms, nxt,
                      self.eps, h[0])

    def residual_attn(self, il, x, o, last, step):
        lw, tap = self.W.layers[il], self.tap
        if step.fused:
            h = np.empty_like(x)
            self._add_norm_fused(x, o, lw.post_attention_norm, lw.ffn_norm, h)
            return x, h
        if self.A.post_norms:
            o = ops.rms_norm(o, lw.post_attention_norm, self.eps)
            tap("attn_post_norm", il, o[-1:] if last else o)
        else:
            tap("attn_out", il, o)
        x = x + o
        if last:
            x = x[-1:]                                     # only the last row is needed now
        tap("sa_out" if self.A.post_norms else "ffn_inp", il, x)
        h = ops.rms_norm(x, lw.ffn_norm, self.eps)
        tap("ffn_norm", il, h)
        return x, h

    def act_mul(self, g, u) -> np.ndarray:
        """act(g) * u, the gated FFN's product (fp32 GeGLU as one fused call, same bits)."""
        if self.A.ffn_act == "silu":
            return ops.silu(g) * u
        if self.num == "ggml":
            return ops.gelu_tanh_ggml(g) * u
        return ops.gelu_tanh_mul(g, u)

    def ffn(self, il, h, step) -> np.ndarray:
        lw, num, tap = self.W.layers[il], self.num, self.tap
        if step.fused:
            return lw.ffn_down(self.act_mul(*lw.project((lw.ffn_gate, lw.ffn_up), h, num)), num)
        g = lw.ffn_gate(h, num)
        u = lw.ffn_up(h, num)
        if not lw.fused_up:
            tap("ffn_gate", il, g)
            tap("ffn_up", il, u)
        elif tap is not no_tap:                          # one fused product: gate rows, up rows
            tap("ffn_up", il, np.concatenate([g, u], axis=1))
        gu = self.act_mul(g, u)
        tap("ffn_geglu" if self.A.ffn_act == "gelu_tanh" else "ffn_swiglu", il, gu)
        f = lw.ffn_down(gu, num)
        tap("ffn_out", il, f)
        return f

    def residual_ffn(self, il, x, f, step):
        lw, W, tap = self.W.layers[il], self.W, self.tap
        nxt = W.layers[il + 1].attn_norm if il + 1 < self.cfg.n_layer else W.output_norm
        if step.fused:
            h = np.empty_like(x)
            self._add_norm_fused(x, f, lw.post_ffw_norm, nxt, h)
            return x, h
        if self.A.post_norms:
            f = ops.rms_norm(f, lw.post_ffw_norm, self.eps)
            tap("ffn_post_norm", il, f)
        x = x + f
        tap("l_out", il, x)
        if il + 1 < self.cfg.n_layer:
            return x, self.norm_in(x, il + 1, step)
        h = ops.rms_norm(x, nxt, self.eps) if step.logits else None
        if step.logits:
            tap("result_norm", -1, h)
        return x, h

    def head(self, h, step) -> np.ndarray:
        out = self.W.output(h, self.num)
        if self.cfg.final_softcap:
            out = ops.softcap(out, self.cfg.final_softcap)
        self.tap("result_output", -1, out)
        return out

    # ------------------------------------------------------- compile ahead
    def compile_fused_ops(self) -> None:
        """Compile (or load) the fused ops of a one-token step, with the argument types the
        forward passes them, on zeros. A first run's warmup calls it in the engine's process,
        before the decode matvecs are shared out: the compile helper's forward then loads them
        instead of compiling them last, after its share."""
        cfg, W = self.cfg, self.W
        q = np.zeros((1, cfg.n_head, cfg.head_dim), np.float32)
        k = np.zeros((1, cfg.n_head_kv, cfg.head_dim), np.float32)
        cos, sin = ops.rope_cache(np.arange(1), cfg.rope_dim, freq_factors=W.rope_freqs,
                                  **cfg.layer_rope(0))
        self._qk_fused(0, q, k, cos, sin)
        lw = W.layers[0]
        x, y, h = (np.zeros((1, cfg.n_embd), np.float32) for _ in range(3))
        nxt = W.layers[1].attn_norm if cfg.n_layer > 1 else W.output_norm
        self._add_norm_fused(x, y, lw.post_attention_norm, lw.ffn_norm, h)
        self._add_norm_fused(x, y, lw.post_ffw_norm, nxt, h)
