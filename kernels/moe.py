"""Routed experts of one MoE layer on Hopper: tokens grouped by expert, one W4A16 launch per GEMM for all
experts (kernels/gemm_w4a16.py in grouped mode), SwiGLU with clamp and routing weight fused into the first
GEMM's epilogue.

    plan   = route_plan(topk_ids, n_experts, chunk)       # on the device, no host synchronisation
    x_s    = x[plan.tok]                                   # rows grouped by expert
    h      = W4A16_grouped(x_s, W13)  -> swiglu epilogue   # [P, I]   (w1/w3 rows interleaved by 8)
    y_s    = W4A16_grouped(h, W2)                          # [P, D]
    y      = MoeGatherSum(y_s)                             # [T, D] fp32: each token's k rows summed in
                                                           # expert order, as dsv4_references.moe.moe_combine

The work units (expert, first row, rows) are computed from the routing with torch ops on the device; the
grid is sized by the static bound ceil(P / chunk) + E, and units past the real count exit at once, so the
layer needs no host round trip (CUDA-graph capturable).

Expert weights: NVFP4 (ModelOpt) packs directly; MXFP4 (the official checkpoint) is cast losslessly to
NVFP4 at load (dsv4debug.formats.mxfp4_to_nvfp4: w1 and w3 share one global scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import torch
from cutlass import BFloat16, Float32, Int32, cute

from . import w4_pack
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
    row_geometry,
)
from .gemm_w4a16 import w4a16_launch


@dataclass
class RoutePlan:
    tok: torch.Tensor          # [P] int64: token of each expert-sorted row
    order: torch.Tensor        # [P] int64: flat (token, slot) index of each sorted row
    units: torch.Tensor        # [U_max, 3] int32: (expert, first row, rows)
    ucount: torch.Tensor       # [1] int32: number of valid units
    chunk: int


def route_plan(topk_ids: torch.Tensor, n_experts: int, chunk: int) -> RoutePlan:
    """Sort (token, slot) pairs by expert (stable: token order within an expert) and cut work units."""
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    P = ids.numel()
    order = torch.argsort(ids, stable=True)
    tok = order // k
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
    seg = torch.cumsum(counts, 0) - counts
    nu = (counts + chunk - 1) // chunk
    ucum = torch.cumsum(nu, 0)
    u_max = -(-P // chunk) + n_experts
    u = torch.arange(u_max, device=ids.device)
    e = torch.searchsorted(ucum, u, right=True).clamp(max=n_experts - 1)
    j = u - (ucum[e] - nu[e])
    row0 = seg[e] + j * chunk
    cnt = (counts[e] - j * chunk).clamp(min=0, max=chunk)
    units = torch.stack([e, row0, cnt], dim=1).to(torch.int32).contiguous()
    ucount = ucum[-1:].to(torch.int32)
    return RoutePlan(tok, order, units, ucount, chunk)


class MoeGatherSum:
    """y[t] = sum_j rows[src[t * k + j]] for j = 0..k-1 in that order, fp32; rows bf16 [P, d], src int32 [T * k].

    The combine of the grouped layer: each token's k expert rows are gathered from the expert-sorted output
    and summed in one pass (16-byte loads, all k rows of a thread in flight), instead of a permuting copy and k
    fp32 read-modify-write passes over [T, d] (~3.6 GB of traffic at Pro's 4096 tokens, ~10% of the layer).
    Starting from zero and adding in slot order gives the bits of the torch loop `y += yt[:, j].float()`."""

    def __init__(self, d: int, k: int):
        if d % 8:
            raise ValueError(f"moe gather-sum row width {d} must be a multiple of 8")
        self.d, self.k = d, k
        self.tpr, self.nv = row_geometry(d // 8, max_threads=128)

    @cute.jit
    def __call__(self, rows_ptr: cute.Pointer, src_ptr: cute.Pointer, y_ptr: cute.Pointer, P: Int32, T: Int32,
                 stream):
        def rows_of(p, n):      # [8, thread, vector, row]: a thread's vectors of a row
            return cute.make_tensor(p, cute.make_layout((8, self.tpr, self.nv, n),
                                                        stride=(1, 8, 8 * self.tpr, self.d)))
        mSrc = cute.make_tensor(src_ptr, cute.make_layout((self.k, T), stride=(1, self.k)))
        self.kernel(rows_of(rows_ptr, P), mSrc, rows_of(y_ptr, T)).launch(
            grid=[T, 1, 1], block=[self.tpr, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mRows: cute.Tensor, mSrc: cute.Tensor, mY: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        tok, _, _ = cute.arch.block_idx()
        got = []
        for j in cutlass.range_constexpr(self.k):
            r = cute.make_rmem_tensor((8, self.nv), BFloat16)
            cute.autovec_copy(mRows[None, tidx, None, mSrc[j, tok]], r)
            got.append(r)
        acc = cute.make_rmem_tensor((8, self.nv), Float32)
        acc.fill(0.0)
        for j in cutlass.range_constexpr(self.k):
            acc.store(acc.load() + got[j].load().to(Float32))
        cute.autovec_copy(acc, mY[None, tidx, None, tok])


def _build_gather_sum(d: int, k: int):
    return MoeGatherSum(d, k), (fake_ptr(BFloat16), fake_ptr(Int32, 4), fake_ptr(Float32), Int32(1), Int32(1),
                                fake_stream())


register(KernelDef("moe_gather_sum", "experts", BOTH, _build_gather_sum,
                   configs=({"d": 7168, "k": 6}, {"d": 4096, "k": 6}),
                   doc="MoE combine: each token's top-k expert rows gathered and summed in expert order, fp32"))


def gather_sum(rows: torch.Tensor, src: torch.Tensor, k: int) -> torch.Tensor:
    """rows bf16 [P, d], src [T * k] row of each (token, slot) -> fp32 [T, d] (MoeGatherSum)."""
    if rows.dtype != torch.bfloat16:
        raise ValueError(f"moe gather-sum takes bf16 rows, not {rows.dtype}")
    if src.numel() % k:
        raise ValueError(f"moe gather-sum: {src.numel()} row indices are not whole tokens of {k} slots")
    rows = rows.contiguous()
    src = src.to(torch.int32).contiguous()
    P, d = rows.shape
    T = src.numel() // k
    check_numel(rows)
    y = torch.empty(T, d, dtype=torch.float32, device=rows.device)
    if T:
        fn = compile_kernel("moe_gather_sum", device_arch(rows.device), d=d, k=k)
        fn(ptr(rows), ptr(src, align=4), ptr(y), Int32(P), Int32(T), current_stream())
    return y


def pick_grouped_config(pairs: int, n_experts: int, widths: tuple[int, ...] = ()) -> dict:
    """Decode-sized groups (a few tokens per expert) stream weights; prefill groups fill 64-token sub-tiles, in
    pairs of CTAs along N sharing their activation tile where every GEMM's N (`widths`) has an even number of
    128-row weight tiles (Pro layer at 4096 tokens on the H200: 11.4 ms, alone 12.3 ms)."""
    if pairs <= 16 * n_experts:
        return {"n_tok": 16, "t_max": 1, "tile_k": 64}
    pairs_of_tiles = bool(widths) and all((w // 128) % 2 == 0 for w in widths)
    return {"n_tok": 64, "t_max": 2, "tile_k": 128} | ({"cluster_n": 2} if pairs_of_tiles else {})


def moe_routed(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, w13, w2, n_experts: int,
               limit: float, config: dict | None = None, config2: dict | None = None) -> torch.Tensor:
    """Sum of the routed experts' outputs per token, fp32 [T, D] (the shared expert is added by the caller).

    x bf16 [T, D]; topk_ids [T, k]; topk_w fp32 [T, k]; w13 / w2 stacked packs (w4_pack.stack_packed) of the
    interleaved gate/up [E, 2I, D] and down [E, D, I] projections.
    """
    T, D = x.shape
    k = topk_ids.shape[1]
    inter2 = w13[0].shape[1] * 64
    # each token's experts in increasing id: the fp32 sum below then runs in the reference's order
    topk_ids, perm = topk_ids.sort(dim=1)
    topk_w = topk_w.gather(1, perm).float()
    cfg = dict(config or pick_grouped_config(T * k, n_experts, (inter2, D)))
    plan = route_plan(topk_ids, n_experts, cfg["n_tok"] * cfg.get("t_max", 1))
    xs = x.index_select(0, plan.tok).contiguous()
    rw = topk_w.reshape(-1).index_select(0, plan.order).contiguous()
    h = w4a16_launch(xs, w13, inter2, route_w=rw, units=plan.units, unit_count=plan.ucount, lim=limit,
                     grouped=True, epilogue="swiglu", **cfg)
    cfg2 = dict(config2 or cfg)
    if cfg2["n_tok"] * cfg2.get("t_max", 1) != plan.chunk:
        raise ValueError("both grouped GEMMs of a layer use the same work units (same n_tok * t_max)")
    ys = w4a16_launch(h, w2, D, units=plan.units, unit_count=plan.ucount, grouped=True, **cfg2)
    src = torch.empty_like(plan.order, dtype=torch.int32)
    src[plan.order] = torch.arange(plan.order.numel(), device=x.device, dtype=torch.int32)
    return gather_sum(ys, src, k)


def pack_expert(w1, w3, w2):
    """One expert's QWeights (NVFP4 or MXFP4) -> (w13 pack, w2 pack) for the grouped kernels."""
    fmt = w1.fmt
    if fmt == "nvfp4":
        t1, t3, t2 = w1.tensors, w3.tensors, w2.tensors
        if not torch.equal(t1["weight_scale_2"].float(), t3["weight_scale_2"].float()):
            raise ValueError(f"{w1.name} and {w3.name} have different weight_scale_2: the fused w13 kernel "
                             "needs one global scale per expert")
        p13 = w4_pack.pack_nvfp4_w13(t1["weight"], t1["weight_scale"], t3["weight"], t3["weight_scale"],
                                     t1["weight_scale_2"])
        p2 = w4_pack.pack_nvfp4(t2["weight"], t2["weight_scale"], t2["weight_scale_2"])
        return p13, p2
    if fmt == "mxfp4":
        from dsv4debug.formats import mxfp4_to_nvfp4
        nv1, nv3, lossy = mxfp4_to_nvfp4(w1.tensors["weight"], w1.tensors["scale"], w3.tensors["weight"],
                                         w3.tensors["scale"])
        nv2, _, lossy2 = mxfp4_to_nvfp4(w2.tensors["weight"], w2.tensors["scale"])
        if lossy or lossy2:
            raise ValueError(f"{w1.name}: MXFP4 -> NVFP4 cast is lossy for {lossy + lossy2} blocks")
        # the cast made these scales (valid e4m3, never NaN): no scale check, no host sync
        p13 = w4_pack.pack_nvfp4_w13(nv1[0], nv1[1], nv3[0], nv3[1], nv1[2], check_scales=False)
        p2 = w4_pack.pack_nvfp4(*nv2, check_scales=False)
        return p13, p2
    raise ValueError(f"{w1.name}: W4A16 experts take NVFP4 or MXFP4 weights, not {fmt}")
