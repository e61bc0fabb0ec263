"""pyimp-dump / Engine.trace: names per layer and step, ggml shapes, metadata, values, filters."""
from __future__ import annotations

import fnmatch
import os

import gguf
import numpy as np
import pytest

from pyimp.trace import dump
from pyimp.engine import Engine, EngineOptions
from tools.write_synthetic_gguf import SynthSpec, write

PROMPT = [1, 17, 42, 99, 5, 250, 31, 77, 3, 128]
STEPS = 3

SPECS = {
    "llama": SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                       vocab_size=300, weight_type="F32", seed=3),
    "gemma3": SynthSpec(arch="gemma3", n_layer=3, n_embd=64, n_head=2, n_head_kv=1, head_dim=32,
                        n_ff=128, vocab_size=300, weight_type="F32", sliding_window=4,
                        swa_pattern=3, final_softcap=30.0, rms_eps=1e-6, seed=4),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump_models")
    return {arch: write(d / f"{arch}.gguf", spec) for arch, spec in SPECS.items()}


def _engine(path, **kw) -> Engine:
    kw.setdefault("n_ctx", 64)
    kw.setdefault("block_len", 4)
    kw.setdefault("kv_type", "f32")
    return Engine(path, EngineOptions(**kw))


def _expected(arch: str, n_layer: int, steps: int) -> list:
    names = []
    for s in range(steps + 1):
        pre = [p for p in dump.PRE if arch == "gemma3" or p != "inp_scaled"]
        names += [f"{p}@{s}" for p in pre]
        for il in range(n_layer):
            for n in dump.LAYER_ORDER[arch]:
                if n in ("Qcur#3", "Kcur#3", "Vcur#2", "kqv_wo"):       # biases only
                    continue
                base, _, k = n.partition("#")
                names.append(f"{base}-{il}" + (f"#{k}" if k else "") + f"@{s}")
        names += [f"{p}@{s}" for p in dump.POST]
    return names


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dump_file_names_shapes_metadata(models, arch, tmp_path):
    path = models[arch]
    eng = _engine(path)
    tr = eng.trace(PROMPT, steps=STEPS)
    out = tmp_path / "d.gguf"
    tr.write(out)
    cfg = eng.cfg
    r = gguf.GGUFReader(out)                       # any GGUF reader opens it
    names = [t.name for t in r.tensors]
    assert names == _expected(arch, cfg.n_layer, STEPS)
    f = {k: v.contents() for k, v in r.fields.items()}
    assert f["pyimp.trace.dump.version"] == 1
    assert f["pyimp.trace.dump.producer"] == "pyimp"
    assert f["pyimp.trace.dump.model_fingerprint"] == eng.file.fingerprint()
    assert f["pyimp.trace.dump.steps"] == STEPS
    assert f["pyimp.trace.dump.numerics"] == "fp32"
    assert f["pyimp.trace.dump.architecture"] == arch
    assert f["pyimp.trace.dump.order"] == names
    T, E, Hq, Hkv, D = len(PROMPT), cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim
    t = {x.name: x for x in r.tensors}
    # ggml order: ne is NumPy's shape reversed, trailing ones dropped
    assert list(t["attn_norm-0@0"].shape) == [E, T]
    assert list(t["Qcur-0@0"].shape) == [Hq * D, T]
    assert list(t["Qcur-0#1@0"].shape) == [D, Hq, T]
    assert list(t["Kcur-0#2@0"].shape) == [D, Hkv, T]
    assert list(t["kqv-0@0"].shape) == [D, T, Hq]
    assert list(t["l_out-0@0"].shape) == [E, T]
    last = cfg.n_layer - 1
    assert list(t[f"l_out-{last}@0"].shape) == [E]            # the output row only
    assert list(t[f"kqv_out-{last}@0"].shape) == [Hq * D, T]
    assert list(t["result_output@0"].shape) == [cfg.n_vocab]
    assert list(t["attn_norm-0@1"].shape) == [E]              # a decode step's one row
    assert t["inp_tokens@0"].tensor_type == gguf.GGMLQuantizationType.I32
    if arch == "gemma3":
        assert list(t[f"attn_post_norm-{last}@0"].shape) == [E]
    eng.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_dump_values_equal_the_engine(models, arch, tmp_path):
    path = models[arch]
    eng = _engine(path)
    tr = eng.trace(PROMPT, steps=STEPS)
    tr.write(tmp_path / "d.gguf")
    d = dump.read(tmp_path / "d.gguf")
    # the same tokens through eval, step by step
    ref = _engine(path)
    feed = PROMPT
    for s in range(STEPS + 1):
        assert d.tensor(f"inp_tokens@{s}").tolist() == feed
        logits = ref.eval(feed)
        np.testing.assert_array_equal(d.tensor(f"result_output@{s}").ravel(), logits.ravel())
        np.testing.assert_array_equal(tr.logits[s], logits[-1])
        feed = [int(np.argmax(logits[-1]))]
    assert tr.tokens[0] == PROMPT and [t[0] for t in tr.tokens[1:]] == \
        [int(np.argmax(x)) for x in tr.logits[:-1]]
    # the embedding rows, the projections' reshape, what a layer hands the next
    w = ref.weights
    np.testing.assert_array_equal(d.tensor("embd@0"), w.embed(np.array(PROMPT), scaled=False))
    np.testing.assert_array_equal(d.tensor("Qcur-0#1@0").reshape(len(PROMPT), -1),
                                  d.tensor("Qcur-0@0"))
    np.testing.assert_array_equal(d.tensor("kqv-0@0").transpose(1, 0, 2).reshape(len(PROMPT), -1),
                                  d.tensor("kqv_out-0@0"))
    from pyimp import ops
    np.testing.assert_array_equal(d.tensor("attn_norm-1@0"),
                                  ops.rms_norm(d.tensor("l_out-0@0"), w.layers[1].attn_norm,
                                               ref.cfg.rms_eps))
    if arch == "gemma3":
        np.testing.assert_array_equal(d.tensor("inp_scaled@0"),
                                      w.embed(np.array(PROMPT)))
    # the trace leaves the engine as an eval of the same tokens does
    assert eng.tokens == ref.tokens
    eng.close()
    ref.close()


def test_trace_costs_nothing_when_off(models):
    """Without a trace the forward's tap is the no-op; the logits equal a traced run's."""
    eng = _engine(models["llama"])
    from pyimp.engine import _no_tap
    assert eng._tap is _no_tap
    a = eng.eval(PROMPT)
    tr = eng.trace(PROMPT, steps=0)
    assert eng._tap is _no_tap
    np.testing.assert_array_equal(a[-1], tr.logits[0])


def test_sparse_tensors(models, tmp_path):
    path = models["llama"]
    eng = _engine(path, block_len=2, sparse=dump_sparse())
    prompt = PROMPT * 3
    tr = eng.trace(prompt, steps=2)
    names = list(tr.tensors)
    cfg = eng.cfg
    for s in range(3):
        for il in range(cfg.n_layer):
            imp = tr.tensors[f"importance_-{il}@{s}"]
            n = len(prompt) + s                     # tokens cached after step s
            assert imp.dtype == np.float16 and imp.shape == (-(-n // 2), 2, cfg.n_head)
            assert f"anchor_-{il}@{s}" in tr.tensors
    assert any(fnmatch.fnmatch(n, "sel-*@1") for n in names)
    sel = [n for n in names if n.startswith("sel-")]
    for n in sel:
        assert tr.tensors[n].dtype == np.int32
        assert tr.tensors[n.replace("sel-", "cnt-")].dtype == np.int32
    # pyimp-only tensors come after the graph's in each step
    step1 = [n for n in names if n.endswith("@1")]
    assert step1.index("result_output@1") < step1.index("importance_-0@1")
    tr.write(tmp_path / "s.gguf")
    assert dump.read(tmp_path / "s.gguf").tensor("importance_-0@0").dtype == np.float16


def dump_sparse():
    from pyimp.sparse.policy import SparseOptions
    return SparseOptions(enabled=True, topk=1, init_blocks=1, local_blocks=1)


def test_cli_filters(models, tmp_path, capsys):
    path = models["gemma3"]
    out = tmp_path / "f.gguf"
    assert dump.main([path, "-p", "hello there", "--steps", "1", "--layers", "1",
                      "--tensors", "l_out-*", "--tensors", "Qcur-1#2@0", "--tensors", "embd",
                      "-o", str(out)]) == 0
    d = dump.read(out)
    assert d.names == ["inp_tokens@0", "embd@0", "Qcur-1#2@0", "l_out-1@0",
                       "inp_tokens@1", "embd@1", "l_out-1@1"]
    assert d.meta["prompt"] == "hello there" and d.meta["steps"] == 1
    assert dump.main([path, "-p", "hello", "--steps", "0", "-o", str(out)]) == 0
    d = dump.read(out)
    assert {dump.split_name(n)[3] for n in d.names} == {0}
    assert "pyimp-dump:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, code, needle", [
    (["--steps", "-1"], 2, "--steps must be >= 0"),
    (["--layers", "x"], 2, "--layers must be"),
    (["--layers", "7"], 1, "--layers 7: the model has layers 0..2"),
    (["--tensors", ""], 2, "empty glob"),
    (["--tensors", "l_outt-*"], 1, "--tensors l_outt-*: matches no tensor"),
    (["--device", "cuda"], 2, "invalid choice: 'cuda' (choose from 'cpu')"),
    (["-p", "", "--no-bos"], 1, "the prompt is empty"),
])
def test_cli_errors(models, tmp_path, capsys, argv, code, needle):
    args = [models["gemma3"], "-o", str(tmp_path / "x.gguf")]
    if "-p" not in argv:
        args += ["-p", "hi"]
    with pytest.raises(SystemExit) if code == 2 else _nullctx() as e:
        rc = dump.main(args + argv)
    rc = e.value.code if code == 2 else rc
    err = capsys.readouterr().err
    assert rc == code
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.gguf").exists()


def test_cli_bad_model_and_output(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope" * 100)
    assert dump.main([str(bad), "-p", "hi", "-o", str(tmp_path / "x.gguf")]) == 1
    assert dump.main([str(tmp_path / "missing.gguf"), "-p", "hi", "-o", str(tmp_path / "x.gguf")]) == 1
    assert dump.main([str(bad), "-p", "hi", "-o", str(tmp_path / "no" / "x.gguf")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(ln.startswith("pyimp-dump: error:") for ln in lines)


def test_trace_refuses(models):
    eng = _engine(models["llama"], batch_size=4)
    with pytest.raises(ValueError, match="batch size"):
        eng.trace(PROMPT)
    eng = _engine(models["llama"], n_ctx=12)
    with pytest.raises(ValueError, match="do not fit"):
        eng.trace(PROMPT, steps=4)
    with pytest.raises(ValueError, match="steps"):
        eng.trace(PROMPT, steps=-1)


class _nullctx:
    value = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _trace_bytes(tr) -> int:
    return sum(a.nbytes for a in tr.tensors.values()) + sum(x.nbytes for x in tr.logits)


@pytest.mark.parametrize("arch, sparse, layers, globs", [
    ("llama", False, None, None),
    ("gemma3", False, None, None),
    ("llama", True, None, None),
    ("gemma3", False, frozenset({1}), ["l_out-*", "Qcur-1#2@0", "embd"]),
    ("llama", True, None, ["importance_-*"]),
])
def test_dump_size_estimate_bounds_the_trace(models, arch, sparse, layers, globs):
    """estimate_bytes, the memory a trace will hold, computed before it runs: never below what
    the trace records, and close to it (within 10 %: only the sparse selections are bounded above)."""
    import argparse
    eng = _engine(models[arch], block_len=2, **({"sparse": dump_sparse()} if sparse else {}))
    keep = dump._keep(argparse.Namespace(layers=layers, tensors=globs))
    prompt = PROMPT * 2
    est = dump.estimate_bytes(eng, len(prompt), 5, keep)
    got = _trace_bytes(eng.trace(prompt, steps=5, keep=keep))
    assert got <= est <= 1.1 * got + 4096, (got, est)


def test_dump_larger_than_memory_is_refused_before_the_run(models, tmp_path, capsys, monkeypatch):
    """--steps whose dump cannot fit in the available memory: one line naming --steps, the
    size and the memory, before any step runs, and no output file."""
    from pyimp.engine import Engine
    path = models["llama"]
    out = tmp_path / "big.gguf"
    monkeypatch.setenv("PYIMP_MEMORY_LIMIT", "16M")
    ran = []
    real = Engine.trace
    monkeypatch.setattr(Engine, "trace", lambda self, *a, **k: ran.append(1) or real(self, *a, **k))
    # 3000 steps: past the model's training context (2048) too, whose warning is not shown
    rc = dump.main([path, "-p", "hello", "--steps", "3000", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and not ran and not out.exists(), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("pyimp-dump: error: --steps 3000: the dump")
    assert "more than the 16.0 MiB of memory available" in err
    assert os.listdir(tmp_path) == []
    # the same steps of one layer's l_out fit
    assert dump.main([path, "-p", "hello", "--steps", "2000", "--tensors", "l_out-0",
                      "-o", str(out)]) == 0
    assert ran and out.exists()
