"""The fused fp32 statistics used on GPUs agree with the float64 path (exact counts, min, max, first bad
element; sums to fp32 accuracy), also where naive fp32 sums would overflow or cancel."""
import math

import numpy as np
import pytest
import torch

from dsv4debug.tensorstats import _device_partials, combine_blocks, fused_partials


def _cases():
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(50_000, generator=g).bfloat16()
    special = plain.clone()
    special[[7, 123, 4000]] = torch.tensor([float("nan"), float("inf"), float("-inf")]).bfloat16()
    huge = (torch.randn(10_000, generator=g) * 1e30).bfloat16()               # squares overflow fp32
    offset = (1000 + 1e-2 * torch.randn(10_000, generator=g)).float()          # mean^2 >> variance
    return {"plain": plain, "special": special, "huge": huge, "offset": offset,
            "all_nan": torch.full((64,), float("nan")).bfloat16(), "zeros": torch.zeros(100)}


@pytest.mark.parametrize("name", list(_cases()))
def test_fused_partials_match_float64(name):
    x = _cases()[name]
    want = combine_blocks([_device_partials(x).numpy()], x.numel(), x.numel())
    got = combine_blocks([fused_partials(x).numpy()], x.numel(), x.numel())
    for key, g, w in zip(("nan", "inf", "min", "max", "mean", "std", "absmax", "l2", "first_bad"), got, want):
        if key in ("nan", "inf", "min", "max", "absmax", "first_bad") or math.isnan(w):
            assert g == w or (math.isnan(g) and math.isnan(w)), key
        else:
            scale = want[6] if math.isfinite(want[6]) else 0.0
            assert np.isclose(g, w, rtol=2e-4, atol=1e-6 * scale), (key, g, w)
