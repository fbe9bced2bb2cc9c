"""The DeepSeek-V4 forward pass, written once.

Every op goes through `ctx(site, op, *args, **kw)`: the context runs it on one or more backends, records it,
injects faults, or hands a candidate the reference's inputs. Weights travel as `W(name)` references that each
side resolves from its own weight source, so a weight fault can hit the candidate alone.

The forward is a list of stages (embed, one per layer, head) so runners can stream weights one layer at a
time and compare or swap sides at layer boundaries. Shapes: S tokens, M = hc_mult streams, D = dim.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from dsv4_references import rope as rope_ref
from dsv4_references.attention import assemble_idxs, causal_compressed_idxs, window_idxs

from .config import ModelConfig
from .schema import block_prefix


@dataclass(frozen=True)
class W:
    """A reference to a checkpoint module (schema name); each side resolves it from its own weights."""
    name: str


class Ctx(Protocol):
    def __call__(self, site: str, op: str, *args: Any, **kw: Any) -> Any: ...


@dataclass
class State:
    """What travels between stages: the token ids and the hidden streams (or logits at the end)."""
    token_ids: torch.Tensor                 # [S] int64
    h: torch.Tensor | None = None           # [S, M, D] streams, or [S, vocab] logits after the head
    streams: torch.Tensor | None = None     # after the head: the main model's last streams (the MTP's input)
    mtp_logits: torch.Tensor | None = None  # [S, vocab] after the MTP stage


@dataclass(frozen=True)
class Stage:
    name: str                               # "embed", "layers.3", "head"
    layer: int                              # -1 embed, 0..n_layers-1, n_layers head
    run: Callable[[Ctx, State], State]


class RopeTables:
    """freqs_cis per theta flavour, computed once per sequence length (complex64, fp32 math as DeepSeek's)."""

    def __init__(self, cfg: ModelConfig, seqlen: int, device: torch.device | str = "cpu"):
        r = cfg.rope_head_dim
        self.plain = rope_ref.rope_freqs(seqlen, r, cfg.rope_theta).to(device)           # SWA: no YaRN
        self.compress = rope_ref.rope_freqs(seqlen, r, cfg.compress_rope_theta, cfg.original_seq_len,
                                            cfg.rope_factor, cfg.beta_fast, cfg.beta_slow).to(device)

    def for_layer(self, cfg: ModelConfig, layer: int) -> torch.Tensor:
        return self.compress if cfg.compress_ratio(layer) else self.plain


def attention(ctx: Ctx, cfg: ModelConfig, layer: int, x: torch.Tensor, freqs: torch.Tensor,
              qat: bool) -> torch.Tensor:
    """x [S, D] (attn_norm output) -> [S, D]. CSA/HCA/SWA by the layer's compress ratio."""
    p = block_prefix(cfg, layer) + "attn."
    S, H, d, r = x.size(0), cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
    ratio = cfg.compress_ratio(layer)
    eps = cfg.norm_eps

    qr = ctx(p + "wq_a", "linear", x, W(p + "wq_a"))                                     # [S, Q]
    qr = ctx(p + "q_norm", "rms_norm", qr, W(p + "q_norm.weight"), eps=eps)
    q = ctx(p + "wq_b", "linear", qr, W(p + "wq_b")).unflatten(-1, (H, d))               # [S, H, d]
    q = ctx(p + "q_head_norm", "head_rms_norm", q, eps=eps)
    q = ctx(p + "q_rope", "rope", q, freqs)

    kv = ctx(p + "wkv", "linear", x, W(p + "wkv"))                                       # [S, d]
    kv = ctx(p + "kv_norm", "rms_norm", kv, W(p + "kv_norm.weight"), eps=eps)
    kv = ctx(p + "kv_rope", "rope", kv, freqs)
    kv = ctx(p + "kv_cache", "kv_cache", kv, rope_dim=r, qat=qat)

    idx = window_idxs(S, cfg.window_size, device=x.device)                               # [S, window]
    if ratio:
        c = p + "compressor."
        comp = ctx(p + "compressor", "compressor", x, W(c + "wkv"), W(c + "wgate"), W(c + "ape"),
                   W(c + "norm.weight"), freqs, ratio=ratio, rope_dim=r, eps=eps, rotate=False, qat=qat)
        kv = torch.cat([kv, comp], 0)                                                    # [S + S//ratio, d]
    if ratio == 4:
        i, ih, idim = p + "indexer.", cfg.index_n_heads, cfg.index_head_dim
        qi = ctx(i + "wq_b", "linear", qr, W(i + "wq_b")).unflatten(-1, (ih, idim))       # [S, IH, ID]
        qi = ctx(i + "q", "indexer_q", qi, freqs, qat=qat)
        ki = ctx(i + "compressor", "compressor", x, W(i + "compressor.wkv"), W(i + "compressor.wgate"),
                 W(i + "compressor.ape"), W(i + "compressor.norm.weight"), freqs, ratio=4, rope_dim=r,
                 eps=eps, rotate=True, qat=qat)                                         # [S//4, ID]
        wts = ctx(i + "weights_proj", "linear", x, W(i + "weights_proj"))                # [S, IH]
        scores = ctx(i + "scores", "indexer_scores", qi, ki, wts, ratio=4,
                     weight_scale=idim ** -0.5 * ih ** -0.5)                             # [S, S//4]
        top = ctx(i + "topk", "indexer_topk", scores, k=cfg.index_topk)
        idx = assemble_idxs(idx, top, S)
    elif ratio:
        idx = assemble_idxs(idx, causal_compressed_idxs(S, ratio, device=x.device), S)

    o = ctx(p + "sparse_attn", "sparse_attn", q, kv, W(p + "attn_sink"), idx, scale=d ** -0.5)
    del q                      # [S, H, d]: 0.5 GiB in the fp64 floor run at 1024 tokens, no longer needed
    o = ctx(p + "o_rope", "rope", o, freqs, inverse=True)                                # [S, H, d]
    z = ctx(p + "wo_a", "grouped_linear", o, W(p + "wo_a"), groups=cfg.o_groups)         # [S, G*R]
    return ctx(p + "wo_b", "linear", z, W(p + "wo_b"))                                   # [S, D]


def moe(ctx: Ctx, cfg: ModelConfig, layer: int, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """x [S, D] (ffn_norm output) -> [S, D]: routed experts (hash or score routing) plus the shared expert."""
    p = block_prefix(cfg, layer) + "ffn."
    lim = cfg.swiglu_limit
    hashed = cfg.is_hash_layer(layer)
    weights, ids, _ = ctx(p + "gate", "gate", x, W(p + "gate"), None if hashed else W(p + "gate.bias"),
                          W(p + "gate.tid2eid") if hashed else None, token_ids,
                          topk=cfg.n_activated_experts, route_scale=cfg.route_scale)   # [S, k] x2
    outs: dict[int, torch.Tensor] = {}
    routes = expert_routes(ids, weights)
    for e, (tok, route_w) in routes.items():
        ep = f"{p}experts.{e}."
        outs[e] = ctx(f"{p}experts.{e}", "expert", x[tok], W(ep + "w1"), W(ep + "w3"), W(ep + "w2"),
                      route_w, limit=lim)
    sp = p + "shared_experts."
    shared = ctx(p + "shared_experts", "expert", x, W(sp + "w1"), W(sp + "w3"), W(sp + "w2"), None, limit=lim)
    return ctx(p[:-1], "moe_combine", x.size(0), outs, {e: tok for e, (tok, _) in routes.items()}, shared)


def expert_routes(ids: torch.Tensor, weights: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """ids, weights [S, k] -> {expert: (its tokens in ascending order [n], their routing weights [n])},
    for the experts that received tokens, with a single device-to-host sync (the counts)."""
    S, k = ids.shape
    token = torch.arange(S, device=ids.device).repeat_interleave(k)                      # [S*k]
    order = torch.argsort(ids.flatten() * S + token)                                     # by expert, then token
    counts = torch.bincount(ids.flatten()).tolist()
    tokens, w = token[order].split(counts), weights.flatten()[order].split(counts)
    return {e: (tokens[e], w[e]) for e, n in enumerate(counts) if n}


def block(ctx: Ctx, cfg: ModelConfig, layer: int, h: torch.Tensor, token_ids: torch.Tensor,
          freqs: torch.Tensor, qat: bool) -> torch.Tensor:
    """One layer: h [S, M, D] -> [S, M, D] with mHC around attention and MoE."""
    p = block_prefix(cfg, layer)
    hc = {"iters": cfg.hc_sinkhorn_iters, "norm_eps": cfg.norm_eps, "hc_eps": cfg.hc_eps}
    y, post, comb = ctx(p + "hc_attn.pre", "hc_pre", h, W(p + "hc_attn_fn"), W(p + "hc_attn_scale"),
                        W(p + "hc_attn_base"), **hc)
    x = ctx(p + "attn_norm", "rms_norm", y, W(p + "attn_norm.weight"), eps=cfg.norm_eps)
    a = attention(ctx, cfg, layer, x, freqs, qat)
    h = ctx(p + "hc_attn.post", "hc_post", a, h, post, comb)
    y, post, comb = ctx(p + "hc_ffn.pre", "hc_pre", h, W(p + "hc_ffn_fn"), W(p + "hc_ffn_scale"),
                        W(p + "hc_ffn_base"), **hc)
    x = ctx(p + "ffn_norm", "rms_norm", y, W(p + "ffn_norm.weight"), eps=cfg.norm_eps)
    f = moe(ctx, cfg, layer, x, token_ids)
    return ctx(p + "hc_ffn.post", "hc_post", f, h, post, comb)


def stages(cfg: ModelConfig, seqlen: int, device: torch.device | str = "cpu", qat: bool = True,
           layers: range | None = None, mtp: bool = False) -> list[Stage]:
    """The forward as stages: embed, the main layers (or a range of them), head, and optionally the MTP."""
    tables = RopeTables(cfg, seqlen, device)
    layers = range(cfg.n_layers) if layers is None else layers

    def embed(ctx: Ctx, st: State) -> State:
        e = ctx("embed", "embed", st.token_ids, W("embed.weight"))                       # [S, D]
        return State(st.token_ids, e.unsqueeze(1).repeat(1, cfg.hc_mult, 1))             # [S, M, D]

    def layer_stage(i: int) -> Stage:
        def run(ctx: Ctx, st: State) -> State:
            return State(st.token_ids, block(ctx, cfg, i, st.h, st.token_ids, tables.for_layer(cfg, i), qat))
        return Stage(f"layers.{i}", i, run)

    def head(ctx: Ctx, st: State) -> State:
        y = ctx("hc_head", "hc_head", st.h, W("hc_head_fn"), W("hc_head_scale"), W("hc_head_base"),
                norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps)                                # [S, D]
        y = ctx("norm", "rms_norm", y, W("norm.weight"), eps=cfg.norm_eps)
        return State(st.token_ids, ctx("logits", "logits", y, W("head.weight")), st.h)     # [S, vocab] fp32

    out = [Stage("embed", -1, embed), *(layer_stage(i) for i in layers), Stage("head", cfg.n_layers, head)]
    if mtp:
        out.append(Stage("mtp.0", cfg.n_layers + 1,
                         lambda ctx, st: mtp_block(ctx, cfg, st, tables.for_layer(cfg, cfg.n_layers), qat)))
    return out


def mtp_block(ctx: Ctx, cfg: ModelConfig, st: State, freqs: torch.Tensor, qat: bool) -> State:
    """The multi-token-prediction block (MTPBlock): drafts token t+2 from the main streams at t and the
    embedding of token t+1 (the last position repeats its own token). Shares embed and head."""
    layer, p, eps = cfg.n_layers, block_prefix(cfg, cfg.n_layers), cfg.norm_eps
    nxt = torch.cat([st.token_ids[1:], st.token_ids[-1:]])                               # [S]
    e = ctx(p + "embed", "embed", nxt, W("embed.weight"))                                # [S, D]
    e = ctx(p + "enorm", "rms_norm", e, W(p + "enorm.weight"), eps=eps)
    x = ctx(p + "hnorm", "rms_norm", st.streams, W(p + "hnorm.weight"), eps=eps)         # [S, M, D]
    x = ctx(p + "e_proj", "linear", e, W(p + "e_proj")).unsqueeze(1) + ctx(p + "h_proj", "linear", x,
                                                                            W(p + "h_proj"))
    h = block(ctx, cfg, layer, x, nxt, freqs, qat)
    y = ctx(p + "hc_head", "hc_head", h, W(p + "hc_head_fn"), W(p + "hc_head_scale"), W(p + "hc_head_base"),
            norm_eps=eps, hc_eps=cfg.hc_eps)
    y = ctx(p + "norm", "rms_norm", y, W(p + "norm.weight"), eps=eps)
    return State(st.token_ids, st.h, st.streams, ctx(p + "logits", "logits", y, W("head.weight")))
