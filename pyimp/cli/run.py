"""``pyimp-run``: generate text with a GGUF model (default: the embedded Gemma 3 270M).

Streams the prompt and its continuation on stdout; the model summary,
warnings, errors and progress go to stderr (as llama-cli does), so
``pyimp-run ... > out.txt`` holds only the text. ``--stats`` adds timings at
the end (stderr), ``--json`` prints one JSON object instead of the text.
User mistakes end with a one-line message and a non-zero exit code.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
import warnings

from loaders.config import SUPPORTED_ARCHITECTURES

from ..capabilities import CAPABILITIES
from .common import (EXIT_ERROR, HelpFormatter, Parser, add_model_args, add_option_flags,
                     add_prompt_args, float_in, int_at_least, model_path, options_from_args,
                     quiet_stdout, read_prompt)
from ..options import EngineOptions, SparseOptions


def _non_empty(s: str) -> str:
    if not s:
        raise argparse.ArgumentTypeError("-r/--reverse-prompt: an empty string would stop at once")
    return s


def _heatmap_path(s: str) -> str:
    """--heatmap's argparse type: the format (the extension; none: PNG) must be one matplotlib
    writes; without matplotlib the path passes (run() reports the missing package)."""
    ext = os.path.splitext(s)[1][1:].lower()
    if not ext:
        return s
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return s
    formats = FigureCanvasAgg.get_supported_filetypes()
    if ext not in formats:
        raise argparse.ArgumentTypeError(
            f"--heatmap {s}: matplotlib cannot write '.{ext}' files (it writes "
            f"{', '.join(sorted(formats))}; no extension: png)")
    return s


def flag_conflict(args: argparse.Namespace) -> str | None:
    """A flag that the other flags would make pyimp-run ignore (None: none); a usage error."""
    given = getattr(args, "given", set())
    if args.kv_budget and args.kv_policy == "full":
        return (f"--kv-budget {args.kv_budget}: --kv-policy full keeps every token; the budget "
                f"applies to streaming, h2o, snapkv and pyramidkv")
    if not args.sparse:
        for dest, flag in (("topk", "--topk"), ("recall_target", "--recall-target")):
            if dest in given:
                return f"{flag} applies to --sparse (block-sparse attention), which is off"
    if args.prompt_cache_ro and not args.prompt_cache:
        return "--prompt-cache-ro applies to --prompt-cache FILE, which is not given"
    return None


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    p = Parser(prog="pyimp-run", formatter_class=HelpFormatter,
                description=f"Generate text with a GGUF model ({', '.join(SUPPORTED_ARCHITECTURES)}).")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_model_args(p)
    add_prompt_args(p)
    p.add_argument("-n", "--n-predict", type=int_at_least(-1, "--n-predict"), default=128,
                   help="tokens to generate (-1 = until end of text or context)")
    p.add_argument("--temp", type=float_in(0.0, 1e6, "--temp"), default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int_at_least(0, "--top-k"), default=40, help="top-k (0 = off)")
    p.add_argument("--top-p", type=float_in(0.0, 1.0, "--top-p"), default=0.95, help="top-p (1 = off)")
    p.add_argument("--min-p", type=float_in(0.0, 1.0, "--min-p"), default=0.05, help="min-p (0 = off)")
    p.add_argument("--repeat-penalty", type=float_in(1e-6, 1e6, "--repeat-penalty"), default=1.0,
                   help="repetition penalty over the last 64 tokens (1 = off)")
    p.add_argument("--seed", type=int_at_least(-1, "--seed"), default=-1, help="RNG seed (-1 = random)")
    add_option_flags(p, EngineOptions)
    p.add_argument("--prompt-cache", metavar="FILE",
                   help="reuse the longest matching prefix of the state saved in FILE, evaluate only "
                        "the rest, and save the state there after the run")
    p.add_argument("--prompt-cache-ro", action="store_true",
                   help="with --prompt-cache: use the file but do not update it")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS token")
    p.add_argument("--parse-special", action="store_true",
                   help="turn control-token text in the prompt, such as <start_of_turn>, into those tokens")
    p.add_argument("-sp", "--special", action="store_true",
                   help="print special tokens (e.g. <end_of_turn>) instead of hiding them")
    p.add_argument("-r", "--reverse-prompt", "--stop", dest="stop", action="append", metavar="STRING",
                   type=_non_empty,
                   help="stop once the generated text contains STRING (printed, as llama-cli does); repeatable")
    sp = p.add_argument_group("importance-guided sparse attention")
    add_option_flags(sp, SparseOptions)
    sp.add_argument("--heatmap", metavar="PATH", type=_heatmap_path,
                    help="write a picture of importance_ and block selections, in the format of "
                    "PATH's extension (png, svg, pdf, ...; none: png at exactly PATH; needs "
                    "matplotlib: pyimp[plot])")
    ev = p.add_argument_group("KV eviction (what each layer keeps; sliding-window layers always "
                              "keep only their window)")
    add_option_flags(ev, EngineOptions, group="eviction")
    p.add_argument("--stats", action="store_true", help="print timings at the end (stderr)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


class _Progress:
    """A progress bar on stderr, shown only once a prefill has run for ~2 s."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or done >= total and not self.shown:
            return
        if not self.shown and time.perf_counter() - self.t0 < 2.0:
            return
        self.shown = True
        width = 30
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\rprefill [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _summary(engine) -> str:
    cfg = engine.cfg
    info = engine.weights.summary()
    total = sum(info["bytes_by_type"].values())
    mix = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in
                    sorted(info["bytes_by_type"].items(), key=lambda kv: -kv[1]))
    n = info["n_params"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    from ..runtime.memory import fmt_bytes
    buf = engine.buffer_bytes
    mem = f"KV cache {fmt_bytes(buf['kv'])}" + \
        (f", importance + anchors {fmt_bytes(buf['sparse'])}" if buf["sparse"] else "")
    return (f"{cfg.arch} '{cfg.name}': {size} params, {cfg.n_layer} layers, quant mix {mix}; "
            f"context {engine.n_ctx} (trained {cfg.n_ctx_train}), kv {engine.options.type_k}/"
            f"{engine.options.type_v}{' rotated' if engine.options.kv_rotate else ''}, "
            f"numerics {engine.options.numerics}; {mem}"
            f"{' on the GPU' if engine.device == 'cuda' else ''}")


# seconds of warmup after which compiling (not loading kernels from Numba's cache) is announced
COMPILE_NOTICE_S = 1.0


@contextlib.contextmanager
def _compile_notice(err):
    """A progress line on stderr while the kernels compile: a first run (empty Numba cache)
    spends ~20 s there, a cached start well under a second. The line appears once the warmup
    has outlasted COMPILE_NOTICE_S and Numba has started compiling something (its
    ``numba:compile`` event, which a kernel loaded from the cache does not fire), and a second
    line gives the time once it ends."""
    from numba.core import event

    t0 = time.perf_counter()
    shown = threading.Event()
    compiled = threading.Event()
    lock = threading.Lock()

    def notice():
        with lock:
            if shown.is_set() or not compiled.is_set():
                return
            shown.set()
        print("pyimp-run: compiling kernels for this model's types (first run; cached for later "
              "runs) ...", file=err, flush=True)

    class Compiles(event.Listener):
        def on_start(self, ev):
            compiled.set()
            if time.perf_counter() - t0 >= COMPILE_NOTICE_S:
                notice()

        def on_end(self, ev):
            pass

    timer = threading.Timer(COMPILE_NOTICE_S, notice)
    timer.daemon = True
    try:
        with event.install_listener("numba:compile", Compiles()):
            timer.start()
            yield
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"pyimp-run: kernels ready after {time.perf_counter() - t0:.1f} s", file=err, flush=True)


def _error(msg: str) -> int:
    print(f"pyimp-run: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def _check_heatmap(path: str) -> str | None:
    """Why a heatmap cannot be written to ``path`` (None: it can), checked before the run."""
    try:
        import matplotlib  # noqa: F401  (imported here so that a broken install shows now too)
    except ImportError:
        return "--heatmap needs matplotlib: pip install 'pyimp[plot]'"
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--heatmap {path}: is a directory, not a file name"
    if not os.path.isdir(folder):
        return f"--heatmap {path}: folder {folder} does not exist"
    why = _cannot_create_in(folder)
    if why:
        return f"--heatmap {path}: cannot create a file in {folder} ({why})"
    return None


def _cannot_create_in(folder: str) -> str | None:
    """Why no file can be created in ``folder`` (None: one can), found by creating an unnamed
    (or at once removed) temporary file there: permissions, a read-only filesystem, a
    filesystem that refuses new files, for root too."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def _write_heatmap(engine, path: str) -> None:
    """The heatmap, in the format of ``path``'s extension (none: png), written to a temporary
    file beside ``path`` and renamed onto it: a failed write leaves no file and keeps an
    existing one."""
    import matplotlib

    from . import plotting

    fmt = os.path.splitext(path)[1][1:].lower() or "png"
    folder, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{base}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh, matplotlib.rc_context({"savefig.format": fmt}):
            plotting.sparse_heatmap(engine.sparse, fh, len(engine.tokens))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write(out, text: str) -> None:
    """Write ``text`` even where the stream's encoding cannot: the prompt's undecodable bytes
    (read with surrogateescape) go out as they came in; other characters are replaced."""
    try:
        out.write(text)
    except UnicodeEncodeError:
        enc = getattr(out, "encoding", None) or "utf-8"
        try:
            data = text.encode(enc, "surrogateescape")
        except UnicodeEncodeError:
            data = text.encode(enc, "replace")
        buf = getattr(out, "buffer", None)
        if buf is None:
            out.write(data.decode(enc, "replace"))
        else:
            out.flush()
            buf.write(data)
            buf.flush()


def _print_report(r: dict, sparse_on: bool, err) -> None:
    b = r.get("bytes", {})
    sizes = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in b.items())
    if not sparse_on:
        # no sparse layer ran: report only what was tracked (buffers), claim nothing else
        print(f"report: --sparse is off, every layer attended densely | buffers: {sizes}", file=err)
        return
    rec = "n/a" if r.get("mean_recall") is None else f"{r['mean_recall']:.4f}"
    if r.get("mean_estimated_recall") is not None:      # --recall-target: estimate beside it
        rec += f" (estimated {r['mean_estimated_recall']:.4f})"
    frac = "n/a" if r.get("mean_attended_fraction") is None else f"{r['mean_attended_fraction']:.3f}"
    print(f"sparse layers {r.get('sparse_layers')} | mean recall {rec} | attended fraction {frac} | "
          f"buffers: {sizes}", file=err)
    for il, v in r.get("layers", {}).items():
        if "recall_per_head" in v:
            print(f"  layer {il}: recall per head {v['recall_per_head']}", file=err)


def run(args: argparse.Namespace) -> int:
    from loaders.gguf_file import GGUFError

    from ..cuda import DeviceUnavailable
    from ..runtime.default_model import DefaultModelError
    from ..engine import Engine
    from ..kv.cache import ContextFullError
    from ..ops import NonFiniteError
    from ..sampling import SamplingParams

    if args.prompt_cache and not CAPABILITIES[args.device].prompt_cache:
        return _error("--prompt-cache needs the KV cache on the host: run it with --device cpu")
    if args.model and args.model_opt and args.model != args.model_opt:
        return _error(f"two models given ({args.model_opt} and {args.model}): use -m/--model or the "
                      f"first argument")
    if args.heatmap:
        why = _check_heatmap(args.heatmap)
        if why:
            return _error(why)
    if args.prompt_cache:
        why = _check_prompt_cache(args.prompt_cache, args.prompt_cache_ro)
        if why:
            return _error(why)
    try:
        prompt = read_prompt(args)
    except OSError as e:
        return _error(str(e))
    err = sys.stderr
    try:
        path = model_path(args)
        opts = options_from_args(EngineOptions, args, sparse=options_from_args(
            SparseOptions, args, track=args.heatmap is not None))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = Engine(path, opts)
    except (GGUFError, DefaultModelError, ValueError, MemoryError, DeviceUnavailable) as e:
        return _error(str(e) if str(e) else "out of memory")
    for w in caught:
        print(f"pyimp-run: warning: {w.message}", file=err)
    out = sys.stdout
    ids = engine.tokenize(prompt, add_bos=not args.no_bos, special=args.parse_special)
    if not ids:
        return _error("the prompt is empty (give -p TEXT or -f FILE)")
    if len(ids) >= engine.n_ctx:
        return _error(f"the prompt has {len(ids)} tokens, more than the context size {engine.n_ctx} "
                      f"allows (raise -c/--ctx-size)")
    cached = args.prompt_cache is not None and os.path.exists(args.prompt_cache)
    if cached:
        # the file's header against this engine's model and options, before anything compiles
        from ..kv.state import check as check_state
        from ..kv.statefile import StateFileError
        try:
            check_state(engine, args.prompt_cache)
        except (StateFileError, OSError) as e:
            return _error(_state_read_error(args.prompt_cache, e))
    if not args.json:
        print(_summary(engine), file=err, flush=True)
    try:
        with _compile_notice(err):
            engine.warmup(compile_helper=True)
    except NonFiniteError as e:
        return _error(str(e))
    reuse = False
    if cached:
        try:
            n_loaded = engine.load_state(args.prompt_cache)
        except (StateFileError, OSError) as e:
            return _error(_state_read_error(args.prompt_cache, e))
        reuse = True
        if not args.json:
            print(f"prompt cache {args.prompt_cache}: {n_loaded} tokens loaded", file=err)
    sampling = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, seed=args.seed)
    # control tokens (<eos>, <end_of_turn>) print as nothing unless --special, as in llama-cli
    # the generated text continues the prompt: its first piece keeps its leading space
    decoder = engine.tokenizer.incremental_decoder(skip_special=not args.special, continuation=True)
    eog = engine.eog_ids()
    tokens, logprobs = [], []
    if not args.json:
        _write(out, prompt)
        out.flush()
    finish = "length"
    try:
        for tok, lp in engine.generate(ids, max_tokens=args.n_predict, sampling=sampling, stop=args.stop,
                                       progress=_Progress(not args.json), reuse_prefix=reuse):
            tokens.append(tok)
            logprobs.append(lp)
            if tok in eog:
                finish = "stop"
                if not args.special:
                    continue
            piece = decoder.feed(tok)
            if piece and not args.json:
                _write(out, piece)
                out.flush()
    except (ContextFullError, NonFiniteError, ValueError) as e:
        if not args.json:
            out.write("\n")
            out.flush()
        return _error(str(e))
    tail = decoder.flush()
    text = engine.tokenizer.decode([t for t in tokens if args.special or t not in eog],
                                   skip_special=not args.special, continuation=True)
    if args.stop and any(s in text for s in args.stop):
        finish = "stop"
    timings = engine.timings.as_dict()
    if reuse:
        timings["prompt_cache_reused"] = engine.timings.extra.get("prefix_reused", 0)
        if engine.timings.extra.get("prefix_restarted") and not args.json:
            print(f"prompt cache {args.prompt_cache}: the prompt was processed again in full: the "
                  f"cache had dropped tokens its prefix needs (sliding-window layers keep only "
                  f"their window, --swa-full keeps them; --kv-policy and --kv-merge drop or "
                  f"merge tokens)", file=err)
    if engine.policy is not None:
        timings["kv_bytes_held"] = engine.cache.bytes_held()
        timings["kv_evicted"] = engine.policy.evicted
        timings["kv_merged"] = 0 if engine.merger is None else engine.merger.merged
    report = engine.sparse.report() if args.report and engine.sparse is not None else None
    try:
        if args.json:
            obj = {"prompt_tokens": ids, "tokens": tokens, "text": text, "logprobs": logprobs,
                   "finish_reason": finish, "timings": timings}
            if report is not None:
                obj["report"] = report
            json.dump(obj, out, ensure_ascii=False)
            out.write("\n")
            out.flush()
        else:
            _write(out, tail + "\n")
            out.flush()
            if report is not None:
                _print_report(report, args.sparse, err)
            if args.stats:
                t = timings
                if args.kv_policy != "full" or args.kv_merge:
                    print(f"kv cache: {t['kv_bytes_held'] / 2**20:.1f} MiB held at the end, "
                          f"{t['kv_evicted']} tokens evicted by --kv-policy {args.kv_policy}, "
                          f"{t['kv_merged']} merged by --kv-merge", file=err)
                print(f"load {t['load_s']:.2f} s | compile {t['compile_s']:.2f} s | prefill "
                      f"{t['prefill_tokens']} tok {t['prefill_tok_s']:.1f} tok/s | decode "
                      f"{t['decode_tokens']} tok {t['decode_tok_s']:.1f} tok/s", file=err)
    except BrokenPipeError:            # stdout closed early: the files are still written
        quiet_stdout()
    # the files after the output: one that cannot be written is reported, the output is kept
    failed = []
    if args.heatmap:
        try:
            _write_heatmap(engine, args.heatmap)
        except Exception as e:         # matplotlib's own errors as well as the disk's
            failed.append(f"cannot write heatmap {args.heatmap}: {_reason(e)}")
    if args.prompt_cache and not args.prompt_cache_ro:
        try:
            engine.save_state(args.prompt_cache)
        except OSError as e:
            failed.append(f"cannot write prompt cache {args.prompt_cache}: {_reason(e)}")
    engine.close()
    for msg in failed:
        _error(msg)
    return EXIT_ERROR if failed else 0


def _reason(e: BaseException) -> str:
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def _state_read_error(path: str, e: Exception) -> str:
    from ..kv.statefile import StateFileError
    if isinstance(e, StateFileError):
        return str(e)
    return f"cannot read prompt cache {path}: {_reason(e)}"


def _check_prompt_cache(path: str, read_only: bool) -> str | None:
    """Why --prompt-cache ``path`` cannot be used (None: it can), before anything loads: a
    directory, a missing file with --prompt-cache-ro, or (the state is saved there after the
    run) a folder that is missing or where no file can be created."""
    if os.path.isdir(path):
        return f"prompt cache {path}: is a directory"
    if read_only:
        if not os.path.exists(path):
            return f"prompt cache {path}: no such file (--prompt-cache-ro only reads it)"
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return (f"prompt cache {path}: directory {parent} does not exist (the state is saved "
                f"there after the run)")
    why = _cannot_create_in(parent)
    if why:
        return (f"prompt cache {path}: cannot create a file in {parent} ({why}; the state is "
                f"saved there after the run; --prompt-cache-ro only reads it)")
    return None


def main(argv=None) -> int:
    from ..runtime.process import configure_process, numba_env_error
    configure_process()   # before NumPy / Numba start threads
    parser = build_parser()
    args = parser.parse_args(argv)
    conflict = flag_conflict(args)
    if conflict:
        parser.error(conflict)
    bad = numba_env_error()
    if bad:
        return _error(bad)
    try:
        return run(args)
    except KeyboardInterrupt:
        # a second Ctrl-C now ends the process at once (default action), instead of landing
        # in the interpreter's shutdown as a traceback
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("\npyimp-run: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        quiet_stdout()
        return 0


if __name__ == "__main__":
    sys.exit(main())
