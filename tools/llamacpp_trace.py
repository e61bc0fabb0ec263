"""Capture llama.cpp's intermediate tensors (``Qcur-0``, ``kq_soft_max-0``, ``l_out-3``, ...).

Uses the ``cb_eval`` scheduler callback of llama.cpp's context parameters;
tensors are read back as float32 NumPy arrays in NumPy order (reverse of
ggml's ne). For debugging numerics against pyimp's forward pass.

    from tools.llamacpp_trace import trace
    t = trace("model.gguf", [1, 2, 3], names=("Qcur-0", "kqv_out-0"))
"""
from __future__ import annotations

import ctypes

import numpy as np

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
GGML_MAX_OP_PARAMS = 64


class _Tensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h) up to the fields read here."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def _read(t: _Tensor) -> np.ndarray | None:
    ne = [t.ne[i] for i in range(4)]
    nb = [t.nb[i] for i in range(4)]
    if t.type == 0:
        item = np.float32
    elif t.type == 1:
        item = np.float16
    else:
        return None
    size = sum((n - 1) * s for n, s in zip(ne, nb)) + np.dtype(item).itemsize
    buf = (ctypes.c_char * size).from_address(t.data)
    base = np.frombuffer(buf, dtype=np.uint8)
    arr = np.lib.stride_tricks.as_strided(base.view(item), shape=ne[::-1], strides=nb[::-1])
    return np.array(arr, dtype=np.float32)


def trace(path: str, tokens, names=None, n_batch: int = 512, kv_type: int = 0, n_threads: int = 2) -> dict:
    """Run ``tokens`` through llama.cpp; return {tensor name: float32 array} (last chunk wins)."""
    import llama_cpp as L

    want = set(names) if names else None
    out: dict = {}

    @L.ggml_backend_sched_eval_callback
    def cb(tp, ask, _user):
        t = ctypes.cast(tp, ctypes.POINTER(_Tensor)).contents
        name = t.name.decode(errors="replace")
        if ask:
            return want is None or name in want
        arr = _read(t)
        if arr is not None:
            out.setdefault(name, []).append(arr)
        return True

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = max(64, len(tokens) + 8)
    cp.n_batch = cp.n_ubatch = n_batch
    cp.type_k = cp.type_v = kv_type
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.cb_eval = cb
    ctx = L.llama_init_from_model(model, cp)
    toks = list(map(int, tokens))
    for s in range(0, len(toks), n_batch):
        chunk = toks[s:s + n_batch]
        arr = (L.llama_token * len(chunk))(*chunk)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(chunk))):
            raise RuntimeError("llama_decode failed")
    L.llama_free(ctx)
    L.llama_model_free(model)
    return out
