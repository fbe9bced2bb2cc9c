"""RMSNorm (weighted) and the unweighted per-head query norm."""
import torch

from .precision import acc


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n], weight [n]: fp32 math, result in x's dtype (DeepSeek's RMSNorm)."""
    xf = x.to(acc(x))
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.to(xf.dtype) * y).to(x.dtype)


def head_rms_norm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """q [S, H, d]: per-head RMS norm without weight, computed in q's dtype as DeepSeek's Attention does."""
    return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
