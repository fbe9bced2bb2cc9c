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
import itertools
import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch

HASH_NAME = "sha256"           # SHA-NI: 1.8 GB/s a core, where blake2b did 1.3 (the capture writer's largest cost)
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


_STORED_BLOCK = 0xFFFF
_FULL_BLOCK_HEADER = np.frombuffer(struct.pack("<BHH", 0, _STORED_BLOCK, 0), dtype=np.uint8)


def _stored_blocks(data: np.ndarray) -> np.ndarray:
    """data as deflate stored blocks, built with a handful of numpy calls (each releases the GIL)."""
    full, rest = divmod(data.size, _STORED_BLOCK)
    out = np.empty(data.size + 5 * (full + (rest > 0)), dtype=np.uint8)
    if full:
        blocks = out[:full * (_STORED_BLOCK + 5)].reshape(full, _STORED_BLOCK + 5)
        blocks[:, :5] = _FULL_BLOCK_HEADER
        blocks[:, 5:] = data[:full * _STORED_BLOCK].reshape(full, _STORED_BLOCK)
    if rest:
        tail = out[full * (_STORED_BLOCK + 5):]
        tail[:5] = np.frombuffer(struct.pack("<BHH", 0, rest, rest ^ 0xFFFF), dtype=np.uint8)
        tail[5:] = data[full * _STORED_BLOCK:]
    return out


def _huffman_deflate(data: np.ndarray) -> bytes:
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)


def shuffled(chunk: np.ndarray, widen_bf16: bool = False) -> tuple[np.ndarray, int]:
    """(HDF5's shuffle of a chunk as one contiguous byte array, number of leading zero bytes not in it).

    widen_bf16: the chunk holds bf16 bits (uint16) that the dataset stores as float32, whose two low byte
    planes are zero: they are not materialised.
    """
    data = np.ascontiguousarray(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1, chunk.itemsize).T)
    return data.reshape(-1), 2 * chunk.size if widen_bf16 else 0


def encode_shuffled(data: np.ndarray, zeros: int, plane: int, compression: str) -> np.ndarray:
    """The zlib stream of `zeros` zero bytes then `data` (planes of `plane` bytes), for write_direct_chunk
    under filters [shuffle, deflate]. All-zero planes become a few bytes; "fast" keeps the others as stored
    blocks, "small" Huffman-codes them."""
    nonzero = data.reshape(-1, plane).any(axis=1) if data.size else np.zeros(0, dtype=bool)
    parts = [np.frombuffer(_ZLIB_HEADER, dtype=np.uint8)]
    adler = _adler32_of_zeros(1, zeros)
    if zeros:
        parts.append(np.frombuffer(_zero_plane_deflate(zeros), dtype=np.uint8))
    for start, stop, is_data in _runs(nonzero):
        span = data[start * plane:stop * plane]
        if not is_data:
            parts.append(np.frombuffer(_zero_plane_deflate(span.size), dtype=np.uint8))
            adler = _adler32_of_zeros(adler, span.size)
            continue
        adler = zlib.adler32(span, adler)
        parts += [_small(span, plane) if compression == "small" else _stored_blocks(span)]
    parts += [np.frombuffer(_FINAL_EMPTY_BLOCK + struct.pack(">I", adler), dtype=np.uint8)]
    return np.concatenate(parts)


def _runs(flags: np.ndarray) -> list[tuple[int, int, bool]]:
    """Maximal runs of equal flags as (start, stop, flag)."""
    edges = [0, *(np.flatnonzero(flags[1:] != flags[:-1]) + 1).tolist(), flags.size]
    return [(a, b, bool(flags[a])) for a, b in itertools.pairwise(edges) if b > a]


def _small(span: np.ndarray, plane: int) -> np.ndarray:
    """Huffman-coded planes, each kept stored where coding does not shrink it."""
    parts = []
    for i in range(0, span.size, plane):
        packed = _huffman_deflate(span[i:i + plane])
        parts.append(np.frombuffer(packed, dtype=np.uint8) if len(packed) < plane else
                     _stored_blocks(span[i:i + plane]))
    return np.concatenate(parts)


def encode_chunks(arr: np.ndarray, origins: Sequence[tuple[int, ...]], chunk: tuple[int, ...], compression: str,
                  widen_bf16: bool) -> list[np.ndarray]:
    """Encoded chunks of arr at origins: one worker task covers several chunks, so fewer GIL hand-offs."""
    out = []
    for origin in origins:
        region = chunk_at(arr, origin, chunk)
        data, zeros = shuffled(region, widen_bf16)
        out.append(encode_shuffled(data, zeros, region.size, compression))
    return out


ROW_ENCODED = (torch.bfloat16, torch.float32, torch.float64)     # dtypes encode_rows takes


def row_chunk(dtype: torch.dtype, shape: Sequence[int], compression: str) -> int | None:
    """Rows a chunk where encode_rows can build a dataset's chunks, else None: "fast", a dtype stored as
    itself (or bf16, widened), and chunks of whole rows, as chunk_shape gives for all but very wide rows."""
    if compression != "fast" or dtype not in ROW_ENCODED or len(shape) == 0 or math.prod(shape) == 0:
        return None
    chunk = chunk_shape(shape, 4 if dtype == torch.bfloat16 else dtype.itemsize)
    return chunk[0] if tuple(chunk[1:]) == tuple(shape[1:]) else None


def encode_rows(t: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """[n_chunks, stream bytes] uint8 on t's device: the "fast" zlib stream of each chunk of `chunk_rows` rows
    of t under [shuffle, deflate] (the edge chunk zero-padded, as chunk_at). torch ops only, so a GPU tensor
    is encoded by the GPU and the host just writes the bytes; on the CPU they run in torch's own threads,
    without the GIL. Byte planes are kept as stored blocks (all-zero ones too); bf16's two zero widening
    planes are folded as in encode_shuffled, which this equals wherever no data plane is all zero."""
    flat = t.contiguous().reshape(-1)
    rows = t.shape[0]
    n_chunks = -(-rows // chunk_rows)
    elems = chunk_rows * (flat.numel() // rows)                # E elements a chunk
    if n_chunks * elems != flat.numel():
        flat = torch.cat([flat, flat.new_zeros(n_chunks * elems - flat.numel())])
    widen = t.dtype == torch.bfloat16
    item = flat.element_size()
    data = flat.view(torch.uint8).view(n_chunks, elems, item).transpose(1, 2).reshape(n_chunks, -1)  # shuffled
    size = data.shape[1]
    zeros = 2 * elems if widen else 0
    full, rest = divmod(size, _STORED_BLOCK)
    head = _ZLIB_HEADER + (_zero_plane_deflate(zeros) if zeros else b"")
    body = size + 5 * (full + (rest > 0))
    out = torch.empty(n_chunks, len(head) + body + 9, dtype=torch.uint8, device=t.device)
    out[:, :len(head)] = _bytes_tensor(head, t.device)
    if full:
        blocks = out[:, len(head):len(head) + full * (_STORED_BLOCK + 5)].view(n_chunks, full, _STORED_BLOCK + 5)
        blocks[:, :, :5] = _bytes_tensor(_FULL_BLOCK_HEADER.tobytes(), t.device)
        blocks[:, :, 5:] = data[:, :full * _STORED_BLOCK].view(n_chunks, full, _STORED_BLOCK)
    if rest:
        tail = out[:, len(head) + full * (_STORED_BLOCK + 5):len(head) + body]
        tail[:, :5] = _bytes_tensor(struct.pack("<BHH", 0, rest, rest ^ 0xFFFF), t.device)
        tail[:, 5:] = data[:, full * _STORED_BLOCK:]
    out[:, -9:-4] = _bytes_tensor(_FINAL_EMPTY_BLOCK, t.device)
    adler = _adler32_rows(data, zeros)
    for k, shift in enumerate((24, 16, 8, 0)):                 # big-endian
        out[:, out.shape[1] - 4 + k] = (adler >> shift) & 0xFF
    return out


def _adler32_rows(data: torch.Tensor, zeros: int) -> torch.Tensor:
    """adler32 of `zeros` zero bytes then each row of data [C, D] uint8, as int64 [C]. With the sums
    s = sum(b_i) and w = sum(i * b_i) (i from 0): A = 1 + s and B = zeros + D + D * s - w (mod 65521). w comes
    from row and column sums of a [Q, K] view, so no int64 copy of the data is made; int64 does not
    overflow below D = 2**22 (chunks are 1 MiB)."""
    n, size = data.shape
    k = 4096
    if size % k:
        data = torch.cat([data, data.new_zeros(n, k - size % k)], dim=1)
    grid = data.view(n, -1, k)
    by_q = grid.sum(2, dtype=torch.int64)                                   # [C, Q]
    by_r = grid.sum(1, dtype=torch.int64)                                   # [C, K]
    s = by_q.sum(1)
    w = (by_q * torch.arange(by_q.shape[1], device=data.device) * k).sum(1) + \
        (by_r * torch.arange(k, device=data.device)).sum(1)
    low = torch.remainder(1 + s, _ADLER_MOD)
    high = torch.remainder(zeros + size + size * s - w, _ADLER_MOD)
    return (high << 16) | low


@functools.lru_cache(maxsize=32)
def _bytes_tensor(raw: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


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


def read_rows(dset, start: int, stop: int, dtype: str) -> torch.Tensor:
    """Rows [start, stop) of a dataset in its original dtype (`from_storage` of the slice). Where the rows are
    whole chunks under [shuffle, deflate] (every dataset this writer makes), the chunks are read raw and
    decoded here: zlib inflates, the planes are put back with numpy, and bf16 comes straight from its two
    high byte planes, never as float32 (HDF5's own filter pipeline is about half as fast)."""
    chunks = dset.chunks
    whole_rows = chunks is not None and dset.ndim > 0 and tuple(chunks[1:]) == tuple(dset.shape[1:])
    plain_filters = dset.compression == "gzip" and dset.shuffle and not (dset.fletcher32 or dset.scaleoffset)
    if not (whole_rows and plain_filters and start % chunks[0] == 0):
        return from_storage(dset[start:stop], dtype)
    row_elems = math.prod(chunks[1:])
    parts = []
    for origin in range(start, stop, chunks[0]):
        mask, raw = dset.id.read_direct_chunk((origin,) + (0,) * (dset.ndim - 1))
        if mask:                                    # a filter was skipped for this chunk: let HDF5 decode it
            return from_storage(dset[start:stop], dtype)
        zeros, data = _inflate(raw, chunks[0] * row_elems * dset.dtype.itemsize)
        parts.append(_unshuffle(zeros, data, dset.dtype, dtype)[:min(chunks[0], stop - origin) * row_elems])
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    return flat.view(stop - start, *dset.shape[1:])


def _inflate(raw: bytes, size: int) -> tuple[int, np.ndarray]:
    """(z, data): the `size` bytes a chunk's zlib stream decodes to are z zero bytes, then `data`. A stream
    this module wrote for bf16 ("fast": the two zero planes, then stored blocks) is cut apart with numpy and
    checked against its adler32, and its zero planes are never materialised (inflating them byte by byte is
    most of zlib's time); any other stream goes through zlib (z = 0)."""
    zeros = size // 2
    zero_part = _zero_plane_deflate(zeros)
    head, body = 2 + len(zero_part), size - zeros
    full, rest = divmod(body, _STORED_BLOCK)
    n_blocks = full + (rest > 0)
    if len(raw) == head + body + 5 * n_blocks + 9 and raw[2:head] == zero_part:
        blocks = np.frombuffer(raw, dtype=np.uint8, offset=head, count=body + 5 * n_blocks)
        grid = blocks[:full * (_STORED_BLOCK + 5)].reshape(full, _STORED_BLOCK + 5)
        tail = blocks[full * (_STORED_BLOCK + 5):]
        if (grid[:, :5] == _FULL_BLOCK_HEADER).all() and (
                not rest or bytes(tail[:5]) == struct.pack("<BHH", 0, rest, rest ^ 0xFFFF)):
            data = np.empty(body, dtype=np.uint8)
            data[:full * _STORED_BLOCK] = grid[:, 5:].reshape(-1)
            data[full * _STORED_BLOCK:] = tail[5:]
            if zlib.adler32(data, _adler32_of_zeros(1, zeros)) == struct.unpack(">I", raw[-4:])[0]:
                return zeros, data
    return 0, np.frombuffer(zlib.decompress(raw), dtype=np.uint8)


def _unshuffle(zeros: int, data: np.ndarray, stored: np.dtype, dtype: str) -> torch.Tensor:
    """A decoded chunk (byte planes: `zeros` zero bytes, then `data`) -> flat tensor of `dtype`."""
    n = (zeros + data.size) // stored.itemsize
    if dtype == "bfloat16" and stored == np.float32 and zeros in (0, 2 * n):   # bf16 = the two high planes
        high = data[2 * n - zeros:]
        bits = np.empty((n, 2), dtype=np.uint8)
        bits[:, 0], bits[:, 1] = high[:n], high[n:2 * n]
        return torch.from_numpy(bits.view(np.int16).reshape(-1)).view(torch.bfloat16)
    planes = np.concatenate([np.zeros(zeros, dtype=np.uint8), data]).reshape(stored.itemsize, n)
    return from_storage(np.ascontiguousarray(planes.T).view(stored).reshape(-1), dtype)


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
    """SHA-256 of a host tensor's bytes in its own dtype, C order."""
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{HASH_NAME}:{hashlib.sha256(data).hexdigest()}"


