"""The `kernels` backend: DeepSeek-V4 ops on our CuTeDSL kernels (kernels/, imported as dsv4_kernels).

It declares the ops it has a kernel for (`implements`, from KERNEL_MODULES) and declines the calls of those
its kernels do not cover (`unsupported`: bf16-weight linears); the runner runs everything else with the
reference op and names it in the report ("ops without a kernel (run by the reference)", `delegated_ops`), so
nothing falls back silently.

Implemented (kernels/ module): rms_norm, head_rms_norm (norm); rope (rope); kv_cache (kv_cache: the
serving round trip quantise -> paged write -> paged read -> dequantise); hc_pre, hc_post, hc_head (mhc).
Where an op chains a kernel with torch, it is said here: hc_pre/hc_head allocate outputs and upcast the
small fp32 parameters with torch; kv_cache builds the block table and slot mapping with torch.
linear (gemm_fp8, gemm_w4a16): FP8 weights -> per-1x128 FP8 activations (one quantisation for consecutive
linears of one x: wq_a and wkv, the shared expert's w1 and w3) and the block-scaled WGMMA GEMM;
NVFP4/MXFP4 weights -> W4A16 (weights packed once per stage by kernels/w4_pack); bf16 weights (the indexer's
weights_proj) have no kernel (declined: run by the reference). expert: NVFP4/MXFP4 experts (packed per call,
not kept for the stage) -> fused w1|w3 W4A16 GEMM with the SwiGLU/clamp/routing-weight epilogue, then w2;
FP8 experts (the shared expert) -> three FP8 linears with the SwiGLU in torch (said here).
sparse_attn (sparse_attn): the joint KV paged into two FP8 caches (window rows, compressed rows) by kv_cache's
write kernel, the index list translated to cache slots with torch, then the WGMMA attention kernel.
indexer_q (compressor module: rope, Hadamard, FP4 sim in one kernel); indexer_scores, indexer_topk (indexer):
WGMMA scores with the reference's bf16 rounding points (the weight scale is one bf16 torch multiply, heads
zero-padded to 64); radix-select top-k, ids in index order (the runner compares index sites as sets).
compressor (compressor): the kv and gate projections as one bf16 x bf16 -> fp32 WGMMA GEMM (torch fp32 matmul
where the weights are not bf16-valued or the shape does not fit), then one kernel for the pooling (ratio-4
overlapping / ratio-128), RMSNorm, RoPE and the FP8 or Hadamard + FP4 QAT.
grouped_linear (wo_a; compressor module's bf16 x bf16 -> fp32 WGMMA GEMM, one launch per head group on the
dequantised weight, which FP8 values are exactly in bf16; the groups' activations are made contiguous with
torch; shapes the GEMM's tiles do not fit are declined). logits (the same GEMM: bf16 head weights, fp32
out, as DeepSeek's fp32 head on bf16 operands; other head formats are declined). Not implemented: embed,
gate, moe_combine.
The kernels take bf16 activations (the serving dtype): the fp32/fp64 twins stay on the reference.
"""
from __future__ import annotations

import torch

from ..errors import BadInput
from .base import Backend

# op -> the kernels/ module that implements it: the site table's one hop from a site to its kernel
KERNEL_MODULES = {
    "rms_norm": "dsv4_kernels.norm", "head_rms_norm": "dsv4_kernels.norm", "rope": "dsv4_kernels.rope",
    "kv_cache": "dsv4_kernels.kv_cache", "hc_pre": "dsv4_kernels.mhc", "hc_post": "dsv4_kernels.mhc",
    "hc_head": "dsv4_kernels.mhc", "linear": "dsv4_kernels.gemm_fp8 | dsv4_kernels.gemm_w4a16",
    "expert": "dsv4_kernels.gemm_w4a16 (+ gemm_fp8 for the shared expert)",
    "sparse_attn": "dsv4_kernels.sparse_attn (+ kv_cache write)",
    "indexer_scores": "dsv4_kernels.indexer", "indexer_topk": "dsv4_kernels.indexer",
    "compressor": "dsv4_kernels.compressor", "indexer_q": "dsv4_kernels.compressor",
    "grouped_linear": "dsv4_kernels.compressor (bf16_gemm_f32, one launch per group)",
    "logits": "dsv4_kernels.compressor (bf16_gemm_f32)",
}


def _gemm_tiles(n: int, k: int) -> str | None:
    """Why bf16_gemm_f32's tiles do not fit an [n, k] weight (None: they do)."""
    if n % 128 or k % 64:
        return f"a {n} x {k} weight (bf16_gemm_f32's tiles need rows % 128 and columns % 64)"
    return None


def _load_kernels():
    try:
        import dsv4_kernels
        dsv4_kernels.load_all()
        from dsv4_kernels import kv_cache, mhc, norm, rope
    except ImportError as e:            # CuTeDSL missing
        raise BadInput(f"the kernels backend needs CuTeDSL (pip install 'dsv4debug[gpu]'): {e}") from None
    return norm, rope, kv_cache, mhc


def _load_gemm_kernels():
    try:
        from dsv4_kernels import gemm_fp8, gemm_w4a16, moe, w4_pack
    except ImportError as e:            # CuTeDSL missing
        raise BadInput(f"the kernels backend needs CuTeDSL (pip install 'dsv4debug[gpu]'): {e}") from None
    return {"fp8": gemm_fp8, "w4": gemm_w4a16, "moe": moe, "pack": w4_pack}


def _check_arch(device: torch.device) -> None:
    """Refuse, before any launch, a GPU some of the pipeline's kernels are not built for (WGMMA GEMMs and
    attention: Hopper only), instead of failing at the first such kernel mid-run."""
    from dsv4_kernels._common import gpu_name, kernel_arch, runnable_archs
    runnable = runnable_archs()
    if kernel_arch(device) not in runnable:
        raise BadInput(f"the kernels backend's pipeline is built for {', '.join(sorted(runnable))}; this GPU is "
                       f"{gpu_name(device)}. Run another candidate (sim, sim-w4a16, a plugin) or that GPU")


class KernelsBackend(Backend):
    name = "kernels"
    numerics = "quantized"
    simulator = "sim-w4a16"         # FP8 activations into FP8 GEMMs, bf16 into the W4A16 experts, FP8 KV cache
    implements = tuple(KERNEL_MODULES)
    kv_block_size = 64
    QUANTIZED_KEPT = 2              # activations whose FP8 quantisation is kept (_act_quant)

    def __init__(self, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16):
        super().__init__(device, dtype)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise BadInput("the kernels backend runs CuTeDSL kernels on a CUDA GPU: pass --device cuda on a "
                           "machine with one (this one has " + ("no GPU)" if not torch.cuda.is_available()
                                                                 else f"--device {self.device})"))
        if dtype != torch.bfloat16:
            raise BadInput(f"the kernels backend runs bf16 activations, not {dtype}")
        self._norm, self._rope, self._kv, self._mhc = _load_kernels()
        self._gemm = _load_gemm_kernels()
        _check_arch(self.device)
        self._packs: dict[tuple, object] = {}           # packed weights per QWeight, dropped at end_stage
        self._quantized: list[tuple] = []               # (x, its version, fp8_act_quant(x)), newest first
        self._gen = torch.Generator().manual_seed(0)     # block order of the paged KV round trip

    def unsupported(self, op: str, args: tuple) -> str | None:
        x, w = args[0], args[1] if len(args) > 1 else None
        if op in ("linear", "expert") and w.fmt not in ("fp8", "nvfp4", "mxfp4"):
            return f"{w.fmt} weights"
        if op == "logits":
            return f"{w.fmt} head weights" if w.fmt != "bf16_plain" else _gemm_tiles(*w.shape)
        if op == "grouped_linear":                          # w [G*R, H*d/G], x [S, H, d]: tiles per group
            rows, cols = w.shape
            return _gemm_tiles(rows * cols // (x.shape[1] * x.shape[2]), cols)
        return None

    @staticmethod
    def _bf16(x: torch.Tensor, op: str) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise BadInput(f"kernels backend op {op}: got {x.dtype} activations, the kernels take bf16")
        return x

    # ---- norm
    def rms_norm(self, x, w, *, eps):
        return self._norm.rms_norm(self._bf16(x, "rms_norm"), self.param(w), eps)

    def head_rms_norm(self, q, *, eps):
        return self._norm.head_rms_norm(self._bf16(q, "head_rms_norm"), eps)

    # ---- rope
    def rope(self, x, freqs, *, inverse=False):
        return self._rope.rope(self._bf16(x, "rope"), freqs, inverse)

    # ---- FP8 KV cache: the serving round trip (the cache is FP8 whatever the QAT switch, as in `sim`)
    def kv_cache(self, kv, *, rope_dim, qat):
        out, _, _ = self._kv.round_trip(self._bf16(kv, "kv_cache"), rope_dim, self.kv_block_size, self._gen)
        return out

    # ---- sparse attention over the FP8 paged caches (kernels/sparse_attn.py)
    def sparse_attn(self, q, kv, sink, idx, *, scale):
        from dsv4_kernels import sparse_attn as sa
        return sa.sparse_attn_paged(self._bf16(q, "sparse_attn"), self._bf16(kv, "sparse_attn"), self.param(sink),
                                    idx, scale, block_size=self.kv_block_size, generator=self._gen)

    # ---- compressor (kernels/compressor.py): projections GEMM kernel, pooling/norm/rope/QAT kernel
    def compressor(self, x, wkv, wgate, ape, norm, freqs, *, ratio, rope_dim, eps, rotate, qat):
        from dsv4_kernels import compressor
        if rope_dim != 64:
            raise BadInput(f"kernels backend op compressor: the kernel rotates 64 rope dims, not {rope_dim}")
        return compressor.compress_op(self._bf16(x, "compressor"), self.param(wkv), self.param(wgate),
                                      self.param(ape), self.param(norm), freqs, ratio, rope_dim, eps, rotate, qat)

    # ---- wo_a: one bf16 GEMM per head group (kernels/compressor.py's bf16_gemm_f32)
    def grouped_linear(self, o, w, *, groups):
        from dsv4_kernels import compressor
        o = self._bf16(o, "grouped_linear")
        S = o.size(0)
        og = o.reshape(S, groups, -1).transpose(0, 1).contiguous()              # [G, S, H*d/G]
        wg = self.dense(w, torch.bfloat16).view(groups, -1, og.size(-1))        # [G, R, H*d/G]
        z = torch.stack([compressor.bf16_gemm_f32(og[g], wg[g]) for g in range(groups)], dim=1)   # [S, G, R]
        return z.flatten(1).to(torch.bfloat16)                                  # [S, G*R]

    # ---- head: x bf16 [S, D] @ head bf16 [V, D]^T -> fp32 logits [S, V]
    def logits(self, x, w):
        from dsv4_kernels import compressor
        return compressor.bf16_gemm_f32(self._bf16(x, "logits"), self.dense(w, torch.bfloat16))

    # ---- lightning indexer (kernels/indexer.py); weights * weight_scale is one bf16 torch multiply
    def indexer_scores(self, q, k, weights, *, ratio, weight_scale):
        from dsv4_kernels import indexer
        return indexer.scores_op(self._bf16(q, "indexer_scores"), k, weights, ratio, weight_scale)

    def indexer_q(self, q, freqs, *, qat):
        from dsv4_kernels import compressor
        return compressor.indexer_q(self._bf16(q, "indexer_q"), freqs, qat)

    def indexer_topk(self, scores, *, k):
        from dsv4_kernels import indexer
        return indexer.indexer_topk(self._bf16(scores, "indexer_topk"), k)

    # ---- mHC
    def hc_pre(self, x, fn, scale, base, *, iters, norm_eps, hc_eps):
        return self._mhc.hc_pre(self._bf16(x, "hc_pre"), self.param(fn), self.param(scale), self.param(base),
                                iters, norm_eps, hc_eps)

    def hc_post(self, a, residual, post, comb):
        return self._mhc.hc_post(self._bf16(a, "hc_post"), residual, post, comb)

    def hc_head(self, x, fn, scale, base, *, norm_eps, hc_eps):
        return self._mhc.hc_head(self._bf16(x, "hc_head"), self.param(fn), self.param(scale), self.param(base),
                                 norm_eps, hc_eps)

    # ---- GEMMs (kernels/gemm_fp8.py, kernels/gemm_w4a16.py)
    def end_stage(self) -> None:
        super().end_stage()
        self._packs.clear()
        self._quantized = []

    def _packed(self, kind: str, *ws, keep: bool = True):
        """The kernel layout of weights ws, cached until end_stage unless not `keep` (experts: a Pro layer's 384
        packed experts next to the stored ones held 2.08x a layer's weights on the H200; the reference does not
        cache its dequantised experts either)."""
        key = (kind,) + tuple(id(w) for w in ws)
        p = self._packs.get(key)
        if p is None:
            dev = self.device
            if kind == "fp8":
                (w,) = ws
                p = (w.tensors["weight"].to(dev).contiguous(), self._gemm["fp8"].weight_scales(w.tensors["scale"].to(dev)))
            elif kind == "w4":
                (w,) = ws
                t = {k: v.to(dev) for k, v in w.tensors.items()}
                if w.fmt == "mxfp4":
                    from ..formats import mxfp4_to_nvfp4
                    nv, _, lossy = mxfp4_to_nvfp4(t["weight"], t["scale"])
                    if lossy:
                        raise BadInput(f"{w.name}: the MXFP4 -> NVFP4 cast is lossy for {lossy} blocks")
                    p = self._gemm["pack"].pack_nvfp4(*nv, check_scales=False)     # the cast's own scales
                else:
                    p = self._gemm["pack"].pack_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])
            else:                                       # "expert": fused w1|w3 and w2 of one expert
                moved = [type(w)(w.name, w.fmt, {k: v.to(dev) for k, v in w.tensors.items()}) for w in ws]
                try:
                    p = self._gemm["moe"].pack_expert(*moved)
                except ValueError as e:
                    raise BadInput(str(e)) from None
            if keep:
                self._packs[key] = p
        return p

    def linear(self, x, w):
        x = self._bf16(x, "linear")
        if w.fmt == "fp8":
            q, sb = self._packed("fp8", w)
            xq, sa = self._act_quant(x)
            return self._gemm["fp8"].fp8_gemm(xq, sa, q, sb).view(*x.shape[:-1], q.shape[0])
        if w.fmt in ("nvfp4", "mxfp4"):
            return self._gemm["w4"].w4a16_linear(x, self._packed("w4", w), w.shape[0])
        raise BadInput(f"kernels backend op linear: no kernel for {w.fmt} weights ({w.name}); the runner "
                       "declines such calls (unsupported) and runs them with the reference op")

    def _act_quant(self, x):
        """x's FP8 activations (fp8_act_quant), kept for later linears of the same unchanged x: wq_a and wkv read
        one normed x (wq_b's comes between them), as do the shared expert's w1 and w3, and serving quantises it
        once (wkv's quantiser alone takes 0.75 of cuBLAS' time for its whole GEMM at M = 2048)."""
        for held, version, quantized in self._quantized:
            if held is x and version == x._version:
                return quantized
        quantized = self._gemm["fp8"].fp8_act_quant(x.reshape(-1, x.shape[-1]).contiguous())
        self._quantized = [(x, x._version, quantized)] + self._quantized[:self.QUANTIZED_KEPT - 1]
        return quantized

    def expert(self, x, w1, w3, w2, route_w, *, limit):
        x = self._bf16(x, "expert")
        if w1.fmt in ("nvfp4", "mxfp4"):
            p13, p2 = self._packed("expert", w1, w3, w2, keep=False)
            W4 = self._gemm["w4"]
            xc = x.contiguous()
            n13 = p13[0].shape[1] * 64
            rw = (route_w if route_w is not None else torch.ones(xc.shape[0], device=x.device)).float().contiguous()
            h = W4.w4a16_launch(xc, p13, n13, route_w=rw, lim=limit, epilogue="swiglu",
                                **W4.pick_swiglu_config(xc.shape[0], n13, xc.shape[1]))
            return W4.w4a16_linear(h, p2, p2[0].shape[1] * 64)
        if w1.fmt == "fp8":
            # three FP8 linears; the SwiGLU between them is torch (as dsv4_references.moe.expert computes it)
            g = self.linear(x, w1).float()
            u = self.linear(x, w3).float()
            if limit > 0:
                u = u.clamp(-limit, limit)
                g = g.clamp(max=limit)
            h = torch.nn.functional.silu(g) * u
            if route_w is not None:
                h = route_w.float().unsqueeze(-1) * h
            return self.linear(h.to(x.dtype), w2)
        raise BadInput(f"kernels backend op expert: no kernel for {w1.fmt} expert weights ({w1.name})")
