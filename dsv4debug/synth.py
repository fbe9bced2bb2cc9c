"""Synthetic DeepSeek-V4 checkpoints in the real formats, names and layout (DESIGN.md "Checkpoints").

Every module's values depend on (seed, module name) alone and come from a counter-based integer hash, so a
layer can be regenerated on any device bit for bit (`synth_module(..., device="cuda")` equals what
`make_checkpoint` wrote on the CPU). Normals are Irwin-Hall sums of four 16-bit uniforms (exact integer
arithmetic, one rounding), which bounds them at +-3.46 sigma.

Statistics keep activations in realistic ranges through every layer: linears ~ N(0, 1/fan_in) with output
projections scaled by 1/sqrt(2 n_layers), norms ~ 1, mHC mixing close to identity on the residual streams.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig, preset
from .errors import BadInput
from .formats import (
    E2M1_MAX,
    E4M3_MAX,
    E8M0,
    PLAIN_FORMATS,
    QWeight,
    exact_compile,
    fp8_block_quantize,
    mxfp4_quantize,
    mxfp4_to_nvfp4,
)
from .safetensors_io import safetensors_writer
from .schema import ModuleSpec, block_modules, global_modules

SYNTH_VERSION = "1"
INDEX_NAME = "model.safetensors.index.json"
CHUNK_ELEMENTS = 1 << 20        # values generated and encoded ~4 MB of float32 at a time: bounded memory
GPU_CHUNK_ELEMENTS = 1 << 26    # on a GPU, 64M at a time: ~20 launches a chunk, so 1M chunks were launch-bound
HASH_SLICE = 1 << 14            # CPU hash slices: stay in cache (2-3x faster) and under torch's parallel grain
SHARD_BLOCKS = 2                # at most this many layers per shard ...
SHARD_BYTES = 4 << 30           # ... and about this many bytes (a bigger layer gets a shard of its own)
COMB_DIAG = 3.0                 # hc_*_base comb part = 3 * identity: the residual mostly carries through
SYNTH_ACT_AMAX = 16.0           # NVFP4 input_scale = act_amax / (6 * 448); stands in for calibration


# ---- deterministic counter-based normals ---------------------------------------------------------------

def _int64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _splitmix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 counters (wrapping arithmetic)."""
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def _hash_bits(key: int, start: int, count: int, device: torch.device) -> torch.Tensor:
    """splitmix64 of counters start..start+count-1 under `key`: [count] int64 of uniform bits."""
    return _splitmix(torch.arange(start, start + count, dtype=torch.int64, device=device) * _GOLDEN + key)


def _irwin_hall(z: torch.Tensor) -> torch.Tensor:
    """int64 uniform bits -> float32 ~ N(0, 1): the sum of their four 16-bit parts, centred and scaled."""
    s = (z & 0xFFFF) + (_srl(z, 16) & 0xFFFF) + (_srl(z, 32) & 0xFFFF) + _srl(z, 48)
    return (s - 2 * 0xFFFF).float() * (math.sqrt(3.0) / 65536)


def gaussian(key: int, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[count] float32 ~ N(0, 1) (Irwin-Hall of four 16-bit uniforms), element i a function of (key, start+i)."""
    device = torch.device(device)
    out = torch.empty(count, dtype=torch.float32, device=device)
    step = count if device.type == "cuda" else HASH_SLICE
    for a in range(0, count, step):
        out[a:a + step] = _irwin_hall(_hash_bits(key, start + a, min(step, count - a), device))
    return out


def module_key(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"dsv4debug-synth/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


# ---- per-module statistics ------------------------------------------------------------------------------

def _stats(cfg: ModelConfig, spec: ModuleSpec) -> tuple[float, float]:
    """(mean, std) of a module's values."""
    leaf = spec.name.rsplit(".", 1)[-1]
    if spec.name == "embed.weight":
        return 0.0, 1.0
    if spec.name.endswith("norm.weight"):
        return 1.0, 0.05
    if leaf.startswith("hc_"):
        if leaf.endswith("_fn"):
            return 0.0, 0.1 / math.sqrt(spec.shape[-1])
        return (1.0, 0.05) if leaf.endswith("_scale") else (0.0, 0.01)      # _scale ~ 1, _base ~ 0
    if leaf == "attn_sink":
        return 0.0, 0.5
    if leaf == "ape":
        return 0.0, 0.02
    if spec.name.endswith("gate.bias"):
        return 0.0, 0.01
    std = 1.0 / math.sqrt(spec.shape[-1])                                    # linear: N(0, 1/fan_in)
    if leaf in ("wo_b", "w2"):                                               # output projections
        std /= math.sqrt(2 * cfg.n_layers)
    return 0.0, std


def _generate(key: int, shape: tuple[int, ...], mean: float, std: float, device: torch.device,
              encode: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], block_rows: int = 1,
              fused: bool = False) -> tuple[torch.Tensor, ...]:
    """Values in chunks of whole `block_rows` row groups, each encoded, the encodings concatenated on dim 0.
    fused: each chunk's hash, normals and encoding as one torch.compile'd function."""
    rows, cols = shape[0], math.prod(shape[1:])
    chunk = GPU_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS     # whole row groups: same values
    step = max(block_rows, chunk // max(cols, 1) // block_rows * block_rows)
    parts = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if fused:
            scalars = torch.tensor([key, r0 * cols], dtype=torch.int64, device=device)
            affine = torch.tensor([std, mean], dtype=torch.float32, device=device)
            out = _fused_encoder(encode)(scalars, affine, r1 - r0, cols)
            parts.append(out if len(shape) == 2 else tuple(t.view(r1 - r0, *shape[1:]) for t in out))
        else:
            x = gaussian(key, r0 * cols, (r1 - r0) * cols, device).view(r1 - r0, *shape[1:])
            parts.append(encode(x * std + mean))
    return tuple(p[0] if len(p) == 1 else torch.cat(p) for p in zip(*parts))


def _encoded_chunk(encode, scalars: torch.Tensor, affine: torch.Tensor, rows: int, cols: int):
    """What the eager path computes for one chunk [rows, cols], from tensors (key, start) and (std, mean), so a
    compiled version is not specialised on (recompiled for) every key and offset."""
    z = (torch.arange(rows * cols, dtype=torch.int64, device=scalars.device) + scalars[1]) * _GOLDEN + scalars[0]
    x = _irwin_hall(_splitmix(z)).view(rows, cols)
    # e8m0 scales leave as their bytes: inductor has no e8m0 type (_fused_encoder views them back)
    return tuple(t.view(torch.uint8) if t.dtype == E8M0 else t for t in encode(x * affine[0] + affine[1]))


@functools.cache
def _fused_encoder(encode):
    """exact_compile of _encoded_chunk for one encoder: one or two kernels a chunk instead of ~30 (a Pro layer's
    weights in 0.9 s instead of 4.7 s on an H200), bit-identical to the eager path (tests/test_checkpoint.py)."""
    compiled = exact_compile(functools.partial(_encoded_chunk, encode))
    e8m0 = {k for k, t in enumerate(encode(torch.ones(1, 128))) if t.dtype == E8M0}

    def run(*args):
        return tuple(t.view(E8M0) if k in e8m0 else t for k, t in enumerate(compiled(*args)))
    return run


def _tid2eid(key: int, cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """[vocab, k] int64: k distinct experts per token id (top-k of per-row random keys made unique)."""
    n_exp, k = cfg.n_routed_experts, cfg.n_activated_experts
    cols = torch.arange(n_exp, dtype=torch.int64, device=device)
    step = max(1, CHUNK_ELEMENTS // n_exp)
    parts = []
    for r0 in range(0, cfg.vocab_size, step):
        r1 = min(cfg.vocab_size, r0 + step)
        bits = _hash_bits(key, r0 * n_exp, (r1 - r0) * n_exp, device).view(r1 - r0, n_exp)
        parts.append((((bits >> 16) << 16) | cols).topk(k, dim=1).indices)
    return torch.cat(parts)


# ---- modules ----------------------------------------------------------------------------------------------

_ENCODERS: dict[str, tuple[Callable[[torch.Tensor], tuple[torch.Tensor, ...]], tuple[str, ...], int]] = {
    "fp8": (fp8_block_quantize, ("weight", "scale"), 128),
    "mxfp4": (mxfp4_quantize, ("weight", "scale"), 1),
    "bf16": (lambda x: (x.to(torch.bfloat16),), ("weight",), 1),
}
_PLAIN_DTYPES = {"bf16_plain": torch.bfloat16, "f32": torch.float32, "i64": torch.int64}


@functools.cache
def _plain_encoder(dtype: torch.dtype) -> Callable[[torch.Tensor], tuple[torch.Tensor]]:
    return lambda x: (x.to(dtype),)


def synth_module(cfg: ModelConfig, spec: ModuleSpec, seed: int = 0,
                 device: torch.device | str | None = None, fused: bool = False) -> QWeight:
    """The synthetic values of one module (schema.ModuleSpec) in its stored format; `fused`: generated by
    torch.compile'd chunks (the same values; worth its compile time on a GPU)."""
    return _synth_group(cfg, spec, seed, torch.device(device or "cpu"), fused)[0]


def _synth_group(cfg: ModelConfig, spec: ModuleSpec, seed: int, device: torch.device,
                 fused: bool = False) -> list[QWeight]:
    """The module, plus its w3 partner for an NVFP4 w1 (they share scale_2, so they are made together)."""
    if spec.fmt == "nvfp4":
        return _synth_nvfp4(cfg, spec, seed, device, fused)
    key = module_key(seed, spec.name)
    if spec.name.endswith("tid2eid"):
        return [QWeight(spec.name, spec.fmt, {"": _tid2eid(key, cfg, device)})]
    mean, std = _stats(cfg, spec)
    if spec.fmt in PLAIN_FORMATS:
        dtype = _PLAIN_DTYPES[spec.fmt]
        (values,) = _generate(key, spec.shape, mean, std, device, _plain_encoder(dtype), fused=fused)
        if spec.name.rsplit(".", 1)[-1].startswith("hc_") and spec.name.endswith("_base"):   # f32
            values = _with_comb_identity(cfg, values)
        return [QWeight(spec.name, spec.fmt, {"": values})]
    encode, suffixes, block_rows = _ENCODERS[spec.fmt]
    tensors = _generate(key, spec.shape, mean, std, device, encode, block_rows, fused)
    return [QWeight(spec.name, spec.fmt, dict(zip(suffixes, tensors)))]


def _with_comb_identity(cfg: ModelConfig, base: torch.Tensor) -> torch.Tensor:
    """hc_*_base [(2+M)*M]: pre [0:M] and post [M:2M] stay ~0, comb [2M:] (an MxM matrix) ~ 3 * identity."""
    m = cfg.hc_mult
    if base.numel() != (2 + m) * m:          # hc_head_base has only the pre part
        return base
    comb = torch.eye(m, device=base.device).flatten() * COMB_DIAG
    return torch.cat([base[: 2 * m], base[2 * m:] + comb])


def _w13_partner(name: str) -> str | None:
    stem, leaf = name.rsplit(".", 1)
    return {"w1": f"{stem}.w3", "w3": f"{stem}.w1"}.get(leaf)


def _synth_nvfp4(cfg: ModelConfig, spec: ModuleSpec, seed: int, device: torch.device,
                 fused: bool) -> list[QWeight]:
    """NVFP4 the way NVIDIA's checkpoint was made: the MXFP4 module cast losslessly (w1, w3 share scale_2)."""
    names = [spec.name] + [n for n in [_w13_partner(spec.name)] if n]
    mx = [_synth_group(cfg, dataclasses.replace(spec, name=n, fmt="mxfp4"), seed, device, fused)[0]
          for n in names]
    nv1, nv3, _ = mxfp4_to_nvfp4(*(t for q in mx for t in (q.tensors["weight"], q.tensors["scale"])))
    input_scale = torch.tensor(SYNTH_ACT_AMAX / (E2M1_MAX * E4M3_MAX), dtype=torch.float32, device=device)
    return [QWeight(n, "nvfp4", {"weight": w, "weight_scale": ws, "weight_scale_2": s2.clone(),
                                 "input_scale": input_scale.clone()})
            for n, (w, ws, s2) in zip(names, [nv1, nv3])]


# ---- checkpoint writer -----------------------------------------------------------------------------------

def _tensor_name(module: str, suffix: str) -> str:
    return f"{module}.{suffix}" if suffix else module


def _spec_bytes(specs: list[ModuleSpec]) -> int:
    return sum(math.prod(shape) * dtype.itemsize for s in specs for dtype, shape in s.tensors().values())


def shard_plan(cfg: ModelConfig) -> list[list[ModuleSpec]]:
    """Modules per shard: consecutive layers grouped (<= SHARD_BLOCKS, ~SHARD_BYTES), embed in the first
    shard, the final norm/head/hc_head in the last."""
    groups: list[list[ModuleSpec]] = [[]]
    count = size = 0
    for layer in range(cfg.n_layers + cfg.n_mtp_layers):
        mods = block_modules(cfg, layer)
        nbytes = _spec_bytes(mods)
        if count and (count >= SHARD_BLOCKS or size + nbytes > SHARD_BYTES):
            groups.append([])
            count = size = 0
        groups[-1] += mods
        count, size = count + 1, size + nbytes
    embed, *tail = global_modules(cfg)
    groups[0].insert(0, embed)
    groups[-1] += tail
    return groups


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise BadInput(f"{out}: exists and is not empty; pass --force to replace it")
        if not ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
            raise BadInput(f"{out}: refusing to replace a non-empty directory that is not a checkpoint "
                           "(no config.json, no *.safetensors)")


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished temp dir into place; an old checkpoint is swapped out first, then deleted."""
    old = None
    if out.is_dir() and any(out.iterdir()):
        _check_target(out, force)       # again: OUT may have appeared while we were writing
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(tmp, out)            # also replaces an empty directory
    except OSError as e:
        raise BadInput(f"{out}: could not move the new checkpoint into place ({e}); was it created "
                       "meanwhile?") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_shard(path: Path, cfg: ModelConfig, specs: list[ModuleSpec], seed: int, device: torch.device,
                 advance: Callable[[int], None], fused: bool) -> None:
    planned = {name: t for s in specs for name, t in s.tensors().items()}
    partners: dict[str, QWeight] = {}
    with safetensors_writer(path, planned) as write:
        for spec in specs:
            qw = partners.pop(spec.name, None)
            if qw is None:
                qw, *rest = _synth_group(cfg, spec, seed, device, fused)
                partners.update({q.name: q for q in rest})
            for suffix, tensor in qw.tensors.items():
                write(_tensor_name(spec.name, suffix), tensor)
            advance(qw.nbytes)


def make_checkpoint(out_dir: str | Path, cfg: ModelConfig, seed: int = 0, experts_format: str | None = None,
                    force: bool = False, progress: Any = None, device: torch.device | str | None = None,
                    first_layers: int | None = None, fused: bool = False) -> Path:
    """Write a synthetic checkpoint (config.json, index, shards) for `cfg` into `out_dir`, atomically.

    experts_format: mxfp4 | nvfp4 | fp8 (default: cfg.expert_format). `progress`: a rich Progress (optional).
    first_layers: write only the first N main layers (no MTP block) of `cfg`'s model: a valid N-layer
    checkpoint whose modules are bit-identical to those of the full model (SyntheticModel(cfg, base=...)
    streams the remaining layers on top of it). fused: generate through torch.compile'd chunks (the same
    values; worth its compile time on a GPU).
    """
    fmt = experts_format or cfg.expert_format
    if fmt not in ("mxfp4", "nvfp4", "fp8"):
        raise BadInput(f"--experts-format {fmt!r}: choose mxfp4, nvfp4 or fp8")
    cfg = dataclasses.replace(cfg, compress_ratios=list(cfg.compress_ratios), expert_format=fmt,
                              expert_dtype="fp8" if fmt == "fp8" else "fp4").validate()
    out = Path(out_dir)
    _check_target(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = torch.device(device or "cpu")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    written = cfg
    if first_layers is not None:
        written = dataclasses.replace(cfg.shrink(first_layers), n_mtp_layers=0)
        written.compress_ratios = written.compress_ratios[:first_layers]
    try:
        _write_all(tmp, cfg, written.validate(), seed, device, progress, fused)
        _install(tmp, out, force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_all(tmp: Path, cfg: ModelConfig, written: ModelConfig, seed: int, device: torch.device,
               progress: Any, fused: bool) -> None:
    """The modules of `written` (cfg or its first layers) with the values of cfg's model."""
    plan = shard_plan(written)
    total = sum(_spec_bytes(specs) for specs in plan)
    task = progress.add_task(f"writing {written.name} checkpoint", total=total) if progress else None

    def advance(n: int) -> None:
        if progress:
            progress.advance(task, n)

    weight_map = {}
    for i, specs in enumerate(plan):
        shard = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        _write_shard(tmp / shard, cfg, specs, seed, device, advance, fused)
        weight_map.update({name: shard for s in specs for name in s.tensors()})
    metadata = {"total_size": total, "generator": "dsv4debug", "synth_version": SYNTH_VERSION,
                "seed": seed, "preset": cfg.name, "expert_format": cfg.expert_format}
    if written is not cfg:
        metadata["values_of_layers"] = cfg.n_layers
    (tmp / "config.json").write_text(json.dumps(written.to_hf(), indent=2) + "\n")
    (tmp / INDEX_NAME).write_text(json.dumps({"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))},
                                             indent=2) + "\n")


# ---- the embedded default model ----------------------------------------------------------------------------

def cache_root() -> Path:
    """$DSV4DEBUG_CACHE, else ~/.cache/dsv4debug."""
    return Path(os.environ.get("DSV4DEBUG_CACHE") or Path.home() / ".cache" / "dsv4debug")


def _is_current(path: Path) -> bool:
    try:
        meta = json.loads((path / INDEX_NAME).read_text())["metadata"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return meta.get("synth_version") == SYNTH_VERSION


def default_checkpoint(seed: int = 0) -> Path:
    """The tiny synthetic model, generated on first use into cache_root()/tiny-seed{seed}, reused afterwards."""
    out = cache_root() / f"tiny-seed{seed}"
    if _is_current(out):
        return out
    try:
        make_checkpoint(out, preset("tiny"), seed=seed, force=out.exists())
    except BadInput:
        if not _is_current(out):    # another process may have just written it
            raise
    return out


# ---- a model generated on the fly ----------------------------------------------------------------------------

class SyntheticModel:
    """A checkpoint stand-in that generates each module on request, on any device (bit-identical to what
    make_checkpoint writes): Pro-shaped models far larger than any disk stream through the same runner."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu", base: Any = None,
                 fused: bool = False):
        """base: a checkpoint (e.g. the first layers written by make_checkpoint(..., first_layers=N)) whose
        modules are read from disk instead of generated; they must have this model's names and shapes.
        fused: generate through torch.compile'd chunks (the same values; on a GPU far faster than eager)."""
        self.config = cfg
        self.seed = seed
        self.device = torch.device(device)
        self.fused = fused
        self.base = base
        self.path = Path(f"<synthetic {cfg.name} seed {seed}>")
        self.specs = {m.name: m for m in global_modules(cfg)}
        for layer in range(cfg.n_layers + cfg.n_mtp_layers):
            self.specs.update({m.name: m for m in block_modules(cfg, layer)})
        clash = [n for n, m in (base.specs.items() if base else ()) if n in self.specs and
                 (self.specs[n].shape, self.specs[n].fmt) != (m.shape, m.fmt)]
        if clash:
            raise BadInput(f"{base.path}: module '{clash[0]}' differs in shape or format from the synthetic "
                           f"{cfg.name} model it should be the base of")

    @property
    def identity(self) -> dict[str, Any]:
        return {"path": str(self.path), "synthetic": True, "synth_version": SYNTH_VERSION, "seed": self.seed,
                "preset": self.config.name, "format": self.config.expert_format,
                **({"base": self.base.identity} if self.base else {})}

    def module(self, name: str) -> QWeight:
        spec = self.specs.get(name)
        if spec is None:
            raise BadInput(f"'{name}' is no module of the synthetic {self.config.name} model")
        if self.base is not None and name in self.base.specs:
            return self.base.module(name)
        return synth_module(self.config, spec, self.seed, self.device, self.fused)
