"""FP8 linear for DeepSeek's FP8 weights on Hopper (sm_90a): e4m3 x e4m3 WGMMA with 128x128 block scales.

y[m, n] = sum_kb sa[kb, m] * sb[n / 128, kb] * sum_{k in block kb} xq[m, k] * wq[n, k]   (bf16 out)

- Activations: `fp8_act_quant` kernel, per 1 x 128 block: power-of-two scale s = 2**ceil(log2(amax / 448))
  (amax clamped below at 1e-4), xq = e4m3(x / s) with saturation, exactly what the `sim` backend's
  fp8_act_quant (dsv4_references.fp8_sim with block 128) computes, scales stored fp32 [K/128, M].
- Weights: the checkpoint's e4m3 [N, K] as they are; the e8m0 block scales as fp32 [N/128, K/128].
- GEMM: TMA tiles 128 x 128 x 128 or 128 x 64 x 128, in clusters of two CTAs along N that share (multicast)
  their activation tile, K split into parts summed in fp32 in decode (pick_config, Fp8Config; one K block
  per pipeline stage), producer warpgroup + two consumer warpgroups (64 rows each), 4 WGMMA m64nNk32 per
  stage into a fresh fp32 accumulator which is then promoted into the main fp32 accumulator times sa * sb
  (DeepGEMM's per-block promotion: Hopper's FP8 WGMMA accumulates with reduced precision, so no product sum
  runs longer than one 128-wide block).
  Scales are powers of two, so the promotion multiply is exact. A k-tile's scales are loaded as its WGMMAs
  are queued; the epilogue stores 16 bytes a lane after a shuffle exchange within each quad (`store`).
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Uint32, cute, pipeline
from cutlass.cute.nvgpu import warpgroup

from ._common import KernelDef, bits_f32, f32_bits, fake_ptr, fake_stream, fmax_nan, ld_cg_f32x2, register
from ._tma_gemm import CONSUMER_WARPS, TmaOperandsAB, leave_cluster, raster_group, tile_coords

SM90 = ("sm_90a",)
SMEM_BYTES = 227 * 1024
TILE_NS = (128, 64)         # 64-wide tiles double the CTAs of narrow N (wkv's N = 512: 64 CTAs at M = 2048)
CLUSTER_NS = (1, 2)         # CTAs along N sharing (multicasting) their A tile
CLUSTER_N = 2               # where (n // tile_n) is even
TILE64_RATE = 0.6           # a 64-wide tile's speed over a 128-wide one's in full waves (H200: 0.60-0.66)
MAX_SPLIT = 16              # split-K parts
SPLIT_MAX_M = 256           # split K only for one or two rows of tiles (decode, small batches)
CTA_FIXED_KTILES = 7        # decode cost model, in k-tiles of a CTA's main loop: its fixed part (fill, epilogue)
SPLIT_PART_KTILES = 2       # and the sum of the fp32 partials, per part (fit to the H200's decode rows)
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def bf16x2(lo: Float32, hi: Float32) -> Uint32:
    """Two fp32 values rounded to bf16 (round to nearest even) in one 32-bit word, lo in the low half."""
    return cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Uint32],
                                read_only_args=[hi, lo])


# --------------------------------------------------------------------------------------------------------
# Activation quantisation (1 x 128 blocks, power-of-two scales)
# --------------------------------------------------------------------------------------------------------

class Fp8ActQuant:
    """x bf16 [M, K] -> xq e4m3 [M, K], sa fp32 [K/128, M]; 16 threads per block, 8 elements a vector, VECS
    vectors a thread, all loaded before any is converted (one 16-byte load in flight a thread left the copy
    rate at half)."""
    threads, vecs = 256, 4

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, q_ptr: cute.Pointer, s_ptr: cute.Pointer, m: Int32, k: Int32, stream):
        nvec = m * (k // 8)
        mX = cute.make_tensor(x_ptr, cute.make_layout((8, nvec), stride=(1, 8)))
        mQ = cute.make_tensor(q_ptr, cute.make_layout((8, nvec), stride=(1, 8)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((k // 128, m), stride=(m, 1)))
        self.kernel(mX, mQ, mS, nvec, k).launch(grid=[cute.ceil_div(nvec, self.threads * self.vecs), 1, 1],
                                                 block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, nvec: Int32, k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        first = bidx * self.threads * self.vecs + tidx
        rX = cute.make_rmem_tensor((8, self.vecs), BFloat16)
        for j in cutlass.range_constexpr(self.vecs):
            # nvec is a multiple of 16: whole 16-lane groups (one 128-wide block) are in or out
            cute.autovec_copy(mX[None, cutlass.min(first + j * self.threads, nvec - 1)], rX[None, j])
        for j in cutlass.range_constexpr(self.vecs):
            self.quantize(rX[None, j], mQ, mS, first + j * self.threads, nvec, k)

    @cute.jit
    def quantize(self, rX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, v: Int32, nvec: Int32, k: Int32):
        """Vector v's 8 values (rX) -> e4m3 codes; lane 0 of its 16 writes the block's scale."""
        x = rX.load().to(Float32)
        amax = Float32(0.0)
        for i in cutlass.range_constexpr(8):
            amax = fmax_nan(amax, fmax_nan(x[i], -x[i]))
        for off in cutlass.range_constexpr(4):
            amax = fmax_nan(amax, cute.arch.shuffle_sync_bfly(amax, offset=8 >> off))
        t = fmax_nan(amax, Float32(AMAX_FLOOR)) / Float32(FP8_MAX)
        tb = f32_bits(t)
        te = (tb >> 23) & 0xFF
        e = te - 127 + cutlass.select_((tb & 0x7FFFFF) != 0, Int32(1), Int32(0))
        s = bits_f32((e + 127) << 23)
        inv = bits_f32((127 - e) << 23)
        if te == 255:                         # inf or NaN amax: scale inf/NaN, as torch's exp2(ceil(log2))
            s = t
            inv = Float32(0.0)                # inf block: x / inf = 0, inf / inf = NaN (x * 0 gives both)
            if (tb & 0x7FFFFF) != 0:          # NaN block: every element NaN
                inv = t
        rQ = cute.make_rmem_tensor(8, Float8E4M3FN)
        rQ.store((x * inv).to(Float8E4M3FN))          # cvt.rn.satfinite: the clamp to +-448 of the reference
        if v < nvec:
            cute.autovec_copy(rQ, mQ[None, v])
            lane = cute.arch.lane_idx()
            if lane % 16 == 0:
                kpr = k // 8
                row = v // kpr
                kb = (v % kpr) // 16
                mS[kb, row] = s


def _build_quant():
    return Fp8ActQuant(), (fake_ptr(BFloat16), fake_ptr(Float8E4M3FN), fake_ptr(Float32, 4), Int32(16),
                           Int32(7168), fake_stream())


register(KernelDef("fp8_act_quant", "linear", ("sm_90a", "sm_100a"), _build_quant, configs=({},),
                   doc="bf16 -> e4m3 with a power-of-two scale per 1 x 128 (DeepSeek's act_quant)"))


# --------------------------------------------------------------------------------------------------------
# Block-scaled GEMM
# --------------------------------------------------------------------------------------------------------

class Fp8BlockGemm(TmaOperandsAB):
    """xq e4m3 [M, K] (K-major), w e4m3 [N, K] (K-major), sa fp32 [K/128, M], sb fp32 [N/128, K/128] -> y bf16
    [M, N], written as bf16 pairs (y_ptr: 32-bit words, [M, N/2]).

    split_k: grid z splits K into n_split equal parts (the host picks a divisor of K/128). Each part writes its
    fp32 tile to a workspace [n_split, M, N]; per consumer warp a ticket counts the parts done, and the warp
    that finishes last sums the parts in split order (deterministic) and runs the epilogue. A warp's values
    are the same (row, column) set in every part, so warps need not wait for each other."""
    threads = 384

    def __init__(self, tile_n: int = 128, split_k: bool = False, cluster_n: int = 1):
        if tile_n not in TILE_NS:
            raise ValueError(f"tile N must be one of {TILE_NS} (a tile lies in one 128-wide weight block)")
        if cluster_n not in CLUSTER_NS:
            raise ValueError(f"cluster along N must be one of {CLUSTER_NS}")
        self.tile_m, self.tile_n, self.tile_k = 128, tile_n, 128
        self.split_k, self.cluster_n = split_k, cluster_n
        stage_bytes = (self.tile_m + self.tile_n) * self.tile_k
        self.stages = min(8, (SMEM_BYTES - 2048) // stage_bytes)

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, sa_ptr: cute.Pointer, sb_ptr: cute.Pointer,
                 y_ptr: cute.Pointer, ws_ptr: cute.Pointer, ticket_ptr: cute.Pointer, m: Int32, n: Int32,
                 k: Int32, n_split: Int32, group_m: Int32, stream):
        kb = k // 128
        mA = cute.make_tensor(x_ptr, cute.make_layout((m, k), stride=(k, 1)))
        mB = cute.make_tensor(w_ptr, cute.make_layout((n, k), stride=(k, 1)))
        mSA = cute.make_tensor(sa_ptr, cute.make_layout((kb, m), stride=(m, 1)))
        mSB = cute.make_tensor(sb_ptr, cute.make_layout((n // 128, kb), stride=(kb, 1)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((m, n // 2), stride=(n // 2, 1)))
        mWs = cute.make_tensor(ws_ptr, cute.make_layout(n_split * m * n))
        n_tickets = cute.ceil_div(m, self.tile_m) * (n // self.tile_n) * CONSUMER_WARPS
        mTicket = cute.make_tensor(ticket_ptr, cute.make_layout(n_tickets))

        tma_a, mA_tma, tma_b, mB_tma, tiled_mma, sA_layout, sB_layout = self.tma_operands(Float8E4M3FN, mA, mB)
        # grid: x over N tiles, y over M tiles (rastered in groups of group_m rows: tile_coords), z over K parts
        self.kernel(tma_a, mA_tma, tma_b, mB_tma, mSA, mSB, mY, mWs, mTicket, tiled_mma, sA_layout, sB_layout,
                    m, n, k, n_split, group_m).launch(
            grid=[n // self.tile_n, cute.ceil_div(m, self.tile_m), n_split], block=[self.threads, 1, 1],
            cluster=[self.cluster_n, 1, 1], min_blocks_per_mp=1, stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               mSA: cute.Tensor, mSB: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor, mTicket: cute.Tensor,
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout, m: Int32,
               n: Int32, k: Int32, n_split: Int32, group_m: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        _, _, bz = cute.arch.block_idx()
        bx, by = tile_coords(group_m, self.cluster_n)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        k_tiles, k_first = k // self.tile_k, 0
        if cutlass.const_expr(self.split_k):
            k_tiles = k_tiles // n_split
            k_first = bz * k_tiles
        pipe, sA, sB, loads = self.operand_pipeline(tma_a, mA, tma_b, mB, sA_layout, sB_layout, bx, by)

        if warp < 4:
            self.producer_warpgroup(pipe, loads, k_tiles, warp, lane, k_first)
        else:
            cute.arch.setmaxregister_increase(232)
            tCrA, tCrB, tCcC, acc = self.consumer_operands(tiled_mma, sA, sB, tidx)
            # two block accumulators: the WGMMAs of k-tile t + 1 run while tile t is promoted into acc
            tmp0 = cute.make_rmem_tensor(acc.shape, Float32)
            tmp1 = cute.make_rmem_tensor(acc.shape, Float32)
            # this thread's two accumulator rows (r and r + 8)
            r_lo, _ = tCcC[0]
            r_hi, _ = tCcC[2]
            row_lo = cutlass.min(by * self.tile_m + r_lo, m - 1)
            row_hi = cutlass.min(by * self.tile_m + r_hi, m - 1)

            # pairs of k-tiles keep the buffer choice static; the pipeline states advance only in the loop body.
            # Each tile's scales are loaded as its WGMMAs are queued, a tile before its promotion needs them:
            # loaded at the promotion, their global-load latency stalled every k-step (the tensor cores idle).
            rd = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            rl = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            lo0, hi0 = self.scales(mSA, mSB, bx, k_first, row_lo, row_hi)
            self.issue(tiled_mma, tCrA, tCrB, tmp0, pipe, rd)
            rd.advance()
            for kp in cutlass.range((k_tiles - 1) // 2, unroll=1):
                lo1, hi1 = self.scales(mSA, mSB, bx, k_first + 2 * kp + 1, row_lo, row_hi)
                self.issue(tiled_mma, tCrA, tCrB, tmp1, pipe, rd)            # tile 2kp + 1
                rd.advance()
                warpgroup.wait_group(1)                                     # tile 2kp is done
                pipe.consumer_release(rl)
                rl.advance()
                self.promote(acc, tmp0, lo0, hi0)
                lo0, hi0 = self.scales(mSA, mSB, bx, k_first + 2 * kp + 2, row_lo, row_hi)
                self.issue(tiled_mma, tCrA, tCrB, tmp0, pipe, rd)            # tile 2kp + 2
                rd.advance()
                warpgroup.wait_group(1)
                pipe.consumer_release(rl)
                rl.advance()
                self.promote(acc, tmp1, lo1, hi1)
            last = k_tiles - 1 - (k_tiles - 1) % 2                          # the tile now in tmp0
            rl_next = rl.clone()
            rl_next.advance()
            if k_tiles % 2 == 0:                                            # one more tile, into tmp1
                lo1, hi1 = self.scales(mSA, mSB, bx, k_first + last + 1, row_lo, row_hi)
                self.issue(tiled_mma, tCrA, tCrB, tmp1, pipe, rd)
                warpgroup.wait_group(1)
                pipe.consumer_release(rl)
                self.promote(acc, tmp0, lo0, hi0)
                warpgroup.wait_group(0)
                pipe.consumer_release(rl_next)
                self.promote(acc, tmp1, lo1, hi1)
            else:
                warpgroup.wait_group(0)
                pipe.consumer_release(rl)
                self.promote(acc, tmp0, lo0, hi0)

            if cutlass.const_expr(self.split_k):
                if self.sum_splits(acc, tCcC, mWs, mTicket, bx, by, bz, m, n, n_split, warp, lane):
                    self.store(acc, tCcC, mY, bx, by, m, n, lane)
            else:
                self.store(acc, tCcC, mY, bx, by, m, n, lane)
        leave_cluster(self.cluster_n)

    @cute.jit
    def sum_splits(self, acc: cute.Tensor, tCcC: cute.Tensor, mWs: cute.Tensor, mTicket: cute.Tensor, bx: Int32,
                   by: Int32, bz: Int32, m: Int32, n: Int32, n_split: Int32, warp: Int32, lane: Int32):
        """Split-K: this part's acc into the workspace; in the warp that finishes the last part, acc becomes the
        sum of all parts in split order. Returns whether this warp holds the sum (uniform across the warp).
        Values are written and read in (row, 2 columns) pairs: value 4j + 2h + e is row r + 8h, column
        8j + 2q + e."""
        part = m * n
        for p in cutlass.range_constexpr(cute.size(acc) // 2):
            r, c = tCcC[2 * p]
            row = by * self.tile_m + r
            if row < m:
                pair = cute.make_rmem_tensor(2, Float32)
                pair[0] = acc[2 * p]
                pair[1] = acc[2 * p + 1]
                off = cute.assume(bz * part + row * n + bx * self.tile_n + c, divby=2)
                cute.autovec_copy(pair, cute.make_tensor(mWs.iterator + off, cute.make_layout(2)))
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_warp()
        done = Int32(0)
        if lane == 0:
            ticket = (by * (n // self.tile_n) + bx) * CONSUMER_WARPS + (warp - 4)
            done = cute.arch.atomic_add(mTicket.iterator + ticket, Int32(1), sem="acq_rel", scope="gpu")
            if done == n_split - 1:
                mTicket[ticket] = Int32(0)                  # ready for the next launch
        last = cute.arch.shuffle_sync(done, 0) == n_split - 1
        if last:
            cute.arch.fence_acq_rel_gpu()
            acc.fill(0.0)
            # parts outermost, a thread's pairs within each: their loads are in flight together
            for z in cutlass.range(n_split, unroll=2):
                for p in cutlass.range_constexpr(cute.size(acc) // 2):
                    r, c = tCcC[2 * p]
                    row = by * self.tile_m + r
                    if row < m:
                        off = z * part + row * n + bx * self.tile_n + c
                        v0, v1 = ld_cg_f32x2((mWs.iterator + off).toint())
                        acc[2 * p] = acc[2 * p] + v0
                        acc[2 * p + 1] = acc[2 * p + 1] + v1
        return last

    @cute.jit
    def store(self, acc: cute.Tensor, tCcC: cute.Tensor, mY: cute.Tensor, bx: Int32, by: Int32, m: Int32,
              n: Int32, lane: Int32):
        """The epilogue: acc -> bf16 rows of y in 16-byte stores. A thread holds, per 8-column block j, columns
        2q and 2q + 1 (q = lane % 4) of rows r and r + 8 (value 4j + 2h + e: row r + 8h, column 8j + 2q + e).
        The 4 lanes of a quad swap their bf16 pairs over 4 blocks (a 4 x 4 transpose by shuffles), after which
        lane q holds all 8 columns of block 4g + q: 8 stores of 16 bytes a thread instead of 32 of 4 (the
        epilogue is not hidden by any main loop, and with 2-byte stores it cost wq_b a fifth of its time)."""
        q = lane % 4
        quad = lane - q
        for h in cutlass.range_constexpr(2):
            r, _ = tCcC[2 * h]
            row = by * self.tile_m + r
            for g in cutlass.range_constexpr(cute.size(acc) // 16):
                words = []                                  # this lane's pair in each block of the group
                for d in cutlass.range_constexpr(4):
                    words.append(bf16x2(acc[(4 * g + d) * 4 + 2 * h], acc[(4 * g + d) * 4 + 2 * h + 1]))
                out = list(words)
                for k in cutlass.range_constexpr(1, 4):
                    give = (q + 4 - k) % 4                  # this lane's word for lane q - k of the quad (% of a
                                                            # negative Int32 is negative, as in C)
                    send = cutlass.select_(give == 0, words[0], cutlass.select_(
                        give == 1, words[1], cutlass.select_(give == 2, words[2], words[3])))
                    src = (q + k) % 4                       # which sends its word for block 4g + q
                    got = cute.arch.shuffle_sync(send, quad + src)
                    for d in cutlass.range_constexpr(4):
                        out[d] = cutlass.select_(src == d, got, out[d])
                # k = 0: this lane's own word for its block stays in place (out[q] = words[q])
                for d in cutlass.range_constexpr(4):
                    out[d] = cutlass.select_(q == d, words[d], out[d])
                _, c0 = tCcC[4 * (4 * g)]                   # column 8 * 4g + 2q: the group's first block
                col = bx * self.tile_n + (c0 - 2 * q) + 8 * q
                if row < m:
                    v = cute.make_rmem_tensor(4, Uint32)
                    for d in cutlass.range_constexpr(4):
                        v[d] = out[d]
                    base = cute.assume(row * (n // 2) + col // 2, divby=4)
                    cute.autovec_copy(v, cute.make_tensor(mY.iterator + base, cute.make_layout(4)))

    @cute.jit
    def issue(self, tiled_mma: cute.TiledMma, tCrA: cute.Tensor, tCrB: cute.Tensor, tmp: cute.Tensor, pipe, rd):
        """Wait for the stage, queue one k-tile's WGMMAs into tmp (fresh accumulation) and commit them."""
        pipe.consumer_wait(rd)
        warpgroup.fence()
        mma = cute.make_mma_atom(tiled_mma.op)         # a local atom: its accumulate flag stays in this call
        mma.set(warpgroup.Field.ACCUMULATE, False)
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            cute.gemm(mma, tmp, tCrA[(None, None, kb, rd.index)], tCrB[(None, None, kb, rd.index)], tmp)
            mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def scales(self, mSA: cute.Tensor, mSB: cute.Tensor, bx: Int32, kt: Int32, row_lo: Int32, row_hi: Int32):
        """The promotion factors of k-tile kt for this thread's rows: sa[row, kt] * sb[n-block, kt]."""
        sb = mSB[bx // (128 // self.tile_n), kt]
        return mSA[kt, row_lo] * sb, mSA[kt, row_hi] * sb

    @cute.jit
    def promote(self, acc: cute.Tensor, tmp: cute.Tensor, s_lo: Float32, s_hi: Float32):
        """acc += tmp * scale of its row (values alternate rows r, r + 8 in pairs)."""
        for i4 in cutlass.range_constexpr(cute.size(acc) // 4):
            acc[i4 * 4 + 0] = acc[i4 * 4 + 0] + tmp[i4 * 4 + 0] * s_lo
            acc[i4 * 4 + 1] = acc[i4 * 4 + 1] + tmp[i4 * 4 + 1] * s_lo
            acc[i4 * 4 + 2] = acc[i4 * 4 + 2] + tmp[i4 * 4 + 2] * s_hi
            acc[i4 * 4 + 3] = acc[i4 * 4 + 3] + tmp[i4 * 4 + 3] * s_hi


def _build_gemm(tile_n: int = 128, split_k: bool = False, cluster_n: int = 1):
    args = (fake_ptr(Float8E4M3FN), fake_ptr(Float8E4M3FN), fake_ptr(Float32, 4), fake_ptr(Float32, 4),
            fake_ptr(Uint32), fake_ptr(Float32), fake_ptr(Int32, 4), Int32(256), Int32(1536), Int32(7168), Int32(2),
            Int32(2), fake_stream())
    return Fp8BlockGemm(tile_n, split_k, cluster_n), args


register(KernelDef("fp8_block_gemm", "linear", SM90, _build_gemm,
                   configs=tuple({"tile_n": t, "split_k": s, "cluster_n": c} for t in TILE_NS for s in (False, True)
                                 for c in CLUSTER_NS),
                   ci_configs=({"tile_n": 128, "split_k": False, "cluster_n": 2},
                               {"tile_n": 128, "split_k": True, "cluster_n": 1}),
                   doc="e4m3 x e4m3 WGMMA with 1x128 activation / 128x128 weight block scales, bf16 out, "
                       "split-K and clusters sharing the activation tile as configured"))


# --------------------------------------------------------------------------------------------------------
# Torch launchers
# --------------------------------------------------------------------------------------------------------

def fp8_act_quant(x):
    """x bf16 [M, K] -> (xq e4m3 [M, K], sa fp32 [K/128, M]): the values sim.fp8_act_quant rounds to are
    xq * sa (per 1 x 128 block)."""
    import torch

    from ._common import check_numel, compile_kernel, current_stream, device_arch, ptr
    m, k = x.shape
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or k % 128:
        raise ValueError("fp8_act_quant takes contiguous bf16 [M, K] with K % 128 == 0")
    check_numel(x)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(k // 128, m, dtype=torch.float32, device=x.device)
    if m:
        fn = compile_kernel("fp8_act_quant", device_arch(x.device))
        fn(ptr(x), ptr(q), ptr(s, align=4), Int32(m), Int32(k), current_stream())
    return q, s


def weight_scales(scale):
    """e8m0 block scales [N/128, K/128] -> fp32 (exact powers of two), the GEMM's sb."""
    import torch
    return scale.view(torch.float8_e8m0fnu).float().contiguous()


def pick_tile_n(m: int, n: int, sms: int) -> int:
    """The tile width with the shorter estimated time in whole waves of CTAs: 64-wide tiles do half the work of
    128-wide ones at TILE64_RATE of their speed, and win only where 128-wide tiles leave most SMs idle (wkv's
    N = 512 at M = 2048: 64 CTAs on 132 SMs)."""
    rows = -(-m // 128)
    waves128 = -(-rows * (n // 128) // sms)
    waves64 = -(-rows * (n // 64) // sms)
    return 64 if 0.5 * waves64 / TILE64_RATE < waves128 else 128


class Fp8Config(NamedTuple):
    """How fp8_gemm runs a shape: tile width, K parts, CTAs along N that share their A tile, rows of tiles in a
    raster group (0: raster_group's choice; 1: launch order, one row of tiles after another)."""
    tile_n: int = 128
    split: int = 1
    cluster_n: int = 1
    group_m: int = 0

    def __str__(self) -> str:
        return f"n{self.tile_n}" + (f"/k{self.split}" if self.split > 1 else "") + (
            f"/c{self.cluster_n}" if self.cluster_n > 1 else "") + (f"/g{self.group_m}" if self.group_m else "")


def pick_config(m: int, n: int, k: int, sms: int) -> Fp8Config:
    """Above SPLIT_MAX_M rows: pick_tile_n's width and K whole. The GEMM is bound there by the operand traffic
    from L2 (~6 TB/s on the H200 at every large shape): splitting the 1.45 waves of Pro wq_a at M = 2048 into
    2.9 half-length ones gained nothing (69.3 -> 68.8 us), while clusters of two CTAs along N multicasting
    their A tile (a quarter less traffic) took it to 54.2 us and wo_b from 592 to 501 us. Short K loops (wq_b's
    12 k-tiles) gained nothing from clusters while each row of tiles streamed all of B; with the grouped raster
    they do too (H100: Pro wq_b at M = 2048 610 -> 555 us, Flash 254 -> 232 us).
    In decode one row of tiles leaves most SMs idle and each CTA's long K loop bounds the time: the width and
    split with the least estimated time in whole waves, a CTA costing its k-tiles plus CTA_FIXED_KTILES plus
    SPLIT_PART_KTILES a part (Pro wq_a at M = 16: 31 us unsplit, 12.8 us in 8 parts), in clusters of two."""
    k_tiles = k // 128
    if m > SPLIT_MAX_M:
        t = pick_tile_n(m, n, sms)
        return Fp8Config(t, 1, CLUSTER_N if (n // t) % CLUSTER_N == 0 else 1)
    best = None
    for t in TILE_NS:
        width = t / 128 / (1.0 if t == 128 else TILE64_RATE)
        for split in range(1, min(MAX_SPLIT, k_tiles) + 1):
            if k_tiles % split == 0:
                ctas = -(-m // 128) * (n // t) * split
                part = SPLIT_PART_KTILES * split if split > 1 else 0
                est = -(-ctas // sms) * width * (k_tiles // split + CTA_FIXED_KTILES + part)
                if best is None or est < best[0]:
                    best = (est, t, split)
    _, t, split = best
    return Fp8Config(t, split, CLUSTER_N if (n // t) % CLUSTER_N == 0 else 1)


def fp8_gemm(xq, sa, w, sb, out=None, config: Fp8Config | None = None):
    """xq e4m3 [M, K], sa fp32 [K/128, M], w e4m3 [N, K], sb fp32 [N/128, K/128] -> bf16 [M, N]; config:
    pick_config's by default."""
    import torch

    from ._common import check_numel, compile_kernel, current_stream, device_arch, ptr, scratch, sm_count
    m, k = xq.shape
    n = w.shape[0]
    if w.shape[1] != k or n % 128 or k % 128:
        raise ValueError(f"fp8 GEMM needs N % 128 == 0 and K % 128 == 0 (got N={n}, K={k})")
    if sb.shape != (n // 128, k // 128) or sa.shape != (k // 128, m):
        raise ValueError("fp8 GEMM scale shapes do not match the operands")
    check_numel(xq, w)
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=xq.device)
    elif out.dtype != torch.bfloat16 or out.shape != (m, n) or not out.is_contiguous():
        raise ValueError(f"fp8 GEMM writes a contiguous bf16 [{m}, {n}], not {out.dtype} {tuple(out.shape)}")
    if not m:
        return out
    tile_n, split, cluster_n, group_m = config or pick_config(m, n, k, sm_count(xq.device))
    if split < 1 or (k // 128) % split or split * m * n >= 2 ** 31:
        raise ValueError(f"fp8 GEMM cannot split K = {k} into {split} parts of whole 128-wide blocks "
                         f"(or the [{split}, {m}, {n}] fp32 partials exceed 32-bit offsets)")
    if (n // tile_n) % cluster_n:
        raise ValueError(f"fp8 GEMM cannot group {n // tile_n} tiles along N in clusters of {cluster_n}")
    if split > 1:
        ws = scratch("fp8_partials", xq.device, split * m * n, torch.float32)
        tickets = scratch("fp8_tickets", xq.device, -(-m // 128) * (n // tile_n) * CONSUMER_WARPS, torch.int32)
    else:
        ws, tickets = sa, sa                                # not read without split-K
    fn = compile_kernel("fp8_block_gemm", device_arch(xq.device), tile_n=tile_n, split_k=split > 1,
                        cluster_n=cluster_n)
    fn(ptr(xq), ptr(w), ptr(sa, align=4), ptr(sb, align=4), ptr(out, Uint32), ptr(ws, Float32, align=4),
       ptr(tickets, Int32, align=4), Int32(m), Int32(n), Int32(k), Int32(split),
       Int32(group_m or raster_group(m, k, 128, 1)), current_stream())
    return out


def fp8_linear(x, w, sb, out=None, config: Fp8Config | None = None):
    """x bf16 [..., K] @ (w e4m3 [N, K] with fp32 block scales sb [N/128, K/128])^T -> bf16 [..., N]:
    activations quantised per 1 x 128 (the official act_quant), fp32 accumulation with per-block promotion."""
    shape = x.shape
    xq, sa = fp8_act_quant(x.reshape(-1, shape[-1]).contiguous())
    y = fp8_gemm(xq, sa, w.contiguous(), sb, out, config)
    return y.view(*shape[:-1], w.shape[0])
