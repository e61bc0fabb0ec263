"""The model's forward pass, written once, in the order the model computes, over a backend.

:func:`forward` is the model: embeddings; per layer the attention norm, the q / k / v
projections, q / k norms and RoPE, the cache write and attention, the output projection, the
residual with the feed-forward norm, the gated feed-forward and its residual with the next
norm; then the output head. A backend implements the steps: :class:`pyimp.cpu_forward.CPUForward`
(Numba kernels; a one-token step fuses the small ops between the matvecs, and a traced forward
records llama.cpp-named tensors at every step) and :class:`pyimp.cuda.forward.DeviceForward`
(numba-cuda kernels, activations on the device).

What a forward decides it decides once, in :class:`Step`, made by the engine at the top and
passed down: no step below re-derives decode or prefill, positions, a layer's window, the
query scale or the importance observation window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Step:
    """One forward's decisions: ``tokens`` after ``pos0`` cached positions."""

    tokens: np.ndarray
    pos0: int
    decode: bool            # one decode step; else a prefill chunk (a lone token may be one)
    windows: tuple          # per layer: its sliding window, 0 for a global layer
    kq_scale: float         # the scores' scale (1 where q is scaled before RoPE's output)
    obs_start: int          # a prefill's first row that adds importance (0: every row)
    obs_start2: int         # ... that adds to the second window's buffer (-1: none)
    prompt_end: int | None  # absolute end of the prompt this chunk belongs to
    all_logits: bool        # logits of every row (else of the last)
    logits: bool            # run the output head
    fused: bool             # one token and nothing traced: a backend may fuse the small ops
    sparse: tuple = ()      # decode: per layer, whether it takes the block-sparse path
    memo: dict = field(default_factory=dict)     # per-step tables a backend shares across layers

    @property
    def T(self) -> int:
        return len(self.tokens)

    @property
    def pos(self) -> np.ndarray:
        return np.arange(self.pos0, self.pos0 + self.T)


def make_step(cfg, arch, tokens, pos0: int, decode: bool, obs_start: int,
              prompt_end: int | None, all_logits: bool, logits: bool, fused: bool,
              sparse_state=None, cache=None, obs_start2: int = -1) -> Step:
    """The :class:`Step` of a forward of ``tokens`` after ``pos0`` positions (cfg: the model's
    :class:`loaders.config.ModelConfig`, arch its :class:`pyimp.model.ArchSpec`). A decode
    step with a ``sparse_state`` decides here, once, which layers take the block-sparse path,
    by the slots each layer of ``cache`` holds with the new token."""
    sparse = () if sparse_state is None or not decode else tuple(
        sparse_state.is_sparse_step(il, cache.slot_count(il) + 1) for il in range(cfg.n_layer))
    kq_scale = 1.0 if arch.q_prescale else 1.0 / math.sqrt(cfg.head_dim)
    return Step(tokens=tokens, pos0=pos0, decode=decode, windows=cfg.windows, kq_scale=kq_scale,
                obs_start=obs_start, obs_start2=obs_start2, prompt_end=prompt_end,
                all_logits=all_logits, logits=logits, fused=fused and len(tokens) == 1,
                sparse=tuple(sparse))


def forward(n_layer: int, be, step: Step):
    """Logits of ``step`` (float32 [rows, n_vocab] on the host; the last row only unless
    ``step.all_logits``) or None when ``step.logits`` is False; ``be`` the backend. The caller
    reserved the cache's slots and commits them after."""
    be.begin(step)
    try:
        x = be.embed(step)                                    # [T, E]
        h = be.norm_in(x, 0, step)                            # layer 0's attention norm
        for il in range(n_layer):
            q, k, v = be.qkv(il, h, step)                     # projections (+ biases)
            q, k = be.qk_rope(il, q, k, step)                 # q / k norms, RoPE, q prescale
            att = be.attention(il, q, k, v, step)             # cache write, dense or sparse
            o = be.attn_output(il, att, step)
            last = il == n_layer - 1 and not step.all_logits  # the last layer keeps one row
            x, h = be.residual_attn(il, x, o, last, step)     # post-norm, residual, ffn norm
            f = be.ffn(il, h, step)                           # gated feed-forward
            x, h = be.residual_ffn(il, x, f, step)            # post-norm, residual, next norm
        return be.head(h, step) if step.logits else None
    except BaseException:
        be.abort()                                            # a backend's step state ends
        raise
