"""Planted faults for tests and demos: `KIND@TARGET[:ARG]`.

Activation faults change a site's (first) output on the side they are given to:
  nan@SITE[:INDEX]   one element (flat INDEX, default the middle one) becomes NaN
  inf@SITE[:INDEX]   ... +Inf
  scale@SITE:F       the output is multiplied by F
  noise@SITE:REL     Gaussian noise of REL x the output's RMS is added (seeded, reproducible)
  zero@SITE          the output becomes zeros
  stale_kv@layers.L  layer L's KV cache is never written: attention reads the zeros it was allocated with
                     (the output of its kv_cache site, the cache read, is zeros)
Weight faults change what the side reads from the checkpoint:
  swap_experts@layers.L:A,B          experts A and B of layer L trade places (wrong packing offset)
  swap_w13@layers.L.ffn.experts.E    w1 and w3 of one expert trade places
  block_scale@MODULE[:K]             the first block scale of an FP8/FP4 weight is off by 2**K (default 1)
  fused_scale@MODULE[:F]             one part of a fused projection is dequantised with the wrong scale: its
                                     weights come out F times too large (default 2; a power of two for FP8 and
                                     MXFP4, whose scales are e8m0). A fused GEMM keeps one scale layout for
                                     all its parts (w1|w3 of an expert or the shared expert; attention's q_a,
                                     kv, compressor and indexer inputs), so scales read at the wrong offset, or
                                     a fused NVFP4 w1|w3 that keeps only w1's weight_scale_2, scale one part
                                     alone. MODULE is that part, e.g. layers.3.ffn.experts.5.w3. (A part
                                     followed by an RMSNorm, wq_a or wkv, is normalised away downstream: `run`
                                     shows it at its site, a bisection on the logits cannot.)
SITE may be a glob (`layers.*.attn.kv_cache`). Weight faults reach only the ops the side runs on its own
code: an op delegated to the reference reads the clean weights (as the reference's loader would).
"""
from __future__ import annotations

import fnmatch
import re
import zlib
from dataclasses import dataclass, replace

import torch

from .errors import BadInput
from .formats import QWeight

ACTIVATION_KINDS = ("nan", "inf", "scale", "noise", "zero", "stale_kv")
WEIGHT_KINDS = ("swap_experts", "swap_w13", "block_scale", "fused_scale")
# the targets some kinds require: (regular expression, what it is)
TARGETS = {
    "swap_experts": (r"(layers|mtp)\.\d+", "a layer, layers.L"),
    "swap_w13": (r"(layers|mtp)\.\d+\.ffn\.experts\.\d+", "one expert, layers.L.ffn.experts.E"),
    "stale_kv": (r"(layers|mtp)\.[\d*]+", "a layer, layers.L (or layers.*)"),
    "fused_scale": ((r"(layers|mtp)\.\d+\.(ffn\.(experts\.\d+|shared_experts)\.w[13]|"
                    r"attn\.(wq_a|wkv|indexer\.weights_proj|(indexer\.)?compressor\.(wkv|wgate)))"),
                    ("a part of a fused projection: w1 or w3 of an expert or the shared expert, or attn.wq_a, "
                    "attn.wkv, attn.indexer.weights_proj, a compressor's wkv or wgate")),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str
    arg: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}@{self.target}" + (f":{self.arg}" if self.arg is not None else "")

    @property
    def on_weights(self) -> bool:
        return self.kind in WEIGHT_KINDS

    def matches(self, site: str) -> bool:
        target = self.target + ".attn.kv_cache" if self.kind == "stale_kv" else self.target
        return site == target or fnmatch.fnmatchcase(site, target)


def parse_fault(spec: str) -> Fault:
    m = re.fullmatch(r"(\w+)@([^:]+)(?::(.+))?", spec.strip())
    if not m or m.group(1) not in ACTIVATION_KINDS + WEIGHT_KINDS:
        raise BadInput(f"--inject {spec!r}: expected KIND@SITE[:ARG] with KIND one of "
                       f"{', '.join(ACTIVATION_KINDS + WEIGHT_KINDS)}")
    fault = Fault(m.group(1), m.group(2), m.group(3))
    if fault.kind in TARGETS and not re.fullmatch(TARGETS[fault.kind][0], fault.target):
        raise BadInput(f"--inject {spec!r}: {fault.kind} takes {TARGETS[fault.kind][1]}")
    try:
        _check_arg(fault)
    except ValueError:
        raise BadInput(f"--inject {spec!r}: bad argument {fault.arg!r} for {fault.kind}") from None
    return fault


def _check_arg(f: Fault) -> None:
    if f.kind in ("nan", "inf") and f.arg is not None:
        int(f.arg)
    elif f.kind in ("scale", "noise"):
        float(f.arg if f.arg is not None else "x")
    elif f.kind == "swap_experts":
        _a, _b = (int(v) for v in (f.arg or "").split(","))
    elif f.kind == "block_scale" and f.arg is not None:
        int(f.arg)
    elif (f.kind == "stale_kv" and f.arg is not None) or (f.kind == "fused_scale" and float(f.arg or 2) <= 0):
        raise ValueError


def apply_activation_fault(f: Fault, site: str, out: torch.Tensor) -> torch.Tensor:
    if not out.is_floating_point():
        raise BadInput(f"--inject {f}: site '{site}' produces integer ids; only weight faults reach it")
    out = out.clone()
    flat = out.view(-1)
    if f.kind in ("nan", "inf"):
        i = int(f.arg) if f.arg is not None else flat.numel() // 2
        if not 0 <= i < flat.numel():
            raise BadInput(f"--inject {f}: index {i} outside site '{site}' with {flat.numel()} elements")
        flat[i] = float("nan") if f.kind == "nan" else float("inf")
    elif f.kind == "scale":
        out.mul_(float(f.arg))
    elif f.kind == "noise":
        g = torch.Generator(device="cpu").manual_seed(zlib.crc32(site.encode()))
        noise = torch.randn(out.shape, generator=g, dtype=torch.float32).to(out.device)
        rms = out.float().square().mean().sqrt()
        out.add_((noise * rms * float(f.arg)).to(out.dtype))
    elif f.kind in ("zero", "stale_kv"):
        out.zero_()
    return out


def apply_weight_faults(faults: list[Fault], name: str, load) -> QWeight:
    """Resolve module `name` through the weight faults; `load(name)` reads a clean module."""
    for f in faults:
        if f.kind == "swap_experts":
            a, b = f.arg.split(",")
            m = re.fullmatch(re.escape(f.target) + r"\.ffn\.experts\.(\d+)\.(w[123])", name)
            if m and m.group(1) in (a, b):
                other = b if m.group(1) == a else a
                return replace(load(f"{f.target}.ffn.experts.{other}.{m.group(2)}"), name=name)
        elif f.kind == "swap_w13" and name in (f"{f.target}.w1", f"{f.target}.w3"):
            other = f"{f.target}.w3" if name.endswith("w1") else f"{f.target}.w1"
            return replace(load(other), name=name)
        elif f.kind == "block_scale" and name == f.target:
            return _shift_first_scale(load(name), int(f.arg or 1))
        elif f.kind == "fused_scale" and name == f.target:
            return _scale_part(load(name), float(f.arg or 2))
    return load(name)


def _scale_part(w: QWeight, factor: float) -> QWeight:
    """All of `w` dequantised `factor` times too large, through the tensor its format scales with."""
    key = {"fp8": "scale", "mxfp4": "scale", "nvfp4": "weight_scale_2", "bf16": "weight"}.get(w.fmt, "")
    t = w.tensors[key]
    scaled = (t.float() * factor).to(t.dtype)
    if not torch.equal(scaled.float(), t.float() * factor):
        raise BadInput(f"fused_scale fault: {w.name} has {w.fmt} scales, which cannot hold x{factor:g} "
                       "(use a power of two)")
    return replace(w, tensors={**w.tensors, key: scaled})


def _shift_first_scale(w: QWeight, k: int) -> QWeight:
    key = {"fp8": "scale", "mxfp4": "scale", "nvfp4": "weight_scale"}.get(w.fmt)
    if key is None:
        raise BadInput(f"block_scale fault: module '{w.name}' is {w.fmt}, it has no block scales")
    scale = w.tensors[key].clone()
    first = scale.view(-1)[:1].float() * 2.0 ** k
    scale.view(-1)[:1] = first.to(scale.dtype)
    return replace(w, tensors={**w.tensors, key: scale})
