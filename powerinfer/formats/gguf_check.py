"""Reading a GGUF file's header (metadata and tensor table) in one bounds-checked pass.

Written by hand instead of using `gguf.GGUFReader` for two measured reasons: the reader
builds a numpy view per metadata item and takes 2.3-2.5 s on SmolLM2's 49k-token vocabulary
(this pass: 0.05-0.1 s, so a load or a refusal is fast), and it parses by indexing a memory
map, so a file cut short or with a corrupt length fails deep inside it (IndexError, struct
errors, huge allocations) with nothing that says where. Here every length, count, type and
offset is checked against the file's size as it is read, and an error names the field or
tensor that is cut short or corrupt. Tensor data is not read: tensors are views of a
copy-on-write memory map of the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ModelFileError

# GGUF metadata value types: fixed-size scalars (struct format), 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# element dtypes of the non-block GGML types (others are blocks of bytes)
_ELEMENT = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
            "I32": np.int32, "I64": np.int64, "BF16": np.uint16}


@dataclass
class GGUFTensor:
    """One tensor of the table: `shape` innermost-first as GGUF lists it; `data` a view of
    the file: elements shaped (rows, cols) for element types, (rows, bytes) for blocks."""

    name: str
    shape: list[int]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # absolute, in the file
    n_bytes: int
    data: np.ndarray | None = None


@dataclass
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    data_start: int


class _Cursor:
    """Reads little-endian values from a file, refusing to read past its end."""

    def __init__(self, data: bytes, path: str):
        self.data, self.path, self.size, self.pos = data, path, len(data), 0

    def cut(self, what: str, need: int) -> ModelFileError:
        return ModelFileError(f"{self.path}: truncated GGUF file: {what} is cut short "
                              f"(needs {need} bytes at byte {self.pos}, the file has {self.size})")

    def corrupt(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: corrupt GGUF file: {what}")

    def take(self, n: int, what: str) -> memoryview:
        if n > self.size - self.pos:
            raise self.cut(what, n) if n < 1 << 40 else self.corrupt(f"{what} claims {n} bytes")
        view = memoryview(self.data)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack_from("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"the length of {what}")
        raw = self.take(n, what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not UTF-8 text") from None

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings (`what`[i]) one after another: `string`'s checks and messages in one
        loop, since a vocabulary's ~100k strings through `string` were most of a load's header
        time (docs/BENCHMARKS.md "Loading")."""
        data, pos, size = self.data, self.pos, self.size
        length = struct.Struct("<Q").unpack_from
        view = memoryview(data)
        out = []
        append = out.append
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                raise self.cut(f"the length of {what}[{i}]", 8)
            n = length(data, pos)[0]
            pos += 8
            if n > size - pos:
                self.pos = pos
                raise self.cut(f"{what}[{i}]", n) if n < 1 << 40 else self.corrupt(f"{what}[{i}] claims {n} bytes")
            try:
                append(str(view[pos:pos + n], "utf-8"))
            except UnicodeDecodeError:
                self.pos = pos + n
                raise self.corrupt(f"{what}[{i}] is not UTF-8 text") from None
            pos += n
        self.pos = pos
        return out


def _value(c: _Cursor, vtype: int, what: str) -> Any:
    if vtype in _SCALARS:
        return c.scalar(_SCALARS[vtype], what)
    if vtype == _STRING:
        return c.string(what)
    if vtype != _ARRAY:
        raise c.corrupt(f"{what} has unknown value type {vtype}")
    item_type = c.scalar("I", f"the item type of {what}")
    count = c.scalar("Q", f"the length of {what}")
    if item_type in _NUMPY:
        item = np.dtype(_NUMPY[item_type]).itemsize
        raw = c.take(count * item if count < 1 << 40 else 1 << 41, what)
        return np.frombuffer(raw, dtype=np.dtype(_NUMPY[item_type]).newbyteorder("<")).tolist()
    if item_type == _STRING:
        if count > c.size:  # every string takes at least its 8-byte length
            raise c.corrupt(f"{what} claims {count} strings")
        return c.strings(count, what)
    raise c.corrupt(f"{what} has unknown item type {item_type}" if item_type != _ARRAY
                    else f"{what} is an array of arrays")


def read_header(path: str, size: int) -> GGUFHeader:
    """Metadata and tensor table of the GGUF file at `path` (of `size` bytes), checked;
    raises a one-line ModelFileError naming the first field or tensor cut short or corrupt."""
    import mmap

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        # mapped, not read: only the header's pages are touched (closed when unreferenced)
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    return _parse(_Cursor(view, path), path, size, GGML_QUANT_SIZES, GGMLQuantizationType)


def _parse(c: _Cursor, path: str, size: int, quant_sizes: dict, quant_type: Any) -> GGUFHeader:
    c.take(4, "the magic number")
    version = c.scalar("I", "the version")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = c.scalar("Q", "the tensor count")
    n_fields = c.scalar("Q", "the metadata count")
    if n_tensors > size // 24 or n_fields > size // 12:  # a tensor entry or a field takes at least this
        raise ModelFileError(f"{path}: truncated or corrupt GGUF file: its header lists {n_tensors} tensors "
                             f"and {n_fields} metadata fields, more than its {size} bytes can hold")
    metadata: dict[str, Any] = {}
    for i in range(n_fields):
        key = c.string(f"metadata key #{i}")
        vtype = c.scalar("I", f"the type of metadata field {key}")
        metadata[key] = _value(c, vtype, f"metadata field {key}")
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise c.corrupt("general.alignment must be a power of two")
    infos = []
    for i in range(n_tensors):
        name = c.string(f"the name of tensor #{i}")
        n_dims = c.scalar("I", f"the dimension count of tensor {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.corrupt(f"tensor {name} has {n_dims} dimensions")
        dims = [c.scalar("Q", f"the shape of tensor {name}") for _ in range(n_dims)]
        type_id = c.scalar("I", f"the type of tensor {name}")
        offset = c.scalar("Q", f"the data offset of tensor {name}")
        try:
            qtype = quant_type(type_id)
            block, type_size = quant_sizes[qtype]
        except (ValueError, KeyError):
            raise c.corrupt(f"tensor {name} has unknown type {type_id}") from None
        if any(d == 0 or d >= 1 << 40 for d in dims) or dims[0] % block:
            raise c.corrupt(f"tensor {name} has shape {dims}, not whole {qtype.name} blocks of {block}")
        if offset % alignment:
            raise c.corrupt(f"tensor {name}'s offset {offset} is not aligned")
        count = int(np.prod(dims, dtype=object))
        infos.append(GGUFTensor(name, dims, qtype, offset, count // block * type_size))
    data_start = -(-c.pos // alignment) * alignment
    tensors = {}
    for t in infos:
        t.data_offset += data_start
        end = t.data_offset + t.n_bytes
        if end > size:
            raise ModelFileError(f"{path}: truncated GGUF file: tensor {t.name} is cut short "
                                 f"(it ends at byte {end}, the file has {size})")
        if t.name in tensors:
            raise c.corrupt(f"tensor {t.name} is listed twice")
        tensors[t.name] = t
    return GGUFHeader(metadata, tensors, data_start)


def map_tensors(path: str, header: GGUFHeader) -> np.memmap:
    """Map the file copy-on-write and give each tensor its `data` view; returns the map."""
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    for t in header.tensors.values():
        raw = mm[t.data_offset:t.data_offset + t.n_bytes]
        rows = int(np.prod(t.shape[1:], dtype=np.int64)) if len(t.shape) > 1 else 1
        element = _ELEMENT.get(t.tensor_type.name)
        if element is not None:
            shape = tuple(int(d) for d in reversed(t.shape))
            t.data = raw.view(element).reshape(shape)
        else:
            t.data = raw.reshape(rows, t.n_bytes // rows)
    return mm
