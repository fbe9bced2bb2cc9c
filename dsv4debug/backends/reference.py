"""The reference backend: every op from dsv4_references (references/), in the activation dtype."""
from __future__ import annotations

import dsv4_references as ref
import torch

from ..formats import QWeight
from .base import Backend

DENSE_CHUNK_BYTES = 256 << 20      # above it a dense weight is made and used in row chunks (the fp64 floors' linears
                                   # and the fp32 head: the largest other Pro weight is 224 MiB in bf16)


def _dense_rows(w: QWeight, dtype: torch.dtype) -> int:
    """Output rows of w's dense copy in `dtype` per chunk: all of them, or 128-row blocks within DENSE_CHUNK_BYTES."""
    out, inp = w.shape
    if out * inp * dtype.itemsize <= DENSE_CHUNK_BYTES:
        return out
    return max(128, DENSE_CHUNK_BYTES // (inp * dtype.itemsize) // 128 * 128)


class ReferenceBackend(Backend):
    name = "reference"

    def embed(self, ids: torch.Tensor, w: QWeight) -> torch.Tensor:
        # only the S rows of the (memory-mapped) table are read, and nothing is cached
        return w.tensors[""][ids.cpu()].to(self.device, self.dtype)

    def hc_pre(self, x, fn, scale, base, *, iters, norm_eps, hc_eps):
        return ref.hc_pre(x, self.param(fn), self.param(scale), self.param(base), iters, norm_eps, hc_eps)

    def hc_post(self, a, residual, post, comb):
        return ref.hc_post(a, residual, post, comb)

    def hc_head(self, x, fn, scale, base, *, norm_eps, hc_eps):
        return ref.hc_head(x, self.param(fn), self.param(scale), self.param(base), norm_eps, hc_eps)

    def rms_norm(self, x, w, *, eps):
        return ref.rms_norm(x, self.param(w), eps)

    def head_rms_norm(self, q, *, eps):
        return ref.head_rms_norm(q, eps)

    def linear(self, x, w):
        return self._by_rows(w, x.dtype, x.dtype, lambda dense, a, b: ref.linear(x, dense))

    def grouped_linear(self, o, w, *, groups):
        R = w.shape[0] // groups                                            # rows of each head group
        og = o.reshape(o.size(0), groups, -1)                               # [S, G, H*d/G]
        return self._by_rows(w, o.dtype, o.dtype, lambda dense, a, b: ref.grouped_linear(
            og[:, a // R:b // R], dense, (b - a) // R), unit=R)

    def logits(self, x, w):
        wide = torch.promote_types(x.dtype, torch.float32)            # linear_fp32 widens the weight to it
        return self._by_rows(w, torch.float32, wide, lambda dense, a, b: ref.linear_fp32(x, dense))

    def _by_rows(self, w: QWeight, dtype: torch.dtype, used: torch.dtype, product, unit: int = 1) -> torch.Tensor:
        """product(dense rows [a, b) of w in dtype, a, b) -> [..., b - a], for all rows at once, or, when w's
        dense copy in `used` passes DENSE_CHUNK_BYTES, concatenated over chunks of 128-row blocks and of whole
        `unit`s (wo_a: head groups, each group's product its own). The fp64 floor's dense wo_b alone was 0.9 GiB
        at a Pro run's peak, its wo_a 0.5 GiB, its head 7.4 GB."""
        out = w.shape[0]
        rows = _dense_rows(w, used)
        rows = rows if rows >= out else max(unit, rows // unit * unit)
        if rows >= out or rows % 128:                      # chunks must end on fp8's 128-row scale blocks
            return product(self.dense(w, dtype), 0, out)
        return torch.cat([product(self.dense(w.rows(a, min(a + rows, out)), dtype), a, min(a + rows, out))
                          for a in range(0, out, rows)], -1)

    def rope(self, x, freqs, *, inverse=False):
        return ref.apply_rope(x, freqs, inverse)

    def kv_cache(self, kv, *, rope_dim, qat):
        return ref.kv_qat(kv, rope_dim, qat)

    def compressor(self, x, wkv, wgate, ape, norm, freqs, *, ratio, rope_dim, eps, rotate, qat):
        return ref.compress(x, self.param(wkv), self.param(wgate), self.param(ape), self.param(norm), freqs,
                            ratio, rope_dim, eps, rotate, qat)

    def indexer_q(self, q, freqs, *, qat):
        return ref.indexer_q(q, freqs, qat)

    def indexer_scores(self, q, k, weights, *, ratio, weight_scale):
        return ref.indexer_scores(q, k, weights * weight_scale, ratio)

    def indexer_topk(self, scores, *, k):
        return ref.indexer_topk(scores, k)

    def sparse_attn(self, q, kv, sink, idx, *, scale):
        return ref.sparse_attn(q, kv, self.param(sink), idx, scale)

    def gate(self, x, w, bias, tid2eid, token_ids, *, topk, route_scale):
        hash_ids = None if tid2eid is None else tid2eid.tensors[""][token_ids.cpu()].to(self.device)
        return ref.gate(x, self.param(w), self.param(bias), hash_ids, topk, route_scale)

    def expert(self, x, w1, w3, w2, route_w, *, limit):
        dt = x.dtype
        return ref.expert(x, *self.dense_all((w1, w3, w2), dt), limit, route_w)

    def moe_combine(self, n_tokens, expert_out, expert_tokens, shared):
        return ref.moe_combine(n_tokens, expert_out, expert_tokens, shared)

