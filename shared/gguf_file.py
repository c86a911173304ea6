"""A GGUF file's header in one quick pass: its metadata, its tensor directory, and each tensor's bytes (a memmap).

gguf-py's ``GGUFReader`` builds numpy views for every element of every metadata array: SmolLM2's vocabulary and
merges (about 196,000 strings) cost it 4.2 s per parse on a quiet core of this machine, and a node used to parse its
file three times on the way up (config, span, self-test). Nothing on a node reads the tokenizer's arrays, so this
reader walks the header with ``struct`` as the GGUF spec lays it out (ggml's docs/gguf.md), steps over arrays of
strings by their lengths without decoding them, and leaves what is hard to gguf-py: the quantization formats
(``gguf.quants.dequantize``) and the tensor-name table. The same file parses here in about 0.1 s.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from shared.errors import ModelLoadError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (the spec's gguf_metadata_value_type) and the struct format of each scalar one.
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

# Arrays of strings longer than this (the tokenizer's vocabulary and merges) are stepped over, not decoded.
LONGEST_DECODED_STRINGS = 256

MetadataValue = int | float | bool | str | tuple[int | float | bool, ...] | tuple[str, ...]


@dataclass(frozen=True)
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # row-major (Hugging Face order); ggml lists dimensions innermost first
    kind: GGMLQuantizationType
    data: np.ndarray  # the raw bytes, uint8 [*shape[:-1], bytes per row]: what gguf.quants.dequantize takes


@dataclass(frozen=True)
class GgufFile:
    """``metadata``: every key except long arrays of strings (the tokenizer's), whose lengths are in
    ``string_arrays``."""

    path: str
    metadata: dict[str, MetadataValue]
    string_arrays: dict[str, int]
    tensors: dict[str, GgufTensor]


class _Cursor:
    """Little-endian reads from the mapped file, advancing an offset (``struct`` on the mmap: no copies)."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def uint(self, fmt: str) -> int:
        return int(self.scalar(fmt))

    def string(self) -> str:
        length = self.uint("Q")
        start, self.offset = self.offset, self.offset + length
        return self.buffer[start : self.offset].decode("utf-8")

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.offset += 8 + self.uint("Q")

    def value(self, kind: int) -> MetadataValue:
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        raise ModelLoadError(f"GGUF metadata value of unknown type {kind}")


def read_gguf(path: str | Path) -> GgufFile:
    """Parses the header of ``path``; raises ``ModelLoadError`` when it is not a GGUF file we can read."""
    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(str(path), buffer)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the GGUF file {path}: {exc}") from exc


def _parse(path: str, buffer: mmap.mmap) -> GgufFile:
    cursor = _Cursor(buffer)
    if buffer[:4] != MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic)")
    cursor.offset = 4
    version = cursor.uint("I")
    if version not in SUPPORTED_VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported ({SUPPORTED_VERSIONS})")
    tensor_count, kv_count = cursor.uint("Q"), cursor.uint("Q")
    metadata: dict[str, MetadataValue] = {}
    string_arrays: dict[str, int] = {}
    for _ in range(kv_count):
        key, kind = cursor.string(), cursor.uint("I")
        if kind != _ARRAY:
            metadata[key] = cursor.value(kind)
            continue
        item_kind, count = cursor.uint("I"), cursor.uint("Q")
        if item_kind == _STRING and count <= LONGEST_DECODED_STRINGS:
            metadata[key] = tuple(cursor.string() for _ in range(count))
        elif item_kind == _STRING:
            cursor.skip_strings(count)
            string_arrays[key] = count
        elif item_kind in _SCALARS:
            fmt = f"<{count}{_SCALARS[item_kind]}"
            metadata[key] = struct.unpack_from(fmt, buffer, cursor.offset)
            cursor.offset += struct.calcsize(fmt)
        else:
            raise ModelLoadError(f"{path}: metadata {key} is an array of type {item_kind}, which we cannot read")
    directory = [_tensor_entry(cursor) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ModelLoadError(f"{path}: general.alignment {alignment!r} is not a positive integer")
    data_start = -(-cursor.offset // alignment) * alignment  # the tensors' data begins at the next aligned offset
    raw = np.frombuffer(buffer, dtype=np.uint8)
    tensors = {name: _tensor(raw, data_start, name, dims, kind, at) for name, dims, kind, at in directory}
    return GgufFile(path, metadata, string_arrays, tensors)


def _tensor_entry(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cursor.string()
    dims = tuple(cursor.uint("Q") for _ in range(cursor.uint("I")))
    kind = GGMLQuantizationType(cursor.uint("I"))
    return name, dims, kind, cursor.uint("Q")


def _tensor(
    raw: np.ndarray, data_start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, at: int
) -> GgufTensor:
    shape = tuple(reversed(dims))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    if shape[-1] % block_size:
        raise ModelLoadError(f"tensor {name}: rows of {shape[-1]} are not whole {kind.name} blocks of {block_size}")
    row_bytes = shape[-1] // block_size * type_size
    size = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
    start = data_start + at
    if start + size > raw.size:
        raise ModelLoadError(f"tensor {name} runs past the end of the file (truncated?)")
    return GgufTensor(name, shape, kind, raw[start : start + size].reshape(*shape[:-1], row_bytes))
