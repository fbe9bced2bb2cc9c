"""Capture sites' statistics, many sites in one launch: the PARTIALS of dsv4debug.tensorstats, one row per CTA.

Eager torch takes about 20 small kernels a site (masks, where, six reductions, casts, a stack), and even one
launch a site costs the calling thread ~55 us of launcher: a Pro layer records ~430 sites and its forward is
bound by the host's launches, so a capture's statistics must be launched a batch of sites at a time. This
kernel works from a table with one row per site, (address, 16-byte vectors, first output row, first CTA): a
CTA finds its site among the table's rows (one row a thread, in one round trip), then reads its block of up to
BLOCK_VECTORS vectors of that tensor (consecutive threads on consecutive vectors) and writes one float64 row of
(nan_count, finite_count, min, max, sum, sum_sq, first non-finite index in the block or -1) at the site's
first row plus its block's index. A table of sites, not of CTAs, keeps the host's part of a launch small: a
per-CTA table of a Pro layer's batch (~7000 rows) took 0.15 ms to build and copy, and the launch waited for
the GPU wherever the GPU ran behind (2 ms a launch; the site table's does not: H200, 2026-12-03). A site's
rows are its consecutive blocks, which the host combines with `tensorstats.combine_segments` as it does the
eager chunks. Counts, extremes and the first index are exact; sums accumulate the values (bf16 and fp32
widened exactly, fp64 as they are) in float64 per thread, then through a shared-memory tree, so they match
eager's float64 sums to rounding.
Non-finite by the exponent bits (all ones), NaN when the mantissa is also non-zero.
"""
from __future__ import annotations

import functools
import itertools

import cutlass
import numpy as np
import torch
from cutlass import BFloat16, Float32, Float64, Int32, Int64, cute
from cutlass.memory import SmemAllocator

from ._common import (
    BOTH,
    KernelDef,
    check_numel,
    compile_kernel,
    current_stream,
    device_arch,
    f32_bits,
    f64_bits,
    fake_ptr,
    fake_stream,
    kernel_arch,
    ptr,
    register,
)

_DTYPES = {"bf16": BFloat16, "fp32": Float32, "fp64": Float64}
THREADS = 256
ITERS = 16                          # vectors per thread per CTA
BLOCK_VECTORS = THREADS * ITERS     # 16-byte vectors per CTA (a table row)
NONE = 1 << 30                      # "no non-finite element yet" (blocks are far smaller)
N_PARTIALS = 7
TABLE_COLUMNS = 4                   # int64 a site: address, vectors, first output row, first CTA
MAX_SITES = THREADS                 # table rows a launch: one a thread (the launcher splits larger batches)


class SiteStats:
    def __init__(self, dtype: str = "bf16"):
        self.dtype = _DTYPES[dtype]
        self.vec = 128 // self.dtype.width
        self.wide = self.dtype is Float64           # fp64 (the noise floors' runs): its own bits and extremes
        self.value = Float64 if self.wide else Float32

    @cute.jit
    def __call__(self, table_ptr: cute.Pointer, out_ptr: cute.Pointer, n_sites: Int32, n_cta: Int32,
                 n_out: Int32, stream):
        mTable = cute.make_tensor(table_ptr, cute.make_layout((TABLE_COLUMNS, n_sites), stride=(1, TABLE_COLUMNS)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((N_PARTIALS, n_out), stride=(1, N_PARTIALS)))
        self.kernel(mTable, mOut, n_sites).launch(grid=[n_cta, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mTable: cute.Tensor, mOut: cute.Tensor, n_sites: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        mine = smem.allocate_tensor(Int32, cute.make_layout((1,)), byte_alignment=16)
        if tidx < n_sites:                                   # the one site whose CTAs include this one
            start = Int32(mTable[3, tidx])
            n_blocks = (Int32(mTable[1, tidx]) + (BLOCK_VECTORS - 1)) // BLOCK_VECTORS
            if start <= bidx and bidx < start + n_blocks:  # noqa: PLR1716 - as checked on the GPU (traced)
                mine[0] = tidx
        cute.arch.barrier()
        site = mine[0]
        block = bidx - Int32(mTable[3, site])
        address = mTable[0, site] + Int64(block) * (BLOCK_VECTORS * 16)
        n_vec = cutlass.min(Int32(mTable[1, site]) - block * BLOCK_VECTORS, Int32(BLOCK_VECTORS))
        row = Int32(mTable[2, site]) + block
        x_ptr = cute.make_ptr(self.dtype, address, cute.AddressSpace.gmem, assumed_align=16)
        mX = cute.make_tensor(x_ptr, cute.make_layout((self.vec, BLOCK_VECTORS), stride=(1, self.vec)))
        n_nan, n_fin, first = Int32(0), Int32(0), Int32(NONE)
        lo, hi = self.value(float("inf")), self.value(float("-inf"))
        total, sum_sq = Float64(0.0), Float64(0.0)
        for it in cutlass.range_constexpr(ITERS):
            local = it * THREADS + tidx                      # vector index within the CTA's block
            if local < n_vec:
                rX = cute.make_rmem_tensor((self.vec,), self.dtype)
                cute.autovec_copy(mX[None, local], rX)
                x = rX.load().to(self.value)
                for e in cutlass.range_constexpr(self.vec):
                    val = x[e]
                    if cutlass.const_expr(self.wide):
                        bits = f64_bits(val)
                        special = (bits & 0x7FF0000000000000) == 0x7FF0000000000000
                        nan = special and (bits & 0xFFFFFFFFFFFFF) != 0
                    else:
                        bits = f32_bits(val)
                        special = (bits & 0x7F800000) == 0x7F800000
                        nan = special and (bits & 0x7FFFFF) != 0
                    finite = not special
                    n_nan += cutlass.select_(nan, Int32(1), Int32(0))
                    n_fin += cutlass.select_(finite, Int32(1), Int32(0))
                    lo = cutlass.select_(finite and val < lo, val, lo)
                    hi = cutlass.select_(finite and val > hi, val, hi)
                    kept = Float64(cutlass.select_(finite, val, self.value(0.0)))
                    total += kept
                    sum_sq += kept * kept
                    first = cutlass.select_(special and first == NONE, local * self.vec + e, first)

        red_i = smem.allocate_tensor(Int32, cute.make_layout((3, THREADS), stride=(THREADS, 1)), byte_alignment=16)
        red_f = smem.allocate_tensor(self.value, cute.make_layout((2, THREADS), stride=(THREADS, 1)), byte_alignment=16)
        red_d = smem.allocate_tensor(Float64, cute.make_layout((2, THREADS), stride=(THREADS, 1)), byte_alignment=16)
        red_i[0, tidx], red_i[1, tidx], red_i[2, tidx] = n_nan, n_fin, first
        red_f[0, tidx], red_f[1, tidx] = lo, hi
        red_d[0, tidx], red_d[1, tidx] = total, sum_sq
        for level in cutlass.range_constexpr(THREADS.bit_length() - 1):     # a tree over the threads
            off = THREADS >> (level + 1)
            cute.arch.barrier()
            if tidx < off:
                o = tidx + off
                red_i[0, tidx] = red_i[0, tidx] + red_i[0, o]
                red_i[1, tidx] = red_i[1, tidx] + red_i[1, o]
                red_i[2, tidx] = cutlass.min(red_i[2, tidx], red_i[2, o])
                red_f[0, tidx] = cutlass.select_(red_f[0, o] < red_f[0, tidx], red_f[0, o], red_f[0, tidx])
                red_f[1, tidx] = cutlass.select_(red_f[1, o] > red_f[1, tidx], red_f[1, o], red_f[1, tidx])
                red_d[0, tidx] = red_d[0, tidx] + red_d[0, o]
                red_d[1, tidx] = red_d[1, tidx] + red_d[1, o]
        cute.arch.barrier()
        if tidx == 0:
            mOut[0, row] = Float64(red_i[0, 0])
            mOut[1, row] = Float64(red_i[1, 0])
            mOut[2, row] = Float64(red_f[0, 0])
            mOut[3, row] = Float64(red_f[1, 0])
            mOut[4, row] = red_d[0, 0]
            mOut[5, row] = red_d[1, 0]
            mOut[6, row] = cutlass.select_(red_i[2, 0] == NONE, Float64(-1.0), Float64(red_i[2, 0]))



def _build(dtype: str = "bf16"):
    return SiteStats(dtype), (fake_ptr(Int64, 8), fake_ptr(Float64, 8), Int32(1), Int32(1), Int32(1), fake_stream())


register(KernelDef("site_stats", "capture", BOTH, _build,
                   configs=({"dtype": "bf16"}, {"dtype": "fp32"}, {"dtype": "fp64"}),
                   doc="capture sites' NaN/Inf counts, min, max, sums and first non-finite index, one row a CTA, "
                       "many sites a launch"))


# --------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------

def layout(t) -> tuple[int, int] | None:
    """(PARTIALS rows, elements a row) that site_stats writes for t, or None where it does not take t: it takes
    contiguous bf16, fp32 and fp64 tensors, 16-byte aligned, of whole vectors and fewer than 2**31 elements
    (check_numel), on a GPU it is built for (ARCHS; on any other the capture takes torch ops and says so in
    `gpu_statistics`). Asked at every record()."""
    size = _ELEMENT_SIZES.get(t.dtype)
    if size is None or not (t.is_cuda and t.is_contiguous()):
        return None
    n, per_vector = t.numel(), 16 // size
    if not 0 < n < 2 ** 31 or n % per_vector or t.data_ptr() % 16 or not kernel_arch(t.get_device()):
        return None
    block = BLOCK_VECTORS * per_vector
    return -(-n // block), block


def supports(t) -> bool:
    """Whether site_stats takes t (see layout)."""
    return layout(t) is not None


_TORCH_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}
_ELEMENT_SIZES = {dtype: dtype.itemsize for dtype in _TORCH_NAMES}


def n_rows(t) -> int:
    """PARTIALS rows (CTAs) site_stats writes for t."""
    return -(-t.numel() // (BLOCK_VECTORS * (16 // t.element_size())))


def site_stats(tensors, first_rows, out, supported: bool = False) -> None:
    """PARTIALS rows of every tensor (each one site_stats `supports`), n_rows(t) of them from out[first_rows[i]]
    (out: contiguous float64 [rows, 7] on their device): one launch per dtype among them and MAX_SITES tensors,
    whatever their sizes. The launches are queued on the current stream; tensors may be freed once this
    returns. `supported`: the caller placed every tensor's rows by its `layout` inside `out`, on the tensors'
    device (a capture, at each record()): nothing is checked again (a capture's batch launches in the forward,
    where each check costs)."""
    if out.dtype != torch.float64 or not out.is_contiguous() or out.dim() != 2 or out.shape[1] != N_PARTIALS:
        raise ValueError(f"site_stats writes a contiguous float64 [rows, {N_PARTIALS}], not {out.dtype} "
                         f"{tuple(out.shape)}")
    if not supported:
        _check_placed(tensors, first_rows, out)
    arch, staging = device_arch(out.device), _staging(out.device)
    for dtype, name in _TORCH_NAMES.items():
        group = [(t, first) for t, first in zip(tensors, first_rows) if t.dtype == dtype]
        if not group:
            continue
        fn = compile_kernel("site_stats", arch, dtype=name)
        for at in range(0, len(group), MAX_SITES):
            part = group[at:at + MAX_SITES]
            table, n_cta = _table([t.data_ptr() for t, _ in part],
                                  [t.numel() * t.element_size() // 16 for t, _ in part], [first for _, first in part])
            device_table = staging.to_device(table)
            fn(ptr(device_table, Int64, 8), ptr(out, Float64, 8), Int32(len(part)), Int32(n_cta), Int32(out.shape[0]),
               current_stream())


def _check_placed(tensors, first_rows, out) -> None:
    """What site_stats asks of a caller that has not placed its tensors by `layout`."""
    for t, first in zip(tensors, first_rows, strict=True):
        if not supports(t) or t.device != out.device:
            raise ValueError(f"site_stats takes contiguous, aligned bf16/fp32/fp64 CUDA tensors of whole 16-byte "
                             f"vectors on the output's device, not {t.dtype} {tuple(t.shape)} on {t.device}")
        check_numel(t)
        if not 0 <= first or first + n_rows(t) > out.shape[0]:
            raise ValueError(f"site_stats rows [{first}, {first + n_rows(t)}) are outside out's {out.shape[0]}")


class _TableStaging:
    """Pinned host memory for launch tables, in two halves used in turn: a table is written into the current
    half and copied to the device in stream order, and a half is rewritten only after the copies of its
    previous turn have run (one event a turn). A launch then allocates no pinned memory: while the GPU runs
    behind the host, the caching host allocator has no free block and each allocation is a cudaHostAlloc."""

    HALF_ROWS = 1 << 14                           # 0.5 MiB a half, a row a site: ~40 Pro layers of ~420 sites

    def __init__(self, device):
        self.device = device
        self.host = torch.empty(2, self.HALF_ROWS, TABLE_COLUMNS, dtype=torch.int64, pin_memory=True)
        self.half, self.cursor = 0, 0
        self.turn_done: list = [None, None]       # an event after the last copy of each half's last turn

    def to_device(self, table: np.ndarray):
        n = len(table)                            # <= MAX_SITES
        if self.cursor + n > self.HALF_ROWS:
            self.turn_done[self.half] = torch.cuda.Event()
            self.turn_done[self.half].record()
            self.half, self.cursor = 1 - self.half, 0
            if self.turn_done[self.half] is not None:
                self.turn_done[self.half].synchronize()
        region = self.host[self.half, self.cursor:self.cursor + n]
        region.numpy()[:] = table
        self.cursor += n
        return region.to(self.device, non_blocking=True)


@functools.cache
def _staging(device) -> _TableStaging:
    return _TableStaging(device)


def _table(addresses, vectors, first_rows) -> tuple[np.ndarray, int]:
    """The launch table, one int64 row a site (address, vectors, first output row, first CTA), and its CTAs."""
    blocks = [-(-v // BLOCK_VECTORS) for v in vectors]
    starts = list(itertools.accumulate(blocks, initial=0))
    return np.array([addresses, vectors, first_rows, starts[:-1]], dtype=np.int64).T, starts[-1]
