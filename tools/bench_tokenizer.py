"""Tokenizer speed against llama.cpp (``llama_cpp.Llama(vocab_only=True)``) in the same run.

    python -m tools.bench_tokenizer [--model PATH] [--mb 1.0] [--bpe NAME ...]

Reports, for the model (default: the embedded Gemma 3 270M) and for llama.cpp's
BPE fixture vocabularies named with ``--bpe`` (default: llama-bpe):

* cold load: a fresh Python process imports the tokenizer, reads the GGUF
  vocabulary and encodes one word (so every lazily built table is ready);
  llama.cpp's vocab-only load in a fresh process for comparison;
* encode throughput on ``--mb`` MB of English prose (Python's own pydoc topics,
  repeated), first call and warm call, against llama.cpp on the same bytes, and
  whether the ids agree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COLD_OURS = """
import json, sys, time
t0 = time.perf_counter()
from loaders.tokenizer import Tokenizer
tok = Tokenizer.from_gguf(sys.argv[1])
tok.encode("Hello")
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

_COLD_LLAMA = """
import json, sys, time
t0 = time.perf_counter()
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
llm.tokenize(b"Hello", add_bos=True, special=False)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def english_text(n_bytes: int) -> str:
    """About ``n_bytes`` of English prose (ASCII-dominated), from pydoc's topic texts."""
    import pydoc_data.topics
    base = "\n\n".join(pydoc_data.topics.topics.values())
    text = base * (n_bytes // len(base) + 1)
    return text.encode()[:n_bytes].decode("utf-8", "ignore")


def cold(script: str, path: str) -> tuple[float, float]:
    """(seconds inside a fresh process from first import, wall seconds of the whole process)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script, path], cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "failed")
    return json.loads(r.stdout.strip().splitlines()[-1])["seconds"], wall


def bench(label: str, path: str, text: str) -> dict:
    from loaders.tokenizer import Tokenizer
    res = {"vocab": label}
    res["cold_ours_s"], res["cold_ours_wall_s"] = cold(_COLD_OURS, path)
    tok = Tokenizer.from_gguf(path)
    t0 = time.perf_counter()
    ids = tok.encode(text)
    res["encode_first_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok.encode(text)
    res["encode_warm_s"] = time.perf_counter() - t0
    res["n_tokens"] = len(ids)
    try:
        import llama_cpp
    except ImportError:
        return res
    res["cold_llama_s"], _ = cold(_COLD_LLAMA, path)
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    data = text.encode()
    t0 = time.perf_counter()
    ref = llm.tokenize(data, add_bos=True, special=False)
    res["encode_llama_s"] = time.perf_counter() - t0
    res["ids_equal"] = ref == ids
    llm.close()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Tokenizer speed against llama.cpp.")
    p.add_argument("--model", help="GGUF file (default: the embedded Gemma 3 270M)")
    p.add_argument("--mb", type=float, default=1.0, help="MB of English text to encode (default 1)")
    p.add_argument("--bpe", nargs="*", default=["llama-bpe"],
                   help="llama.cpp fixture vocabularies to bench as well (default: llama-bpe)")
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)

    runs = []
    if a.model:
        runs.append((os.path.basename(a.model), a.model))
    else:
        from pyimp.runtime.default_model import default_model_path
        runs.append(("gemma-3-270m", str(default_model_path())))
    if a.bpe:
        from tools.fetch_vocab_fixtures import fixtures_dir
        d = fixtures_dir()
        runs += [(name, str(d / f"ggml-vocab-{name}.gguf")) for name in a.bpe]

    text = english_text(int(a.mb * 1_000_000))
    mb = len(text.encode()) / 1e6
    print(f"text: {mb:.2f} MB of English prose")
    hdr = (f"{'vocab':<16}{'cold load':>10}{'(llama)':>9}{'encode 1st':>12}{'warm':>8}{'llama':>8}"
           f"{'speed vs llama':>16}{'MB/s':>7}  ids equal")
    print(hdr)
    for label, path in runs:
        r = bench(label, path, text)
        ll = r.get("encode_llama_s")
        ratio = f"{ll / r['encode_first_s']:.2f}x" if ll else "-"
        print(f"{label:<16}{r['cold_ours_s']:>9.2f}s{r.get('cold_llama_s', float('nan')):>8.2f}s"
              f"{r['encode_first_s']:>11.2f}s{r['encode_warm_s']:>7.2f}s"
              f"{(ll if ll else float('nan')):>7.2f}s{ratio:>16}{mb / r['encode_first_s']:>7.2f}  "
              f"{r.get('ids_equal', '-')}")
    print("cold load: fresh process, import + read vocabulary + first encode "
          "(wall time of the whole process adds interpreter start-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
