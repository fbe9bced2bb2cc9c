"""Rotary embedding: interleaved pairs on the last 64 dims, YaRN for compressed layers, and its inverse."""
import math

import torch

from .precision import complex_of


def _correction_dim(rotations: float, dim: int, base: float, max_seq_len: int) -> float:
    return dim * math.log(max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_range(beta_fast: float, beta_slow: float, dim: int, base: float, max_seq_len: int) -> tuple[int, int]:
    low = math.floor(_correction_dim(beta_fast, dim, base, max_seq_len))
    high = math.ceil(_correction_dim(beta_slow, dim, base, max_seq_len))
    return max(low, 0), min(high, dim - 1)


def rope_freqs(seqlen: int, dim: int, theta: float, original_seq_len: int = 0, factor: float = 1.0,
               beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """freqs_cis [seqlen, dim/2] complex64, in fp32 as DeepSeek's precompute_freqs_cis.

    original_seq_len == 0 disables YaRN (pure sliding-window layers).
    """
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))      # [dim/2]
    if original_seq_len > 0:
        low, high = yarn_range(beta_fast, beta_slow, dim, theta, original_seq_len)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        smooth = 1 - ramp.clamp(0, 1)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float32), freqs)               # [S, dim/2]
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*freqs.size(-1) dims of x in interleaved pairs.

    x [S, ..., d]; freqs [S, r/2] complex, broadcast over the middle dims. Returns a new tensor.
    """
    r = 2 * freqs.size(-1)
    f = freqs.to(device=x.device, dtype=complex_of(x))
    f = f.conj() if inverse else f
    f = f.view(f.size(0), *([1] * (x.dim() - 2)), f.size(-1))                           # [S, 1.., r/2]
    xr = torch.view_as_complex(x[..., -r:].to(f.real.dtype).unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(xr * f).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-r], rotated], -1)
