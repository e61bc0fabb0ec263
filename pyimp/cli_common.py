"""What pyimp's commands share: argument parsing (one-line usage errors, defaults in the
help), the model argument, the prompt file reader and its size limit, exit codes.

``pyimp-run`` (:mod:`pyimp.cli`), ``pyimp-dump`` (:mod:`pyimp.dump`), ``pyimp-compare`` and
``pyimp-tokenize`` import these; this module imports none of them, nor the engine.
"""
from __future__ import annotations

import argparse
import io
import os
import stat
import sys

EXIT_USAGE = 2
EXIT_ERROR = 1


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit code :data:`EXIT_USAGE`)."""

    def error(self, message: str):  # one line, no usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if "%(default)" in h or d is None or d is False or d == () or d == argparse.SUPPRESS \
                or not action.option_strings:
            return h
        return h + " (default: %(default)s)"


def int_at_least(lo: int, name: str):
    """An argparse type: an integer >= lo (``name``: the flag, in messages)."""
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be >= {lo}, got {v}")
        return v
    return conv


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model as first argument or -m/--model (pyimp-run, pyimp-dump); see :func:`model_path`."""
    p.add_argument("model", nargs="?", help="GGUF model file (default: embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL",
                   help="GGUF model file, as llama-cli's -m (or give it as the first argument)")


def model_path(args: argparse.Namespace) -> str:
    """The model :func:`add_model_args` parsed, or the embedded default model's path (written to
    the cache on first use). Raises ValueError for two different models, and
    :class:`pyimp.default_model.DefaultModelError` when the default model cannot be provided."""
    if args.model and args.model_opt and args.model != args.model_opt:
        raise ValueError(f"two models given ({args.model_opt} and {args.model}): use -m/--model "
                         f"or the first argument")
    model = args.model_opt or args.model
    if model:
        return model
    from .default_model import default_model_path
    return str(default_model_path())


def quiet_stdout() -> None:
    """After a BrokenPipeError (stdout closed early, e.g. piped into head): point stdout at
    /dev/null so the process exits quietly, without a flush error at exit."""
    try:
        sys.stdout = open(os.devnull, "w")
    except OSError:
        pass


# the most bytes of prompt text -f / --stdin read (pyimp-run, pyimp-dump, pyimp-tokenize): far
# more than any model's context holds, and a bound on what an endless input (/dev/zero, a pipe
# that never closes) can take before it is refused
MAX_PROMPT_BYTES = 64 << 20


class PromptTooLarge(OSError):
    """An input holds more than :data:`MAX_PROMPT_BYTES`; the message names it and the limit."""


def read_capped(fh, name: str) -> bytes:
    """The bytes of the binary stream ``fh`` (called ``name`` in messages), at most
    :data:`MAX_PROMPT_BYTES` of them: a regular file over the limit is refused by its size,
    any other stream after reading one byte more than the limit (PromptTooLarge)."""
    from .memory import fmt_bytes
    cap = MAX_PROMPT_BYTES
    too_large = PromptTooLarge(f"{name}: more than the {fmt_bytes(cap)} a prompt may have "
                               f"({cap} bytes)")
    try:
        st = os.fstat(fh.fileno())
    except (OSError, AttributeError, ValueError):
        st = None
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_size > cap:
        raise too_large
    data = fh.read(cap + 1)
    if len(data) > cap:
        raise too_large
    return data


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt of ``-p TEXT`` or ``-f FILE`` ("" when neither is given), a file read as
    UTF-8 text (undecodable bytes kept as surrogates, newlines translated) of at most
    :data:`MAX_PROMPT_BYTES`; a file that cannot be read or is larger raises OSError with a
    message naming it."""
    if getattr(args, "file", None) is None:
        return args.prompt if args.prompt is not None else ""
    try:
        with open(args.file, "rb") as fh:
            data = read_capped(fh, f"prompt file {args.file}")
    except PromptTooLarge:
        raise
    except OSError as e:
        raise OSError(f"cannot read prompt file {args.file}: {e.strerror}") from None
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape").read()
