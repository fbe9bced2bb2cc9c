"""HDF5 chunks written directly: shuffle + deflate streams built per byte plane, storage dtypes, hashes.

A chunk of n elements of itemsize s is stored shuffled (byte 0 of every element, then byte 1 ...) and then
deflated, exactly what HDF5's shuffle and deflate filters produce, so h5py, h5dump and every HDF5 tool
decode it. We build the zlib stream plane by plane: all-zero planes (the low half of a bf16 value widened
to float32) become a few bytes, the other planes are Huffman-coded ("small") or kept as deflate stored
blocks ("fast", a memcpy). General LZ77 deflate runs at 40-80 MB/s per core and would not keep up with a disk.
"""
from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch

HASH_NAME = "blake2b-256"
CHUNK_BYTES = 1 << 20           # target stored bytes per chunk: large enough for throughput, small for diff
_ZLIB_HEADER = b"\x78\x01"
_FINAL_EMPTY_BLOCK = b"\x01\x00\x00\xff\xff"
_ADLER_MOD = 65521


@functools.lru_cache(maxsize=64)
def _zero_plane_deflate(n: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_RLE)
    return c.compress(bytes(n)) + c.flush(zlib.Z_SYNC_FLUSH)


def _adler32_of_zeros(adler: int, n: int) -> int:
    low, high = adler & 0xFFFF, adler >> 16
    return (((high + n * low) % _ADLER_MOD) << 16) | low


def _stored_blocks(data: np.ndarray) -> list:
    view = memoryview(data).cast("B")
    parts = []
    for i in range(0, len(view), 0xFFFF):
        piece = view[i:i + 0xFFFF]
        parts += [struct.pack("<BHH", 0, len(piece), len(piece) ^ 0xFFFF), piece]
    return parts


def _huffman_deflate(data: np.ndarray) -> bytes:
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)


def shuffled_planes(chunk: np.ndarray, widen_bf16: bool = False) -> list[np.ndarray | int]:
    """HDF5's shuffle of a chunk as byte planes. widen_bf16: the chunk holds bf16 bits (uint16) that the
    dataset stores as float32, whose two low byte planes are zero (an int n stands for n zero bytes)."""
    planes = list(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1, chunk.itemsize).T.copy())
    return [chunk.size, chunk.size, *planes] if widen_bf16 else planes


def encode_planes(planes: Sequence[np.ndarray | int], compression: str) -> bytes:
    """The zlib stream of the concatenated planes, for write_direct_chunk under filters [shuffle, deflate]."""
    parts, adler = [_ZLIB_HEADER], 1
    for plane in planes:
        if isinstance(plane, int) or not plane.any():
            n = plane if isinstance(plane, int) else plane.size
            parts.append(_zero_plane_deflate(n))
            adler = _adler32_of_zeros(adler, n)
            continue
        adler = zlib.adler32(plane, adler)
        packed = _huffman_deflate(plane) if compression == "small" else None
        parts += [packed] if packed is not None and len(packed) < plane.size else _stored_blocks(plane)
    parts += [_FINAL_EMPTY_BLOCK, struct.pack(">I", adler)]
    return b"".join(parts)


def encode_chunk(region: np.ndarray, compression: str, widen_bf16: bool) -> bytes:
    return encode_planes(shuffled_planes(region, widen_bf16), compression)


def chunk_shape(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Whole trailing dims while they fit in CHUNK_BYTES, then as many rows of the next dim as fit."""
    chunk = list(shape)
    budget = max(1, CHUNK_BYTES // itemsize)
    for i in range(len(shape) - 1, -1, -1):
        if budget >= shape[i]:
            budget //= max(shape[i], 1)
            continue
        chunk[i] = max(1, budget)
        chunk[:i] = [1] * i
        break
    return tuple(max(1, c) for c in chunk)


def chunk_at(arr: np.ndarray, origin: tuple[int, ...], chunk: tuple[int, ...]) -> np.ndarray:
    """The chunk starting at origin, zero-padded to the full chunk shape at the dataset's edges."""
    region = arr[tuple(slice(o, o + c) for o, c in zip(origin, chunk))]
    if region.shape == chunk:
        return region
    padded = np.zeros(chunk, dtype=arr.dtype)
    padded[tuple(slice(0, s) for s in region.shape)] = region
    return padded


# ---------------------------------------------------------------------------------------------------------
# Storage dtypes
# ---------------------------------------------------------------------------------------------------------
def storage_array(t: torch.Tensor) -> np.ndarray:
    """A host tensor as the numpy array we store: lossless, in a type plain HDF5 readers know."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:   # bf16 is the top half of a float32: widen by shifting, exact and fast
        bits = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        return (bits << 16).view(np.float32)
    if t.dtype == torch.bool:
        return t.numpy().view(np.uint8)
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        return t.float().numpy()    # fp16 and fp8 formats are exactly representable in float32
    return t.numpy()


def from_storage(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of storage_array (bit-exact for bf16, NaN payloads included)."""
    arr = np.asarray(arr)
    if dtype == "bfloat16":
        return torch.from_numpy((arr.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr.copy() if not arr.flags.c_contiguous else arr).to(getattr(torch, dtype))


def source_array(t: torch.Tensor) -> tuple[np.ndarray, np.dtype, bool]:
    """(array to cut chunks from, dataset dtype, whether it holds bf16 bits widened while encoding).

    bf16 is never materialised as float32: its bits are the float32's top half, so the encoder emits two
    zero byte planes and the bf16 bytes shuffled.
    """
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), np.dtype(np.float32), True
    arr = storage_array(t)
    return arr, arr.dtype, False


def content_hash(t: torch.Tensor) -> str:
    """blake2b-256 of a host tensor's bytes in its own dtype, C order."""
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{HASH_NAME}:{hashlib.blake2b(data, digest_size=32).hexdigest()}"


