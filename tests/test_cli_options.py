"""The flags of pyimp-run and pyimp-dump come from the option dataclasses' field metadata
(pyimp.options.opt): every field is a flag or named here as one without, every option flag of
pyimp-run is a field, and a command line's values come back in the options built from it."""
import argparse
import dataclasses

import pytest

from pyimp.cli import run as cli
from pyimp.trace import dump
from pyimp.cli.common import Parser, add_option_flags, flag_dest, option_flags, options_from_args
from pyimp.options import EngineOptions, SparseOptions

# the fields that are not flags (set by the Python API, or by pyimp-run from other flags;
# second_window serves the evaluation tools)
FLAGLESS = {EngineOptions: {"v_layout", "sparse"},
            SparseOptions: {"decay", "track", "second_window"}}
# pyimp-run's flags that are not options of the engine (dests)
COMMAND_ONLY = {"help", "version", "model_opt", "prompt", "file", "n_predict", "temp", "top_k",
                "top_p", "min_p", "repeat_penalty", "seed", "prompt_cache", "prompt_cache_ro",
                "no_bos", "parse_special", "special", "stop", "heatmap", "stats", "json"}
# values with a syntax of their own: (text, value)
SPECIAL = {"importance_window": ("all", 0), "dense_layers": ("1,3", (1, 3))}


def _fields_without_flag(cls) -> set:
    flagged = {f.name for f in option_flags(cls)}
    return {f.name for f in dataclasses.fields(cls)} - flagged - FLAGLESS.get(cls, set())


def _value(f: dataclasses.Field):
    """A command line for field ``f`` with a value other than its default, and that value."""
    m, flag = f.metadata, f.metadata["flag"]
    if f.name in SPECIAL:
        text, value = SPECIAL[f.name]
        return [flag, text], value
    if isinstance(f.default, bool):
        return [flag], True
    if m["choices"] is not None:
        value = [c for c in m["choices"] if c != f.default][-1]
        return [m["short"] or flag, value], value
    if isinstance(f.default, float):
        value = (m["min"] + m["max"]) / 2 if m["max"] is not None else m["min"] + 1.5
        return [flag, repr(value)], value
    return [m["short"] or flag, str(f.default + 3)], f.default + 3


def _round_trip(cls, parser: argparse.ArgumentParser) -> None:
    """Every field of ``cls`` is a flag of ``parser`` (or FLAGLESS), and a non-default value of
    each flag comes back in the options built from the parsed arguments."""
    missing = _fields_without_flag(cls)
    assert not missing, f"{cls.__name__} fields without a flag: {sorted(missing)}"
    argv, want = [], {}
    for f in option_flags(cls):
        words, want[f.name] = _value(f)
        argv += words
    args = parser.parse_args(argv)
    got = options_from_args(cls, args)
    for name, value in want.items():
        assert getattr(got, name) == value, (name, getattr(got, name), value)
    # and no flag given: the dataclass's defaults
    assert options_from_args(cls, parser.parse_args([])) == cls()


def test_every_field_is_a_flag_or_named_flagless():
    for cls in (EngineOptions, SparseOptions):
        assert not _fields_without_flag(cls)
        for f in option_flags(cls):
            assert f.metadata["flag"].startswith("--") and "help" in f.metadata


def test_every_option_flag_of_pyimp_run_is_a_field():
    fields = {flag_dest(f.metadata["flag"]): f for cls in (EngineOptions, SparseOptions)
              for f in option_flags(cls)}
    actions = {a.dest: a for a in cli.build_parser()._actions if a.option_strings}
    for dest, a in actions.items():
        if dest in COMMAND_ONLY:
            continue
        assert dest in fields, f"{a.option_strings}: neither a field's flag nor a command flag"
        m = fields[dest].metadata
        assert a.option_strings == [s for s in (m["short"], m["flag"]) if s]
        assert a.help == m["help"] and a.default == fields[dest].default
        assert a.choices == m["choices"]
    assert set(fields) <= set(actions), "a field's flag is missing from pyimp-run"


def test_pyimp_run_flags_round_trip():
    argv, want = [], {}
    for cls in (EngineOptions, SparseOptions):
        for f in option_flags(cls):
            words, want[f.name] = _value(f)
            argv += words
    args = cli.build_parser().parse_args(argv)
    opts = options_from_args(EngineOptions, args, sparse=options_from_args(
        SparseOptions, args, track=args.heatmap is not None))
    for name, value in want.items():
        got = getattr(opts.sparse if name in SparseOptions.__dataclass_fields__ else opts, name)
        assert got == value, (name, got, value)
    assert not opts.sparse.track
    args = cli.build_parser().parse_args([])
    assert options_from_args(EngineOptions, args) == EngineOptions()


@pytest.mark.parametrize("cls", [EngineOptions, SparseOptions])
def test_round_trip_per_class(cls):
    p = Parser(prog="t")
    add_option_flags(p, cls)
    if cls is EngineOptions:
        add_option_flags(p, cls, group="eviction")
    _round_trip(cls, p)


def _without_flag(cls, name: str):
    """``cls`` with the metadata of field ``name`` removed (a plain default)."""
    spec = []
    for f in dataclasses.fields(cls):
        if f.name == name:
            spec.append((f.name, f.type, dataclasses.field(default=f.default)))
        elif f.default_factory is not dataclasses.MISSING:
            spec.append((f.name, f.type, dataclasses.field(default_factory=f.default_factory)))
        else:
            spec.append((f.name, f.type, dataclasses.field(default=f.default,
                                                           metadata=f.metadata)))
    return dataclasses.make_dataclass(cls.__name__, spec)


@pytest.mark.parametrize("cls,name", [(c, f.name) for c in (EngineOptions, SparseOptions)
                                      for f in option_flags(c)])
def test_a_field_without_its_metadata_fails_the_round_trip(cls, name):
    stripped = _without_flag(cls, name)
    p = Parser(prog="t")
    add_option_flags(p, stripped)
    add_option_flags(p, stripped, group="eviction")
    FLAGLESS[stripped] = FLAGLESS[cls]
    try:
        with pytest.raises(AssertionError, match=name):
            _round_trip(stripped, p)
    finally:
        del FLAGLESS[stripped]


def test_pyimp_dump_flags_round_trip():
    args = dump.build_parser().parse_args(
        ["-o", "x.gguf", "--numerics", "ggml", "--kv-type", "q8_0", "-c", "64", "--block-len",
         "16", "-t", "2", "--sparse", "--anchor", "cuboid_mean", "--topk", "3",
         "--init-blocks", "0", "--local-blocks", "4"])
    opts = options_from_args(EngineOptions, args, batch_size=600)
    assert (opts.numerics, opts.kv_type, opts.n_ctx, opts.block_len, opts.n_threads,
            opts.batch_size, opts.device) == ("ggml", "q8_0", 64, 16, 2, 600, "cpu")
    sp = opts.sparse
    assert (sp.enabled, sp.anchor, sp.topk, sp.init_blocks, sp.local_blocks) == \
        (True, "cuboid_mean", 3, 0, 4)
    # the flags pyimp-dump does not have keep the defaults; its context defaults to 0
    defaults = options_from_args(EngineOptions, dump.build_parser().parse_args(["-o", "x"]))
    assert defaults == dataclasses.replace(EngineOptions(), n_ctx=0)


def test_options_from_args_refuses_an_unknown_field():
    with pytest.raises(TypeError, match="no field 'ctx_size'"):
        options_from_args(EngineOptions, argparse.Namespace(), ctx_size=3)


@pytest.mark.parametrize("argv,needle", [
    (["--importance-window", "0"], "--importance-window must be a positive integer or 'all', "
                                   "got '0'"),
    (["--dense-layers", "1,x"], "--dense-layers must be comma-separated integers, got '1,x'"),
    (["--kv-merge", "2"], "--kv-merge must be in [0.0, 1.0], got 2"),
    (["--kv-depth-ratio", "0.5"], "--kv-depth-ratio must be a finite number >= 1.0, got 0.5"),
    (["--topk", "-1"], "--topk must be >= 0, got -1"),
    (["-ctk", "q4"], "invalid choice: 'q4'"),
])
def test_bad_values_are_one_line_errors(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count("\n") == 1
