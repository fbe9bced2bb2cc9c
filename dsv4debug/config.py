"""DeepSeek-V4 model configuration: HF `config.json`, DeepSeek `inference/config.json`, presets.

Field names follow DeepSeek's `ModelArgs` (inference/model.py); `HF_KEYS` maps the HF names onto them.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import BadInput

# Layer attention types by compress ratio (dsv4-architecture.md 2.2).
SWA, CSA, HCA = "SWA", "CSA", "HCA"
RATIO_TO_TYPE = {0: SWA, 4: CSA, 128: HCA}
EXPERT_FORMATS = ("mxfp4", "nvfp4", "fp8", "bf16")

# HF config.json key -> ModelArgs field.
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_hash_layers": "n_hash_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "swiglu_limit": "swiglu_limit",
    "q_lora_rank": "q_lora_rank",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta",
    "compress_ratios": "compress_ratios",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "rms_norm_eps": "norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "expert_dtype": "expert_dtype",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "norm_topk_prob": "norm_topk_prob",
    "topk_method": "topk_method",
    "hidden_act": "hidden_act",
    "num_key_value_heads": "n_kv_heads",
    "tie_word_embeddings": "tie_word_embeddings",
}
# HF rope_scaling sub-keys -> ModelArgs field.
ROPE_SCALING_KEYS = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "original_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
}


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    dim: int = 7168
    moe_inter_dim: int = 3072
    n_layers: int = 61
    n_hash_layers: int = 3
    n_mtp_layers: int = 1
    n_heads: int = 128
    n_kv_heads: int = 1
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    route_scale: float = 2.5
    swiglu_limit: float = 10.0
    q_lora_rank: int = 1536
    head_dim: int = 512
    rope_head_dim: int = 64
    o_groups: int = 16
    o_lora_rank: int = 1024
    window_size: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # One ratio per main layer plus one per MTP layer (the MTP ratio is 0: SWA).
    compress_ratios: list[int] = field(default_factory=lambda: [128, 128] + [4, 128] * 29 + [4, 0])
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 1024
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    dtype: str = "fp8"
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    # How routed experts are stored: "mxfp4" (official), "nvfp4" (ModelOpt), "fp8", "bf16".
    expert_format: str = "mxfp4"
    quantization_config: dict[str, Any] = field(default_factory=lambda: {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
    name: str = "custom"

    # ---- derived structure -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def compress_ratio(self, layer: int) -> int:
        """Ratio of main layer `layer`; layer == n_layers + j is MTP block j."""
        return self.compress_ratios[layer]

    def layer_type(self, layer: int) -> str:
        return RATIO_TO_TYPE[self.compress_ratio(layer)]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < min(self.n_hash_layers, self.n_layers)

    def layer_types(self) -> list[str]:
        return [self.layer_type(i) for i in range(self.n_layers)]

    def validate(self) -> ModelConfig:
        """Check the structural constraints the model and the checkpoint formats rely on."""
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise BadInput(f"config '{self.name}': {what}")
        need(len(self.compress_ratios) >= self.n_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries, need >= n_layers={self.n_layers}")
        need(all(r in RATIO_TO_TYPE for r in self.compress_ratios),
             f"compress_ratios {sorted(set(self.compress_ratios))} may only hold 0, 4, 128")
        need(self.rope_head_dim == 64, "rope_head_dim must be 64")
        need(self.nope_head_dim > 0 and self.nope_head_dim % 64 == 0,
             f"head_dim - rope_head_dim = {self.nope_head_dim} must be a positive multiple of 64 (FP8 sim blocks)")
        need(self.n_heads % self.o_groups == 0, f"n_heads={self.n_heads} not divisible by o_groups={self.o_groups}")
        need(self.index_head_dim & (self.index_head_dim - 1) == 0 and self.index_head_dim % 32 == 0,
             f"index_head_dim={self.index_head_dim} must be a power of two >= 32 (Hadamard, FP4 sim blocks)")
        need(self.index_head_dim > self.rope_head_dim, "index_head_dim must exceed rope_head_dim")
        for name in ("dim", "q_lora_rank", "moe_inter_dim", "o_lora_rank"):
            need(getattr(self, name) % 128 == 0, f"{name}={getattr(self, name)} must be a multiple of 128 (FP8 blocks)")
        need(1 <= self.n_activated_experts <= self.n_routed_experts,
             f"n_activated_experts={self.n_activated_experts} must be in 1..n_routed_experts={self.n_routed_experts}")
        need(self.n_shared_experts == 1, "n_shared_experts must be 1 (asserted by DeepSeek's code)")
        need(self.hc_mult >= 1, "hc_mult must be >= 1")
        need(self.expert_format in EXPERT_FORMATS, f"expert_format must be one of {EXPERT_FORMATS}")
        need(self.score_func == "sqrtsoftplus", f"score_func {self.score_func!r} unsupported (V4 uses sqrtsoftplus)")
        return self

    def summary(self) -> dict[str, Any]:
        types = self.layer_types()
        return {
            "name": self.name, "dim": self.dim, "n_layers": self.n_layers, "n_heads": self.n_heads,
            "head_dim": self.head_dim, "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups,
            "n_routed_experts": self.n_routed_experts, "n_activated_experts": self.n_activated_experts,
            "moe_inter_dim": self.moe_inter_dim, "vocab_size": self.vocab_size,
            "expert_format": self.expert_format, "n_hash_layers": min(self.n_hash_layers, self.n_layers),
            "layer_types": {t: types.count(t) for t in (HCA, CSA, SWA)}, "n_mtp_layers": self.n_mtp_layers,
        }

    # ---- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_hf(self) -> dict[str, Any]:
        """An HF-style config.json as DeepSeek ships it."""
        out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                               "torch_dtype": "bfloat16"}
        for hf, ours in HF_KEYS.items():
            out[hf] = getattr(self, ours)
        out["rope_scaling"] = {"type": "yarn", **{hf: getattr(self, ours) for hf, ours in ROPE_SCALING_KEYS.items()}}
        out["quantization_config"] = dict(self.quantization_config)
        if self.expert_format == "nvfp4":
            out["quantization_config"].update({
                "moe_quant_algo": "NVFP4", "quant_algo": "MIXED_PRECISION", "group_size": 16,
                "producer": {"name": "modelopt", "version": "dsv4-nvfp4-experts"},
                "ignore": ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]})
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str = "custom", source: str = "config") -> ModelConfig:
        """Build from an HF config.json dict, a DeepSeek inference/config.json dict, or our own to_dict()."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in d.items():
            if key in HF_KEYS:
                kw[HF_KEYS[key]] = value
            elif key == "rope_scaling" and isinstance(value, dict):
                for sub, ours in ROPE_SCALING_KEYS.items():
                    if sub in value:
                        kw[ours] = value[sub]
            elif key in known:
                kw[key] = value
        kw.setdefault("name", name)
        qc = d.get("quantization_config") or {}
        if "expert_format" not in d:
            if str(qc.get("moe_quant_algo", "")).upper() == "NVFP4":
                kw["expert_format"] = "nvfp4"
            elif kw.get("expert_dtype", "fp4") == "fp8":
                kw["expert_format"] = "fp8"
        try:
            cfg = cls(**kw)
        except TypeError as e:
            raise BadInput(f"{source}: {e}") from None
        n_total = cfg.n_layers + cfg.n_mtp_layers
        if len(cfg.compress_ratios) == cfg.n_layers:   # some configs omit the MTP entry: MTP is SWA
            cfg.compress_ratios = list(cfg.compress_ratios) + [0] * cfg.n_mtp_layers
        if len(cfg.compress_ratios) < n_total:
            raise BadInput(f"{source}: compress_ratios has {len(cfg.compress_ratios)} entries, "
                           f"need n_layers + n_mtp_layers = {n_total}")
        return cfg.validate()

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise BadInput(f"{path}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadInput(f"{path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise BadInput(f"{path}: expected a JSON object")
        return cls.from_dict(d, name=path.parent.name or "custom", source=str(path))

    # ---- presets -------------------------------------------------------------------------------
    def shrink(self, layers: int | None = None, experts: int | None = None) -> ModelConfig:
        """Fewer main layers (keeping the first ones and the MTP ratio) and/or fewer routed experts."""
        cfg = dataclasses.replace(self, compress_ratios=list(self.compress_ratios))
        if layers is not None:
            if not 1 <= layers <= self.n_layers:
                raise BadInput(f"--layers {layers}: must be in 1..{self.n_layers}")
            cfg.compress_ratios = self.compress_ratios[:layers] + self.compress_ratios[self.n_layers:]
            cfg.n_layers = layers
        if experts is not None:
            if experts < 1:
                raise BadInput(f"--experts {experts}: must be >= 1")
            cfg.n_routed_experts = experts
            cfg.n_activated_experts = min(self.n_activated_experts, experts)
        return cfg.validate()


def _pro() -> ModelConfig:
    return ModelConfig(name="pro")


def _flash() -> ModelConfig:
    return ModelConfig(
        name="flash", dim=4096, moe_inter_dim=2048, n_layers=43, n_heads=64, n_routed_experts=256,
        route_scale=1.5, q_lora_rank=1024, o_groups=8, index_topk=512,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])


def _tiny() -> ModelConfig:
    # Every structure of V4 at CPU-friendly size: SWA/CSA/HCA layers, hash routing on SWA, HCA and CSA
    # layers and score routing on each type, real head_dim 512 (448 nope + 64 rope), 128-wide indexer
    # heads, FP8 128-blocks on every linear, window 128 and ratios 4/128 as in the real model.
    return ModelConfig(
        name="tiny", vocab_size=2048, dim=256, moe_inter_dim=128, n_layers=6, n_hash_layers=3, n_heads=4,
        n_routed_experts=8, n_activated_experts=2, route_scale=2.5, q_lora_rank=128, o_groups=2,
        o_lora_rank=128, index_n_heads=4, index_topk=16, compress_ratios=[0, 128, 4, 128, 4, 0, 0])


PRESETS = {"tiny": _tiny, "flash": _flash, "pro": _pro}


def preset(name: str, layers: int | None = None, experts: int | None = None,
           expert_format: str | None = None) -> ModelConfig:
    if name not in PRESETS:
        raise BadInput(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]()
    if expert_format is not None:
        cfg.expert_format = expert_format
    return cfg.shrink(layers, experts)
