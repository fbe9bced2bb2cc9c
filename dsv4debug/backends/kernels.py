"""The `kernels` backend: DeepSeek-V4 ops on our CuTeDSL kernels (kernels/, imported as dsv4_kernels).

It implements an op only where a kernel exists and never falls back to PyTorch silently: the runner
refuses to start while any op of the flow is missing, naming them, unless the user delegates those op
families to the reference explicitly (`--reference-ops`), which the report then states.

Implemented (kernels/ module): rms_norm, head_rms_norm (norm); rope (rope); kv_cache (kv_cache: the
serving round trip quantise -> paged write -> paged read -> dequantise); hc_pre, hc_post, hc_head (mhc).
Where an op chains a kernel with torch, it is said here: hc_pre/hc_head allocate outputs and upcast the
small fp32 parameters with torch; kv_cache builds the block table and slot mapping with torch. Not
implemented: embed, linear, grouped_linear, logits, compressor, indexer_*, sparse_attn, gate, expert,
moe_combine. The kernels take bf16 activations (the serving dtype): the fp32/fp64 twins stay on the reference.
"""
from __future__ import annotations

import torch

from ..errors import BadInput
from .base import Backend


def _load_kernels():
    try:
        import dsv4_kernels
        dsv4_kernels.load_all()
        from dsv4_kernels import kv_cache, mhc, norm, rope
    except ImportError as e:            # CuTeDSL missing
        raise BadInput(f"the kernels backend needs CuTeDSL (pip install 'dsv4debug[gpu]'): {e}") from None
    return norm, rope, kv_cache, mhc


class KernelsBackend(Backend):
    name = "kernels"
    numerics = "quantized"
    kv_block_size = 64

    def __init__(self, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16):
        super().__init__(device, dtype)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise BadInput("the kernels backend runs CuTeDSL kernels on a CUDA GPU: pass --device cuda on a "
                           "machine with one (this one has " + ("no GPU)" if not torch.cuda.is_available()
                                                                 else f"--device {self.device})"))
        if dtype != torch.bfloat16:
            raise BadInput(f"the kernels backend runs bf16 activations, not {dtype}")
        self._norm, self._rope, self._kv, self._mhc = _load_kernels()
        self._gen = torch.Generator().manual_seed(0)     # block order of the paged KV round trip

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

    # ---- mHC
    def hc_pre(self, x, fn, scale, base, *, iters, norm_eps, hc_eps):
        return self._mhc.hc_pre(self._bf16(x, "hc_pre"), self.param(fn), self.param(scale), self.param(base),
                                iters, norm_eps, hc_eps)

    def hc_post(self, a, residual, post, comb):
        return self._mhc.hc_post(self._bf16(a, "hc_post"), residual, post, comb)

    def hc_head(self, x, fn, scale, base, *, norm_eps, hc_eps):
        return self._mhc.hc_head(self._bf16(x, "hc_head"), self.param(fn), self.param(scale), self.param(base),
                                 norm_eps, hc_eps)
