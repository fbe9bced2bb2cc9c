"""A capture site's statistics in one launch: the PARTIALS of dsv4debug.tensorstats, one row per CTA.

Eager torch takes about 20 small kernels a site (masks, where, six reductions, casts, a stack), about 1 ms of
launches and dispatch per site; a Pro layer records ~436 sites, so a stats-only capture cost 2.3x the
forward on the H200. This kernel reads the tensor once: each CTA takes a contiguous block of BLOCK elements
(128-bit loads, consecutive threads on consecutive vectors) and writes one float64 row of
(nan_count, finite_count, min, max, sum, sum_sq, first non-finite index in the block or -1); the host combines
the rows with `tensorstats.combine_blocks(rows, numel, block)`, as it does the eager chunks. Counts, extremes
and the first index are exact; sums accumulate the fp32 values (exact for bf16 and fp32) in float64 per thread,
then through a shared-memory tree, so they match eager's float64 sums to rounding.
Non-finite by the exponent bits (all ones), NaN when the mantissa is also non-zero.
"""
from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float32, Float64, Int32, cute
from cutlass.memory import SmemAllocator

from ._common import (
    BOTH,
    KernelDef,
    check_numel,
    compile_kernel,
    current_stream,
    device_arch,
    f32_bits,
    fake_ptr,
    fake_stream,
    ptr,
    register,
)

_DTYPES = {"bf16": BFloat16, "fp32": Float32}
THREADS = 256
ITERS = 16                  # vectors per thread per CTA
NONE = 1 << 30              # "no non-finite element yet" (blocks are far smaller)
N_PARTIALS = 7


class SiteStats:
    def __init__(self, dtype: str = "bf16"):
        self.dtype = _DTYPES[dtype]
        self.vec = 128 // self.dtype.width
        self.block = THREADS * ITERS * self.vec          # elements per CTA

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, out_ptr: cute.Pointer, n_vec: Int32, n_cta: Int32, stream):
        mX = cute.make_tensor(x_ptr, cute.make_layout((self.vec, n_vec), stride=(1, self.vec)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((N_PARTIALS, n_cta), stride=(1, N_PARTIALS)))
        self.kernel(mX, mOut, n_vec).launch(grid=[n_cta, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, n_vec: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        n_nan, n_fin, first = Int32(0), Int32(0), Int32(NONE)
        lo, hi = Float32(float("inf")), Float32(float("-inf"))
        total, sum_sq = Float64(0.0), Float64(0.0)
        for it in cutlass.range_constexpr(ITERS):
            local = it * THREADS + tidx                      # vector index within the CTA's block
            v = bidx * (THREADS * ITERS) + local
            if v < n_vec:
                rX = cute.make_rmem_tensor((self.vec,), self.dtype)
                cute.autovec_copy(mX[None, v], rX)
                x = rX.load().to(Float32)
                for e in cutlass.range_constexpr(self.vec):
                    val = x[e]
                    bits = f32_bits(val)
                    special = (bits & 0x7F800000) == 0x7F800000
                    finite = not special
                    n_nan += cutlass.select_(special and (bits & 0x7FFFFF) != 0, Int32(1), Int32(0))
                    n_fin += cutlass.select_(finite, Int32(1), Int32(0))
                    lo = cutlass.select_(finite and val < lo, val, lo)
                    hi = cutlass.select_(finite and val > hi, val, hi)
                    kept = Float64(cutlass.select_(finite, val, Float32(0.0)))
                    total += kept
                    sum_sq += kept * kept
                    first = cutlass.select_(special and first == NONE, local * self.vec + e, first)

        smem = SmemAllocator()
        red_i = smem.allocate_tensor(Int32, cute.make_layout((3, THREADS), stride=(THREADS, 1)), byte_alignment=16)
        red_f = smem.allocate_tensor(Float32, cute.make_layout((2, THREADS), stride=(THREADS, 1)), byte_alignment=16)
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
            mOut[0, bidx] = Float64(red_i[0, 0])
            mOut[1, bidx] = Float64(red_i[1, 0])
            mOut[2, bidx] = Float64(red_f[0, 0])
            mOut[3, bidx] = Float64(red_f[1, 0])
            mOut[4, bidx] = red_d[0, 0]
            mOut[5, bidx] = red_d[1, 0]
            mOut[6, bidx] = cutlass.select_(red_i[2, 0] == NONE, Float64(-1.0), Float64(red_i[2, 0]))


def _build(dtype: str = "bf16"):
    return SiteStats(dtype), (fake_ptr(_DTYPES[dtype]), fake_ptr(Float64, 8), Int32(1), Int32(1), fake_stream())


register(KernelDef("site_stats", "capture", BOTH, _build, configs=({"dtype": "bf16"}, {"dtype": "fp32"}),
                   doc="a capture site's NaN/Inf counts, min, max, sums and first non-finite index, one row a CTA"))


# --------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------

def supports(t) -> bool:
    """Whether site_stats takes t: a contiguous bf16 or fp32 CUDA tensor, 16-byte aligned, whole vectors."""
    import torch
    if not (t.is_cuda and t.dtype in (torch.bfloat16, torch.float32) and t.is_contiguous()):
        return False
    return t.numel() > 0 and t.data_ptr() % 16 == 0 and t.numel() % (16 // t.element_size()) == 0


def block_of(t) -> int:
    """Elements per PARTIALS row (SiteStats.block) for t's dtype."""
    return THREADS * ITERS * (16 // t.element_size())


def n_rows(t) -> int:
    """PARTIALS rows (CTAs) site_stats writes for t."""
    return -(-t.numel() // block_of(t))


def site_stats(t, out=None):
    """PARTIALS rows of t (see the module doc), one per block_of(t) elements, written into `out` (float64
    [n_rows(t), 7] on t's device; allocated when None) and returned."""
    import torch
    if not supports(t):
        raise ValueError(f"site_stats takes contiguous, aligned bf16/fp32 CUDA tensors of whole 16-byte vectors, "
                         f"not {t.dtype} {tuple(t.shape)} on {t.device}")
    check_numel(t)
    n_cta = n_rows(t)
    if out is None:
        out = torch.empty(n_cta, N_PARTIALS, dtype=torch.float64, device=t.device)
    if out.shape != (n_cta, N_PARTIALS) or out.dtype != torch.float64 or not out.is_contiguous():
        raise ValueError(f"site_stats writes a contiguous float64 [{n_cta}, {N_PARTIALS}], not {out.dtype} "
                         f"{tuple(out.shape)}")
    dtype = "bf16" if t.dtype == torch.bfloat16 else "fp32"
    fn = compile_kernel("site_stats", device_arch(t.device), dtype=dtype)
    fn(ptr(t), ptr(out, Float64, 8), Int32(t.numel() // (16 // t.element_size())), Int32(n_cta), current_stream())
    return out
