"""``pyimp-run``: generate text with a GGUF model (default: the embedded Gemma 3 270M).

Prints a one-line model summary, then streams the prompt's continuation;
``--stats`` adds timings at the end, ``--json`` prints one JSON object
instead. User mistakes end with a one-line message and a non-zero exit code.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

EXIT_USAGE = 2
EXIT_ERROR = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _int_at_least(lo: int, name: str):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be >= {lo}, got {v}")
        return v
    return conv


def _float_in(lo: float, hi: float, name: str):
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if not (lo <= v <= hi):
            raise argparse.ArgumentTypeError(f"{name} must be in [{lo}, {hi}], got {s}")
        return v
    return conv


def _window(s: str) -> int:
    if s == "all":
        return 0
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"--importance-window must be a positive integer or 'all', got {s!r}")
    return v


def _int_list(s: str) -> tuple:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dense-layers must be comma-separated integers, got {s!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pyimp-run", description="Generate text with a GGUF model (llama, gemma3).")
    p.add_argument("model", nargs="?", help="GGUF model file (default: embedded Gemma 3 270M Q4_K_M)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument("-n", "--n-predict", type=_int_at_least(-1, "--n-predict"), default=128,
                   help="tokens to generate (-1 = until end of text or context)")
    p.add_argument("--temp", type=_float_in(0.0, 1e6, "--temp"), default=0.8, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=_int_at_least(0, "--top-k"), default=40, help="top-k (0 = off)")
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, "--top-p"), default=0.95, help="top-p (1 = off)")
    p.add_argument("--min-p", type=_float_in(0.0, 1.0, "--min-p"), default=0.05, help="min-p (0 = off)")
    p.add_argument("--repeat-penalty", type=_float_in(1e-6, 1e6, "--repeat-penalty"), default=1.0,
                   help="repetition penalty over the last 64 tokens (1 = off)")
    p.add_argument("--seed", type=_int_at_least(-1, "--seed"), default=-1, help="RNG seed (-1 = random)")
    p.add_argument("-c", "--ctx-size", type=_int_at_least(0, "--ctx-size"), default=4096,
                   help="context size in tokens (0 = the model's)")
    p.add_argument("--block-len", type=_int_at_least(1, "--block-len"), default=32, help="KV block length")
    p.add_argument("-b", "--batch-size", type=_int_at_least(1, "--batch-size"), default=512,
                   help="prefill chunk size")
    p.add_argument("-t", "--threads", type=_int_at_least(0, "--threads"), default=0,
                   help="threads (0 = all cores)")
    p.add_argument("--numerics", choices=("fp32", "ggml"), default="fp32",
                   help="fp32: exact weights, fp32 activations; ggml: activations quantized as ggml's CPU does")
    p.add_argument("--kv-type", choices=("f16", "f32"), default="f16", help="KV cache element type")
    p.add_argument("--no-bos", action="store_true", help="do not add the BOS token")
    sp = p.add_argument_group("importance-guided sparse attention")
    sp.add_argument("--sparse", action="store_true", help="block-sparse decode attention on global layers")
    sp.add_argument("--anchor", choices=("fixed", "dynamic", "quest", "block_mean", "block_max", "cuboid_mean"),
                    default="quest", help="anchor type used to score blocks")
    sp.add_argument("--anchor-num", type=_int_at_least(0, "--anchor-num"), default=0,
                    help="anchors per block (0 = the type's minimum)")
    sp.add_argument("--retrieval", choices=("layer", "kvhead", "qhead"), default="kvhead",
                    help="selection granularity")
    sp.add_argument("--topk", type=_int_at_least(0, "--topk"), default=8, help="blocks picked by score")
    sp.add_argument("--init-blocks", type=_int_at_least(0, "--init-blocks"), default=1,
                    help="attention-sink blocks always attended")
    sp.add_argument("--local-blocks", type=_int_at_least(0, "--local-blocks"), default=2,
                    help="most recent full blocks always attended")
    sp.add_argument("--importance-window", type=_window, default=128,
                    help="prompt rows that add importance at prefill (an integer or 'all')")
    sp.add_argument("--token-step", type=_int_at_least(1, "--token-step"), default=1,
                    help="reuse a block selection for this many decode steps")
    sp.add_argument("--layer-step", type=_int_at_least(1, "--layer-step"), default=1,
                    help="reuse a lead layer's selection for this many sparse layers")
    sp.add_argument("--dense-layers", type=_int_list, default=(), help="comma-separated layers kept dense")
    sp.add_argument("--report", action="store_true",
                    help="print attention recall, attended fraction and buffer sizes (also in --json)")
    sp.add_argument("--heatmap", metavar="PATH", help="write a PNG of importance_ and block selections")
    p.add_argument("--stats", action="store_true", help="print timings at the end")
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
    return (f"{cfg.arch} '{cfg.name}': {size} params, {cfg.n_layer} layers, quant mix {mix}; "
            f"context {engine.n_ctx} (trained {cfg.n_ctx_train}), kv {engine.options.kv_type}, "
            f"numerics {engine.options.numerics}")


def run(args: argparse.Namespace) -> int:
    from loaders.gguf_file import GGUFError

    from .default_model import DefaultModelError, default_model_path
    from .engine import Engine, EngineOptions
    from .kvcache import ContextFullError
    from .sampling import SamplingParams
    from .sparse_policy import SparseOptions

    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8", errors="surrogateescape") as fh:
                prompt = fh.read()
        except OSError as e:
            print(f"pyimp-run: error: cannot read prompt file {args.file}: {e.strerror}", file=sys.stderr)
            return EXIT_ERROR
    else:
        prompt = args.prompt if args.prompt is not None else ""
    try:
        path = args.model or default_model_path()
        sparse = SparseOptions(enabled=args.sparse, anchor=args.anchor, anchor_num=args.anchor_num,
                               retrieval=args.retrieval, topk=args.topk, init_blocks=args.init_blocks,
                               local_blocks=args.local_blocks, importance_window=args.importance_window,
                               token_step=args.token_step, layer_step=args.layer_step,
                               dense_layers=args.dense_layers, report=args.report,
                               track=args.heatmap is not None)
        engine = Engine(path, EngineOptions(n_ctx=args.ctx_size, block_len=args.block_len,
                                            batch_size=args.batch_size, n_threads=args.threads,
                                            numerics=args.numerics, kv_type=args.kv_type, sparse=sparse))
    except (GGUFError, DefaultModelError, ValueError) as e:
        print(f"pyimp-run: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    out = sys.stdout
    if not args.json:
        print(_summary(engine), file=out, flush=True)
    ids = engine.tokenize(prompt, add_bos=not args.no_bos)
    if not ids:
        print("pyimp-run: error: the prompt is empty (give -p TEXT or -f FILE)", file=sys.stderr)
        return EXIT_ERROR
    if len(ids) >= engine.n_ctx:
        print(f"pyimp-run: error: the prompt has {len(ids)} tokens, more than the context size "
              f"{engine.n_ctx} allows (raise -c/--ctx-size)", file=sys.stderr)
        return EXIT_ERROR
    engine.warmup()
    sampling = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repeat_penalty=args.repeat_penalty, seed=args.seed)
    decoder = engine.tokenizer.incremental_decoder()
    tokens, logprobs = [], []
    if not args.json:
        out.write(prompt)
        out.flush()
    try:
        for tok, lp in engine.generate(ids, max_tokens=args.n_predict, sampling=sampling,
                                       progress=_Progress(not args.json)):
            tokens.append(tok)
            logprobs.append(lp)
            piece = decoder.feed(tok)
            if piece and not args.json:
                out.write(piece)
                out.flush()
    except (ContextFullError, ValueError) as e:
        print(f"\npyimp-run: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    tail = decoder.flush()
    timings = engine.timings.as_dict()
    report = engine.sparse.report() if args.report else None
    if args.heatmap:
        try:
            engine.sparse.heatmap(args.heatmap, len(engine.tokens))
        except (RuntimeError, OSError) as e:
            print(f"pyimp-run: error: cannot write heatmap {args.heatmap}: {e}", file=sys.stderr)
            return EXIT_ERROR
    if args.json:
        obj = {"prompt_tokens": ids, "tokens": tokens, "text": engine.detokenize(tokens),
               "logprobs": logprobs, "timings": timings}
        if report is not None:
            obj["report"] = report
        json.dump(obj, out, ensure_ascii=False)
        out.write("\n")
    else:
        out.write(tail + "\n")
        if report is not None:
            r = report
            rec = "n/a" if r["mean_recall"] is None else f"{r['mean_recall']:.4f}"
            frac = "n/a" if r["mean_attended_fraction"] is None else f"{r['mean_attended_fraction']:.3f}"
            b = r["bytes"]
            print(f"sparse layers {r['sparse_layers']} | mean recall {rec} | attended fraction {frac} | "
                  f"KV {b['kv'] / 2**20:.1f} MiB, importance {b['importance'] / 2**20:.2f} MiB, "
                  f"anchors {b['anchors'] / 2**20:.2f} MiB", file=out)
            for il, v in r["layers"].items():
                if "recall_per_head" in v:
                    print(f"  layer {il}: recall per head {v['recall_per_head']}", file=out)
        if args.stats:
            t = timings
            print(f"load {t['load_s']:.2f} s | compile {t['compile_s']:.2f} s | prefill "
                  f"{t['prefill_tokens']} tok {t['prefill_tok_s']:.1f} tok/s | decode {t['decode_tokens']} tok "
                  f"{t['decode_tok_s']:.1f} tok/s", file=out)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\npyimp-run: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
