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
register(KernelDef("hc_pre_apply", "mhc", BOTH, _build_apply,
                   configs=({"D": 7168, "M": 4, "iters": 20}, {"D": 4096, "M": 4, "iters": 20},
                            {"D": 7168, "M": 4, "iters": 0, "head": True}, {"D": 4096, "M": 4, "iters": 0, "head": True}),
                   doc="mHC pre: sigmoid, softmax + Sinkhorn (shuffles), weighted stream sum (and hc_head)"))
register(KernelDef("hc_post", "mhc", BOTH, _build_post, configs=({"D": 7168, "M": 4}, {"D": 4096, "M": 4}),
                   doc="mHC post: post * a + comb^T . residual"))


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------

def hc_mixes(x, fn, eps: float):
    """x [S, M, D] bf16, fn [(2+M)M, M*D] -> mixes fp32 [S, (2+M)M]."""
    import torch
    x = x.contiguous()
    S = x.size(0)
    K = x[0].numel()
    fn = fn.to(device=x.device, dtype=torch.float32).contiguous()
    nmix = fn.size(0)
    out = torch.empty(S, nmix, dtype=torch.float32, device=x.device)
    check_numel(x)
    if S:
        f = compile_kernel("hc_mix", device_arch(x.device), K=K, nmix=nmix)
        f(ptr(x), ptr(fn), ptr(out, Float32, 4), Int32(S), Float32(eps), current_stream())
    return out


def hc_pre(x, fn, scale, base, iters: int, norm_eps: float, hc_eps: float):
    """x [S, M, D] bf16 streams -> (y [S, D] bf16, post [S, M] fp32, comb [S, M, M] fp32)."""
    import torch
    if x.dtype != torch.bfloat16 or x.dim() != 3:
        raise ValueError("hc_pre kernel takes x [S, M, D] bf16")
    x = x.contiguous()
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


def hc_head(x, fn, scale, base, norm_eps: float, hc_eps: float):
    """ParallelHead.hc_head: x [S, M, D] bf16 -> [S, D] bf16 (sigmoid-weighted stream sum, no Sinkhorn)."""
    import torch
    if x.dtype != torch.bfloat16 or x.dim() != 3:
        raise ValueError("hc_head kernel takes x [S, M, D] bf16")
    x = x.contiguous()
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
