"""Working precision of the reference ops.

The same op code runs the bf16 reference and its fp32 / fp64 twins used for noise floors: where DeepSeek's
code upcasts to fp32, `acc(x)` gives fp32 for bf16/fp32 inputs and fp64 for fp64 inputs; where it rounds to
bf16, the ops round to the activation dtype instead.
"""
import torch


def acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype for activations of dtype x.dtype (fp32, or fp64 in the fp64 twin)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def complex_of(x: torch.Tensor) -> torch.dtype:
    return torch.complex128 if x.dtype == torch.float64 else torch.complex64
