"""The reference backend: every op from dsv4_references (references/), in the activation dtype."""
from __future__ import annotations

import dsv4_references as ref
import torch

from ..formats import QWeight
from .base import Backend


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
        return ref.linear(x, self.dense(w, x.dtype))

    def grouped_linear(self, o, w, *, groups):
        return ref.grouped_linear(o, self.dense(w, o.dtype), groups)

    def logits(self, x, w):
        return ref.linear_fp32(x, self.param(w))

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

