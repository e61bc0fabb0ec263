"""pyimp-compare: metrics, divergence injection, one-sided and mismatched tensors, bad inputs;
pyimp against llama.cpp's trace of the same synthetic llama model."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from pyimp.trace import compare, dump
from pyimp.engine import Engine, EngineOptions
from tools.write_synthetic_gguf import SynthSpec, write

needs_peer = pytest.mark.usefixtures("peer")   # probed once in a subprocess (conftest.py)

PROMPT = [1, 17, 42, 99, 5, 250, 31, 77, 3, 128]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    return write(d / "llama.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=256, n_head=4,
                                             n_head_kv=2, n_ff=512, vocab_size=512,
                                             weight_type="F32", seed=1))


@pytest.fixture(scope="module")
def pyimp_dump(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("cmpd") / "a.gguf"
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8, kv_type="f32", numerics="ggml"))
    eng.trace(PROMPT, steps=3).write(out)
    eng.close()
    return out


def _copy(src, dst, change=None, drop=()):
    """Rewrite dump src as dst with change {name: fn(array) -> array} applied, names dropped."""
    d = dump.read(src)
    tensors = {n: np.array(d.tensor(n)) for n in d.order if n not in drop}
    for n, fn in (change or {}).items():
        tensors[n] = fn(tensors[n])
    meta = {k: v for k, v in d.meta.items() if k not in ("order", "version")}
    dump.write(dst, tensors, meta)
    return dst


def _run(capsys, *argv):
    rc = compare.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_metrics():
    a = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    m = compare.metrics(a, a)
    assert m["nmse"] == 0 and m["max_abs"] == 0 and m["cos"] == pytest.approx(1.0)
    b = a + np.array([0, 0, 0, 0.5], np.float32)
    m = compare.metrics(a, b)
    assert m["nmse"] == pytest.approx(0.25 / 30)
    assert m["max_abs"] == pytest.approx(0.5) and m["max_rel"] == pytest.approx(0.125)
    assert m["cos"] == pytest.approx(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))
    assert compare.metrics(a, -a)["cos"] == pytest.approx(-1.0)
    assert math.isinf(compare.metrics(a, np.array([1, 2, 3, np.nan], np.float32))["nmse"])
    assert compare.metrics(np.zeros(3), np.zeros(3))["nmse"] == 0


def test_identical_copy_no_divergence(pyimp_dump, tmp_path, capsys):
    b = _copy(pyimp_dump, tmp_path / "b.gguf")
    rc, out, err = _run(capsys, pyimp_dump, b)
    assert rc == 0 and not err
    assert "no divergence" in out and "diverged" not in out
    rc, out, _ = _run(capsys, pyimp_dump, b, "--json")
    res = json.loads(out)
    assert res["first_divergence"] is None and res["paired"] == len(dump.read(pyimp_dump).order)
    assert res["same_model"] and not res["only_in_a"] and not res["only_in_b"]


@pytest.mark.parametrize("target", ["ffn_out-1@0", "Kcur-0#2@2", "result_output@3"])
def test_injected_divergence_is_first(pyimp_dump, tmp_path, capsys, target):
    """Perturb exactly one tensor: compare names it (the tensors after it are copies, equal)."""
    rng = np.random.default_rng(0)
    b = _copy(pyimp_dump, tmp_path / "b.gguf",
              change={target: lambda x: x + 0.05 * np.std(x) * rng.standard_normal(x.shape)
                      .astype(np.float32)})
    rc, out, _ = _run(capsys, pyimp_dump, b, "--json")
    res = json.loads(out)
    f = res["first_divergence"]
    assert rc == 0 and f["name"] == target
    assert 1e-4 < f["nmse"] < 1e-2 and f["cos"] < 1
    assert [r["name"] for r in res["tensors"] if r["status"] == "diverged"] == [target]
    # below the flag's threshold it is no divergence
    rc, out, _ = _run(capsys, pyimp_dump, b, "--nmse", "0.1")
    assert "no divergence" in out
    rc, out, _ = _run(capsys, pyimp_dump, b)
    assert f"first divergence (A's graph order, nmse > 0.0001): {target} nmse" in out


def test_tokens_compared_exactly(pyimp_dump, tmp_path, capsys):
    b = _copy(pyimp_dump, tmp_path / "b.gguf", change={"inp_tokens@2": lambda x: x + 1})
    _, out, _ = _run(capsys, pyimp_dump, b, "--json")
    res = json.loads(out)
    row = next(r for r in res["tensors"] if r["name"] == "inp_tokens@2")
    assert row["status"] == "differ" and row["differing"] == 1
    assert res["first_divergence"]["name"] == "inp_tokens@2"


def test_one_sided_and_shape_mismatch(pyimp_dump, tmp_path, capsys):
    b = _copy(pyimp_dump, tmp_path / "b.gguf", drop=("kqv-0@0", "kqv-1@0"),
              change={"ffn_up-0@1": lambda x: np.concatenate([x, x])})
    rc, out, _ = _run(capsys, pyimp_dump, b)
    assert rc == 0
    assert "only in A (2, not compared): kqv (2)" in out
    assert "shape mismatches (1): ffn_up-0@1" in out
    assert "ffn_up-0@1" in out and "shape mismatch: B has 1024" in out
    # a shape mismatch is where the dumps diverge
    assert "first divergence (A's graph order): ffn_up-0@1: shape mismatch (A 512, B 1024)" in out
    rc, out, _ = _run(capsys, b, pyimp_dump, "--json")
    res = json.loads(out)
    assert res["only_in_b"] == ["kqv-0@0", "kqv-1@0"] and res["shape_mismatch"] == ["ffn_up-0@1"]


@pytest.mark.parametrize("other", [PROMPT[:7], PROMPT[:4] + [18] + PROMPT[5:]],
                         ids=["shorter", "one token changed"])
def test_dumps_of_different_prompts_are_flagged(llama, pyimp_dump, tmp_path, capsys, other):
    """Dumps of two prompts: a warning that the inputs differ (as for two models), and the
    first divergence is the first tensor that differs in shape or values, inp_tokens@0, not a
    later tensor whose shapes happen to agree (the last layer's one-row tensors)."""
    b = tmp_path / "other.gguf"
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8, kv_type="f32", numerics="ggml"))
    eng.trace(other, steps=3).write(b)
    eng.close()
    rc, out, _ = _run(capsys, pyimp_dump, b)
    assert rc == 0
    assert "WARNING: the dumps are of different inputs" in out
    assert "different models" not in out
    first = next(ln for ln in out.splitlines() if ln.startswith("first divergence"))
    assert "inp_tokens@0" in first, first
    if len(other) != len(PROMPT):
        assert "shape mismatch" in first and "A 10, B 7" in first, first
    rc, out, _ = _run(capsys, pyimp_dump, b, "--json")
    res = json.loads(out)
    assert res["same_model"] and not res["same_input"]
    assert res["first_divergence"]["name"] == "inp_tokens@0"
    # the same prompt: no warning
    rc, out, _ = _run(capsys, pyimp_dump, _copy(pyimp_dump, tmp_path / "same.gguf"))
    assert "WARNING" not in out


def test_bad_inputs_one_line(pyimp_dump, llama, tmp_path, capsys):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(1).bytes(4000))
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(pyimp_dump.read_bytes()[:3000])
    for bad, needle in ((tmp_path / "missing.gguf", "no such file"),
                        (garbage, "not a readable GGUF file"),
                        (trunc, "not a readable GGUF file"),
                        (llama, "not a tensor dump"),
                        (tmp_path, "is a directory")):
        for argv in ((pyimp_dump, bad), (bad, pyimp_dump)):
            rc, out, err = _run(capsys, *argv)
            assert rc == 1 and not out
            assert err.startswith(f"pyimp-compare: error: {bad}") and needle in err
            assert len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        compare.main([str(pyimp_dump), str(pyimp_dump), "--nmse", "-1"])
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_console_script_module(pyimp_dump):
    r = subprocess.run([sys.executable, "-m", "pyimp.trace.compare", str(pyimp_dump), str(pyimp_dump),
                        "--diverged-only"], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "no divergence" in r.stdout
    assert len(r.stdout.splitlines()) < 8              # the header and the summary only


# pyimp (ggml numerics, F32 cache) and llama.cpp (F32 cache, flash attention off) on an F32
# synthetic llama: only float32 summation order differs; measured at most 3.2e-7 NMSE over
# every tensor of 2 layers and 4 steps (attention and the feed-forward's sums)
NMSE_BOUND = 1e-5


@pytest.mark.slow
@needs_peer
def test_pyimp_vs_llamacpp_trace(llama, pyimp_dump, tmp_path, capsys):
    out = tmp_path / "llama.gguf"
    r = subprocess.run([sys.executable, "-m", "tools.llamacpp_trace", str(llama), "--follow",
                        str(pyimp_dump), "--kv-type", "f32", "-o", str(out)],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    b = dump.read(out)
    assert b.meta["producer"] == "llama.cpp" and b.meta["steps"] == 3
    _, text, _ = _run(capsys, pyimp_dump, out, "--json")
    res = json.loads(text)
    assert res["same_model"]
    assert not res["shape_mismatch"] and not res["only_in_a"]
    # llama.cpp's names pyimp leaves out, exactly
    assert {dump.split_name(n)[0] for n in res["only_in_b"]} == set(dump.NOT_PRODUCED)
    a = dump.read(pyimp_dump)
    assert res["paired"] == len(a.order)
    worst = max(r["nmse"] for r in res["tensors"] if "nmse" in r)
    assert worst < NMSE_BOUND, res["worst"]
    assert all(r["status"] == "equal" for r in res["tensors"] if "differing" in r)
    # llama.cpp's emission order of the paired names is pyimp's order
    assert [n for n in b.order if n in a] == a.order
