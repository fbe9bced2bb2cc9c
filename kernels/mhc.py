"""mHC (manifold-constrained hyper-connections): Block.hc_pre and hc_post (dsv4_references.mhc).

hc_pre (and hc_head) run as two kernels; `hc_fused` (HcFused: x read once, the parts of a persistent grid
waiting for each other's mixes) is an opt-in single pass, correct but slower so far (see `hc_pre`):
- `hc_mix`: mixes[s, n] = (x_s . fn_n) * rsqrt(mean(x_s^2) + eps) over all M*D features of the M streams
  (the reference's F.linear in fp32). A skinny GEMM (N = (2+M)*M = 24 columns) on tensor cores: fn is split
  into bf16 hi + lo (fn = hi + lo to ~2^-17 relative), so that mma.sync m16n8k16 on bf16 x gives fp32
  products of the fp32 weights. A CTA owns 128 tokens and one of `parts` K ranges; x and fn are staged in
  64-feature chunks by cp.async, STAGES deep (~96 KB in flight an SM), fn shared by the CTA's 4 warps of 32
  tokens. The K parts are summed in part order by the warp that completes a 32-token tile (split-K ticket).
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
    cp_async_16,
    current_stream,
    device_arch,
    fake_ptr,
    fake_stream,
    last_split_part,
    ld_acquire_i32,
    ld_cg_f32,
    ld_cg_f32x4,
    ld_shared_v4,
    mma_bf16_16816,
    ptr,
    register,
    scratch,
    sm_count,
    st_global_v4,
)

CHUNK = 64              # features of one hc_mix pipeline stage: two 32-feature blocks
STAGES = 4
FN_ROW = CHUNK + 4      # fp32 shared row of fn, padded 16 bytes: rows g and g + 1 fall on different banks
MIX_WARPS = 4
MIX_MTILES = 2          # 16-token MMA tiles a warp
MIX_TOKENS = 16 * MIX_MTILES * MIX_WARPS
MAX_PARTS = 32
PART_D = 128            # hc_fused: features of each stream one CTA owns (2 chunks a stream; fn slice 52 KB)
FUSED_TOKENS = 16       # hc_fused: tokens of a tile (one MMA row tile)
FUSED_BUFS = 9          # hc_fused: x tiles on chip (16 KB each): mixed, waiting for the weights, loading
FUSED_LAG = 4           # hc_fused: tiles between a tile's mixes and its weighted sum
FUSED_LEAD = 1          # hc_fused: tiles between a tile's mixes and its owner publishing its weights
SMEM_BYTES = 227 * 1024


def mix_lane_values(nmix: int) -> int:
    """fp32 partials of one hc_mix lane: C fragments of its tiles and column tiles, 2 sums of squares a tile,
    padded to whole 16-byte stores."""
    return -(-(MIX_MTILES * (4 * -(-nmix // 8) + 2)) // 4) * 4


def mix_parts(S: int, K: int, sms: int) -> int:
    """K parts of hc_mix: halve the parts' K range while the grid stays within one CTA an SM, at most MAX_PARTS.
    H100 sweep at Pro shapes (results/hc-mix-sweep-h100-2026-12-05.json): 4 parts (128 CTAs) 94.7 us, 8 parts
    (two CTAs an SM, the earlier rule) 102.9, 16 parts 119.9 for 24 mixes; 87.7 / 90.3 / 104.0 us for 4 mixes:
    more parts add partials and tail, not bandwidth. The pipeline depth mattered less (2-5 stages within 15%)."""
    ctas, nchunks, parts = -(-S // MIX_TOKENS), K // CHUNK, 1
    while 2 * parts <= MAX_PARTS and nchunks % (2 * parts) == 0 and ctas * 2 * parts <= sms:
        parts *= 2
    return parts


def split_bf16x2(f0: Uint32, f1: Uint32):
    """Two fp32 (as bits) -> (hi, lo) bf16x2 words with f = hi + lo to 16 significant bits: hi = bf16(f),
    lo = bf16(f - hi) (the difference is exact). The lower half holds f0's, as MMA fragments want."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 h, t0, t1; cvt.rn.bf16x2.f32 h, {$r1}, {$r0}; shl.b32 t0, h, 16; "
        "and.b32 t1, h, 0xffff0000; sub.f32 t0, {$r0}, t0; sub.f32 t1, {$r1}, t1; mov.b32 {$w0}, h; "
        "cvt.rn.bf16x2.f32 {$w1}, t1, t0; }",
        write_only_types=[Uint32, Uint32], read_only_args=[f0, f1])


def bf16x2_square_sum(w: Uint32, acc: Float32) -> Float32:
    """acc + lo^2 + hi^2 of the two bf16 values of a word, in fp32 (a bf16 is the top half of its fp32)."""
    return cute.arch.inline_ptx(
        "{ .reg .b32 lo, hi; shl.b32 lo, {$r0}, 16; and.b32 hi, {$r0}, 0xffff0000; "
        "fma.rn.f32 {$w0}, lo, lo, {$r1}; fma.rn.f32 {$w0}, hi, hi, {$w0}; }",
        write_only_types=[Float32], read_only_args=[w, acc])


def mix_chunk(x0, f0, mtiles: int, nmix: int, g, q, acc, ss):
    """One 64-feature chunk of the mixes for a warp's `mtiles` 16-token tiles (trace-time helper): x rows of
    CHUNK bf16 from shared byte address x0 (16-byte pieces XOR-swizzled by row parity), fn rows of FN_ROW fp32
    from f0. Within a 32-feature block lane (g, q) takes features 8q..8q+7 of x rows g and g + 8 and of fn rows
    g (+8 a column tile); k-step s (two a block) uses features 8q+4s+{0,1} as the fragment's columns 2q, 2q+1
    and 8q+4s+{2,3} as 2q+8, 2q+9. The chunk's MMAs go to a fresh accumulator, added to acc in IEEE fp32: the
    tensor core's own accumulation truncates (on the H200 a whole-K accumulator drifted to 3.8e-5 on the Pro
    mixes, 4x the error of the bf16 hi + lo split of fn). ss gets the rows' sums of squares (2 a tile)."""
    nt = -(-nmix // 8)
    part = [None] * (mtiles * nt * 4)
    for b in range(2):
        xw = []                                            # [tile][row g, g + 8]: 4 words = 8 features
        for t in range(mtiles):
            piece = (4 * b + q) ^ ((g % 2) * 4)            # the rows' parity is g's
            xw.append([ld_shared_v4(x0 + ((16 * t + 8 * h + g) * CHUNK + 8 * piece) * 2) for h in range(2)])
        hi, lo = [], []                                    # [column tile]: 4 words each
        for j in range(nt):
            n = 8 * j + g if const_expr(8 * j + 8 <= nmix) else cutlass.min(8 * j + g, nmix - 1)
            base = f0 + (n * FN_ROW + 32 * b + 8 * q) * 4
            f = list(ld_shared_v4(base)) + list(ld_shared_v4(base + 16))
            pairs = [split_bf16x2(f[2 * p], f[2 * p + 1]) for p in range(4)]
            hi.append([w[0] for w in pairs])
            lo.append([w[1] for w in pairs])
        for s in range(2):
            for t in range(mtiles):
                a = (xw[t][0][2 * s], xw[t][1][2 * s], xw[t][0][2 * s + 1], xw[t][1][2 * s + 1])
                for j in range(nt):
                    i0 = (t * nt + j) * 4
                    c = tuple(part[i0 + e] for e in range(4)) if b + s else (Float32(0.0),) * 4
                    c = mma_bf16_16816(a, (hi[j][2 * s], hi[j][2 * s + 1]), c)
                    c = mma_bf16_16816(a, (lo[j][2 * s], lo[j][2 * s + 1]), c)
                    part[i0:i0 + 4] = c
        for t in range(mtiles):
            for h in range(2):
                v = ss[2 * t + h]
                for e in range(4):
                    v = bf16x2_square_sum(xw[t][h][e], v)
                ss[2 * t + h] = v
    for i in range(len(part)):
        acc[i] = acc[i] + part[i]


def sinkhorn_lane(c, zp, iters: int, hc_eps):
    """split_sinkhorn on 16 lanes a token (trace-time helper): lane e = 4j + k holds comb logit [j, k] in c and
    the post logit of stream e % 4 in zp; row sums over k and column sums over j by butterfly shuffles, all in
    registers. -> (post, the lane's doubly stochastic comb entry)."""
    post = Float32(2.0) / (Float32(1.0) + cute.math.exp(-zp))
    mx = c
    for off in (1, 2):                                              # row max over k
        mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=off))
    c = cute.math.exp(c - mx)
    rs = c
    for off in (1, 2):
        rs = rs + cute.arch.shuffle_sync_bfly(rs, offset=off)
    c = c / rs + hc_eps
    cs = c
    for off in (4, 8):                                              # column sum over j
        cs = cs + cute.arch.shuffle_sync_bfly(cs, offset=off)
    c = c / (cs + hc_eps)
    for _ in range(iters - 1):
        rs = c
        for off in (1, 2):
            rs = rs + cute.arch.shuffle_sync_bfly(rs, offset=off)
        c = c / (rs + hc_eps)
        cs = c
        for off in (4, 8):
            cs = cs + cute.arch.shuffle_sync_bfly(cs, offset=off)
        c = c / (cs + hc_eps)
    return post, c


def bf16x2_to_f32(w: Uint32):
    """The two bf16 values of a word as fp32 (lower half first)."""
    return cute.arch.inline_ptx("{ shl.b32 {$w0}, {$r0}, 16; and.b32 {$w1}, {$r0}, 0xffff0000; }",
                                write_only_types=[Float32, Float32], read_only_args=[w])


def f32x2_to_bf16x2(lo: Float32, hi: Float32) -> Uint32:
    return cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};", write_only_types=[Uint32],
                                read_only_args=[lo, hi])


def st_global_f32(addr: Int64, v: Float32):
    cute.arch.inline_ptx("st.global.f32 [{$r0}], {$r1};", read_only_args=[addr, v])


class HcMix:
    """x bf16 [S, K], fn fp32 [nmix, K] -> mixes fp32 [S, nmix]; K split in `parts` (workspace + tickets).

    Grid (ceil(S / 128), parts). Warp w of a CTA owns tokens 32w..32w+31 (two MMA tiles) and walks its CTA's
    K range with the others, chunk by chunk through shared memory (`mix_chunk`).
    """

    def __init__(self, K: int, nmix: int = 24, parts: int = 1, stages: int = STAGES):
        nchunks = K // CHUNK
        if K % CHUNK or nchunks % parts:
            raise ValueError(f"hc_mix: K={K} must be a multiple of {CHUNK} chunks split into {parts} parts")
        if not 1 <= parts <= MAX_PARTS:
            raise ValueError(f"hc_mix: parts must be in [1, {MAX_PARTS}]")
        if stages < 2:
            raise ValueError("hc_mix: at least 2 pipeline stages")
        self.K, self.nmix, self.parts, self.stages = K, nmix, parts, stages
        self.nt = -(-nmix // 8)                           # 8-column MMA tiles
        self.cpp = nchunks // parts                       # chunks of one part
        self.threads = 32 * MIX_WARPS
        self.nv = mix_lane_values(nmix)

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, fn_ptr: cute.Pointer, o_ptr: cute.Pointer, ws_ptr: cute.Pointer,
                 ticket_ptr: cute.Pointer, S: Int32, eps: Float32, stream):
        mO = cute.make_tensor(o_ptr, cute.make_layout((S, self.nmix), stride=(self.nmix, 1)))

        @cute.struct
        class Storage:
            sX: cute.struct.Align[cute.struct.MemRange[BFloat16, self.stages * MIX_TOKENS * CHUNK], 128]
            sF: cute.struct.Align[cute.struct.MemRange[Float32, self.stages * self.nmix * FN_ROW], 128]

        self.storage = Storage
        self.kernel(x_ptr, fn_ptr, mO, ws_ptr, ticket_ptr, S, eps).launch(
            grid=[cute.ceil_div(S, MIX_TOKENS), self.parts, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.jit
    def load_stage(self, x_ptr: cute.Pointer, fn_ptr: cute.Pointer, sx: Int32, sf: Int32, tidx: Int32, S: Int32,
                   tok0: Int32, c: Int32, stage: Int32):
        """Chunk c (features 64c..64c+63) of the CTA's 128 x rows and of fn's rows -> shared stage."""
        for i in cutlass.range_constexpr(MIX_TOKENS * 8 // self.threads):
            piece = tidx + i * self.threads                # 8 pieces of 16 bytes a row
            r = piece // 8
            v = piece % 8
            src = x_ptr.toint() + Int64(cutlass.min(tok0 + r, S - 1) * self.K + c * CHUNK + v * 8) * 2
            cp_async_16(sx + ((stage * MIX_TOKENS + r) * CHUNK + 8 * (v ^ ((r % 2) * 4))) * 2, src, Int32(16))
        pieces = self.nmix * CHUNK // 4
        for i in cutlass.range_constexpr(-(-pieces // self.threads)):
            piece = tidx + i * self.threads
            n = piece // (CHUNK // 4)
            v = piece % (CHUNK // 4)
            if piece < pieces:
                src = fn_ptr.toint() + Int64(n * self.K + c * CHUNK + v * 4) * 4
                cp_async_16(sf + ((stage * self.nmix + n) * FN_ROW + v * 4) * 4, src, Int32(16))

    @cute.kernel
    def kernel(self, x_ptr: cute.Pointer, fn_ptr: cute.Pointer, mO: cute.Tensor, ws_ptr: cute.Pointer,
               ticket_ptr: cute.Pointer, S: Int32, eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, part, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane // 4
        q = lane % 4
        st = SmemAllocator().allocate(self.storage)
        sx = st.sX.data_ptr().toint()
        sf = st.sF.data_ptr().toint()
        tok0 = bx * MIX_TOKENS
        c0 = part * self.cpp

        acc = cute.make_rmem_tensor((MIX_MTILES * self.nt * 4,), Float32)
        acc.fill(0.0)
        ss = cute.make_rmem_tensor((MIX_MTILES * 2,), Float32)
        ss.fill(0.0)
        for i in cutlass.range_constexpr(self.stages - 1):
            if const_expr(i < self.cpp):
                self.load_stage(x_ptr, fn_ptr, sx, sf, tidx, S, tok0, c0 + i, i)
            cute.arch.cp_async_commit_group()
        for c in cutlass.range(self.cpp):
            cute.arch.cp_async_wait_group(self.stages - 2)  # chunk c has landed (this thread's pieces)
            cute.arch.barrier()                            # ... everyone's; and stage (c - 1) % stages is free
            if c + self.stages - 1 < self.cpp:
                nxt = c + self.stages - 1
                self.load_stage(x_ptr, fn_ptr, sx, sf, tidx, S, tok0, c0 + nxt, nxt % self.stages)
            cute.arch.cp_async_commit_group()
            stage = c % self.stages
            mix_chunk(sx + ((stage * MIX_TOKENS + warp * 16 * MIX_MTILES) * CHUNK) * 2,
                      sf + stage * self.nmix * FN_ROW * 4, MIX_MTILES, self.nmix, g, q, acc, ss)
        cute.arch.cp_async_wait_group(0)

        # ---- K parts: summed in part order by the warp that completes the 32-token tile
        vals = cute.make_rmem_tensor((self.nv,), Float32)
        vals.fill(0.0)
        for i in cutlass.range_constexpr(MIX_MTILES * self.nt * 4):
            vals[i] = acc[i]
        for i in cutlass.range_constexpr(MIX_MTILES * 2):
            vals[MIX_MTILES * self.nt * 4 + i] = ss[i]
        tile = bx * MIX_WARPS + warp
        if const_expr(self.parts == 1):
            self.store(vals, mO, tile, g, q, S, eps)
        else:
            frag = ws_ptr.toint() + Int64((tile * self.parts + part) * 32 + lane) * (self.nv * 4)
            for i in cutlass.range_constexpr(self.nv // 4):
                st_global_v4(frag + 16 * i, [vals[4 * i + e] for e in range(4)])
            if last_split_part(ticket_ptr + tile, self.parts, lane):
                vals.fill(0.0)
                first = ws_ptr.toint() + Int64(tile * self.parts * 32 + lane) * (self.nv * 4)
                for p in cutlass.range_constexpr(self.parts):
                    for i in cutlass.range_constexpr(self.nv // 4):
                        got = ld_cg_f32x4(first + p * 32 * self.nv * 4 + 16 * i)
                        for e in cutlass.range_constexpr(4):
                            vals[4 * i + e] = vals[4 * i + e] + got[e]
                self.store(vals, mO, tile, g, q, S, eps)

    @cute.jit
    def store(self, vals: cute.Tensor, mO: cute.Tensor, tile: Int32, g: Int32, q: Int32, S: Int32, eps: Float32):
        """C fragment value 4j + 2h + e of tile t: token 16t + 8h + g, column 8j + 2q + e; times rsqrt(mean x^2
        + eps), the quad's 4 lanes holding a row's sum of squares in parts."""
        for t in cutlass.range_constexpr(MIX_MTILES):
            for h in cutlass.range_constexpr(2):
                sq = vals[MIX_MTILES * self.nt * 4 + 2 * t + h]
                for off in (1, 2):
                    sq = sq + cute.arch.shuffle_sync_bfly(sq, offset=off)
                rstd = cute.math.rsqrt(sq / self.K + eps)
                tok = tile * 16 * MIX_MTILES + 16 * t + 8 * h + g
                for j in cutlass.range_constexpr(self.nt):
                    for e in cutlass.range_constexpr(2):
                        col = 8 * j + 2 * q + e
                        if tok < S and col < self.nmix:          # columns past nmix: fn rows clamped
                            mO[tok, col] = vals[(t * self.nt + j) * 4 + 2 * h + e] * rstd


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
            post, c = sinkhorn_lane(mMix[2 * M + e, tok_c] * mScale[2] + mBase[2 * M + e], zp, self.iters, hc_eps)
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


class HcFused:
    """hc_pre (or hc_head, head=True) in one pass over x: x bf16 [S, M, D], fn fp32 [nmix, M*D], scale, base
    -> y bf16 [S, D] (and post fp32 [S, M], comb fp32 [S, M, M]).

    The two-kernel path reads x twice (235 MB at Pro shapes, more than L2), since a token's mixes need its
    whole 4 x D row before its weighted sum can start. Here the grid is persistent and cooperative: CTA
    (part p, slot s) owns features [p part_d, (p + 1) part_d) of every stream and keeps its slice of fn in
    shared memory for the whole launch; it walks the 16-token tiles s, s + slots, ... holding each tile's x
    slice on chip until the tile's weights are known. Per tile: warp m mixes stream m's chunks (`mix_chunk`),
    the warps' partials are summed in warp order and stored as the part's record [16 tokens][sum of squares,
    nmix mixes]; an arrival counter counts the parts in. `lead` tiles later the tile's owner (part tile %
    parts) sums the records in part order, publishes the tile's pre weights, raises the tile's flag and runs
    the Sinkhorn (`sinkhorn_lane`) for post and comb; `lag` tiles after its mixes every part reads the weights
    and writes y for its features. With `bufs` x tiles on chip (bufs - lag of them loads in flight), the
    exchange overlaps the next tiles' mixing instead of stalling every part on the owner each tile (which
    cost ~5 us a tile on the H100 when the owner published in the same step as the parts waited). Every
    counter and flag is left zero: the owner resets the counter it alone waits on, and the last part past a
    flag resets it.

    All CTAs must be resident at once (they wait for each other): the grid is parts x slots <= the SM count,
    one CTA an SM. Bits differ from the two-kernel path (partials are summed per part_d features), within the
    same fp32 tolerance of the reference.
    """

    def __init__(self, D: int, M: int = 4, iters: int = 20, head: bool = False, part_d: int = PART_D,
                 bufs: int = FUSED_BUFS, lag: int = FUSED_LAG, lead: int = FUSED_LEAD):
        if M != 4:
            raise ValueError("hc_fused is written for hc_mult = 4 (a warp a stream, 16 lanes a token)")
        if part_d % CHUNK or D % part_d:
            raise ValueError(f"hc_fused: D={D} must be a multiple of part_d={part_d}, itself one of {CHUNK}")
        if not 0 <= lead < lag < bufs:
            raise ValueError(f"hc_fused: lead={lead}, lag={lag}, bufs={bufs} must satisfy 0 <= lead < lag < bufs")
        self.D, self.M, self.iters, self.head = D, M, iters, head
        self.part_d, self.bufs, self.lag, self.lead = part_d, bufs, lag, lead
        self.nmix = M if head else (2 + M) * M
        self.nt = -(-self.nmix // 8)
        self.parts = D // part_d
        self.cps = part_d // CHUNK                         # chunks of a stream in a part
        self.nc = M * self.cps                             # chunks of a part
        self.rec = -(-(self.nmix + 1) // 8) * 8            # fp32 a token in a record: sum of squares, then the mixes
        self.nv = self.nt * 4 + 2                          # a lane's partial: C fragment values, 2 sums of squares
        self.threads = 32 * M
        smem = 4 * (self.nc * self.nmix * FN_ROW + (M - 1) * 32 * self.nv + M * FUSED_TOKENS) \
            + 2 * bufs * self.nc * FUSED_TOKENS * CHUNK
        if smem > SMEM_BYTES:
            raise ValueError(f"hc_fused: part_d={part_d} with {bufs} x tiles needs {smem} bytes of shared memory "
                             f"(at most {SMEM_BYTES})")

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, fn_ptr: cute.Pointer, scale_ptr: cute.Pointer, base_ptr: cute.Pointer,
                 y_ptr: cute.Pointer, post_ptr: cute.Pointer, comb_ptr: cute.Pointer, rec_ptr: cute.Pointer,
                 cnt_ptr: cute.Pointer, fin_ptr: cute.Pointer, flag_ptr: cute.Pointer, S: Int32, slots: Int32,
                 norm_eps: Float32, hc_eps: Float32, stream):
        M = self.M
        mScale = cute.make_tensor(scale_ptr, cute.make_layout((3,)))
        mBase = cute.make_tensor(base_ptr, cute.make_layout((self.nmix,)))
        mPost = cute.make_tensor(post_ptr, cute.make_layout((M, S), stride=(1, M)))
        mComb = cute.make_tensor(comb_ptr, cute.make_layout((M * M, S), stride=(1, M * M)))

        @cute.struct
        class Storage:
            sF: cute.struct.Align[cute.struct.MemRange[Float32, self.nc * self.nmix * FN_ROW], 128]
            sX: cute.struct.Align[cute.struct.MemRange[BFloat16, self.bufs * self.nc * FUSED_TOKENS * CHUNK], 128]
            sRed: cute.struct.Align[cute.struct.MemRange[Float32, (M - 1) * 32 * self.nv], 16]
            sPre: cute.struct.Align[cute.struct.MemRange[Float32, M * FUSED_TOKENS], 16]

        self.storage = Storage
        self.kernel(x_ptr, fn_ptr, mScale, mBase, y_ptr, mPost, mComb, rec_ptr, cnt_ptr, fin_ptr, flag_ptr, S,
                    slots, norm_eps, hc_eps).launch(grid=[self.parts, slots, 1], block=[self.threads, 1, 1],
                                                    stream=stream, cooperative=True)   # co-resident or an error

    @cute.jit
    def load_fn(self, fn_ptr: cute.Pointer, sf: Int32, tidx: Int32, part: Int32):
        """The part's fn columns, chunk c = stream m, chunk k of the part: [c][n][FN_ROW] fp32."""
        pieces = self.nc * self.nmix * (CHUNK // 4)
        for i in cutlass.range(-(-pieces // self.threads), unroll=4):
            piece = tidx + i * self.threads
            if piece < pieces:
                c = piece // (self.nmix * (CHUNK // 4))
                n = piece // (CHUNK // 4) % self.nmix
                v = piece % (CHUNK // 4)
                col = (c // self.cps) * self.D + part * self.part_d + (c % self.cps) * CHUNK + v * 4
                cp_async_16(sf + ((c * self.nmix + n) * FN_ROW + v * 4) * 4,
                            fn_ptr.toint() + Int64(n * self.M * self.D + col) * 4, Int32(16))

    @cute.jit
    def load_tile(self, x_ptr: cute.Pointer, sx: Int32, tidx: Int32, S: Int32, part: Int32, tile: Int32,
                  buf: Int32):
        """x of the tile's 16 tokens over the part's features -> buffer buf, [c][token][CHUNK] bf16, pieces
        swizzled by token parity (rows past S clamped: their results are never stored)."""
        for i in cutlass.range_constexpr(self.nc * FUSED_TOKENS * 8 // self.threads):
            piece = tidx + i * self.threads
            c = piece // (FUSED_TOKENS * 8)
            r = piece // 8 % FUSED_TOKENS
            v = piece % 8
            tok = cutlass.min(tile * FUSED_TOKENS + r, S - 1)
            col = (c // self.cps) * self.D + part * self.part_d + (c % self.cps) * CHUNK + v * 8
            cp_async_16(sx + (((buf * self.nc + c) * FUSED_TOKENS + r) * CHUNK + 8 * (v ^ ((r % 2) * 4))) * 2,
                        x_ptr.toint() + Int64(tok * self.M * self.D + col) * 2, Int32(16))

    @cute.kernel
    def kernel(self, x_ptr: cute.Pointer, fn_ptr: cute.Pointer, mScale: cute.Tensor, mBase: cute.Tensor,
               y_ptr: cute.Pointer, mPost: cute.Tensor, mComb: cute.Tensor, rec_ptr: cute.Pointer,
               cnt_ptr: cute.Pointer, fin_ptr: cute.Pointer, flag_ptr: cute.Pointer, S: Int32, slots: Int32,
               norm_eps: Float32, hc_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        part, slot, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        st = SmemAllocator().allocate(self.storage)
        sf = st.sF.data_ptr().toint()
        sx = st.sX.data_ptr().toint()
        sRed = st.sRed.get_tensor(cute.make_layout((self.nv, 32, self.M - 1)))
        sPre = st.sPre.get_tensor(cute.make_layout((self.M, FUSED_TOKENS)))
        mine = (cute.ceil_div(S, FUSED_TOKENS) - slot + slots - 1) // slots      # tiles of this slot
        ahead = self.bufs - self.lag                       # tiles loaded ahead of the one being mixed

        # tile j of the slot lives in buffer j % bufs from its load (iteration j - ahead) to its weighted sum
        # (iteration j + lag), when that buffer takes tile j + bufs
        self.load_fn(fn_ptr, sf, tidx, part)
        self.load_tile(x_ptr, sx, tidx, S, part, slot, Int32(0))
        cute.arch.cp_async_commit_group()
        for j in cutlass.range_constexpr(1, ahead):
            if j < mine:
                self.load_tile(x_ptr, sx, tidx, S, part, slot + j * slots, Int32(j))
            cute.arch.cp_async_commit_group()
        for i in cutlass.range(mine + self.lag):
            if i < mine:
                cute.arch.cp_async_wait_group(ahead - 1)   # tile i has landed (this thread's pieces) ...
                cute.arch.barrier()                        # ... and everyone's
                self.mix(sf, sx, sRed, rec_ptr, cnt_ptr, slot + i * slots, i % self.bufs, part, warp, lane)
            if i >= self.lead and i - self.lead < mine:
                tile = slot + (i - self.lead) * slots
                if tile % self.parts == part:
                    self.publish(mScale, mBase, mPost, mComb, rec_ptr, cnt_ptr, fin_ptr, flag_ptr, S, tile, tidx,
                                 lane, norm_eps, hc_eps)
            if i >= self.lag:
                j = i - self.lag
                self.apply(sx, sPre, y_ptr, fin_ptr, flag_ptr, S, slot + j * slots, j % self.bufs, part, tidx)
            cute.arch.barrier()                            # buffer (i + ahead) % bufs is free again
            if i + ahead < mine:
                self.load_tile(x_ptr, sx, tidx, S, part, slot + (i + ahead) * slots, (i + ahead) % self.bufs)
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def mix(self, sf: Int32, sx: Int32, sRed: cute.Tensor, rec_ptr: cute.Pointer, cnt_ptr: cute.Pointer,
            tile: Int32, buf: Int32, part: Int32, warp: Int32, lane: Int32):
        """The part's partial mixes of the tile, summed over the warps in warp order -> its record
        [token][sum of squares, mixes]; then counts the part in."""
        g = lane // 4
        q = lane % 4
        acc = cute.make_rmem_tensor((self.nv,), Float32)
        acc.fill(0.0)
        ss = cute.make_rmem_tensor((2,), Float32)
        ss.fill(0.0)
        for k in cutlass.range_constexpr(self.cps):
            c = warp * self.cps + k                        # warp m: stream m
            mix_chunk(sx + ((buf * self.nc + c) * FUSED_TOKENS) * CHUNK * 2, sf + c * self.nmix * FN_ROW * 4,
                      1, self.nmix, g, q, acc, ss)
        acc[self.nv - 2] = ss[0]
        acc[self.nv - 1] = ss[1]
        if warp > 0:
            for i in cutlass.range_constexpr(self.nv):
                sRed[i, lane, warp - 1] = acc[i]
        cute.arch.barrier()
        if warp == 0:
            for w in cutlass.range_constexpr(self.M - 1):
                for i in cutlass.range_constexpr(self.nv):
                    acc[i] = acc[i] + sRed[i, lane, w]
            rec = rec_ptr.toint() + Int64(tile * self.parts + part) * (FUSED_TOKENS * self.rec * 4)
            for h in cutlass.range_constexpr(2):            # C value 4j + 2h + e: token 8h + g, column 8j + 2q + e
                row = rec + (8 * h + g) * (self.rec * 4)
                for j in cutlass.range_constexpr(self.nt):
                    for e in cutlass.range_constexpr(2):
                        col = 8 * j + 2 * q + e
                        if col < self.nmix:
                            st_global_f32(row + (1 + col) * 4, acc[4 * j + 2 * h + e])
                sq = acc[self.nv - 2 + h]
                for off in (1, 2):                         # the quad's 4 lanes hold a row's sum in parts
                    sq = sq + cute.arch.shuffle_sync_bfly(sq, offset=off)
                if q == 0:
                    st_global_f32(row, sq)
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.atomic_add(cnt_ptr + tile, Int32(1), sem="acq_rel", scope="gpu")

    @cute.jit
    def record_sum(self, rec_ptr: cute.Pointer, tile: Int32, tok: Int32, col: Int32):
        """Record value col of token tok summed over the tile's parts in part order (L2-coherent loads)."""
        first = rec_ptr.toint() + Int64(tile * self.parts * FUSED_TOKENS + tok) * (self.rec * 4) + col * 4
        parts = []                                         # every part's load in flight before the sum
        for p in cutlass.range_constexpr(self.parts):
            parts.append(ld_cg_f32(first + p * (FUSED_TOKENS * self.rec * 4)))
        v = parts[0]
        for p in cutlass.range_constexpr(1, self.parts):
            v = v + parts[p]
        return v

    @cute.jit
    def spin(self, flag: Int64, until: int):
        """Wait until the GPU-scope counter at `flag` reaches `until` (acquire: what was written before it
        counted is visible after)."""
        seen = ld_acquire_i32(flag)
        while seen < until:
            seen = ld_acquire_i32(flag)

    @cute.jit
    def publish(self, mScale: cute.Tensor, mBase: cute.Tensor, mPost: cute.Tensor, mComb: cute.Tensor,
                rec_ptr: cute.Pointer, cnt_ptr: cute.Pointer, fin_ptr: cute.Pointer, flag_ptr: cute.Pointer, S: Int32,
                tile: Int32, tidx: Int32, lane: Int32, norm_eps: Float32, hc_eps: Float32):
        """By the tile's owner, once every part has counted in: the records summed in part order -> the pre
        weights [16 tokens][M] and the flag that releases them; then post and comb."""
        M = self.M
        inv_k = Float32(1.0 / (M * self.D))
        if tidx == 0:
            self.spin(cnt_ptr.toint() + Int64(tile) * 4, self.parts)
            cute.make_tensor(cnt_ptr + tile, cute.make_layout(1))[0] = Int32(0)    # no one else reads it
        cute.arch.barrier()
        # 8 lanes a token: lane e < M sums pre mix e, the others the sum of squares (record column 0)
        tok = tidx // 8
        e = tidx % 8
        v = self.record_sum(rec_ptr, tile, tok, cutlass.select_(e < M, e + 1, 0))
        sq = cute.arch.shuffle_sync(v, (lane // 8) * 8 + M)
        rstd = cute.math.rsqrt(sq * inv_k + norm_eps)
        if e < M:
            pre = Float32(1.0) / (Float32(1.0) + cute.math.exp(-(v * rstd * mScale[0] + mBase[e]))) + hc_eps
            st_global_f32(fin_ptr.toint() + Int64((tile * FUSED_TOKENS + tok) * M + e) * 4, pre)
        cute.arch.barrier()
        if tidx == 0:
            cute.arch.atomic_add(flag_ptr + tile, Int32(1), sem="acq_rel", scope="gpu")
        # ---- post and comb of the tile's tokens: 16 lanes a token, 8 tokens a round
        if const_expr(not self.head):
            for r in cutlass.range_constexpr(FUSED_TOKENS * M * M // self.threads):
                tok = r * (self.threads // (M * M)) + tidx // (M * M)
                e = tidx % (M * M)
                sq = self.record_sum(rec_ptr, tile, tok, Int32(0))
                rstd = cute.math.rsqrt(sq * inv_k + norm_eps)
                zp = self.record_sum(rec_ptr, tile, tok, 1 + M + e % M) * rstd * mScale[1] + mBase[M + e % M]
                zc = self.record_sum(rec_ptr, tile, tok, 1 + 2 * M + e) * rstd * mScale[2] + mBase[2 * M + e]
                post, c = sinkhorn_lane(zc, zp, self.iters, hc_eps)
                gtok = tile * FUSED_TOKENS + tok
                if gtok < S:
                    mComb[e, gtok] = c
                    if e < M:
                        mPost[e, gtok] = post

    @cute.jit
    def apply(self, sx: Int32, sPre: cute.Tensor, y_ptr: cute.Pointer, fin_ptr: cute.Pointer,
              flag_ptr: cute.Pointer, S: Int32, tile: Int32, buf: Int32, part: Int32, tidx: Int32):
        """Once the owner has published the tile's pre weights: y over the part's features. The flag counts
        every part past it after the owner's 1; the last one resets it."""
        M = self.M
        if tidx == 0:
            self.spin(flag_ptr.toint() + Int64(tile) * 4, 1)
            if cute.arch.atomic_add(flag_ptr + tile, Int32(1), sem="relaxed", scope="gpu") == self.parts:
                cute.make_tensor(flag_ptr + tile, cute.make_layout(1))[0] = Int32(0)
        cute.arch.barrier()
        if tidx < M * FUSED_TOKENS:
            sPre[tidx % M, tidx // M] = ld_cg_f32(fin_ptr.toint() + Int64(tile * FUSED_TOKENS * M + tidx) * 4)
        cute.arch.barrier()
        # ---- y = sum_m pre_m x_m: 16 tokens x part_d / 8 vectors of 8 features
        for it in cutlass.range_constexpr(FUSED_TOKENS * (self.part_d // 8) // self.threads):
            idx = it * self.threads + tidx
            t = idx // (self.part_d // 8)
            v8 = idx % (self.part_d // 8)
            k = v8 // 8
            piece = (v8 % 8) ^ ((t % 2) * 4)
            y = [None] * 8                                  # stream 0 initialises each sum
            for m in cutlass.range_constexpr(M):
                w = ld_shared_v4(sx + (((buf * self.nc + m * self.cps + k) * FUSED_TOKENS + t) * CHUNK + 8 * piece) * 2)
                pm = sPre[m, t]
                for p in cutlass.range_constexpr(4):
                    lo, hi = bf16x2_to_f32(w[p])
                    y[2 * p] = lo * pm if m == 0 else y[2 * p] + lo * pm
                    y[2 * p + 1] = hi * pm if m == 0 else y[2 * p + 1] + hi * pm
            gtok = tile * FUSED_TOKENS + t
            if gtok < S:
                st_global_v4(y_ptr.toint() + Int64(gtok * self.D + part * self.part_d + v8 * 8) * 2,
                             [f32x2_to_bf16x2(y[2 * p], y[2 * p + 1]) for p in range(4)])


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


def _build_mix(K: int, nmix: int = 24, parts: int = 1, stages: int = STAGES):
    return HcMix(K, nmix, parts, stages), (fake_ptr(BFloat16), fake_ptr(Float32), fake_ptr(Float32, 4), fake_ptr(Float32),
                                   fake_ptr(Int32, 4), Int32(1), Float32(1e-6), fake_stream())


def _build_apply(D: int, M: int = 4, iters: int = 20, head: bool = False):
    return HcPreApply(D, M, iters, head), (fake_ptr(Float32, 4), fake_ptr(Float32, 4), fake_ptr(Float32, 4),
                                     fake_ptr(BFloat16), fake_ptr(BFloat16), fake_ptr(Float32, 4),
                                     fake_ptr(Float32, 4), Int32(1), Float32(1e-6), fake_stream())


def _build_fused(D: int, M: int = 4, iters: int = 20, head: bool = False, **tuning):
    f32, i32 = fake_ptr(Float32, 4), fake_ptr(Int32, 4)
    return HcFused(D, M, iters, head, **tuning), (fake_ptr(BFloat16), fake_ptr(Float32), f32, f32, fake_ptr(BFloat16),
                                                  f32, f32, f32, i32, f32, i32, Int32(1), Int32(1), Float32(1e-6),
                                                  Float32(1e-6), fake_stream())


def _build_post(D: int, M: int = 4):
    return HcPost(D, M), (fake_ptr(BFloat16), fake_ptr(BFloat16), fake_ptr(Float32), fake_ptr(Float32),
                          fake_ptr(BFloat16), Int32(1), fake_stream())


register(KernelDef("hc_mix", "mhc", BOTH, _build_mix,
                   configs=({"K": 4 * 7168, "nmix": 24, "parts": 8}, {"K": 4 * 4096, "nmix": 24, "parts": 8},
                            {"K": 4 * 7168, "nmix": 4, "parts": 8}, {"K": 4 * 7168, "nmix": 24, "parts": 32}),
                   ci_configs=({"K": 4 * 7168, "nmix": 24, "parts": 8}, {"K": 4 * 7168, "nmix": 4, "parts": 1}),
                   doc="mHC mixes: RMS over 4*D times the 24-column projection (mma.sync, fn as bf16 hi + lo)"))
register(KernelDef("hc_pre_apply", "mhc", BOTH, _build_apply,
                   configs=({"D": 7168, "M": 4, "iters": 20}, {"D": 4096, "M": 4, "iters": 20},
                            {"D": 7168, "M": 4, "iters": 0, "head": True}, {"D": 4096, "M": 4, "iters": 0, "head": True}),
                   doc="mHC pre: sigmoid, softmax + Sinkhorn (shuffles), weighted stream sum (and hc_head)"))
register(KernelDef("hc_fused", "mhc", BOTH, _build_fused,
                   configs=({"D": 7168, "M": 4, "iters": 20}, {"D": 4096, "M": 4, "iters": 20},
                            {"D": 7168, "M": 4, "iters": 0, "head": True}, {"D": 4096, "M": 4, "iters": 0, "head": True}),
                   ci_configs=({"D": 7168, "M": 4, "iters": 20}, {"D": 7168, "M": 4, "iters": 0, "head": True}),
                   doc="mHC pre / head in one pass: persistent parts x slots grid, fn slice resident, x tile held "
                       "until every part's mixes are in"))
register(KernelDef("hc_post", "mhc", BOTH, _build_post, configs=({"D": 7168, "M": 4}, {"D": 4096, "M": 4}),
                   doc="mHC post: post * a + comb^T . residual"))


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------

def hc_mixes(x, fn, eps: float, parts: int | None = None, stages: int = STAGES):
    """x [S, M, D] bf16, fn [(2+M)M, M*D] -> mixes fp32 [S, (2+M)M]; K in `parts` (default: mix_parts).
    The pipeline's stages change only the buffering, not a result bit."""
    import torch
    x = x.contiguous()
    S = x.size(0)
    K = x[0].numel()
    fn = fn.to(device=x.device, dtype=torch.float32).contiguous()
    nmix = fn.size(0)
    out = torch.empty(S, nmix, dtype=torch.float32, device=x.device)
    check_numel(x)
    if S:
        parts = parts or mix_parts(S, K, sm_count(x.device))
        f = compile_kernel("hc_mix", device_arch(x.device), K=K, nmix=nmix, parts=parts, stages=stages)
        tiles = -(-S // MIX_TOKENS) * MIX_WARPS
        ws = scratch("hc_mix_partials", x.device, tiles * parts * 32 * mix_lane_values(nmix), torch.float32)
        tickets = scratch("hc_mix_tickets", x.device, tiles, torch.int32)
        f(ptr(x), ptr(fn), ptr(out, Float32, 4), ptr(ws, Float32), ptr(tickets, Int32, align=4), Int32(S),
          Float32(eps), current_stream())
    return out


def fused_fits(D: int, M: int, sms: int, part_d: int = PART_D) -> bool:
    """hc_fused takes the shape: 4 streams, D in whole part_d-feature parts, one CTA a part within the SMs."""
    return M == 4 and D % part_d == 0 and D // part_d <= sms


def hc_fused(x, fn, scale, base, iters: int, norm_eps: float, hc_eps: float, head: bool = False,
             tuning: dict | None = None):
    """hc_pre (head=False: -> y, post, comb) or hc_head (-> y) in one launch of hc_fused; x [S, M, D] bf16.
    tuning: HcFused's part_d / bufs / lag in place of the defaults (benchmarks/sweep_hc_chunks.py)."""
    import torch
    S, M, D = x.shape
    sms = sm_count(x.device)
    tuning = tuning or {}
    part_d = tuning.get("part_d", PART_D)
    if not fused_fits(D, M, sms, part_d):
        raise ValueError(f"hc_fused takes M = 4 and D a multiple of {part_d} with D / {part_d} <= {sms} SMs "
                         f"(got M={M}, D={D})")
    check_numel(x)
    fn = fn.to(device=x.device, dtype=torch.float32).contiguous()
    scale = scale.to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
    base = base.to(device=x.device, dtype=torch.float32).contiguous()
    y = torch.empty(S, D, dtype=torch.bfloat16, device=x.device)
    post = torch.empty(S, M, dtype=torch.float32, device=x.device)
    comb = torch.empty(S, M, M, dtype=torch.float32, device=x.device)
    if S:
        k = HcFused(D, M, iters, head, **tuning)
        tiles = -(-S // FUSED_TOKENS)
        slots = min(sms // k.parts, tiles)
        rec = scratch("hc_fused_records", x.device, tiles * k.parts * FUSED_TOKENS * k.rec, torch.float32)
        counters = scratch("hc_fused_counters", x.device, tiles, torch.int32)
        weights = scratch("hc_fused_weights", x.device, tiles * FUSED_TOKENS * M, torch.float32)
        flags = scratch("hc_fused_flags", x.device, tiles, torch.int32)
        f = compile_kernel("hc_fused", device_arch(x.device), D=D, M=M, iters=iters, head=head, **tuning)
        f(ptr(x), ptr(fn), ptr(scale, Float32, 4), ptr(base, Float32, 4), ptr(y), ptr(post, Float32, 4),
          ptr(comb, Float32, 4), ptr(rec, Float32, 4), ptr(counters, Int32, align=4), ptr(weights, Float32, 4),
          ptr(flags, Int32, align=4), Int32(S), Int32(slots), Float32(norm_eps), Float32(hc_eps), current_stream())
    return y if head else (y, post, comb)


def hc_pre(x, fn, scale, base, iters: int, norm_eps: float, hc_eps: float, fused: bool = False):
    """x [S, M, D] bf16 streams -> (y [S, D] bf16, post [S, M] fp32, comb [S, M, M] fp32); by the two kernels
    (hc_mix, then hc_pre_apply), or fused=True by hc_fused: correct, but on the H100 (2026-12-06/07) slower at
    Pro shapes at every tuning (460-511 vs 201 us; each tile's record sum and Sinkhorn sit on one CTA's path)."""
    import torch
    if x.dtype != torch.bfloat16 or x.dim() != 3:
        raise ValueError("hc_pre kernel takes x [S, M, D] bf16")
    x = x.contiguous()
    if fused:
        return hc_fused(x, fn, scale, base, iters, norm_eps, hc_eps)
    return hc_pre_apply(x, hc_mixes(x, fn, norm_eps), scale, base, iters, hc_eps)


def hc_pre_apply(x, mixes, scale, base, iters: int, hc_eps: float):
    """hc_pre's second kernel: x [S, M, D] bf16, mixes fp32 [S, (2+M)M] -> (y, post, comb) as hc_pre."""
    import torch
    x, mixes = x.contiguous(), mixes.to(torch.float32).contiguous()
    S, M, D = x.shape
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


def hc_head(x, fn, scale, base, norm_eps: float, hc_eps: float, fused: bool = False):
    """ParallelHead.hc_head: x [S, M, D] bf16 -> [S, D] bf16 (sigmoid-weighted stream sum, no Sinkhorn); two
    kernels, or fused=True one launch of hc_fused (slower so far, as in hc_pre)."""
    import torch
    if x.dtype != torch.bfloat16 or x.dim() != 3:
        raise ValueError("hc_head kernel takes x [S, M, D] bf16")
    x = x.contiguous()
    if fused:
        return hc_fused(x, fn, scale, base, 0, norm_eps, hc_eps, head=True)
    S, M, D = x.shape
    mixes = hc_mixes(x, fn, norm_eps)
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
