"""DeepSeek-V4 attention pieces: KV QAT, compressor, lightning indexer, index assembly, sparse attention.

Shapes: S tokens, H heads, d = 512 (448 nope + 64 rope), T = S // ratio compressed entries.
"""
import torch

from .norm import rms_norm
from .precision import acc
from .quant import fp4_sim, fp8_sim, rotate_activation
from .rope import apply_rope


def kv_qat(kv: torch.Tensor, rope_dim: int, enabled: bool = True) -> torch.Tensor:
    """kv [S, d]: FP8-simulate the non-rope dims (blocks of 64); the rope dims stay in bf16."""
    if not enabled:
        return kv
    return torch.cat([fp8_sim(kv[..., :-rope_dim], 64), kv[..., -rope_dim:]], -1)


def _pool_blocks(kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """kv, score [T, ratio, c*dc] fp32 -> [T, dc]: per-feature softmax pooling over the block's slots.

    overlap (ratio 4): block w pools 2*ratio slots, the previous block's first-half features and its own
    second-half features, so entry w covers tokens (w-1)*ratio .. (w+1)*ratio-1.
    """
    if overlap:
        dc = kv.size(-1) // 2
        prev_kv = torch.cat([torch.zeros_like(kv[:1, :, :dc]), kv[:-1, :, :dc]], 0)
        prev_sc = torch.cat([torch.full_like(score[:1, :, :dc], float("-inf")), score[:-1, :, :dc]], 0)
        kv = torch.cat([prev_kv, kv[..., dc:]], 1)                         # [T, 2*ratio, dc]
        score = torch.cat([prev_sc, score[..., dc:]], 1)
    return (score.softmax(1) * kv).sum(1)                                   # [T, dc]


def compress(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor,
             norm_w: torch.Tensor, freqs: torch.Tensor, ratio: int, rope_dim: int, eps: float,
             rotate: bool, qat: bool = True) -> torch.Tensor:
    """Compressor: x [S, D] -> [S // ratio, dc] entries (only complete blocks).

    Projections and pooling in fp32; RMSNorm; rope at the block's first position; then the QAT sim:
    main compressor FP8 on the nope dims, indexer compressor (rotate=True) Hadamard + FP4.
    """
    T = x.size(0) // ratio
    xf = x[:T * ratio].to(acc(x))
    kv = (xf @ wkv.to(xf.dtype).T).unflatten(0, (T, ratio))                 # [T, ratio, c*dc]
    score = (xf @ wgate.to(xf.dtype).T).unflatten(0, (T, ratio)) + ape.to(xf.dtype)
    c = rms_norm(_pool_blocks(kv, score, ratio, overlap=ratio == 4).to(x.dtype), norm_w, eps)
    c = apply_rope(c, freqs[:T * ratio:ratio])                             # [T, dc]
    if rotate:
        c = rotate_activation(c)
        return fp4_sim(c, 32) if qat else c
    return kv_qat(c, rope_dim, qat)


def indexer_q(q: torch.Tensor, freqs: torch.Tensor, qat: bool = True) -> torch.Tensor:
    """Indexer queries q [S, IH, ID]: rope on the last 64 dims, Hadamard, FP4 sim."""
    q = rotate_activation(apply_rope(q, freqs))
    return fp4_sim(q, 32) if qat else q


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, ratio: int) -> torch.Tensor:
    """q [S, IH, ID], k [T, ID], weights [S, IH] -> scores [S, T], -inf where entry t is not yet complete.

    score[s, t] = sum_h relu(q[s,h] . k[t]) * weights[s,h], in the activation dtype (bf16 in DeepSeek's code).
    """
    s = torch.einsum("shd,td->sht", q, k.to(q.dtype)).relu()
    scores = (s * weights.to(q.dtype).unsqueeze(-1)).sum(1)                # [S, T]
    visible = torch.arange(k.size(0), device=q.device)[None, :] < (torch.arange(q.size(0), device=q.device)[:, None] + 1) // ratio
    return scores.masked_fill(~visible, float("-inf"))


def indexer_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [S, T] -> [S, min(k, T)] entry ids, -1 where fewer than k entries are visible."""
    k = min(k, scores.size(-1))
    vals, idx = scores.topk(k, dim=-1)
    return idx.masked_fill(vals == float("-inf"), -1)


def window_idxs(S: int, window: int, device=None) -> torch.Tensor:
    """[S, window] key positions max(0, t-window+1) .. t, -1 padded (get_window_topk_idxs)."""
    t = torch.arange(S, device=device)[:, None]
    j = t - window + 1 + torch.arange(window, device=device)[None, :]
    return j.masked_fill(j < 0, -1)


def causal_compressed_idxs(S: int, ratio: int, device=None) -> torch.Tensor:
    """HCA: [S, S // ratio] every complete compressed entry w < (t+1) // ratio, else -1."""
    w = torch.arange(S // ratio, device=device)[None, :]
    return w.masked_fill(w >= (torch.arange(S, device=device)[:, None] + 1) // ratio, -1)


def assemble_idxs(win: torch.Tensor, compressed: torch.Tensor | None, offset: int) -> torch.Tensor:
    """Concatenate window ids with compressed-entry ids shifted by `offset` (their rows in the joint KV)."""
    if compressed is None:
        return win
    return torch.cat([win, torch.where(compressed >= 0, compressed + offset, compressed)], -1)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                chunk_bytes: int = 64 << 20) -> torch.Tensor:
    """MQA over gathered rows with a per-head sink logit.

    q [S, H, d], kv [N, d] (K = V), sink [H], idx [S, K] rows of kv (-1 = skip) -> o [S, H, d].
    o = sum_j exp(s_j - m) kv_j / (sum_j exp(s_j - m) + exp(sink - m)), s_j = q . kv_j * scale (fp32).
    Queries go in chunks whose gathered rows take about chunk_bytes (a Pro layer's fp64 floor gathers 4.7 MB
    of rows per query; a chunk's temporaries are ~3 times that, at a Pro run's peak of memory with 256 MiB).
    """
    out = torch.empty_like(q)
    chunk = max(1, chunk_bytes // (idx.size(1) * kv.size(1) * max(kv.element_size(), acc(q).itemsize)))
    for a in range(0, q.size(0), chunk):
        qi, ii = q[a:a + chunk], idx[a:a + chunk]                          # [s, H, d], [s, K]
        kvg = kv[ii.clamp(min=0)]                                          # [s, K, d]
        s = torch.einsum("shd,skd->shk", qi.to(acc(q)), kvg.to(acc(q))) * scale
        s = s.masked_fill((ii < 0).unsqueeze(1), float("-inf"))
        snk = sink.to(s.dtype).view(1, -1, 1).expand(s.size(0), -1, 1)    # [s, H, 1]
        p = torch.cat([s, snk], -1).softmax(-1)[..., :-1]                  # sink takes mass, has no value
        out[a:a + chunk] = torch.einsum("shk,skd->shd", p.to(q.dtype), kvg)
    return out
