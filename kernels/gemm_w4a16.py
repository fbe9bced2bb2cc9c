"""NVFP4 weight x bf16 activation GEMM for Hopper (sm_90a): W4A16 with the weights decoded in registers.

out[t, n] = sum_k x[t, k] * W[n, k], W = E2M1 * e4m3 block scale (per 16 along k) * fp32 global scale.

Swap-AB WGMMA: the weight is the A operand (64 rows per warpgroup, register-sourced, `wgmma ... .bf16` with A
from registers), the activations are B (tokens = WGMMA N, K-major in shared memory by TMA). The packed
weights (kernels/w4_pack.py: nibbles in fragment order, 0.5 B/element + 1 B per 16) travel by bulk copies
into shared memory in the same pipeline stages as the activation tiles; each consumer thread reads its 16
bytes per 64-wide K chunk, turns every 32-bit word into four bf16x2 A registers with shift-and-mask code,
multiplies them by the block scale in bf16 (exact), and issues the WGMMAs. The fp32 global scale (times
2**7, see w4_pack) is applied in the epilogue. Decode of stage k+1 overlaps the WGMMAs of stage k (two A
register buffers).

CTA = 3 warpgroups: warpgroup 0 = producer (one warp issues TMA and bulk copies), warpgroups 1-2 = consumers,
128 weight rows per CTA. Grid = (N / 128, work units).

Work units:
- dense: unit u = tokens [u * n_cta, u * n_cta + n_cta) of x [M, K]; expert 0.
- grouped (MoE, one launch for all experts): units[u] = (expert, first row in x_sorted, row count), written by
  kernels/moe.py from the routing on the device (no host synchronisation); rows of x_sorted are grouped by
  expert; a unit never spans two experts. Units past units_count[0] exit at once.
- n_cta = n_tok * t_max tokens per unit: the CTA decodes each weight tile once and runs it against up to
  t_max token sub-tiles of n_tok (sub-tiles with no token of the unit are skipped).

Epilogues:
- "plain":  out[row, n] = bf16(acc * gscale[e])
- "swiglu": rows interleaved by 8 (w4_pack.interleave_w13): a thread holds gate and up of the same column;
            h[row, i] = bf16(silu(min(g, lim)) * clamp(u, -lim, lim) * route_w[row]) with g, u first
            rounded to bf16 (as the reference computes F.linear in bf16), NaN-propagating min/max.
Clusters (cluster_n = 2, MoE prefill): two CTAs along N with the same work unit share the activation tile,
each loading half of it and multicasting it to both (kernels/_tma_gemm.py); the weights stay per CTA.

Dense decode (M <= 16) runs a second kernel on the same packed weights, W4A16Gemv: mma.sync m16n8k16 (whose A
fragment order is the WGMMA one), many small CTAs whose bytes are all requested at their start, split-K.
"""
from __future__ import annotations

import cutlass
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, Uint32, const_expr, cute, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.experimental import primitives as prims

from ._common import (
    BOTH,
    KernelDef,
    cp_async_16,
    fake_ptr,
    fake_stream,
    fmax_nan,
    fmin_nan,
    last_split_part,
    ld_cg_f32x4,
    ld_shared_v2,
    ld_shared_v4,
    mma_bf16_16816,
    register,
    scratch,
    st_global_v4,
)
from ._tma_gemm import leave_cluster, load, multicast_op, shared_tile_partition, tma_pipeline

SM90 = ("sm_90a",)
SMEM_BYTES = 227 * 1024
CHUNK_WORDS = 4 * 32 * 4          # uint32 words of one (64-row block, 64-wide K chunk) of the blob
CHUNK_SBYTES = 4 * 8 * 8          # scale bytes of one (64-row block, chunk)
GEMV_MAX_CHUNKS = 16              # K chunks of one warp in the decode kernel (all in shared memory at once)
GEMV_CHUNKS = 8                   # K chunks a warp that the decode's split aims at (4.5 KB in flight a warp)
GEMV_MAX_SPLIT = 32               # K parts of the decode kernel (the last warp loads all of them at once)
SCALE_BIAS_BITS = (236 << 7) | (236 << 23)


# --------------------------------------------------------------------------------------------------------
# In-register helpers (inline PTX: exact instructions, no reliance on pattern matching)
# --------------------------------------------------------------------------------------------------------

def bf16x2_mul(a: Uint32, b: Uint32) -> Uint32:
    return cute.arch.inline_ptx("mul.rn.bf16x2 {$w0}, {$r0}, {$r1};", write_only_types=[Uint32],
                                read_only_args=[a, b])


def prmt(a: Uint32, b: Uint32, sel: int) -> Uint32:
    return cute.arch.inline_ptx(f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {sel:#x};", write_only_types=[Uint32],
                                read_only_args=[a, b])


def decode_word(w: Uint32, s_r: Uint32, s_r8: Uint32):
    """One fragment word (8 codes) -> 4 bf16x2 A registers (a0a1, a2a3, a4a5, a6a7), block scale applied."""
    m = Uint32(0x81C081C0)
    o0 = (w << 6) & m
    o1 = (w << 3) & m
    o2 = w & m
    o3 = ((w >> 4) & Uint32(0x00C000C0)) | ((w >> 5) & Uint32(0x01000100)) | ((w << 1) & Uint32(0x80008000))
    return bf16x2_mul(o0, s_r), bf16x2_mul(o1, s_r8), bf16x2_mul(o2, s_r), bf16x2_mul(o3, s_r8)


def scale_pair(sw: Uint32, byte: int) -> Uint32:
    """Byte `byte` of a scale word (u code) -> bf16x2 (s * 2**119, s * 2**119)."""
    dup = prmt(sw, Uint32(0), byte | (4 << 4) | (byte << 8) | (4 << 12))      # [u, 0, u, 0]
    return (dup << 4) + Uint32(SCALE_BIAS_BITS)


def silu(x: Float32) -> Float32:
    return x / (Float32(1.0) + cute.math.exp(-x, fastmath=False))


# --------------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------------

class W4A16Gemm:
    threads = 384

    def __init__(self, n_tok: int, t_max: int = 1, grouped: bool = False, epilogue: str = "plain",
                 tile_k: int = 64, stages: int | None = None, cluster_n: int = 1):
        if n_tok % 8 or not 8 <= n_tok <= 256 or n_tok * t_max > 256:
            raise ValueError("n_tok must be a multiple of 8 in [8, 256] and n_tok * t_max <= 256")
        if epilogue not in ("plain", "swiglu"):
            raise ValueError(f"unknown epilogue {epilogue}")
        if cluster_n not in (1, 2):
            raise ValueError("cluster_n must be 1 or 2")
        self.n_tok, self.t_max, self.grouped, self.epilogue = n_tok, t_max, grouped, epilogue
        self.cluster_n = cluster_n
        self.n_cta = n_tok * t_max
        if tile_k not in (64, 128):
            raise ValueError("tile_k must be 64 or 128")
        self.tile_k = tile_k
        self.chunks = self.tile_k // 64
        self.kb = self.tile_k // 16                       # k16 blocks per stage
        stage_bytes = self.n_cta * self.tile_k * 2 + 2 * self.chunks * (CHUNK_WORDS * 4 + CHUNK_SBYTES)
        self.stages = stages or max(2, min(12, (SMEM_BYTES - 4096) // stage_bytes))
        self.tx_bytes = stage_bytes

    # ---- host side ----

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, blob_ptr: cute.Pointer, sblob_ptr: cute.Pointer, gs_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, rw_ptr: cute.Pointer, units_ptr: cute.Pointer, ucount_ptr: cute.Pointer,
                 rows: Int32, n: Int32, k: Int32, n_units: Int32, n_experts: Int32, lim: Float32, stream):
        nb = n // 64
        mX = cute.make_tensor(x_ptr, cute.make_layout((rows, k), stride=(k, 1)))
        mBlob = cute.make_tensor(blob_ptr, cute.make_layout(CHUNK_WORDS))       # base pointers only: offsets
        mS = cute.make_tensor(sblob_ptr, cute.make_layout(CHUNK_SBYTES))        # are 64-bit (E * N * K / 2)
        mGs = cute.make_tensor(gs_ptr, cute.make_layout(n_experts))
        n_out = n // 2 if const_expr(self.epilogue == "swiglu") else n
        mOut = cute.make_tensor(out_ptr, cute.make_layout((rows, n_out), stride=(n_out, 1)))
        mRw = cute.make_tensor(rw_ptr, cute.make_layout(rows))
        mUnits = cute.make_tensor(units_ptr, cute.make_layout((3, n_units), stride=(1, 3)))
        mUcount = cute.make_tensor(ucount_ptr, cute.make_layout(1))

        b_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.utils.LayoutEnum.ROW_MAJOR, BFloat16, self.tile_k), BFloat16)
        sB_layout = cute.tile_to_shape(b_atom, (self.n_cta, self.tile_k, self.stages), order=(0, 1, 2))
        tma_atom, mX_tma = cpasync.make_tiled_tma_atom(
            multicast_op(self.cluster_n), mX, cute.slice_(sB_layout, (None, None, 0)), (self.n_cta, self.tile_k),
            num_multicast=self.cluster_n)

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (2, 1, 1), tiler_mn=(64, self.n_tok), a_source=warpgroup.OperandSource.RMEM)

        @cute.struct
        class Storage:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[Uint32, self.stages * 2 * self.chunks * CHUNK_WORDS], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Uint32, self.stages * 2 * self.chunks * CHUNK_SBYTES // 4],
                                  128]

        self.storage = Storage
        self.kernel(tma_atom, mX_tma, mBlob, mS, mGs, mOut, mRw, mUnits, mUcount, tiled_mma, sB_layout, rows, n, k,
                    lim).launch(
            grid=[nb // 2, n_units, 1], block=[self.threads, 1, 1], cluster=[self.cluster_n, 1, 1],
            min_blocks_per_mp=1, stream=stream)

    # ---- device side ----

    @cute.kernel
    def kernel(self, tma_atom: cute.CopyAtom, mX: cute.Tensor, mBlob: cute.Tensor, mS: cute.Tensor,
               mGs: cute.Tensor, mOut: cute.Tensor, mRw: cute.Tensor, mUnits: cute.Tensor, mUcount: cute.Tensor,
               tiled_mma: cute.TiledMma, sB_layout: cute.ComposedLayout, rows: Int32, n: Int32, k: Int32,
               lim: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        nb = n // 64
        kc = k // 64

        # ---- work unit ----
        expert = Int32(0)
        row0 = by * self.n_cta
        cnt = cutlass.min(rows - row0, self.n_cta)
        valid = Int32(1)
        if const_expr(self.grouped):
            valid = Int32(0)
            if by < mUcount[0]:
                valid = Int32(1)
            uc = cutlass.min(by, mUnits.shape[1] - 1)
            expert = mUnits[0, uc]
            row0 = mUnits[1, uc]
            cnt = mUnits[2, uc]
        k_tiles = kc // self.chunks

        if valid != 0:
            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(self.storage)
            sB = st.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            sW = st.sW.get_tensor(cute.make_layout((4, 32, 4, self.chunks, 2, self.stages),
                                                   stride=(1, 4, 128, CHUNK_WORDS, self.chunks * CHUNK_WORDS,
                                                           2 * self.chunks * CHUNK_WORDS)))
            sS = st.sS.get_tensor(cute.make_layout((2, 8, 4, self.chunks, 2, self.stages),
                                                   stride=(1, 2, 16, CHUNK_SBYTES // 4,
                                                           self.chunks * CHUNK_SBYTES // 4,
                                                           2 * self.chunks * CHUNK_SBYTES // 4)))
            pipe = tma_pipeline(st.bars, self.stages, self.tx_bytes, self.cluster_n)

            gX = cute.local_tile(cute.domain_offset((row0, 0), mX), (self.n_cta, self.tile_k), (0, None))
            tBsB, tBgX, x_mask = shared_tile_partition(tma_atom, self.cluster_n, sB, gX)

            if warp < 4:
                # ================= producer =================
                cute.arch.setmaxregister_decrease(40)
                if warp == 0:
                    if lane == 0:
                        cpasync.prefetch_descriptor(tma_atom)
                    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    for kt in cutlass.range(k_tiles, unroll=1):
                        pipe.producer_acquire(state)
                        bar = pipe.producer_get_barrier(state)
                        load(tma_atom, tBgX[(None, kt)], tBsB[(None, state.index)], bar, x_mask)
                        if lane == 0:
                            for h in cutlass.range_constexpr(2):
                                blk = Int64((expert * nb + bx * 2 + h) * kc + kt * self.chunks)
                                prims.cp_async_bulk_shared_cluster_global(
                                    sW[(None, 0, 0, 0, h, state.index)].iterator,
                                    mBlob.iterator + blk * CHUNK_WORDS, bar,
                                    self.chunks * CHUNK_WORDS * 4)
                                prims.cp_async_bulk_shared_cluster_global(
                                    sS[(None, 0, 0, 0, h, state.index)].iterator,
                                    mS.iterator + blk * CHUNK_SBYTES, bar,
                                    self.chunks * CHUNK_SBYTES)
                        pipe.producer_commit(state)
                        state.advance()
                    pipe.producer_tail(state)
            else:
                # ================= consumers =================
                cute.arch.setmaxregister_increase(232)
                ctid = tidx - 128
                h = (warp - 4) // 4                        # consumer warpgroup = 64-row block
                wq = warp % 4
                g = lane // 4
                thr_mma = tiled_mma.get_slice(ctid)
                # one B fragment (V, 1, KB, STAGES) and one accumulator (V, 1, 1) per token sub-tile
                tCrBs = [tiled_mma.make_fragment_B(thr_mma.partition_B(
                    cute.local_tile(sB, (self.n_tok, self.tile_k, self.stages), (t, 0, 0))))
                    for t in range(self.t_max)]
                a_shape = thr_mma.partition_shape_A((128, self.tile_k))
                fragA0 = tiled_mma.make_fragment_A(a_shape)
                fragA1 = tiled_mma.make_fragment_A(a_shape)
                accs = [cute.make_rmem_tensor(thr_mma.partition_shape_C((128, self.n_tok)), Float32)
                        for _ in range(self.t_max)]
                for t in cutlass.range_constexpr(self.t_max):
                    accs[t].fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                n_sub = cutlass.min((cnt + self.n_tok - 1) // self.n_tok, self.t_max)

                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

                if k_tiles > 0:
                    pipe.consumer_wait(read)
                    self.decode_stage(sW, sS, read.index, fragA0, lane, wq, g, h)
                    read.advance()
                kt = Int32(0)
                while kt < k_tiles:
                    # even tile: frag0 feeds the WGMMAs while the next tile decodes into frag1
                    self.mma_stage(tiled_mma, accs, fragA0, tCrBs, release.index, n_sub)
                    if kt + 1 < k_tiles:
                        pipe.consumer_wait(read)
                        self.decode_stage(sW, sS, read.index, fragA1, lane, wq, g, h)
                        read.advance()
                    warpgroup.wait_group(0)
                    pipe.consumer_release(release)
                    release.advance()
                    kt += 1
                    if kt < k_tiles:
                        self.mma_stage(tiled_mma, accs, fragA1, tCrBs, release.index, n_sub)
                        if kt + 1 < k_tiles:
                            pipe.consumer_wait(read)
                            self.decode_stage(sW, sS, read.index, fragA0, lane, wq, g, h)
                            read.advance()
                        warpgroup.wait_group(0)
                        pipe.consumer_release(release)
                        release.advance()
                        kt += 1

                # ================= epilogue =================
                gs = mGs[expert]
                cC = cute.make_identity_tensor((128, self.n_tok))
                tCcC = thr_mma.partition_C(cC)
                for t in cutlass.range_constexpr(self.t_max):
                    if t < n_sub:
                        self.epilogue_direct(accs[t], tCcC, mOut, mRw, gs, lim, bx, row0 + t * self.n_tok,
                                             cnt - t * self.n_tok)
            leave_cluster(self.cluster_n)          # both CTAs of a cluster have the same unit: valid together

    @cute.jit
    def decode_stage(self, sW: cute.Tensor, sS: cute.Tensor, stage: Int32, frag: cute.Tensor, lane: Int32,
                     wq: Int32, g: Int32, h: Int32):
        fw = cute.recast_tensor(frag, Uint32)             # (4, 1, KB) words
        for c in cutlass.range_constexpr(self.chunks):
            rw = cute.make_rmem_tensor(4, Uint32)
            cute.autovec_copy(sW[(None, lane, wq, c, h, stage)], rw)
            rs = cute.make_rmem_tensor(2, Uint32)
            cute.autovec_copy(sS[(None, g, wq, c, h, stage)], rs)
            for j in cutlass.range_constexpr(4):
                s_r = scale_pair(rs[j // 2], 2 * (j % 2))
                s_r8 = scale_pair(rs[j // 2], 2 * (j % 2) + 1)
                a01, a23, a45, a67 = decode_word(rw[j], s_r, s_r8)
                kb = c * 4 + j
                fw[0, 0, kb] = a01
                fw[1, 0, kb] = a23
                fw[2, 0, kb] = a45
                fw[3, 0, kb] = a67

    @cute.jit
    def mma_stage(self, tiled_mma: cute.TiledMma, accs: list, frag: cute.Tensor, tCrBs: list, stage: Int32,
                  n_sub: Int32):
        # sub-tile 0 always has tokens: its WGMMAs go without a branch. Under one, ptxas waits for them at the
        # commit (C7519) and the next stage's decode stops overlapping them (MoE at 256 tokens: 6.0 -> 5.7 ms).
        # Later sub-tiles keep theirs: issuing empty sub-tiles' WGMMAs cost more at 4096 tokens (12.0 -> 13.3 ms)
        warpgroup.fence()
        self.mma_tile(tiled_mma, accs[0], frag, tCrBs[0], stage)
        for t in cutlass.range_constexpr(1, self.t_max):
            if t < n_sub:
                self.mma_tile(tiled_mma, accs[t], frag, tCrBs[t], stage)
        warpgroup.commit_group()

    @cute.jit
    def mma_tile(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, frag: cute.Tensor, tCrB: cute.Tensor,
                 stage: Int32):
        for kb in cutlass.range_constexpr(self.kb):
            cute.gemm(tiled_mma, acc, frag[(None, None, kb)], tCrB[(None, None, kb, stage)], acc)

    @cute.jit
    def epilogue_direct(self, acc: cute.Tensor, tCcC: cute.Tensor, mOut: cute.Tensor, mRw: cute.Tensor,
                        gs: Float32, lim: Float32, bx: Int32, row0: Int32, cnt: Int32):
        if const_expr(self.epilogue == "plain"):
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, c = tCcC[i]
                if c < cnt:
                    mOut[row0 + c, bx * 128 + r] = (acc[i] * gs).to(BFloat16)
        else:
            # value order per thread: (r, c), (r, c+1), (r+8, c), (r+8, c+1), then the next 8 columns
            for i4 in cutlass.range_constexpr(cute.size(acc) // 4):
                for d in cutlass.range_constexpr(2):
                    i = i4 * 4 + d
                    r, c = tCcC[i]
                    if c < cnt:
                        gate = (acc[i] * gs).to(BFloat16).to(Float32)
                        up = (acc[i + 2] * gs).to(BFloat16).to(Float32)
                        gate = fmin_nan(gate, lim)
                        up = fmax_nan(fmin_nan(up, lim), -lim)
                        hval = silu(gate) * up * mRw[row0 + c]
                        col = (bx * 128 + r) // 16 * 8 + r % 8
                        mOut[row0 + c, col] = hval.to(BFloat16)


# --------------------------------------------------------------------------------------------------------
# Decode (M <= 16): warp-level MMAs, every weight load of a warp in flight at once
# --------------------------------------------------------------------------------------------------------

def ldmatrix(smem_addr: Int32, count: int):
    """`count` (2 or 4) 8x8 bf16 matrices from shared memory, lane i addressing row i % 8 of matrix i / 8."""
    regs = ", ".join(f"{{$w{i}}}" for i in range(count))
    return cute.arch.inline_ptx(f"ldmatrix.sync.aligned.m8n8.x{count}.shared.b16 {{{regs}}}, [{{$r0}}];",
                                write_only_types=[Uint32] * count, read_only_args=[smem_addr])


class W4A16Gemv:
    """Dense W4A16 for M <= 16 tokens (decode), on the same packed weights as W4A16Gemm.

    A warp owns 16 weight rows and `chunks` 64-wide K chunks. Every byte a CTA needs is requested at its start
    by cp.async into shared memory, one commit group per chunk (x's K range first: 16 or 8 token rows, zero
    past M), so warps x chunks x 576 bytes a CTA are in flight at once and no register holds them (ptxas sinks
    register loads to their use). Each chunk is computed as soon as its group lands: per k16 block one
    fragment word is decoded into the mma.sync A registers (the fragment order of the WGMMA kernel is also
    that of m16n8k16), x's B fragments come by one ldmatrix, one MMA per 8 tokens.

    CTA = `warps` warps = 16 x warps weight rows; grid = (N / rows, split): K in `split` parts. Each warp writes
    its fp32 fragments to a workspace; a ticket per 16-row slab counts the parts, and the warp that completes
    the last one sums them in split order (deterministic, all parts' loads in flight at once) and stores bf16
    out (_common.last_split_part; with GPU-scope fences and 4 parts a load round, the sum cost ~2.5 us of 8.8 on
    the H200).
    """

    def __init__(self, tok_tiles: int, chunks: int, split: int, warps: int = 8):
        if tok_tiles not in (1, 2):
            raise ValueError("tok_tiles must be 1 (M <= 8) or 2 (M <= 16)")
        if not 1 <= chunks <= GEMV_MAX_CHUNKS:
            raise ValueError(f"chunks per warp must be in [1, {GEMV_MAX_CHUNKS}]")
        if not 1 <= split <= GEMV_MAX_SPLIT:
            raise ValueError(f"split must be in [1, {GEMV_MAX_SPLIT}]")
        if warps not in (4, 8):
            raise ValueError("warps must be 4 or 8")
        self.tok_tiles, self.chunks, self.split, self.warps = tok_tiles, chunks, split, warps
        self.threads = 32 * warps
        self.tokens = 8 * tok_tiles
        self.nv = 4 * tok_tiles                    # fp32 values of a lane's fragments
        self.row = chunks * 64 + 8        # smem row of x in bf16: padded so ldmatrix's 8 rows miss each other's banks

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, blob_ptr: cute.Pointer, sblob_ptr: cute.Pointer, gs_ptr: cute.Pointer,
                 out_ptr: cute.Pointer, ws_ptr: cute.Pointer, ticket_ptr: cute.Pointer, rows: Int32, n: Int32,
                 k: Int32, stream):
        mOut = cute.make_tensor(out_ptr, cute.make_layout((rows, n), stride=(n, 1)))
        warp_chunks = self.warps * self.chunks

        @cute.struct
        class Storage:
            sW: cute.struct.Align[cute.struct.MemRange[Uint32, warp_chunks * 128], 128]     # [warp, chunk, lane, 4]
            sS: cute.struct.Align[cute.struct.MemRange[Uint32, warp_chunks * 16], 128]      # [warp, chunk, g, 2]
            sX: cute.struct.Align[cute.struct.MemRange[BFloat16, self.tokens * self.row], 128]

        self.storage = Storage
        self.kernel(x_ptr, blob_ptr, sblob_ptr, gs_ptr, mOut, ws_ptr, ticket_ptr, rows, n, k).launch(
            grid=[n // (16 * self.warps), self.split, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x_ptr: cute.Pointer, blob_ptr: cute.Pointer, sblob_ptr: cute.Pointer, gs_ptr: cute.Pointer,
               mOut: cute.Tensor, ws_ptr: cute.Pointer, ticket_ptr: cute.Pointer, rows: Int32, n: Int32, k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, part, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane // 4
        q = lane % 4
        kc = k // 64
        c0 = part * self.chunks
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.storage)
        sw = st.sW.data_ptr().toint() + (warp * self.chunks * 128 + lane * 4) * 4
        ss = st.sS.data_ptr().toint() + warp * self.chunks * 64
        sx = st.sX.data_ptr().toint()

        # ---- group 0: x[:, c0 * 64 : (c0 + chunks) * 64] -> shared memory, token rows past M zero ----
        per_row = self.chunks * 8                          # 16-byte pieces of a token row
        for i in cutlass.range_constexpr(-(-self.tokens * per_row // self.threads)):
            piece = tidx + i * self.threads
            t = piece // per_row
            v = piece % per_row
            if piece < self.tokens * per_row:
                src = x_ptr.toint() + Int64(cutlass.min(t, rows - 1) * k + c0 * 64 + v * 8) * 2
                cp_async_16(sx + (t * self.row + v * 8) * 2, src, cutlass.select_(t < rows, Int32(16), Int32(0)))
        cute.arch.cp_async_commit_group()
        # ---- groups 1..chunks: the warp's fragments (16 bytes a lane) and scales (64 bytes a warp) ----
        slab = bx * self.warps + warp                      # 16-row slab = (64-row block, warp in the block)
        blob = blob_ptr.toint() + Int64((slab // 4 * kc + c0) * CHUNK_WORDS + slab % 4 * 128 + lane * 4) * 4
        sblob = sblob_ptr.toint() + Int64((slab // 4 * kc + c0) * CHUNK_SBYTES + slab % 4 * 64 + lane * 16)
        for c in cutlass.range_constexpr(self.chunks):
            cp_async_16(sw + c * 512, blob + c * CHUNK_WORDS * 4, Int32(16))
            if lane < 4:
                cp_async_16(ss + c * 64 + lane * 16, sblob + c * CHUNK_SBYTES, Int32(16))
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(self.chunks)
        cute.arch.barrier()                                # x is read by every warp

        # ---- MMAs: lane i addresses row i % 8 of matrix i / 8 = (tokens 8 * (i / 16) + ..., k half (i / 8) % 2)
        tok = lane % 8 + (lane // 16) * 8 if const_expr(self.tok_tiles == 2) else lane % 8
        b_addr = sx + (tok * self.row + (lane // 8) % 2 * 8) * 2
        acc = [[Float32(0.0)] * 4 for _ in range(self.tok_tiles)]
        for c in cutlass.range_constexpr(self.chunks):
            cute.arch.cp_async_wait_group(self.chunks - 1 - c)
            cute.arch.sync_warp()                          # scales were copied by lanes 0-3
            words = ld_shared_v4(sw + c * 512)
            scales = ld_shared_v2(ss + c * 64 + g * 8)
            for j in cutlass.range_constexpr(4):
                s_r = scale_pair(scales[j // 2], 2 * (j % 2))
                s_r8 = scale_pair(scales[j // 2], 2 * (j % 2) + 1)
                a = decode_word(words[j], s_r, s_r8)
                b = ldmatrix(b_addr + (c * 64 + j * 16) * 2, 2 * self.tok_tiles)
                for t in cutlass.range_constexpr(self.tok_tiles):
                    acc[t] = list(mma_bf16_16816(a, b[2 * t:2 * t + 2], acc[t]))

        # ---- K parts: summed in split order by the warp that completes the slab ----
        vals = [v for tile in acc for v in tile]           # value 4t + 2h + e: row g + 8h, token 8t + 2q + e
        if const_expr(self.split == 1):
            self.store(vals, mOut, gs_ptr, slab, g, q, rows)
        else:
            part_bytes = n * self.tokens * 4               # one part: every slab's fragments
            frag = ws_ptr.toint() + Int64(slab * 32 + lane) * (self.nv * 4)
            for i in cutlass.range_constexpr(self.nv // 4):
                st_global_v4(frag + Int64(part * part_bytes + 16 * i), vals[4 * i:4 * i + 4])
            if last_split_part(ticket_ptr + slab, self.split, lane):
                total = cute.make_rmem_tensor(self.nv, Float32)
                total.fill(0.0)
                for p in cutlass.range_constexpr(self.split):
                    for i in cutlass.range_constexpr(self.nv // 4):
                        got = ld_cg_f32x4(frag + Int64(p * part_bytes + 16 * i))
                        for e in cutlass.range_constexpr(4):
                            total[4 * i + e] = total[4 * i + e] + got[e]
                self.store(total, mOut, gs_ptr, slab, g, q, rows)

    @cute.jit
    def store(self, vals, mOut: cute.Tensor, gs_ptr: cute.Pointer, slab: Int32, g: Int32, q: Int32, rows: Int32):
        gs = cute.make_tensor(gs_ptr, cute.make_layout(1))[0]
        for i in cutlass.range_constexpr(self.nv):
            token = 8 * (i // 4) + 2 * q + i % 2
            if token < rows:
                mOut[token, slab * 16 + g + 8 * (i % 4 // 2)] = (vals[i] * gs).to(BFloat16)


# --------------------------------------------------------------------------------------------------------
# Registry and launcher
# --------------------------------------------------------------------------------------------------------

def _build(n_tok: int, t_max: int = 1, grouped: bool = False, epilogue: str = "plain", tile_k: int = 64,
           cluster_n: int = 1):
    kern = W4A16Gemm(n_tok, t_max, grouped, epilogue, tile_k, cluster_n=cluster_n)
    args = (fake_ptr(BFloat16), fake_ptr(Uint32), fake_ptr(Uint8, 16), fake_ptr(Float32, 4),
            fake_ptr(BFloat16), fake_ptr(Float32, 4), fake_ptr(Int32, 4), fake_ptr(Int32, 4),
            Int32(16), Int32(3072), Int32(7168), Int32(1), Int32(1), Float32(10.0), fake_stream())
    return kern, args


W4_CONFIGS = (
    {"n_tok": 16},                                              # dense SwiGLU w13 at M <= 16
    {"n_tok": 64},                                                 # dense, M <= 64
    {"n_tok": 128, "t_max": 2},                                    # dense prefill
    {"n_tok": 16, "grouped": True, "epilogue": "swiglu"},             # MoE decode w13
    {"n_tok": 16, "grouped": True},                                # MoE decode w2
    {"n_tok": 64, "t_max": 2, "grouped": True, "epilogue": "swiglu"},    # MoE prefill w13
    {"n_tok": 64, "t_max": 2, "grouped": True},                       # MoE prefill w2
    {"n_tok": 64, "t_max": 2, "grouped": True, "epilogue": "swiglu", "tile_k": 128, "cluster_n": 2},
    {"n_tok": 64, "t_max": 2, "grouped": True, "tile_k": 128, "cluster_n": 2},
)

register(KernelDef(
    "w4a16_gemm", "linear", SM90, _build, configs=W4_CONFIGS,
    ci_configs=({"n_tok": 128, "t_max": 2}, {"n_tok": 64, "t_max": 2, "grouped": True, "epilogue": "swiglu"}),
    doc="NVFP4 x bf16 WGMMA GEMM, weights decoded in registers (swap-AB), dense/grouped, SwiGLU epilogue"))


def _build_gemv(tok_tiles: int, chunks: int, split: int, warps: int = 8):
    kern = W4A16Gemv(tok_tiles, chunks, split, warps)
    args = (fake_ptr(BFloat16), fake_ptr(Uint32), fake_ptr(Uint8, 16), fake_ptr(Float32, 4), fake_ptr(BFloat16),
            fake_ptr(Float32), fake_ptr(Int32, 4), Int32(16), Int32(3072), Int32(7168), fake_stream())
    return kern, args


register(KernelDef(
    "w4a16_gemv", "linear", BOTH, _build_gemv,
    # the Pro and Flash expert shapes at their picked splits (w1 / w2: 14 / 6 and 8 / 4), M <= 8 and <= 16
    configs=tuple({"tok_tiles": t, "chunks": 8, "split": s} for s in (14, 6, 8, 4) for t in (1, 2)),
    ci_configs=({"tok_tiles": 2, "chunks": 8, "split": 14}, {"tok_tiles": 1, "chunks": 8, "split": 1, "warps": 4}),
    doc="NVFP4 x bf16 decode GEMM (M <= 16): mma.sync on in-register decoded weights, split-K"))


# --------------------------------------------------------------------------------------------------------
# Torch launchers
# --------------------------------------------------------------------------------------------------------

def pick_dense_config(m: int, n: int, k: int) -> dict:
    """Kernel configuration for a dense W4A16 GEMM of m tokens (decode: the mma.sync kernel with its K split;
    more tokens, or a K the decode kernel cannot split: the WGMMA kernel, prefill in wide token tiles)."""
    if m <= 16:
        return {"gemv": True, "split": pick_gemv_split(k)} if gemv_splits(k) else {"n_tok": 16}
    if m <= 64:
        return {"n_tok": 64}
    # prefill: 256 tokens a CTA. Clusters sharing the activation tile gained nothing here on the H200 (Pro w1
    # at M = 2048: 156.1 us in pairs, 155.0 alone; 4096: 267.6 / 253.9): the dense GEMM is not bound by L2
    return {"n_tok": 128, "t_max": 2}


def pick_swiglu_config(m: int, n: int, k: int) -> dict:
    """WGMMA configuration for the fused w1|w3 + SwiGLU of one dense expert (the decode kernel has no SwiGLU
    epilogue): in decode 16-token tiles with K stages 128 wide where K allows (the faster of the two on the
    H200: Pro w1 at M = 16, 27.7 us against 32.7), else the dense pick."""
    if m <= 16:
        return {"n_tok": 16, "tile_k": 128 if (k // 64) % 2 == 0 else 64}
    return pick_dense_config(m, n, k)


def w4a16_launch(x, pack, n: int, *, out=None, route_w=None, units=None, unit_count=None, lim: float = 0.0,
                 n_tok: int = 16, t_max: int = 1, grouped: bool = False, epilogue: str = "plain",
                 tile_k: int = 64, cluster_n: int = 1):
    """Launch one W4A16 GEMM. x bf16 [rows, K] (grouped: rows sorted by expert), pack = (blob, sblob, gscale)
    from w4_pack; returns out bf16 [rows, n] (swiglu: [rows, n/2])."""
    import torch

    from ._common import compile_kernel, current_stream, device_arch, ptr
    blob, sblob, gscale = pack
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError("W4A16 takes contiguous bf16 activations")
    if blob.shape[1] * 64 != n or blob.shape[2] * 64 != k:
        raise ValueError(f"packed weight is {blob.shape[1] * 64}x{blob.shape[2] * 64}, GEMM asks {n}x{k}")
    n_out = n // 2 if epilogue == "swiglu" else n
    if out is None:
        out = torch.empty(rows, n_out, dtype=torch.bfloat16, device=x.device)
    if rows == 0:
        return out
    if (k // 64) % (tile_k // 64):
        raise ValueError(f"tile_k {tile_k} does not divide K = {k}")
    if (n // 128) % cluster_n:
        raise ValueError(f"W4A16 cannot group {n // 128} weight tiles in clusters of {cluster_n}")
    n_cta = n_tok * t_max
    if grouped:
        n_units = units.shape[0]
    else:
        n_units = -(-rows // n_cta)
        units = unit_count = torch.zeros(3, dtype=torch.int32, device=x.device)
    cfg = {"n_tok": n_tok, "t_max": t_max, "grouped": grouped, "epilogue": epilogue, "tile_k": tile_k,
           "cluster_n": cluster_n}
    fn = compile_kernel("w4a16_gemm", device_arch(x.device), **cfg)
    rw = route_w if route_w is not None else gscale
    fn(ptr(x), ptr(blob, cutlass.Uint32), ptr(sblob, cutlass.Uint8), ptr(gscale, align=4), ptr(out),
       ptr(rw, cutlass.Float32, align=4), ptr(units, cutlass.Int32, align=4),
       ptr(unit_count, cutlass.Int32, align=4), Int32(rows), Int32(n), Int32(k), Int32(n_units),
       Int32(blob.shape[0]), Float32(lim if lim > 0 else float("inf")), current_stream())
    return out


def gemv_splits(k: int) -> list[int]:
    """The K splits the decode GEMV can run: each part a whole number of chunks, at most GEMV_MAX_CHUNKS."""
    kc = k // 64
    return [s for s in range(1, min(kc, GEMV_MAX_SPLIT) + 1) if kc % s == 0 and kc // s <= GEMV_MAX_CHUNKS]


def pick_gemv_split(k: int) -> int:
    """The split that gives each warp GEMV_CHUNKS chunks of K, or the nearest: the fastest on the H200 for all
    four expert shapes at M = 1 and 16, whatever their CTA count (benchmarks/results/gemm.json, decode_*)."""
    return min(gemv_splits(k), key=lambda s: (abs(k // 64 // s - GEMV_CHUNKS), s))


def w4a16_gemv(x, pack, n: int, split: int | None = None, warps: int = 8, out=None):
    """x [M <= 16, K] bf16 @ W^T for one packed NVFP4 weight W [n, K] -> [M, n] bf16 (the decode kernel)."""
    import torch

    from ._common import compile_kernel, current_stream, device_arch, ptr
    blob, sblob, gscale = pack
    rows, k = x.shape
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError("W4A16 takes contiguous bf16 activations")
    if rows > 16:
        raise ValueError(f"the W4A16 decode kernel takes at most 16 tokens, not {rows}")
    if blob.shape[0] != 1 or blob.shape[1] * 64 != n or blob.shape[2] * 64 != k:
        raise ValueError(f"packed weight is {blob.shape[0]} x {blob.shape[1] * 64}x{blob.shape[2] * 64}, GEMM asks "
                         f"one {n}x{k}")
    split = split or pick_gemv_split(k)
    if split not in gemv_splits(k):
        raise ValueError(f"split {split} is not one of the decode kernel's splits of K = {k}: {gemv_splits(k)}")
    if out is None:
        out = torch.empty(rows, n, dtype=torch.bfloat16, device=x.device)
    elif out.shape != (rows, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{rows}, {n}] tensor, not {out.dtype} {list(out.shape)}")
    if rows == 0:
        return out
    tok_tiles = 1 if rows <= 8 else 2
    fn = compile_kernel("w4a16_gemv", device_arch(x.device), tok_tiles=tok_tiles, chunks=k // 64 // split,
                        split=split, warps=warps)
    ws = scratch("w4_gemv_partials", x.device, split * n * 8 * tok_tiles, torch.float32)
    tickets = scratch("w4_gemv_tickets", x.device, n // 16, torch.int32)
    fn(ptr(x), ptr(blob, cutlass.Uint32), ptr(sblob, cutlass.Uint8), ptr(gscale, align=4), ptr(out),
       ptr(ws, cutlass.Float32), ptr(tickets, cutlass.Int32, align=4), Int32(rows), Int32(n), Int32(k),
       current_stream())
    return out


def w4a16_linear(x, pack, n: int, config: dict | None = None, out=None):
    """x [..., K] bf16 @ W^T for one packed NVFP4 weight W [n, K] -> [..., n] bf16 (dense)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    cfg = dict(config or pick_dense_config(x2.shape[0], n, shape[-1]))
    if cfg.pop("gemv", False):
        y = w4a16_gemv(x2, pack, n, out=out, **cfg)
    else:
        y = w4a16_launch(x2, pack, n, out=out, **cfg)
    return y.view(*shape[:-1], n)
