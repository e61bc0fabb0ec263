"""GGUF reading: header, metadata, tensor views, vocabulary.

The metadata section is parsed here with a small, bounds-checked reader over
the memory-mapped file instead of ``gguf.GGUFReader``: the latter turns every
vocabulary string into a NumPy object and needs ~16 s to open a 262k-token
vocabulary, while this reader needs a fraction of a second. The constants (value
types, ggml type table) come from :mod:`loaders.ggml_types`; ``gguf`` is not needed.

Every problem with a file raises :class:`GGUFError`, whose message names the
file and the offending key, tensor or type.

GGUF layout (little endian, versions 2 and 3)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x      (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32)
    tensor data, each tensor at data_start + offset

    string = u64 length + UTF-8 bytes;  array = u32 elem_type, u64 count, elems
"""
from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from .ggml_types import (GGML_QUANT_SIZES, SUPPORTED_TYPES, GGMLQuantizationType, GGUFValueType,
                         type_name)
from .vocab import TOKEN_NORMAL, Vocab

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
# GGUF spells some special-token keys out; Vocab.special uses the short names
_SPECIAL_ALIASES = {"unknown": "unk", "padding": "pad", "seperator": "sep", "separator": "sep"}
_KNOWN_TYPES = frozenset(int(t) for t in GGML_QUANT_SIZES)
DEFAULT_ALIGNMENT = 32

# value type -> (struct format, byte size) for scalar types
SCALAR_FORMATS = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
SCALAR_DTYPES = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


class GGUFError(Exception):
    """A GGUF file cannot be used; the message names the file and what is wrong."""

    def __init__(self, path: str | os.PathLike, what: str):
        self.path = str(path)
        self.what = what
        super().__init__(f"{self.path}: {what}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file.

    name   GGUF tensor name, e.g. ``blk.0.attn_q.weight``
    qtype  ggml type id (a ``GGMLQuantizationType`` of :mod:`loaders.ggml_types` when known)
    shape  ggml order (ne0 = row length first)
    offset absolute byte offset of the data in the file
    nbytes size of the data in bytes
    """

    name: str
    qtype: int
    shape: tuple
    offset: int
    nbytes: int

    @property
    def n_per_row(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)


@dataclass(frozen=True)
class QTensor:
    """Zero-copy view of a tensor's stored bytes.

    raw    uint8[n_rows, row_bytes], read-only, backed by the memory map
    qtype  ggml type
    shape  ggml order (ne0 first); raw row r holds elements [r*ne0, (r+1)*ne0)
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple
    raw: np.ndarray

    @property
    def n_per_row(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return self.raw.shape[0]

    def as_float32(self) -> np.ndarray:
        """F32 tensors only: float32 view in NumPy order (reverse of ggml shape)."""
        if self.qtype != GGMLQuantizationType.F32:
            raise TypeError(f"{self.name} is {self.qtype.name}, not F32")
        return self.raw.view(np.float32).reshape(tuple(reversed(self.shape)))


class _Cursor:
    """Bounds-checked little-endian reader over a memoryview."""

    __slots__ = ("buf", "pos", "end", "path")

    def __init__(self, buf: memoryview, path: str, pos: int = 0):
        self.buf = buf
        self.pos = pos
        self.end = len(buf)
        self.path = path

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise GGUFError(self.path, f"truncated file: {what} at byte {self.pos} needs {n} bytes, "
                                       f"file has {self.end}")

    def scalar(self, vtype: GGUFValueType, what: str):
        fmt, size = SCALAR_FORMATS[vtype]
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(self.path, f"{what}: invalid UTF-8 string") from None

    def string_array(self, count: int, what: str) -> list:
        """``count`` strings; the hot path of vocabulary loading."""
        buf, pos, end = self.buf, self.pos, self.end
        unpack = struct.unpack_from
        out = []
        append = out.append
        try:
            for _ in range(count):
                if pos + 8 > end:
                    raise IndexError
                (n,) = unpack("<Q", buf, pos)
                pos += 8
                stop = pos + n
                if stop > end:
                    raise IndexError
                append(str(buf[pos:stop], "utf-8"))
                pos = stop
        except IndexError:
            raise GGUFError(self.path, f"truncated file: {what} ends past the end of the file") from None
        except UnicodeDecodeError:
            # keep going with replacement characters only for token texts would hide corruption
            raise GGUFError(self.path, f"{what}: invalid UTF-8 string at element {len(out)}") from None
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise GGUFError(self.path, f"{what}: unknown value type {vtype}") from None
        if vt == GGUFValueType.STRING:
            return self.string(what)
        if vt in SCALAR_FORMATS:
            return self.scalar(vt, what)
        # array
        if depth > 0:
            raise GGUFError(self.path, f"{what}: nested arrays are not supported")
        etype = self.u32(what)
        count = self.u64(what)
        try:
            et = GGUFValueType(etype)
        except ValueError:
            raise GGUFError(self.path, f"{what}: unknown array element type {etype}") from None
        if et in SCALAR_DTYPES:
            size = SCALAR_FORMATS[et][1]
            self.need(count * size, what)
            arr = np.frombuffer(self.buf, dtype=np.dtype(SCALAR_DTYPES[et]).newbyteorder("<"),
                                count=count, offset=self.pos)
            self.pos += count * size
            return arr
        if et == GGUFValueType.STRING:
            # every string needs at least its 8-byte length: bound the count before looping
            self.need(count * 8, what)
            return self.string_array(count, what)
        raise GGUFError(self.path, f"{what}: arrays of {et.name} are not supported")


# bytes hashed per hashlib call by GGUFFile.fingerprint (hashlib releases the GIL for each)
FINGERPRINT_CHUNK = 1 << 24


class GGUFFile:
    """A memory-mapped GGUF file: metadata dict, tensor table, zero-copy tensor views.

    ``metadata`` maps keys to Python scalars, str, list[str] or read-only NumPy
    arrays (numeric arrays are views into the map).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fingerprint: str | None = None
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 4:
                    raise GGUFError(self.path, "not a GGUF file (too short to hold the magic)")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise GGUFError(self.path, "no such file") from None
        except IsADirectoryError:
            raise GGUFError(self.path, "is a directory, not a GGUF file") from None
        except PermissionError:
            raise GGUFError(self.path, "permission denied") from None
        except OSError as e:
            raise GGUFError(self.path, f"cannot read file: {e.strerror or e}") from None
        self._buf = memoryview(self._mmap)
        self._bytes = np.frombuffer(self._mmap, dtype=np.uint8)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    # ------------------------------------------------------------------ parse
    def _parse(self) -> None:
        cur = _Cursor(self._buf, self.path)
        magic = bytes(self._buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(self.path, f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.u32("header version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise GGUFError(self.path, "big-endian GGUF files are not supported")
            raise GGUFError(self.path, f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        n_tensors = cur.u64("header tensor count")
        n_kv = cur.u64("header metadata count")
        # every kv needs >= 8+4 bytes and every tensor info >= 8+4+4+8: reject absurd counts
        if n_kv * 12 + n_tensors * 24 > cur.end - cur.pos:
            raise GGUFError(self.path, f"truncated file: header claims {n_kv} metadata keys and "
                                       f"{n_tensors} tensors, more than the file can hold")
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.u32(f"metadata key {key!r} type")
            if key in self.metadata:
                raise GGUFError(self.path, f"metadata key {key!r} appears twice")
            self.metadata[key] = cur.value(vtype, f"metadata key {key!r}")

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
                or alignment & (alignment - 1):
            raise GGUFError(self.path, f"metadata key 'general.alignment': {alignment!r} "
                                       f"is not a positive power of two")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor info #{i} name")
            n_dims = cur.u32(f"tensor {name!r} dimension count")
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise GGUFError(self.path, f"tensor {name!r}: {n_dims} dimensions "
                                           f"(expected 1..{GGML_MAX_DIMS})")
            shape = tuple(cur.u64(f"tensor {name!r} shape") for _ in range(n_dims))
            qtype = cur.u32(f"tensor {name!r} type")
            offset = cur.u64(f"tensor {name!r} offset")
            if name in self.tensors or any(name == n for n, *_ in infos):
                raise GGUFError(self.path, f"tensor {name!r} appears twice")
            infos.append((name, shape, qtype, offset))
        data_start = -(-cur.pos // alignment) * alignment
        self.data_start = data_start
        file_size = cur.end
        for name, shape, qtype, offset in infos:
            if qtype not in _KNOWN_TYPES:
                raise GGUFError(self.path, f"tensor {name!r}: unknown ggml type id {qtype}")
            bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            if any(d <= 0 for d in shape) or shape[0] % bs:
                raise GGUFError(self.path, f"tensor {name!r}: shape {list(shape)} is invalid for "
                                           f"type {type_name(qtype)} (block size {bs})")
            n_el = 1
            for d in shape:
                n_el *= d
            nbytes = n_el // bs * ts
            if offset % alignment:
                raise GGUFError(self.path, f"tensor {name!r}: data offset {offset} is not aligned "
                                           f"to {alignment}")
            start = data_start + offset
            if start + nbytes > file_size:
                raise GGUFError(self.path, f"truncated file: tensor {name!r} data ends at byte "
                                           f"{start + nbytes}, file has {file_size}")
            self.tensors[name] = TensorInfo(name, qtype, shape, start, nbytes)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise GGUFError(self.path, f"tensor {b!r}: data overlaps tensor {a!r}")

    # --------------------------------------------------------------- metadata
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(self.path, "metadata key 'general.architecture' is missing")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple = (int, float, str, bool)) -> Any:
        """Value of ``key``; GGUFError naming the key when it is missing or of the wrong kind."""
        if key not in self.metadata:
            raise GGUFError(self.path, f"metadata key {key!r} is missing")
        v = self.metadata[key]
        if not isinstance(v, kind):
            raise GGUFError(self.path, f"metadata key {key!r} has an unexpected value {v!r}")
        return v

    # ---------------------------------------------------------------- tensors
    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str, shape: tuple | None = None) -> QTensor:
        """Zero-copy view of tensor ``name``, checked against ``shape`` (ggml order) when given."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(self.path, f"tensor {name!r} is missing")
        if info.qtype not in SUPPORTED_TYPES:
            raise GGUFError(self.path, f"tensor {name!r} has unsupported type {info.type_name}")
        if shape is not None and tuple(shape) != info.shape:
            raise GGUFError(self.path, f"tensor {name!r} has shape {list(info.shape)}, "
                                       f"expected {list(shape)}")
        rows = info.n_rows
        raw = self._bytes[info.offset:info.offset + info.nbytes].reshape(rows, info.nbytes // rows)
        return QTensor(name, GGMLQuantizationType(info.qtype), info.shape, raw)

    def file_size(self) -> int:
        return len(self._bytes)

    def fingerprint(self) -> str:
        """``"sha256-file:<hex>"``, the SHA-256 of the whole file (header, metadata, tensor infos
        and every byte of the tensor data: two models that differ in one weight differ here;
        the hex is what ``sha256sum`` prints for the file): the one identity of a model that
        saved states and tensor dumps record. Computed on the first call and kept; it reads
        the whole file (measured on the 253 MB default model: 0.15-0.18 s from the page cache,
        0.47 s from disk; hashlib's SHA-256 runs on the CPU's SHA extensions)."""
        if self._fingerprint is None:
            if self._buf is None:
                raise GGUFError(self.path, "the file is closed")
            h = hashlib.sha256()
            step = FINGERPRINT_CHUNK
            for at in range(0, len(self._buf), step):
                h.update(self._buf[at:at + step])
            self._fingerprint = "sha256-file:" + h.hexdigest()
        return self._fingerprint

    def close(self) -> bool:
        """Release the map; True once it is unmapped.

        Metadata arrays are copied out first and stay readable. Tensor views (and arrays
        made from metadata views) obtained earlier keep the map open: then this returns
        False, and a later call, once they are gone, unmaps it.
        """
        if self._mmap is None:
            return True
        for key, value in self.metadata.items():
            if isinstance(value, np.ndarray) and not value.flags.owndata:
                self.metadata[key] = value.copy()
        self._bytes = None
        try:
            if self._buf is not None:
                self._buf.release()
                self._buf = None
            self._mmap.close()
        except BufferError:
            return False   # live views still export the map's memory
        self._mmap = None
        return True

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------- vocabulary
    def vocab(self) -> Vocab:
        """The tokenizer vocabulary from ``tokenizer.ggml.*``."""
        md = self.metadata
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise GGUFError(self.path, "metadata key 'tokenizer.ggml.tokens' is missing or empty")
        n = len(tokens)

        def array(key: str, dtype, fill) -> np.ndarray:
            v = md.get(key)
            if v is None:
                return np.full(n, fill, dtype=dtype)
            if not isinstance(v, np.ndarray) or v.shape != (n,):
                raise GGUFError(self.path, f"metadata key {key!r} must be a numeric array of "
                                           f"{n} elements")
            return np.ascontiguousarray(v, dtype=dtype)

        scores = array("tokenizer.ggml.scores", np.float32, 0.0)
        types = array("tokenizer.ggml.token_type", np.int32, TOKEN_NORMAL)
        merges = md.get("tokenizer.ggml.merges", [])
        if not isinstance(merges, list):
            raise GGUFError(self.path, "metadata key 'tokenizer.ggml.merges' must be a string array")
        model = md.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise GGUFError(self.path, "metadata key 'tokenizer.ggml.model' is missing")
        pre = md.get("tokenizer.ggml.pre", "default")
        special, flags = {}, {}
        prefix = "tokenizer.ggml."
        for key, v in md.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            if name.endswith("_token_id"):
                if not isinstance(v, int) or isinstance(v, bool):
                    raise GGUFError(self.path, f"metadata key {key!r} must be an integer")
                short = name[:-len("_token_id")]
                special[_SPECIAL_ALIASES.get(short, short)] = int(v) if 0 <= v < n else -1
            elif isinstance(v, bool):
                flags[name] = v
        for name in ("bos", "eos", "unk", "sep", "pad", "eot", "eom", "mask"):
            special.setdefault(name, -1)
        return Vocab(tokens=tokens, scores=scores, token_types=types, merges=merges,
                     model=model, pre=pre if isinstance(pre, str) else "default",
                     special=special, flags=flags)


def read_vocab(path: str | os.PathLike) -> Vocab:
    """The tokenizer vocabulary of a GGUF file (model or vocab-only)."""
    with GGUFFile(path) as f:
        return f.vocab()
