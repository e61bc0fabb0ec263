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
import os
import subprocess
import sys
import time

CLAIM_WAIT_S = 300.0     # how long the helper waits for the engine's claimed kernels (a guard)


def decode_linears(weights) -> list:
    """One Linear per weight type, in the order a one-token forward first reaches each type."""
    first = {}
    for lw in weights.layers:
        for lin in lw.linears():
            first.setdefault(lin.qtype, lin)
    first.setdefault(weights.output.qtype, weights.output)
    return list(first.values())


class Claims:
    """Which of the two processes compiles which weight type's decode matvec: the first to
    create the type's claim file in ``folder`` (atomic, O_EXCL); a done file follows its
    compile (or its failure: the other process then compiles it in its forward)."""

    def __init__(self, folder: str):
        self.folder = folder

    def _path(self, lin, what: str) -> str:
        return os.path.join(self.folder, f"{int(lin.qtype)}.{what}")

    def take(self, lin) -> bool:
        try:
            os.close(os.open(self._path(lin, "claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
        except OSError:            # no folder (removed, unwritable): compile it here
            return True

    def compile(self, linears, numerics: str) -> None:
        """Compile the decode matvec of each of ``linears`` that no one has claimed yet."""
        for lin in linears:
            if self.take(lin):
                try:
                    lin.compile_decode(numerics)
                finally:
                    try:
                        open(self._path(lin, "done"), "w").close()
                    except OSError:
                        pass

    def wait(self, linears, timeout_s: float = CLAIM_WAIT_S) -> None:
        """Until every claimed one of ``linears`` is done (or the timeout passes)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and any(
                os.path.exists(self._path(lin, "claim")) and not os.path.exists(self._path(lin, "done"))
                for lin in linears):
            time.sleep(0.05)


def start(engine, claims: str) -> subprocess.Popen | None:
    """Start compiling ``engine``'s decode kernels in a new process that shares the claim folder
    ``claims`` (:class:`Claims`) with the engine; None when no process can be started (or the
    JIT is disabled). Where Numba cannot write its cache the helper's work is lost and the
    engine compiles those kernels after it: slower, not wrong."""
    o = engine.options
    spec = {"path": engine.path, "numerics": o.numerics, "type_k": o.type_k, "type_v": o.type_v,
            "v_layout": o.v_layout, "block_len": o.block_len, "claims": claims}
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
        eng.compile_decode_attention()      # the largest kernel first
        claims, linears = Claims(spec["claims"]), decode_linears(eng.weights)
        claims.compile(linears, spec["numerics"])       # from the front; the engine from the back
        claims.wait(linears)                            # then this forward loads them all
        eng.forward(np.array([bos], dtype=np.int64))      # one token: the decode path
    return 0


if __name__ == "__main__":
    sys.exit(main())
