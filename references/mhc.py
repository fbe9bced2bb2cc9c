"""mHC: manifold-constrained hyper-connections (Block.hc_pre / hc_post, split_sinkhorn, ParallelHead.hc_head)."""
import torch
import torch.nn.functional as F

from .precision import acc


def _mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """x [S, M, D] -> RMS over all M*D features times the mixing projection: [S, n_mix]."""
    xf = x.flatten(-2).to(acc(x))                                          # [S, M*D]
    rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return F.linear(xf, fn.to(xf.dtype)) * rs


def split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, m: int,
                   iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [S, (2+m)*m] -> pre [S, m], post [S, m], comb [S, m, m] (doubly stochastic)."""
    scale, base = scale.to(mixes.dtype), base.to(mixes.dtype)
    pre = torch.sigmoid(mixes[..., :m] * scale[0] + base[:m]) + eps
    post = 2 * torch.sigmoid(mixes[..., m:2 * m] * scale[1] + base[m:2 * m])
    comb = (mixes[..., 2 * m:] * scale[2] + base[2 * m:]).unflatten(-1, (m, m))   # comb[j, k]
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)                   # rows
        comb = comb / (comb.sum(-2, keepdim=True) + eps)                   # columns
    return pre, post, comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           iters: int, norm_eps: float, hc_eps: float):
    """x [S, M, D] streams -> y [S, D] sublayer input, post [S, M], comb [S, M, M]."""
    return hc_pre_apply(x, _mixes(x, fn, norm_eps), scale, base, iters, hc_eps)


def hc_pre_apply(x: torch.Tensor, mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                 iters: int, hc_eps: float):
    """hc_pre after the projection: x [S, M, D], mixes [S, (2+M)*M] -> y [S, D], post [S, M], comb [S, M, M]."""
    pre, post, comb = split_sinkhorn(mixes, scale, base, x.size(-2), iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.to(pre.dtype)).sum(-2)                       # [S, D] in fp32
    return y.to(x.dtype), post, comb


def hc_post(a: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """a [S, D] sublayer output, residual [S, M, D] -> new streams [S, M, D].

    out_k = post_k * a + sum_j comb[j, k] * residual_j  (comb consumed transposed, as in DeepSeek's code),
    summed j by j: DeepSeek's one broadcast product [S, M, M, D] would be 3.8 GB in the fp64 floor run at 4096 tokens
    """
    mixed = sum(comb[..., j, :, None] * residual[..., j, None, :] for j in range(residual.size(-2)))   # [S, M, D]
    return (post.unsqueeze(-1) * a.unsqueeze(-2) + mixed).to(a.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """x [S, M, D] -> [S, D]: sigmoid-weighted sum of the streams (no Sinkhorn)."""
    mixes = _mixes(x, fn, norm_eps)                                        # [S, M]
    pre = torch.sigmoid(mixes * scale.to(mixes.dtype) + base.to(mixes.dtype)) + hc_eps
    return (pre.unsqueeze(-1) * x.to(pre.dtype)).sum(-2).to(x.dtype)
