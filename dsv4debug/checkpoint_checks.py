"""Value checks for `Checkpoint.verify()`: what a correct DeepSeek-V4 tensor may not contain.

Each check returns a problem description (with the first offending index) or None.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import BadInput
from .formats import QWeight
from .schema import ModuleSpec

if TYPE_CHECKING:
    from .checkpoint import Checkpoint


def _first(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask)[0].tolist()


def _e8m0_problem(t: torch.Tensor) -> str | None:
    nan = t.view(torch.uint8) == 255
    return f"e8m0 scale byte 255 (NaN) at {_first(nan)}" if nan.any() else None


def _e4m3_problem(t: torch.Tensor, is_scale: bool) -> str | None:
    b = t.view(torch.uint8)
    nan = (b & 0x7F) == 0x7F
    if nan.any():
        return f"e4m3 NaN (byte {int(b[nan][0]):#04x}) at {_first(nan)}"
    negative = (b & 0x80 != 0) & (b & 0x7F != 0)
    if is_scale and negative.any():
        return f"negative block scale {float(t[negative][0].float())} at {_first(negative)}"
    return None


def _float_problem(t: torch.Tensor) -> str | None:
    bad = ~torch.isfinite(t)
    return f"non-finite value {float(t[bad][0])} at {_first(bad)}" if bad.any() else None


def _global_scale_problem(t: torch.Tensor) -> str | None:
    value = float(t)
    return None if value > 0 and torch.isfinite(t) else f"global scale {value} must be finite and > 0"


def _tid2eid_problem(t: torch.Tensor, n_experts: int) -> str | None:
    out_of_range = (t < 0) | (t >= n_experts)
    if out_of_range.any():
        return f"expert id {int(t[out_of_range][0])} outside 0..{n_experts - 1} at {_first(out_of_range)}"
    ordered = t.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
    if repeated.any():
        row = int(_first(repeated)[0])
        return f"row {row} (token id {row}) repeats an expert: {t[row].tolist()}"
    return None


def tensor_problem(spec: ModuleSpec, suffix: str, t: torch.Tensor, n_experts: int) -> str | None:
    if suffix in ("weight_scale_2", "input_scale"):
        return _global_scale_problem(t)
    if spec.name.endswith("tid2eid"):
        return _tid2eid_problem(t, n_experts)
    if t.dtype == torch.float8_e8m0fnu:
        return _e8m0_problem(t)
    if t.dtype == torch.float8_e4m3fn:
        return _e4m3_problem(t, is_scale=suffix == "weight_scale")
    if t.is_floating_point():
        return _float_problem(t)
    return None                  # packed FP4 bytes: every value is a valid code pair


def check_module(ckpt: Checkpoint, spec: ModuleSpec, qw: QWeight) -> None:
    for suffix, t in qw.tensors.items():
        problem = tensor_problem(spec, suffix, t, ckpt.config.n_routed_experts)
        if problem:
            name = f"{spec.name}.{suffix}" if suffix else spec.name
            raise BadInput(f"tensor '{name}' in {ckpt.file_of(name)}: {problem}")


def pair_warnings(ckpt: Checkpoint, spec: ModuleSpec) -> list[str]:
    """NVFP4 w1 and w3 of one expert share weight_scale_2 (fused w13 kernels rely on it)."""
    if spec.fmt != "nvfp4" or not spec.name.endswith(".w1"):
        return []
    w3 = spec.name[:-1] + "3"
    a, b = (ckpt.tensor(f"{n}.weight_scale_2") for n in (spec.name, w3))
    if torch.equal(a, b):
        return []
    return [(f"'{spec.name}' and '{w3}' have different weight_scale_2 ({float(a)} vs {float(b)}); fused w13 "
            "kernels assume one shared value")]
