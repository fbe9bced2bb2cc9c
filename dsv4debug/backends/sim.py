"""The `sim` backend: the reference with the serving pipeline's quantisation, in plain PyTorch.

It shows how much divergence quantisation alone explains, on any machine:
- FP8 activations (e4m3, power-of-two scale per 1x128) before every GEMM on FP8 weights (DeepSeek's act_quant);
- NVFP4 activations (e2m1, e4m3 scale per 16 under an fp32 global scale) before routed-expert GEMMs, as a
  W4A4 Blackwell MoE does;
- the FP8 KV cache (448 nope dims e4m3 with power-of-two scales per 64, rope dims bf16), always on.
`sim-w4a16` is the same with bf16 activations into FP4 experts, as the Hopper kernels (W4A16) run them.
"""
from __future__ import annotations

import dsv4_references as ref
import torch
from dsv4_references.quant import e2m1_round

from .reference import ReferenceBackend

QUANTIZED_WEIGHTS = ("fp8", "mxfp4", "nvfp4")


def fp8_act_quant(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Round to e4m3 with a power-of-two (ue8m0) scale per 1 x `block` (values, not codes)."""
    return ref.fp8_sim(x, block)


def nvfp4_act_quant(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """NVFP4 round trip: global scale amax/(6*448), e4m3 block scale per 16, e2m1 values."""
    xf = x.float()
    g = (xf.abs().amax() / (6 * 448)).clamp(min=torch.finfo(torch.float32).tiny)
    xb = xf.unflatten(-1, (-1, block))
    bs = (xb.abs().amax(-1, keepdim=True) / (6 * g)).to(torch.float8_e4m3fn).float() * g
    q = e2m1_round(xb / torch.where(bs > 0, bs, 1.0)) * bs
    return q.flatten(-2).to(x.dtype)


class SimBackend(ReferenceBackend):
    name = "sim"
    numerics = "quantized"
    simulator = "sim"
    fp4_expert_act_quant = True

    def linear(self, x, w):
        return super().linear(fp8_act_quant(x) if w.fmt in QUANTIZED_WEIGHTS else x, w)

    def expert(self, x, w1, w3, w2, route_w, *, limit):
        if w1.fmt in ("mxfp4", "nvfp4"):
            quant = nvfp4_act_quant if self.fp4_expert_act_quant else None
        else:
            quant = fp8_act_quant
        dt = x.dtype
        return ref.expert(x, *self.dense_all((w1, w3, w2), dt), limit, route_w, quant)

    def kv_cache(self, kv, *, rope_dim, qat):
        return ref.kv_qat(kv, rope_dim, enabled=True)       # the serving cache is FP8 whatever the QAT switch


class SimW4A16Backend(SimBackend):
    name = "sim-w4a16"
    simulator = "sim-w4a16"
    fp4_expert_act_quant = False
