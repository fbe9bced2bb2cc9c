"""MoE: sqrt-softplus gate with hash or score routing, SwiGLU experts with clamp, shared expert."""
import torch
import torch.nn.functional as F

from .linear import linear, linear_fp32
from .precision import acc


def gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None,
         topk: int, route_scale: float):
    """x [N, D] -> routing weights [N, k] (fp32), expert ids [N, k], selection scores [N, E] (fp32).

    Scores s = sqrt(softplus(x . W)); the bias only steers selection (noaux_tc); hash layers take the ids
    from tid2eid[token]; weights are the unbiased scores of the chosen experts, renormalised, times route_scale.
    """
    s = F.softplus(linear_fp32(x, weight)).sqrt()                          # [N, E]
    select = s if bias is None else s + bias.to(s.dtype)
    ids = hash_ids if hash_ids is not None else select.topk(topk, dim=-1).indices
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * route_scale
    return w, ids, select


def expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
           route_w: torch.Tensor | None = None, act_quant=None) -> torch.Tensor:
    """SwiGLU expert with clamp: x [n, D] -> [n, D]; the routing weight [n] multiplies before w2.

    act_quant, if given, rounds each GEMM's input first, as DeepSeek's linear() does for FP8/FP4 weights.
    """
    q = act_quant or (lambda t: t)
    x = q(x)
    g = linear(x, w1).to(acc(x))
    u = linear(x, w3).to(acc(x))
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u                                                      # [n, I] fp32
    if route_w is not None:
        h = route_w.to(h.dtype).unsqueeze(-1) * h
    return linear(q(h.to(x.dtype)), w2)


def moe_combine(n_tokens: int, expert_out: dict[int, torch.Tensor], expert_tokens: dict[int, torch.Tensor],
                shared: torch.Tensor) -> torch.Tensor:
    """Sum routed expert outputs [n_e, D] back onto their tokens (fp32, expert order), plus the shared
    expert -> [N, D]."""
    y = torch.zeros(n_tokens, shared.size(-1), dtype=acc(shared), device=shared.device)
    for e, out in sorted(expert_out.items()):
        y.index_add_(0, expert_tokens[e], out.to(y.dtype))
    return (y + shared.to(y.dtype)).to(shared.dtype)
