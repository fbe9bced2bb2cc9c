"""The backend interface: one method per op of the model flow (dsv4debug/model.py).

Op families group ops for bisection ("swap the candidate's attention to the reference") and for reports
(one hop from a site to its reference op in references/ and to its kernel in kernels/).
"""
from __future__ import annotations

import torch

from ..formats import QWeight, dequantize_all

# op -> (family, reference function in dsv4_references, output names after the first)
OPS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "embed": ("embed", "(row gather of embed.weight)", ()),
    "hc_pre": ("mhc", "mhc.hc_pre", ("post", "comb")),
    "hc_post": ("mhc", "mhc.hc_post", ()),
    "hc_head": ("mhc", "mhc.hc_head", ()),
    "rms_norm": ("norm", "norm.rms_norm", ()),
    "head_rms_norm": ("norm", "norm.head_rms_norm", ()),
    "linear": ("linear", "linear.linear", ()),
    "grouped_linear": ("linear", "linear.grouped_linear", ()),
    "logits": ("head", "linear.linear_fp32", ()),
    "rope": ("rope", "rope.apply_rope", ()),
    "kv_cache": ("kv_cache", "attention.kv_qat", ()),
    "compressor": ("compressor", "attention.compress", ()),
    "indexer_q": ("indexer", "attention.indexer_q", ()),
    "indexer_scores": ("indexer", "attention.indexer_scores", ()),
    "indexer_topk": ("indexer", "attention.indexer_topk", ()),
    "sparse_attn": ("attention", "attention.sparse_attn", ()),
    "gate": ("router", "moe.gate", ("topk_ids", "scores")),
    "expert": ("experts", "moe.expert", ()),
    "moe_combine": ("experts", "moe.moe_combine", ()),
}
FAMILIES = tuple(dict.fromkeys(f for f, _, _ in OPS.values()))


def family_of(op: str) -> str:
    return OPS[op][0]


class UnsupportedOp(Exception):
    """A backend was asked for an op it does not implement (never silently replaced)."""


class Backend:
    """Base class: weight dequantisation, device placement, op lookup.

    Subclasses implement op methods named as in OPS. `numerics` says what the backend's arithmetic is:
    "bf16" (judged against bf16 noise floors) or "quantized" (FP8/FP4 pipelines: the runner also measures
    how far the `sim` backend lands from the reference, so quantisation noise is not called a bug).
    `implements` declares the ops the backend runs on its own code (None: every op method it has); a subclass
    of ReferenceBackend that overrides a few ops declares those, and the runner runs the rest with the
    reference op and names them in its report (`delegated_ops`), never silently. `unsupported()` declines
    single calls an implemented op has no kernel for (e.g. a weight format); those are named as well.
    `simulator` names the backend that rounds as this one does, in PyTorch (a quantising backend's own
    quantisation, no more): bisect judges the candidate against it, so a fault smaller than the quantisation
    noise still stands out at the logits.
    """
    name = "base"
    numerics = "bf16"
    implements: tuple[str, ...] | None = None
    simulator: str | None = None

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.device = torch.device(device)
        self.dtype = dtype                      # activation dtype of a free run (bf16; fp32/fp64 twins)

    @classmethod
    def missing_ops(cls) -> list[str]:
        """Ops of the flow this backend does not implement (not declared, or no method)."""
        return [op for op in OPS if not callable(getattr(cls, op, None))
                or (cls.implements is not None and op not in cls.implements)]

    def unsupported(self, op: str, args: tuple) -> str | None:
        """Why this backend has no kernel for this call of an implemented op (None: it has one)."""
        return None

    def op(self, op: str):
        fn = getattr(self, op, None)
        if not callable(fn):
            raise UnsupportedOp(f"backend '{self.name}' does not implement op '{op}'")
        return fn

    def is_candidate_op(self, op: str) -> bool:
        """Whether `op` runs on this backend's own code (planted faults live there), not delegated."""
        return True

    def dense(self, w: QWeight | None, dtype: torch.dtype) -> torch.Tensor | None:
        """The exact dequantised weight in `dtype` on this backend's device. Not cached: a prefill reads each
        weight once per stage, and dense copies kept for the stage would hold up to a layer's worth beside the
        stored weights on every side (fp64 floors: 4x the bf16 bytes; a Pro layer's 384 dense experts would
        be 51 GB in bf16). On a GPU through the fused (torch.compile'd, bit-identical) dequantisation. Not
        traced by --graph compile (GraphBackend): weights resolve outside the graph."""
        if w is None:
            return None
        return w.dequantize(dtype, self.device, fused=self.device.type == "cuda")

    def dense_all(self, ws: tuple[QWeight, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """dense() of several weights; on a GPU those of one block format in one fused call (an expert's
        three matrices: one host dispatch instead of three)."""
        return dequantize_all(ws, dtype, self.device, fused=self.device.type == "cuda")

    def param(self, w: QWeight | None) -> torch.Tensor | None:
        """Small parameters (norm weights, mHC, sinks, biases, ape) are held in fp32 as DeepSeek does."""
        return self.dense(w, torch.float32)

    def end_stage(self) -> None:
        """Called after each stage: backends drop what they kept for it."""
