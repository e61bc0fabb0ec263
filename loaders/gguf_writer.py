"""GGUF writing: a version 3 file from metadata and tensors, in the layout
:mod:`loaders.gguf_file` reads (little endian, default alignment of 32 bytes)::

    w = GGUFWriter("model.gguf")
    w.add_string("general.architecture", "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_array("tokenizer.ggml.tokens", tokens, GGUFValueType.STRING)
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.add_tensor("token_embd.weight", blocks, QT.Q8_0)     # uint8 [rows, row bytes]
    w.write()

The file holds the header (magic, version 3, tensor count, metadata count), the metadata
pairs in the order they were added, the tensor infos in the order the tensors were added
(dimensions innermost first, type id, offset in the data section), zero bytes up to the
next multiple of 32, then each tensor's bytes, each followed by zero bytes up to the next
multiple of 32 (so every offset is a multiple of 32). Nothing is written until
:meth:`GGUFWriter.write`; a value or tensor that cannot be written raises ``ValueError``
naming the file and the key or tensor when it is added.
"""
from __future__ import annotations

import os
import struct
import sys
from typing import Any, Iterable

import numpy as np

from .ggml_types import GGML_QUANT_SIZES, QT, GGUFValueType, type_name
from .gguf_file import DEFAULT_ALIGNMENT, GGML_MAX_DIMS, GGUF_MAGIC, SCALAR_DTYPES, SCALAR_FORMATS

GGUF_VERSION = 3

# the element type of a tensor given as typed values rather than bytes
_ELEMENT_DTYPES = {QT.F32: np.dtype(np.float32), QT.F16: np.dtype(np.float16),
                   QT.BF16: np.dtype(np.uint16)}       # BF16: the bit patterns
_INTEGER_TYPES = frozenset(t for t, d in SCALAR_DTYPES.items() if np.issubdtype(d, np.integer))
# what a value of each kind of type must be, as said in errors
_WHAT = {"integer": "an integer", "bool": "a bool", "float": "a real number"}


def _kind(vtype: GGUFValueType) -> str:
    if vtype in _INTEGER_TYPES:
        return "integer"
    return "bool" if vtype == GGUFValueType.BOOL else "float"


def _fits_kind(v, vtype: GGUFValueType) -> bool:
    """Whether a Python or NumPy scalar v is a value of vtype's kind (integers for integer
    types, bools for BOOL, real numbers for the float types; a bool is not a number here)."""
    if isinstance(v, (bool, np.bool_)):
        return vtype == GGUFValueType.BOOL
    kind = _kind(vtype)
    if kind == "integer":
        return isinstance(v, (int, np.integer))
    return kind == "float" and isinstance(v, (int, float, np.integer, np.floating))


def _string_bytes(s: str | bytes) -> bytes:
    raw = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(raw)) + raw


class GGUFWriter:
    """Collects metadata and tensors for one GGUF file and writes it (see the module doc)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._kv: dict[str, bytes] = {}       # key -> encoded value type and value
        self._tensors: dict[str, tuple[tuple[int, ...], QT, np.ndarray]] = {}

    def _fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {what}")

    # ---------------------------------------------------------------- metadata

    def add(self, key: str, value: Any, vtype: GGUFValueType) -> None:
        """Metadata ``key`` = a scalar or string ``value`` of value type ``vtype``."""
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.ARRAY:
            raise self._fail(f"metadata key {key!r}: arrays go through add_array")
        self._put(key, struct.pack("<I", vtype) + self._encode(key, value, vtype))

    def add_array(self, key: str, values: Iterable, elem_type: GGUFValueType) -> None:
        """Metadata ``key`` = an array of ``elem_type`` (a scalar type or STRING)."""
        elem_type = GGUFValueType(elem_type)
        if elem_type == GGUFValueType.ARRAY:
            raise self._fail(f"metadata key {key!r}: arrays of arrays are not supported")
        if elem_type == GGUFValueType.STRING:
            items = [v if isinstance(v, (bytes, bytearray)) else self._utf8(key, v) for v in values]
            body = b"".join(struct.pack("<Q", len(b)) + bytes(b) for b in items)
            count = len(items)
        else:
            arr = self._numbers(key, values, elem_type)
            body, count = arr.tobytes(), arr.size
        self._put(key, struct.pack("<IIQ", GGUFValueType.ARRAY, elem_type, count) + body)

    def add_string(self, key: str, value: str) -> None:
        self.add(key, value, GGUFValueType.STRING)

    def add_uint32(self, key: str, value: int) -> None:
        self.add(key, value, GGUFValueType.UINT32)

    def add_float32(self, key: str, value: float) -> None:
        self.add(key, value, GGUFValueType.FLOAT32)

    def add_bool(self, key: str, value: bool) -> None:
        self.add(key, value, GGUFValueType.BOOL)

    def _put(self, key: str, encoded: bytes) -> None:
        if not isinstance(key, str) or not key:
            raise self._fail(f"metadata key {key!r}: keys are non-empty strings")
        if key in self._kv:
            raise self._fail(f"metadata key {key!r} added twice")
        self._kv[key] = encoded

    def _utf8(self, key: str, s) -> bytes:
        if not isinstance(s, str):
            raise self._fail(f"metadata key {key!r}: {s!r} is not a string")
        return s.encode("utf-8")

    def _encode(self, key: str, value: Any, vtype: GGUFValueType) -> bytes:
        if vtype == GGUFValueType.STRING:
            return _string_bytes(value if isinstance(value, (bytes, bytearray))
                                 else self._utf8(key, value))
        if not _fits_kind(value, vtype):
            raise self._fail(f"metadata key {key!r}: {value!r} is not {_WHAT[_kind(vtype)]}")
        value = int(value) if _kind(vtype) == "integer" else value
        try:
            return struct.pack(SCALAR_FORMATS[vtype][0], value)
        except (struct.error, OverflowError, TypeError) as e:
            raise self._fail(f"metadata key {key!r}: {value!r} does not fit {vtype.name} "
                             f"({e})") from None

    def _numbers(self, key: str, values, elem_type: GGUFValueType) -> np.ndarray:
        """values (a 1-D NumPy array or an iterable of numbers) as a little-endian array of
        elem_type; integers out of its range, and values of the wrong kind, raise."""
        dtype = np.dtype(SCALAR_DTYPES[elem_type]).newbyteorder("<")
        kind = _kind(elem_type)
        if isinstance(values, np.ndarray):
            if values.ndim != 1:
                raise self._fail(f"metadata key {key!r}: array values must be one-dimensional, "
                                 f"got shape {values.shape}")
            if values.dtype.kind not in {"integer": "iu", "bool": "b", "float": "iuf"}[kind]:
                raise self._fail(f"metadata key {key!r}: {elem_type.name} array given as "
                                 f"{values.dtype} values")
            src = values
        else:
            src = list(values)
            for v in src:
                if not _fits_kind(v, elem_type):
                    raise self._fail(f"metadata key {key!r}: {elem_type.name} array holds {v!r}")
        if kind == "integer" and len(src):
            info, lo, hi = np.iinfo(dtype), int(min(src)), int(max(src))
            if lo < info.min or hi > info.max:
                raise self._fail(f"metadata key {key!r}: values {lo}..{hi} do not fit "
                                 f"{elem_type.name}")
        return np.asarray(src, dtype=dtype) if len(src) else np.zeros(0, dtype)

    # ---------------------------------------------------------------- tensors

    def add_tensor(self, name: str, data: np.ndarray, qtype: int | None = None) -> None:
        """Tensor ``name`` of ggml type ``qtype``, its dimensions in NumPy order (the last one
        is ggml's first, ``ne[0]``). ``data`` is either the values in the type's element type
        (float32 for F32, float16 for F16, uint16 bit patterns for BF16; ``qtype`` None: F32
        or F16 from the dtype), or uint8 bytes whose last dimension is the row's bytes (any
        type, block types included)."""
        data = np.asarray(data)
        dtype = data.dtype.newbyteorder("=")            # compared whatever its byte order
        if qtype is None:
            qtype = {np.dtype(np.float32): QT.F32, np.dtype(np.float16): QT.F16}.get(dtype)
            if qtype is None:
                raise self._fail(f"tensor {name!r}: give the ggml type of {data.dtype} data")
        try:
            qtype = QT(qtype)
        except ValueError:
            raise self._fail(f"tensor {name!r}: unknown ggml type {type_name(qtype)}") from None
        if not 1 <= data.ndim <= GGML_MAX_DIMS or data.size == 0:
            raise self._fail(f"tensor {name!r}: shape {list(data.shape)}; tensors have 1 to "
                             f"{GGML_MAX_DIMS} dimensions and at least one element")
        shape = data.shape
        if dtype == np.uint8 and _ELEMENT_DTYPES.get(qtype) != dtype:
            bs, ts = GGML_QUANT_SIZES[qtype]
            if shape[-1] % ts:
                raise self._fail(f"tensor {name!r}: rows of {shape[-1]} bytes are not whole "
                                 f"{qtype.name} blocks of {ts} bytes")
            shape = (*shape[:-1], shape[-1] // ts * bs)
        elif _ELEMENT_DTYPES.get(qtype) != dtype:
            raise self._fail(f"tensor {name!r}: {qtype.name} data given as {data.dtype}; "
                             f"expected uint8 bytes"
                             + (f" or {_ELEMENT_DTYPES[qtype]}" if qtype in _ELEMENT_DTYPES else ""))
        if not isinstance(name, str) or not name:
            raise self._fail(f"tensor {name!r}: names are non-empty strings")
        if name in self._tensors:
            raise self._fail(f"tensor {name!r} added twice")
        self._tensors[name] = (tuple(int(d) for d in shape), qtype, data)

    # ---------------------------------------------------------------- the file

    def write(self) -> str:
        """Write the file (replacing one at the path); returns the path."""
        infos, offset = [], 0
        for name, (shape, qtype, data) in self._tensors.items():
            infos.append(_string_bytes(name) + struct.pack("<I", len(shape))
                         + struct.pack(f"<{len(shape)}Q", *reversed(shape))
                         + struct.pack("<IQ", qtype, offset))
            offset += -(-data.nbytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT
        head = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(self._kv))]
        head += [_string_bytes(k) + v for k, v in self._kv.items()]
        head += infos
        with open(self.path, "wb") as f:
            pos = sum(f.write(b) for b in head)
            f.write(bytes(-pos % DEFAULT_ALIGNMENT))
            for _, _, data in self._tensors.values():
                if data.dtype.byteorder == ">" or (data.dtype.byteorder == "="
                                                   and sys.byteorder == "big"):
                    data = data.astype(data.dtype.newbyteorder("<"))
                f.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
                f.write(bytes(-data.nbytes % DEFAULT_ALIGNMENT))
        return self.path
