"""Name maps: which module of another DeepSeek-V4 implementation produces which dsv4debug site.

`dsv4debug.hooks.capture` puts forward hooks on a PyTorch model and records module outputs into a capture
under our site names (`layers.7.attn.wq_a`, `layers.7.ffn.experts`, `embed`, `norm`, `logits` ...). A map
says, per module (matched by a regular expression on its qualified name), which sites it yields and how to
get each one from the call: the output, an input, a slice of a fused output, a re-layout (batch dimension
of 1 dropped, per-head views back to our [tokens, heads, dim]). Only views, slices, permutations and the
module's own elementwise follow-ups are applied; anything else is a different tensor and is said so in the
tap's `note`, which the capture stores in the site's `attrs`.

Two built-in maps, written from the implementations' source:

- `hf`: Hugging Face transformers `DeepseekV4ForCausalLM` / `DeepseekV4Model`
  (transformers/models/deepseek_v4/modeling_deepseek_v4.py, transformers 5.x)
- `vllm`: vLLM `DeepseekV4ForCausalLM` (vllm/model_executor/models/deepseek_v4.py and
  vllm/model_executor/layers/deepseek_v4_attention.py, deepseek_compressor.py, mhc.py)

Sites a map can see are listed in `HF_SITES` / `VLLM_SITES` (the docstring table of each map); sites of the
reference flow that happen inside a module with no module boundary (functions, fused kernels, custom ops)
cannot be captured by hooks; `not_observable` lists them. Taps marked `extra` record tensors that have no
site in the dsv4debug reference flow (projections inside the compressor, the summed routed experts): they
are named after DeepSeek's module paths so two engines can be diffed on them, and a diff against the
reference must ignore them (see `captures/rules/hf.toml`).

This module also converts DeepSeek-native checkpoint names to transformers' names (`hf_state_dict`), so a
DeepSeek-V4 checkpoint (real or synthetic) can be loaded into transformers' model for a side-by-side run.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SKIP = "skip"          # a map's answer for a module it knows and deliberately does not record


# ---------------------------------------------------------------------------------------------------------
# Map structure
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Call:
    """One forward call of a hooked module, as a tap sees it."""
    name: str                          # qualified module name (as named_modules() gives it)
    module: nn.Module
    args: tuple
    kwargs: dict
    output: Any                        # None in "pre" taps
    n_tokens: int                      # tokens of the current forward (batch 1 / flattened)
    calls: int                         # how many earlier calls this module had in the current forward
    groups: dict[str, Any]             # named groups of the rule's pattern ("L": layer index as int)
    dims: Mapping[str, int]            # model dimensions the map read from the model's config
    running: Mapping[str, tuple[tuple, dict]]   # modules whose forward is in progress -> their (args, kwargs)
    state: dict[str, Any]              # scratch shared by the taps of one forward
    modules: Mapping[str, nn.Module]   # every module by qualified name

    def arg(self, i: int, name: str) -> Any:
        """Positional argument i, or keyword `name`."""
        return self.args[i] if len(self.args) > i else self.kwargs.get(name)

    def parent(self, up: int = 1) -> tuple[str, nn.Module | None]:
        name = self.name.rsplit(".", up)[0] if self.name.count(".") >= up else ""
        return name, self.modules.get(name)


Take = Callable[[Call], "torch.Tensor | None"]


@dataclass(frozen=True)
class Tap:
    """One site a module call yields. `site` is a template over the rule's groups: {L} the layer index,
    {P} the previous layer's (L - 1). `take` returns the tensor (or None: nothing to record this call)."""
    site: str
    take: Take
    when: str = "post"                 # "post": from the output (forward hook); "pre": from the inputs
    family: str = ""
    note: str = ""                     # how this tensor differs from our site's, if it does
    covers: tuple[str, ...] = ()       # fused modules: the reference sites this one module computes
    extra: bool = False                # no counterpart in the dsv4debug reference flow

    def site_name(self, groups: Mapping[str, Any]) -> str:
        layer = groups.get("L")
        return self.site.format(L=layer, P=None if layer is None else layer - 1)


@dataclass(frozen=True)
class Rule:
    pattern: str                       # re.search on the qualified name; named group L = layer index
    taps: tuple[Tap, ...] | str        # or SKIP

    def match(self, name: str) -> dict[str, Any] | None:
        m = re.search(self.pattern, name)
        if m is None:
            return None
        return {k: (int(v) if k == "L" and v is not None else v) for k, v in m.groupdict().items()}


@dataclass
class NameMap:
    """An ordered list of rules (first match wins); `dims` reads model dimensions from the model."""
    name: str
    rules: Sequence[Rule]
    engine: str = ""
    dims: Callable[[nn.Module], dict[str, int]] = lambda root: {}
    layer_end_site: str | None = "hc_ffn.post"    # recording layers.N.<this> closes layer N
    not_observable: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def resolve(self, name: str) -> tuple[tuple[Tap, ...] | str | None, dict[str, Any]]:
        """(taps, groups) of the first matching rule; (SKIP, {}) or (None, {}) when unmapped."""
        for rule in self.rules:
            groups = rule.match(name)
            if groups is not None:
                return rule.taps, groups
        return None, {}

    def taps(self) -> Iterator[tuple[str, Tap]]:
        for rule in self.rules:
            if rule.taps != SKIP:
                for tap in rule.taps:
                    yield rule.pattern, tap


def _layer(prefix: str) -> str:
    """Pattern prefix: any module path ending in layers.<L>. followed by `prefix`."""
    return rf"(?:^|\.)layers\.(?P<L>\d+)\.{prefix}"


# ---------------------------------------------------------------------------------------------------------
# Takers
# ---------------------------------------------------------------------------------------------------------
def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


def out(i: int | None = None) -> Take:
    """The output (element i of a tuple output), batch dim kept."""
    def take(c: Call) -> torch.Tensor | None:
        v = c.output if i is None else c.output[i]
        return v if isinstance(v, torch.Tensor) else _first_tensor(v) if i is None else None
    return take


def batch1(take: Take) -> Take:
    """Drop a leading batch dimension of 1 ([1, S, ...] -> [S, ...])."""
    def wrapped(c: Call) -> torch.Tensor | None:
        t = take(c)
        return t[0] if t is not None and t.dim() > 0 and t.shape[0] == 1 else t
    return wrapped


def arg(i: int, name: str) -> Take:
    def take(c: Call) -> torch.Tensor | None:
        v = c.arg(i, name)
        return v if isinstance(v, torch.Tensor) else None
    return take


def split(take: Take, part: int, sizes: Callable[[Call], Sequence[int]]) -> Take:
    """Part `part` of a tensor that concatenates several outputs along its last dim (a view)."""
    def wrapped(c: Call) -> torch.Tensor | None:
        t = take(c)
        return None if t is None else t.split(list(sizes(c)), dim=-1)[part]
    return wrapped


def _halves(t_take: Take) -> Callable[[Call], Sequence[int]]:
    def sizes(c: Call) -> Sequence[int]:
        n = t_take(c).shape[-1]
        return (n // 2, n - n // 2)
    return sizes


def generic_take(c: Call) -> torch.Tensor | None:
    """Unmapped modules: the first tensor of the output; [1, S, ...] -> [S, ...] when S is the token count."""
    t = _first_tensor(c.output)
    if t is not None and t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == c.n_tokens:
        t = t[0]
    return t


# ---------------------------------------------------------------------------------------------------------
# Hugging Face transformers DeepseekV4
# ---------------------------------------------------------------------------------------------------------
def _hf_dims(root: nn.Module) -> dict[str, int]:
    cfg = getattr(root, "config", None)
    if cfg is None:
        return {}
    return {"head_dim": cfg.head_dim, "n_heads": cfg.num_attention_heads, "hc_mult": cfg.hc_mult,
            "n_layers": cfg.num_hidden_layers}


def _hf_heads(c: Call) -> torch.Tensor | None:
    """q_b_norm output [1, H, S, d] -> [S, H, d] (a permuted view; our per-head layout)."""
    return c.output[0].transpose(0, 1)


def _hf_o_rope(c: Call) -> torch.Tensor | None:
    """o_a_proj input [1, S, G, H*d/G] (heads of a group are contiguous) -> [S, H, d] (a view)."""
    x = c.arg(0, "x")[0]
    return x.reshape(x.shape[0], -1, c.dims["head_dim"])


def _hf_wo_a(c: Call) -> torch.Tensor | None:
    """o_a_proj output [1, S, G, R] -> [S, G*R] (what o_b_proj reads after flatten(2))."""
    y = c.output[0]
    return y.reshape(y.shape[0], -1)


def _hf_compressed(c: Call) -> torch.Tensor | None:
    """compressor output (compressed_kv [1, 1, T, d], block_bias) -> [T, d]."""
    return c.output[0][0, 0]


def _hf_router(c: Call) -> dict[str, torch.Tensor]:
    """Router output (logits [N, E], weights [N, k], indices [N, k]) in the reference's conventions:
    selection scores = score_fn(logits) (+ e_score_correction_bias for score routing), as the router
    computes them internally; a score router's (ids, weights) sorted by selection score, descending, as
    DeepSeek's topk(sorted=True) returns them (HF uses topk(sorted=False)); hash routing keeps tid2eid order."""
    cached = c.state.get(("router", c.name, c.calls))
    if cached is not None:
        return cached
    logits, weights, ids = c.output
    fn = c.module.score_fn
    scores = fn.forward(logits) if isinstance(fn, nn.Module) else fn(logits)
    bias = getattr(c.module, "e_score_correction_bias", None)
    if bias is not None:
        scores = scores + bias
        order = scores.gather(1, ids).argsort(dim=-1, descending=True, stable=True)
        ids, weights = ids.gather(1, order), weights.gather(1, order)
    result = {"weights": weights, "ids": ids, "scores": scores}
    c.state[("router", c.name, c.calls)] = result
    return result


def _hf_index_scores(c: Call) -> torch.Tensor | None:
    """Indexer scorer output [1, S, T] with the causal mask HF's indexer applies right after it
    (entry w is visible to the query at position p iff w < (p + 1) // ratio) -> [S, T]."""
    scores = c.output
    indexer_name, indexer = c.parent()
    call = c.running.get(indexer_name)
    if call is None or indexer is None:
        return scores[0]
    args, kwargs = call
    positions = args[2] if len(args) > 2 else kwargs.get("position_ids")
    ratio = indexer.compress_rate
    entries = torch.arange(scores.shape[-1], device=scores.device)
    future = entries.view(1, 1, -1) >= ((positions + 1) // ratio).unsqueeze(-1)
    return scores.masked_fill(future, float("-inf"))[0]


_HF_BF16_LINEAR = ("transformers runs this projection as nn.Linear in the model dtype (bf16 output, bf16 "
                   "inputs); DeepSeek's code projects in fp32")
_HF_NOTES = {
    "hc_attn.post": ("input of ffn_hc: HF's hc_post (DeepseekV4DecoderLayer.forward) rounds post and comb to "
                     "bf16 and mixes in bf16; DeepSeek mixes in fp32 then rounds"),
    "hc_ffn.post": "decoder layer output; hc_post in bf16 as for hc_attn.post",
    "q_head_norm": ("q_b_norm output [1, H, S, d] permuted to [S, H, d]; HF multiplies by an rsqrt computed in "
                    "fp32 and rounded to bf16, the reference computes the norm in bf16 as DeepSeek's code"),
    "o_rope": "input of o_a_proj ([1, S, G, H*d/G] viewed as [S, H, d]): attention output after inverse rope",
    "wo_a": "o_a_proj output [1, S, G, R] viewed as [S, G*R]",
    "compressor": ("compressor output [1, 1, T, d] -> [T, d]; " + _HF_BF16_LINEAR + "; HF pools in bf16 "
                   "(softmax weights rounded to bf16) and has no FP8 simulation (compare with qat=False)"),
    "indexer.topk": "indexer output [1, S, k]: top-k compressed entries per query, -1 where not yet visible",
    "indexer.scores": ("scorer output [1, S, T] with HF's causal mask applied as the indexer does next; fp32, "
                       "no Hadamard rotation and no FP4 simulation (DeepSeek: bf16 after rotation + FP4)"),
    "ffn.gate": ("router weights; HF's gate logits are F.linear in bf16 (DeepSeek: fp32), so weights are "
                 "bf16-rounded; reordered by selection score"),
    "ffn.gate.topk_ids": "router indices, reordered by selection score (descending) like DeepSeek's topk",
    "ffn.gate.scores": "score_fn(router logits) + e_score_correction_bias, recomputed from the logits output",
    "ffn": ("MoE block output; HF applies the routing weight after down_proj, accumulates routed experts in "
            "bf16 (index_add_ into a bf16 tensor) and adds the shared expert in bf16; DeepSeek weights before "
            "w2 and accumulates in fp32"),
    "ffn.experts": ("extra: DeepseekV4Experts output = sum of the routed experts, routing weight applied after "
                    "down_proj, bf16 accumulation; the reference has per-expert sites only"),
    "logits": "lm_head in bf16 (DeepSeek: fp32 logits)",
}


def _hf_taps() -> list[Rule]:
    L = _layer
    bl = batch1(out())
    router = [Tap("layers.{L}.ffn.gate", lambda c: _hf_router(c)["weights"], family="router",
                  note=_HF_NOTES["ffn.gate"]),
              Tap("layers.{L}.ffn.gate.topk_ids", lambda c: _hf_router(c)["ids"], family="router",
                  note=_HF_NOTES["ffn.gate.topk_ids"]),
              Tap("layers.{L}.ffn.gate.scores", lambda c: _hf_router(c)["scores"], family="router",
                  note=_HF_NOTES["ffn.gate.scores"])]

    def hc(side: str) -> tuple[Tap, ...]:
        # DeepseekV4HyperConnection returns (post [1,S,M], comb [1,S,M,M], collapsed [1,S,D])
        return (Tap(f"layers.{{L}}.hc_{side}.pre", batch1(out(2)), family="mhc"),
                Tap(f"layers.{{L}}.hc_{side}.pre.post", batch1(out(0)), family="mhc"),
                Tap(f"layers.{{L}}.hc_{side}.pre.comb", batch1(out(1)), family="mhc"))

    comp = r"self_attn\.compressor\."
    idx = comp + r"indexer\."
    return [
        Rule(r"(?:^|\.)(act_fn|score_fn|rotary_emb|input_norm)$", SKIP),   # helpers inside other taps
        Rule(r"^(model)?$", SKIP),                                         # whole model: = norm / logits
        Rule(r"(?:^|\.)embed_tokens$", (Tap("embed", bl, family="embed"),)),
        Rule(L("attn_hc$"), hc("attn")),
        Rule(L("input_layernorm$"), (Tap("layers.{L}.attn_norm", bl, family="norm"),)),
        Rule(L(r"self_attn$"), SKIP),                                      # (o_b_proj output, None)
        Rule(L(r"self_attn\.q_a_proj$"), (Tap("layers.{L}.attn.wq_a", bl, family="linear"),)),
        Rule(L(r"self_attn\.q_a_norm$"), (Tap("layers.{L}.attn.q_norm", bl, family="norm"),)),
        Rule(L(r"self_attn\.q_b_proj$"), (Tap("layers.{L}.attn.wq_b", bl, family="linear"),)),
        Rule(L(r"self_attn\.q_b_norm$"), (Tap("layers.{L}.attn.q_head_norm", _hf_heads, family="norm",
                                              note=_HF_NOTES["q_head_norm"]),)),
        Rule(L(r"self_attn\.kv_proj$"), (Tap("layers.{L}.attn.wkv", bl, family="linear"),)),
        Rule(L(r"self_attn\.kv_norm$"), (Tap("layers.{L}.attn.kv_norm", bl, family="norm"),)),
        Rule(L(r"self_attn\.o_a_proj$"), (
            Tap("layers.{L}.attn.o_rope", _hf_o_rope, when="pre", family="rope", note=_HF_NOTES["o_rope"]),
            Tap("layers.{L}.attn.wo_a", _hf_wo_a, family="linear", note=_HF_NOTES["wo_a"]))),
        Rule(L(r"self_attn\.o_b_proj$"), (Tap("layers.{L}.attn.wo_b", bl, family="linear"),)),
        # indexer (CSA layers): its compressor's projections, q_b_proj, scorer, top-k
        Rule(L(idx + r"kv_proj$"), (Tap("layers.{L}.attn.indexer.compressor.wkv", bl, family="linear",
                                        note=_HF_BF16_LINEAR, extra=True),)),
        Rule(L(idx + r"gate_proj$"), (Tap("layers.{L}.attn.indexer.compressor.wgate", bl, family="linear",
                                          note=_HF_BF16_LINEAR, extra=True),)),
        Rule(L(idx + r"kv_norm$"), (Tap("layers.{L}.attn.indexer.compressor.norm", bl, family="norm",
                                        note="pooled entries after RMSNorm, before rope", extra=True),)),
        Rule(L(idx + r"q_b_proj$"), (Tap("layers.{L}.attn.indexer.wq_b", bl, family="linear"),)),
        Rule(L(idx + r"scorer\.weights_proj$"), (Tap("layers.{L}.attn.indexer.weights_proj", bl,
                                                     family="linear"),)),
        Rule(L(idx + r"scorer$"), (Tap("layers.{L}.attn.indexer.scores", _hf_index_scores, family="indexer",
                                       note=_HF_NOTES["indexer.scores"]),)),
        Rule(L(comp + r"indexer$"), (Tap("layers.{L}.attn.indexer.topk", bl, family="indexer",
                                         note=_HF_NOTES["indexer.topk"]),)),
        # main compressor (CSA and HCA layers)
        Rule(L(comp + r"kv_proj$"), (Tap("layers.{L}.attn.compressor.wkv", bl, family="linear",
                                         note=_HF_BF16_LINEAR, extra=True),)),
        Rule(L(comp + r"gate_proj$"), (Tap("layers.{L}.attn.compressor.wgate", bl, family="linear",
                                           note=_HF_BF16_LINEAR, extra=True),)),
        Rule(L(comp + r"kv_norm$"), (Tap("layers.{L}.attn.compressor.norm", bl, family="norm",
                                         note="pooled entries after RMSNorm, before rope", extra=True),)),
        Rule(L(r"self_attn\.compressor$"), (Tap("layers.{L}.attn.compressor", _hf_compressed,
                                                family="compressor", note=_HF_NOTES["compressor"]),)),
        # FFN half
        Rule(L("ffn_hc$"), (Tap("layers.{L}.hc_attn.post", batch1(arg(0, "hidden_streams")), when="pre",
                                family="mhc", note=_HF_NOTES["hc_attn.post"]), *hc("ffn"))),
        Rule(L("post_attention_layernorm$"), (Tap("layers.{L}.ffn_norm", bl, family="norm"),)),
        Rule(L(r"mlp\.gate$"), tuple(router)),
        Rule(L(r"mlp\.experts$"), (Tap("layers.{L}.ffn.experts", out(), family="experts",
                                       note=_HF_NOTES["ffn.experts"], extra=True),)),
        Rule(L(r"mlp\.shared_experts\.gate_proj$"), (Tap("layers.{L}.ffn.shared_experts.w1", bl,
                                                         family="linear", extra=True),)),
        Rule(L(r"mlp\.shared_experts\.up_proj$"), (Tap("layers.{L}.ffn.shared_experts.w3", bl,
                                                       family="linear", extra=True),)),
        Rule(L(r"mlp\.shared_experts\.down_proj$"), SKIP),                # = shared_experts output
        Rule(L(r"mlp\.shared_experts$"), (Tap("layers.{L}.ffn.shared_experts", bl, family="experts"),)),
        Rule(L(r"mlp$"), (Tap("layers.{L}.ffn", bl, family="experts", note=_HF_NOTES["ffn"]),)),
        Rule(r"(?:^|\.)layers\.(?P<L>\d+)$", (Tap("layers.{L}.hc_ffn.post", bl, family="mhc",
                                                  note=_HF_NOTES["hc_ffn.post"]),)),
        Rule(r"(?:^|\.)hc_head$", (Tap("hc_head", bl, family="mhc"),)),
        Rule(r"(?:^|(?:^|\.)model\.)norm$", (Tap("norm", bl, family="norm"),)),
        Rule(r"(?:^|\.)lm_head$", (Tap("logits", bl, family="logits", note=_HF_NOTES["logits"]),)),
    ]


HF = NameMap(
    name="hf", engine="transformers", rules=_hf_taps(), dims=_hf_dims,
    not_observable=(
        "attn.q_rope", "attn.kv_rope", "attn.kv_cache", "attn.sparse_attn",   # functions inside self_attn
        "attn.indexer.q", "attn.indexer.compressor",                          # inside DeepseekV4Indexer
        "ffn.experts.<E>",                                                     # one fused 3-D experts module
    ),
    notes=(
        ("Window and compressed KV, rope and the sink attention are functions inside DeepseekV4Attention: "
        "their outputs have no module boundary. o_rope is taken from o_a_proj's input."),
        ("HF has no QAT simulations (KV FP8, indexer Hadamard + FP4): compare with our reference run with "
        "qat=False."),
        ("The experts are one module with 3-D weights (gate_up_proj [E, 2I, D], gate rows first): per-expert "
        "outputs are not observable; layers.N.ffn.experts records the routed sum."),
    ),
)


# ---------------------------------------------------------------------------------------------------------
# vLLM DeepseekV4
# ---------------------------------------------------------------------------------------------------------
def _vllm_dims(root: nn.Module) -> dict[str, int]:
    cfg = getattr(root, "config", None)
    if cfg is None:
        return {}
    return {"head_dim": cfg.head_dim, "n_heads": cfg.num_attention_heads, "hc_mult": cfg.hc_mult,
            "n_layers": cfg.num_hidden_layers, "q_lora_rank": cfg.q_lora_rank}


def _vllm_side(c: Call, fn_index: int) -> str | None:
    """Which hyper-connection (attn or ffn) an mhc op call belongs to, by the fn parameter it was given."""
    fn = c.arg(fn_index, "fn")
    _, layer = c.parent()
    if fn is None or layer is None:
        return None
    if fn is getattr(layer, "hc_attn_fn", None):
        return "attn"
    if fn is getattr(layer, "hc_ffn_fn", None):
        return "ffn"
    return None


def _mix_post(t: torch.Tensor, c: Call) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _mix_comb(t: torch.Tensor, c: Call) -> torch.Tensor:
    m = c.dims.get("hc_mult") or round((t[0].numel()) ** 0.5)
    return t.reshape(t.shape[0], m, m)


def _vllm_pre(side: str, what: str, fn_index: int, index: int) -> Take:
    """One output of an mhc pre (post_mix, comb_mix, layer_input) when the call belongs to `side`."""
    def take(c: Call) -> torch.Tensor | None:
        if _vllm_side(c, fn_index) != side:
            return None
        t = c.output[index]
        return _mix_post(t, c) if what == "post" else _mix_comb(t, c) if what == "comb" else t
    return take


def _vllm_fused_residual(side: str) -> Take:
    """mhc_fused_post_pre output 0: the streams after the previous sublayer's hc_post."""
    def take(c: Call) -> torch.Tensor | None:
        return c.output[0] if _vllm_side(c, 4) == side else None
    return take


def _vllm_post(which: str) -> Take:
    """MHCPostOp: ROCm calls it twice inside the layer (attn, then ffn); the CUDA path only once, for the
    last layer's ffn, after the layer's forward returned."""
    def take(c: Call) -> torch.Tensor | None:
        layer_name, _ = c.parent()
        inside = layer_name in c.running
        kind = ("attn" if c.calls == 0 else "ffn") if inside else "ffn"
        return c.output if kind == which else None
    return take


def _vllm_q_norm(c: Call) -> torch.Tensor | None:
    return c.arg(0, "input_")


def _vllm_mla_heads(index: int, name: str) -> Take:
    """DeepseekV4MLAAttention(q, kv, positions, output=out): q and out are padded to 64/128 heads."""
    def take(c: Call) -> torch.Tensor | None:
        t = c.arg(index, name)
        return None if t is None else t[:, :c.module.num_heads]
    return take


def _vllm_gate_scores(c: Call) -> torch.Tensor | None:
    logits = c.output[1]
    scores = torch.nn.functional.softplus(logits.float()).sqrt()
    bias = getattr(c.module, "e_score_correction_bias", None)
    return scores + bias if bias is not None else scores


def _vllm_kv_score(part: int) -> Take:
    """DeepseekCompressor(kv_score, ...): kv_score = [kv | score] fp32 from one GEMM."""
    def take(c: Call) -> torch.Tensor | None:
        t = c.arg(0, "kv_score")
        return None if t is None else t.chunk(2, dim=-1)[part]
    return take


def _vllm_routed(c: Call) -> torch.Tensor | None:
    # FusedMoE is built with the shared expert inside and returns routed + shared (= the ffn site):
    # only DeepseekV4MegaMoEExperts returns the routed sum alone.
    return c.output if type(c.module).__name__ == "DeepseekV4MegaMoEExperts" else None


def _t0(c: Call) -> torch.Tensor | None:
    """Output of a layer returning (output, bias) or a tensor."""
    return c.output[0] if isinstance(c.output, (tuple, list)) else c.output


def _vllm_sizes(c: Call) -> Sequence[int]:
    sizes = getattr(c.module, "output_sizes", None)
    if sizes:
        return list(sizes)
    t = _t0(c)
    q = c.dims["q_lora_rank"]
    return (q, t.shape[-1] - q)


_VLLM_NOTES = {
    "fused_wqa_wkv": ("split from fused_wqa_wkv (one FP8 GEMM computing wq_a and wkv: [N, q_lora_rank + "
                      "head_dim]); W8A8 block-FP8 numerics"),
    "q_norm": "input of wq_b: q_a after vLLM's fused q/kv RMSNorm (fused_q_kv_rmsnorm)",
    "q_rope": ("input q of DeepseekV4MLAAttention (heads padded to 64/128, sliced): wq_b output after the "
               "fused q_head_norm + rope kernel; covers q_head_norm"),
    "kv_norm": "input kv of DeepseekV4MLAAttention: after the fused q/kv RMSNorm, before rope (rope + FP8 "
               "quantisation happen in the cache-insert kernel)",
    "sparse_attn": ("output buffer of DeepseekV4MLAAttention (FlashMLA sparse, FP8 KV cache), padded heads "
                    "sliced; prefill and decode tokens in vLLM's batch order"),
    "wo_a": "input of wo_b: fp8_einsum of the inverse-rope'd, FP8-quantised attention output",
    "hc": "vLLM's mhc ops: post_mix includes hc_post_alpha=2 like DeepSeek's post",
    "compressor": ("input of DeepseekCompressor: [kv | score] projections (fp32 GEMM out); pooling, norm, "
                   "rope and FP8 quantisation run in one kernel writing the paged cache (not observable)"),
    "gate.scores": "sqrt(softplus(router logits)) + e_score_correction_bias, recomputed from norm_gate's fp32 "
                   "logits; top-k ids and weights are computed inside FusedMoE (not observable)",
    "ffn": "DeepseekV4MoE output: routed experts + shared expert (FusedMoE)",
    "indexer.topk": ("DeepseekV4Indexer output as SparseAttnIndexer returns it (its topk_indices_buffer "
                     "rows): index space and padding as the kernel writes them, unverified against ours"),
    "logits": "LogitsProcessor output: only the rows vLLM samples from (last token of each request)",
    "tp": "with tensor parallelism > 1, head-sharded sites (wq_b, q_rope, sparse_attn, wo_a) hold this rank's "
          "heads only",
}


def _vllm_taps() -> list[Rule]:
    L = _layer
    t0 = _t0
    mla = r"attn\.mla_attn\."
    return [
        Rule(r"(?:^|\.)(rotary_emb|act_fn|k_cache|state_cache|swa_cache_layer|indexer_op|k_norm)$", SKIP),
        Rule(r"^(model)?$", SKIP),
        Rule(r"(?:^|\.)embed_tokens$", (Tap("embed", t0, family="embed"),)),
        Rule(L(r"mhc_pre$"), tuple(
            Tap(f"layers.{{L}}.hc_{side}.pre{suffix}", _vllm_pre(side, what, 1, index), family="mhc",
                note=_VLLM_NOTES["hc"])
            for side in ("attn", "ffn")
            for suffix, what, index in (("", "x", 2), (".post", "post", 0), (".comb", "comb", 1)))),
        Rule(L(r"mhc_fused_post_pre$"), (
            Tap("layers.{P}.hc_ffn.post", _vllm_fused_residual("attn"), family="mhc",
                note="mhc_fused_post_pre of the next layer: its hc_post part"),
            Tap("layers.{L}.hc_attn.post", _vllm_fused_residual("ffn"), family="mhc",
                note="mhc_fused_post_pre: its hc_post part"),
            *(Tap(f"layers.{{L}}.hc_{side}.pre{suffix}", _vllm_pre(side, what, 4, index + 1), family="mhc",
                  note=_VLLM_NOTES["hc"])
              for side in ("attn", "ffn")
              for suffix, what, index in (("", "x", 2), (".post", "post", 0), (".comb", "comb", 1))))),
        Rule(L(r"mhc_post$"), (Tap("layers.{L}.hc_attn.post", _vllm_post("attn"), family="mhc"),
                               Tap("layers.{L}.hc_ffn.post", _vllm_post("ffn"), family="mhc"))),
        Rule(L(r"attn_norm$"), (Tap("layers.{L}.attn_norm", t0, family="norm"),)),
        Rule(L(r"attn\.fused_wqa_wkv$"), (
            Tap("layers.{L}.attn.wq_a", split(t0, 0, _vllm_sizes), family="linear",
                note=_VLLM_NOTES["fused_wqa_wkv"], covers=("attn.wq_a", "attn.wkv")),
            Tap("layers.{L}.attn.wkv", split(t0, 1, _vllm_sizes), family="linear",
                note=_VLLM_NOTES["fused_wqa_wkv"], covers=("attn.wq_a", "attn.wkv")))),
        Rule(L(r"attn\.wq_b$"), (
            Tap("layers.{L}.attn.q_norm", _vllm_q_norm, when="pre", family="norm", note=_VLLM_NOTES["q_norm"]),
            Tap("layers.{L}.attn.wq_b", t0, family="linear", note=_VLLM_NOTES["tp"]))),
        Rule(L(mla + r"q_head_norm$"), (Tap("layers.{L}.attn.q_head_norm",
                                            lambda c: c.output.reshape(c.n_tokens, -1, c.output.shape[-1]),
                                            family="norm", note="ROCm reference path only"),)),
        Rule(L(mla + r"mla_attn$"), (
            Tap("layers.{L}.attn.q_rope", _vllm_mla_heads(0, "q"), when="pre", family="rope",
                note=_VLLM_NOTES["q_rope"], covers=("attn.q_head_norm", "attn.q_rope")),
            Tap("layers.{L}.attn.kv_norm", arg(1, "kv"), when="pre", family="norm", note=_VLLM_NOTES["kv_norm"]),
            Tap("layers.{L}.attn.sparse_attn", _vllm_mla_heads(3, "output"), family="attention",
                note=_VLLM_NOTES["sparse_attn"]))),
        Rule(L(mla + r"compressor$"), (
            Tap("layers.{L}.attn.compressor.wkv", _vllm_kv_score(0), when="pre", family="linear",
                note=_VLLM_NOTES["compressor"], extra=True),
            Tap("layers.{L}.attn.compressor.wgate", _vllm_kv_score(1), when="pre", family="linear",
                note=_VLLM_NOTES["compressor"], extra=True))),
        Rule(L(r"compressor\.(norm|fused_wkv_wgate)$"), SKIP),            # weights read by fused kernels
        Rule(L(mla + r"wo_b$"), (
            Tap("layers.{L}.attn.wo_a", arg(0, "input_"), when="pre", family="linear", note=_VLLM_NOTES["wo_a"]),
            Tap("layers.{L}.attn.wo_b", t0, family="linear"))),
        Rule(L(r"attn(\.mla_attn)?$"), SKIP),                                 # = wo_b output
        Rule(L(r"attn\.indexer\.wq_b$"), (Tap("layers.{L}.attn.indexer.wq_b", t0, family="linear"),)),
        Rule(L(r"attn\.indexer\.weights_proj$"), (Tap("layers.{L}.attn.indexer.weights_proj", t0,
                                                      family="linear"),)),
        Rule(L(r"attn\.indexer\.compressor$"), (
            Tap("layers.{L}.attn.indexer.compressor.wkv", _vllm_kv_score(0), when="pre", family="linear",
                note=_VLLM_NOTES["compressor"], extra=True),
            Tap("layers.{L}.attn.indexer.compressor.wgate", _vllm_kv_score(1), when="pre", family="linear",
                note=_VLLM_NOTES["compressor"], extra=True))),
        Rule(L(r"attn\.indexer$"), (Tap("layers.{L}.attn.indexer.topk", t0, family="indexer",
                                        note=_VLLM_NOTES["indexer.topk"]),)),
        Rule(L(r"ffn\.norm_gate$"), (
            Tap("layers.{L}.ffn_norm", out(0), family="norm", note="NormGateLinear: fused ffn_norm + gate"),
            Tap("layers.{L}.ffn.gate.scores", _vllm_gate_scores, family="router",
                note=_VLLM_NOTES["gate.scores"]))),
        Rule(L(r"ffn\.norm_gate\.(norm|gate)$"), SKIP),
        Rule(L(r"ffn\.experts$"), (Tap("layers.{L}.ffn.experts", _vllm_routed, family="experts", extra=True,
                                       note="DeepseekV4MegaMoEExperts output: routed experts only"),)),
        Rule(L(r"ffn\.shared_experts\.gate_up_proj$"), (
            Tap("layers.{L}.ffn.shared_experts.w1", split(t0, 0, lambda c: _halves(t0)(c)), family="linear",
                note="split from gate_up_proj (w1 | w3)", extra=True),
            Tap("layers.{L}.ffn.shared_experts.w3", split(t0, 1, lambda c: _halves(t0)(c)), family="linear",
                note="split from gate_up_proj (w1 | w3)", extra=True))),
        Rule(L(r"ffn\.shared_experts\.down_proj$"), SKIP),
        Rule(L(r"ffn\.shared_experts$"), (Tap("layers.{L}.ffn.shared_experts", t0, family="experts"),)),
        Rule(L(r"ffn$"), (Tap("layers.{L}.ffn", t0, family="experts", note=_VLLM_NOTES["ffn"]),)),
        Rule(r"(?:^|\.)layers\.(?P<L>\d+)$", SKIP),       # (ffn output, hc_attn.post streams, mixes)
        Rule(r"(?:^|\.)hc_head_op$", (Tap("hc_head", t0, family="mhc"),)),
        Rule(r"(?:^|(?:^|\.)model\.)norm$", (Tap("norm", t0, family="norm"),)),
        Rule(r"(?:^|\.)logits_processor$", (Tap("logits", t0, family="logits", note=_VLLM_NOTES["logits"]),)),
        Rule(r"(?:^|\.)lm_head$", SKIP),
    ]


VLLM = NameMap(
    name="vllm", engine="vllm", rules=_vllm_taps(), dims=_vllm_dims,
    not_observable=(
        "attn.q_head_norm (CUDA: fused with q rope)", "attn.kv_rope", "attn.kv_cache",
        "attn.compressor (written to the paged FP8 cache by a fused kernel)", "attn.indexer.q",
        "attn.indexer.compressor", "attn.indexer.scores", "attn.o_rope", "ffn.gate", "ffn.gate.topk_ids",
        "ffn.experts.<E>",
    ),
    notes=(
        ("Run vLLM with enforce_eager=True and compilation_config=0: CUDA-graph replay and torch.compile'd "
         "regions do not call forward hooks."),
        ("Capture one request (the capture holds one token sequence); logits are only computed for sampled "
        "rows."),
        _VLLM_NOTES["tp"],
    ),
)

BUILTIN: dict[str, NameMap] = {"hf": HF, "vllm": VLLM}


# ---------------------------------------------------------------------------------------------------------
# User maps
# ---------------------------------------------------------------------------------------------------------
def from_user(mapping: Mapping[str, str | None] | Callable[[str, nn.Module], str | None], name: str = "custom"
              ) -> NameMap:
    """A NameMap from {qualified name: site or None} or callable(qualified name, module) -> site | None.
    The site gets the module's first output tensor ([1, S, ...] squeezed to [S, ...]); None skips it."""
    def rule_for(site: str | None, pattern: str) -> Rule:
        return Rule(pattern, SKIP if site is None else (Tap(site.replace("{", "{{").replace("}", "}}"),
                                                            generic_take),))
    if callable(mapping) and not isinstance(mapping, Mapping):
        return _CallableMap(name=name, rules=(), fn=mapping, layer_end_site=None)
    rules = [rule_for(site, rf"^{re.escape(qual)}$") for qual, site in mapping.items()]
    return NameMap(name=name, rules=rules, layer_end_site=None)


@dataclass
class _CallableMap(NameMap):
    fn: Callable[[str, nn.Module], str | None] = field(default=lambda name, module: None)

    def resolve_module(self, name: str, module: nn.Module) -> tuple[tuple[Tap, ...] | str | None, dict]:
        site = self.fn(name, module)
        if site is None:
            return SKIP, {}
        return (Tap(site.replace("{", "{{").replace("}", "}}"), generic_take),), {}


def resolve(nmap: NameMap, name: str, module: nn.Module) -> tuple[tuple[Tap, ...] | str | None, dict]:
    if isinstance(nmap, _CallableMap):
        return nmap.resolve_module(name, module)
    return nmap.resolve(name)


def site_table(nmap: NameMap) -> list[dict[str, Any]]:
    """The map as rows (module pattern, site, when, note, covers, extra): for docs and `--json` output."""
    return [{"module": pattern, "site": tap.site, "when": tap.when, "family": tap.family, "note": tap.note,
             "covers": list(tap.covers), "extra": tap.extra} for pattern, tap in nmap.taps()]


# ---------------------------------------------------------------------------------------------------------
# DeepSeek-native checkpoint names -> transformers' names (dsv4-architecture.md 4.8)
# ---------------------------------------------------------------------------------------------------------
# (native regex, HF replacement), applied in order to the module name; written from the tensor layouts of
# transformers' DeepseekV4 modules. Routed experts are stacked separately (hf_state_dict).
HF_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$", r"model.layers.\1.\2_hc.\3"),
    (r"^layers\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^layers\.(\d+)\.attn\.attn_sink$", r"model.layers.\1.self_attn.sinks"),
    (r"^layers\.(\d+)\.attn\.indexer\.compressor\.", r"model.layers.\1.self_attn.compressor.indexer.#cmp."),
    (r"^layers\.(\d+)\.attn\.indexer\.wq_b$", r"model.layers.\1.self_attn.compressor.indexer.q_b_proj"),
    (r"^layers\.(\d+)\.attn\.indexer\.weights_proj$",
     r"model.layers.\1.self_attn.compressor.indexer.scorer.weights_proj"),
    (r"^layers\.(\d+)\.attn\.compressor\.", r"model.layers.\1.self_attn.compressor.#cmp."),
    (r"#cmp\.wkv$", "kv_proj"), (r"#cmp\.wgate$", "gate_proj"), (r"#cmp\.ape$", "position_bias"),
    (r"#cmp\.norm\.weight$", "kv_norm.weight"),
    (r"^layers\.(\d+)\.attn\.wq_a$", r"model.layers.\1.self_attn.q_a_proj"),
    (r"^layers\.(\d+)\.attn\.q_norm\.", r"model.layers.\1.self_attn.q_a_norm."),
    (r"^layers\.(\d+)\.attn\.wq_b$", r"model.layers.\1.self_attn.q_b_proj"),
    (r"^layers\.(\d+)\.attn\.wkv$", r"model.layers.\1.self_attn.kv_proj"),
    (r"^layers\.(\d+)\.attn\.kv_norm\.", r"model.layers.\1.self_attn.kv_norm."),
    (r"^layers\.(\d+)\.attn\.wo_a$", r"model.layers.\1.self_attn.o_a_proj"),
    (r"^layers\.(\d+)\.attn\.wo_b$", r"model.layers.\1.self_attn.o_b_proj"),
    (r"^layers\.(\d+)\.ffn\.gate$", r"model.layers.\1.mlp.gate"),
    (r"^layers\.(\d+)\.ffn\.gate\.bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    (r"^layers\.(\d+)\.ffn\.gate\.tid2eid$", r"model.layers.\1.mlp.gate.tid2eid"),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w1$", r"model.layers.\1.mlp.shared_experts.gate_proj"),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w2$", r"model.layers.\1.mlp.shared_experts.down_proj"),
    (r"^layers\.(\d+)\.ffn\.shared_experts\.w3$", r"model.layers.\1.mlp.shared_experts.up_proj"),
)
_PLAIN_TENSOR = re.compile(r"(\.weight|_fn|_base|_scale|\.ape|\.attn_sink|\.bias|\.tid2eid)$")
_ROUTED = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])$")


def hf_name(native: str) -> str:
    """HF parameter name of a DeepSeek-native module name (a linear module gets `.weight` appended)."""
    name = native
    for pattern, repl in HF_RENAMES:
        name = re.sub(pattern, repl, name)
    if not name.startswith(("model.", "lm_head")):
        raise KeyError(f"no transformers name for DeepSeek module {native!r}")
    if not name.endswith((".weight", "position_bias", "sinks", "e_score_correction_bias", "tid2eid",
                          ".fn", ".base", ".scale", "hc_fn", "hc_base", "hc_scale")):
        name += ".weight"
    return name


def hf_state_dict(model, layers: Iterable[int] | None = None, dtype: torch.dtype = torch.bfloat16
                  ) -> dict[str, torch.Tensor]:
    """A transformers DeepseekV4ForCausalLM state dict from a dsv4debug Checkpoint: every module
    dequantised exactly (Checkpoint.module(...).dequantize()), linear weights cast to `dtype`, fp32
    tensors (mHC, ape, sinks, gate bias) kept fp32, routed experts stacked as gate_up_proj [E, 2I, D]
    (w1 rows, then w3) and down_proj [E, D, I]. `layers`: main layers to include (default all)."""
    cfg = model.config
    keep = set(range(cfg.n_layers) if layers is None else layers)
    names = list(model.global_module_names())
    for layer in sorted(keep):
        names += model.layer_module_names(layer)
    out: dict[str, torch.Tensor] = {}
    routed: dict[tuple[int, int, str], torch.Tensor] = {}
    for native in names:
        q = model.module(native)
        m = _ROUTED.match(native)
        if m:
            routed[int(m.group(1)), int(m.group(2)), m.group(3)] = q.dequantize(dtype)
            continue
        # plain tensors (norms, embeddings, mHC, ape, sinks, bias, tid2eid) as stored; linears dequantised
        plain = q.fmt in ("f32", "i64", "bf16_plain")
        out[hf_name(native)] = q.tensors[""] if plain else q.dequantize(dtype)
    for layer in sorted({k[0] for k in routed}):
        experts = sorted({k[1] for k in routed if k[0] == layer})
        w13 = [torch.cat([routed[layer, e, "w1"], routed[layer, e, "w3"]], 0) for e in experts]
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(w13)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([routed[layer, e, "w2"] for e in experts])
    return out


def hf_config(model_config) -> Any:
    """transformers' DeepseekV4Config for a dsv4debug ModelConfig (DeepSeek's config.json keys; HF folds
    compress_ratios, num_hash_layers and qk_rope_head_dim in itself). quantization_config is dropped: the
    weights are loaded dequantised."""
    from transformers import DeepseekV4Config
    d = model_config.to_hf()
    d.pop("quantization_config", None)
    return DeepseekV4Config(**d)


def model_config_of(module: nn.Module) -> dict[str, Any] | None:
    """Our ModelConfig (as a dict) for a foreign model's `config`, when it can be read; else None."""
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "to_dict"):
        return None
    from .config import ModelConfig
    d = dict(cfg.to_dict())
    types = d.get("layer_types")
    rates = d.get("compress_rates") or {}
    if "compress_ratios" not in d and types:
        d["compress_ratios"] = [rates.get(t, 0) for t in types]
    if "num_hash_layers" not in d and d.get("mlp_layer_types"):
        d["num_hash_layers"] = sum(t == "hash_moe" for t in d["mlp_layer_types"])
    compress = (d.get("rope_parameters") or {}).get("compress")
    if isinstance(compress, dict):
        d.setdefault("rope_scaling", compress)
    if "qk_rope_head_dim" not in d and getattr(cfg, "qk_rope_head_dim", None):
        d["qk_rope_head_dim"] = cfg.qk_rope_head_dim
    for key in ("quantization_config", "dtype", "name"):      # HF's runtime dtype is not our weight format
        d.pop(key, None)
    try:
        return ModelConfig.from_dict(d, name=str(d.get("model_type", "custom"))).to_dict()
    except Exception:   # noqa: BLE001 - provenance only: fall back to the raw config
        return None
