"""The header of a GGUF file (llama.cpp's format): metadata and tensor table, read with bounds.

The layout (llama.cpp ``docs/gguf.md``, versions 2 and 3), little-endian unless the version
reads byte-swapped::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count times:      key (string) | value type u32 | value
    tensor_count times:  name (string) | n_dims u32 | dims u64 x n_dims | type u32 | offset u64
    padding up to general.alignment (default 32), then the tensor data

A string is a u64 byte length and that many UTF-8 bytes; an array is an item type u32, an item
count u64 and the items. Every count and length is a claim about the rest of the file, so each
is checked against the bytes that remain *before* anything is read or allocated: a 4 KB file
that claims 2**40 array items, a string longer than the file or a tensor past its end is a
``GGUFFormatError`` naming the field, at once. The work is bounded by the file's size, never by
what the header claims (an item that takes at least one byte cannot be counted beyond the
bytes left).

Tensor types are checked against ``type_sizes`` (ggml type -> (block size, bytes per block),
``gguf.constants.GGML_QUANT_SIZES`` for the caller that reads the data), so a tensor's size in
bytes is known exactly and must lie inside the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFFormatError", "GGUFHeader", "TensorInfo", "read_header"]

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32

# Value types (gguf_type): struct format of each scalar; 8 is a string, 9 an array.
_SCALARS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {
    0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32",
    7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64",
}  # fmt: skip
# The fewest bytes one entry can take: a key/value (empty key, 1-byte value) and a tensor info
# (empty name, one dimension).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8


class GGUFFormatError(ValueError):
    """A GGUF header that cannot be right: a count or length past the end of the file, an
    unknown type, a duplicate name, a misaligned or truncated tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: ``shape`` in torch's order (GGUF's list reversed),
    ``start`` the absolute byte offset of its data, ``n_bytes`` its size."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    start: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """``metadata``: key -> value (str, int, float, bool, or a list of them); ``tensors``: name
    -> ``TensorInfo`` in file order; ``byte_order``: ``"<"`` or ``">"``; ``size``: file bytes."""

    version: int
    byte_order: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    size: int


class _Cursor:
    """Reads forward through ``buf``; every read is checked against the bytes left."""

    def __init__(self, buf: Any, size: int, order: str) -> None:
        self.buf, self.size, self.order, self.pos = buf, size, order, 0

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n > self.left():
            raise GGUFFormatError(
                f"{what} needs {n:,} bytes at byte {self.pos:,}, but the {self.size:,}-byte file "
                f"has {self.left():,} left (truncated or corrupt)"
            )

    def scalars(self, code: str, count: int, what: str) -> tuple[Any, ...]:
        fmt = f"{self.order}{count}{code}"
        n = struct.calcsize(fmt)
        self.need(n, what)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return values

    def scalar(self, code: str, what: str) -> Any:
        return self.scalars(code, 1, what)[0]

    def items(self, code: str, count: int, what: str) -> list[Any]:
        """``count`` scalars as a list, decoded by numpy in one pass (no per-item objects on
        the way: a long array costs its list, nothing more)."""
        dtype = np.dtype(self.order + code)
        self.need(count * dtype.itemsize, what)
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
        self.pos += count * dtype.itemsize
        return values

    def count(self, what: str, item_bytes: int) -> int:
        """A u64 count of items that each take at least ``item_bytes``, checked against what
        is left before anything is read."""
        n = self.scalar("Q", what)
        if n * item_bytes > self.left():
            raise GGUFFormatError(
                f"{what} is {n:,} (at least {n * item_bytes:,} bytes), but the {self.size:,}-byte "
                f"file has {self.left():,} bytes left after byte {self.pos:,}"
            )
        return n

    def strings(self, n: int, what: str) -> list[str]:
        """``n`` strings (a token list holds about 50,000): one tight loop that stops at the
        first item that is not plainly right, which ``string`` then reads again and names."""
        buf, size, pos = self.buf, self.size, self.pos
        length_at = struct.Struct(self.order + "Q").unpack_from
        out: list[str] = []
        try:
            for _ in range(n):
                start = pos + 8
                end = start + length_at(buf, pos)[0]
                if end > size:
                    break
                out.append(bytes(buf[start:end]).decode("utf-8"))
                pos = end
        except (struct.error, UnicodeDecodeError):
            pass
        self.pos = pos
        out.extend(self.string(f"item {k} of {what}") for k in range(len(out), n))
        return out

    def string(self, what: str) -> str:
        n = self.count(f"the length of {what}", 1)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise GGUFFormatError(f"{what} is not valid UTF-8 ({err})") from None


def _value(cur: _Cursor, kind: int, key: str) -> Any:
    if kind in _SCALARS:
        return cur.scalar(_SCALARS[kind], f"metadata {key!r} ({_TYPE_NAMES[kind]})")
    if kind == _STRING:
        return cur.string(f"metadata {key!r}")
    if kind != _ARRAY:
        raise GGUFFormatError(f"metadata {key!r} has unknown value type {kind}")
    item = cur.scalar("I", f"the item type of metadata {key!r}")
    if item == _ARRAY:
        raise GGUFFormatError(f"metadata {key!r} is an array of arrays, which GGUF readers refuse")
    if item != _STRING and item not in _SCALARS:
        raise GGUFFormatError(f"metadata {key!r} is an array of unknown item type {item}")
    size = 8 if item == _STRING else struct.calcsize(_SCALARS[item])
    n = cur.count(f"the item count of metadata {key!r} ({_TYPE_NAMES[item]} array)", size)
    if item == _STRING:
        return cur.strings(n, f"metadata {key!r}")
    return cur.items(_SCALARS[item], n, f"metadata {key!r}")


def read_header(
    path: str | os.PathLike[str], type_sizes: Mapping[int, tuple[int, int]]
) -> GGUFHeader:
    """Parse ``path``'s header; ``type_sizes``: ggml type -> (block size, bytes per block)."""
    path = Path(path)
    with path.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size < 24:
            raise GGUFFormatError(f"a GGUF header takes 24 bytes; the file has {size}")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, size, type_sizes)


def _parse(buf: Any, size: int, type_sizes: Mapping[int, tuple[int, int]]) -> GGUFHeader:
    if bytes(buf[:4]) != MAGIC:
        raise GGUFFormatError("no GGUF magic bytes")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} is not supported (only {VERSIONS})")
    cur = _Cursor(buf, size, order)
    cur.pos = 8
    tensor_count = cur.count("tensor_count (header)", _MIN_TENSOR_BYTES)
    kv_count = cur.count("kv_count (header)", _MIN_KV_BYTES)
    if tensor_count * _MIN_TENSOR_BYTES + kv_count * _MIN_KV_BYTES > cur.left():
        raise GGUFFormatError(
            f"tensor_count {tensor_count:,} and kv_count {kv_count:,} (header) need more than the "
            f"{cur.left():,} bytes left in the {size:,}-byte file"
        )
    metadata: dict[str, Any] = {}
    for k in range(kv_count):
        key = cur.string(f"metadata key {k}")
        kind = cur.scalar("I", f"the value type of metadata {key!r}")
        value = _value(cur, kind, key)
        if key in metadata:
            raise GGUFFormatError(f"metadata {key!r} appears twice")
        metadata[key] = value

    raw_tensors = []
    for k in range(tensor_count):
        name = cur.string(f"tensor name {k}")
        n_dims = cur.scalar("I", f"n_dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFFormatError(f"tensor {name!r} has n_dims={n_dims}; GGUF allows 1..{MAX_DIMS}")
        dims = cur.scalars("Q", n_dims, f"the dimensions of tensor {name!r}")
        ggml_type = cur.scalar("I", f"the type of tensor {name!r}")
        offset = cur.scalar("Q", f"the data offset of tensor {name!r}")
        raw_tensors.append((name, dims, ggml_type, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        not isinstance(alignment, int)
        or isinstance(alignment, bool)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset in raw_tensors:
        if name in tensors:
            raise GGUFFormatError(f"tensor {name!r} appears twice in the tensor table")
        if ggml_type not in type_sizes:
            raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {ggml_type}")
        block, block_bytes = type_sizes[ggml_type]
        if dims[0] % block:
            raise GGUFFormatError(
                f"tensor {name!r}: its rows of {dims[0]} are not whole blocks of {block}"
            )
        if offset % alignment:
            raise GGUFFormatError(
                f"tensor {name!r}: data offset {offset:,} is not a multiple of the alignment "
                f"{alignment}"
            )
        elements = 1
        for d in dims:
            elements *= d  # Python ints: no overflow, and bounded by the check just below
        n_bytes = elements // block * block_bytes
        start = data_start + offset
        if start + n_bytes > size:
            raise GGUFFormatError(
                f"tensor {name!r} (dims {list(dims)}) ends at byte {start + n_bytes:,} of a "
                f"{size:,}-byte file (truncated or corrupt)"
            )
        tensors[name] = TensorInfo(name, ggml_type, tuple(reversed(dims)), start, n_bytes)
    return GGUFHeader(version, order, metadata, tensors, size)
