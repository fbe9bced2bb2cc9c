"""Minimal safetensors I/O: validated header parsing, memory-mapped tensor reads, streaming writes.

Own implementation rather than the `safetensors` package because (a) its torch binding has no F8_E8M0 in the
version we pin, (b) a debugger must say exactly what is wrong with a damaged file, and (c) a tensor read must
touch that tensor's bytes only (one mmap per file; a tensor is a view of its byte range).
File layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}, ...,
"__metadata__": {str: str}}, then the data; offsets are relative to the end of the header.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import mmap
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import BadInput

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
ALIGN = 8


@dataclass(frozen=True)
class TensorEntry:
    name: str
    path: Path                 # the file holding it
    dtype_name: str            # safetensors spelling, e.g. F8_E4M3
    shape: tuple[int, ...]
    start: int                 # absolute byte offset in the file
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]


class SafetensorsFile:
    """A parsed, validated safetensors header; tensors are read lazily through one private mmap."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = self.path.stat().st_size
        self.header_bytes = self._read_header()
        self.metadata, self.entries = self._parse(self.header_bytes)
        self._map: mmap.mmap | None = None

    def _bad(self, what: str) -> BadInput:
        return BadInput(f"{self.path}: {what}")

    def _read_header(self) -> bytes:
        if self.size < 8:
            raise self._bad(f"truncated: {self.size} bytes, but a safetensors file starts with an 8-byte "
                            "header length")
        with open(self.path, "rb") as f:
            prefix = f.read(8)
            (n,) = struct.unpack("<Q", prefix)
            if 8 + n > self.size:
                raise self._bad(f"header length {n} runs past the end of the file ({self.size} bytes): "
                                "truncated or not a safetensors file")
            return prefix + f.read(n)

    def _parse(self, header: bytes) -> tuple[dict, dict[str, TensorEntry]]:
        try:
            doc = json.loads(header[8:].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not valid JSON ({e}); the file is corrupt") from None
        if not isinstance(doc, dict):
            raise self._bad("header is not a JSON object; the file is corrupt")
        metadata = doc.pop("__metadata__", None) or {}
        data_start = len(header)
        entries = {name: self._entry(name, info, data_start) for name, info in doc.items()}
        self._check_overlaps(entries)
        return metadata, entries

    def _entry(self, name: str, info: object, data_start: int) -> TensorEntry:
        if not isinstance(info, dict):
            raise self._bad(f"tensor '{name}': header entry is not an object")
        dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype_name not in DTYPES:
            raise self._bad(f"tensor '{name}': unknown dtype {dtype_name!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise self._bad(f"tensor '{name}': bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise self._bad(f"tensor '{name}': bad data_offsets {offsets!r}")
        begin, end = offsets
        need = math.prod(shape) * DTYPES[dtype_name].itemsize
        if end - begin != need:
            raise self._bad(f"tensor '{name}': data_offsets {offsets} hold {end - begin} bytes but "
                            f"{dtype_name}{shape} needs {need}")
        if data_start + end > self.size:
            raise self._bad(f"tensor '{name}': data ends at byte {data_start + end}, beyond the file's "
                            f"{self.size} bytes (truncated shard?)")
        return TensorEntry(name, self.path, dtype_name, tuple(shape), data_start + begin, need)

    def _check_overlaps(self, entries: dict[str, TensorEntry]) -> None:
        ordered = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.start)
        for prev, cur in itertools.pairwise(ordered):
            if cur.start < prev.start + prev.nbytes:
                raise self._bad(f"tensors '{prev.name}' and '{cur.name}' overlap in the data section")

    def read(self, entry: TensorEntry) -> torch.Tensor:
        """The tensor as a zero-copy view of its bytes (copy-on-write: writing to it never touches the file)."""
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._map, dtype=entry.dtype, count=entry.nbytes // entry.dtype.itemsize,
                                offset=entry.start)
        return flat.view(entry.shape)


def _layout(tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None
            ) -> tuple[bytes, dict[str, int], int]:
    """(length + header bytes, absolute start of each tensor, file size). Tensors go by decreasing element
    size (stable, so module order is kept within a size), which keeps every one aligned."""
    order = sorted(tensors, key=lambda n: -tensors[n][0].itemsize)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offsets, offset = {}, 0
    for name in order:
        dtype, shape = tensors[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[name], offset = offset, offset + nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % ALIGN)
    data_start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {n: data_start + o for n, o in offsets.items()}, data_start + offset


@contextlib.contextmanager
def safetensors_writer(path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                       metadata: dict[str, str] | None = None) -> Iterator[Callable[[str, torch.Tensor], None]]:
    """Write one file whose tensor list (name -> dtype, shape) is known up front: the header first, then
    each tensor, in any order, through the yielded `write(name, tensor)`."""
    header, starts, size = _layout(tensors, metadata)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)

        def write(name: str, tensor: torch.Tensor) -> None:
            dtype, shape = tensors[name]
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name}: got {tensor.dtype}{list(tensor.shape)}, planned {dtype}{list(shape)}")
            f.seek(starts[name])
            f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

        yield write
