"""Compile a model's decode kernels into Numba's on-disk cache, in a process of its own.

:meth:`pyimp.engine.Engine.warmup` starts this (``compile_helper=True``, as
``pyimp-run`` does) on a first run, when compiling takes 20-40 s: this process
compiles the decode attention (the largest kernel) while the engine's process
compiles the prefill kernels; then both compile the weight types' decode
matvecs, this one from the first type a forward reaches, the engine from the
last, each type once (:class:`Claims`); then this one runs a one-token forward
(the rest of the decode path) and the engine loads all of it from the cache.
Kernel signatures depend only on the weight types, the numerics and the KV
cache types, which is what it is given.
"""
from __future__ import annotations

import json
import sys

from .parallel_compile import CLAIM_WAIT_S, Claims, decode_linears, start


def main(argv=None) -> int:
    import numpy as np

    from ..engine import Engine, EngineOptions
    from .process import configure_process
    configure_process()
    spec = json.loads((argv or sys.argv[1:])[0])
    block_len = spec["block_len"]
    opts = EngineOptions(n_ctx=2 * block_len, block_len=block_len, numerics=spec["numerics"],
                         cache_type_k=spec["type_k"], cache_type_v=spec["type_v"],
                         v_layout=spec["v_layout"])
    with Engine(spec["path"], opts) as eng:
        bos = max(eng.cfg.bos_id, 0)
        eng.compile_decode_attention()      # the largest kernel first
        claims, linears = Claims(spec["claims"]), decode_linears(eng.weights)
        claims.compile(linears, spec["numerics"])       # from the front; the engine from the back
        claims.wait(linears)                            # then this forward loads them all
        eng.forward(np.array([bos], dtype=np.int64))      # one token: the decode path
    return 0


if __name__ == "__main__":
    sys.exit(main())
