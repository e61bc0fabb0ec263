"""Getting the kernels ready: whether this is a first run (Numba's cache index), the process's
Numba settings, and an engine's warmup (every kernel of prefill and decode compiled or loaded,
with a compile helper process on a first run)."""
from __future__ import annotations

import shutil
import tempfile
import time
import warnings

import numpy as np

from loaders import quants

from .. import ops
from ..attention.attend import decode_over_blocks, every_block

# seconds a small kernel takes to come from Numba's cache at most (warm ~3 ms; compiling ~0.2 s)
COLD_LOAD_S = 0.05


def numba_cache_has_kernels() -> bool | None:
    """Whether Numba's on-disk cache holds this machine's entry of the rms_norm kernel (every
    forward runs it), without loading anything; None where Numba's cache is not laid out as
    this reads it (internals: the index of ``FunctionCache``)."""
    try:
        d = ops.rms_norm_rows
        magic = d.targetctx.codegen().magic_tuple()
        return any(key[1] == magic for key in d._cache._cache_file._load_index())
    except Exception:
        return None


def first_run() -> bool:
    """Whether the kernels will be compiled rather than loaded from Numba's cache: the cache
    index when it can be read (so a compile helper starts before anything compiles), else the
    time of a kernel load (the first load pays Numba's start-up; the second shows which)."""
    cached = numba_cache_has_kernels()
    if cached is not None:
        return not cached
    ops.rms_norm(np.ones((1, 8), np.float32), np.ones(8, np.float32), 1e-6)
    t1 = time.perf_counter()
    cos, sin = ops.rope_cache(np.arange(1), 8, 10000.0, 1.0)
    ops.rope(np.ones((1, 1, 8), np.float32), cos, sin, True)
    return time.perf_counter() - t1 > COLD_LOAD_S


def check_numba() -> None:
    """ValueError, one line naming the variable, when this process's Numba settings cannot run
    pyimp's kernels (instead of a traceback from the first kernel)."""
    import numba
    from numba.core import config
    if config.DISABLE_JIT:
        raise ValueError("NUMBA_DISABLE_JIT=1 is set in the environment: pyimp's kernels are "
                         "compiled Numba code (LLVM intrinsics, with no pure-Python form); "
                         "unset it to run a model")
    try:
        numba.get_num_threads()       # loads the threading layer the parallel kernels run on
    except (ValueError, ImportError) as e:
        why = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip() and ln.strip() != "HINT:")
        raise ValueError(f"NUMBA_THREADING_LAYER={config.THREADING_LAYER}: Numba cannot start a "
                         f"threading layer ({why})") from None
    from loaders import jit
    unused = jit.unused_host_features()
    if unused:
        # measured: Gemma 3 270M decodes 13 tok/s for NUMBA_CPU_NAME=generic against 110 for
        # the host (AMD EPYC znver5): no vector FMA (each one a libm call), SSE2 vectors
        # AVX-512F alone (an AVX2 machine's target, e.g. a cache built for one): 256-bit steps;
        # Gemma decoded about as fast as llama.cpp built for AVX2 (tools.bench --target znver3)
        cost = ("the kernels run several times slower" if set(unused) - {"avx512f"} else
                "the kernels run on 256-bit vectors where this CPU has 512-bit ones")
        warnings.warn(f"Numba compiles for a CPU without {', '.join(unused)}, which this one has "
                      f"(NUMBA_CPU_NAME / NUMBA_CPU_FEATURES / NUMBA_ENABLE_AVX): {cost}",
                      RuntimeWarning, stacklevel=3)


def compile_decode_attention(engine) -> None:
    """Compile (or load) the decode attention kernels of this cache's types: one call over a
    zero token in layer 0, then the cache is empty again. :mod:`pyimp.runtime.compile_helper` runs it
    first, so that the largest kernel starts compiling at once."""
    if engine.tokens:
        raise RuntimeError("compile_decode_attention needs an empty cache")
    c, cfg = engine.cache, engine.cfg
    z = np.zeros((1, cfg.n_head_kv, cfg.head_dim), np.float32)
    c.reserve(1)
    c.write(0, z, z, 0)
    sel, cnt = every_block(1, c.block_len, 0)
    q = np.zeros((cfg.n_head, cfg.head_dim), np.float32)
    try:
        decode_over_blocks(q, c.k_layer(0), c.v_layer(0), c.table(0), 1, 1.0, 0, sel, cnt,
                           np.empty_like(q), None, 1.0, None, 8, c.bias(0))
    finally:
        engine.reset()


def run(engine, compile_helper: bool = False) -> float:
    """Compile (or load from cache) every kernel of prefill and decode; returns seconds.

    With ``compile_helper``, when the kernels are not in Numba's cache (a first run), a second
    process (:mod:`pyimp.runtime.compile_helper`) compiles the decode attention into the cache while
    this one compiles the prefill kernels, the two share out the decode matvecs, then this
    one loads the helper's kernels: two cores compile in about half the time of one."""
    t0 = time.perf_counter()
    saved = engine.tokens
    if saved:
        raise RuntimeError("warmup needs an empty cache")
    bos = max(engine.cfg.bos_id, 0)
    helper = None
    if compile_helper and engine._gpu is None and first_run():
        from . import parallel_compile as pc
        try:
            claims = tempfile.mkdtemp(prefix="pyimp-claims-")
        except OSError:        # no writable temporary folder: this process compiles it all
            claims = None
        helper = None if claims is None else pc.start(engine, claims)
        if helper is None and claims is not None:
            shutil.rmtree(claims, ignore_errors=True)
    try:
        # with a helper, both rows go through the last layer (matmuls) and the head is
        # skipped, so that this forward compiles no decode matvec (those are shared out below)
        engine.forward(np.array([bos, bos], dtype=np.int64), all_logits=helper is not None,
                     logits=helper is None)
        if helper is not None:
            engine._backend.compile_fused_ops()
            # the helper compiles the decode attention (the largest kernel) meanwhile, then
            # both compile the weight types' decode matvecs, it from the first type its
            # forward reaches and this process from the last, each type once
            pc.Claims(claims).compile(pc.decode_linears(engine.weights)[::-1],
                                      engine.options.numerics)
            helper.wait()      # its kernels are in the cache now (or it failed: compiled below)
    finally:
        if helper is not None:
            shutil.rmtree(claims, ignore_errors=True)
    engine.forward(np.array([bos], dtype=np.int64))
    if engine._gpu is None:
        # each decode matvec chooses serial or parallel by timing its first calls
        # (quants.ThreadChoice): those calls are made here, not in the first tokens a user times
        for _ in range(max(0, min(2 * quants.ThreadChoice.TRIALS, engine.n_ctx - 3))):
            engine.forward(np.array([bos], dtype=np.int64))
    if engine.sparse is not None:
        with engine._threads():
            engine.sparse.warmup()
    engine.reset()
    engine.timings.compile_s = time.perf_counter() - t0
    return engine.timings.compile_s

