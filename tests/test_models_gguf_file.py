"""The GGUF header reader: the same metadata and tensor table as the gguf package's reader on
files the gguf package writes (both byte orders), and hostile headers, written here byte by
byte, refused at once with the field named, in bounded time and memory."""

from __future__ import annotations

import struct
import time
import tracemalloc

import numpy as np
import pytest

from attnkit.models.gguf_file import GGUFFormatError, read_header

gguf = pytest.importorskip("gguf")

SIZES = {int(t): sizes for t, sizes in gguf.GGML_QUANT_SIZES.items()}
U32, STRING, ARRAY = 4, 8, 9
Q4_1 = int(gguf.GGMLQuantizationType.Q4_1)


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + payload


def _file(tmp_path, body: bytes, *, tensors: int = 0, kvs: int = 1, pad: int = 0, name="x"):
    """A GGUF v3 file: the header with the given counts, then ``body``, then ``pad`` zeros."""
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, kvs) + body + bytes(pad))
    return path


ARCH = _kv("general.architecture", STRING, _string("llama"))


def _tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    head = _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
    return head + struct.pack("<IQ", ggml_type, offset)


HOSTILE = {
    # A 4.6 KB file whose array claims 2**40 uint32 items.
    "array items": (
        dict(kvs=2, pad=4_500),
        ARCH + _kv("tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", U32, 2**40)),
        r"the item count of metadata 'tokenizer\.ggml\.token_type' \(uint32 array\) is "
        r"1,099,511,627,776",
    ),
    "string array items": (
        dict(kvs=2, pad=4_500),
        ARCH + _kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 2**40)),
        r"item count of metadata 'tokenizer\.ggml\.tokens' \(string array\) is 1,099,511",
    ),
    "string length": (
        dict(kvs=2, pad=4_500),
        ARCH + _kv("general.name", STRING, struct.pack("<Q", 2**62)),
        r"the length of metadata 'general\.name' is 4,611,686,018,427,387,904",
    ),
    "key length": (
        dict(kvs=1, pad=4_500),
        struct.pack("<Q", 2**63 + 5),
        r"the length of metadata key 0 is",
    ),
    "an item's string length": (
        dict(kvs=1, pad=64),
        _kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 2))
        + _string("a")
        + struct.pack("<Q", 2**40),
        r"the length of item 1 of metadata 'tokenizer\.ggml\.tokens' is",
    ),
    "kv_count": (dict(kvs=2**40, pad=4_500), ARCH, r"kv_count \(header\) is 1,099,511,627,776"),
    "tensor_count": (
        dict(tensors=2**40, pad=4_500),
        ARCH,
        r"tensor_count \(header\) is 1,099,511,627,776",
    ),
    "both counts together": (
        dict(tensors=50, kvs=100, pad=2_000),
        ARCH,
        r"tensor_count 50 and kv_count 100 \(header\) need more than",
    ),
    "n_dims": (
        dict(tensors=1, pad=4_500),
        ARCH + _string("token_embd.weight") + struct.pack("<I", 2**32 - 1),
        r"tensor 'token_embd\.weight' has n_dims=4294967295; GGUF allows 1\.\.4",
    ),
    "tensor extent": (
        dict(tensors=1, pad=64),
        ARCH + _tensor("token_embd.weight", [2**31, 2**31, 2**31, 2**31]),
        r"tensor 'token_embd\.weight' \(dims \[2147483648, .*\]\) ends at byte [\d,]+ of a",
    ),
    "tensor offset": (
        dict(tensors=1, pad=64),
        ARCH + _tensor("output_norm.weight", [4], offset=2**63),
        r"tensor 'output_norm\.weight' \(dims \[4\]\) ends at byte",
    ),
    "tensor type": (
        dict(tensors=1, pad=64),
        ARCH + _tensor("output_norm.weight", [4], ggml_type=2**31),
        r"tensor 'output_norm\.weight' has unknown ggml type 2147483648",
    ),
    "misaligned offset": (
        dict(tensors=1, pad=128),
        ARCH + _tensor("output_norm.weight", [4], offset=4),
        r"data offset 4 is not a multiple of the alignment 32",
    ),
    "partial block": (
        dict(tensors=1, pad=128),
        ARCH + _tensor("blk.0.ffn_up.weight", [33, 2], ggml_type=Q4_1),
        r"tensor 'blk\.0\.ffn_up\.weight': its rows of 33 are not whole blocks of 32",
    ),
    "value type": (dict(kvs=1, pad=64), _kv("general.name", 99, b""), r"unknown value type 99"),
    "array of arrays": (
        dict(kvs=1, pad=64),
        _kv("general.tags", ARRAY, struct.pack("<IQ", ARRAY, 1)),
        r"metadata 'general\.tags' is an array of arrays",
    ),
    "array item type": (
        dict(kvs=1, pad=64),
        _kv("general.tags", ARRAY, struct.pack("<IQ", 77, 1)),
        r"an array of unknown item type 77",
    ),
    "duplicate key": (dict(kvs=2, pad=64), ARCH + ARCH, r"'general\.architecture' appears twice"),
    "duplicate tensor": (
        dict(tensors=2, pad=128),
        ARCH + _tensor("output_norm.weight", [4]) + _tensor("output_norm.weight", [4]),
        r"tensor 'output_norm\.weight' appears twice",
    ),
    "alignment": (
        dict(kvs=2, pad=64),
        ARCH + _kv("general.alignment", U32, struct.pack("<I", 24)),
        r"general\.alignment must be a power of two, got 24",
    ),
    "utf-8": (
        dict(kvs=1, pad=64),
        _kv("general.name", STRING, _string(b"\xff\xfe")),
        r"metadata 'general\.name' is not valid UTF-8",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_refused_at_once_naming_the_field(tmp_path, case) -> None:
    layout, body, words = HOSTILE[case]
    path = _file(tmp_path, body, **layout)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(GGUFFormatError, match=words):
            read_header(path, SIZES)
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < 1.0 and peak < 1_000_000, (seconds, peak)


def test_short_foreign_and_unknown_version_files_are_refused(tmp_path) -> None:
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(GGUFFormatError, match="a GGUF header takes 24 bytes; the file has 8"):
        read_header(short, SIZES)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(GGUFFormatError, match="no GGUF magic"):
        read_header(foreign, SIZES)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + struct.pack("<IQQ", 1, 0, 0))
    with pytest.raises(GGUFFormatError, match=r"GGUF version 1 is not supported"):
        read_header(old, SIZES)


def _written(path, endian) -> None:
    """A file with every metadata value type and three tensor types, by the gguf package."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60_000)
    writer.add_int16("t.i16", -30_000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_uint64("t.u64", 2**63 + 1)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_array("t.strings", ["a", "", "ünï"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    q = gguf.GGMLQuantizationType.Q8_0
    block = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), q)
    writer.add_tensor("q8", block, raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endian", ["LITTLE", "BIG"])
def test_metadata_and_tensor_table_equal_the_gguf_readers(tmp_path, endian) -> None:
    path = tmp_path / f"{endian}.gguf"
    _written(path, gguf.GGUFEndian[endian])
    header = read_header(path, SIZES)
    reader = gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.metadata == want
    assert header.byte_order == ("<" if endian == "LITTLE" else ">")
    assert header.metadata["t.u64"] == 2**63 + 1 and header.metadata["t.str"] == "héllo ✓"
    assert [t.name for t in reader.tensors] == list(header.tensors)
    for t in reader.tensors:
        ours = header.tensors[t.name]
        assert ours.shape == tuple(int(x) for x in reversed(t.shape))
        assert (ours.start, ours.n_bytes, ours.ggml_type) == (
            t.data_offset,
            t.n_bytes,
            int(t.tensor_type),
        )
