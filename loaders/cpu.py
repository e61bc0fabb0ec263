"""The host CPU's features as LLVM names them, read without importing Numba: a caller that
sets NUMBA_CPU_NAME / NUMBA_CPU_FEATURES for itself (``tools.bench --target``) must check the
host before Numba reads those variables at its import."""
from __future__ import annotations


def host_features() -> frozenset:
    """The host CPU's features as LLVM names them (empty where LLVM cannot tell)."""
    from llvmlite import binding as llb
    try:
        return frozenset(k for k, v in llb.get_host_cpu_features().items() if v)
    except RuntimeError:
        return frozenset()
