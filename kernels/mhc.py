"""mHC (manifold-constrained hyper-connections): Block.hc_pre and hc_post (dsv4_references.mhc).

hc_pre is two kernels:
- `hc_mix`: mixes[s, n] = (x_s . fn_n) * rsqrt(mean(x_s^2) + eps) over all M*D features of the M streams,
  fp32 accumulation (the reference's F.linear in fp32). A skinny product (N = (2+M)*M = 24 columns): each warp
  owns 4 tokens and walks K in chunks of 256 features; the fn chunk [24, 256] (fp32) is staged in shared memory
  by cp.async, two stages deep, and shared by the 8 warps (32 tokens) of the CTA; the next x chunk is
  prefetched into registers while the current one is multiplied. SIMT FMAs, no tensor cores: fn stays fp32.
- `hc_pre_apply`: per token, sigmoid pre/post, softmax + Sinkhorn on the M x M comb (16 lanes per token, one
  per comb entry, row/column sums by butterfly shuffles, `iters` normalisation rounds, all in registers), then
  the weighted stream sum y = sum_m pre_m x_m (fp32, one bf16 rounding), 16 tokens per CTA.
hc_post is one kernel: out[s, k] = post[s, k] * a[s] + sum_j comb[s, j, k] * residual[s, j], fp32 math.
"""
from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, Uint32, const_expr, cute
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
    ld_nc_u32x4,
    mma_bf16_16816,
    ptr,
    register,
)

CHUNK = 256        # features per warp pass in hc_mix: lane holds [h*128 + 4*lane, +4) for h = 0, 1


class HcMix:
    """x bf16 [S, K], fn fp32 [nmix, K] -> mixes fp32 [S, nmix]."""

    def __init__(self, K: int, nmix: int = 24, tpw: int = 4, warps: int = 8):
        if K % (2 * CHUNK):
            raise ValueError(f"hc_mix: K={K} must be a multiple of {2 * CHUNK}")
        if (nmix * CHUNK // 4) % (warps * 32):
            raise ValueError(f"hc_mix: nmix={nmix} does not split over {warps * 32} threads")
        self.K, self.nmix, self.tpw, self.warps = K, nmix, tpw, warps
        self.nchunks = K // CHUNK
        self.threads = warps * 32
        self.tokens_per_cta = warps * tpw
        self.fn_vecs = nmix * CHUNK // 4 // self.threads        # 16-byte cp.async per thread per chunk

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, fn_ptr: cute.Pointer, o_ptr: cute.Pointer, S: Int32, eps: Float32,
                 stream):
        mX = cute.make_tensor(x_ptr, cute.make_layout((4, 32, 2, self.nchunks, S),
                                                      stride=(1, 4, 128, CHUNK, self.K)))
        # fn chunk c as 16-byte vectors: (4 floats, 64 vectors a row, nmix rows, chunk)
        mFn = cute.make_tensor(fn_ptr, cute.make_layout((4, CHUNK // 4, self.nmix, self.nchunks),
                                                        stride=(1, 4, self.K, CHUNK)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((self.nmix, S), stride=(1, self.nmix)))
        self.kernel(mX, mFn, mO, S, eps).launch(
            grid=[cute.ceil_div(S, self.tokens_per_cta), 1, 1], block=[self.threads, 1, 1], stream=stream)

    # trace-time helpers (plain Python loops unroll while tracing)
    def load_fn(self, atom, mFn, sFn, tidx, c, stage):
        for i in range(self.fn_vecs):
            v = tidx + i * self.threads
            cute.copy(atom, mFn[None, v % (CHUNK // 4), v // (CHUNK // 4), c],
                      sFn[None, v % (CHUNK // 4), v // (CHUNK // 4), stage])
        cute.arch.cp_async_commit_group()

    def load_x(self, mX, r, lane, tok0, S, c):
        for tk in range(self.tpw):
            tok = cutlass.min(tok0 + tk, S - 1)
            for h in range(2):
                cute.autovec_copy(mX[None, lane, h, c, tok], r[None, h, tk])

    def compute(self, sW, r, acc, ss, lane, stage):
        rx = cute.make_rmem_tensor((4, 2, self.tpw), Float32)
        rx.store(r.load().to(Float32))
        for tk in range(self.tpw):
            s = ss[tk]
            for h in range(2):
                for e in range(4):
                    s += rx[e, h, tk] * rx[e, h, tk]
            ss[tk] = s
        rW = cute.make_rmem_tensor((4,), Float32)
        for n in range(self.nmix):
            for h in range(2):
                cute.autovec_copy(sW[None, lane, h, n, stage], rW)
                for tk in range(self.tpw):
                    a = acc[tk, n]
                    for e in range(4):
                        a += rx[e, h, tk] * rW[e]
                    acc[tk, n] = a

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mFn: cute.Tensor, mO: cute.Tensor, S: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = SmemAllocator()
        sFn = smem.allocate_tensor(Float32, cute.make_layout((4, CHUNK // 4, self.nmix, 2),
                                                             stride=(1, 4, CHUNK, self.nmix * CHUNK)),
                                   byte_alignment=16)
        # the same buffer seen by the compute warps: (4 floats, lane, half, n, stage)
        sW = cute.make_tensor(sFn.iterator, cute.make_layout((4, 32, 2, self.nmix, 2),
                                                             stride=(1, 4, 128, CHUNK, self.nmix * CHUNK)))
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128)

        tok0 = bidx * self.tokens_per_cta + warp * self.tpw
        acc = cute.make_rmem_tensor((self.tpw, self.nmix), Float32)
        acc.fill(0.0)
        ss = cute.make_rmem_tensor((self.tpw,), Float32)
        ss.fill(0.0)
        rA = cute.make_rmem_tensor((4, 2, self.tpw), BFloat16)
        rB = cute.make_rmem_tensor((4, 2, self.tpw), BFloat16)

        self.load_fn(atom, mFn, sFn, tidx, 0, 0)
        self.load_x(mX, rA, lane, tok0, S, 0)
        for c2 in cutlass.range(self.nchunks // 2):
            c = 2 * c2
            self.load_fn(atom, mFn, sFn, tidx, c + 1, 1)
            self.load_x(mX, rB, lane, tok0, S, c + 1)
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()
            self.compute(sW, rA, acc, ss, lane, 0)
            cute.arch.barrier()
            cn = cutlass.min(c + 2, self.nchunks - 1)
            self.load_fn(atom, mFn, sFn, tidx, cn, 0)
            self.load_x(mX, rA, lane, tok0, S, cn)
            cute.arch.cp_async_wait_group(1)
            cute.arch.barrier()
            self.compute(sW, rB, acc, ss, lane, 1)
            cute.arch.barrier()
        cute.arch.cp_async_wait_group(0)

        for tk in cutlass.range_constexpr(self.tpw):
            tok = tok0 + tk
            rstd = cute.math.rsqrt(group_sum(ss[tk], 32) / self.K + eps)
            for n in cutlass.range_constexpr(self.nmix):
                v = group_sum(acc[tk, n], 32)
                if lane == n % 32 and tok < S:
                    mO[n, tok] = v * rstd


class HcMixMma:
    """hc_mix on tensor cores: x bf16 [S, K], fn as bf16 hi + lo [2, NP, K] (fn = hi + lo to 16 significant
    bits; NP = nmix rounded up to 8, zero rows past nmix) -> mixes fp32 [S, nmix].

    The SIMT kernel's 24 FMAs per feature and token bound it (hc_pre at ~2.3x hc_head's 4 mixes); here they
    are mma.sync m16n8k16 with fp32 accumulators, x.hi + x.lo for each of NP / 8 column tiles. A CTA holds
    `mtiles` tiles of 16 tokens, each split over `kparts` warps along K: warp (p, m) walks features
    [p K / kparts, (p + 1) K / kparts) in blocks of 32. The features of a block are permuted the same way for
    x and fn, so that every lane loads 16 contiguous bytes of one row of each (no shuffles, no shared-memory
    staging): lane (g, q) reads features 8q..8q+7 of x rows g and g+8 and of fn rows g (+8 per column tile);
    k-step s (two per block) takes features 8q+4s+{0,1} as the fragment's columns 2q, 2q+1 and 8q+4s+{2,3}
    as 2q+8, 2q+9. The next block's registers are loaded while this one is multiplied; fn (2.75 MB at Pro
    shapes) is read through L1 by the CTA's `mtiles` warps of one K part. The sums of squares come from the
    same x registers. The K parts' partial sums meet in shared memory and are added in part order
    (deterministic), then times rsqrt(mean + eps)."""

    def __init__(self, K: int, nmix: int = 24, mtiles: int = 2, kparts: int = 8):
        self.np = -(-nmix // 8) * 8
        self.nt = self.np // 8
        if K % (kparts * 64):
            raise ValueError(f"hc_mix_mma: K={K} must be a multiple of {kparts * 64}")
        if mtiles * kparts * 32 > 1024:
            raise ValueError("hc_mix_mma: at most 32 warps a CTA")
        self.K, self.nmix, self.mtiles, self.kparts = K, nmix, mtiles, kparts
        self.threads = 32 * mtiles * kparts
        self.tokens_per_cta = 16 * mtiles
        self.blocks = K // kparts // 32                   # 32-feature blocks of one warp (even)
        self.words = 8 + 8 * self.nt                     # registers of a block: x rows g, g+8; fn hi, lo a tile

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, fn_ptr: cute.Pointer, o_ptr: cute.Pointer, S: Int32, eps: Float32,
                 stream):
        mO = cute.make_tensor(o_ptr, cute.make_layout((self.nmix, S), stride=(1, self.nmix)))
        self.kernel(x_ptr, fn_ptr, mO, S, eps).launch(
            grid=[cute.ceil_div(S, self.tokens_per_cta), 1, 1], block=[self.threads, 1, 1], stream=stream)

    # trace-time helpers
    def load_block(self, buf, x_a: Int64, x_b: Int64, fn_row: Int64, blk):
        off = Int64(blk) * 64                             # 32 bf16 features
        for row, base in ((0, x_a), (1, x_b)):
            w = ld_nc_u32x4(base + off)
            for e in range(4):
                buf[4 * row + e] = w[e]
        for j in range(self.nt):
            for h in range(2):
                w = ld_nc_u32x4(fn_row + Int64((h * self.np + 8 * j) * self.K * 2) + off)
                for e in range(4):
                    buf[8 + 8 * j + 4 * h + e] = w[e]

    def compute_block(self, buf, acc, ss):
        for s in range(2):
            a = (buf[2 * s], buf[4 + 2 * s], buf[2 * s + 1], buf[4 + 2 * s + 1])
            for j in range(self.nt):
                for h in range(2):
                    b = (buf[8 + 8 * j + 4 * h + 2 * s], buf[8 + 8 * j + 4 * h + 2 * s + 1])
                    d = mma_bf16_16816(a, b, tuple(acc[4 * j + e] for e in range(4)))
                    for e in range(4):
                        acc[4 * j + e] = d[e]
        for row in range(2):
            v = ss[row]
            for e in range(4):
                v = bf16x2_square_sum(buf[4 * row + e], v)
            ss[row] = v

    @cute.kernel
    def kernel(self, x_ptr: cute.Pointer, fn_ptr: cute.Pointer, mO: cute.Tensor, S: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        g, q = lane // 4, lane % 4
        mt, part = warp % self.mtiles, warp // self.mtiles
        tok = bidx * self.tokens_per_cta + mt * 16 + g          # this lane's rows: tok, tok + 8
        k0 = part * (self.K // self.kparts) + 8 * q
        x_a = x_ptr.toint() + Int64(cutlass.min(tok, S - 1) * self.K + k0) * 2
        x_b = x_ptr.toint() + Int64(cutlass.min(tok + 8, S - 1) * self.K + k0) * 2
        fn_row = fn_ptr.toint() + Int64(g * self.K + k0) * 2

        acc = cute.make_rmem_tensor((4 * self.nt,), Float32)
        acc.fill(0.0)
        ss = cute.make_rmem_tensor((2,), Float32)
        ss.fill(0.0)
        bufA = cute.make_rmem_tensor((self.words,), Uint32)
        bufB = cute.make_rmem_tensor((self.words,), Uint32)
        self.load_block(bufA, x_a, x_b, fn_row, 0)
        for b2 in cutlass.range(self.blocks // 2):
            self.load_block(bufB, x_a, x_b, fn_row, 2 * b2 + 1)
            self.compute_block(bufA, acc, ss)
            self.load_block(bufA, x_a, x_b, fn_row, cutlass.min(2 * b2 + 2, self.blocks - 1))
            self.compute_block(bufB, acc, ss)

        # ---- the K parts meet in shared memory: [part, m-tile, token of the tile, mix | sum of squares]
        width = self.np + 1
        smem = SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout((width, 16, self.mtiles, self.kparts),
                                                              stride=(1, width, 16 * width, self.mtiles * 16 * width)),
                                    byte_alignment=16)
        for row in cutlass.range_constexpr(2):
            v = ss[row]
            for off in (1, 2):                                   # the quad's 4 lanes hold a row's features
                v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
            if q == 0:
                sRed[self.np, g + 8 * row, mt, part] = v
            for j in cutlass.range_constexpr(self.nt):
                for e in cutlass.range_constexpr(2):             # C fragment: row g (+8), columns 2q, 2q + 1
                    sRed[8 * j + 2 * q + e, g + 8 * row, mt, part] = acc[4 * j + 2 * row + e]
        cute.arch.barrier()
        for i in cutlass.range_constexpr(-(-self.tokens_per_cta * self.nmix // self.threads)):
            idx = tidx + i * self.threads
            t = idx // self.nmix
            n = idx % self.nmix
            t_c = cutlass.min(t, self.tokens_per_cta - 1)
            dot = Float32(0.0)
            sq = Float32(0.0)
            for p in cutlass.range_constexpr(self.kparts):
                dot = dot + sRed[n, t_c % 16, t_c // 16, p]
                sq = sq + sRed[self.np, t_c % 16, t_c // 16, p]
            out_tok = bidx * self.tokens_per_cta + t
            if idx < self.tokens_per_cta * self.nmix and out_tok < S:
                mO[n, out_tok] = dot * cute.math.rsqrt(sq / self.K + eps)


def bf16x2_square_sum(w: Uint32, acc: Float32) -> Float32:
    """acc + lo^2 + hi^2 of the two bf16 values of a word, in fp32 (a bf16 is the top half of its fp32)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 lo, hi; shl.b32 lo, {$r0}, 16; and.b32 hi, {$r0}, 0xffff0000; "
        "fma.rn.f32 {$w0}, lo, lo, {$r1}; fma.rn.f32 {$w0}, hi, hi, {$w0}; }",
        write_only_types=[Float32], read_only_args=[w, acc])


class HcPreApply:
    """mixes fp32 [S, (2+M)M], scale fp32 [3], base fp32 [(2+M)M], x bf16 [S, M, D]
    -> y bf16 [S, D], post fp32 [S, M], comb fp32 [S, M, M].
    head=True (ParallelHead.hc_head): mixes [S, M], scale [1], base [M] -> y only."""

    def __init__(self, D: int, M: int = 4, iters: int = 20, head: bool = False):
        if M != 4:
            raise ValueError("hc_pre_apply is written for hc_mult = 4 (16 lanes a token)")
        if D % 128:
            raise ValueError(f"hc_pre_apply: D={D} must be a multiple of 128")
        self.D, self.M, self.iters, self.head = D, M, iters, head
        self.nmix = M if head else (2 + M) * M          # hc_head: only the pre weights (no Sinkhorn)
        self.threads = 256
        self.tokens_per_cta = self.threads // (M * M)
        self.dvec = D // 8
        self.items = self.tokens_per_cta * self.dvec // self.threads

    @cute.jit
    def __call__(self, mix_ptr: cute.Pointer, scale_ptr: cute.Pointer, base_ptr: cute.Pointer,
                 x_ptr: cute.Pointer, y_ptr: cute.Pointer, post_ptr: cute.Pointer, comb_ptr: cute.Pointer,
                 S: Int32, hc_eps: Float32, stream):
        M = self.M
        mMix = cute.make_tensor(mix_ptr, cute.make_layout((self.nmix, S), stride=(1, self.nmix)))
        mScale = cute.make_tensor(scale_ptr, cute.make_layout((3,)))
        mBase = cute.make_tensor(base_ptr, cute.make_layout((self.nmix,)))
        mX = cute.make_tensor(x_ptr, cute.make_layout((8, self.dvec, M, S), stride=(1, 8, self.D, M * self.D)))
        mY = cute.make_tensor(y_ptr, cute.make_layout((8, self.dvec, S), stride=(1, 8, self.D)))
        mPost = cute.make_tensor(post_ptr, cute.make_layout((M, S), stride=(1, M)))
        mComb = cute.make_tensor(comb_ptr, cute.make_layout((M * M, S), stride=(1, M * M)))
        self.kernel(mMix, mScale, mBase, mX, mY, mPost, mComb, S, hc_eps).launch(
            grid=[cute.ceil_div(S, self.tokens_per_cta), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mMix: cute.Tensor, mScale: cute.Tensor, mBase: cute.Tensor, mX: cute.Tensor,
               mY: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, S: Int32, hc_eps: Float32):
        M = self.M
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        sPre = smem.allocate_tensor(Float32, cute.make_layout((M, self.tokens_per_cta)), byte_alignment=16)

        # ---- phase 1: 16 lanes a token, lane e holds comb[j = e // 4, k = e % 4]
        tl = tidx // (M * M)
        e = tidx % (M * M)
        tok = bidx * self.tokens_per_cta + tl
        tok_c = cutlass.min(tok, S - 1)
        m4 = e % M
        pre = Float32(1.0) / (Float32(1.0) + cute.math.exp(-(mMix[m4, tok_c] * mScale[0] + mBase[m4]))) + hc_eps
        if const_expr(not self.head):
            zp = mMix[M + m4, tok_c] * mScale[1] + mBase[M + m4]
            post = Float32(2.0) / (Float32(1.0) + cute.math.exp(-zp))
            c = mMix[2 * M + e, tok_c] * mScale[2] + mBase[2 * M + e]
            mx = c
            for off in (1, 2):                                          # row max over k
                mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=off))
            c = cute.math.exp(c - mx)
            rs = c
            for off in (1, 2):
                rs = rs + cute.arch.shuffle_sync_bfly(rs, offset=off)
            c = c / rs + hc_eps
            cs = c
            for off in (4, 8):                                          # column sum over j
                cs = cs + cute.arch.shuffle_sync_bfly(cs, offset=off)
            c = c / (cs + hc_eps)
            for _ in cutlass.range_constexpr(self.iters - 1):
                rs = c
                for off in (1, 2):
                    rs = rs + cute.arch.shuffle_sync_bfly(rs, offset=off)
                c = c / (rs + hc_eps)
                cs = c
                for off in (4, 8):
                    cs = cs + cute.arch.shuffle_sync_bfly(cs, offset=off)
                c = c / (cs + hc_eps)
            if tok < S:
                mComb[e, tok] = c
                if e < M:
                    mPost[e, tok] = post
        if e < M:
            sPre[e, tl] = pre
        cute.arch.barrier()

        # ---- phase 2: y = sum_m pre_m * x_m over the CTA's tokens, one 8-dim vector per item
        for it in cutlass.range(self.items):
            idx = it * self.threads + tidx
            t2 = idx // self.dvec
            v = idx % self.dvec
            tok2 = bidx * self.tokens_per_cta + t2
            if tok2 < S:
                rX = cute.make_rmem_tensor((8, M), BFloat16)
                for m in cutlass.range_constexpr(M):
                    cute.autovec_copy(mX[None, v, m, tok2], rX[None, m])
                y = rX[None, 0].load().to(Float32) * sPre[0, t2]
                for m in cutlass.range_constexpr(1, M):
                    y = y + rX[None, m].load().to(Float32) * sPre[m, t2]
                rY = cute.make_rmem_tensor((8,), BFloat16)
                rY.store(y.to(BFloat16))
                cute.autovec_copy(rY, mY[None, v, tok2])


class HcPost:
    """a bf16 [S, D], residual bf16 [S, M, D], post fp32 [S, M], comb fp32 [S, M, M] -> bf16 [S, M, D]."""

    def __init__(self, D: int, M: int = 4):
        if D % 8:
            raise ValueError(f"hc_post: D={D} must be a multiple of 8")
        self.D, self.M = D, M
        self.dvec = D // 8
        self.threads = 256

    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, r_ptr: cute.Pointer, post_ptr: cute.Pointer, comb_ptr: cute.Pointer,
                 o_ptr: cute.Pointer, S: Int32, stream):
        M = self.M
        mA = cute.make_tensor(a_ptr, cute.make_layout((8, self.dvec, S), stride=(1, 8, self.D)))
        lay = cute.make_layout((8, self.dvec, M, S), stride=(1, 8, self.D, M * self.D))
        mR = cute.make_tensor(r_ptr, lay)
        mO = cute.make_tensor(o_ptr, lay)
        mPost = cute.make_tensor(post_ptr, cute.make_layout((M, S), stride=(1, M)))
        mComb = cute.make_tensor(comb_ptr, cute.make_layout((M * M, S), stride=(1, M * M)))   # [j * M + k, s]
        items = S * self.dvec
        self.kernel(mA, mR, mPost, mComb, mO, items).launch(
            grid=[cute.ceil_div(items, self.threads), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mR: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor, mO: cute.Tensor,
               items: Int32):
        M = self.M
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        idx = bidx * self.threads + tidx
        if idx < items:
            tok = idx // self.dvec
            v = idx % self.dvec
            rA = cute.make_rmem_tensor((8,), BFloat16)
            cute.autovec_copy(mA[None, v, tok], rA)
            rR = cute.make_rmem_tensor((8, M), BFloat16)
            for j in cutlass.range_constexpr(M):
                cute.autovec_copy(mR[None, v, j, tok], rR[None, j])
            rP = cute.make_rmem_tensor((M,), Float32)
            cute.autovec_copy(mPost[None, tok], rP)
            rC = cute.make_rmem_tensor((M * M,), Float32)
            cute.autovec_copy(mComb[None, tok], rC)
            a = rA.load().to(Float32)
            rO = cute.make_rmem_tensor((8,), BFloat16)
            for k in cutlass.range_constexpr(M):
                acc = rR[None, 0].load().to(Float32) * rC[k]
                for j in cutlass.range_constexpr(1, M):
                    acc = acc + rR[None, j].load().to(Float32) * rC[j * M + k]
                rO.store((a * rP[k] + acc).to(BFloat16))
                cute.autovec_copy(rO, mO[None, v, k, tok])


def _build_mix(K: int, nmix: int = 24):
    return HcMix(K, nmix), (fake_ptr(BFloat16), fake_ptr(Float32), fake_ptr(Float32, 4), Int32(1), Float32(1e-6),
                            fake_stream())


def _build_mix_mma(K: int, nmix: int = 24):
    return HcMixMma(K, nmix), (fake_ptr(BFloat16), fake_ptr(BFloat16), fake_ptr(Float32, 4), Int32(1),
                               Float32(1e-6), fake_stream())


def _build_apply(D: int, M: int = 4, iters: int = 20, head: bool = False):
    return HcPreApply(D, M, iters, head), (fake_ptr(Float32, 4), fake_ptr(Float32, 4), fake_ptr(Float32, 4),
                                     fake_ptr(BFloat16), fake_ptr(BFloat16), fake_ptr(Float32, 4),
                                     fake_ptr(Float32, 4), Int32(1), Float32(1e-6), fake_stream())


def _build_post(D: int, M: int = 4):
    return HcPost(D, M), (fake_ptr(BFloat16), fake_ptr(BFloat16), fake_ptr(Float32), fake_ptr(Float32),
                          fake_ptr(BFloat16), Int32(1), fake_stream())


register(KernelDef("hc_mix", "mhc", BOTH, _build_mix,
                   configs=({"K": 4 * 7168, "nmix": 24}, {"K": 4 * 4096, "nmix": 24}, {"K": 4 * 7168, "nmix": 4}),
                   ci_configs=({"K": 4 * 7168, "nmix": 24},),
                   doc="mHC mixes: RMS over 4*D times the 24-column projection, fp32 (cp.async-staged fn)"))
register(KernelDef("hc_mix_mma", "mhc", BOTH, _build_mix_mma,
                   configs=({"K": 4 * 7168, "nmix": 24}, {"K": 4 * 4096, "nmix": 24}, {"K": 4 * 7168, "nmix": 4}),
                   ci_configs=({"K": 4 * 7168, "nmix": 24}, {"K": 4 * 7168, "nmix": 4}),
                   doc="mHC mixes on tensor cores: mma.sync with fn split into bf16 hi + lo, K over 8 warps"))
register(KernelDef("hc_pre_apply", "mhc", BOTH, _build_apply,
                   configs=({"D": 7168, "M": 4, "iters": 20}, {"D": 4096, "M": 4, "iters": 20},
                            {"D": 7168, "M": 4, "iters": 0, "head": True}, {"D": 4096, "M": 4, "iters": 0, "head": True}),
                   doc="mHC pre: sigmoid, softmax + Sinkhorn (shuffles), weighted stream sum (and hc_head)"))
register(KernelDef("hc_post", "mhc", BOTH, _build_post, configs=({"D": 7168, "M": 4}, {"D": 4096, "M": 4}),
                   doc="mHC post: post * a + comb^T . residual"))


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------

_FN_SPLITS: dict[tuple, object] = {}     # fn's bf16 hi + lo for hc_mix_mma, by (address, version, shape, device)


def fn_hi_lo(fn):
    """fp32 fn [nmix, K] -> bf16 [2, NP, K]: hi = bf16(fn), lo = bf16(fn - hi), rows past nmix zero (NP = nmix
    rounded up to 8). hi + lo keeps 16 significant bits of fn: a relative error <= 2^-17 a term. Kept for the
    last 4 weights (a model has two fn per layer): the split is 3 small kernels per call otherwise."""
    import torch
    key = (fn.data_ptr(), fn._version, tuple(fn.shape), fn.device)
    split = _FN_SPLITS.get(key)
    if split is None:
        nmix, K = fn.shape
        split = torch.zeros(2, -(-nmix // 8) * 8, K, dtype=torch.bfloat16, device=fn.device)
        split[0, :nmix] = fn
        split[1, :nmix] = fn - split[0, :nmix].float()
        if len(_FN_SPLITS) >= 4:
            _FN_SPLITS.pop(next(iter(_FN_SPLITS)))
        _FN_SPLITS[key] = split
    return split


def hc_mixes(x, fn, eps: float, tensor_cores: bool = False):
    """x [S, M, D] bf16, fn [(2+M)M, M*D] -> mixes fp32 [S, (2+M)M]; tensor_cores: by hc_mix_mma (fn as bf16
    hi + lo) instead of the fp32 SIMT hc_mix."""
    import torch
    x = x.contiguous()
    S = x.size(0)
    K = x[0].numel()
    fn = fn.to(device=x.device, dtype=torch.float32).contiguous()
    nmix = fn.size(0)
    out = torch.empty(S, nmix, dtype=torch.float32, device=x.device)
    check_numel(x)
    if S:
        name, w = ("hc_mix_mma", fn_hi_lo(fn)) if tensor_cores else ("hc_mix", fn)
        f = compile_kernel(name, device_arch(x.device), K=K, nmix=nmix)
        f(ptr(x), ptr(w), ptr(out, Float32, 4), Int32(S), Float32(eps), current_stream())
    return out


def hc_pre(x, fn, scale, base, iters: int, norm_eps: float, hc_eps: float, tensor_cores: bool = False):
    """x [S, M, D] bf16 streams -> (y [S, D] bf16, post [S, M] fp32, comb [S, M, M] fp32)."""
    import torch
    if x.dtype != torch.bfloat16 or x.dim() != 3:
        raise ValueError("hc_pre kernel takes x [S, M, D] bf16")
    x = x.contiguous()
    S, M, D = x.shape
    mixes = hc_mixes(x, fn, norm_eps, tensor_cores)
    scale = scale.to(device=x.device, dtype=torch.float32).contiguous()
    base = base.to(device=x.device, dtype=torch.float32).contiguous()
    y = torch.empty(S, D, dtype=torch.bfloat16, device=x.device)
    post = torch.empty(S, M, dtype=torch.float32, device=x.device)
    comb = torch.empty(S, M, M, dtype=torch.float32, device=x.device)
    if S:
        f = compile_kernel("hc_pre_apply", device_arch(x.device), D=D, M=M, iters=iters)
        f(ptr(mixes, Float32, 4), ptr(scale, Float32, 4), ptr(base, Float32, 4), ptr(x), ptr(y),
          ptr(post, Float32, 4), ptr(comb, Float32, 4), Int32(S), Float32(hc_eps), current_stream())
    return y, post, comb


def hc_head(x, fn, scale, base, norm_eps: float, hc_eps: float, tensor_cores: bool = False):
    """ParallelHead.hc_head: x [S, M, D] bf16 -> [S, D] bf16 (sigmoid-weighted stream sum, no Sinkhorn)."""
    import torch
    if x.dtype != torch.bfloat16 or x.dim() != 3:
        raise ValueError("hc_head kernel takes x [S, M, D] bf16")
    x = x.contiguous()
    S, M, D = x.shape
    mixes = hc_mixes(x, fn, norm_eps, tensor_cores)
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
    base = base.to(device=x.device, dtype=torch.float32).contiguous()
    y = torch.empty(S, D, dtype=torch.bfloat16, device=x.device)
    if S:
        f = compile_kernel("hc_pre_apply", device_arch(x.device), D=D, M=M, iters=0, head=True)
        f(ptr(mixes, Float32, 4), ptr(scale, Float32, 4), ptr(base, Float32, 4), ptr(x), ptr(y),
          ptr(mixes, Float32, 4), ptr(mixes, Float32, 4), Int32(S), Float32(hc_eps), current_stream())
    return y


def hc_post(a, residual, post, comb):
    """a [S, D] bf16, residual [S, M, D] bf16, post [S, M], comb [S, M, M] -> [S, M, D] bf16."""
    import torch
    if a.dtype != torch.bfloat16 or residual.dtype != torch.bfloat16:
        raise ValueError("hc_post kernel takes bf16 a and residual")
    a, residual = a.contiguous(), residual.contiguous()
    S, M, D = residual.shape
    post = post.to(torch.float32).contiguous()
    comb = comb.to(torch.float32).contiguous()
    out = torch.empty_like(residual)
    check_numel(residual)
    if S:
        f = compile_kernel("hc_post", device_arch(a.device), D=D, M=M)
        f(ptr(a), ptr(residual), ptr(post), ptr(comb), ptr(out), Int32(S), current_stream())
    return out
