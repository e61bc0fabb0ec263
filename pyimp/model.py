"""Model weights (GGUF names, kept quantized) and the per-architecture recipe.

Everything that differs between ``llama`` and ``gemma3`` lives in
:class:`ArchSpec`; the forward pass in :mod:`pyimp.engine` reads it and has
no ``arch ==`` branches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from loaders import quants
from loaders.config import ModelConfig
from loaders.ggml_types import GGMLQuantizationType
from loaders.gguf_file import GGUFFile, QTensor


@dataclass(frozen=True)
class ArchSpec:
    """The architecture-specific choices of the forward pass."""

    rope_neox: bool        # NEOX pairs (i, i+n/2) vs NORM pairs (2i, 2i+1)
    embd_scale: bool       # multiply embeddings by sqrt(n_embd)
    qk_norm: bool          # per-head RMSNorm of q and k (attn_q_norm, attn_k_norm)
    post_norms: bool       # RMSNorm after attention and after the FFN (post_attention_norm, post_ffw_norm)
    ffn_act: str           # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    q_prescale: bool       # scale q by 1/sqrt(head_dim) before attention (softmax scale 1)


ARCHS = {
    "llama": ArchSpec(rope_neox=False, embd_scale=False, qk_norm=False, post_norms=False,
                      ffn_act="silu", q_prescale=False),
    "gemma3": ArchSpec(rope_neox=True, embd_scale=True, qk_norm=True, post_norms=True,
                       ffn_act="gelu_tanh", q_prescale=True),
    # q, k, v biases: read wherever the file has them (LayerWeights)
    "qwen2": ArchSpec(rope_neox=True, embd_scale=False, qk_norm=False, post_norms=False,
                      ffn_act="silu", q_prescale=False),
    "qwen3": ArchSpec(rope_neox=True, embd_scale=False, qk_norm=True, post_norms=False,
                      ffn_act="silu", q_prescale=False),
    # fused attn_qkv and gate+up (ModelWeights splits them by rows), partial rotary where the
    # file declares fewer rotary dims, long / short RoPE factors by context (ModelWeights)
    "phi3": ArchSpec(rope_neox=True, embd_scale=False, qk_norm=False, post_norms=False,
                     ffn_act="silu", q_prescale=True),
}


def row_slice(t: QTensor, r0: int, r1: int, name: str) -> QTensor:
    """Rows r0..r1-1 of weight ``t`` as a tensor of its own (zero-copy): one part of a fused
    matrix (phi3's attn_qkv, its gate+up ffn_up). A matvec computes each output row from its
    weight row alone, so the parts give the bits of the fused product."""
    return QTensor(name, t.qtype, (t.shape[0], r1 - r0), t.raw[r0:r1])


# llama.cpp pads the context to a multiple of this before it compares it with the original
# context length (phi3's long or short RoPE factors)
CTX_PAD = 256


class Linear:
    """A quantized weight matrix y = x @ W.T with W stored as ggml rows (n_out rows of n_in)."""

    def __init__(self, t: QTensor):
        self.name = t.name
        self.raw = t.raw
        self.qtype = t.qtype
        self.n_in = t.shape[0]
        self.n_out = t.n_rows
        self._rows = None          # checked uint8 row view and kernels, made at the first decode
        self._choices: dict = {}   # numerics -> its thread choice (see thread_choice)

    def __call__(self, x: np.ndarray, numerics: str) -> np.ndarray:
        """x float32[T, n_in] -> float32[T, n_out]."""
        if x.shape[0] == 1:
            return self._matvec(x, numerics)
        return quants.matmul(self.raw, self.qtype, self.n_in, x, numerics)

    def _matvec(self, x: np.ndarray, numerics: str = "fp32") -> np.ndarray:
        """A decode step's matvec with the weight checks of quants.matvec done once (they
        cost more than a small layer matrix's kernel) and its thread choice measured (one per
        numerics: their kernels differ)."""
        raw, k = self._kernel_rows()
        if x.shape != (1, self.n_in):
            raise ValueError(f"{self.name}: input must be float32[1, {self.n_in}], got shape {x.shape}")
        out = np.empty((1, self.n_out), np.float32)
        xr = np.ascontiguousarray(x[0], dtype=np.float32)
        choice = self._choices.get(numerics) or self.thread_choice(numerics)
        if numerics == "fp32":
            choice.run(k.matvec, raw, xr, out[0])
        else:
            choice.run(quants.matvec_ggml_kernel, k, raw, xr, out[0])
        return out

    def thread_choice(self, numerics: str) -> quants.ThreadChoice:
        """The decode matvec's serial-or-parallel choice: the one quants.matvec makes for a
        weight of this type, shape and numerics (looked up once per numerics, then kept)."""
        quants.check_numerics(numerics)
        choice = self._choices[numerics] = quants.thread_choice(
            quants.matvec_key(self.qtype, self._kernel_rows()[0].shape, numerics))
        return choice

    def _kernel_rows(self):
        if self._rows is None:
            self._rows = (quants.as_raw(self.raw, self.qtype, self.n_in), quants.kernels(self.qtype))
        return self._rows

    def compile_decode(self, numerics: str = "fp32") -> None:
        """Compile (or load from Numba's cache) the decode matvec kernel of this weight type
        with one call on zeros, outside the thread choice (which times its first calls)."""
        raw, k = self._kernel_rows()
        x, out = np.zeros(self.n_in, np.float32), np.empty(self.n_out, np.float32)
        if numerics == "fp32":
            k.matvec(raw, x, out)
        else:
            quants.check_numerics(numerics)
            quants.matvec_ggml_kernel(k, raw, x, out)

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes


class LinearGroup:
    """Weight matrices of one type and input length that read the same activations in a decode
    step (a layer's q, k and v; its gate and up), run as one fp32 matvec call
    (``TypeKernels.matvec_group``): one thread-pool dispatch and one choice of threads, x
    permuted once, work items spread over all their rows. Each row's sum is computed as its own
    matrix's matvec computes it, so the results are the same bits."""

    def __init__(self, linears: tuple[Linear, ...]):
        self.linears = linears
        self.n_in = linears[0].n_in
        self.n_out = sum(lin.n_out for lin in linears)
        self._bounds = np.cumsum([0] + [lin.n_out for lin in linears]).tolist()
        self._kernel = None
        # one serial-or-parallel choice per group of these types and shapes
        self._threads = quants.thread_choice(("matvec_group",) + tuple(
            (lin.qtype, lin.n_out, lin.n_in) for lin in linears))

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        """x float32[1, n_in] -> float32[1, n_out] of each matrix (views of one buffer)."""
        if self._kernel is None:
            rows = [lin._kernel_rows() for lin in self.linears]
            self._kernel = (tuple(r for r, _ in rows), rows[0][1].matvec_group)
        raws, mv = self._kernel
        if x.shape != (1, self.n_in):
            raise ValueError(f"{self.linears[0].name} and the rest of its group: input must be "
                             f"float32[1, {self.n_in}], got shape {x.shape}")
        out = np.empty((1, self.n_out), np.float32)
        self._threads.run(mv, raws, np.ascontiguousarray(x[0], dtype=np.float32), out[0])
        b = self._bounds
        return [out[:, b[i]:b[i + 1]] for i in range(len(self.linears))]


MAX_GROUP = 3      # matrices per grouped matvec call (the kernels' raw, raw1, raw2)


def group_linears(linears: tuple) -> list:
    """``linears`` (run on the same x, in order) as a list of single Linears and LinearGroups:
    runs of consecutive Linears of one type and input length whose kernels take groups, up to
    MAX_GROUP each. Anything else (a type without groups, a wrapped callable) stays alone."""
    out: list = []
    for lin in linears:
        prev = out[-1] if out else None
        run = prev.linears if isinstance(prev, LinearGroup) else (prev,)
        if (isinstance(lin, Linear) and isinstance(run[0], Linear) and len(run) < MAX_GROUP
                and run[0].qtype == lin.qtype and run[0].n_in == lin.n_in
                and quants.kernels(lin.qtype).matvec_group is not None):
            out[-1] = LinearGroup(run + (lin,))
        else:
            out.append(lin)
    return out


@dataclass
class LayerWeights:
    attn_norm: np.ndarray
    attn_q: Linear
    attn_k: Linear
    attn_v: Linear
    attn_output: Linear
    ffn_norm: np.ndarray
    ffn_gate: Linear
    ffn_up: Linear
    ffn_down: Linear
    attn_q_bias: np.ndarray | None = None
    attn_k_bias: np.ndarray | None = None
    attn_v_bias: np.ndarray | None = None
    attn_output_bias: np.ndarray | None = None
    attn_q_norm: np.ndarray | None = None
    attn_k_norm: np.ndarray | None = None
    post_attention_norm: np.ndarray | None = None
    post_ffw_norm: np.ndarray | None = None
    fused_qkv: bool = False        # attn_q, attn_k, attn_v are row parts of one attn_qkv
    fused_up: bool = False         # ffn_gate, ffn_up are row parts of one ffn_up
    _groups: dict = field(default_factory=dict, repr=False, compare=False)

    def project(self, linears: tuple, x: np.ndarray, numerics: str, grouped: bool = True) -> list:
        """``[lin(x, numerics) for lin in linears]``. A one-token fp32 step with ``grouped``
        runs them as :func:`group_linears` groups them (the same bits, fewer calls)."""
        if not grouped or x.shape[0] != 1 or numerics != "fp32":
            return [lin(x, numerics) for lin in linears]
        groups = self._groups.get(linears)
        if groups is None:
            groups = self._groups[linears] = group_linears(linears)
        out = []
        for g in groups:
            if isinstance(g, LinearGroup):
                out += g(x)
            else:
                out.append(g(x, numerics))
        return out

    def linears(self) -> tuple[Linear, ...]:
        """The layer's weight matrices in the order a forward runs them."""
        return (self.attn_q, self.attn_k, self.attn_v, self.attn_output, self.ffn_gate,
                self.ffn_up, self.ffn_down)


def _vector(f: GGUFFile, name: str, n: int) -> np.ndarray:
    """A 1-D float tensor as float32[n] (F32 is zero-copy; F16/BF16 are converted once)."""
    t = f.tensor(name, (n,))
    return quants.dequantize(t.raw.reshape(1, -1), t.qtype, n)[0] if t.qtype != GGMLQuantizationType.F32 \
        else t.as_float32()


class ModelWeights:
    """All tensors of a model, named as in GGUF, shape-checked against the config."""

    def __init__(self, f: GGUFFile, cfg: ModelConfig, n_ctx: int = 0):
        """``n_ctx``: the context the engine runs (0: the training context); it picks phi3's
        long or short RoPE factors for the whole context, as llama.cpp does."""
        self.cfg = cfg
        self.arch = ARCHS[cfg.arch]
        E, D, Hq, Hkv, F, V = cfg.n_embd, cfg.head_dim, cfg.n_head, cfg.n_head_kv, cfg.n_ff, cfg.n_vocab
        self.token_embd = f.tensor("token_embd.weight", (E, V))
        self.output_norm = _vector(f, "output_norm.weight", E)
        self.output = Linear(f.tensor("output.weight", (E, V)) if not cfg.tied_output else self.token_embd)
        self.rope_freqs = self._rope_factors(f, n_ctx or cfg.n_ctx_train)
        self.layers: list[LayerWeights] = []
        for il in range(cfg.n_layer):
            p = f"blk.{il}."

            def lin(name: str, n_in: int, n_out: int) -> Linear:
                return Linear(f.tensor(p + name + ".weight", (n_in, n_out)))

            if f.has_tensor(p + "attn_qkv.weight"):            # fused q, k, v rows (phi3)
                qkv = f.tensor(p + "attn_qkv.weight", (E, (Hq + 2 * Hkv) * D))
                q, k = Hq * D, Hkv * D
                attn_q, attn_k, attn_v = (Linear(row_slice(qkv, a, b, p + name)) for name, a, b in (
                    ("attn_q", 0, q), ("attn_k", q, q + k), ("attn_v", q + k, q + 2 * k)))
            else:
                attn_q, attn_k, attn_v = lin("attn_q", E, Hq * D), lin("attn_k", E, Hkv * D), \
                    lin("attn_v", E, Hkv * D)
            if not f.has_tensor(p + "ffn_gate.weight") and f.has_tensor(p + "ffn_up.weight"):
                up = f.tensor(p + "ffn_up.weight", (E, 2 * F))      # gate rows, then up rows (phi3)
                ffn_gate, ffn_up = Linear(row_slice(up, 0, F, p + "ffn_gate")), \
                    Linear(row_slice(up, F, 2 * F, p + "ffn_up"))
            else:
                ffn_gate, ffn_up = lin("ffn_gate", E, F), lin("ffn_up", E, F)

            def opt_vec(name: str, n: int) -> np.ndarray | None:
                return _vector(f, p + name, n) if f.has_tensor(p + name) else None

            lw = LayerWeights(
                attn_norm=_vector(f, p + "attn_norm.weight", E),
                attn_q=attn_q,
                attn_k=attn_k,
                attn_v=attn_v,
                attn_output=lin("attn_output", Hq * D, E),
                ffn_norm=_vector(f, p + "ffn_norm.weight", E),
                ffn_gate=ffn_gate,
                ffn_up=ffn_up,
                ffn_down=lin("ffn_down", F, E),
                attn_q_bias=opt_vec("attn_q.bias", Hq * D),
                attn_k_bias=opt_vec("attn_k.bias", Hkv * D),
                attn_v_bias=opt_vec("attn_v.bias", Hkv * D),
                attn_output_bias=opt_vec("attn_output.bias", E),
                fused_qkv=f.has_tensor(p + "attn_qkv.weight"),
                fused_up=not f.has_tensor(p + "ffn_gate.weight"),
            )
            if self.arch.qk_norm:
                lw.attn_q_norm = _vector(f, p + "attn_q_norm.weight", D)
                lw.attn_k_norm = _vector(f, p + "attn_k_norm.weight", D)
            if self.arch.post_norms:
                lw.post_attention_norm = _vector(f, p + "post_attention_norm.weight", E)
                lw.post_ffw_norm = _vector(f, p + "post_ffw_norm.weight", E)
            self.layers.append(lw)

    def _rope_factors(self, f: GGUFFile, n_ctx: int) -> np.ndarray | None:
        """The frequency factors every layer's RoPE divides its angles by: rope_freqs (Llama
        3.x), else phi3's rope_factors_long when the context (padded to CTX_PAD) exceeds the
        original one, rope_factors_short otherwise (llama.cpp's choice), else None."""
        half = self.cfg.rope_dim // 2
        if self.cfg.has_rope_freqs:
            return _vector(f, "rope_freqs.weight", half)
        padded = -(-n_ctx // CTX_PAD) * CTX_PAD
        name = "rope_factors_long.weight" if padded > self.cfg.rope_ctx_orig \
            else "rope_factors_short.weight"
        return _vector(f, name, half) if f.has_tensor(name) else None

    def embed(self, tokens: np.ndarray, scaled: bool = True) -> np.ndarray:
        """float32[T, n_embd] rows of token_embd (scaled by sqrt(n_embd) for gemma3, unless
        ``scaled`` is False: then :meth:`scale_embd` does it)."""
        t = self.token_embd
        x = quants.dequantize_rows(t.raw, t.qtype, t.shape[0], np.asarray(tokens, dtype=np.int64))
        return self.scale_embd(x) if scaled else x

    def scale_embd(self, x: np.ndarray) -> np.ndarray:
        """Embedding rows times sqrt(n_embd) where the architecture scales them (gemma3), else x."""
        if self.arch.embd_scale:
            x = x * np.float32(math.sqrt(self.cfg.n_embd))
        return x

    def summary(self) -> dict:
        """Parameter count and bytes per weight type."""
        by_type: dict[str, int] = {}
        n_params = 0
        tensors = [self.token_embd]
        for lw in self.layers:
            tensors += lw.linears()
        if not self.cfg.tied_output:
            tensors.append(self.output)
        for t in tensors:
            by_type[t.qtype.name] = by_type.get(t.qtype.name, 0) + t.raw.nbytes
            n_in = t.shape[0] if isinstance(t, QTensor) else t.n_in
            n_rows = t.n_rows if isinstance(t, QTensor) else t.n_out
            n_params += n_in * n_rows
        return {"n_params": n_params, "bytes_by_type": by_type}

