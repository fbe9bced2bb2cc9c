"""RMSNorm: the weighted norm (attn_norm, ffn_norm, q_norm, kv_norm, the final norm) and the unweighted
per-head query norm (dsv4_references.norm.rms_norm / head_rms_norm).

One row per group of threads; each thread holds its share of the row in registers (128-bit loads), the sum
of squares is reduced by butterfly shuffles (and through shared memory across warps), and the row is
written once. fp32 math, one rounding to the activation dtype at the end, as DeepSeek's RMSNorm. The
per-head norm (which DeepSeek computes in bf16 arithmetic) uses the same fp32 code without weight: it is
judged against the fp32 twin of the reference.
"""
from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float32, Int32, const_expr, cute
from cutlass.memory import SmemAllocator

from ._common import (
    BOTH,
    KernelDef,
    check_numel,
    compile_kernel,
    current_stream,
    device_arch,
    fake_ptr,
    fake_stream,
    group_sum,
    ptr,
    register,
    row_geometry,
)

_DTYPES = {"bf16": BFloat16, "fp32": Float32}


class RMSNorm:
    """y = x * rsqrt(mean(x^2) + eps) [* w]; x [M, n] contiguous, w [n] fp32."""

    def __init__(self, n: int, weighted: bool, dtype: str = "bf16"):
        self.dtype = _DTYPES[dtype]
        self.vec = 128 // self.dtype.width
        if n % self.vec:
            raise ValueError(f"RMSNorm row width {n} must be a multiple of {self.vec}")
        self.n, self.weighted = n, weighted
        self.tpr, self.nv = row_geometry(n // self.vec, max_threads=256)
        self.threads = max(self.tpr, 128)
        self.rows_per_cta = self.threads // self.tpr
        self.warps_per_row = max(self.tpr // 32, 1)

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, o_ptr: cute.Pointer, M: Int32, eps: Float32,
                 stream):
        lay = cute.make_layout((self.vec, self.tpr, self.nv, M),
                               stride=(1, self.vec, self.vec * self.tpr, self.n))
        mX = cute.make_tensor(x_ptr, lay)
        mO = cute.make_tensor(o_ptr, lay)
        mW = cute.make_tensor(w_ptr, cute.make_layout((self.vec, self.tpr, self.nv),
                                                      stride=(1, self.vec, self.vec * self.tpr)))
        self.kernel(mX, mW, mO, M, eps).launch(
            grid=[cute.ceil_div(M, self.rows_per_cta), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor, M: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = tidx % self.tpr
        r = tidx // self.tpr
        row = bidx * self.rows_per_cta + r
        row_c = cutlass.min(row, M - 1)                 # rows past the end load a valid row, store nothing

        rX = cute.make_rmem_tensor((self.vec, self.nv), self.dtype)
        cute.autovec_copy(mX[None, t, None, row_c], rX)
        x = rX.load().to(Float32)
        ss = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        ss = group_sum(ss, min(self.tpr, 32))
        if const_expr(self.warps_per_row > 1):
            smem = SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((self.warps_per_row, self.rows_per_cta)),
                                       byte_alignment=16)
            lane = cute.arch.lane_idx()
            w_in_row = t // 32
            if lane == 0:
                red[w_in_row, r] = ss
            cute.arch.barrier()
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(self.warps_per_row):
                ss += red[i, r]
        rstd = cute.math.rsqrt(ss / self.n + eps)
        y = x * rstd
        if const_expr(self.weighted):
            rW = cute.make_rmem_tensor((self.vec, self.nv), Float32)
            cute.autovec_copy(mW[None, t, None], rW)
            y = y * rW.load()
        rO = cute.make_rmem_tensor((self.vec, self.nv), self.dtype)
        rO.store(y.to(self.dtype))
        if row < M:
            cute.autovec_copy(rO, mO[None, t, None, row])


def _build(n: int, weighted: bool, dtype: str = "bf16"):
    k = RMSNorm(n, weighted, dtype)
    dt = _DTYPES[dtype]
    return k, (fake_ptr(dt), fake_ptr(Float32), fake_ptr(dt), Int32(1), Float32(1e-6), fake_stream())


register(KernelDef(
    "rmsnorm", "norm", BOTH, _build,
    # Pro/Flash widths: dim, q_lora_rank, kv (head_dim); the per-head q norm (head_dim, no weight)
    configs=({"n": 7168, "weighted": True}, {"n": 4096, "weighted": True}, {"n": 1536, "weighted": True},
             {"n": 1024, "weighted": True}, {"n": 512, "weighted": True}, {"n": 512, "weighted": False}),
    ci_configs=({"n": 7168, "weighted": True}, {"n": 512, "weighted": False}),
    doc="weighted RMSNorm and the unweighted per-head q norm, fp32 math, bf16 in/out"))


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------

def _run(x, w, eps: float, out=None):
    import torch
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"rms_norm kernel takes bf16 or fp32 activations, not {x.dtype}")
    x = x.contiguous()
    n = x.size(-1)
    out = torch.empty_like(x) if out is None else out
    check_numel(x)
    M = x.numel() // n
    if M == 0:
        return out
    dtype = "bf16" if x.dtype == torch.bfloat16 else "fp32"
    fn = compile_kernel("rmsnorm", device_arch(x.device), n=n, weighted=w is not None, dtype=dtype)
    if w is not None:
        w = w.to(device=x.device, dtype=torch.float32).contiguous()
    fn(ptr(x), ptr(w if w is not None else x, cutlass.Float32), ptr(out), Int32(M), Float32(eps),
       current_stream())
    return out


def rms_norm(x, weight, eps: float, out=None):
    """x [..., n] bf16, weight [n] (held in fp32) -> [..., n] in x's dtype."""
    return _run(x, weight, eps, out)


def head_rms_norm(q, eps: float, out=None):
    """q [S, H, d]: per-head RMS norm without weight (fp32 math)."""
    return _run(q, None, eps, out)
