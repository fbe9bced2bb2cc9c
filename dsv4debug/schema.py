"""The tensor inventory of a DeepSeek-V4 checkpoint: native names, dtypes, shapes (dsv4-architecture.md 4.2-4.6).

Generated from a ModelConfig, so the synthetic writer and the reader's validation use one source of truth.
A *module* is a weight with its format: `layers.3.attn.wq_a` in format fp8 owns `.weight` and `.scale`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig

FP8_BLOCK = 128

# tensor suffixes each stored format owns, with their dtype
FORMAT_TENSORS: dict[str, tuple[tuple[str, torch.dtype], ...]] = {
    "fp8": (("weight", torch.float8_e4m3fn), ("scale", torch.float8_e8m0fnu)),
    "mxfp4": (("weight", torch.int8), ("scale", torch.float8_e8m0fnu)),
    "nvfp4": (("weight", torch.uint8), ("weight_scale", torch.float8_e4m3fn),
              ("weight_scale_2", torch.float32), ("input_scale", torch.float32)),
    "bf16": (("weight", torch.bfloat16),),
}


@dataclass(frozen=True)
class ModuleSpec:
    """One stored weight: `name` is the module path, `shape` the logical [out, in] (or tensor) shape."""
    name: str
    fmt: str                     # fp8 | mxfp4 | nvfp4 | bf16 | f32 | i64 (plain tensors are bf16/f32/i64)
    shape: tuple[int, ...]

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Stored tensor name -> (dtype, shape)."""
        if self.fmt == "f32":
            return {self.name: (torch.float32, self.shape)}
        if self.fmt == "i64":
            return {self.name: (torch.int64, self.shape)}
        if self.fmt == "bf16_plain":
            return {self.name: (torch.bfloat16, self.shape)}
        out, inp = self.shape
        shapes = {
            "fp8": {"weight": (out, inp), "scale": (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))},
            "mxfp4": {"weight": (out, inp // 2), "scale": (out, inp // 32)},
            "nvfp4": {"weight": (out, inp // 2), "weight_scale": (out, inp // 16),
                      "weight_scale_2": (), "input_scale": ()},
            "bf16": {"weight": (out, inp)},
        }[self.fmt]
        return {f"{self.name}.{suffix}": (dtype, shapes[suffix]) for suffix, dtype in FORMAT_TENSORS[self.fmt]}


def _lin(name: str, out: int, inp: int, fmt: str = "fp8") -> ModuleSpec:
    return ModuleSpec(name, fmt, (out, inp))


def _vec(name: str, n: int, fmt: str = "bf16_plain") -> ModuleSpec:
    return ModuleSpec(name, fmt, (n,))


def global_modules(cfg: ModelConfig) -> list[ModuleSpec]:
    D, M, V = cfg.dim, cfg.hc_mult, cfg.vocab_size
    return [
        ModuleSpec("embed.weight", "bf16_plain", (V, D)),
        ModuleSpec("head.weight", "bf16_plain", (V, D)),
        _vec("norm.weight", D),
        ModuleSpec("hc_head_fn", "f32", (M, M * D)),
        _vec("hc_head_base", M, "f32"),
        _vec("hc_head_scale", 1, "f32"),
    ]


def block_prefix(cfg: ModelConfig, layer: int) -> str:
    """Main layers are `layers.{i}.`; layer index n_layers + j is MTP block `mtp.{j}.`."""
    return f"layers.{layer}." if layer < cfg.n_layers else f"mtp.{layer - cfg.n_layers}."


def expert_format(cfg: ModelConfig, layer: int) -> str:
    # ModelOpt's NVFP4 export replaces only the main layers' routed experts; mtp.* stays MXFP4.
    if cfg.expert_format == "nvfp4" and layer >= cfg.n_layers:
        return "mxfp4"
    return cfg.expert_format


def layer_weight_bytes(cfg: ModelConfig) -> int:
    """The largest main layer's stored weights in bytes: what streaming a layer at a time holds at once."""
    return max(sum(math.prod(shape) * dtype.itemsize for m in block_modules(cfg, layer)
                   for dtype, shape in m.tensors().values()) for layer in range(cfg.n_layers))


def block_modules(cfg: ModelConfig, layer: int) -> list[ModuleSpec]:
    p = block_prefix(cfg, layer)
    D, M, H, d, Q = cfg.dim, cfg.hc_mult, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
    G, R, I, E = cfg.o_groups, cfg.o_lora_rank, cfg.moe_inter_dim, cfg.n_routed_experts
    n_mix = (2 + M) * M
    ratio = cfg.compress_ratio(layer)
    mods = [
        ModuleSpec(p + "hc_attn_fn", "f32", (n_mix, M * D)), _vec(p + "hc_attn_base", n_mix, "f32"),
        _vec(p + "hc_attn_scale", 3, "f32"),
        ModuleSpec(p + "hc_ffn_fn", "f32", (n_mix, M * D)), _vec(p + "hc_ffn_base", n_mix, "f32"),
        _vec(p + "hc_ffn_scale", 3, "f32"),
        _vec(p + "attn_norm.weight", D), _vec(p + "ffn_norm.weight", D),
        _vec(p + "attn.attn_sink", H, "f32"),
        _lin(p + "attn.wq_a", Q, D), _vec(p + "attn.q_norm.weight", Q),
        _lin(p + "attn.wq_b", H * d, Q),
        _lin(p + "attn.wkv", d, D), _vec(p + "attn.kv_norm.weight", d),
        _lin(p + "attn.wo_a", G * R, H * d // G), _lin(p + "attn.wo_b", D, G * R),
    ]
    if ratio:
        c = 2 if ratio == 4 else 1   # the ratio-4 compressor has two overlapping halves
        mods += [
            _vec(p + "attn.compressor.norm.weight", d),
            ModuleSpec(p + "attn.compressor.ape", "f32", (ratio, c * d)),
            _lin(p + "attn.compressor.wkv", c * d, D, "bf16"),
            _lin(p + "attn.compressor.wgate", c * d, D, "bf16"),
        ]
    if ratio == 4:
        IH, ID = cfg.index_n_heads, cfg.index_head_dim
        mods += [
            _lin(p + "attn.indexer.wq_b", IH * ID, Q),
            _lin(p + "attn.indexer.weights_proj", IH, D, "bf16"),
            ModuleSpec(p + "attn.indexer.compressor.ape", "f32", (4, 2 * ID)),
            _lin(p + "attn.indexer.compressor.wkv", 2 * ID, D, "bf16"),
            _lin(p + "attn.indexer.compressor.wgate", 2 * ID, D, "bf16"),
            _vec(p + "attn.indexer.compressor.norm.weight", ID),
        ]
    mods.append(_lin(p + "ffn.gate", E, D, "bf16"))
    if cfg.is_hash_layer(layer):
        mods.append(ModuleSpec(p + "ffn.gate.tid2eid", "i64", (cfg.vocab_size, cfg.n_activated_experts)))
    else:
        mods.append(_vec(p + "ffn.gate.bias", E, "f32"))
    mods += [_lin(p + "ffn.shared_experts.w1", I, D), _lin(p + "ffn.shared_experts.w3", I, D),
             _lin(p + "ffn.shared_experts.w2", D, I)]
    efmt = expert_format(cfg, layer)
    for e in range(E):
        mods += [_lin(p + f"ffn.experts.{e}.w1", I, D, efmt), _lin(p + f"ffn.experts.{e}.w3", I, D, efmt),
                 _lin(p + f"ffn.experts.{e}.w2", D, I, efmt)]
    if layer >= cfg.n_layers:   # MTP block extras
        mods += [_lin(p + "e_proj", D, D), _lin(p + "h_proj", D, D), _vec(p + "enorm.weight", D),
                 _vec(p + "hnorm.weight", D), _vec(p + "norm.weight", D),
                 ModuleSpec(p + "hc_head_fn", "f32", (M, M * D)), _vec(p + "hc_head_base", M, "f32"),
                 _vec(p + "hc_head_scale", 1, "f32")]
    return mods


def all_modules(cfg: ModelConfig) -> list[ModuleSpec]:
    mods = global_modules(cfg)
    for layer in range(cfg.n_layers + cfg.n_mtp_layers):
        mods += block_modules(cfg, layer)
    return mods


def tensor_inventory(cfg: ModelConfig) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every stored tensor name -> (dtype, shape) for this config."""
    inv: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for m in all_modules(cfg):
        inv.update(m.tensors())
    return inv
