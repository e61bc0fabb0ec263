"""loaders.ggml_types' own constant tables (what pyimp uses where ``gguf`` is missing, as on the
GPU machine) against gguf's, member by member."""
from __future__ import annotations

import gguf

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
