"""The tensor index of a GGUF file (v2 / v3, little-endian): each tensor's name, type, dims and
bytes, read from the header without decoding the metadata arrays (a tokenizer's vocabulary and
merges: gguf.GGUFReader builds an object per entry, ~4 s for SmolLM2's, more for Llama-3's).

Invariant: a tensor's bytes are the file's (a read-only map of them; the caller copies).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# metadata value types -> their size in bytes (fixed-size ones)
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass
class GgufTensorInfo:
    name: str
    type_id: int  # gguf.GGMLQuantizationType's value
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    data: np.ndarray  # uint8 [bytes]: the tensor's bytes in the file


@dataclass
class GgufIndex:
    metadata: dict[str, object]  # the scalar and string values (arrays are skipped)
    tensors: list[GgufTensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise GgufFormatError("the header runs past the end of the file")
        out = self.buf[self.pos: self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> object:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GgufFormatError("the header runs past the end of the file")
        out = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return out

    def string(self) -> str:
        n = self.unpack("<Q")
        return self.take(int(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> object:
        """A metadata value; an array is skipped (None)."""
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), int(self.unpack("<Q"))
            if etype in _SCALAR_SIZES:
                self.skip(_SCALAR_SIZES[etype] * count)
            elif etype == _STRING:
                for _ in range(count):
                    self.skip(int(self.unpack("<Q")))
            else:
                for _ in range(count):
                    self.value(etype)
            return None
        raise GgufFormatError(f"unknown metadata value type {vtype}")

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GgufFormatError("the header runs past the end of the file")
        self.pos += n


def read_index(path: Path) -> GgufIndex:
    """The metadata scalars and the tensor index of the GGUF file at `path`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf)
    if cur.take(4) != MAGIC:
        raise GgufFormatError("not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GgufFormatError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file?)")
    n_tensors, n_kv = int(cur.unpack("<Q")), int(cur.unpack("<Q"))
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(int(cur.unpack("<I")))
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(int(cur.unpack("<Q")) for _ in range(int(cur.unpack("<I"))))
        infos.append((name, int(cur.unpack("<I")), dims, int(cur.unpack("<Q"))))
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))  # type: ignore[call-overload]
    start = -(-cur.pos // align) * align
    tensors = []
    for name, type_id, dims, offset in infos:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise GgufFormatError(f"tensor {name} has unknown type {type_id}") from None
        nbytes = int(np.prod(dims, dtype=np.int64)) // block * size
        begin = start + offset
        if begin + nbytes > len(buf):
            raise GgufFormatError(f"tensor {name} runs past the end of the file (truncated?)")
        tensors.append(GgufTensorInfo(name, type_id, dims, np.frombuffer(buf, np.uint8, nbytes, begin)))
    return GgufIndex(metadata, tensors)
