"""QAT simulations that live inside DeepSeek-V4's model.py (they change values, so the reference keeps them).

fp8_sim ~ act_quant(x, 64, "ue8m0", inplace) after the 2026-06-08 kernel fix; fp4_sim ~ fp4_act_quant(x, 32);
rotate_activation ~ fast_hadamard_transform with scale n**-0.5 (Sylvester order).
"""
import functools
import math

import torch
import torch.nn.functional as F

from .precision import acc

FP8_MAX = 448.0
FP4_MAX = 6.0


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (ue8m0 scales)."""
    return torch.exp2(torch.ceil(torch.log2(amax / qmax)))


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (sign kept), ties to the even code."""
    a = v.abs().clamp(max=FP4_MAX)
    # grid spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; torch.round is half-to-even on each sub-grid,
    # which is round-half-to-even on the E2M1 code
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q, v)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.to(acc(x)).unflatten(-1, (-1, block))                     # [..., n/block, block]


def fp8_sim(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Round x to e4m3 with a power-of-two scale per `block` contiguous elements of the last dim."""
    xb = _blocks(x, block)
    s = pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=1e-4), FP8_MAX)
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(xb.dtype)
    return (q * s).flatten(-2).to(x.dtype)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round x to e2m1 with a power-of-two scale per `block` contiguous elements of the last dim."""
    xb = _blocks(x, block)
    s = pow2_scale(xb.abs().amax(-1, keepdim=True).clamp(min=FP4_MAX * 2.0 ** -126), FP4_MAX)
    return (e2m1_round(xb / s) * s).flatten(-2).to(x.dtype)


@functools.lru_cache(maxsize=8)
def _hadamard(n: int) -> torch.Tensor:
    assert n & (n - 1) == 0, f"Hadamard size {n} must be a power of two"
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(int(math.log2(n))):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)   # Sylvester order
    return h


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """Hadamard transform of the last dim, scaled by n**-0.5 (orthonormal)."""
    n = x.size(-1)
    h = _hadamard(n).to(device=x.device, dtype=acc(x))
    return (F.linear(x.to(acc(x)), h) * n ** -0.5).to(x.dtype)
