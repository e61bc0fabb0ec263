"""Compiling the kernels in two processes: the engine's side.

On a first run (:meth:`pyimp.engine.Engine.warmup` with ``compile_helper=True``, as
``pyimp-run`` does) the engine starts the compile helper (:mod:`pyimp.runtime.compile_helper`, a process
of its own: :func:`start`), which compiles the decode attention (the largest kernel) while the
engine's process compiles the prefill kernels; then both compile the weight types' decode
matvecs, the helper from the first type a forward reaches, the engine from the last, each type
once (:class:`Claims`, :func:`decode_linears`). Nothing here imports the engine: the helper
process does.
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
        return subprocess.Popen([sys.executable, "-m", "pyimp.runtime.compile_helper", json.dumps(spec)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None
