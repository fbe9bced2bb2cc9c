"""Reading DeepSeek-V4 checkpoints: the official FP8 + MXFP4 release, NVIDIA's NVFP4 one, our synthetic ones.

`Checkpoint.open(path)` reads config.json and the safetensors headers only, and validates the whole tensor
inventory against schema.py (cheap: no tensor data). Tensors are memory-mapped views read on demand, so
`module()` on layer i touches layer i's bytes only. `verify()` reads every tensor and checks its values.

Policy for tensors the schema does not know: one that contradicts config.json (a layer, MTP block or expert
index beyond the config, a compressor/indexer in a layer whose ratio has none, hash-routing tensors in a
score layer) is an error; any other is ignored with a warning in `Checkpoint.warnings`.
Every problem raises BadInput with one message naming the tensor and the file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .checkpoint_checks import check_module, pair_warnings
from .config import ModelConfig
from .errors import BadInput
from .formats import PLAIN_FORMATS, QWeight
from .safetensors_io import DTYPE_NAMES, SafetensorsFile, TensorEntry
from .schema import ModuleSpec, all_modules, block_modules, block_prefix, global_modules
from .synth import INDEX_NAME, default_checkpoint, make_checkpoint, synth_module

__all__ = ["Checkpoint", "default_checkpoint", "make_checkpoint", "synth_module"]

SINGLE_NAME = "model.safetensors"
_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.w[123]$")
_EXPERT_DTYPES = {"I8": "mxfp4", "F8_E4M3": "fp8", "BF16": "bf16"}
# tensor name fragment -> config.json keys that decide its shape (first match wins), for error messages
_SHAPE_KEYS = (
    ("tid2eid", ("vocab_size", "num_experts_per_tok")),
    ("ffn.experts.", ("moe_intermediate_size", "hidden_size")),
    ("ffn.shared_experts.", ("moe_intermediate_size", "hidden_size")),
    ("ffn.gate", ("n_routed_experts", "hidden_size")),
    ("indexer.", ("index_n_heads", "index_head_dim", "q_lora_rank", "hidden_size")),
    ("compressor.", ("head_dim", "hidden_size")),
    ("embed.", ("vocab_size", "hidden_size")),
    ("head.", ("vocab_size", "hidden_size")),
    ("hc_", ("hc_mult", "hidden_size")),
    ("attn_sink", ("num_attention_heads",)),
    ("attn.wo_", ("o_groups", "o_lora_rank", "num_attention_heads", "head_dim", "hidden_size")),
    ("attn.wq_", ("q_lora_rank", "num_attention_heads", "head_dim", "hidden_size")),
    ("attn.q_norm", ("q_lora_rank",)),
    ("attn.", ("head_dim", "hidden_size")),
    ("", ("hidden_size",)),
)


class Checkpoint:
    """A validated, lazily read checkpoint. Build it with `Checkpoint.open(path)`."""

    def __init__(self, path: Path, config: ModelConfig, files: dict[str, SafetensorsFile],
                 entries: dict[str, TensorEntry], listing: Path, identity_source: bytes):
        self.path = path
        self.config = config
        self.files = files                  # file name -> parsed file
        self.entries = entries              # tensor name -> where its bytes are
        self.listing = listing              # the index json, or the single file
        self.warnings: list[str] = []
        self._identity_source = identity_source
        self.specs: dict[str, ModuleSpec] = {}

    # ---- opening ----------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """A directory with config.json plus model.safetensors.index.json and shards (or one
        model.safetensors), or the path of a single .safetensors file next to its config.json."""
        path = Path(path)
        if path.is_file():
            directory, single = path.parent, path
        elif path.is_dir():
            directory = path
            single = None if (path / INDEX_NAME).exists() else path / SINGLE_NAME
            if single is not None and not single.exists():
                raise BadInput(f"{path}: no {INDEX_NAME} and no {SINGLE_NAME}; not a checkpoint directory")
        else:
            raise BadInput(f"{path}: no such checkpoint (file or directory)")
        config = ModelConfig.from_file(directory / "config.json")
        ckpt = cls._open_single(directory, single, config) if single else cls._open_index(directory, config)
        ckpt._validate()
        return ckpt

    @classmethod
    def _open_single(cls, directory: Path, single: Path, config: ModelConfig) -> Checkpoint:
        f = SafetensorsFile(single)
        return cls(directory, config, {single.name: f}, dict(f.entries), single, f.header_bytes)

    @classmethod
    def _open_index(cls, directory: Path, config: ModelConfig) -> Checkpoint:
        index_path = directory / INDEX_NAME
        raw = index_path.read_bytes()
        weight_map = _parse_index(index_path, raw)
        files: dict[str, SafetensorsFile] = {}
        for shard in dict.fromkeys(weight_map.values()):
            if not (directory / shard).is_file():
                example = next(t for t, s in weight_map.items() if s == shard)
                raise BadInput(f"{directory / shard}: shard listed in {INDEX_NAME} (e.g. for tensor "
                               f"'{example}') is missing")
            files[shard] = SafetensorsFile(directory / shard)
        entries = {}
        for tensor, shard in weight_map.items():
            if tensor not in files[shard].entries:
                raise BadInput(f"tensor '{tensor}': {INDEX_NAME} puts it in {shard}, whose header lacks it")
            entries[tensor] = files[shard].entries[tensor]
        ckpt = cls(directory, config, files, entries, index_path, raw)
        for shard, f in files.items():
            stray = [n for n in f.entries if weight_map.get(n) != shard]
            if stray:
                ckpt.warnings.append(f"{shard}: {len(stray)} tensor(s) not listed in {INDEX_NAME} for this "
                                     f"shard, ignored (e.g. '{stray[0]}')")
        return ckpt

    def file_of(self, tensor: str) -> str:
        """The file holding `tensor` (the listing if it is absent), for messages."""
        e = self.entries.get(tensor)
        return str(e.path) if e else str(self.listing)

    # ---- validation (headers only) -------------------------------------------------------------------------

    def _validate(self) -> None:
        cfg = self.config
        claimed = cfg.expert_format
        detected = self._detect_expert_formats()
        self.specs = {s.name: dataclasses.replace(s, fmt=detected.get(s.name, s.fmt)) for s in all_modules(cfg)}
        main = [fmt for name, fmt in detected.items() if name.startswith("layers.")]
        if main:
            cfg.expert_format = main[0]
            if claimed != cfg.expert_format:
                self.warnings.append(f"config.json implies {claimed} routed experts but the tensors are "
                                     f"{cfg.expert_format}; using {cfg.expert_format}")
        for spec in self.specs.values():
            for tensor, (dtype, shape) in spec.tensors().items():
                self._check_tensor(spec, tensor, dtype, shape)
        self._check_unknown({t for s in self.specs.values() for t in s.tensors()})

    def _detect_expert_formats(self) -> dict[str, str]:
        """Routed expert module -> its stored format, from the tensors' dtypes; main layers must agree."""
        formats: dict[str, str] = {}
        first_main: str | None = None
        for spec in all_modules(self.config):
            if not _EXPERT.match(spec.name) or spec.name + ".weight" not in self.entries:
                continue
            fmt = self._expert_format(spec.name)
            formats[spec.name] = fmt
            if spec.name.startswith("layers."):
                first_main = first_main or spec.name
                if fmt != formats[first_main]:
                    raise BadInput(f"tensor '{spec.name}.weight' in {self.file_of(spec.name + '.weight')} is "
                                   f"{fmt} but '{first_main}' is {formats[first_main]}: the main layers' routed "
                                   "experts must share one format")
        return formats

    def _expert_format(self, module: str) -> str:
        w = self.entries[module + ".weight"]
        if w.dtype_name == "U8" and module + ".weight_scale" in self.entries:
            return "nvfp4"
        if w.dtype_name in _EXPERT_DTYPES:
            return _EXPERT_DTYPES[w.dtype_name]
        raise BadInput(f"tensor '{w.name}' in {w.path}: dtype {w.dtype_name} is no known routed-expert format "
                       "(I8 + F8_E8M0 .scale = MXFP4, U8 + F8_E4M3 .weight_scale = NVFP4, F8_E4M3 = FP8, BF16)")

    def _check_tensor(self, spec: ModuleSpec, tensor: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        e = self.entries.get(tensor)
        if e is None:
            raise BadInput(f"tensor '{tensor}' ({spec.fmt} module '{spec.name}') is missing from "
                           f"{self.listing}; config.json expects it ({self._config_hint(tensor)})")
        if e.dtype != dtype:
            raise BadInput(f"tensor '{tensor}' in {e.path} has dtype {e.dtype_name}, expected "
                           f"{DTYPE_NAMES[dtype]} for a {spec.fmt} module")
        if e.shape != tuple(shape):
            raise BadInput(f"tensor '{tensor}' in {e.path} has shape {list(e.shape)}, expected {list(shape)} "
                           f"from config.json ({self._shape_hint(tensor)})")

    def _check_unknown(self, expected: set[str]) -> None:
        for name in sorted(self.entries.keys() - expected):
            contradiction = self._contradiction(name)
            if contradiction:
                raise BadInput(f"tensor '{name}' in {self.file_of(name)} contradicts config.json: {contradiction}")
            self.warnings.append(f"tensor '{name}' in {self.file_of(name)} is not part of DeepSeek-V4's "
                                 "inventory; ignored")

    def _contradiction(self, name: str) -> str | None:
        cfg = self.config
        layer = _layer_of(cfg, name)
        if layer is None:
            return None
        if name.startswith("layers.") and layer >= cfg.n_layers:
            return f"num_hidden_layers={cfg.n_layers} but the checkpoint has layer {layer}"
        if layer >= cfg.n_layers + cfg.n_mtp_layers:
            block = ".".join(name.split(".")[:2])
            return f"num_nextn_predict_layers={cfg.n_mtp_layers} but the checkpoint has {block}"
        expert = re.search(r"\.ffn\.experts\.(\d+)\.", name)
        if expert and int(expert[1]) >= cfg.n_routed_experts:
            return f"n_routed_experts={cfg.n_routed_experts} but the checkpoint has expert {expert[1]}"
        if ".attn.compressor." in name or ".attn.indexer." in name:
            return f"compress_ratios[{layer}]={cfg.compress_ratio(layer)} gives this layer no such tensor"
        if name.endswith(("ffn.gate.tid2eid", "ffn.gate.bias")):
            return (f"num_hash_layers={cfg.n_hash_layers} makes layer {layer} "
                    f"{'hash' if cfg.is_hash_layer(layer) else 'score'}-routed")
        return None

    def _config_hint(self, tensor: str) -> str:
        cfg = self.config
        layer = _layer_of(cfg, tensor)
        if re.search(r"\.ffn\.experts\.\d+\.", tensor):
            return f"n_routed_experts={cfg.n_routed_experts}"
        if layer is not None and (".attn.compressor." in tensor or ".attn.indexer." in tensor):
            return f"compress_ratios[{layer}]={cfg.compress_ratio(layer)}"
        if tensor.endswith(("gate.tid2eid", "gate.bias")):
            return f"num_hash_layers={cfg.n_hash_layers}"
        if layer is not None:
            return f"num_hidden_layers={cfg.n_layers}, num_nextn_predict_layers={cfg.n_mtp_layers}"
        return "every DeepSeek-V4 checkpoint has it"

    def _shape_hint(self, tensor: str) -> str:
        hf = self.config.to_hf()
        keys = next(keys for fragment, keys in _SHAPE_KEYS if fragment in tensor)
        return ", ".join(f"{k}={hf[k]}" for k in keys)

    # ---- reading ----------------------------------------------------------------------------------------

    def tensor(self, name: str) -> torch.Tensor:
        """One stored tensor, raw (a copy-on-write view of the file's bytes)."""
        e = self.entries.get(name)
        if e is None:
            raise BadInput(f"tensor '{name}' is not in {self.listing}")
        return self.files[e.path.name].read(e)

    def module(self, name: str) -> QWeight:
        """One module (schema.ModuleSpec.name, e.g. 'layers.3.attn.wq_a') with its stored tensors."""
        spec = self.specs.get(name)
        if spec is None:
            raise BadInput(f"'{name}' is no module of this checkpoint (see `dsv4debug checkpoint info`)")
        plain = spec.fmt in PLAIN_FORMATS
        return QWeight(name, spec.fmt, {("" if plain else t[len(name) + 1:]): self.tensor(t) for t in spec.tensors()})

    def layer_module_names(self, layer: int) -> list[str]:
        """Module names of main layer `layer`; index n_layers + j is MTP block j."""
        if not 0 <= layer < self.config.n_layers + self.config.n_mtp_layers:
            raise BadInput(f"layer {layer}: this checkpoint has layers 0..{self.config.n_layers - 1} and "
                           f"{self.config.n_mtp_layers} MTP block(s)")
        return [s.name for s in block_modules(self.config, layer)]

    def global_module_names(self) -> list[str]:
        return [s.name for s in global_modules(self.config)]

    # ---- description --------------------------------------------------------------------------------------

    @property
    def identity(self) -> dict[str, Any]:
        """Provenance for captures: where, how big, a content hash of the listing, the formats."""
        return {
            "path": str(self.path.resolve()),
            "total_bytes": sum(f.size for f in self.files.values()),
            "sha256": hashlib.sha256(self._identity_source).hexdigest(),
            "sha256_of": INDEX_NAME if self.listing.name == INDEX_NAME else f"{self.listing.name} header",
            "format": f"fp8 + {self.config.expert_format} experts",
            "expert_format": self.config.expert_format,
            "n_files": len(self.files),
            "n_tensors": len(self.entries),
        }

    def _module_bytes(self, names: list[str]) -> int:
        return sum(self.entries[t].nbytes for n in names for t in self.specs[n].tensors())

    def info(self) -> dict[str, Any]:
        """Config summary, a row per layer, and sizes per module format and per dtype."""
        cfg = self.config
        layers = []
        for layer in range(cfg.n_layers + cfg.n_mtp_layers):
            names = self.layer_module_names(layer)
            expert_fmts = sorted({self.specs[n].fmt for n in names if _EXPERT.match(n)})
            layers.append({
                "layer": layer, "prefix": block_prefix(cfg, layer).rstrip("."), "type": cfg.layer_type(layer),
                "compress_ratio": cfg.compress_ratio(layer),
                "routing": "hash" if cfg.is_hash_layer(layer) else "score",
                "experts": "+".join(expert_fmts), "modules": len(names), "bytes": self._module_bytes(names)})
        formats: dict[str, dict[str, int]] = {}
        for spec in self.specs.values():
            row = formats.setdefault(spec.fmt, {"modules": 0, "tensors": 0, "bytes": 0})
            row["modules"] += 1
            row["tensors"] += len(spec.tensors())
            row["bytes"] += self._module_bytes([spec.name])
        dtypes: dict[str, dict[str, int]] = {}
        for e in self.entries.values():
            row = dtypes.setdefault(e.dtype_name, {"tensors": 0, "bytes": 0})
            row["tensors"] += 1
            row["bytes"] += e.nbytes
        return {"identity": self.identity, "config": cfg.summary(), "layers": layers,
                "globals": {"modules": len(self.global_module_names()),
                            "bytes": self._module_bytes(self.global_module_names())},
                "formats": formats, "dtypes": dtypes, "warnings": list(self.warnings)}

    # ---- deep verification -----------------------------------------------------------------------------------

    def verify(self, progress: Any = None) -> dict[str, Any]:
        """Read every tensor and check its values (scales, NaN/Inf, routing tables); BadInput on the first
        problem. `progress`: a rich Progress (optional). Returns a summary."""
        t0 = time.perf_counter()
        total = sum(e.nbytes for e in self.entries.values())
        task = progress.add_task("verifying", total=total) if progress else None
        warnings = list(self.warnings)
        for name, spec in self.specs.items():
            qw = self.module(name)
            check_module(self, spec, qw)
            warnings += pair_warnings(self, spec)
            if progress:
                progress.advance(task, qw.nbytes)
        counts = Counter(s.fmt for s in self.specs.values())
        return {"ok": True, "path": str(self.path), "modules": len(self.specs), "tensors": len(self.entries),
                "bytes_read": total, "formats": dict(counts), "seconds": round(time.perf_counter() - t0, 3),
                "warnings": warnings}


def _parse_index(path: Path, raw: bytes) -> dict[str, str]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise BadInput(f"{path}: no \"weight_map\" object of tensor name -> shard file name")
    for tensor, shard in weight_map.items():
        if Path(shard).name != shard or not shard:
            raise BadInput(f"{path}: tensor '{tensor}' maps to {shard!r}, which is not a file name in this "
                           "directory")
    return weight_map


def _layer_of(cfg: ModelConfig, tensor: str) -> int | None:
    m = re.match(r"^(layers|mtp)\.(\d+)\.", tensor)
    if not m:
        return None
    return int(m[2]) + (cfg.n_layers if m[1] == "mtp" else 0)
