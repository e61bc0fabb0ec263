"""``pyimp-dump``: every named intermediate tensor of a greedy run, in a GGUF file.

:meth:`pyimp.engine.Engine.trace` runs a prompt (the prefill as one forward, then N greedy
decode steps) with a recorder on the forward's taps; :func:`write` stores what it recorded as
a GGUF file (``gguf.GGUFWriter``), so any GGUF reader opens it. ``tools/llamacpp_trace.py``
writes llama.cpp's own intermediates (its ``cb_eval`` callback) in the same format, and
``pyimp-compare`` (:mod:`pyimp.trace.compare`) pairs the two by name::

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
``pyimp.trace.dump.order``) is llama.cpp's emission order (read off real traces of both
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
producers. Metadata (``general.architecture`` is ``pyimp.trace.dump``)::

    pyimp.trace.dump.version            uint32  1
    pyimp.trace.dump.producer           string  "pyimp" or "llama.cpp"
    pyimp.trace.dump.model_fingerprint  string  GGUFFile.fingerprint() of the model
    pyimp.trace.dump.prompt             string  the prompt text ("" when token ids were given)
    pyimp.trace.dump.steps              uint32  decode steps run (the file has steps 0..steps)
    pyimp.trace.dump.numerics           string  pyimp: "fp32" / "ggml"; llama.cpp: "llama.cpp"
    pyimp.trace.dump.architecture       string  the model's architecture (llama, gemma3, ...)
    pyimp.trace.dump.kv_type            string  K/V cache types ("f16", "f32/f16", ...)
    pyimp.trace.dump.order              [string] tensor names in graph order

``--layers``, ``--tensors`` and ``--steps`` limit what is written: layer filters keep tensors
without a layer (embd, result_*); ``inp_tokens`` is always written; a ``--tensors`` glob (fnmatch, repeatable) matches
the full name or the name without its ``@s``. The prefill is one forward (one llama.cpp ubatch):
the batch size is raised to the prompt length. A trace is held in memory until it is written:
its size (:func:`estimate_bytes`, from the model's shapes, the filters and the steps) with the KV
cache is checked against the available memory (:mod:`pyimp.runtime.memory`) before the run, and a dump
that does not fit is refused with one line.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
import warnings

from ..capabilities import devices_with
# the recorder and the file format (pyimp.trace.record), re-exported under the names documented above
from .record import (FORMAT_ARCH, KEY, LAYER_ORDER, NOT_PRODUCED, POST, PRE, VERSION, Dump,
                     DumpError, Recorder, Trace, estimate_bytes, ggml_shape, read, run_trace,
                     split_name, unstepped, write)


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
    from .. import __version__
    from ..cli.common import (HelpFormatter, Parser, add_model_args, add_option_flags,
                              add_prompt_args, int_at_least)
    from ..options import EngineOptions, SparseOptions

    p = Parser(prog="pyimp-dump", formatter_class=HelpFormatter,
                description="Write every named intermediate tensor of a greedy run (prefill + "
                            "--steps decode steps) to a GGUF file, under llama.cpp's graph names "
                            "(see pyimp.trace.dump's documentation; compare with pyimp-compare).")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_model_args(p)
    add_prompt_args(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf", help="the dump to write")
    p.add_argument("--steps", type=int_at_least(0, "--steps"), default=4,
                   help="greedy decode steps after the prefill (0 = prefill only)")
    p.add_argument("--layers", type=_layers, default=None,
                   help="comma-separated layers whose tensors are written (tensors without a "
                        "layer are always written)")
    p.add_argument("--tensors", type=_glob, action="append", metavar="GLOB",
                   help="write only the tensors whose name (with or without its @step) matches "
                        "this fnmatch glob, e.g. 'l_out-*' or 'Qcur-0#2@0'; repeatable")
    # pyimp-run's flags of the same names; the context defaults to what the dump needs, the
    # devices are those that trace
    add_option_flags(p, EngineOptions, only=("numerics", "kv_type", "n_ctx", "block_len",
                                             "n_threads"), overrides={
        "numerics": {"help": "fp32: exact weights, fp32 activations; ggml: activations "
                             "quantized as ggml's CPU does (closest to llama.cpp)"},
        "kv_type": {"help": "K and V cache type"},
        "n_ctx": {"default": 0,
                  "help": "context size (0 = the prompt plus the steps, rounded up to a block)"}})
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS token")
    add_option_flags(p, EngineOptions, only=("device",), overrides={
        "device": {"choices": devices_with("trace"),
                   "help": "where the traced forward runs: the devices whose backend records "
                           "tensors (pyimp.capabilities)"}})
    sp = p.add_argument_group("sparse state (importance_, anchor_, block selections)")
    add_option_flags(sp, SparseOptions, only=("enabled", "anchor", "topk", "init_blocks",
                                              "local_blocks"), overrides={
        "enabled": {"help": "block-sparse decode attention, as pyimp-run --sparse"}})
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

    from ..cli.common import model_path, read_prompt
    from ..runtime.default_model import DefaultModelError
    from ..cli.common import options_from_args
    from ..engine import Engine
    from ..runtime.memory import check_fits
    from ..ops import NonFiniteError
    from ..options import EngineOptions

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
        # the engine's warnings (a context beyond the model's training) are shown only when
        # the dump goes ahead: a refusal is one line
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = Engine(path, options_from_args(EngineOptions, args, n_ctx=n_ctx,
                                                    batch_size=max(512, len(ids))))
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
                          f"pydoc pyimp.trace.dump), nothing written")
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
    from ..runtime.process import configure_process
    configure_process()
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\npyimp-dump: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
