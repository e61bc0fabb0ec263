"""State files: an entropy-coded, checksummed container of named NumPy arrays.

The on-disk format of saved engine state (prompt-cache files). The module knows nothing
about the engine: a caller stores a JSON-able header dict and an ordered dict of named
arrays, and reads back the same header and bit-identical arrays (same names and order,
dtype, shape and bytes; arrays come back in native byte order).

API
---
- :func:`write_state` ``(path, header, arrays, *, level=None, rotary=None) -> stats``:
  writes the file atomically (a temporary file in the same directory, flushed and
  fsynced, then ``os.replace``'d onto ``path``, then the directory fsynced). On any
  exception the temporary file is removed and a file already at ``path`` is left
  untouched. SIGTERM during the write (where the process leaves it at its default action,
  on the main thread) is handled as SIGINT is: the write unwinds, the temporary is removed,
  then the signal ends the process as it would have. The writer holds an exclusive
  ``flock`` on its temporary (``.<name>.<12 hex digits>.tmp``); a write removes the
  temporaries of that name that no process holds and that are older than
  :data:`STALE_TMP_S` (left by a process that was killed). Refusals of the input
  (unsupported dtype, a name that is not a string, a header that is not JSON, a
  ``rotary`` entry that is not a :class:`Rotary` of one of the arrays) are
  ``ValueError`` naming the offending key, raised before anything is written. ``rotary`` gives the RoPE frame of sections of keys (see ``pred-f16``).
- :func:`read_state` ``(path) -> (header, arrays)``: verifies the whole file (magic,
  version, every checksum, every length, dtype and shape consistency, decoded sizes)
  before returning anything. Arrays are writable, C-contiguous and own their memory.
- :func:`read_header` ``(path) -> header``: reads and verifies only the preamble and the
  header, so a caller can check a fingerprint before decoding megabytes.
- :class:`StateFileError` (a ``ValueError``): every problem found while reading, with a
  message that names the file and the reason.

Supported dtypes: float16, float32, uint8, int8, uint16, int32, int64, uint32, any shape
(0-d and empty included). The header must be a dict of JSON values that survive a JSON
round trip unchanged: dicts with string keys, lists, strings, bools, None, ints and finite
floats (tuples, NaN/inf and other types are refused).

Byte layout (version 1)
-----------------------
All integers little-endian; every checksum is CRC-32 (``zlib.crc32``, the ISO-HDLC / zlib
polynomial), which detects every single-bit error and every burst of up to 32 bits in
the bytes it covers. There is no padding: every byte of a file is either checked against
a constant (magic, version) or covered by a checksum, and the file must end exactly
after the last payload::

    preamble    28 bytes, struct "<8sIIIII":
                  magic       b"PYIMPST\\0"
                  version     u32 = 1
                  header_len  u32   bytes of the header JSON
                  table_len   u32   bytes of the section table
                  n_sections  u32
                  crc         u32   CRC-32 of the 24 bytes before it
    header      header_len bytes of UTF-8 JSON (an object), then u32 CRC-32 of them
    table       table_len bytes: n_sections entries, in the order of the arrays,
                then u32 CRC-32 of the table_len bytes. Each entry:
                  name_len    u16, then name_len bytes of UTF-8 name (1..1024 bytes)
                  dtype       u8    1 float16, 2 float32, 3 uint8, 4 int8,
                                    5 uint16, 6 int32, 7 int64, 8 uint32
                  codec       u8    0 raw, 1 zstd, 2 shuffle-zstd, 3 pred-f16
                  ndim        u8    (0..64), then ndim x u64 dimensions
                  raw_len     u64   = product(shape) * itemsize
                  stored_len  u64   bytes of the payload
                  crc         u32   CRC-32 of the stored payload bytes
    payloads    the sections' stored bytes, back to back, in table order

Codecs (the element bytes are always the little-endian, C-order bytes of the array):

- ``raw`` (0): the element bytes as they are.
- ``zstd`` (1): one Zstandard frame (RFC 8878) of the element bytes, with the content
  size and the frame's own XXH64 content checksum.
- ``shuffle-zstd`` (2): the element bytes regrouped into ``itemsize`` byte planes (all
  elements' byte 0, then all byte 1, ...), then one zstd frame of that, as above.
- ``pred-f16`` (3, float16 sections only): the predictive codec of
  :mod:`pyimp.kv.floatcodec` (its payload layout is documented there): the array read as
  planes of rows x channels (last axis), each value coded from a linear prediction on
  the previous row and the row's earlier channels (with a rotary frame for keys that
  carry RoPE, and repeated rows predicted by the row they repeat), entropy coded with
  rANS. Version 1 files without it (codecs 0-2) read as they always did.

The writer measures per section: float16 sections of at least 4 KiB whose last axis
has at most 1024 channels try ``pred-f16``, ``shuffle-zstd`` and ``zstd``; other
sections wider than one byte ``shuffle-zstd`` (and ``zstd`` up to 256 KiB); one-byte
dtypes ``zstd``; each keeps the smallest, and sections under 64 bytes, and any whose
coded form is not smaller than the raw bytes, are stored ``raw``. Sections are encoded
and decoded on up to four threads (the codecs release the GIL).

``tools/bench_statefile.py`` measures these choices on a real KV cache (Gemma 3 270M,
f16, after a 4032-token prefill of pydoc text; 20.25 MB of KV held, each layer's K and
V a section): the byte-plane split separates the skewed sign/exponent bytes of float
data from their near-random low mantissa bytes, so zstd's entropy coder models each
plane on its own (1.16x on those sections, decoding at 1-2 GB/s; plain zstd 1.08x);
``pred-f16`` models the values themselves (keys in their un-rotated frame, the first
layer's recurring tokens) and reaches 1.259x, decoding at 26-39 MB/s: the whole state
(1.264x against the raw bytes of all its sections, 1.258x against the KV it holds)
reads in 0.3-0.65 s, 3-6 % of the ~11 s prefill it replaces. Subtracting each value's
predecessor in its channel (as ordered integers, or XOR) before the shuffle does not
help (1.134x / 1.138x on the keys against 1.136x). zstd's default level 3 comes within
1 % of level 9's ratio at 3-5 times its compression speed; decoding speed hardly
depends on the level.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import signal
import stat
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, NoReturn

import numpy as np
import zstandard

try:
    import fcntl
except ImportError:          # no flock: temporaries are neither locked nor cleared
    fcntl = None

from . import floatcodec
from .floatcodec import Rotary

__all__ = ["FORMAT_VERSION", "MAGIC", "Rotary", "StateFileError", "read_header", "read_state",
           "write_state"]

MAGIC = b"PYIMPST\0"
FORMAT_VERSION = 1
DEFAULT_LEVEL = 3
MAX_LEVEL = 22
MAX_NAME_BYTES = 1024
MAX_NDIM = 64

_PREAMBLE = struct.Struct("<8sIIIII")          # magic, version, header_len, table_len, n, crc
_CRC = struct.Struct("<I")
_NAME_LEN = struct.Struct("<H")
_ENTRY_FIXED = struct.Struct("<BBB")           # dtype code, codec id, ndim
_DIM = struct.Struct("<Q")
_ENTRY_TAIL = struct.Struct("<QQI")            # raw_len, stored_len, crc

RAW, ZSTD, SHUFFLE_ZSTD, PRED_F16 = 0, 1, 2, 3
CODEC_NAMES = {RAW: "raw", ZSTD: "zstd", SHUFFLE_ZSTD: "shuffle-zstd", PRED_F16: "pred-f16"}

# dtype code -> little-endian dtype
_DTYPES: dict[int, np.dtype] = {
    1: np.dtype("<f2"), 2: np.dtype("<f4"), 3: np.dtype("u1"), 4: np.dtype("i1"),
    5: np.dtype("<u2"), 6: np.dtype("<i4"), 7: np.dtype("<i8"), 8: np.dtype("<u4"),
}
_DTYPE_CODES = {(dt.kind, dt.itemsize): code for code, dt in _DTYPES.items()}

_RAW_BELOW = 64                  # sections smaller than this are stored raw
_TRY_BOTH_UP_TO = 256 * 1024     # sections up to this size try both zstd codecs
_PRED_FROM = 4096                # float16 sections from this size also try pred-f16
_LITTLE = sys.byteorder == "little"
# seconds after which a temporary of an earlier write that no process holds is removed (a
# live writer holds its lock from just after creating the file until just before renaming it)
STALE_TMP_S = 60
_TMP_TAIL = re.compile(r"[0-9a-f]{12}\.tmp")     # after ".<name>.": secrets.token_hex(6)


class StateFileError(ValueError):
    """A state file that cannot be read: missing, not a state file, unsupported, corrupt or
    truncated. ``path`` and ``reason`` hold the two parts of the message."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(f"state file {self.path}: {reason}")


# --------------------------------------------------------------------- input checks
def _refuse(message: str) -> NoReturn:
    """Every write-time refusal of the input is a ValueError (wrong types included), so a
    caller has one exception type to handle for "the format cannot hold this"."""
    raise ValueError(message)


def _check_json(value: Any, where: str) -> None:
    """ValueError naming ``where`` unless ``value`` survives a JSON round trip unchanged."""
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"header{where} is {value!r}: not representable in JSON")
        return
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"header{where} is a string that is not valid UTF-8") from None
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                _refuse(f"header{where} has key {key!r} of type {type(key).__name__}: "
                        f"JSON object keys must be strings")
            _check_json(key, f"{where} key {key!r}")
            _check_json(item, f"{where}[{key!r}]")
        return
    _refuse(f"header{where} has type {type(value).__name__} ({value!r:.60}), which is not a JSON "
            f"value (use dict, list, str, int, finite float, bool or None)")


def _encode_header(header: Any) -> bytes:
    if not isinstance(header, dict):
        _refuse(f"header must be a dict, got {type(header).__name__}")
    _check_json(header, "")
    return json.dumps(header, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


def _prepare_arrays(arrays: Any) -> list[tuple[str, bytes, np.ndarray, int]]:
    """(name, UTF-8 name, little-endian C-contiguous array, dtype code) per array, in order."""
    if not isinstance(arrays, Mapping):
        _refuse(f"arrays must be a mapping of names to arrays, got {type(arrays).__name__}")
    out = []
    for name, a in arrays.items():
        if not isinstance(name, str):
            _refuse(f"array name {name!r} is a {type(name).__name__}, not a string")
        try:
            bname = name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"array name {name!r} is not valid UTF-8") from None
        if not 1 <= len(bname) <= MAX_NAME_BYTES:
            raise ValueError(f"array name {name[:40]!r} has {len(bname)} UTF-8 bytes "
                             f"(1..{MAX_NAME_BYTES} allowed)")
        if not isinstance(a, np.ndarray):
            _refuse(f"array {name!r} is a {type(a).__name__}, not a NumPy array")
        code = _DTYPE_CODES.get((a.dtype.kind, a.dtype.itemsize))
        if code is None:
            allowed = ", ".join(str(dt.name) for dt in _DTYPES.values())
            raise ValueError(f"array {name!r} has dtype {a.dtype}, which state files do not "
                             f"support (supported: {allowed})")
        if a.ndim > MAX_NDIM:
            raise ValueError(f"array {name!r} has {a.ndim} dimensions (at most {MAX_NDIM})")
        out.append((name, bname, np.asarray(a, dtype=_DTYPES[code], order="C"), code))
    return out


# -------------------------------------------------------------------------- codecs
def _shuffle(a: np.ndarray) -> np.ndarray:
    """The little-endian bytes of ``a`` as ``itemsize`` byte planes, plane-major (uint8)."""
    n = a.dtype.itemsize
    elems = a.reshape(-1).view(np.uint8).reshape(-1, n)
    planes = np.empty((n, elems.shape[0]), dtype=np.uint8)
    for i in range(n):
        planes[i] = elems[:, i]
    return planes


def _unshuffle_into(planes: bytes, out: np.ndarray) -> None:
    """Scatter byte planes (as :func:`_shuffle` makes them) into the little-endian ``out``."""
    n = out.dtype.itemsize
    src = np.frombuffer(planes, dtype=np.uint8).reshape(n, -1)
    dst = out.reshape(-1).view(np.uint8).reshape(-1, n)
    for i in range(n):
        dst[:, i] = src[i]


def _encode(a: np.ndarray, level: int,
            rotary: Rotary | None = None) -> tuple[int, bytes | memoryview]:
    """(codec id, stored bytes) for the little-endian C-contiguous array ``a``: the smallest
    of the codecs tried (see the module docstring), raw when none is smaller."""
    raw = memoryview(a.reshape(-1).view(np.uint8))
    if level == 0 or a.nbytes < _RAW_BELOW:
        return RAW, raw
    if a.dtype.itemsize == 1:
        codecs = [ZSTD]
    elif a.dtype.kind == "f" and a.dtype.itemsize == 2 and a.nbytes >= _PRED_FROM \
            and floatcodec.applies(a.shape):
        codecs = [PRED_F16, SHUFFLE_ZSTD, ZSTD]
    else:
        codecs = [SHUFFLE_ZSTD] + ([ZSTD] if a.nbytes <= _TRY_BOTH_UP_TO else [])
    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    best: tuple[int, bytes | memoryview] = (RAW, raw)
    for codec in codecs:
        if codec == PRED_F16:
            stored = floatcodec.encode(a, rotary)
        else:
            stored = cctx.compress(_shuffle(a) if codec == SHUFFLE_ZSTD else raw)
        if len(stored) < len(best[1]):
            best = (codec, stored)
    return best


def _decode(codec: int, stored: bytes, dtype: np.dtype, shape: tuple[int, ...],
            fail: Callable[[str], NoReturn]) -> np.ndarray:
    """The array a section's stored bytes encode (little-endian ``dtype``); ``fail(reason)``
    raises the caller's StateFileError."""
    if codec == PRED_F16 and dtype.name != "float16":
        fail(f"codec pred-f16 for a {dtype.name} section")
    try:
        out = np.empty(shape, dtype=np.float16 if codec == PRED_F16 else dtype)
    except (MemoryError, ValueError) as e:
        fail(f"cannot allocate {dtype.name} array of shape {shape} ({e})")
    raw_len = out.nbytes
    if codec == PRED_F16:
        return floatcodec.decode(stored, shape, fail, out)        # native float16
    if codec == RAW:
        if len(stored) != raw_len:
            fail(f"raw payload of {len(stored)} bytes for {raw_len} bytes of data")
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(stored, dtype=np.uint8)
        return out
    try:
        size = zstandard.frame_content_size(stored)
    except zstandard.ZstdError as e:
        fail(f"bad zstd frame ({e})")
    if size != raw_len:
        fail(f"zstd frame declares {size} bytes, expected {raw_len}")
    try:
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_len)
    except zstandard.ZstdError as e:
        fail(f"zstd decoding failed ({e})")
    if len(data) != raw_len:
        fail(f"decoded {len(data)} bytes, expected {raw_len}")
    if codec == SHUFFLE_ZSTD:
        _unshuffle_into(data, out)
    else:
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    return out


# ---------------------------------------------------------------------------- write
def _table_entry(bname: bytes, code: int, codec: int, shape: tuple[int, ...], raw_len: int,
                 stored_len: int, crc: int) -> bytes:
    return b"".join([_NAME_LEN.pack(len(bname)), bname, _ENTRY_FIXED.pack(code, codec, len(shape)),
                     *(_DIM.pack(d) for d in shape), _ENTRY_TAIL.pack(raw_len, stored_len, crc)])


def _fsync_dir(dirpath: str) -> None:
    """Make a rename in ``dirpath`` durable (where the platform can open directories)."""
    try:
        fd = os.open(dirpath, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _workers() -> int:
    """Threads that encode or decode sections at once (the codecs release the GIL)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(4, n))


@contextlib.contextmanager
def _pool(n_jobs: int) -> Iterator[Callable]:
    """``submit(fn, *args) -> future`` on a thread pool (inline when one thread will do);
    queued jobs are dropped when the block exits with an exception."""
    workers = min(_workers(), n_jobs)
    if workers <= 1:
        class _Done:
            def __init__(self, fn, args):
                self.fn, self.args = fn, args

            def result(self):
                return self.fn(*self.args)
        yield lambda fn, *args: _Done(fn, args)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="statefile")
    try:
        yield pool.submit
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _check_rotary(rotary: Any, names: set[str]) -> dict[str, Rotary]:
    if rotary is None:
        return {}
    if not isinstance(rotary, Mapping):
        _refuse(f"rotary must be a mapping of section names to Rotary, got {type(rotary).__name__}")
    for name, r in rotary.items():
        if name not in names:
            raise ValueError(f"rotary names {name!r}, which is not one of the arrays")
        if not isinstance(r, Rotary):
            _refuse(f"rotary[{name!r}] is a {type(r).__name__}, not a statefile.Rotary")
    return dict(rotary)


class _Terminated(BaseException):
    """SIGTERM arrived while a state was being written (see :class:`_TermUnwinds`)."""


class _TermUnwinds:
    """While a state is written: SIGTERM raises :class:`_Terminated`, so the write unwinds
    and removes its temporary file as on SIGINT's KeyboardInterrupt; on leaving, the default
    action is restored and, if SIGTERM arrived, the signal is raised again, which ends the
    process as SIGTERM would have. Only on the main thread, and only where SIGTERM has its
    default action (a process's own handler or SIG_IGN is left alone)."""

    def __enter__(self):
        self.armed = False
        try:
            if threading.current_thread() is threading.main_thread() and \
                    signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, self._handler)
                self.armed = True
        except (ValueError, OSError):       # no signals here (an embedded interpreter)
            pass
        self.installed = self.armed
        return self

    def _handler(self, signum, frame):
        if self.armed:
            raise _Terminated
        # the write is over (the temporary renamed or removed): the default action, now
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)

    def __exit__(self, exc_type, exc, tb):
        self.armed = False
        if self.installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if exc_type is _Terminated:
            signal.raise_signal(signal.SIGTERM)
        return False


def _lock(fd: int) -> None:
    """Hold an exclusive flock on the writer's temporary (a filesystem without locks: none)."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass


def _remove_stale_temporaries(dirpath: str, base: str) -> None:
    """Remove ``.<base>.<12 hex digits>.tmp`` files in ``dirpath`` that are regular files,
    older than STALE_TMP_S and locked by no process: left by a writer that was killed."""
    if fcntl is None:
        return
    prefix = f".{base}."
    try:
        names = [n for n in os.listdir(dirpath)
                 if n.startswith(prefix) and _TMP_TAIL.fullmatch(n, len(prefix))]
    except OSError:
        return
    now = time.time()
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for name in names:
        full = os.path.join(dirpath, name)
        try:
            fd = os.open(full, flags)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < STALE_TMP_S:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:                  # a live writer holds it (or no locks here)
                continue
            cur = os.lstat(full)
            if (cur.st_dev, cur.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(full)
        except OSError:
            pass
        finally:
            os.close(fd)


def write_state(path: str | os.PathLike, header: dict, arrays: Mapping[str, np.ndarray], *,
                level: int | None = None, rotary: Mapping[str, Rotary] | None = None) -> dict:
    """Write ``header`` and ``arrays`` to ``path`` atomically; see the module docstring.

    ``level``: zstd level 1..22 (default :data:`DEFAULT_LEVEL`), or 0 to store every
    section raw. ``rotary``: for float16 sections of keys that carry rotary position
    embedding, their :class:`Rotary` frame (positions per row, channel pairs,
    frequencies), which the ``pred-f16`` codec uses as a prediction frame (it changes
    only the ratio; a frame that does not fit the section is ignored). Returns
    ``{"path", "file_bytes", "raw_bytes", "seconds", "sections"}``, ``sections`` mapping
    each name to ``{"codec", "raw_bytes", "stored_bytes"}``. Raises ValueError for input
    the format cannot hold (before touching the disk) and OSError for I/O failures.
    Sections are encoded on up to four threads.
    """
    t0 = time.perf_counter()
    level = DEFAULT_LEVEL if level is None else level
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"level must be an int in 0..{MAX_LEVEL}, got {level!r}")
    hdr = _encode_header(header)
    prepared = _prepare_arrays(arrays)
    frames = _check_rotary(rotary, {name for name, *_ in prepared})
    # the table's size depends only on names and ranks: its place is reserved, the payloads
    # are streamed after it, and the table is written once their lengths and CRCs are known
    table_len = sum(_NAME_LEN.size + len(b) + _ENTRY_FIXED.size + _DIM.size * a.ndim
                    + _ENTRY_TAIL.size for _, b, a, _ in prepared)
    if len(hdr) > 0xFFFFFFFF or table_len > 0xFFFFFFFF:
        raise ValueError("header or section table exceeds 4 GiB")
    body = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(hdr), table_len, len(prepared), 0)[:-_CRC.size]
    preamble = body + _CRC.pack(zlib.crc32(body))
    table_at = len(preamble) + len(hdr) + _CRC.size

    path = os.fspath(path)
    dirpath, base = os.path.split(os.path.abspath(path))
    with _TermUnwinds():
        _remove_stale_temporaries(dirpath, base)
        tmp = os.path.join(dirpath, f".{base}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        file_bytes, sections = _write_file(fd, tmp, path, preamble, hdr, table_len, table_at,
                                           prepared, level, frames)
    _fsync_dir(dirpath)
    return {"path": path, "file_bytes": file_bytes,
            "raw_bytes": sum(s["raw_bytes"] for s in sections.values()),
            "seconds": time.perf_counter() - t0, "sections": sections}


def _write_file(fd: int, tmp: str, path: str, preamble: bytes, hdr: bytes, table_len: int,
                table_at: int, prepared: list, level: int, frames: dict) -> tuple[int, dict]:
    """Write the state into the new temporary ``tmp`` (open as ``fd``, locked while written),
    rename it onto ``path``; on any exception remove it. Returns (file bytes, sections)."""
    sections: dict[str, dict] = {}
    try:
        _lock(fd)
        with os.fdopen(fd, "wb") as f, _pool(len(prepared)) as submit:
            jobs = [submit(_encode, a, level, frames.get(name)) for name, _, a, _ in prepared]
            f.write(preamble)
            f.write(hdr)
            f.write(_CRC.pack(zlib.crc32(hdr)))
            f.write(bytes(table_len + _CRC.size))
            entries = []
            for (name, bname, a, code), job in zip(prepared, jobs):
                codec, stored = job.result()
                f.write(stored)
                entries.append(_table_entry(bname, code, codec, a.shape, a.nbytes, len(stored),
                                            zlib.crc32(stored)))
                sections[name] = {"codec": CODEC_NAMES[codec], "raw_bytes": a.nbytes,
                                  "stored_bytes": len(stored)}
            table = b"".join(entries)
            file_bytes = f.tell()
            f.seek(table_at)
            f.write(table)
            f.write(_CRC.pack(zlib.crc32(table)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return file_bytes, sections


# ----------------------------------------------------------------------------- read
class _Reader:
    """Reads and verifies one state file; every failure is a StateFileError."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def fail(self, reason: str) -> NoReturn:
        raise StateFileError(self.path, reason)

    @contextlib.contextmanager
    def opened(self) -> Iterator[BinaryIO]:
        """The file, opened for reading after checking that it is a regular file (so that a
        FIFO or device is refused instead of blocking or reading forever)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.fail("no such file")
        except OSError as e:
            self.fail(f"cannot access ({e.strerror or e})")
        if stat.S_ISDIR(st.st_mode):
            self.fail("is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            self.fail("not a regular file")
        with contextlib.ExitStack() as stack:
            try:
                f = stack.enter_context(open(self.path, "rb"))
            except OSError as e:
                self.fail(f"cannot open ({e.strerror or e})")
            self.size = os.fstat(f.fileno()).st_size
            yield f

    def read_exact(self, f: BinaryIO, n: int, what: str) -> bytes:
        try:
            data = f.read(n)
        except OSError as e:
            self.fail(f"read error in {what} ({e.strerror or e})")
        if len(data) != n:
            self.fail(f"truncated in {what} (expected {n} bytes, got {len(data)})")
        return data

    def check_crc(self, data: bytes, stored_crc: bytes, what: str) -> None:
        want = _CRC.unpack(stored_crc)[0]
        got = zlib.crc32(data)
        if got != want:
            self.fail(f"checksum mismatch in {what} (stored {want:08x}, computed {got:08x})")

    def preamble(self, f: BinaryIO) -> tuple[int, int, int]:
        """(header_len, table_len, n_sections) after checking magic, version and CRC."""
        data = self.read_exact(f, min(self.size, _PREAMBLE.size), "preamble")
        if not data:
            self.fail("empty file (not a pyimp state file)")
        if data[:len(MAGIC)] != MAGIC[:len(data)]:
            self.fail("not a pyimp state file (bad magic)")
        if len(data) >= 12:
            version = struct.unpack_from("<I", data, 8)[0]
            if version != FORMAT_VERSION:
                self.fail(f"format version {version} is not supported "
                          f"(this build reads {FORMAT_VERSION})")
        if len(data) < _PREAMBLE.size:
            self.fail(f"truncated in preamble (expected {_PREAMBLE.size} bytes, got {len(data)})")
        _, _, header_len, table_len, n_sections, _ = _PREAMBLE.unpack(data)
        self.check_crc(data[:-_CRC.size], data[-_CRC.size:], "preamble")
        return header_len, table_len, n_sections

    def header(self, f: BinaryIO, header_len: int) -> dict:
        data = self.read_exact(f, header_len + _CRC.size, "header")
        self.check_crc(data[:header_len], data[header_len:], "header")
        try:
            header = json.loads(data[:header_len].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            self.fail(f"header is not valid JSON ({e})")
        if not isinstance(header, dict):
            self.fail(f"header is a JSON {type(header).__name__}, not an object")
        return header

    def table(self, f: BinaryIO, table_len: int, n_sections: int) -> list[tuple]:
        data = self.read_exact(f, table_len + _CRC.size, "section table")
        table = data[:table_len]
        self.check_crc(table, data[table_len:], "section table")
        entries, names, pos = [], set(), 0
        try:
            for i in range(n_sections):
                (nlen,) = _NAME_LEN.unpack_from(table, pos)
                pos += _NAME_LEN.size
                if not 1 <= nlen <= MAX_NAME_BYTES or pos + nlen > table_len:
                    self.fail(f"section table entry {i}: bad name length {nlen}")
                name = table[pos:pos + nlen].decode("utf-8")
                pos += nlen
                code, codec, ndim = _ENTRY_FIXED.unpack_from(table, pos)
                pos += _ENTRY_FIXED.size
                shape = tuple(_DIM.unpack_from(table, pos + _DIM.size * k)[0] for k in range(ndim))
                pos += _DIM.size * ndim
                raw_len, stored_len, crc = _ENTRY_TAIL.unpack_from(table, pos)
                pos += _ENTRY_TAIL.size
                what = f"section {name!r}"
                if name in names:
                    self.fail(f"{what} appears twice")
                names.add(name)
                dtype = _DTYPES.get(code)
                if dtype is None:
                    self.fail(f"{what} has unknown dtype code {code}")
                if codec not in CODEC_NAMES:
                    self.fail(f"{what} has unknown codec id {codec}")
                if ndim > MAX_NDIM:
                    self.fail(f"{what} has {ndim} dimensions (at most {MAX_NDIM})")
                if raw_len != math.prod(shape) * dtype.itemsize:
                    self.fail(f"{what}: {raw_len} raw bytes do not match dtype {dtype.name} "
                              f"and shape {shape}")
                if codec == PRED_F16 and dtype.name != "float16":
                    self.fail(f"{what}: codec pred-f16 for a {dtype.name} section")
                if codec == RAW and stored_len != raw_len:
                    self.fail(f"{what}: raw section stores {stored_len} bytes for {raw_len}")
                entries.append((name, dtype, shape, codec, raw_len, stored_len, crc))
        except (struct.error, UnicodeDecodeError) as e:
            self.fail(f"corrupt section table ({e})")
        if pos != table_len:
            self.fail(f"section table has {table_len - pos} bytes after its {n_sections} entries")
        return entries

    def check_size(self, start: int, entries: list[tuple]) -> None:
        """Truncation (naming the section it cuts) or trailing bytes, before any decoding."""
        end = start
        for name, *_, stored_len, _crc in entries:
            if self.size < end + stored_len:
                self.fail(f"truncated in section {name!r} (expected {stored_len} bytes, "
                          f"got {max(0, self.size - end)})")
            end += stored_len
        if self.size > end:
            self.fail(f"{self.size - end} unexpected bytes after the last section")


def read_header(path: str | os.PathLike) -> dict:
    """The header of the state file at ``path``, after verifying the preamble (magic,
    version, checksum) and the header's checksum; payloads are not read.
    Raises :class:`StateFileError`."""
    r = _Reader(path)
    with r.opened() as f:
        header_len, _, _ = r.preamble(f)
        return r.header(f, header_len)


def read_state(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """``(header, arrays)`` of the state file at ``path``, in the order written.

    Everything is verified before anything is returned; any problem is a
    :class:`StateFileError` naming the file and the reason.
    """
    r = _Reader(path)
    with r.opened() as f:
        header_len, table_len, n_sections = r.preamble(f)
        header = r.header(f, header_len)
        entries = r.table(f, table_len, n_sections)
        r.check_size(f.tell(), entries)
        with _pool(len(entries)) as submit:
            jobs = []
            for name, dtype, shape, codec, _raw_len, stored_len, crc in entries:
                what = f"section {name!r}"
                stored = r.read_exact(f, stored_len, what)
                r.check_crc(stored, _CRC.pack(crc), what)

                def fail(reason: str, what: str = what) -> NoReturn:
                    r.fail(f"{what}: {reason}")
                jobs.append(submit(_decode, codec, stored, dtype, shape, fail))
            arrays: dict[str, np.ndarray] = {}
            for (name, dtype, *_), job in zip(entries, jobs):     # the first failure in order
                a = job.result()
                native = _LITTLE or a.dtype.itemsize == 1
                arrays[name] = a if native else a.astype(dtype.newbyteorder("="))
    return header, arrays
