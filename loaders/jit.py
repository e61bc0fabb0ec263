"""``njit`` with an on-disk cache that goes stale when any source a kernel is built from changes.

Numba's ``cache=True`` stamps a cached kernel with the modification time and
size of the one file that defines it. A kernel that calls (and so inlines)
``@njit`` code of another module keeps its cached machine code when only that
other module changes: the cache silently runs the old code. pyimp's kernels
are built from shared per-type decoders and fp16 helpers, so that would bite
on every edit.

Here each kernel module declares the modules whose jitted code its kernels
call::

    from loaders import jit
    from loaders import fp16            # a module with @jit.njit helpers
    jit.kernel_module(__file__, fp16)

    @jit.njit(parallel=True)
    def kernel(...): ...

and the stamp of every kernel of that module is a SHA-256 over the contents of
the module and of everything it depends on, transitively. Any edit to any of
those files invalidates the cached kernel; nothing else does. The cache files
live where Numba would put them (``__pycache__`` beside the source, else the
user-wide Numba cache, or ``NUMBA_CACHE_DIR``); under ``NUMBA_CACHE_DIR`` they
are named by each module's path inside its package, not by its absolute path,
so another checkout of the same sources loads them. The process's Numba settings
and other libraries' caches are untouched: only dispatchers made by
:func:`njit` use these locators.

A module that calls into another must declare it *before* its first kernel
compiles (at import, next to its imports); :func:`njit` refuses a module that
was never declared, so a dependency cannot be forgotten silently.

Per-type kernels are one call of an inlined generic driver with that type's
decoder and constants. :func:`specialize` defines such a kernel from a table
row: the function is compiled as if written in the module (its file, its
globals), so it is cached exactly like a hand-written one. (A closure over the
decoder, or the decoder passed as an argument, would never be a cache hit.)
"""
from __future__ import annotations

import hashlib
import os
import types

import numba
from numba.core import caching

from .cpu import host_features  # noqa: F401  (re-exported; loaders.cpu reads it without Numba)

_DEPS: dict[str, tuple[str, ...]] = {}     # module file -> files its kernels call into


def _real(path_or_module) -> str:
    path = path_or_module.__file__ if isinstance(path_or_module, types.ModuleType) else path_or_module
    return os.path.realpath(os.fspath(path))


def kernel_module(file, *deps) -> None:
    """Declare ``file`` (a module's ``__file__``) a kernel module whose jitted code calls into
    ``deps`` (modules or file paths, themselves declared with this function when they call
    into others)."""
    _DEPS[_real(file)] = tuple(sorted({_real(d) for d in deps}))


def closure(file) -> list[str]:
    """``file`` and every file it depends on, transitively, sorted."""
    seen, todo = set(), [_real(file)]
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(_DEPS.get(f, ()))
    return sorted(seen)


def portable_name(path) -> str:
    """``path`` relative to the folder that holds its top-level package (``loaders/quants.py``
    for this project's files; the file name alone for a module outside any package): the same
    in every checkout of the same sources."""
    path = _real(path)
    top = os.path.dirname(path)
    while os.path.exists(os.path.join(top, "__init__.py")):
        top = os.path.dirname(top)
    return os.path.relpath(path, top)


def sources_stamp(file) -> str:
    """Hex SHA-256 over the portable names (:func:`portable_name`) and contents of
    :func:`closure` (``file``)."""
    h = hashlib.sha256()
    for f in closure(file):
        st = os.stat(f)
        h.update(portable_name(f).encode() + b"\0")
        h.update(caching._hash_source_file(f, st.st_mtime, st.st_size))
    return h.hexdigest()


class _SourcesStamp:
    """Locator mixin: the freshness stamp covers the module and its declared dependencies."""

    def get_source_stamp(self):
        return sources_stamp(self._py_file)


class _UserProvided(_SourcesStamp, caching.UserProvidedCacheLocator):
    """``NUMBA_CACHE_DIR``, in a folder named by the module's portable name rather than its
    absolute path: two checkouts of the same sources (a CI clone in a new folder) share the
    kernels; the stamp still refuses an entry compiled from other sources."""

    @classmethod
    def get_suitable_cache_subpath(cls, py_file):
        folder = os.path.dirname(portable_name(py_file))
        digest = hashlib.sha1(folder.encode()).hexdigest()
        return "_".join([os.path.basename(folder) or "top", digest])


class _InTree(_SourcesStamp, caching.InTreeCacheLocator):
    pass


class _UserWide(_SourcesStamp, caching.UserWideCacheLocator):
    pass


class _Impl(caching.CompileResultCacheImpl):
    _locator_classes = [_UserProvided, _InTree, _UserWide]


class _Cache(caching.FunctionCache):
    _impl_class = _Impl


def target_features() -> frozenset:
    """The CPU features Numba compiles for, as LLVM names them: ``NUMBA_CPU_FEATURES`` when set
    (``NUMBA_CPU_NAME=generic`` alone sets it empty: a portable cache), else the host's, less
    the AVX family under ``NUMBA_ENABLE_AVX=0``. Kernels that emit target intrinsics choose by
    these, not by the host's: LLVM aborts the process on an intrinsic its target lacks."""
    from numba.core import codegen, config
    flat = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    return frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))



# features whose absence from the target (while the host has them) costs the kernels most
SPEED_FEATURES = ("avx2", "fma", "f16c", "avx512f")


def unused_host_features() -> list[str]:
    """SPEED_FEATURES the host has and Numba's target lacks (NUMBA_CPU_NAME=generic, a
    NUMBA_CPU_FEATURES list, NUMBA_ENABLE_AVX=0), in that order."""
    host, target = host_features(), target_features()
    return [f for f in SPEED_FEATURES if f in host and f not in target]


def njit(*args, cache: bool = True, **options):
    """``numba.njit`` (lazy, no explicit signatures) whose cache is keyed by :func:`sources_stamp`."""
    if "fastmath" in options and options["fastmath"] is True:
        raise ValueError("fastmath=True changes results (NaN/inf assumptions); name the flags")

    def wrap(func):
        if cache:
            src = _real(func.__code__.co_filename)
            if src not in _DEPS:
                raise RuntimeError(f"{src}: call loaders.jit.kernel_module(__file__, ...) before "
                                   f"defining cached kernels")
        disp = numba.njit(**options)(func)
        if cache:
            disp._cache = _Cache(func)     # what Dispatcher.enable_caching does, with our locators
        return disp

    if args:
        if len(args) == 1 and callable(args[0]):
            return wrap(args[0])
        raise TypeError("loaders.jit.njit takes no signatures (kernels compile lazily)")
    return wrap


def specialize(namespace: dict, name: str, params: str, call: str, **options):
    """Define ``def name(params): call`` in the module whose globals are ``namespace``,
    jitted with :func:`njit` (``options``), and return it. ``call`` is one statement,
    typically a generic driver applied to a type's decoder, e.g.
    ``specialize(globals(), "_matvec_q4_0", "raw, x, out, f16",
    "_matvec_blocks(raw, x, out, f16, head_d, pair_q4_0, 18, False)", parallel=True)``.
    The cache entry is keyed by ``name``; tracebacks show the module's file at line 1."""
    if not name.isidentifier() or name in namespace:
        raise ValueError(f"specialize: {name!r} is not a new identifier of {namespace.get('__name__')}")
    exec(compile(f"def {name}({params}):\n    {call}\n", namespace["__file__"], "exec"), namespace)
    namespace[name] = disp = njit(**options)(namespace[name])
    return disp
