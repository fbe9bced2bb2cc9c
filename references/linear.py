"""Linear layers on dequantised weights (the BF16 reference of fp8_gemm / fp4_gemm / F.linear)."""
import torch
import torch.nn.functional as F

from .precision import acc


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w[out, in]^T in x's dtype (bf16 GEMMs accumulate in fp32 internally)."""
    return F.linear(x, w.to(x.dtype))


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Projections DeepSeek runs in fp32 (compressor, gate, head): fp32 (or fp64) result."""
    xf = x.to(acc(x))
    return F.linear(xf, w.to(xf.dtype))


def grouped_linear(o: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    """wo_a: o [S, H, d] split into `groups` groups of heads; w [G*R, H*d/G] -> [S, G*R]."""
    S = o.size(0)
    og = o.reshape(S, groups, -1)                                          # [S, G, H*d/G]
    wg = w.to(o.dtype).view(groups, -1, og.size(-1))                       # [G, R, H*d/G]
    return torch.einsum("sgd,grd->sgr", og, wg).flatten(1)                 # [S, G*R]
