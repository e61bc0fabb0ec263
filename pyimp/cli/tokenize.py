"""``pyimp-tokenize``: print the token ids of a text, like llama.cpp's ``llama-tokenize``.

    pyimp-tokenize MODEL.gguf -p "Hello world"          # one line per token: id -> 'piece'
    pyimp-tokenize -m MODEL.gguf -f prompt.txt --ids    # [2, 9259, 1902]
    pyimp-tokenize -p "<start_of_turn>user"             # the default model (Gemma 3 270M)

Control-token text such as ``<start_of_turn>`` becomes those tokens unless
``--no-parse-special`` is given, as with llama-tokenize.

Escape sequences (\\n, \\r, \\t, \\', \\", \\\\, \\xHH) in the text are processed
unless ``--no-escape`` is given, for ``-p`` and ``-f`` alike, as llama-tokenize
does. Only the vocabulary is read; no engine code (and no Numba) is imported.
"""
from __future__ import annotations

import argparse
import sys

PROG = "pyimp-tokenize"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def process_escapes(data: bytes) -> bytes:
    """llama.cpp's string_process_escapes on bytes."""
    out = bytearray()
    i, n = 0, len(data)
    simple = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("'"): 39, ord('"'): 34, ord("\\"): 92}
    while i < n:
        c = data[i]
        if c == 0x5C and i + 1 < n:
            i += 1
            e = data[i]
            if e in simple:
                out.append(simple[e])
            elif e == ord("x") and i + 2 < n and all(chr(h) in "0123456789abcdefABCDEF" for h in data[i + 1:i + 3]):
                out.append(int(data[i + 1:i + 3], 16))
                i += 2
            else:
                out += bytes([0x5C, e])
        else:
            out.append(c)
        i += 1
    return bytes(out)


def _piece_text(piece: bytes) -> tuple[str, bool]:
    try:
        return piece.decode("utf-8"), True
    except UnicodeDecodeError:
        return "<" + " ".join(f"{b:02x}" for b in piece) + ">", False


def main(argv: list[str] | None = None) -> int:
    from . import common as cli_common
    from .common import PromptTooLarge, read_capped
    from ..runtime.process import configure_process
    configure_process()
    p = _Parser(prog=PROG, description="Print the token ids of a text for a GGUF vocabulary "
                                       "(same ids as llama.cpp's llama-tokenize).")
    p.add_argument("model", metavar="MODEL.gguf", nargs="?",
                   help="GGUF model or vocab-only file (default: the embedded Gemma 3 270M)")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL.gguf",
                   help="the same, as llama-tokenize's -m")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="text to tokenize")
    limit = f"at most {cli_common.MAX_PROMPT_BYTES >> 20} MiB"
    src.add_argument("-f", "--file", help=f"read the text from this file (bytes as they are; {limit})")
    src.add_argument("--stdin", action="store_true", help=f"read the text from standard input ({limit})")
    p.add_argument("--ids", action="store_true", help="print only the ids, as a list")
    sp = p.add_mutually_exclusive_group()
    sp.add_argument("--parse-special", dest="parse_special", action="store_true", default=True,
                    help="turn control-token text such as <start_of_turn> into those tokens (the default)")
    sp.add_argument("--no-parse-special", dest="parse_special", action="store_false",
                    help="tokenize control-token text as plain text")
    p.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS even where the model asks for them")
    p.add_argument("--no-escape", action="store_true", help="take backslashes in the text literally")
    p.add_argument("--show-count", action="store_true", help="print the number of tokens at the end")
    a = p.parse_args(argv)

    def fail(msg: str):
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        raise SystemExit(1)

    if a.prompt is None and a.file is None and not a.stdin:
        p.error("one of -p/--prompt, -f/--file or --stdin is required")
    if a.model and a.model_opt and a.model != a.model_opt:
        p.error(f"two models given ({a.model_opt} and {a.model}): use -m/--model or the first argument")
    model = a.model_opt or a.model
    if model is None:
        from ..runtime.default_model import DefaultModelError, default_model_path
        try:
            model = str(default_model_path())
        except DefaultModelError as e:
            fail(str(e))
    if a.prompt is not None:
        try:
            text = a.prompt.encode("utf-8", "surrogateescape")  # undecodable argv bytes come back as they were
        except UnicodeEncodeError:
            text = a.prompt.encode("utf-8", "surrogatepass")
    elif a.file is not None:
        try:
            with open(a.file, "rb") as f:
                text = read_capped(f, a.file)
        except PromptTooLarge as e:
            fail(str(e))
        except OSError as e:
            fail(f"cannot read {a.file}: {e.strerror or e}")
    else:
        try:
            text = read_capped(sys.stdin.buffer, "standard input")
        except PromptTooLarge as e:
            fail(str(e))
        except OSError as e:
            fail(f"cannot read standard input: {e.strerror or e}")
    if not a.no_escape:
        text = process_escapes(text)

    from loaders.gguf_file import GGUFError
    from loaders.tokenizer import Tokenizer, TokenizerError
    try:
        tok = Tokenizer.from_gguf(model)
        ids = tok.encode(text, add_special=tok.add_bos and not a.no_bos, parse_special=a.parse_special)
    except (GGUFError, TokenizerError) as e:
        fail(str(e))

    lines = []
    if a.ids:
        lines.append("[" + ", ".join(str(i) for i in ids) + "]")
    else:
        for i in ids:
            s, ok = _piece_text(tok.token_to_bytes(i))
            lines.append(f"{i:6d} -> '{s}'" + ("" if ok else " (utf-8 decode failure)"))
    if a.show_count:
        lines.append(f"Total number of tokens: {len(ids)}")
    try:
        out = sys.stdout
        out.write("".join(line + "\n" for line in lines))
        out.flush()
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
        raise SystemExit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
