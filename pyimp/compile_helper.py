"""Compile a model's decode kernels into Numba's on-disk cache, in a process of its own.

:meth:`pyimp.engine.Engine.warmup` starts this (``compile_helper=True``, as
``pyimp-run`` does) on a first run, when compiling takes 20-40 s: this process
compiles the decode step's kernels (decode attention first, then the rest of a
one-token forward) while the engine's process compiles the prefill kernels and
the weight types' decode matvecs, and the engine then loads this half from the
cache. Kernel signatures depend only on the weight types, the numerics and the
KV cache types, which is what it is given.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys


def start(engine) -> subprocess.Popen | None:
    """Start compiling ``engine``'s decode kernels in a new process; None when no process can
    be started (or the JIT is disabled). Where Numba cannot write its cache the helper's work
    is lost and the engine compiles those kernels after it: slower, not wrong."""
    o = engine.options
    spec = {"path": engine.path, "numerics": o.numerics, "type_k": o.type_k, "type_v": o.type_v,
            "v_layout": o.v_layout, "block_len": o.block_len}
    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", "pyimp.compile_helper", json.dumps(spec)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def main(argv=None) -> int:
    import numpy as np

    from .engine import Engine, EngineOptions
    from .runtime import configure_process
    configure_process()
    spec = json.loads((argv or sys.argv[1:])[0])
    block_len = spec["block_len"]
    opts = EngineOptions(n_ctx=2 * block_len, block_len=block_len, numerics=spec["numerics"],
                         cache_type_k=spec["type_k"], cache_type_v=spec["type_v"],
                         v_layout=spec["v_layout"])
    with Engine(spec["path"], opts) as eng:
        bos = max(eng.cfg.bos_id, 0)
        eng.compile_decode_attention()      # the largest kernel first (the engine compiles the
        # weight types' decode matvecs meanwhile: this forward then loads them from the cache)
        eng.forward(np.array([bos], dtype=np.int64))      # one token: the decode path
    return 0


if __name__ == "__main__":
    sys.exit(main())
