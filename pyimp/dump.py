"""``pyimp-dump``: every named intermediate tensor of a greedy run, in a GGUF file.

:meth:`pyimp.engine.Engine.trace` runs a prompt (the prefill as one forward, then N greedy
decode steps) with a recorder on the forward's taps; :func:`write` stores what it recorded as
a GGUF file (``gguf.GGUFWriter``), so any GGUF reader opens it. ``tools/llamacpp_trace.py``
writes llama.cpp's own intermediates (its ``cb_eval`` callback) in the same format, and
``pyimp-compare`` (:mod:`pyimp.compare`) pairs the two by name::

    pyimp-dump -p "The capital of France is" --steps 4 -o pyimp.gguf
    python -m tools.llamacpp_trace MODEL -p "..." --steps 4 -o llama.gguf --follow pyimp.gguf
    pyimp-compare pyimp.gguf llama.gguf

Tensor names
------------
``<llama.cpp name>[#k]@s``: the name llama.cpp's graph gives the tensor for the model's
architecture (``attn_norm-3``: ``<name>-<layer>``; ``embd``, ``result_output``: no layer),
``#k`` for its k-th repeat (k >= 1) within one step (the first emission has no ``#``), and
``@s`` the step: 0 the prefill, 1..N the decode steps. ``Qcur-0@0`` is the first ``Qcur``
of layer 0 in the prefill (the projection), ``Qcur-0#2@0`` the third (after RoPE),
``l_out-17@3`` layer 17's output in decode step 3. The order of the tensors (metadata
``pyimp.dump.order``) is llama.cpp's emission order (read off real traces of both
architectures with ``tools.llamacpp_trace.trace(names=None)``; :data:`LAYER_ORDER`).

llama (per layer, ``-<il>`` after each name)::

    attn_norm          rms_norm(x) * attn_norm                       [T, E]
    Qcur               q projection                                  [T, Hq*D]
    Qcur#1             q as heads                                    [T, Hq, D]
    Qcur#2             q after RoPE                                  [T, Hq, D]
    Vcur, Vcur#1       v projection, as heads                        [T, Hkv*D], [T, Hkv, D]
    Kcur, #1, #2       k projection, as heads, after RoPE            [T, Hkv*D], [T, Hkv, D]
    kqv                attention output per head                     [Hq, T, D]
    kqv_out            attention output                              [T, Hq*D]
    attn_out           output projection                             [T, E]
    ffn_inp            residual (last layer: the output rows only)   [T, E]
    ffn_norm, ffn_gate, ffn_up, ffn_swiglu (silu(gate) * up), ffn_out, l_out

With q/k/v biases each projection's name repeats once more after the bias (``Qcur#1`` is then
q + bias, ``Qcur#3`` the RoPE output) and ``kqv_wo`` is the output projection before its bias.
gemma3 (per layer)::

    attn_norm, Qcur, Qcur#1, Qcur_normed (per-head rms norm), Qcur#2 (after RoPE, before the
    1/sqrt(D) scale), Kcur, Kcur#1, Kcur_normed, Kcur#2, Vcur, Vcur#1, kqv, kqv_out,
    attn_post_norm (last layer: the output rows only), sa_out (the residual), ffn_norm,
    ffn_gate, ffn_up, ffn_geglu (gelu(gate) * up), ffn_out, ffn_post_norm, l_out

Before the layers ``embd`` (token_embd rows) and for gemma3 ``inp_scaled`` (times sqrt(E));
after them ``result_norm`` and ``result_output`` (the logits, soft-capped for gemma3), for the
last token only: llama.cpp outputs one row per step (its ``inp_out_ids`` get_rows at the last
layer), and pyimp's forward keeps only the last row from the last layer's residual on.

What llama.cpp emits that pyimp does not: ``norm-<il>`` / ``norm`` (rms_norm before the weight
multiply: pyimp's norm multiplies in the same pass), ``kq-<il>`` and ``kq_soft_max-<il>`` (pyimp's
attention kernels never form the score matrix; llama.cpp's rows also span its padded cache),
unnamed nodes (``node_<n>``: gemma3's output projection, the q scale, the logits before the
soft-cap, the last layer's get_rows) and views (``... (view)``, ``(permuted)``, cache copies),
which ``tools/llamacpp_trace`` leaves out.

pyimp-only tensors, after the graph's tensors of each step::

    inp_tokens@s       int32 [T]               the token ids fed in step s (first in the step)
    importance_-<il>@s float16 [n_blocks, B, Hq]  importance_ of the blocks layer il uses, in
                                                 block-table (logical) order, after the step
    anchor_-<il>@s     float16 [n_blocks, A, Ha, D]  its anchors as stored (Ha: kv heads for the
                                                 group-shared types, query heads for dynamic)
    sel-<il>@s         int32 [sets, K]         the block selection of a block-sparse decode step
    cnt-<il>@s         int32 [sets]            the valid entries of each set of sel

(``importance_`` / ``anchor_`` only when the engine keeps a sparse state; ``sel`` / ``cnt`` only
for layers that took the block-sparse path in that step.)

File format
-----------
GGUF, one tensor per name: float32 (float16 for importance_ and anchor_, int32 for token ids and
selections), shapes in ggml order (ne: GGUFWriter reverses NumPy's [T, E] to ne [E, T]) with
trailing ones dropped as ``ggml_n_dims`` does, so a decode step's one-row [1, E] is ne [E] in both
producers. Metadata (``general.architecture`` is ``pyimp.dump``)::

    pyimp.dump.version            uint32  1
    pyimp.dump.producer           string  "pyimp" or "llama.cpp"
    pyimp.dump.model_fingerprint  string  GGUFFile.fingerprint() of the model
    pyimp.dump.prompt             string  the prompt text ("" when token ids were given)
    pyimp.dump.steps              uint32  decode steps run (the file has steps 0..steps)
    pyimp.dump.numerics           string  pyimp: "fp32" / "ggml"; llama.cpp: "llama.cpp"
    pyimp.dump.architecture       string  the model's architecture (llama, gemma3)
    pyimp.dump.kv_type            string  K/V cache types ("f16", "f32/f16", ...)
    pyimp.dump.order              [string] tensor names in graph order

``--layers``, ``--tensors`` and ``--steps`` limit what is written: layer filters keep tensors
without a layer (embd, result_*); ``inp_tokens`` is always written; a ``--tensors`` glob (fnmatch, repeatable) matches
the full name or the name without its ``@s``. The prefill is one forward (one llama.cpp ubatch):
the batch size is raised to the prompt length. A trace is held in memory until it is written:
its size (:func:`estimate_bytes`, from the model's shapes, the filters and the steps) with the KV
cache is checked against the available memory (:mod:`pyimp.memory`) before the run, and a dump
that does not fit is refused with one line.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import struct
import sys
import tempfile
import warnings
from dataclasses import dataclass, field

import numpy as np

VERSION = 1
KEY = "pyimp.dump."
FORMAT_ARCH = "pyimp.dump"

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
}
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
        self.step = 0
        self.out: dict = {}
        self._count: dict = {}
        self._step: list = []

    def begin(self, step: int) -> None:
        self.step = step
        self._count.clear()
        self._step = []

    def __call__(self, name: str, il: int, x: np.ndarray) -> None:
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
    engine._check_tokens(ids + [0] * steps)         # every step fits the context
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
        from .sparse.retrieval import n_sets
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


# ------------------------------------------------------------------ CLI
EXIT_USAGE = 2
EXIT_ERROR = 1


def _layers(s: str) -> frozenset:
    try:
        out = frozenset(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers must be comma-separated layer numbers, "
                                         f"got {s!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"--layers must be comma-separated layer numbers >= 0, "
                                         f"got {s!r}")
    return out


def _glob(s: str) -> str:
    if not s:
        raise argparse.ArgumentTypeError("--tensors: an empty glob matches nothing")
    try:
        re.compile(fnmatch.translate(s))
    except re.error as e:
        raise argparse.ArgumentTypeError(f"--tensors {s!r} is not a valid glob ({e})") from None
    return s


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .cli import MAX_PROMPT_BYTES, _Help, _int_at_least, _Parser, add_model_args

    p = _Parser(prog="pyimp-dump", formatter_class=_Help,
                description="Write every named intermediate tensor of a greedy run (prefill + "
                            "--steps decode steps) to a GGUF file, under llama.cpp's graph names "
                            "(see pyimp.dump's documentation; compare with pyimp-compare).")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file",
                     help=f"read the prompt from this file (at most {MAX_PROMPT_BYTES >> 20} MiB)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="the dump to write")
    p.add_argument("--steps", type=_int_at_least(0, "--steps"), default=4,
                   help="greedy decode steps after the prefill (0 = prefill only)")
    p.add_argument("--layers", type=_layers, default=None,
                   help="comma-separated layers whose tensors are written (tensors without a "
                        "layer are always written)")
    p.add_argument("--tensors", type=_glob, action="append", metavar="GLOB",
                   help="write only the tensors whose name (with or without its @step) matches "
                        "this fnmatch glob, e.g. 'l_out-*' or 'Qcur-0#2@0'; repeatable")
    p.add_argument("--numerics", choices=("fp32", "ggml"), default="fp32",
                   help="fp32: exact weights, fp32 activations; ggml: activations quantized as "
                        "ggml's CPU does (closest to llama.cpp)")
    kv_types = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
    p.add_argument("--kv-type", choices=kv_types, default="f16", help="K and V cache type")
    p.add_argument("-c", "--ctx-size", type=_int_at_least(0, "--ctx-size"), default=0,
                   help="context size (0 = the prompt plus the steps, rounded up to a block)")
    p.add_argument("--block-len", type=_int_at_least(1, "--block-len"), default=32,
                   help="KV block length")
    p.add_argument("-t", "--threads", type=_int_at_least(0, "--threads"), default=0,
                   help="threads (0 = all cores)")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS token")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="only cpu can trace (the GPU forward has no taps)")
    sp = p.add_argument_group("sparse state (importance_, anchor_, block selections)")
    sp.add_argument("--sparse", action="store_true",
                    help="block-sparse decode attention, as pyimp-run --sparse")
    sp.add_argument("--anchor", choices=("fixed", "dynamic", "quest", "block_mean", "block_max",
                                         "cuboid_mean"), default="quest")
    sp.add_argument("--topk", type=_int_at_least(0, "--topk"), default=8)
    sp.add_argument("--init-blocks", type=_int_at_least(0, "--init-blocks"), default=1)
    sp.add_argument("--local-blocks", type=_int_at_least(0, "--local-blocks"), default=2)
    return p


def _keep(args):
    """The name filter of --layers / --tensors (None: keep everything)."""
    layers, globs = args.layers, args.tensors
    if layers is None and not globs:
        return None

    def keep(name: str) -> bool:
        if name.startswith("inp_tokens@"):
            return True                      # always: tools.llamacpp_trace --follow reads them
        parts = split_name(name)
        if layers is not None and parts is not None and parts[1] >= 0 and parts[1] not in layers:
            return False
        if globs:
            bare = unstepped(name)
            return any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(bare, g) for g in globs)
        return True
    return keep


def _tokenize(path: str, prompt: str, add_bos: bool) -> tuple[list, int]:
    """The prompt's token ids and the model's layer count, before an engine is sized for them."""
    from loaders.config import read_config
    from loaders.gguf_file import GGUFFile
    from loaders.tokenizer import Tokenizer

    f = GGUFFile(path)
    try:
        cfg = read_config(f)
        tok = Tokenizer.from_vocab(f.vocab(), model_name=cfg.name, architecture=cfg.arch)
        return tok.encode(prompt, add_special=add_bos, parse_special=False), cfg.n_layer
    finally:
        tok = None
        f.close()


def _error(msg: str) -> int:
    print(f"pyimp-dump: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def run(args: argparse.Namespace) -> int:
    from loaders.gguf_file import GGUFError

    from .cli import model_path, read_prompt
    from .default_model import DefaultModelError
    from .engine import Engine, EngineOptions
    from .memory import check_fits
    from .ops import NonFiniteError
    from .sparse_policy import SparseOptions

    if args.device != "cpu":
        return _error("--device cuda: a trace taps the CPU forward only (the GPU forward has no "
                      "taps); run pyimp-dump with --device cpu")
    out = args.output
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        return _error(f"-o {out}: is a directory, not a file name")
    if not os.path.isdir(folder):
        return _error(f"-o {out}: folder {folder} does not exist")
    try:
        prompt = read_prompt(args)
    except OSError as e:
        return _error(str(e))
    engine = None
    try:
        path = model_path(args)
        ids, n_layer = _tokenize(path, prompt, not args.no_bos)
        if not ids:
            return _error("the prompt is empty (give -p TEXT or -f FILE)")
        if args.layers is not None and max(args.layers) >= n_layer:
            return _error(f"--layers {max(args.layers)}: the model has layers 0..{n_layer - 1}")
        need = len(ids) + args.steps
        n_ctx = args.ctx_size or -(-need // args.block_len) * args.block_len
        if need > n_ctx:
            return _error(f"the prompt's {len(ids)} tokens and {args.steps} steps do not fit "
                          f"context size {n_ctx} (raise -c/--ctx-size)")
        sparse = SparseOptions(enabled=args.sparse, anchor=args.anchor, topk=args.topk,
                               init_blocks=args.init_blocks, local_blocks=args.local_blocks)
        # the engine's warnings (a context beyond the model's training) are shown only when
        # the dump goes ahead: a refusal is one line
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = Engine(path, EngineOptions(n_ctx=n_ctx, block_len=args.block_len,
                                                batch_size=max(512, len(ids)),
                                                n_threads=args.threads, numerics=args.numerics,
                                                kv_type=args.kv_type, sparse=sparse))
        keep = _keep(args)
        check_fits(estimate_bytes(engine, len(ids), args.steps, keep)
                   + sum(engine.buffer_bytes.values()),
                   f"--steps {args.steps}: the dump of {args.steps + 1} steps ({len(ids)} prompt "
                   f"tokens) with its KV cache",
                   "lower --steps, or write fewer tensors (--layers, --tensors)")
    except (GGUFError, DefaultModelError, ValueError, MemoryError) as e:
        if engine is not None:
            engine.close()
        return _error(str(e) if str(e) else "out of memory")
    for w in caught:
        print(f"pyimp-dump: warning: {w.message}", file=sys.stderr)
    try:
        tr = engine.trace(ids, steps=args.steps, keep=keep)
        if args.tensors and all(n.startswith("inp_tokens@") for n in tr.tensors):
            return _error(f"--tensors {' '.join(args.tensors)}: matches no tensor of this model "
                          f"(names look like l_out-0@0, Qcur-0#1@0, result_output@1; see "
                          f"pydoc pyimp.dump), nothing written")
        tr.meta["prompt"] = prompt
        tr.write(out)
    except (NonFiniteError, ValueError) as e:
        return _error(str(e))
    except OSError as e:
        return _error(f"cannot write {out}: {e.strerror or e}")
    finally:
        engine.close()
    toks = " ".join(str(t[0]) for t in tr.tokens[1:])
    print(f"pyimp-dump: {len(tr.tensors)} tensors of {args.steps + 1} steps ({len(ids)} prompt "
          f"tokens; decode fed {toks or 'nothing'}) -> {out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    from .runtime import configure_process
    configure_process()
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\npyimp-dump: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
