"""The `kernels` backend: DeepSeek-V4 ops on our CuTeDSL kernels (kernels/, imported as dsv4_kernels).

It implements an op only where a kernel exists and never falls back to PyTorch silently: the runner
refuses to start while any op of the flow is missing, naming them, unless the user delegates those op
families to the reference explicitly (`--reference-ops`), which the report then states.
"""
from __future__ import annotations

import torch

from ..errors import BadInput
from .base import Backend


class KernelsBackend(Backend):
    name = "kernels"
    numerics = "quantized"

    def __init__(self, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16):
        super().__init__(device, dtype)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise BadInput("the kernels backend runs CuTeDSL kernels on a CUDA GPU: pass --device cuda on a "
                           "machine with one (this one has " + ("no GPU)" if not torch.cuda.is_available()
                                                                 else f"--device {self.device})"))
