"""DeepSeek-V4 lightning indexer on Hopper: scores (WGMMA) and causal top-k (radix select).

indexer_scores (dsv4_references.attention.indexer_scores), sm_90a:
    score[s, t] = sum_h relu(q[s, h] . k[t]) * w[s, h],   -inf where t >= (s + 1) // ratio
  q [S, 64, 128] bf16, k [T, 128] bf16, w [S, 64] bf16 (weights_proj output already times the weight scale,
  as the backend passes it), scores [S, T] bf16. One CTA = one tile of 128 keys x a block of tokens; its two
  warpgroups take alternate tokens. The key tile [128, 128] is loaded once (cp.async, 128B-swizzled), each
  token's q [64 heads, 128] is double-buffered per warpgroup; WGMMA m64n128k16 gives the [64 heads, 128 keys]
  fp32 dot products. The epilogue follows the reference's bf16 rounding points (DeepSeek computes the
  indexer in bf16): bf16(dot), relu, bf16(relu * w) per head, fp32 sum over the 64 heads (in-thread rows,
  quad shuffles, then 4 warps through smem), one rounding to bf16. Tiles wholly in the causal future are
  written as -inf without MMA.

indexer_topk (dsv4_references.attention.indexer_topk), SIMT, any arch:
  one CTA (512 threads) a row; the bf16 scores as order-preserving 16-bit keys; 8-bit radix select in two
  histogram passes (shared-memory atomics) finds the k-th largest key t; a third pass writes, in index order,
  every entry > t, then the lowest-index entries == t up to k (deterministic tie rule), -1 padding where
  fewer than k entries are finite (-inf = not visible). Only the first min(T, (s + 1) // ratio) entries of
  row s are read (the rest are -inf by construction) when ratio > 0.
  The SET equals torch.topk's up to which of the entries tied at the k-th value are taken; the ORDER is not
  descending score: ids above the k-th value in ascending order, then the tied ones in ascending order (the
  attention that consumes the ids is order-independent).
"""
from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Uint16, cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from ._common import BOTH, KernelDef, fake_ptr, fake_stream, register

SM90 = ("sm_90a",)
NEG_INF_KEY = 0x007F          # order-preserving key of bf16 -inf (0xFF80)


def _ordered(shape, order):
    return cute.make_ordered_layout(shape, order=order)


# --------------------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------------------

class IndexerScores:
    """q [S, IH=64, ID=128] bf16, k [T, 128] bf16, w [S, 64] bf16 -> scores [S, T] bf16."""
    threads = 256
    heads = 64
    dim = 128
    bn = 128

    def __init__(self, tokens_per_cta: int = 32):
        if tokens_per_cta % 2:
            raise ValueError("indexer_scores: tokens_per_cta must be even (two warpgroups)")
        self.tb = tokens_per_cta

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, w_ptr: cute.Pointer, o_ptr: cute.Pointer,
                 S: Int32, T: Int32, ratio: Int32, stream):
        H, D = self.heads, self.dim
        mQ = cute.make_tensor(q_ptr, cute.make_layout((S, H, D), stride=(H * D, D, 1)))
        tpad = cute.assume(T, divby=1)
        mK = cute.make_tensor(k_ptr, cute.make_layout((tpad, D), stride=(D, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((S, H), stride=(H, 1)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((S, T), stride=(T, 1)))
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.utils.LayoutEnum.ROW_MAJOR, BFloat16, 64), BFloat16)
        sQ_layout = cute.tile_to_shape(atom, (H, D, 2, 2), order=(0, 1, 2, 3))       # (.., stage, warpgroup)
        sK_layout = cute.tile_to_shape(atom, (self.bn, D), order=(0, 1))
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (1, 1, 1), tiler_mn=(H, self.bn))

        @cute.struct
        class Storage:
            red: cute.struct.MemRange[Float32, 2 * 4 * self.bn]
            sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]

        self.storage = Storage
        self.kernel(mQ, mK, mW, mO, sQ_layout, sK_layout, tiled_mma, S, T, ratio).launch(
            grid=[cute.ceil_div(T, self.bn), cute.ceil_div(S, self.tb), 1], block=[self.threads, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma,
               S: Int32, T: Int32, ratio: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        nt, sb, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        ctid = tidx % 128
        warp_in_wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        lane = cute.arch.lane_idx()
        H, D, bn = self.heads, self.dim, self.bn
        n0 = nt * bn
        s0 = sb * self.tb
        s_end = cutlass.min(s0 + self.tb, S)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sRed = st.red.get_tensor(cute.make_layout((bn, 4, 2), stride=(1, bn, 4 * bn)))
        wg_bar = pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=128)

        # 16-byte cp.async copies: 16 threads a 128-dim row, 8 rows a pass (within one warpgroup)
        g2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
                                num_bits_per_copy=128), _ordered((8, 16), (1, 0)), cute.make_layout((1, 8)))
        thr = g2s.get_slice(ctid)

        # the key tile: each warpgroup loads half of its rows (rows past T are zero: their column is masked)
        gK = cute.local_tile(mK, (bn, D), (nt, 0))
        cK = cute.local_tile(cute.make_identity_tensor((T, D)), (bn, D), (nt, 0))
        tKg = thr.partition_S(gK)
        tKs = thr.partition_D(sK)
        tKc = thr.partition_S(cK)
        for p in cutlass.range_constexpr(cute.size(tKs, mode=[1])):
            if p % 2 == wg:
                row, _ = tKc[0, p, 0]
                if row < T:
                    cute.copy(g2s, tKg[None, p, 0], tKs[None, p, 0])
                else:
                    z = cute.make_rmem_tensor((8,), BFloat16)
                    z.fill(0.0)
                    cute.autovec_copy(z, tKs[None, p, 0])
        cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(ctid)
        tCrK = tiled_mma.make_fragment_B(thr_mma.partition_B(sK))
        cC = cute.make_identity_tensor((H, bn))
        tCc = thr_mma.partition_C(cC)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((H, bn)), Float32)
        n_k = cute.size(tCrK, mode=[2])

        # this warpgroup's tokens: s0 + wg, s0 + wg + 2, ...
        first = s0 + wg
        if first < s_end:
            self.issue_q(g2s, thr, mQ, sQ, first, 0, wg)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(1)                # this thread's part of the key tile has landed
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()                        # ... and every thread's part (both warpgroups)
        it = 0
        for s in cutlass.range(first, s_end, 2, unroll=1):
            stage = it % 2
            nxt = s + 2
            if nxt < s_end:
                self.issue_q(g2s, thr, mQ, sQ, nxt, 1 - stage, wg)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(1)            # q of token s (this warpgroup's threads)
            cute.arch.fence_proxy("async.shared", space="cta")
            wg_bar.arrive_and_wait()
            vis = T
            if ratio > 0:
                vis = cutlass.min(T, (s + 1) // ratio)
            if n0 < vis:
                tCrQ = tiled_mma.make_fragment_A(thr_mma.partition_A(sQ[None, None, stage, wg]))
                warpgroup.fence()
                mma = cute.make_mma_atom(tiled_mma.op)
                mma.set(warpgroup.Field.ACCUMULATE, False)
                for k in cutlass.range_constexpr(n_k):
                    cute.gemm(mma, acc, tCrQ[None, None, k], tCrK[None, None, k], acc)
                    mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                # the reference's rounding points: bf16(dot) -> relu -> bf16(* w) -> fp32 head sum -> bf16
                r_lo, _ = tCc[0]
                r_hi, _ = tCc[2]
                w_lo = mW[s, r_lo].to(Float32)
                w_hi = mW[s, r_hi].to(Float32)
                colsum = cute.make_rmem_tensor((cute.size(acc) // 2,), Float32)
                for i in cutlass.range(cute.size(acc) // 4, unroll_full=True):
                    for a in cutlass.range_constexpr(2):
                        lo = cute.arch.fmax(acc[4 * i + a].to(BFloat16).to(Float32), Float32(0.0))
                        hi = cute.arch.fmax(acc[4 * i + 2 + a].to(BFloat16).to(Float32), Float32(0.0))
                        colsum[2 * i + a] = ((lo * w_lo).to(BFloat16).to(Float32)
                                             + (hi * w_hi).to(BFloat16).to(Float32))
                for i in cutlass.range(cute.size(colsum), unroll_full=True):
                    v = colsum[i]
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=4)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=8)
                    v = v + cute.arch.shuffle_sync_bfly(v, offset=16)
                    colsum[i] = v
                if lane < 4:
                    for i in cutlass.range(cute.size(colsum), unroll_full=True):
                        _, col = tCc[(i % 2) + 4 * (i // 2)]
                        sRed[col, warp_in_wg, wg] = colsum[i]
                wg_bar.arrive_and_wait()
                col = ctid
                tot = sRed[col, 0, wg] + sRed[col, 1, wg] + sRed[col, 2, wg] + sRed[col, 3, wg]
                t = n0 + col
                if t < T:
                    if t < vis:
                        mO[s, t] = tot.to(BFloat16)
                    else:
                        mO[s, t] = Float32(-Float32.inf).to(BFloat16)
            else:
                t = n0 + ctid
                if t < T:
                    mO[s, t] = Float32(-Float32.inf).to(BFloat16)
            wg_bar.arrive_and_wait()                    # sRed and the other q stage are free again
            it = it + 1
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def issue_q(self, g2s: cute.TiledCopy, thr, mQ: cute.Tensor, sQ: cute.Tensor, s: Int32, stage: Int32, wg: Int32):
        cute.copy(g2s, thr.partition_S(mQ[s, None, None]), thr.partition_D(sQ[None, None, stage, wg]))


# --------------------------------------------------------------------------------------------------------
# Top-k
# --------------------------------------------------------------------------------------------------------

class IndexerTopK:
    """scores [S, T] bf16 (read as 16-bit patterns) -> ids [S, k] int32 (-1 padded)."""
    threads = 512

    @cute.jit
    def __call__(self, s_ptr: cute.Pointer, o_ptr: cute.Pointer, S: Int32, T: Int32, k: Int32, ratio: Int32,
                 stream):
        mS = cute.make_tensor(s_ptr, cute.make_layout((S, T), stride=(T, 1)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((S, k), stride=(k, 1)))

        @cute.struct
        class Storage:
            hist: cute.struct.MemRange[Int32, 256]
            wsum: cute.struct.MemRange[Int32, 2 * 2 * 16]
            info: cute.struct.MemRange[Int32, 4]

        self.storage = Storage
        self.kernel(mS, mO, T, k, ratio).launch(grid=[S, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @staticmethod
    @cute.jit
    def key_of(bits: Int32) -> Int32:
        """Order-preserving unsigned key of a bf16 bit pattern (larger value -> larger key)."""
        b = bits & 0xFFFF
        return cutlass.select_((b & 0x8000) != 0, (~b) & 0xFFFF, b | 0x8000)

    @cute.jit
    def select_bin(self, hist: cute.Tensor, need: Int32, info: cute.Tensor, lane: Int32):
        """Warp 0: the bin b holding the need-th largest key, counting down from bin 255;
        info[0] = b, info[1] = how many keys of bin b are needed, info[2] = total count (all bins)."""
        c = Int32(0)
        for j in cutlass.range_constexpr(8):
            c = c + hist[8 * lane + j]
        suf = c                                                  # inclusive suffix sum over lanes >= lane
        for off in (1, 2, 4, 8, 16):
            o = cute.arch.shuffle_sync_down(suf, offset=off)
            if lane + off < 32:
                suf = suf + o
        total = cute.arch.shuffle_sync(suf, 0)
        above = suf - c
        if above < need and need <= suf:          # noqa: PLR1716 - no chained compare in the DSL
            acc = above
            found = Int32(0)
            for jj in cutlass.range_constexpr(8):
                j = 7 - jj
                h = hist[8 * lane + j]
                if found == 0 and acc + h >= need:
                    info[0] = 8 * lane + j
                    info[1] = need - acc
                    found = Int32(1)
                acc = acc + h
        if lane == 0:
            info[2] = total

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mO: cute.Tensor, T: Int32, k: Int32, ratio: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        nthr = self.threads
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        hist = st.hist.get_tensor(cute.make_layout((256,)))
        wsum = st.wsum.get_tensor(cute.make_layout((16, 2, 2), stride=(1, 16, 32)))
        info = st.info.get_tensor(cute.make_layout((4,)))
        limit = T
        if ratio > 0:
            limit = cutlass.min(T, (row + 1) // ratio)

        # ---- pass 1: histogram of the high byte of the finite keys
        if tidx < 256:
            hist[tidx] = Int32(0)
        cute.arch.sync_threads()
        for i in cutlass.range(tidx, limit, nthr, unroll=1):
            key = self.key_of(Int32(mS[row, i]))
            if key != NEG_INF_KEY:
                cute.arch.atomic_add(hist.iterator + (key >> 8), Int32(1), scope="cta")
        cute.arch.sync_threads()
        if warp == 0:
            if lane == 0:
                info[0] = Int32(-1)
            self.select_bin(hist, k, info, lane)
        cute.arch.sync_threads()
        total = info[2]
        b1 = info[0]
        need1 = info[1]
        thr_key = Int32(-1)                                     # all finite entries when total <= k
        need_eq = Int32(0)
        if total > k:
            # ---- pass 2: histogram of the low byte within bin b1
            cute.arch.sync_threads()
            if tidx < 256:
                hist[tidx] = Int32(0)
            cute.arch.sync_threads()
            for i in cutlass.range(tidx, limit, nthr, unroll=1):
                key = self.key_of(Int32(mS[row, i]))
                if key != NEG_INF_KEY and (key >> 8) == b1:
                    cute.arch.atomic_add(hist.iterator + (key & 0xFF), Int32(1), scope="cta")
            cute.arch.sync_threads()
            if warp == 0:
                self.select_bin(hist, need1, info, lane)
            cute.arch.sync_threads()
            thr_key = (b1 << 8) | info[0]
            need_eq = info[1]
        # ---- pass 3: write ids in index order: keys > thr_key, then the first need_eq keys == thr_key
        n_gt_total = cutlass.select_(total > k, k - need_eq, total)
        base_gt = Int32(0)
        base_eq = Int32(0)
        lt_mask = cute.arch.lanemask_lt()
        par = Int32(0)
        for c0 in cutlass.range(0, limit, nthr, unroll=1):
            i = c0 + tidx
            key = Int32(NEG_INF_KEY)
            if i < limit:
                key = self.key_of(Int32(mS[row, i]))
            fin = key != NEG_INF_KEY
            gt = fin and key > thr_key
            eq = fin and key == thr_key and total > k
            bg = cute.arch.vote_ballot_sync(gt)
            be = cute.arch.vote_ballot_sync(eq)
            if lane == 0:
                wsum[warp, 0, par] = cute.arch.popc(bg)
                wsum[warp, 1, par] = cute.arch.popc(be)
            cute.arch.sync_threads()
            pre_g = cute.arch.popc(bg & lt_mask)
            pre_e = cute.arch.popc(be & lt_mask)
            tot_g = Int32(0)
            tot_e = Int32(0)
            for w in cutlass.range_constexpr(nthr // 32):
                vg = wsum[w, 0, par]
                ve = wsum[w, 1, par]
                if w < warp:
                    pre_g = pre_g + vg
                    pre_e = pre_e + ve
                tot_g = tot_g + vg
                tot_e = tot_e + ve
            if gt:
                mO[row, base_gt + pre_g] = i
            if eq:
                r = base_eq + pre_e
                if r < need_eq:
                    mO[row, n_gt_total + r] = i
            base_gt = base_gt + tot_g
            base_eq = base_eq + tot_e
            par = 1 - par
        n_sel = cutlass.min(total, k)
        for j in cutlass.range(n_sel + tidx, k, nthr, unroll=1):
            mO[row, j] = Int32(-1)


# --------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------

def _build_scores(tokens_per_cta: int = 32):
    return IndexerScores(tokens_per_cta), (fake_ptr(BFloat16), fake_ptr(BFloat16), fake_ptr(BFloat16, 2),
                                           fake_ptr(BFloat16, 2), Int32(64), Int32(16), Int32(4), fake_stream())


def _build_topk():
    return IndexerTopK(), (fake_ptr(Uint16, 2), fake_ptr(Int32, 4), Int32(4), Int32(4096), Int32(512), Int32(4),
                           fake_stream())


register(KernelDef("indexer_scores", "indexer", SM90, _build_scores, configs=({"tokens_per_cta": 32},),
                   doc="sum_h relu(q.k) * w with the reference's bf16 rounding points; WGMMA m64n128k16"))
register(KernelDef("indexer_topk", "indexer", BOTH, _build_topk, configs=({},),
                   doc="causal top-k over bf16 scores: 2-pass 8-bit radix select, ids in index order, -1 pad"))


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------

def indexer_scores(q, k, w, ratio: int, tokens_per_cta: int = 32):
    """q [S, 64, 128] bf16, k [T, 128] bf16, w [S, 64] bf16 (weights already scaled) -> [S, T] bf16."""
    import torch

    from ._common import check_numel, compile_kernel, current_stream, device_arch, ptr
    if q.dtype != torch.bfloat16 or q.shape[1:] != (64, 128) or k.shape[1:] != (128,) or w.shape != q.shape[:2]:
        raise ValueError("indexer_scores takes q [S, 64, 128], k [T, 128], w [S, 64] bf16")
    S, T = q.size(0), k.size(0)
    q, k, w = q.contiguous(), k.to(torch.bfloat16).contiguous(), w.to(torch.bfloat16).contiguous()
    out = torch.empty(S, T, dtype=torch.bfloat16, device=q.device)
    check_numel(q, out)
    if S and T:
        fn = compile_kernel("indexer_scores", device_arch(q.device), tokens_per_cta=tokens_per_cta)
        fn(ptr(q), ptr(k), ptr(w, align=2), ptr(out, align=2), Int32(S), Int32(T), Int32(ratio), current_stream())
    return out


def indexer_topk(scores, k: int, ratio: int = 0):
    """scores [S, T] bf16 -> ids [S, min(k, T)] int64, -1 where fewer entries are finite (order: see module).
    ratio > 0: row s reads only its first (s + 1) // ratio entries (the rest must be -inf)."""
    import torch
    from cutlass.cute.runtime import make_ptr

    from ._common import check_numel, compile_kernel, current_stream, device_arch, ptr
    if scores.dtype != torch.bfloat16 or scores.dim() != 2:
        raise ValueError("indexer_topk takes scores [S, T] bf16")
    S, T = scores.shape
    kk = min(k, T)
    scores = scores.contiguous()
    out = torch.empty(S, kk, dtype=torch.int32, device=scores.device)
    check_numel(scores)
    if S and kk:
        fn = compile_kernel("indexer_topk", device_arch(scores.device))
        sp = make_ptr(Uint16, scores.data_ptr(), cute.AddressSpace.gmem, assumed_align=2)
        fn(sp, ptr(out, align=4), Int32(S), Int32(T), Int32(kk), Int32(ratio), current_stream())
    return out.long()


def scores_op(q, k, weights, ratio: int, weight_scale: float):
    """The flow's indexer_scores op: weights * weight_scale in bf16 (torch, as the reference backend does),
    heads zero-padded to the kernel's 64 (a zero head adds relu(0) * 0 = 0 to every sum), then the kernel."""
    import torch
    S, IH, ID = q.shape
    if IH > 64 or ID != 128:
        raise ValueError(f"indexer_scores kernel: needs <= 64 heads of 128 dims, got {IH} x {ID}")
    w = weights.to(torch.bfloat16) * weight_scale
    if IH < 64:
        q = torch.cat([q, q.new_zeros(S, 64 - IH, ID)], 1)
        w = torch.cat([w, w.new_zeros(S, 64 - IH)], 1)
    return indexer_scores(q, k, w, ratio)


# --------------------------------------------------------------------------------------------------------
# CPU models
# --------------------------------------------------------------------------------------------------------

def topk_model(scores, k: int, ratio: int = 0):
    """Exactly what the top-k kernel writes (same threshold, same tie rule, same order), in torch."""
    import torch
    S, T = scores.shape
    kk = min(k, T)
    bits = scores.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    key = torch.where((bits & 0x8000) != 0, (~bits) & 0xFFFF, bits | 0x8000)
    out = torch.full((S, kk), -1, dtype=torch.int64)
    for s in range(S):
        lim = min(T, (s + 1) // ratio) if ratio > 0 else T
        ks = key[s, :lim]
        fin = ks != NEG_INF_KEY
        total = int(fin.sum())
        if total <= kk:
            sel = torch.nonzero(fin).flatten()
        else:
            t = int(torch.sort(ks[fin], descending=True).values[kk - 1])
            gt = torch.nonzero(fin & (ks > t)).flatten()
            eq = torch.nonzero(fin & (ks == t)).flatten()[: kk - gt.numel()]
            sel = torch.cat([gt, eq])
        out[s, : sel.numel()] = sel
    return out


def scores_model(q, k, w, ratio: int):
    """The scores kernel's rounding points in torch: bf16(q.k fp32) -> relu -> bf16(* w) -> fp32 sum -> bf16."""
    import torch
    dots = torch.einsum("shd,td->sht", q.float(), k.float()).bfloat16().float().clamp(min=0)
    prod = (dots * w.float().unsqueeze(-1)).bfloat16().float()
    out = prod.sum(1).bfloat16()
    S, T = out.shape
    dev = out.device
    vis = torch.arange(T, device=dev)[None, :] < (torch.arange(S, device=dev)[:, None] + 1) // ratio \
        if ratio > 0 else torch.ones(S, T, dtype=torch.bool, device=dev)
    return out.masked_fill(~vis, float("-inf"))
