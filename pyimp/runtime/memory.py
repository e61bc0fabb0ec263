"""How much memory a configuration needs, and how much the system has to give.

The engine sums the buffers it is about to allocate (KV cache, importance
matrix, anchors) and refuses a configuration that exceeds the available
memory with one line, instead of a NumPy allocation traceback or a silent
multi-GiB allocation.

Available memory: ``$PYIMP_MEMORY_LIMIT`` when set (bytes, or with a K/M/G/T
suffix, powers of 1024), else the smaller of ``MemAvailable`` in
``/proc/meminfo`` and the cgroup v2 limit's headroom; unknown elsewhere (no check).
"""
from __future__ import annotations

import os
import re

ENV = "PYIMP_MEMORY_LIMIT"
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class InsufficientMemoryError(MemoryError):
    """A configuration needs more memory than the system has available."""


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{ENV}={text!r} is not a size (bytes, or a number with K/M/G/T)")
    return int(float(m.group(1)) * _SUFFIX[m.group(2).upper()])


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            used = int(f.read().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError, StopIteration):
        return None


def available_bytes() -> int | None:
    """Bytes a new allocation may take now; None when the system does not say."""
    env = os.environ.get(ENV)
    if env:
        return parse_size(env)
    known = [x for x in (_meminfo_available(), _cgroup_headroom()) if x is not None]
    return min(known) if known else None


def check_fits(needed: int, what: str, advice: str) -> None:
    """InsufficientMemoryError (one line: what, how much, what to change) when needed > available."""
    avail = available_bytes()
    if avail is not None and needed > avail:
        src = f" (${ENV})" if os.environ.get(ENV) else ""
        raise InsufficientMemoryError(f"{what} needs {fmt_bytes(needed)}, more than the "
                                      f"{fmt_bytes(avail)} of memory available{src}; {advice}")
