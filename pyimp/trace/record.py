"""What :meth:`pyimp.engine.Engine.trace` records and the tensor-dump file it writes.

The recorder the forward's taps call while a trace runs (:class:`Recorder`: llama.cpp's tensor
names, repeats and steps, llama.cpp's order), the run itself (:func:`run_trace`), the memory a
trace will hold (:func:`estimate_bytes`), and the GGUF file format (:func:`write`,
:func:`read`). Names and format are documented in :mod:`pyimp.trace.dump`, the ``pyimp-dump``
command built on this module; ``pyimp-compare`` (:mod:`pyimp.trace.compare`) reads the files.
The engine calls into this module; it imports nothing of the engine.
"""
from __future__ import annotations

import os
import re
import struct
import tempfile
from dataclasses import dataclass, field

import numpy as np

VERSION = 1
KEY = "pyimp.trace.dump."
FORMAT_ARCH = "pyimp.trace.dump"

# llama.cpp's emission order of the names pyimp produces, per architecture (read off real
# traces, see the module docstring). Names a model does not produce (biases) are skipped.
PRE = ("inp_tokens", "embd", "inp_scaled")
LAYER_ORDER = {
    "llama": ("attn_norm", "Qcur", "Qcur#1", "Qcur#2", "Qcur#3", "Vcur", "Vcur#1", "Vcur#2",
              "Kcur", "Kcur#1", "Kcur#2", "Kcur#3", "kqv", "kqv_out", "kqv_wo", "attn_out",
              "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out"),
    "gemma3": ("attn_norm", "Qcur", "Qcur#1", "Qcur_normed", "Qcur#2", "Kcur", "Kcur#1",
               "Kcur_normed", "Kcur#2", "Vcur", "Vcur#1", "kqv", "kqv_out", "attn_post_norm",
               "sa_out", "ffn_norm", "ffn_gate", "ffn_up", "ffn_geglu", "ffn_out",
               "ffn_post_norm", "l_out"),
    "qwen2": ("attn_norm", "Qcur", "Qcur#1", "Qcur#2", "Qcur#3", "Vcur", "Vcur#1", "Vcur#2",
              "Kcur", "Kcur#1", "Kcur#2", "Kcur#3", "kqv", "kqv_out", "ffn_inp", "ffn_norm",
              "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out"),
    "qwen3": ("attn_norm", "Qcur", "Qcur#1", "Qcur_normed", "Qcur#2", "Vcur", "Vcur#1", "Kcur",
              "Kcur#1", "Kcur_normed", "Kcur#2", "kqv", "kqv_out", "ffn_inp", "ffn_norm",
              "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out"),
    "phi3": ("attn_norm", "wqkv", "Qcur", "Qcur#1", "Qcur#2", "Vcur", "Kcur", "Kcur#1", "kqv",
             "kqv_out", "ffn_norm", "ffn_up", "ffn_swiglu", "ffn_out", "l_out"),
}
# names the forward's steps report that llama.cpp's graph of an architecture does not have:
# not recorded for it
NOT_IN_GRAPH = {"llama": frozenset({"Qcur_scaled"}), "gemma3": frozenset({"Qcur_scaled"}),
                "qwen2": frozenset({"attn_out", "Qcur_scaled"}),
                "qwen3": frozenset({"attn_out", "Qcur_scaled"}),
                "phi3": frozenset({"attn_out", "ffn_inp"})}
# names the forward's steps report that an architecture's graph names otherwise
RENAMED = {"phi3": {"Qcur_scaled": "Qcur"}}
POST = ("result_norm", "result_output")
# llama.cpp names pyimp does not produce (documented above; pyimp-compare lists them)
NOT_PRODUCED = ("norm", "kq", "kq_soft_max")

_NAME = re.compile(r"^(?P<base>.+?)(?:-(?P<il>\d+))?(?:#(?P<k>\d+))?@(?P<step>\d+)$")


class DumpError(Exception):
    """A file that is not a readable tensor dump; the message names the file and the reason."""


def split_name(name: str) -> tuple[str, int, int, int] | None:
    """``"Qcur-0#2@1"`` -> ("Qcur", 0, 2, 1): base, layer (-1: none), repeat, step; None for a
    name without a step suffix."""
    m = _NAME.match(name)
    if m is None:
        return None
    il = -1 if m["il"] is None else int(m["il"])
    return m["base"], il, int(m["k"] or 0), int(m["step"])


def unstepped(name: str) -> str:
    """The name without its ``@s`` suffix."""
    return name.rsplit("@", 1)[0]


def _order_key(arch: str, name: str, seq: int) -> tuple:
    """Where a recorded tensor goes within its step: llama.cpp's order, pyimp-only ones after."""
    base, il, k, _ = split_name(name)
    rep = base + (f"#{k}" if k else "")
    if il < 0 and rep in PRE:
        return (0, PRE.index(rep), 0, seq)
    if il < 0 and rep in POST:
        return (2, POST.index(rep), 0, seq)
    layer = LAYER_ORDER.get(arch, ())
    if il >= 0 and rep in layer:
        return (1, il, layer.index(rep), seq)
    return (3, 0, 0, seq)


@dataclass
class Trace:
    """What :meth:`Engine.trace` recorded: ``tensors`` {dump name: array} in graph order,
    ``tokens`` (the ids fed in each step), ``logits`` (float32[n_vocab] the last token of each
    step produced), and the metadata :func:`write` stores."""

    arch: str
    tensors: dict = field(default_factory=dict)
    tokens: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def write(self, path: str | os.PathLike) -> None:
        write(path, self.tensors, self.meta)


class Recorder:
    """The forward's tap while a trace runs: names each tensor (``#k`` repeats, ``@s`` step),
    copies the ones ``keep`` accepts, and orders each step as llama.cpp's graph does."""

    def __init__(self, arch: str, keep=None):
        self.arch = arch
        self.keep = keep
        self.skip = NOT_IN_GRAPH.get(arch, frozenset())
        self.rename = RENAMED.get(arch, {})
        self.step = 0
        self.out: dict = {}
        self._count: dict = {}
        self._step: list = []

    def begin(self, step: int) -> None:
        self.step = step
        self._count.clear()
        self._step = []

    def __call__(self, name: str, il: int, x: np.ndarray) -> None:
        if name in self.skip:
            return
        name = self.rename.get(name, name)
        base = f"{name}-{il}" if il >= 0 else name
        k = self._count.get(base, 0)
        self._count[base] = k + 1
        full = f"{base}#{k}@{self.step}" if k else f"{base}@{self.step}"
        if self.keep is None or self.keep(full):
            self._step.append((full, np.array(x, order="C", copy=True)))

    def end(self) -> None:
        recs = sorted(enumerate(self._step), key=lambda r: _order_key(self.arch, r[1][0], r[0]))
        for _, (name, arr) in recs:
            self.out[name] = arr
        self._step = []


def _record_sparse(engine, tap) -> None:
    """importance_, anchors and this step's block selections of a sparse engine (see above)."""
    sp, cache = engine.sparse, engine.cache
    B = cache.block_len

    def used(il):
        return cache.table(il)[:-(-cache.slot_count(il) // B)]

    for il in range(engine.cfg.n_layer):
        tap("importance_", il, sp.importance_[il][used(il)])
    for il in sp.anchor_.layers:
        tap("anchor_", il, sp.anchor_.storage(il)[used(il)])
    for il, (sel, cnt) in sorted(sp.last_selection.items()):
        tap("sel", il, np.asarray(sel, np.int32))
        tap("cnt", il, np.asarray(cnt, np.int32))
    sp.last_selection.clear()


def run_trace(engine, prompt, steps: int = 0, keep=None, add_bos: bool = True) -> Trace:
    """:meth:`Engine.trace`: reset the cache, run ``prompt`` (text or token ids) as one prefill
    forward and ``steps`` greedy decode steps with the forward's taps recording; ``keep(name)``
    selects the tensors copied (None: all)."""
    if engine.file is None:
        raise RuntimeError("the engine is closed")
    if engine.device != "cpu":
        raise ValueError(f"trace taps the CPU forward only; the model runs on {engine.device}: "
                         f"load it with device='cpu' (pyimp-dump --device cpu)")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    text = isinstance(prompt, str)
    ids = engine.tokenize(prompt, add_bos=add_bos) if text else [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) > engine.options.batch_size:
        raise ValueError(f"the prompt's {len(ids)} tokens exceed the batch size "
                         f"{engine.options.batch_size}: a trace's prefill is one forward "
                         f"(raise batch_size)")
    engine.reset()
    engine.check_tokens(ids + [0] * steps)         # every step fits the context
    tr = Trace(engine.cfg.arch)
    rec = Recorder(engine.cfg.arch, keep)
    prev, engine._tap = engine._tap, rec
    try:
        feed = np.asarray(ids, dtype=np.int64)
        for s in range(steps + 1):
            rec.begin(s)
            rec("inp_tokens", -1, feed.astype(np.int32))
            logits = engine.eval(feed)[-1]
            if engine.sparse is not None:
                _record_sparse(engine, rec)
            rec.end()
            tr.tokens.append([int(t) for t in feed])
            tr.logits.append(np.array(logits, dtype=np.float32))
            feed = np.array([int(np.argmax(logits))], dtype=np.int64)
    finally:
        engine._tap = prev
    o = engine.options
    kv = o.type_k if o.type_k == o.type_v else f"{o.type_k}/{o.type_v}"
    tr.tensors = rec.out
    tr.meta = {"producer": "pyimp", "model_fingerprint": engine.file.fingerprint(),
               "prompt": prompt if text else "", "steps": steps, "numerics": o.numerics,
               "architecture": engine.cfg.arch, "kv_type": kv}
    return tr


def _forward_taps(engine, T: int) -> list:
    """(name without @step, bytes) of every tensor a traced forward of ``T`` tokens records,
    in the order Engine.forward taps them (one prefill or decode step, logits of the last row)."""
    cfg, A = engine.cfg, engine.weights.arch
    E, F, D, Hq, Hkv = cfg.n_embd, cfg.n_ff, cfg.head_dim, cfg.n_head, cfg.n_head_kv
    taps: list = [("inp_tokens", -1, 4 * T), ("embd", -1, 4 * T * E)]
    if A.embd_scale:
        taps.append(("inp_scaled", -1, 4 * T * E))
    for il, lw in enumerate(engine.weights.layers):
        rows = 1 if il == cfg.n_layer - 1 else T        # the last layer keeps one row
        q, kv = 4 * T * Hq * D, 4 * T * Hkv * D
        taps.append(("attn_norm", il, 4 * T * E))
        for name, nb, bias in (("Qcur", q, lw.attn_q_bias), ("Kcur", kv, lw.attn_k_bias),
                               ("Vcur", kv, lw.attn_v_bias)):
            taps += [(name, il, nb)] * (1 if bias is None else 2)
        taps += [("Qcur", il, q), ("Kcur", il, kv), ("Vcur", il, kv)]
        if A.qk_norm:
            taps += [("Qcur_normed", il, q), ("Kcur_normed", il, kv)]
        taps += [("Qcur", il, q), ("Kcur", il, kv), ("kqv", il, q), ("kqv_out", il, q)]
        if lw.attn_output_bias is not None:
            taps.append(("kqv_wo", il, 4 * T * E))
        taps.append(("attn_post_norm", il, 4 * rows * E) if A.post_norms else
                    ("attn_out", il, 4 * T * E))
        act = "ffn_geglu" if A.ffn_act == "gelu_tanh" else "ffn_swiglu"
        taps += [("sa_out" if A.post_norms else "ffn_inp", il, 4 * rows * E),
                 ("ffn_norm", il, 4 * rows * E), ("ffn_gate", il, 4 * rows * F),
                 ("ffn_up", il, 4 * rows * F), (act, il, 4 * rows * F),
                 ("ffn_out", il, 4 * rows * E)]
        if A.post_norms:
            taps.append(("ffn_post_norm", il, 4 * rows * E))
        taps.append(("l_out", il, 4 * rows * E))
    taps += [("result_norm", -1, 4 * E), ("result_output", -1, 4 * cfg.n_vocab)]
    count: dict = {}
    out = []
    for name, il, nb in taps:                 # named as the Recorder names them
        base = f"{name}-{il}" if il >= 0 else name
        k = count.get(base, 0)
        count[base] = k + 1
        out.append((f"{base}#{k}" if k else base, nb))
    return out


def _ceil_sum(n: int, B: int) -> int:
    """sum(ceil(m / B) for m in 1..n)."""
    q, r = divmod(n, B)
    return B * q * (q + 1) // 2 + r * (q + 1)


def estimate_bytes(engine, n_prompt: int, steps: int, keep=None) -> int:
    """The bytes a trace of a ``n_prompt``-token prompt and ``steps`` decode steps holds in
    memory before it is written: the tensors ``keep`` accepts (None: all) and each step's
    logits, from the model's and the sparse state's shapes, before anything runs. An upper
    bound (every sparse layer's selection counted as every block); a name filter is judged on
    the prefill and on the first and last decode step, which stand for all decode steps."""
    ok = (lambda name: True) if keep is None else keep
    decode = sorted({1, steps}) if steps else []

    def kept_in_decode(name: str) -> bool:
        return any(ok(f"{name}@{s}") for s in decode)

    total = (steps + 1) * 4 * engine.cfg.n_vocab               # Trace.logits
    total += sum(nb for name, nb in _forward_taps(engine, n_prompt) if ok(f"{name}@0"))
    total += steps * sum(nb for name, nb in _forward_taps(engine, 1) if kept_in_decode(name))
    sp = engine.sparse
    if sp is not None:
        from ..sparse.retrieval import n_sets
        B, cfg = engine.cache.block_len, engine.cfg
        blocks0 = -(-n_prompt // B)                              # blocks held after the prefill
        blocks_dec = _ceil_sum(n_prompt + steps, B) - _ceil_sum(n_prompt, B)
        per_block = {f"importance_-{il}": sp.importance_[il][:1].nbytes
                     for il in range(cfg.n_layer)}
        per_block.update({f"anchor_-{il}": sp.anchor_.storage(il)[:1].nbytes
                          for il in sp.anchor_.layers})
        for name, nb in per_block.items():
            total += nb * (blocks0 * ok(f"{name}@0") + blocks_dec * kept_in_decode(name))
        sets = n_sets(sp.retrieval_type, cfg.n_head, cfg.n_head_kv)
        for il in sp.sparse_layers:                              # sel [sets, <= blocks], cnt
            if kept_in_decode(f"sel-{il}"):
                total += 4 * sets * blocks_dec
            if kept_in_decode(f"cnt-{il}"):
                total += 4 * sets * steps
    return total


# ------------------------------------------------------------------ file format
def ggml_shape(shape) -> tuple:
    """NumPy shape with leading ones dropped (ggml's trailing ne ones; at least one dim)."""
    shape = tuple(int(n) for n in shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def write(path: str | os.PathLike, tensors: dict, meta: dict) -> None:
    """Write ``tensors`` {name: array} (in graph order) and ``meta`` (the keys above, without
    the prefix) as a tensor dump; written to a temporary file and renamed."""
    import gguf

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".dump-", suffix=".part", dir=folder)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, FORMAT_ARCH)
        w.add_uint32(KEY + "version", VERSION)
        for k in ("producer", "model_fingerprint", "prompt", "numerics", "architecture", "kv_type"):
            w.add_string(KEY + k, str(meta.get(k, "")))
        w.add_uint32(KEY + "steps", int(meta.get("steps", 0)))
        names = list(tensors)
        if names:
            w.add_array(KEY + "order", names)
        for name in names:
            a = np.asarray(tensors[name])
            if a.dtype not in (np.float32, np.float16, np.int32):
                a = a.astype(np.int32 if a.dtype.kind in "iub" else np.float32)
            w.add_tensor(name, np.ascontiguousarray(a).reshape(ggml_shape(a.shape)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class Dump:
    """A tensor dump read back: ``meta`` {key without prefix: value}, ``order`` (names in graph
    order), ``tensor(name)`` (NumPy order, memory-mapped)."""

    path: str
    meta: dict
    order: list
    _tensors: dict

    def tensor(self, name: str) -> np.ndarray:
        return self._tensors[name].data

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    @property
    def names(self) -> list:
        return list(self._tensors)


def read(path: str | os.PathLike) -> Dump:
    """Open a tensor dump; :class:`DumpError` (naming the file and the reason) for a missing or
    unreadable file, one that is not GGUF, or a GGUF file that is not a dump."""
    import gguf

    path = os.fspath(path)
    if not os.path.exists(path):
        raise DumpError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DumpError(f"{path}: is a directory, not a tensor dump")
    try:
        r = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError, struct.error) as e:
        raise DumpError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    f = r.fields.get(KEY + "version")
    if f is None:
        raise DumpError(f"{path}: a GGUF file but not a tensor dump (no {KEY}version key: a "
                        f"model? write dumps with pyimp-dump or tools.llamacpp_trace)")
    meta = {}
    for k, v in r.fields.items():
        if k.startswith(KEY):
            try:
                meta[k[len(KEY):]] = v.contents()
            except (ValueError, IndexError, UnicodeDecodeError) as e:
                raise DumpError(f"{path}: unreadable metadata {k} ({e})") from None
    if meta["version"] != VERSION:
        raise DumpError(f"{path}: tensor dump version {meta['version']}, this reader knows "
                        f"{VERSION}")
    tensors = {t.name: t for t in r.tensors}
    order = list(meta.get("order") or [])
    missing = [n for n in order if n not in tensors]
    if missing:
        raise DumpError(f"{path}: {KEY}order names {missing[0]}, which the file does not hold")
    order += [n for n in tensors if n not in set(order)]
    return Dump(path, meta, order, tensors)
