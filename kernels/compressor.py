"""DeepSeek-V4 KV compressor (dsv4_references.attention.compress): pooling, norm, rope and QAT in one kernel.

The compressor is two projections of x (kv and gate score, fp32 in DeepSeek's code) followed by a per-feature
softmax pooling over each block's slots, RMSNorm, RoPE at the block's first position and the QAT simulation.
Here:
  projections  `bf16_gemm_f32` (sm_90a WGMMA, bf16 operands, fp32 accumulation and output: the products of
               bf16-valued operands are exact in fp32, so this is the reference's fp32 GEMM up to summation
               order), used by `compress_op` on Hopper when the weights are bf16-valued (DeepSeek's are);
               otherwise torch's x.float() @ w.float().T;
  `compress_pool` kernel (SIMT, any arch) does the rest for one compressed entry per group of dc/4 threads
               (4 features a thread, 16-byte fp32 loads):
    ratio 4 (CSA, overlapping): 8 slots = the previous block's 4 rows on the first dc features and this
        block's 4 rows on the last dc features (entry 0: zero kv / -inf score for the previous block), ape
        added per slot; all 8 scores in registers, max, exp, sums;
    ratio 128 (HCA) or any other non-overlapping ratio: online softmax over the block's rows (running max,
        rescaled sum and weighted kv);
    pooled value rounded to bf16 (as `.to(x.dtype)`), RMSNorm in fp32 (sum of squares over the group:
        shuffles, then shared memory across warps), times the weight, rounded to bf16; RoPE on the last 64
        dims (interleaved pairs, the reference's own cos/sin table at positions w * ratio), rounded to bf16;
    post "fp8"  (main compressor, QAT on): fp8_sim of the first dc - 64 dims in blocks of 64 (power-of-two
                 scale from the exponent bits of amax / 448, e4m3 by cvt.rn.satfinite);
    post "hadamard_fp4" (indexer compressor, QAT on): orthonormal Sylvester Hadamard over dc (fast
                 Walsh-Hadamard: 2 in-thread stages, the rest by lane shuffles), bf16, then fp4_sim in blocks
                 of 32 (power-of-two scale from amax / 6, E2M1 by the 7 round-half-even thresholds);
    post "hadamard" / "none": the same without the QAT step.
Outputs bf16 [S // ratio, dc]. The rounding points are the reference's; what differs is the fp32 summation
order (pooling, norm, Hadamard), so results agree to fp32 rounding before each bf16 rounding.
"""
from __future__ import annotations

import math

import cutlass
from cutlass import BFloat16, Float32, Int32, cute, pipeline
from cutlass.cute.nvgpu import warpgroup

from ._common import BOTH, KernelDef, bits_f32, f32_bits, fake_ptr, fake_stream, register
from ._tma_gemm import TmaOperandsAB

POSTS = ("none", "fp8", "hadamard", "hadamard_fp4")


class CompressPool:
    """kv, score fp32 rows [S, *] (row stride `ld`; features [0, c*dc)), ape fp32 [ratio, c*dc], norm_w fp32
    [dc], cs fp32 [T, 32, 2] -> out bf16 [T, dc]."""
    threads = 128

    def __init__(self, dc: int = 512, ratio: int = 128, post: str = "none", rope: int = 64):
        if post not in POSTS:
            raise ValueError(f"compress_pool: post must be one of {POSTS}")
        if dc not in (128, 256, 512):
            raise ValueError("compress_pool: dc must be 128, 256 or 512")
        if post.startswith("hadamard") and dc & (dc - 1):
            raise ValueError("compress_pool: the Hadamard transform needs a power-of-two dc")
        if post.startswith("hadamard") and dc > 128:
            raise ValueError("compress_pool: the in-warp Hadamard covers dc <= 128 (the indexer's 128)")
        if ratio < 1 or rope % 4 or rope > dc:
            raise ValueError("compress_pool: bad ratio / rope")
        self.dc, self.ratio, self.post, self.rope = dc, ratio, post, rope
        self.overlap = ratio == 4
        self.c = 2 if self.overlap else 1
        self.group = dc // 4                              # threads an entry
        self.per_cta = self.threads // self.group         # entries a CTA
        self.warps_per_group = max(1, self.group // 32)

    @cute.jit
    def __call__(self, kv_ptr: cute.Pointer, sc_ptr: cute.Pointer, ape_ptr: cute.Pointer, w_ptr: cute.Pointer,
                 cs_ptr: cute.Pointer, o_ptr: cute.Pointer, S: Int32, ld: Int32, T: Int32, eps: Float32, stream):
        C = self.c * self.dc
        ldv = cute.assume(ld, divby=4)
        mKV = cute.make_tensor(kv_ptr, cute.make_layout((4, C // 4, S), stride=(1, 4, ldv)))
        mSC = cute.make_tensor(sc_ptr, cute.make_layout((4, C // 4, S), stride=(1, 4, ldv)))
        mApe = cute.make_tensor(ape_ptr, cute.make_layout((4, C // 4, self.ratio), stride=(1, 4, C)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((4, self.dc // 4), stride=(1, 4)))
        mCS = cute.make_tensor(cs_ptr, cute.make_layout((2, 2, self.rope // 4, T), stride=(1, 2, 4, self.rope)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((4, self.dc // 4, T), stride=(1, 4, self.dc)))

        @cute.struct
        class Storage:
            red: cute.struct.MemRange[Float32, 8]

        self.storage = Storage
        self.kernel(mKV, mSC, mApe, mW, mCS, mO, T, eps).launch(
            grid=[cute.ceil_div(T, self.per_cta), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mKV: cute.Tensor, mSC: cute.Tensor, mApe: cute.Tensor, mW: cute.Tensor, mCS: cute.Tensor,
               mO: cute.Tensor, T: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        dc, m, G = self.dc, self.ratio, self.group
        j = tidx % G                                      # features 4j .. 4j + 3 (of dc)
        w = bidx * self.per_cta + tidx // G
        wc = cutlass.min(w, T - 1)                        # whole groups past T compute on the last entry
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        sRed = st.red.get_tensor(cute.make_layout((8,)))

        pooled = cute.make_rmem_tensor((4,), Float32)
        if cutlass.const_expr(self.overlap):
            z = cute.make_rmem_tensor((8, 4), Float32)
            v = cute.make_rmem_tensor((8, 4), Float32)
            for r in cutlass.range_constexpr(4):
                a_prev = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(mApe[None, j, r], a_prev)
                a_cur = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(mApe[None, G + j, r], a_cur)
                cur_s = cute.make_rmem_tensor((4,), Float32)
                cur_k = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(mSC[None, G + j, wc * 4 + r], cur_s)
                cute.autovec_copy(mKV[None, G + j, wc * 4 + r], cur_k)
                prev_s = cute.make_rmem_tensor((4,), Float32)
                prev_k = cute.make_rmem_tensor((4,), Float32)
                prev_s.fill(-Float32.inf)
                prev_k.fill(0.0)
                if wc > 0:
                    cute.autovec_copy(mSC[None, j, (wc - 1) * 4 + r], prev_s)
                    cute.autovec_copy(mKV[None, j, (wc - 1) * 4 + r], prev_k)
                    for e in cutlass.range_constexpr(4):
                        prev_s[e] = prev_s[e] + a_prev[e]
                for e in cutlass.range_constexpr(4):
                    z[r, e] = prev_s[e]
                    v[r, e] = prev_k[e]
                    z[4 + r, e] = cur_s[e] + a_cur[e]
                    v[4 + r, e] = cur_k[e]
            for e in cutlass.range_constexpr(4):
                mx = z[0, e]
                for r in cutlass.range_constexpr(1, 8):
                    mx = cute.arch.fmax(mx, z[r, e])
                lsum = Float32(0.0)
                acc = Float32(0.0)
                for r in cutlass.range_constexpr(8):
                    p = cute.math.exp(z[r, e] - mx)
                    lsum = lsum + p
                    acc = acc + p * v[r, e]
                pooled[e] = acc / lsum
        else:
            mx = cute.make_rmem_tensor((4,), Float32)
            lsum = cute.make_rmem_tensor((4,), Float32)
            acc = cute.make_rmem_tensor((4,), Float32)
            mx.fill(-Float32.inf)
            lsum.fill(0.0)
            acc.fill(0.0)
            for r in cutlass.range(m, unroll=4):
                sv = cute.make_rmem_tensor((4,), Float32)
                kv = cute.make_rmem_tensor((4,), Float32)
                ap = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(mSC[None, j, wc * m + r], sv)
                cute.autovec_copy(mKV[None, j, wc * m + r], kv)
                cute.autovec_copy(mApe[None, j, r], ap)
                for e in cutlass.range_constexpr(4):
                    zz = sv[e] + ap[e]
                    mn = cute.arch.fmax(mx[e], zz)
                    a = cute.math.exp(mx[e] - mn)
                    p = cute.math.exp(zz - mn)
                    lsum[e] = lsum[e] * a + p
                    acc[e] = acc[e] * a + p * kv[e]
                    mx[e] = mn
            for e in cutlass.range_constexpr(4):
                pooled[e] = acc[e] / lsum[e]

        # ---- bf16, RMSNorm (fp32), weight, bf16
        x = cute.make_rmem_tensor((4,), Float32)
        ss = Float32(0.0)
        for e in cutlass.range_constexpr(4):
            x[e] = pooled[e].to(BFloat16).to(Float32)
            ss = ss + x[e] * x[e]
        ss = self.group_sum(ss, sRed, tidx)
        inv = cute.math.rsqrt(ss / Float32(dc) + eps)
        wt = cute.make_rmem_tensor((4,), Float32)
        cute.autovec_copy(mW[None, j], wt)
        for e in cutlass.range_constexpr(4):
            x[e] = (wt[e] * (x[e] * inv)).to(BFloat16).to(Float32)

        # ---- rope on the last `rope` dims: pairs (2i, 2i+1), cos/sin of the entry's first position
        first_rope = (dc - self.rope) // 4
        if j >= first_rope:
            cs = cute.make_rmem_tensor((2, 2), Float32)
            cute.autovec_copy(mCS[None, None, j - first_rope, wc], cs)
            for pr in cutlass.range_constexpr(2):
                a, b = x[2 * pr], x[2 * pr + 1]
                c, s = cs[0, pr], cs[1, pr]
                x[2 * pr] = (a * c - b * s).to(BFloat16).to(Float32)
                x[2 * pr + 1] = (a * s + b * c).to(BFloat16).to(Float32)

        # ---- QAT / rotation
        if cutlass.const_expr(self.post == "fp8"):
            self.fp8_sim(x, j < first_rope)            # every lane shuffles; the rope lanes keep their values
        if cutlass.const_expr(self.post in ("hadamard", "hadamard_fp4")):
            self.hadamard(x)
            if cutlass.const_expr(self.post == "hadamard_fp4"):
                self.fp4_sim(x)

        if w < T:
            out = cute.make_rmem_tensor((4,), BFloat16)
            for e in cutlass.range_constexpr(4):
                out[e] = x[e].to(BFloat16)
            cute.autovec_copy(out, mO[None, j, w])

    # ----------------------------------------------------------------------------------------------------
    @cute.jit
    def group_sum(self, v: Float32, sRed: cute.Tensor, tidx: Int32) -> Float32:
        """Sum over the dc/4 threads of one entry (a warp or a whole 128-thread CTA)."""
        off = min(self.group, 32) // 2
        while off > 0:
            v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
            off //= 2
        if cutlass.const_expr(self.group > 32):
            warp = tidx // 32
            if tidx % 32 == 0:
                sRed[warp] = v
            cute.arch.sync_threads()
            base = (warp // self.warps_per_group) * self.warps_per_group
            tot = Float32(0.0)
            for i in cutlass.range_constexpr(self.warps_per_group):
                tot = tot + sRed[base + i]
            v = tot
        return v

    @cute.jit
    def fp8_sim(self, x: cute.Tensor, apply):
        """Round 4 values to e4m3 with the power-of-two scale of their 64-dim block (16 lanes) where apply."""
        amax = Float32(0.0)
        for e in cutlass.range_constexpr(4):
            amax = cute.arch.fmax(amax, cute.arch.fmax(x[e], -x[e]))
        for off in (8, 4, 2, 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
        amax = cute.arch.fmax(amax, Float32(1e-4))
        t = f32_bits(amax / Float32(448.0))
        k = ((t >> 23) & 0xFF) - 127 + cutlass.select_((t & 0x7FFFFF) != 0, Int32(1), Int32(0))
        inv = bits_f32((127 - k) << 23)
        s = bits_f32((127 + k) << 23)
        q = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            q[e] = x[e] * inv
        r8 = cute.make_rmem_tensor((4,), cutlass.Float8E4M3FN)
        r8.store(q.load().to(cutlass.Float8E4M3FN))              # cvt.rn.satfinite: the +-448 clamp
        back = r8.load().to(Float32)
        for e in cutlass.range_constexpr(4):
            x[e] = Float32(cutlass.select_(apply, (back[e] * s).to(BFloat16).to(Float32), x[e]))

    @cute.jit
    def hadamard(self, x: cute.Tensor):
        """Orthonormal Sylvester Hadamard over dc = 4 * group features (in-thread stages for index bits 0-1,
        lane shuffles for bits 2..), fp32, then dc^-1/2 and bf16 (rotate_activation)."""
        for h in (1, 2):
            for e in cutlass.range_constexpr(4):
                if e & h == 0:
                    a, b = x[e], x[e + h]
                    x[e] = a + b
                    x[e + h] = a - b
        lane = cute.arch.lane_idx()
        off = 1
        while off < self.group:
            for e in cutlass.range_constexpr(4):
                o = cute.arch.shuffle_sync_bfly(x[e], offset=off)
                x[e] = cutlass.select_((lane & off) == 0, x[e] + o, o - x[e])
            off *= 2
        sc = Float32(1.0 / math.sqrt(self.dc))
        for e in cutlass.range_constexpr(4):
            x[e] = (x[e] * sc).to(BFloat16).to(Float32)

    @cute.jit
    def fp4_sim(self, x: cute.Tensor):
        """E2M1 with the power-of-two scale of their 32-dim block (8 lanes), round half to even."""
        amax = Float32(0.0)
        for e in cutlass.range_constexpr(4):
            amax = cute.arch.fmax(amax, cute.arch.fmax(x[e], -x[e]))
        for off in (4, 2, 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
        amax = cute.arch.fmax(amax, Float32(6.0 * 2.0 ** -126))
        t = f32_bits(amax / Float32(6.0))
        k = ((t >> 23) & 0xFF) - 127 + cutlass.select_((t & 0x7FFFFF) != 0, Int32(1), Int32(0))
        inv = bits_f32((127 - k) << 23)
        s = bits_f32((127 + k) << 23)
        for e in cutlass.range_constexpr(4):
            y = x[e] * inv
            a = cute.arch.fmax(y, -y)
            code = cutlass.select_(a > Float32(0.25), Int32(1), Int32(0)) \
                + cutlass.select_(a >= Float32(0.75), Int32(1), Int32(0)) \
                + cutlass.select_(a > Float32(1.25), Int32(1), Int32(0)) \
                + cutlass.select_(a >= Float32(1.75), Int32(1), Int32(0)) \
                + cutlass.select_(a > Float32(2.5), Int32(1), Int32(0)) \
                + cutlass.select_(a >= Float32(3.5), Int32(1), Int32(0)) \
                + cutlass.select_(a > Float32(5.0), Int32(1), Int32(0))
            # magnitude of code c (0, 0.5, 1, 1.5, 2, 3, 4, 6) as fp32 bits: c = 1 -> 0.5, c >= 2 ->
            # 2^((c >> 1) - 1) * (1 + (c & 1) / 2), c = 0 -> 0
            mag = bits_f32(Int32(cutlass.select_(code < 2, code * (126 << 23),
                                                 ((126 + (code >> 1)) << 23) | ((code & 1) << 22))))
            val = mag * s
            x[e] = Float32(cutlass.select_(y < Float32(0.0), -val, val)).to(BFloat16).to(Float32)


class IndexerQ(CompressPool):
    """The indexer's queries (dsv4_references.indexer_q): q bf16 [S * IH, 128] rows (row -> position
    row // IH), cs fp32 [S, 32, 2] -> rope on the last 64 dims (bf16), Hadamard (bf16), FP4 sim when qat.
    A warp a row, 4 dims a lane (the compressor's rope / Hadamard / FP4 code)."""

    def __init__(self, qat: bool = True):
        super().__init__(dc=128, ratio=1, post="hadamard_fp4" if qat else "hadamard")

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, cs_ptr: cute.Pointer, o_ptr: cute.Pointer, rows: Int32, IH: Int32,
                 stream):
        dc = self.dc
        S = rows // IH
        mQ = cute.make_tensor(q_ptr, cute.make_layout((4, dc // 4, rows), stride=(1, 4, dc)))
        mCS = cute.make_tensor(cs_ptr, cute.make_layout((2, 2, self.rope // 4, S), stride=(1, 2, 4, self.rope)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((4, dc // 4, rows), stride=(1, 4, dc)))
        self.kernel_q(mQ, mCS, mO, rows, IH).launch(
            grid=[cute.ceil_div(rows, self.per_cta), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel_q(self, mQ: cute.Tensor, mCS: cute.Tensor, mO: cute.Tensor, rows: Int32, IH: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        G = self.group
        j = tidx % G
        row = bidx * self.per_cta + tidx // G
        rc = cutlass.min(row, rows - 1)
        xin = cute.make_rmem_tensor((4,), BFloat16)
        cute.autovec_copy(mQ[None, j, rc], xin)
        x = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            x[e] = xin[e].to(Float32)
        first_rope = (self.dc - self.rope) // 4
        if j >= first_rope:
            cs = cute.make_rmem_tensor((2, 2), Float32)
            cute.autovec_copy(mCS[None, None, j - first_rope, rc // IH], cs)
            for pr in cutlass.range_constexpr(2):
                a, b = x[2 * pr], x[2 * pr + 1]
                c, s = cs[0, pr], cs[1, pr]
                x[2 * pr] = (a * c - b * s).to(BFloat16).to(Float32)
                x[2 * pr + 1] = (a * s + b * c).to(BFloat16).to(Float32)
        self.hadamard(x)
        if cutlass.const_expr(self.post == "hadamard_fp4"):
            self.fp4_sim(x)
        if row < rows:
            out = cute.make_rmem_tensor((4,), BFloat16)
            for e in cutlass.range_constexpr(4):
                out[e] = x[e].to(BFloat16)
            cute.autovec_copy(out, mO[None, j, row])


class Bf16GemmF32(TmaOperandsAB):
    """y fp32 [M, N] = x bf16 [M, K] @ w bf16 [N, K]^T, fp32 accumulation (sm_90a): the compressor's kv / gate
    projections, which DeepSeek runs in fp32 on bf16-valued operands (every product is exact in fp32, so
    only the summation order differs from x.float() @ w.float().T). TMA tiles 128 x 128 x 64, a producer warp
    and two consumer warpgroups (64 rows each), WGMMA m64n128k16, fp32 stores (rows past M skipped)."""
    threads = 384
    SMEM = 227 * 1024

    def __init__(self):
        self.tile_m, self.tile_n, self.tile_k = 128, 128, 64
        self.stages = min(8, (self.SMEM - 2048) // ((self.tile_m + self.tile_n) * self.tile_k * 2))

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, m: Int32, n: Int32, k: Int32,
                 stream):
        kk = cute.assume(k, divby=64)
        nn = cute.assume(n, divby=128)
        mA = cute.make_tensor(x_ptr, cute.make_layout((m, kk), stride=(kk, 1)))
        mB = cute.make_tensor(w_ptr, cute.make_layout((nn, kk), stride=(kk, 1)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((m, nn), stride=(nn, 1)))
        tma_a, mA_tma, tma_b, mB_tma, tiled_mma, sA_layout, sB_layout = self.tma_operands(BFloat16, mA, mB)
        self.kernel(tma_a, mA_tma, tma_b, mB_tma, mY, tiled_mma, sA_layout, sB_layout, m, k).launch(
            grid=[n // self.tile_n, cute.ceil_div(m, self.tile_m), 1], block=[self.threads, 1, 1],
            min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor, mY: cute.Tensor,
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, m: Int32,
               k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        k_tiles = k // self.tile_k
        pipe, sA, sB, loads = self.operand_pipeline(tma_a, mA, tma_b, mB, sA_layout, sB_layout, bx, by)
        if warp < 4:
            self.producer_warpgroup(pipe, loads, k_tiles, warp, lane)
        else:
            cute.arch.setmaxregister_increase(232)
            tCrA, tCrB, tCc, acc = self.consumer_operands(tiled_mma, sA, sB, tidx)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)          # acc starts at zero: always accumulate
            kblocks = cute.size(tCrA, mode=[2])
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for kt in cutlass.range(k_tiles, unroll=1):
                pipe.consumer_wait(read)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(kblocks):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)],
                              acc)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                pipe.consumer_release(read)
                read.advance()
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                r, c = tCc[i]
                row = by * self.tile_m + r
                if row < m:
                    mY[row, bx * self.tile_n + c] = acc[i]


# --------------------------------------------------------------------------------------------------------
# Registry and launchers
# --------------------------------------------------------------------------------------------------------

def _build(dc: int = 512, ratio: int = 128, post: str = "none"):
    return CompressPool(dc, ratio, post), (fake_ptr(Float32), fake_ptr(Float32), fake_ptr(Float32),
                                           fake_ptr(Float32), fake_ptr(Float32), fake_ptr(BFloat16, 8),
                                           Int32(512), Int32(2048), Int32(4), Float32(1e-6), fake_stream())


register(KernelDef(
    "compress_pool", "compressor", BOTH, _build,
    configs=({"dc": 512, "ratio": 4, "post": "fp8"}, {"dc": 512, "ratio": 128, "post": "fp8"},
             {"dc": 128, "ratio": 4, "post": "hadamard_fp4"}, {"dc": 512, "ratio": 4, "post": "none"},
             {"dc": 128, "ratio": 4, "post": "hadamard"}),
    ci_configs=({"dc": 512, "ratio": 4, "post": "fp8"}, {"dc": 512, "ratio": 128, "post": "fp8"},
                {"dc": 128, "ratio": 4, "post": "hadamard_fp4"}),
    doc="compressor pooling (ratio-4 overlapping / ratio-128 online softmax), RMSNorm, rope, FP8 or "
        "Hadamard + FP4 QAT"))


def _build_gemm():
    return Bf16GemmF32(), (fake_ptr(BFloat16), fake_ptr(BFloat16), fake_ptr(Float32), Int32(512), Int32(2048),
                           Int32(7168), fake_stream())


register(KernelDef("bf16_gemm_f32", "compressor", ("sm_90a",), _build_gemm, configs=({},),
                   doc="x bf16 @ w bf16^T with fp32 accumulation and fp32 output (the compressor projections)"))


def bf16_gemm_f32(x, w):
    """x bf16 [M, K] @ w bf16 [N, K]^T -> fp32 [M, N] (N % 128 == 0, K % 64 == 0)."""
    import torch

    from ._common import check_numel, compile_kernel, current_stream, device_arch, ptr
    m, k = x.shape
    n = w.shape[0]
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.shape[1] != k or n % 128 or k % 64:
        raise ValueError(f"bf16_gemm_f32: bf16 x [M, K], w [N, K] with N % 128 == 0, K % 64 == 0 (N={n}, K={k})")
    x, w = x.contiguous(), w.contiguous()
    check_numel(x, w)
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m:
        fn = compile_kernel("bf16_gemm_f32", device_arch(x.device))
        fn(ptr(x), ptr(w), ptr(y), Int32(m), Int32(n), Int32(k), current_stream())
    return y


def _build_q(qat: bool = True):
    return IndexerQ(qat), (fake_ptr(BFloat16, 8), fake_ptr(Float32), fake_ptr(BFloat16, 8), Int32(4096),
                           Int32(64), fake_stream())


register(KernelDef("indexer_q", "indexer", BOTH, _build_q, configs=({"qat": True}, {"qat": False}),
                   ci_configs=({"qat": True},),
                   doc="indexer queries: rope on the last 64 dims, Hadamard 128, FP4 sim (qat)"))


def indexer_q(q, freqs, qat: bool = True):
    """q [S, IH, 128] bf16, freqs [>= S, 32] complex -> bf16 [S, IH, 128] (dsv4_references.indexer_q)."""
    import torch

    from ._common import check_numel, compile_kernel, current_stream, device_arch, ptr
    S, IH, ID = q.shape
    if q.dtype != torch.bfloat16 or ID != 128:
        raise ValueError("indexer_q takes q [S, IH, 128] bf16")
    q = q.contiguous()
    cs = torch.view_as_real(freqs[:S]).float().contiguous().to(q.device)
    out = torch.empty_like(q)
    check_numel(q)
    if q.numel():
        fn = compile_kernel("indexer_q", device_arch(q.device), qat=qat)
        fn(ptr(q, align=8), ptr(cs), ptr(out, align=8), Int32(S * IH), Int32(IH), current_stream())
    return out


def indexer_q_model(q, freqs, qat: bool = True):
    """The indexer_q kernel's arithmetic in torch (rope with separate fp32 products, Hadamard, FP4)."""
    import dsv4_references as ref
    S = q.size(0)
    cs = __import__("torch").view_as_real(freqs[:S]).float()
    x = q.float().clone()
    a, b = x[..., -64::2], x[..., -63::2]
    c, s = cs[:, None, :, 0], cs[:, None, :, 1]
    x[..., -64::2], x[..., -63::2] = (a * c - b * s).bfloat16().float(), (a * s + b * c).bfloat16().float()
    x = ref.rotate_activation(x.bfloat16())
    return ref.fp4_sim(x, 32) if qat else x


def compress_pool(kv, score, ape, norm_w, cs, ratio: int, post: str, eps: float, dc: int):
    """kv, score fp32 [S, c*dc] (may be column slices of one [S, *] tensor with unit column stride), ape fp32
    [ratio, c*dc], norm_w fp32 [dc], cs fp32 [T, rope/2, 2] -> bf16 [S // ratio, dc]."""
    import torch

    from ._common import check_numel, compile_kernel, current_stream, device_arch, ptr
    S = kv.size(0)
    T = S // ratio
    if kv.stride(1) != 1 or score.stride(1) != 1 or kv.stride(0) != score.stride(0) or kv.stride(0) % 4:
        raise ValueError("compress_pool: kv and score must share a row stride (multiple of 4) with unit columns")
    out = torch.empty(T, dc, dtype=torch.bfloat16, device=kv.device)
    check_numel(kv, score)
    if T:
        fn = compile_kernel("compress_pool", device_arch(kv.device), dc=dc, ratio=ratio, post=post)
        fn(ptr(kv), ptr(score), ptr(ape.float().contiguous()), ptr(norm_w.float().contiguous()),
           ptr(cs.float().contiguous()), ptr(out, align=8), Int32(S), Int32(kv.stride(0)), Int32(T), Float32(eps),
           current_stream())
    return out


def compress_op(x, wkv, wgate, ape, norm_w, freqs, ratio: int, rope_dim: int, eps: float, rotate: bool,
                qat: bool = True, gemm: str = "auto"):
    """The flow's compressor op: the two projections as one GEMM on the concatenated weights, then the
    compress_pool kernel. gemm "kernel": bf16_gemm_f32 (needs bf16-valued weights, 2C % 128 == 0, D % 64 == 0,
    Hopper); "torch": x.float() @ w.float().T; "auto": the kernel where it applies, else torch (the weights of
    DeepSeek's compressors are bf16, so on Hopper at real shapes this is the kernel)."""
    import torch
    S = x.size(0)
    dc = norm_w.numel()
    T = S // ratio
    W = torch.cat([wkv, wgate]).float()
    C = wkv.size(0)
    Wb = W.bfloat16()
    fits = (x.is_cuda and W.size(0) % 128 == 0 and x.size(1) % 64 == 0 and bool(torch.equal(Wb.float(), W))
            and torch.cuda.get_device_capability(x.device) == (9, 0))
    if gemm == "kernel" or (gemm == "auto" and fits):
        y = bf16_gemm_f32(x[:T * ratio], Wb)                               # [T*ratio, 2C] fp32
    else:
        y = x[:T * ratio].float() @ W.T
    cs = torch.view_as_real(freqs[:T * ratio:ratio]).float().contiguous()   # [T, rope/2, 2]
    post = ("hadamard_fp4" if qat else "hadamard") if rotate else ("fp8" if qat else "none")
    return compress_pool(y[:, :C], y[:, C:], ape, norm_w, cs.to(x.device), ratio, post, eps, dc)


# --------------------------------------------------------------------------------------------------------
# CPU model
# --------------------------------------------------------------------------------------------------------

def pool_model(kv, score, ape, norm_w, cs, ratio: int, post: str, eps: float, dc: int):
    """The kernel's arithmetic in torch (same rounding points; fp32 sums in torch's order)."""
    import dsv4_references as ref
    import torch
    S = kv.size(0)
    T = S // ratio
    kvb = kv[:T * ratio].float().unflatten(0, (T, ratio))
    scb = score[:T * ratio].float().unflatten(0, (T, ratio)) + ape.float()
    if ratio == 4:
        prev_k = torch.cat([torch.zeros_like(kvb[:1, :, :dc]), kvb[:-1, :, :dc]], 0)
        prev_s = torch.cat([torch.full_like(scb[:1, :, :dc], float("-inf")), scb[:-1, :, :dc]], 0)
        kvb = torch.cat([prev_k, kvb[..., dc:]], 1)
        scb = torch.cat([prev_s, scb[..., dc:]], 1)
    mx = scb.amax(1, keepdim=True)
    p = torch.exp(scb - mx)
    pooled = (p * kvb).sum(1) / p.sum(1)
    x = pooled.bfloat16().float()
    x = (norm_w.float() * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))).bfloat16().float()
    r = cs.size(1) * 2
    a, b = x[:, -r::2], x[:, -r + 1::2]
    c, s = cs[..., 0].float(), cs[..., 1].float()
    x[:, -r::2], x[:, -r + 1::2] = (a * c - b * s).bfloat16().float(), (a * s + b * c).bfloat16().float()
    x = x.bfloat16()
    if post == "fp8":
        x = ref.kv_qat(x, r)
    elif post.startswith("hadamard"):
        x = ref.rotate_activation(x)
        if post == "hadamard_fp4":
            x = ref.fp4_sim(x, 32)
    return x


def fwht_lanes_model(x):
    """The kernel's Hadamard data movement in torch: x [..., 4 * lanes] viewed as [lanes, 4] per entry; two
    in-thread butterfly stages over the value index, then one per lane bit with the partner lane ^ off
    (bit 0: mine + partner's, bit 1: partner's - mine). Unscaled."""
    import torch
    *lead, n = x.shape
    v = x.reshape(*lead, n // 4, 4).clone()
    for h in (1, 2):
        for e in range(4):
            if e & h == 0:
                a, b = v[..., e].clone(), v[..., e + h].clone()
                v[..., e], v[..., e + h] = a + b, a - b
    lanes = n // 4
    lane = torch.arange(lanes, device=x.device)
    off = 1
    while off < lanes:
        partner = v[..., lane ^ off, :]
        bit = ((lane & off) != 0).view(*([1] * len(lead)), lanes, 1)
        v = torch.where(bit, partner - v, v + partner)
        off *= 2
    return v.reshape(*lead, n)
