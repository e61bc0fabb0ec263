"""What pyimp's commands share: argument parsing (one-line usage errors, defaults in the
help), the flags of the option dataclasses (from their fields' metadata, :mod:`pyimp.options`)
and the options built back from them, the model argument, the prompt file reader and its size
limit, exit codes.

``pyimp-run`` (:mod:`pyimp.cli.run`), ``pyimp-dump`` (:mod:`pyimp.trace.dump`), ``pyimp-compare`` and
``pyimp-tokenize`` import these; this module imports none of them, nor the engine.
"""
from __future__ import annotations

import argparse
import dataclasses
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


def float_in(lo: float, hi: float, name: str):
    """An argparse type: a float in [lo, hi] (hi = inf: any finite number >= lo)."""
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if not (lo <= v <= hi) or v == float("inf"):       # NaN fails the comparison too
            what = f"a finite number >= {lo}" if hi == float("inf") else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{name} must be {what}, got {s}")
        return v
    return conv


def _parsed_by(parse, name: str):
    """An argparse type from an option's ``parse`` function: its ValueError's rule becomes the
    one-line usage error ``NAME <rule>, got 'TEXT'``."""
    def conv(s: str):
        try:
            return parse(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{name} {e}, got {s!r}") from None
    return conv


class Noted(argparse.Action):
    """Stores the value as argparse's default action does and notes that the flag was given
    (the set ``args.given`` of dests), for flags that conflict with others when given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = set(getattr(namespace, "given", ())) | {self.dest}


class NotedSwitch(Noted):
    """A switch (store_true) that notes it was given, as :class:`Noted`."""

    def __init__(self, option_strings, dest, default=False, required=False, help=None):
        super().__init__(option_strings, dest, nargs=0, const=True, default=default,
                         required=required, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, True, option_string)


def flag_dest(flag: str) -> str:
    """The argparse dest of a long flag: ``--kv-type`` -> ``kv_type``."""
    return flag.lstrip("-").replace("-", "_")


def option_flags(cls) -> list:
    """The fields of the option dataclass ``cls`` that are command-line flags (their metadata
    has a ``flag``: :func:`pyimp.options.opt`), in field order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag")]


def add_option_flags(p, cls, group: str | None = None, only: tuple | None = None,
                     overrides: dict | None = None) -> None:
    """Add the flags of the option dataclass ``cls`` to the parser or argument group ``p``,
    each as its field's metadata describes it (:func:`pyimp.options.opt`): the flags of
    ``group`` (None: those without one), or the fields named in ``only`` in that order.
    ``overrides``: per field name, metadata a command states differently (pyimp-dump's
    context size default, the devices it traces on). Every flag notes that it was given
    (``args.given``, :class:`Noted`)."""
    fields = {f.name: f for f in option_flags(cls)}
    names = only if only is not None else [n for n, f in fields.items()
                                           if f.metadata.get("group") == group]
    for name in names:
        f = fields[name]
        m = {**f.metadata, **(overrides or {}).get(name, {})}
        default = m.get("default", f.default)
        flag = m["flag"]
        strings = [m["short"], flag] if m.get("short") else [flag]
        kw = {"dest": flag_dest(flag), "default": default, "help": m.get("help")}
        if m.get("metavar"):
            kw["metavar"] = m["metavar"]
        if isinstance(default, bool):
            p.add_argument(*strings, action=NotedSwitch, **kw)
            continue
        if m.get("choices") is not None:
            kw["choices"] = m["choices"]
        elif m.get("parse") is not None:
            kw["type"] = _parsed_by(m["parse"], flag)
        elif isinstance(default, float):
            lo, hi = m.get("min"), m.get("max")
            kw["type"] = float_in(-float("inf") if lo is None else lo,
                                  float("inf") if hi is None else hi, flag)
        elif isinstance(default, int):
            kw["type"] = int if m.get("min") is None else int_at_least(m["min"], flag)
        p.add_argument(*strings, action=Noted, **kw)


def options_from_args(cls, args: argparse.Namespace, **given):
    """The option dataclass ``cls`` from parsed arguments: each field whose flag was added
    (:func:`add_option_flags`) takes the flag's value, a field of a nested option dataclass
    (EngineOptions.sparse) is built the same way, and ``given`` (field name: value) sets
    fields directly; the rest keep their defaults."""
    values = vars(args)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {unknown[0]!r}")
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kw[f.name] = given[f.name]
        elif f.metadata.get("flag") and flag_dest(f.metadata["flag"]) in values:
            kw[f.name] = values[flag_dest(f.metadata["flag"])]
        elif dataclasses.is_dataclass(f.default_factory):
            kw[f.name] = options_from_args(f.default_factory, args)
    return cls(**kw)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model as first argument or -m/--model (pyimp-run, pyimp-dump); see :func:`model_path`."""
    p.add_argument("model", nargs="?", help="GGUF model file (default: embedded Gemma 3 270M Q4_K_M)")
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL",
                   help="GGUF model file, as llama-cli's -m (or give it as the first argument)")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """-p/--prompt or -f/--file, one of them (pyimp-run, pyimp-dump); see :func:`read_prompt`."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file",
                     help=f"read the prompt from this file (at most {MAX_PROMPT_BYTES >> 20} MiB)")


def model_path(args: argparse.Namespace) -> str:
    """The model :func:`add_model_args` parsed, or the embedded default model's path (written to
    the cache on first use). Raises ValueError for two different models, and
    :class:`pyimp.runtime.default_model.DefaultModelError` when the default model cannot be provided."""
    if args.model and args.model_opt and args.model != args.model_opt:
        raise ValueError(f"two models given ({args.model_opt} and {args.model}): use -m/--model "
                         f"or the first argument")
    model = args.model_opt or args.model
    if model:
        return model
    from ..runtime.default_model import default_model_path
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
    from ..runtime.memory import fmt_bytes
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
