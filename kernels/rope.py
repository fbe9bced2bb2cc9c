"""Rotary embedding on the last `r` (64) of `d` (512) dims, interleaved pairs, forward and inverse
(dsv4_references.rope.apply_rope).

The cos/sin table is the reference's own freqs_cis (dsv4_references.rope.rope_freqs: theta, or the
compressed layers' theta with YaRN), read through torch.view_as_real as fp32 [S, r/2, 2] (cos, sin) pairs, so
the kernel sees exactly the reference's table. Pair i of a row at position s becomes
(a*c - b*s, a*s + b*c) in fp32 (s negated for the inverse) and is rounded once to bf16.

Two forms:
- `rope` (out of place, what the debugger's flow needs: the input stays intact): one thread per 8-element
  vector of the row; the first d-r dims are copied, the last r rotated; one read and one write of the row.
- `rope_(inplace)` (what a serving stack does): only the r rope dims are read and written back.
"""
from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float32, Int32, const_expr, cute

from ._common import (
    BOTH,
    KernelDef,
    check_numel,
    compile_kernel,
    current_stream,
    device_arch,
    fake_ptr,
    fake_stream,
    ptr,
    register,
)

VEC = 8            # bf16 elements per 128-bit access


class Rope:
    """x [S*H, d] rows (row -> position row // H), cs [S, r/2, 2] fp32, o [S*H, d] (or x itself)."""

    def __init__(self, d: int, r: int, inverse: bool, inplace: bool, unroll: int = 2):
        if d % VEC or r % VEC or r > d:
            raise ValueError(f"rope: d={d}, r={r} must be multiples of {VEC} with r <= d")
        self.d, self.r, self.inverse, self.inplace, self.unroll = d, r, inverse, inplace, unroll
        self.first = 0 if not inplace else (d - r) // VEC        # first vector of the row this kernel touches
        self.tpr = (d // VEC) - self.first                          # threads per row (one vector each)
        self.rope_from = (d - r) // VEC - self.first                # thread index where rotation starts
        self.threads = 256
        assert self.threads % self.tpr == 0
        self.rows_per_cta = self.threads // self.tpr * unroll

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, cs_ptr: cute.Pointer, o_ptr: cute.Pointer, rows: Int32, H: Int32,
                 stream):
        lay = cute.make_layout((VEC, self.tpr, rows), stride=(1, VEC, self.d))
        mX = cute.make_tensor(x_ptr + self.first * VEC, lay)
        mO = cute.make_tensor(o_ptr + self.first * VEC, lay)
        half = self.r // 2
        # cs[s, pair, 0/1]: thread j of the rope part needs pairs 4j..4j+3 = 8 contiguous floats
        mCS = cute.make_tensor(cs_ptr, cute.make_layout((VEC, self.r // VEC, rows), stride=(1, VEC, 2 * half)))
        self.kernel(mX, mCS, mO, rows, H).launch(
            grid=[cute.ceil_div(rows, self.rows_per_cta), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mCS: cute.Tensor, mO: cute.Tensor, rows: Int32, H: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = tidx % self.tpr
        groups = self.threads // self.tpr
        base = bidx * self.rows_per_cta + tidx // self.tpr
        rX = cute.make_rmem_tensor((VEC, self.unroll), BFloat16)
        rCS = cute.make_rmem_tensor((VEC, self.unroll), Float32)
        for u in cutlass.range_constexpr(self.unroll):       # issue every load first
            row = cutlass.min(base + u * groups, rows - 1)
            cute.autovec_copy(mX[None, t, row], rX[None, u])
            if t >= self.rope_from:
                cute.autovec_copy(mCS[None, t - self.rope_from, row // H], rCS[None, u])
        rO = cute.make_rmem_tensor((VEC, self.unroll), BFloat16)
        for u in cutlass.range_constexpr(self.unroll):
            row = base + u * groups
            if t >= self.rope_from:
                for p in cutlass.range_constexpr(VEC // 2):
                    a = rX[2 * p, u].to(Float32)
                    b = rX[2 * p + 1, u].to(Float32)
                    c = rCS[2 * p, u]
                    s = rCS[2 * p + 1, u]
                    if const_expr(self.inverse):
                        s = -s
                    rO[2 * p, u] = (a * c - b * s).to(BFloat16)
                    rO[2 * p + 1, u] = (a * s + b * c).to(BFloat16)
            else:
                for e in cutlass.range_constexpr(VEC):
                    rO[e, u] = rX[e, u]
            if row < rows:
                cute.autovec_copy(rO[None, u], mO[None, t, row])


def _build(d: int = 512, r: int = 64, inverse: bool = False, inplace: bool = False, unroll: int = 2):
    k = Rope(d, r, inverse, inplace, unroll)
    return k, (fake_ptr(BFloat16), fake_ptr(Float32), fake_ptr(BFloat16), Int32(1), Int32(1), fake_stream())


register(KernelDef(
    "rope", "rope", BOTH, _build,
    configs=({"d": 512, "r": 64, "inverse": False, "inplace": False}, {"d": 512, "r": 64, "inverse": True, "inplace": False},
             {"d": 512, "r": 64, "inverse": False, "inplace": True}, {"d": 512, "r": 64, "inverse": True, "inplace": True}),
    ci_configs=({"d": 512, "r": 64, "inverse": False, "inplace": False}, {"d": 512, "r": 64, "inverse": True, "inplace": True}),
    doc="interleaved RoPE on the last 64 of 512 dims, forward/inverse, out of place or in place"))


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------

def cos_sin(freqs):
    """freqs_cis [S, r/2] complex64 (dsv4_references.rope.rope_freqs) -> fp32 [S, r/2, 2] (cos, sin)."""
    import torch
    if freqs.dtype != torch.complex64:
        freqs = freqs.to(torch.complex64)
    return torch.view_as_real(freqs).contiguous()


def _launch(x, freqs, inverse: bool, out, unroll: int = 2):
    import torch
    if x.dtype != torch.bfloat16:
        raise ValueError(f"rope kernel takes bf16 activations, not {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("rope kernel needs a contiguous x")
    S, d = x.size(0), x.size(-1)
    r = 2 * freqs.size(-1)
    if freqs.size(0) < S:
        raise ValueError(f"rope: freqs has {freqs.size(0)} positions, x has {S}")
    rows = x.numel() // d
    H = rows // S if S else 1
    check_numel(x)
    if rows == 0:
        return out
    cs = cos_sin(freqs.to(x.device)[:S])
    fn = compile_kernel("rope", device_arch(x.device), d=d, r=r, inverse=inverse, inplace=out is x, unroll=unroll)
    fn(ptr(x), ptr(cs), ptr(out), Int32(rows), Int32(H), current_stream())
    return out


def rope(x, freqs, inverse: bool = False, out=None):
    """x [S, ..., d] bf16, freqs [S, r/2] complex -> new tensor with the last r dims rotated."""
    import torch
    x = x.contiguous()
    return _launch(x, freqs, inverse, torch.empty_like(x) if out is None else out)


def rope_(x, freqs, inverse: bool = False, unroll: int = 2):
    """In place: rotate the last r dims of the contiguous bf16 x (`unroll` rows a thread)."""
    return _launch(x, freqs, inverse, x, unroll)
