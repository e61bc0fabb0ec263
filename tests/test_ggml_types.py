"""loaders.ggml_types' own constant tables (what pyimp uses where ``gguf`` is missing, as on the
GPU machine) against gguf's, member by member, and pyimp working with gguf unimportable."""
from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np

from conftest import ROOT
from loaders import ggml_types


def test_own_quant_types_equal_gguf():
    qt, sizes, _ = ggml_types.own_constants()
    assert len(qt) == len(ggml_types.OWN_QUANT_TYPES)         # no name given twice
    for member in qt:
        theirs = gguf.GGMLQuantizationType[member.name]
        assert int(member) == int(theirs), member.name
        assert sizes[member] == tuple(gguf.GGML_QUANT_SIZES[theirs]), member.name


def test_own_value_types_equal_gguf():
    _, _, vt = ggml_types.own_constants()
    assert {m.name: int(m) for m in vt} == {m.name: int(m) for m in gguf.GGUFValueType}


def test_own_table_covers_what_pyimp_names():
    """Every type pyimp loads, every activation type its kernels convert to, and every type the
    KV cache stores is in the own table (else pyimp without gguf would fail on it)."""
    from loaders.quants import KERNELS
    from pyimp.kv.cache import QUANT_TYPES
    qt, _, _ = ggml_types.own_constants()
    names = {m.name for m in qt}
    needed = ({t.name for t in ggml_types.SUPPORTED_TYPES} | {k.act_type.name for k in KERNELS.values()}
              | {t.name for t in QUANT_TYPES.values()} | {t.name for t in ggml_types.FP16_FIELDS})
    assert needed <= names, needed - names


def test_constants_come_from_gguf_where_it_is_installed():
    assert ggml_types.FROM_GGUF
    assert ggml_types.GGMLQuantizationType is gguf.GGMLQuantizationType


# run with gguf and yaml made unimportable: the constants, the reader, the writer of synthetic
# models, a CPU engine with f32 and q8_0 KV and the device check's module must all work
_BLOCKED = r"""
import sys
sys.modules["gguf"] = None
sys.modules["yaml"] = None
sys.path.insert(0, {root!r})
from loaders import ggml_types
assert not ggml_types.FROM_GGUF
assert ggml_types.QT.Q8_0 == 8 and ggml_types.block_size(ggml_types.QT.Q4_K) == 256
import pyimp, pyimp.model, pyimp.kv.cache, pyimp.testing.reference, pyimp.testing.strategies
import loaders.gguf_file, loaders.quants, tools.device_check
from loaders.gguf_file import GGUFFile
from tools.write_synthetic_gguf import SynthSpec, prompt_ids, write
path = write({path!r}, SynthSpec(n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=64,
                                  vocab_size=300, weight_type="Q8_0", embd_type="Q4_0"))
with GGUFFile(path) as f:
    assert f.metadata["llama.block_count"] == 1
    assert f.tensors["token_embd.weight"].qtype == ggml_types.QT.Q4_0
for kv in ("f32", "q8_0"):
    eng = pyimp.load(path, n_ctx=80, block_len=32, kv_type=kv)
    logits = eng.eval(prompt_ids(40))
    print(kv, float(logits[-1].sum()))
"""


def test_pyimp_without_gguf(tmp_path):
    """The same model's logits with gguf blocked equal those with gguf installed (the own
    tables and quantizers give the same file and the same numbers)."""
    code = _BLOCKED.format(root=ROOT, path=str(tmp_path / "m.gguf"))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    got = dict(line.split() for line in r.stdout.strip().splitlines())
    import pyimp
    from tools.write_synthetic_gguf import SynthSpec, prompt_ids, write
    path = write(tmp_path / "with_gguf.gguf", SynthSpec(
        n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=64, vocab_size=300, weight_type="Q8_0",
        embd_type="Q4_0"))
    assert (tmp_path / "with_gguf.gguf").read_bytes() == (tmp_path / "m.gguf").read_bytes()
    for kv in ("f32", "q8_0"):
        eng = pyimp.load(path, n_ctx=80, block_len=32, kv_type=kv)
        want = float(eng.eval(prompt_ids(40))[-1].sum())
        # the same computation in two processes: equal to float64 print precision
        assert np.isclose(float(got[kv]), want, rtol=0, atol=0), (kv, got[kv], want)
