"""llama.cpp (through llama-cpp-python) as the comparison peer: logits, greedy tokens, timing."""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys

import numpy as np

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
# llama.cpp's KV cache types (-ctk / -ctv names) -> ggml type ids (ggml.h's enum ggml_type)
_KV = {"f32": GGML_TYPE_F32, "f16": GGML_TYPE_F16, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7,
       "q8_0": 8}
KV_TYPES = tuple(_KV)
QUANT_KV_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
# llama.cpp rotates a quantized K (and V) by a Hadamard transform along the head dim unless
# this variable is set to 1 when a context is created (read by its KV cache's constructor)
ROT_DISABLE_ENV = "LLAMA_ATTN_ROT_DISABLE"


PROBE_TIMEOUT_S = 300


def _probe_child() -> None:
    """Exercise the peer the way the tests do, in this (child) process; exit 0 when it all ran.

    Tiny synthetic llama models of each weight type the tests use, evaluated with prompt
    batches and single-token steps, f32, f16 and q4_0 caches, flash attention off and on; then
    the libggml bindings of tools.ggml_oracle (quantize and vec_dot) when they load.
    """
    import tempfile

    from tools.write_synthetic_gguf import SynthSpec, write

    with tempfile.TemporaryDirectory() as d:
        for wtype in ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"):
            path = write(os.path.join(d, f"{wtype}.gguf"),
                         SynthSpec(arch="llama", n_layer=1, n_embd=256, n_head=4, n_head_kv=2,
                                   n_ff=512, vocab_size=300, weight_type=wtype))
            for kv_type, fa in (("f32", False), ("f16", True), ("q4_0", None)):
                m = open_model(path, n_ctx=64, n_batch=16, kv_type=kv_type, flash_attn=fa)
                with _quiet():
                    m.eval(list(range(1, 40)))
                    m.eval([5])
                if not np.isfinite(np.asarray(m.scores[:40])).all():
                    raise SystemExit(f"non-finite logits from llama.cpp ({wtype}, {kv_type} cache)")
                m.close()
    from tools import ggml_oracle
    if ggml_oracle.available():
        from loaders.ggml_types import QT
        x = np.linspace(-1, 1, 256, dtype=np.float32)
        for qt in (QT.Q8_0, QT.Q4_0, QT.Q4_K):
            ggml_oracle.vec_dot(int(qt), ggml_oracle.quantize(int(qt), x[None])[0], x)


@functools.lru_cache(maxsize=None)
def probe() -> tuple[bool, str]:
    """(True, build info) when llama.cpp runs here, else (False, why); checked once, in a subprocess.

    ``PYIMP_PEER=off`` turns the peer off (its comparisons skip; under CI=true the run fails).
    A peer built for instructions this CPU cannot execute (e.g. ``-march=native`` on a VM
    that advertises AMX) kills its process with SIGILL; the subprocess keeps that from
    taking the caller (a pytest run) down with it.
    """
    if os.environ.get("PYIMP_PEER", "").lower() == "off":
        return False, "turned off by PYIMP_PEER=off"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False, "llama-cpp-python is not installed (python -m tools.build_peer)"
    return run_probe([sys.executable, "-m", "tools.llamacpp_peer", "--probe"])


def run_probe(cmd: list[str], timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """Run ``cmd`` from the repository root as the probe child; (ok, its output or why it failed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYIMP_PEER_PROBE="child", PYTHONPATH=path)
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"llama.cpp did not finish a tiny evaluation in {timeout:g} s"
    if r.returncode == 0:
        return True, r.stdout.strip()
    if r.returncode < 0:
        try:
            sig = signal.Signals(-r.returncode).name
        except ValueError:
            sig = f"signal {-r.returncode}"
        why = f"llama.cpp crashed with {sig}"
        if sig == "SIGILL":
            why += (" (built for instructions this CPU cannot run; rebuild it portably: "
                    "python -m tools.build_peer --force)")
        return False, why
    tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
    return False, f"llama.cpp probe failed (exit {r.returncode}): {tail[0]}"


def available() -> bool:
    """True when llama-cpp-python is installed and runs on this CPU (see :func:`probe`)."""
    return probe()[0]


def system_info() -> str:
    """llama.cpp's build features (``AVX2 = 1 | AVX512 = 1 | ...``)."""
    import llama_cpp
    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


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


def _check_kv(name: str, kv_type: str) -> None:
    if kv_type not in _KV:
        raise ValueError(f"peer cache type for {name} {kv_type!r} is not one of {', '.join(KV_TYPES)}")


@contextlib.contextmanager
def _rotation(rotate: bool | None):
    """The environment llama.cpp reads for its K/V rotation while a context is created:
    None leaves it as it is, False sets LLAMA_ATTN_ROT_DISABLE=1, True removes it."""
    if rotate is None:
        yield
        return
    old = os.environ.get(ROT_DISABLE_ENV)
    if rotate:
        os.environ.pop(ROT_DISABLE_ENV, None)
    else:
        os.environ[ROT_DISABLE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ROT_DISABLE_ENV, None)
        else:
            os.environ[ROT_DISABLE_ENV] = old


def open_model(path: str, n_ctx: int = 512, n_batch: int = 512, kv_type: str = "f32",
               flash_attn: bool | None = None, n_threads: int = 2, logits_all: bool = True,
               type_k: str | None = None, type_v: str | None = None, rotate: bool | None = None):
    """A llama_cpp.Llama with the given cache types and batch size (n_ubatch = n_batch).

    ``type_k`` / ``type_v`` (default ``kv_type``): f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1.
    ``flash_attn`` None: on exactly when V is quantized (llama.cpp stores a quantized V only
    with flash attention; False with a quantized V is refused here, as llama.cpp would).
    ``rotate``: llama.cpp's Hadamard rotation of quantized K/V, on by default in llama.cpp
    (None keeps whatever the environment says, False turns it off for this context).
    """
    type_k, type_v = type_k or kv_type, type_v or kv_type
    _check_kv("K", type_k)
    _check_kv("V", type_v)
    v_quant = type_v in QUANT_KV_TYPES
    if flash_attn is None:
        flash_attn = v_quant
    elif v_quant and not flash_attn:
        raise ValueError(f"llama.cpp needs flash attention for a quantized V cache ({type_v})")
    import llama_cpp
    with _quiet(), _rotation(rotate):
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                               logits_all=logits_all, flash_attn=flash_attn, type_k=_KV[type_k],
                               type_v=_KV[type_v], n_threads=n_threads, n_threads_batch=n_threads,
                               verbose=False, seed=0)


def logits(path: str, tokens, n_batch: int = 512, kv_type: str = "f32", n_ctx: int | None = None,
           type_k: str | None = None, type_v: str | None = None, flash_attn: bool | None = None,
           rotate: bool | None = None, last: int | None = None) -> np.ndarray:
    """float32[T, n_vocab] logits of every position of ``tokens`` (evaluated in n_batch chunks).
    Cache types, flash attention and rotation as :func:`open_model`.

    ``last``: only the logits of the last ``last`` positions, float32[last, n_vocab]: the
    tokens before them are evaluated in n_batch chunks with no logits kept, then the last
    ones in n_batch chunks with every row's logits (a long prompt's all-position logits
    would take T x n_vocab floats).
    """
    tokens = [int(t) for t in tokens]
    n_ctx = n_ctx or max(64, len(tokens) + 8)
    if last is None:
        m = open_model(path, n_ctx=n_ctx, n_batch=n_batch, kv_type=kv_type, type_k=type_k,
                       type_v=type_v, flash_attn=flash_attn, rotate=rotate)
        with _quiet():
            m.eval(tokens)
        out = np.array(m.scores[:len(tokens)], dtype=np.float32)
        m.close()
        return out
    if not 0 < last <= len(tokens):
        raise ValueError(f"last must be in 1..{len(tokens)}, got {last}")
    m = open_model(path, n_ctx=n_ctx, n_batch=n_batch, kv_type=kv_type, type_k=type_k,
                   type_v=type_v, flash_attn=flash_attn, rotate=rotate, logits_all=False)
    n_vocab = m.n_vocab()
    head, tail = tokens[:-last], tokens[-last:]
    rows = []
    with _quiet():
        if head:
            m.eval(head)
        for i in range(0, len(tail), n_batch):
            chunk = tail[i:i + n_batch]
            m._batch.set_batch(batch=chunk, n_past=m.n_tokens, logits_all=True)
            m._ctx.decode(m._batch)
            rows.append(np.ctypeslib.as_array(m._ctx.get_logits(),
                                              shape=(len(chunk), n_vocab)).copy())
            m.n_tokens += len(chunk)
    m.close()
    return np.concatenate(rows).astype(np.float32, copy=False)


def greedy(path: str, tokens, n: int, n_batch: int = 512, kv_type: str = "f16",
           with_logits: bool = False):
    """``n`` greedy continuation tokens of ``tokens``; with ``with_logits`` also the
    float32[n, n_vocab] logits each token was chosen from."""
    m = open_model(path, n_ctx=len(tokens) + n + 8, n_batch=n_batch, kv_type=kv_type, logits_all=True)
    out, rows = [], []
    with _quiet():
        m.eval([int(t) for t in tokens])
        for _ in range(n):
            row = np.array(m.scores[m.n_tokens - 1], dtype=np.float32)
            t = int(np.argmax(row))
            out.append(t)
            rows.append(row)
            m.eval([t])
    m.close()
    return (out, np.stack(rows)) if with_logits else out


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        _probe_child()
        print(system_info())
        sys.exit(0)
    print("usage: python -m tools.llamacpp_peer --probe", file=sys.stderr)
    sys.exit(2)
