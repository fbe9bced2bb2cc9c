"""NVFP4 activation quantisation and dequantisation (the W4A4 path's activations; on Hopper only to emulate it).

Format (as dsv4debug.backends.sim.nvfp4_act_quant computes the values):
- global decode scale g = max(amax(|x|) / (6 * 448), fp32 tiny), fp32 [1];
- per block of 16 contiguous elements of the last dim: e4m3 scale e = e4m3(amax_block / (6 g)), so the block
  scale is bs = float(e) * g (fp32);
- per element: E2M1 code of x / bs (x / 1 where bs == 0), round half to even on the code grid
  {0, .5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3; two codes per byte, the even element in the low nibble.
Dequantised value = (+-E2M1) * bs in fp32, rounded to bf16.

Hopper has no FP4 conversion instructions (and CuTeDSL's Float4E2M1FN conversions fail on sm_90a), so codes
are computed arithmetically: the reference counts the 7 rounding thresholds the magnitude passes
(> .25, >= .75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5: strict where the tie goes down to the even code); the
kernel rounds the quotient to the E2M1 grid on the FMA pipe instead (`e2m1_code`), from one reciprocal a
block (`quotient_rn`), and decodes by building the fp32 bit pattern. The same code serves sm_100a.

Kernels: `nvfp4_amax` (grid-stride abs-max by integer max over bf16 magnitude bits, one atomic per CTA),
`nvfp4_quant` and `nvfp4_dequant` (one thread per 16-element block), and `nvfp4_quant_onepass` (the amax and the
quantise in one persistent launch, for `quantize(x)` without a given g). The global scale itself,
amax / 2688 clamped, is one scalar torch op between the amax and quantise kernels: it is computed by the same
torch expression as the reference (which on CUDA multiplies by the reciprocal of 2688), so the kernels'
block scales agree bit for bit with the reference on whatever device runs it.
"""
from __future__ import annotations

import cutlass
import numpy as np
from cutlass import BFloat16, Float32, Int32, Uint32, cute
from cutlass.memory import SmemAllocator

from ._common import (
    BOTH,
    KernelDef,
    bits_f32,
    check_numel,
    compile_kernel,
    current_stream,
    device_arch,
    f32_bits,
    fake_ptr,
    fake_stream,
    fmax_nan,
    group_max_int,
    ld_acquire_i32,
    ptr,
    register,
    scratch,
    sm_count,
)

BLOCK = 16
QUANT_CTAS_PER_SM = 4           # nvfp4_quant's grid an SM: the CTAs its registers let reside (test_kernels_compile)
HELD = 7168                     # blocks of x nvfp4_quant_onepass holds a CTA: 224 KiB of the 227 KiB allowed
# nvfp4_quant_onepass's CTA shapes, the default first: 1024 x 1 was the fastest at every size on the H100
# (2026-12-07 09:55; 58.1 us at Pro's 4096 x 7168 against 59.4 for 512 x 4; bench_nvfp4_onepass.py times them all)
ONEPASS_CONFIGS = ({"threads": 1024, "unroll": 1}, {"threads": 1024, "unroll": 2}, {"threads": 512, "unroll": 4})
QUOTIENT_DEN_RANGE = (2.0 ** -60, 2.0 ** 60)   # block scales outside it: IEEE divisions (quotient_rn's range)
FP4_MAX, FP8_MAX = 6.0, 448.0
INV_FP4_FP8_MAX = float(np.float32(1) / np.float32(FP4_MAX * FP8_MAX))   # RN(1 / 2688) in fp32, as torch's
FP32_TINY = 2.0 ** -126
# E2M1 rounding as thresholds on |x| / bs, (value, inclusive): the code is the count passed; ties go to the even code
E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def max_magnitude_bits(m: Int32, w: Int32) -> Int32:
    """Trace-time: m raised to the larger bf16 magnitude (bits without the sign) of the pair in word w; the
    integer max of magnitude bits orders bf16 as |x| does (NaN above inf, -0 as +0)."""
    return cutlass.max(m, cutlass.max(w & 0x7FFF, (w >> 16) & 0x7FFF))


class Amax:
    """amax_bits[0] = max(amax_bits[0], fp32 bits of max |x|) over x bf16 [nvec * 8]."""
    threads, unroll = 256, 4

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, a_ptr: cute.Pointer, nvec: Int32, grid: Int32, iters: Int32, stream):
        mX = cute.make_tensor(x_ptr, cute.make_layout((8, nvec), stride=(1, 8)))
        mA = cute.make_tensor(a_ptr, cute.make_layout((1,)))
        self.kernel(mX, mA, nvec, iters).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mA: cute.Tensor, nvec: Int32, iters: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        stride = gdim * self.threads
        gtid = bidx * self.threads + tidx
        m = Int32(0)
        rX = cute.make_rmem_tensor((8, self.unroll), BFloat16)
        rW = cute.recast_tensor(rX, Int32)                      # (4, unroll) words, two bf16 each
        for k in cutlass.range(iters):
            base = k * stride * self.unroll + gtid
            rW.fill(0)
            for u in cutlass.range_constexpr(self.unroll):
                idx = base + u * stride
                if idx < nvec:
                    cute.autovec_copy(mX[None, idx], rX[None, u])
            for u in cutlass.range_constexpr(self.unroll):
                for e in cutlass.range_constexpr(4):
                    m = max_magnitude_bits(m, rW[e, u])
        m = group_max_int(m, 32)
        smem = SmemAllocator()
        red = smem.allocate_tensor(Int32, cute.make_layout((self.threads // 32,)), byte_alignment=16)
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        if lane == 0:
            red[warp] = m
        cute.arch.barrier()
        if tidx == 0:
            for i in cutlass.range_constexpr(self.threads // 32):
                m = cutlass.max(m, red[i])
            cute.arch.atomic_max(mA.iterator, m << 16)           # bf16 magnitude bits -> fp32 bits


E2M1_SPLIT = 2.0 ** 22 + 1     # Veltkamp's constant that rounds an fp32 to 24 - 22 = 2 significant bits
ROUND_MAGIC = 1.5 * 2 ** 23    # adding it rounds |v| < 2^22 to an integer (half to even) in the low bits


def e2m1_code(q: Float32) -> Int32:
    """The E2M1 magnitude code (0..7) of |q|, round half to even, saturating at 6; NaN gives 7 too (what
    quotient_rn returns where the quotient overflows), so a caller whose NaN quotients must code 0 replaces
    them by 0 first. All on the FMA pipe
    but for 3 min/max and 2 integer ops (the kernel was bound by its integer pipe): c = min(|q|, 6); from 1 up
    E2M1 has 2 significant bits, so h = max(c, 1) rounded to 2 bits by Veltkamp's split (g = h (2^22 + 1),
    h' = g - (g - h), ties to even) has exponent and mantissa bit equal to the code + 252 (1.0 -> 2), and
    below 1 the grid is 0, .5, 1: 2 min(c, 1) rounded to an integer by ROUND_MAGIC. Each part is constant (2)
    on the other side of 1, so code = (bits(h') >> 22) - 254 + bits(l) - bits(ROUND_MAGIC). Equal to the
    reference's threshold count on every fp32 of [0, 8] and +inf (tests/test_kernels_reference.py)."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 c, h, g, d, l; .reg .b32 hb, lb; abs.f32 c, {$r0}; min.f32 c, c, 0f40C00000; "
        "max.f32 h, c, 0f3F800000; mul.rn.f32 g, h, 0f4A800002; sub.rn.f32 d, g, h; sub.rn.f32 h, g, d; "
        "min.f32 l, c, 0f3F800000; fma.rn.f32 l, l, 0f40000000, 0f4B400000; mov.b32 hb, h; mov.b32 lb, l; "
        "shr.u32 hb, hb, 22; add.s32 hb, hb, lb; sub.s32 {$w0}, hb, 1262485758; }",
        write_only_types=[Int32], read_only_args=[q])


def quotient_rn(a: Float32, den: Float32, rcp: Float32) -> Float32:
    """a / den rounded to nearest even as the IEEE division, from rcp = RN(1 / den) (one division a block
    instead of 16): q = a * rcp is within an ulp or so, and one refinement by the exact FMA residual
    r = a - q den gives RN(q + r rcp) = RN(a / den) (Markstein). NaN where q overflows (r = inf - inf): the
    codes saturate there, as e2m1_code does for NaN. For den in QUOTIENT_DEN_RANGE: rcp is normal, and the
    residual is exact wherever a / den is near a code threshold."""
    return cute.arch.inline_ptx(
        "{ .reg .f32 q, r, t; mul.rn.f32 q, {$r0}, {$r2}; neg.f32 t, q; fma.rn.f32 r, t, {$r1}, {$r0}; "
        "fma.rn.f32 {$w0}, r, {$r2}, q; }",
        write_only_types=[Float32], read_only_args=[a, den, rcp])


@cute.jit
def quant_block(rW: cute.Tensor, g: Float32, rE: cute.Tensor, words: cute.Tensor):
    """One block of 16 bf16 (rW: 8 words, element 2j in the low half of word j) -> its e4m3 scale rE[0] and
    its 16 codes in two words (the even element in the low nibble), for the global decode scale g."""
    # block amax from the magnitude bits (exact, and |-0| = +0 as torch's abs)
    mb = Int32(0)
    for j in cutlass.range_constexpr(8):
        mb = max_magnitude_bits(mb, rW[j])
    t = bits_f32(mb << 16) / (Float32(FP4_MAX) * g)
    rT = cute.make_rmem_tensor((2,), Float32)
    rT[0] = t
    rT[1] = t
    # cvt.rn.satfinite.e4m3x2: a caller's g below amax / 2688 saturates scales at 448 (torch 2.13's CPU
    # cast does too; torch 2.11's CUDA cast gives NaN): g from the tensor's amax never gets there
    rE.store(rT.load().to(cutlass.Float8E4M3FN))
    bs = rE.load().to(Float32)[0] * g
    den = cutlass.select_(bs > Float32(0.0), bs, Float32(1.0))  # also for a NaN scale, as the reference
    if (mb <= 0x7F80 and den >= Float32(QUOTIENT_DEN_RANGE[0])    # no NaN x (quotient_rn would code 7)
            and den <= Float32(QUOTIENT_DEN_RANGE[1])):
        encode_block(rW, den, Float32(1.0) / den, words)          # one IEEE division a block
    else:
        encode_block(rW, den, None, words)


def encode_block(rW, den, rcp, words):
    """Trace-time: the 16 codes of a block into two words (rcp None: IEEE divisions)."""
    for half in range(2):
        acc = Int32(0)
        for i in range(8):
            e = half * 8 + i
            w = rW[e // 2]
            x = bits_f32(w << 16 if e % 2 == 0 else w & -65536)        # the bf16 as fp32, signed
            if rcp is None:
                q = x / den                                             # IEEE division
                q = cutlass.select_(q == q, q, Float32(0.0))  # noqa: PLR0124 (NaN test): NaN scale or x, code 0
            else:
                q = quotient_rn(x, den, rcp)
            sign = Int32(Uint32(f32_bits(x)) >> 31)
            acc = acc + (e2m1_code(q) + sign * 8) * (1 << (4 * i))      # disjoint nibbles: + is |
        words[half] = acc


class Quant:
    """x bf16 [nblk * 16], g fp32 [1] -> codes uint32 [nblk * 2] (8 bytes a block), scales e4m3 [nblk].

    A thread per block, grid-stride, the next block's 32 bytes loaded before this one is encoded. On the H200
    the prefetch alone gained nothing (33.9 us against 33.3 us a block a thread, Pro shapes): the kernel was
    bound by its integer pipe, which the FMA-pipe rounding of e2m1_code then relieved (29.6 us)."""
    threads = 256

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, g_ptr: cute.Pointer, c_ptr: cute.Pointer, s_ptr: cute.Pointer,
                 nblk: Int32, grid: Int32, iters: Int32, stream):
        mX = cute.make_tensor(x_ptr, cute.make_layout((8, 2, nblk), stride=(1, 8, 16)))
        mG = cute.make_tensor(g_ptr, cute.make_layout((1,)))
        mC = cute.make_tensor(c_ptr, cute.make_layout((2, nblk), stride=(1, 2)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((nblk,)))
        self.kernel(mX, mG, mC, mS, nblk, iters).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1],
                                                         stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mG: cute.Tensor, mC: cute.Tensor, mS: cute.Tensor, nblk: Int32,
               iters: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        stride = gdim * self.threads
        b0 = bidx * self.threads + tidx
        g = mG[0]
        rX = cute.make_rmem_tensor((8, 2), BFloat16)
        cute.autovec_copy(mX[None, None, cutlass.min(b0, nblk - 1)], rX)
        rW = cute.make_rmem_tensor((8,), Int32)                  # words: element 2j low, 2j+1 high
        for it in cutlass.range(iters):
            b = b0 + it * stride
            rW.store(cute.recast_tensor(rX, Int32).load())
            cute.autovec_copy(mX[None, None, cutlass.min(b + stride, nblk - 1)], rX)   # prefetch
            rE = cute.make_rmem_tensor((2,), cutlass.Float8E4M3FN)
            words = cute.make_rmem_tensor((2,), Int32)
            quant_block(rW, g, rE, words)
            if b < nblk:
                cute.autovec_copy(cute.recast_tensor(words, Uint32), mC[None, b])
                mS[b] = rE[0]

class QuantOnePass:
    """x bf16 [nblk * 16] -> codes, scales and g fp32 [1] from x's own amax, x read from DRAM once.

    The global amax must be known before any block scale, and Pro's [4096, 7168] (59 MB) does not stay in the
    50 MB L2 between two kernels (amax then quantise: 43% of copy). One persistent launch of at most one CTA an
    SM instead: each CTA takes a contiguous chunk, keeps its first HELD blocks in shared memory while it
    reduces their amax and only reads the rest; a grid-wide barrier (arrival counter) publishes the amax; the
    quantise pass then walks the chunk backwards, so the blocks not held are re-read newest first, from L2.
    The grid must be co-resident (it spins on the counter): at most one CTA an SM, which its shared memory
    forces. sync [3] int32: amax bits, arrivals, departures; zero on entry and left zero by the last CTA.
    threads x unroll blocks are in flight a CTA in pass 1 (1024 threads need at most 64 registers each). Pass 2
    is bound by the quantiser's arithmetic throughput (H100: 29 us at Pro's [4096, 7168] wherever x is), so
    the kernel takes the amax read plus that: 58 us, 1.02x the two kernels there, 1.2-1.7x below the L2."""

    def __init__(self, threads: int, unroll: int):
        self.threads, self.unroll = threads, unroll

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, c_ptr: cute.Pointer, s_ptr: cute.Pointer, g_ptr: cute.Pointer,
                 sync_ptr: cute.Pointer, nblk: Int32, chunk: Int32, grid: Int32, stream):
        mX = cute.make_tensor(x_ptr, cute.make_layout((8, 2, nblk), stride=(1, 8, 16)))
        mC = cute.make_tensor(c_ptr, cute.make_layout((2, nblk), stride=(1, 2)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((nblk,)))
        mG = cute.make_tensor(g_ptr, cute.make_layout((1,)))
        # cooperative: the driver refuses a grid that cannot be co-resident (an SM taken by another context,
        # MPS) with an error, where a plain launch would spin on the barrier forever
        self.kernel(mX, mC, mS, mG, sync_ptr, nblk, chunk).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1],
                                                                  stream=stream, cooperative=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mC: cute.Tensor, mS: cute.Tensor, mG: cute.Tensor, sync_ptr: cute.Pointer,
               nblk: Int32, chunk: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        smem = SmemAllocator()
        # a block's two 16-byte halves in two planes: a warp's 16-byte stores and loads are conflict-free
        sX = smem.allocate_tensor(BFloat16, cute.make_layout((8, 2, HELD), stride=(1, 8 * HELD, 8)),
                                  byte_alignment=16)
        red = smem.allocate_tensor(Int32, cute.make_layout((self.threads // 32,)), byte_alignment=16)
        first = bidx * chunk
        mine = cutlass.max(cutlass.min(chunk, nblk - first), 0)
        held = cutlass.min(mine, HELD)
        step = self.threads * self.unroll
        iters = (mine + step - 1) // step
        rX = cute.make_rmem_tensor((8, 2, self.unroll), BFloat16)
        rW = cute.recast_tensor(rX, Int32)                      # (4, 2, unroll): two bf16 a word

        # ---- pass 1: amax over the chunk; the first `held` blocks stay in shared memory
        m = Int32(0)
        for k in cutlass.range(iters):
            rW.fill(0)
            for u in cutlass.range_constexpr(self.unroll):
                i = (k * self.unroll + u) * self.threads + tidx
                if i < mine:
                    cute.autovec_copy(mX[None, None, first + i], rX[None, None, u])
            for u in cutlass.range_constexpr(self.unroll):
                i = (k * self.unroll + u) * self.threads + tidx
                if i < held:
                    cute.autovec_copy(rX[None, None, u], sX[None, None, i])
                for h in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(4):
                        m = max_magnitude_bits(m, rW[e, h, u])
        m = group_max_int(m, 32)
        warp = cute.arch.warp_idx()        # a shfl.sync of the whole warp: never inside the lane-0 branch
        if cute.arch.lane_idx() == 0:
            red[warp] = m
        cute.arch.barrier()
        # ---- the grid-wide amax: every CTA's max, then its arrival; the last departure resets the counters
        if tidx == 0:
            for w in cutlass.range_constexpr(self.threads // 32):
                m = cutlass.max(m, red[w])
            cute.arch.atomic_max(sync_ptr, m << 16, sem="relaxed", scope="gpu")   # bf16 magnitude -> fp32 bits
            cute.arch.atomic_add(sync_ptr + 1, Int32(1), sem="release", scope="gpu")
            seen = ld_acquire_i32(sync_ptr.toint() + 4)
            while seen < gdim:
                seen = ld_acquire_i32(sync_ptr.toint() + 4)
            red[0] = ld_acquire_i32(sync_ptr.toint())
            if cute.arch.atomic_add(sync_ptr + 2, Int32(1), sem="acq_rel", scope="gpu") == gdim - 1:
                counters = cute.make_tensor(sync_ptr, cute.make_layout((3,)))
                for c in cutlass.range_constexpr(3):
                    counters[c] = Int32(0)
        cute.arch.barrier()
        # g = max(amax * RN(1 / 2688), tiny): what torch computes for the reference's amax / 2688 on CUDA (a
        # division by a CPU scalar is a multiplication by its fp32 reciprocal), clamped; NaN stays NaN
        g = fmax_nan(bits_f32(red[0]) * Float32(INV_FP4_FP8_MAX), Float32(FP32_TINY))
        if bidx == 0 and tidx == 0:
            mG[0] = g

        # ---- pass 2, backwards: the blocks not held (newest in L2 first), then the held ones
        for kk in cutlass.range(iters):
            k = iters - 1 - kk
            for u in cutlass.range_constexpr(self.unroll):
                i = (k * self.unroll + u) * self.threads + tidx
                if i < held:
                    cute.autovec_copy(sX[None, None, i], rX[None, None, u])
                elif i < mine:
                    cute.autovec_copy(mX[None, None, first + i], rX[None, None, u])
            for u in cutlass.range_constexpr(self.unroll):
                i = (k * self.unroll + u) * self.threads + tidx
                rB = cute.make_rmem_tensor((8,), Int32)
                rB.store(cute.recast_tensor(rX[None, None, u], Int32).load())
                rE = cute.make_rmem_tensor((2,), cutlass.Float8E4M3FN)
                words = cute.make_rmem_tensor((2,), Int32)
                quant_block(rB, g, rE, words)
                if i < mine:
                    cute.autovec_copy(cute.recast_tensor(words, Uint32), mC[None, first + i])
                    mS[first + i] = rE[0]


class Dequant:
    """codes uint32 [nblk * 2], scales e4m3 [nblk], g fp32 [1] -> bf16 [nblk * 16]."""
    threads = 256

    @cute.jit
    def __call__(self, c_ptr: cute.Pointer, s_ptr: cute.Pointer, g_ptr: cute.Pointer, o_ptr: cute.Pointer,
                 nblk: Int32, stream):
        mC = cute.make_tensor(c_ptr, cute.make_layout((2, nblk), stride=(1, 2)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((nblk,)))
        mG = cute.make_tensor(g_ptr, cute.make_layout((1,)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((8, 2, nblk), stride=(1, 8, 16)))
        self.kernel(mC, mS, mG, mO, nblk).launch(
            grid=[cute.ceil_div(nblk, self.threads), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mC: cute.Tensor, mS: cute.Tensor, mG: cute.Tensor, mO: cute.Tensor, nblk: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        b = bidx * self.threads + tidx
        bc = cutlass.min(b, nblk - 1)
        rC = cute.make_rmem_tensor((2,), Uint32)
        cute.autovec_copy(mC[None, bc], rC)
        rCi = cute.recast_tensor(rC, Int32)
        rE = cute.make_rmem_tensor((2,), cutlass.Float8E4M3FN)
        rE[0] = mS[bc]
        rE[1] = rE[0]
        bs = rE.load().to(Float32)[0] * mG[0]
        rO = cute.make_rmem_tensor((8, 2), BFloat16)
        for e in cutlass.range_constexpr(BLOCK):
            code = (rCi[e // 8] >> (4 * (e % 8))) & 0xF
            c = code & 7
            # E2M1 magnitude as fp32 bits: 1 -> 0.5; c >= 2 -> 2^((c >> 1) - 1) * (1 + (c & 1) / 2)
            mag_bits = Int32(cutlass.select_(c < 2, c * (126 << 23), ((126 + (c >> 1)) << 23) | ((c & 1) << 22)))
            v = bits_f32(mag_bits) * bs
            v = Float32(cutlass.select_(code >= 8, -v, v))
            rO[e % 8, e // 8] = v.to(BFloat16)
        if b < nblk:
            cute.autovec_copy(rO, mO[None, None, b])


def _build_amax():
    return Amax(), (fake_ptr(BFloat16), fake_ptr(Int32, 4), Int32(1), Int32(1), Int32(1), fake_stream())


def _build_quant():
    return Quant(), (fake_ptr(BFloat16), fake_ptr(Float32, 4), fake_ptr(Uint32, 8), fake_ptr(cutlass.Float8E4M3FN, 1),
                     Int32(1), Int32(1), Int32(1), fake_stream())


def _build_quant_onepass(threads, unroll):
    args = (fake_ptr(BFloat16), fake_ptr(Uint32, 8), fake_ptr(cutlass.Float8E4M3FN, 1), fake_ptr(Float32, 4),
            fake_ptr(Int32, 4), Int32(1), Int32(1), Int32(1), fake_stream())
    return QuantOnePass(threads, unroll), args


def _build_dequant():
    return Dequant(), (fake_ptr(Uint32, 8), fake_ptr(cutlass.Float8E4M3FN, 1), fake_ptr(Float32, 4),
                       fake_ptr(BFloat16), Int32(1), fake_stream())


register(KernelDef("nvfp4_amax", "experts", BOTH, _build_amax, configs=({},),
                   doc="global |x| max (bf16 bits, atomic max), feeds the NVFP4 global scale"))
register(KernelDef("nvfp4_quant", "experts", BOTH, _build_quant, configs=({},),
                   doc="NVFP4 quantise: e4m3 scale per 16, E2M1 codes by integer code"))
register(KernelDef("nvfp4_quant_onepass", "experts", BOTH, _build_quant_onepass, configs=ONEPASS_CONFIGS,
                   doc="NVFP4 quantise with the global scale from x's own amax, x read once (grid barrier)"))
register(KernelDef("nvfp4_dequant", "experts", BOTH, _build_dequant, configs=({},),
                   doc="NVFP4 dequantise to bf16"))


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------

def global_scale(amax):
    """g = amax / (6 * 448), clamped to fp32 tiny: the very expression of the reference (sim.nvfp4_act_quant)."""
    import torch
    return (amax / (6 * 448)).clamp(min=torch.finfo(torch.float32).tiny)


def amax(x):
    """max |x| over a bf16 tensor, as an fp32 [1] tensor (kernel; NaN propagates)."""
    import torch
    x = x.contiguous()
    if x.dtype != torch.bfloat16 or x.numel() % 8:
        raise ValueError("nvfp4 amax takes bf16 tensors with a multiple of 8 elements")
    check_numel(x)
    bits = torch.zeros(1, dtype=torch.int32, device=x.device)
    nvec = x.numel() // 8
    if nvec:
        threads, unroll = Amax.threads, Amax.unroll
        sms = sm_count(x.device)
        grid = max(1, min(sms * 8, -(-nvec // (threads * unroll))))
        iters = -(-nvec // (grid * threads * unroll))
        fn = compile_kernel("nvfp4_amax", device_arch(x.device))
        fn(ptr(x), ptr(bits, Int32, 4), Int32(nvec), Int32(grid), Int32(iters), current_stream())
    return bits.view(torch.float32)


def quantize(x, g=None, onepass=None):
    """x [..., n] bf16 (n % 16 == 0) -> (codes uint8 [..., n/2], scales float8_e4m3fn [..., n/16], g fp32 [1]).

    g: the global decode scale; default: from the tensor's amax as the reference does, in one launch
    (nvfp4_quant_onepass, CTA shape `onepass`, one of ONEPASS_CONFIGS, default the first);
    `quantize(x, global_scale(amax(x)))` gives the same bits in two.
    """
    import torch
    x = x.contiguous()
    if x.dtype != torch.bfloat16 or x.size(-1) % BLOCK:
        raise ValueError(f"nvfp4 quantize takes bf16 with a last dim multiple of {BLOCK}")
    check_numel(x)
    codes = torch.empty(*x.shape[:-1], x.size(-1) // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*x.shape[:-1], x.size(-1) // BLOCK, dtype=torch.float8_e4m3fn, device=x.device)
    nblk = x.numel() // BLOCK
    if g is None and nblk:
        cfg = onepass or ONEPASS_CONFIGS[0]
        if cfg not in ONEPASS_CONFIGS:
            raise ValueError(f"nvfp4 quantize: onepass={cfg} is not one of the compiled CTA shapes {ONEPASS_CONFIGS}")
        g = torch.empty(1, dtype=torch.float32, device=x.device)
        grid = max(1, min(sm_count(x.device), -(-nblk // cfg["threads"])))
        chunk = -(-nblk // grid)
        fn = compile_kernel("nvfp4_quant_onepass", device_arch(x.device), **cfg)
        fn(ptr(x), ptr(codes, Uint32, 8), ptr(scales, cutlass.Float8E4M3FN, 1), ptr(g, Float32, 4),
           ptr(scratch("nvfp4_sync", x.device, 4, torch.int32), Int32, 4), Int32(nblk), Int32(chunk), Int32(grid),
           current_stream())
        return codes, scales, g
    if g is None:
        g = global_scale(amax(x))
    g = g.to(device=x.device, dtype=torch.float32).reshape(1).contiguous()
    if nblk:
        grid = max(1, min(sm_count(x.device) * QUANT_CTAS_PER_SM, -(-nblk // Quant.threads)))
        iters = -(-nblk // (grid * Quant.threads))
        fn = compile_kernel("nvfp4_quant", device_arch(x.device))
        fn(ptr(x), ptr(g, Float32, 4), ptr(codes, Uint32, 8), ptr(scales, cutlass.Float8E4M3FN, 1), Int32(nblk),
           Int32(grid), Int32(iters), current_stream())
    return codes, scales, g


def dequantize(codes, scales, g, out=None):
    """Inverse of quantize: -> bf16 [..., 2 * codes.size(-1)]."""
    import torch
    codes, scales = codes.contiguous(), scales.contiguous()
    n = codes.size(-1) * 2
    out = torch.empty(*codes.shape[:-1], n, dtype=torch.bfloat16, device=codes.device) if out is None else out
    nblk = out.numel() // BLOCK
    if scales.numel() != nblk:
        raise ValueError(f"nvfp4 dequantize: {scales.numel()} scales for {nblk} blocks")
    check_numel(out)
    if nblk:
        fn = compile_kernel("nvfp4_dequant", device_arch(codes.device))
        g = g.to(device=codes.device, dtype=torch.float32).reshape(1).contiguous()
        fn(ptr(codes, Uint32, 8), ptr(scales, cutlass.Float8E4M3FN, 1), ptr(g, Float32, 4), ptr(out), Int32(nblk),
           current_stream())
    return out


def act_quant(x):
    """The NVFP4 round trip on the kernels (same values as dsv4debug.backends.sim.nvfp4_act_quant)."""
    return dequantize(*quantize(x))


# --------------------------------------------------------------------------------------------------------
# Bit-level torch reference (any device): codes and scales, not only values
# --------------------------------------------------------------------------------------------------------

def reference_quantize(x, g=None):
    """Pure-torch NVFP4 quantiser producing the same (codes, scales, g) as `quantize`, bit for bit.

    Its values, reference_dequantize(*reference_quantize(x)), equal dsv4debug.backends.sim.nvfp4_act_quant(x).
    """
    import torch
    xf = x.float()
    if g is None:
        g = global_scale(xf.abs().amax())
    g = g.reshape(()).float()
    xb = xf.unflatten(-1, (-1, BLOCK))
    e = (xb.abs().amax(-1) / (6 * g)).to(torch.float8_e4m3fn)
    bs = e.float().unsqueeze(-1) * g
    a = (xb.abs() / torch.where(bs > 0, bs, 1.0))
    code = sum(((a >= th) if inclusive else (a > th)).to(torch.uint8) for th, inclusive in E2M1_THRESHOLDS)
    code = code | (torch.signbit(xb).to(torch.uint8) << 3)
    code = code.flatten(-2)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, e, g.reshape(1)


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def reference_dequantize(codes, scales, g):
    import torch
    lut = torch.tensor(_E2M1, device=codes.device)
    c = torch.stack([codes & 0xF, codes >> 4], -1).flatten(-2).long()          # [..., n]
    mag = lut[c & 7]
    val = torch.where(c >= 8, -mag, mag).unflatten(-1, (-1, BLOCK))
    bs = scales.float().unsqueeze(-1) * g.reshape(()).float()
    return (val * bs).flatten(-2).to(torch.bfloat16)
