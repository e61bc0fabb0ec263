"""Capture llama.cpp's intermediate tensors (``Qcur-0``, ``kq_soft_max-0``, ``l_out-3``, ...).

Uses the ``cb_eval`` scheduler callback of llama.cpp's context parameters;
tensors are read back as float32 NumPy arrays in NumPy order (reverse of
ggml's ne). For debugging numerics against pyimp's forward pass.

    from tools.llamacpp_trace import trace
    t = trace("model.gguf", [1, 2, 3], names=("Qcur-0", "kqv_out-0"))

As a program it writes a greedy run (prefill + N decode steps) as a tensor dump in
pyimp-dump's format and names (:mod:`pyimp.trace.dump`), for ``pyimp-compare``; flash attention off,
the prefill one ubatch::

    python -m tools.llamacpp_trace MODEL -p PROMPT --steps N -o OUT.gguf [--follow PYIMP_DUMP]
        [--kv-type f32|f16] [-t THREADS]

``--follow`` feeds exactly the token ids a pyimp dump recorded (``inp_tokens@s``), so the
decode steps see the same tokens even where the two engines' greedy choices would differ.
Only the tensors llama.cpp's graph names (``<name>`` or ``<name>-<layer>``) are written: not
unnamed nodes (``node_12``) nor views (``Kcur-0 (view)``, ``cache_k_l0 (view)``).
"""
from __future__ import annotations

import ctypes
import os
import re
import sys

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


# names llama.cpp's graph callback gives (cb(cur, name, il)); not node_<n> / leaf_<n> / views
_GRAPH_NAME = re.compile(r"^(?!node_\d|leaf_\d)[A-Za-z][A-Za-z0-9_]*(-\d+)?$")


def trace_run(path: str, tokens, steps: int = 0, follow=None, kv_type: str = "f32",
              n_threads: int = 2, keep=None) -> tuple[dict, list]:
    """Greedy run of ``tokens`` through llama.cpp: the prefill as one ubatch, then ``steps``
    decode steps, each fed the argmax of the previous logits or, with ``follow`` (one id per
    step), that id. Returns ({dump name: float32 array}, the ids fed per step): dump names as
    :mod:`pyimp.trace.dump` (``Qcur-0#2@1``), in emission order; ``keep(name)`` filters."""
    import llama_cpp as L

    from tools.llamacpp_peer import _KV, _quiet

    if follow is not None and len(follow) < steps:
        raise ValueError(f"{len(follow)} tokens to follow for {steps} decode steps")
    out: dict = {}
    state = {"step": 0, "count": {}}

    @L.ggml_backend_sched_eval_callback
    def cb(tp, ask, _user):
        t = ctypes.cast(tp, ctypes.POINTER(_Tensor)).contents
        name = t.name.decode(errors="replace")
        if not _GRAPH_NAME.match(name):
            return not ask
        if ask:
            return True
        k = state["count"].get(name, 0)
        state["count"][name] = k + 1
        full = f"{name}#{k}@{state['step']}" if k else f"{name}@{state['step']}"
        if keep is None or keep(full):
            arr = _read(t)
            if arr is not None:
                out[full] = arr
        return True

    toks = [int(t) for t in tokens]
    with _quiet():
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        model = L.llama_model_load_from_file(os.fsencode(path), mp)
    if not model:
        raise RuntimeError(f"{path}: llama.cpp could not load the model")
    cp = L.llama_context_default_params()
    cp.n_ctx = max(64, len(toks) + steps + 8)
    cp.n_batch = cp.n_ubatch = max(512, len(toks))
    cp.type_k = cp.type_v = _KV[kv_type]
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.cb_eval = cb
    with _quiet():
        ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    fed = []
    try:
        feed = toks
        for s in range(steps + 1):
            state["step"], state["count"] = s, {}
            fed.append(list(feed))
            arr = (L.llama_token * len(feed))(*feed)
            out[f"inp_tokens@{s}"] = np.asarray(feed, dtype=np.int32)
            with _quiet():
                rc = L.llama_decode(ctx, L.llama_batch_get_one(arr, len(feed)))
            if rc:
                raise RuntimeError(f"llama_decode failed (code {rc}) in step {s}")
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            nxt = int(np.argmax(logits))
            feed = [int(follow[s])] if follow is not None and s < steps else [nxt]
    finally:
        with _quiet():
            L.llama_free(ctx)
            L.llama_model_free(model)
    return _steps_ordered(out), fed


def _steps_ordered(out: dict) -> dict:
    """inp_tokens@s first in its step, everything else as emitted."""
    from pyimp.trace.dump import split_name
    steps: dict = {}
    for name, arr in out.items():
        steps.setdefault(split_name(name)[3], []).append((name, arr))
    res = {}
    for s in sorted(steps):
        recs = sorted(steps[s], key=lambda r: not r[0].startswith("inp_tokens@"))
        res.update(recs)
    return res


def tokenize(path: str, text: str, add_bos: bool = True) -> list[int]:
    """llama.cpp's token ids of ``text`` (llama_tokenize, special tokens not parsed)."""
    import llama_cpp as L

    from tools.llamacpp_peer import _quiet
    with _quiet():
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        model = L.llama_model_load_from_file(os.fsencode(path), mp)
    if not model:
        raise RuntimeError(f"{path}: llama.cpp could not load the model")
    try:
        vocab = L.llama_model_get_vocab(model)
        data = text.encode("utf-8", "surrogateescape")
        n_max = len(data) + 8
        buf = (L.llama_token * n_max)()
        n = L.llama_tokenize(vocab, data, len(data), buf, n_max, add_bos, False)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return list(buf[:n])
    finally:
        L.llama_model_free(model)


def _error(msg: str) -> int:
    print(f"llamacpp_trace: error: {msg}", file=sys.stderr)
    return 1


def main(argv=None) -> int:
    from pyimp.cli.common import Parser, int_at_least
    p = Parser(prog="python -m tools.llamacpp_trace",
                description="Write llama.cpp's named intermediate tensors of a greedy run as a "
                            "pyimp tensor dump (GGUF; compare with pyimp-compare).")
    p.add_argument("model", help="GGUF model file")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text (tokenized by llama.cpp)")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("--steps", type=int_at_least(0, "--steps"), default=None,
                   help="greedy decode steps after the prefill (default 4, or the followed "
                        "dump's)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf")
    p.add_argument("--follow", metavar="PYIMP_DUMP",
                   help="feed the token ids this dump recorded (its prompt and decode tokens)")
    p.add_argument("--kv-type", choices=("f32", "f16"), default="f32", help="K and V cache type")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS token")
    p.add_argument("-t", "--threads", type=int_at_least(1, "--threads"), default=2)
    args = p.parse_args(argv)

    from pyimp.trace import dump
    from pyimp.cli.common import read_prompt
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return _error("llama-cpp-python is not installed (python -m tools.build_peer)")
    if not os.path.isfile(args.model):
        return _error(f"{args.model}: no such file")
    out = args.output
    if os.path.isdir(out) or not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        return _error(f"-o {out}: not a file name in an existing folder")
    follow = None
    if args.follow:
        if args.prompt is not None or args.file is not None:
            return _error("--follow takes the prompt from the dump: drop -p/-f")
        try:
            d = dump.read(args.follow)
        except dump.DumpError as e:
            return _error(str(e))
        n = int(d.meta.get("steps", 0))
        steps = n if args.steps is None else args.steps
        if steps > n:
            return _error(f"--steps {steps}: {args.follow} recorded {n} decode steps")
        fed = []
        for s in range(steps + 1):
            if f"inp_tokens@{s}" not in d:
                return _error(f"{args.follow}: no inp_tokens@{s} (the token ids of step {s})")
            fed.append([int(t) for t in np.asarray(d.tensor(f"inp_tokens@{s}")).reshape(-1)])
        tokens, follow, prompt = fed[0], [f[0] for f in fed[1:]], d.meta.get("prompt", "")
    else:
        steps = 4 if args.steps is None else args.steps
        try:
            prompt = read_prompt(args)
        except OSError as e:
            return _error(str(e))
        try:
            tokens = tokenize(args.model, prompt, add_bos=not args.no_bos)
        except RuntimeError as e:
            return _error(str(e))
        if not tokens:
            return _error("the prompt is empty (give -p TEXT or -f FILE, or --follow DUMP)")
    try:
        tensors, fed = trace_run(args.model, tokens, steps, follow=follow, kv_type=args.kv_type,
                                 n_threads=args.threads)
    except (RuntimeError, ValueError) as e:
        return _error(str(e))
    from loaders.gguf_file import GGUFFile
    f = GGUFFile(args.model)
    meta = {"producer": "llama.cpp", "model_fingerprint": f.fingerprint(), "prompt": prompt,
            "steps": steps, "numerics": "llama.cpp", "kv_type": args.kv_type,
            "architecture": str(f.metadata.get("general.architecture", ""))}
    f.close()
    try:
        dump.write(out, tensors, meta)
    except OSError as e:
        return _error(f"cannot write {out}: {e.strerror or e}")
    print(f"llamacpp_trace: {len(tensors)} tensors of {steps + 1} steps ({len(tokens)} prompt "
          f"tokens; decode fed {' '.join(str(t[0]) for t in fed[1:]) or 'nothing'}) -> {out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
