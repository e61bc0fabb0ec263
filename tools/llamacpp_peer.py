"""llama.cpp (through llama-cpp-python) as the comparison peer: logits, greedy tokens, timing."""
from __future__ import annotations

import contextlib
import os

import numpy as np

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
_KV = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16}


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


@contextlib.contextmanager
def _quiet():
    """Silence llama.cpp's C-level logging on stderr."""
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as nul:
            os.dup2(nul.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def open_model(path: str, n_ctx: int = 512, n_batch: int = 512, kv_type: str = "f32",
               flash_attn: bool = False, n_threads: int = 2, logits_all: bool = True):
    """A llama_cpp.Llama with the given cache type and batch size (n_ubatch = n_batch)."""
    import llama_cpp
    with _quiet():
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                               logits_all=logits_all, flash_attn=flash_attn, type_k=_KV[kv_type],
                               type_v=_KV[kv_type], n_threads=n_threads, n_threads_batch=n_threads,
                               verbose=False, seed=0)


def logits(path: str, tokens, n_batch: int = 512, kv_type: str = "f32", n_ctx: int | None = None) -> np.ndarray:
    """float32[T, n_vocab] logits of every position of ``tokens`` (evaluated in n_batch chunks)."""
    tokens = [int(t) for t in tokens]
    m = open_model(path, n_ctx=n_ctx or max(64, len(tokens) + 8), n_batch=n_batch, kv_type=kv_type)
    with _quiet():
        m.eval(tokens)
    out = np.array(m.scores[:len(tokens)], dtype=np.float32)
    m.close()
    return out


def greedy(path: str, tokens, n: int, n_batch: int = 512, kv_type: str = "f16") -> list[int]:
    """``n`` greedy continuation tokens of ``tokens``."""
    m = open_model(path, n_ctx=len(tokens) + n + 8, n_batch=n_batch, kv_type=kv_type, logits_all=True)
    out = []
    with _quiet():
        m.eval([int(t) for t in tokens])
        for _ in range(n):
            t = int(np.argmax(m.scores[m.n_tokens - 1]))
            out.append(t)
            m.eval([t])
    m.close()
    return out
