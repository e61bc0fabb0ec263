"""pyimp as a reference oracle: NumPy references, hypothesis strategies, a conformance suite.

Another backend (a GPU kernel, a port in another language behind a Python binding, a
rewrite) is checked against pyimp by exporting, from one module, the functions of the
interface below under these names, and running::

    python -m pyimp.testing --backend my_package.my_backend

which prints a pass / fail table (``--json`` for a machine-readable one) and exits 1 if any
check fails. The same suite is importable (:func:`run_suite`), e.g. from a pytest test.

The interface (signatures, shapes and dtypes in :mod:`pyimp.testing.reference`, which also
holds each function's reference implementation):

================================  ==========================================================
``dequantize(qtype, raw, n)``     ggml blocks ``uint8[rows, row_bytes]`` -> float32[rows, n]
``matvec(qtype, raw, n, x)``      W @ x, float32[rows]
``attention_decode(...)``         one query over the paged cache; writes out, returns lse
``attention_prefill(...)``        prompt rows over the paged cache, optional importance
``sparse_attention_decode(...)``  one query over selected blocks, importance of those tokens
``importance_update(...)``        in place: fp16(decay*old + new), round to nearest even
``compute_anchors(...)``          in place: the six anchor types, per query head
``block_scores(...)``             sum_d max_a anchor*q per block and query head
``select_blocks(...)``            sinks + best + local + tail, ties to the lower block
``retrieve_blocks(...)``          scores summed per set (layer/kvhead/qhead), then select
================================  ==========================================================

Conventions every function follows:

- argument order as in :mod:`pyimp.testing.reference`; arrays are NumPy, C-contiguous;
  outputs named ``out``, ``importance`` or ``anchor`` are written in place, others returned;
- fp16 buffers (``k_cache``/``v_cache`` when fp16, ``importance``, ``anchor``) arrive as
  float16 arrays, or as their uint16 views if the module sets ``FP16 = "uint16"`` (Numba
  cannot take float16); float32 caches arrive as float32;
- layouts: ``k_cache [Hkv][NB][B*D]`` token-major, ``v_cache [Hkv][NB][D*B]`` transposed,
  ``block_table int32 [NB_logical]``, ``importance [NB][B][Hq]``, ``anchor [NB][A][Hq][D]``;
- GQA: query head h reads kv head ``h // G``; a position p sits in row ``p % B`` of physical
  block ``block_table[p // B]``; the cache's partial tail block holds ``n_ctx % B`` tokens;
- a backend may export any subset: missing functions are reported as skipped.

Backends shipped here: :mod:`pyimp.testing.backends.numba` (pyimp's CPU kernels) and
:mod:`pyimp.testing.backends.cuda` (its numba-cuda kernels; on the simulator with
``NUMBA_ENABLE_CUDASIM=1``). Hypothesis is needed for the suite and the strategies
(``pip install 'pyimp[testing]'``); the references need only NumPy.
"""
from __future__ import annotations

from . import reference
from .reference import NAMES

__all__ = ["NAMES", "checks", "reference", "run_suite", "table"]


def __getattr__(name):
    # the suite imports hypothesis: only when asked for
    if name in ("run_suite", "checks", "table", "Result", "Check"):
        import importlib
        return getattr(importlib.import_module("pyimp.testing.suite"), name)
    raise AttributeError(f"module 'pyimp.testing' has no attribute {name!r}")
