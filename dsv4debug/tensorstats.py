"""Statistics of a site's output: NaN/Inf counts, and min, max, mean, std, absmax, L2 over finite values.

Two implementations with one result layout (STAT_VALUES): `device_stats` runs torch ops where the tensor
lives (on a GPU: a few small kernels, no sync, one small tensor to move to the host), `host_stats` runs
numpy on 1-D blocks of a host tensor, one block per worker thread, with the GIL released. Sums are
accumulated in float64, so bf16 squares cannot overflow and temporaries stay one block large.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

STAT_KEYS = ("nan_count", "inf_count", "min", "max", "mean", "std", "absmax", "l2")
# device_stats / combine_blocks layout: STAT_KEYS then the flat index of the first non-finite element (-1: none)
STAT_VALUES = (*STAT_KEYS, "first_nonfinite")
DEVICE_CHUNK = 1 << 24            # elements per float64 step on the device
HOST_BLOCK = 1 << 20              # elements per numpy task


def device_stats(t: torch.Tensor) -> torch.Tensor:
    """float64 [STAT_VALUES] computed on t's device with torch; nothing waits for the device."""
    x = t.detach().reshape(-1)
    if x.numel() == 0:
        return torch.tensor(_EMPTY, dtype=torch.float64, device=x.device)
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    n_nan = n_finite = total = sumsq = zero
    lo, hi, first_bad = zero + torch.inf, zero - torch.inf, zero - 1
    for start in range(0, x.numel(), DEVICE_CHUNK):
        xd = x[start:start + DEVICE_CHUNK].double()
        finite = torch.isfinite(xd)
        kept = torch.where(finite, xd, 0)
        n_nan, n_finite = n_nan + xd.isnan().sum(), n_finite + finite.sum()
        total, sumsq = total + kept.sum(), sumsq + torch.dot(kept, kept)
        lo = torch.minimum(lo, torch.where(finite, xd, torch.inf).amin())
        hi = torch.maximum(hi, torch.where(finite, xd, -torch.inf).amax())
        bad_here = (~finite).to(torch.uint8).argmax() + start
        first_bad = torch.where((first_bad < 0) & ~finite.all(), bad_here.double(), first_bad)
    n_finite = n_finite.double()
    mean = total / n_finite
    var = ((sumsq - total * mean) / (n_finite - 1).clamp(min=1)).clamp(min=0)
    values = (n_nan, x.numel() - n_finite - n_nan, lo, hi, mean, var.sqrt(), torch.maximum(lo.abs(), hi.abs()),
              sumsq.sqrt(), first_bad)
    return torch.stack([v.double() for v in values])


_EMPTY = [0, 0, math.nan, math.nan, math.nan, math.nan, math.nan, 0, -1]


# ---------------------------------------------------------------------------------------------------------
# host (numpy, worker threads)
# ---------------------------------------------------------------------------------------------------------
def host_blocks(t: torch.Tensor) -> list[np.ndarray]:
    """A host tensor as 1-D numpy blocks of HOST_BLOCK elements (views, no copy except for odd dtypes)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bfloat16:
        arr = flat.view(torch.int16).numpy().view(np.uint16)          # widened per block in block_stats
    elif flat.dtype in (torch.float16, torch.float32, torch.float64):
        arr = flat.numpy()
    else:
        arr = flat.double().numpy()                                    # ints, bool, fp8
    return [arr[i:i + HOST_BLOCK] for i in range(0, arr.size, HOST_BLOCK)]


def block_stats(block: np.ndarray) -> np.ndarray:
    """[n_nan, n_finite, min, max, sum, sumsq, first non-finite index or -1] of one block (uint16 = bf16 bits)."""
    x = _widen_bf16(block) if block.dtype == np.uint16 else block
    lo, hi = x.min(), x.max()                                 # NaN propagates: one pass tells all-finite
    if np.isfinite(lo) and np.isfinite(hi):
        x64 = x.astype(np.float64)
        return np.array([0, x.size, lo, hi, x64.sum(), np.dot(x64, x64), -1], dtype=np.float64)
    finite = np.isfinite(x)
    kept = np.where(finite, x, 0).astype(np.float64)
    n_finite = int(finite.sum())
    lo = x[finite].min() if n_finite else np.inf
    hi = x[finite].max() if n_finite else -np.inf
    return np.array([np.isnan(x).sum(), n_finite, lo, hi, kept.sum(), np.dot(kept, kept), np.argmin(finite)],
                    dtype=np.float64)


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    wide = bits.astype(np.uint32)
    np.left_shift(wide, 16, out=wide)
    return wide.view(np.float32)


def combine_blocks(parts: Sequence[np.ndarray], numel: int) -> list[float]:
    """STAT_VALUES from block_stats results, in block order."""
    if numel == 0:
        return list(_EMPTY)
    p = np.stack(parts).astype(np.float64)
    n_nan, n_finite, total, sumsq = (float(p[:, i].sum()) for i in (0, 1, 4, 5))
    lo, hi = float(p[:, 2].min()), float(p[:, 3].max())
    mean = total / n_finite if n_finite else math.nan
    var = max((sumsq - total * mean) / max(n_finite - 1, 1), 0.0) if n_finite else math.nan
    bad = [i * HOST_BLOCK + int(b[6]) for i, b in enumerate(parts) if b[6] >= 0]
    return [n_nan, numel - n_finite - n_nan, lo, hi, mean, math.sqrt(var), max(abs(lo), abs(hi)),
            math.sqrt(sumsq), bad[0] if bad else -1]


# ---------------------------------------------------------------------------------------------------------
def stats_dict(values: Sequence[float], dtype: torch.dtype, shape: Sequence[int]) -> dict[str, Any]:
    """The statistics of one site from STAT_VALUES (host floats)."""
    numel = int(np.prod(shape))
    n_nan, n_inf = int(values[0]), int(values[1])
    no_finite = n_nan + n_inf == numel
    out: dict[str, Any] = {"nan_count": n_nan, "inf_count": n_inf}
    for key, v in zip(STAT_KEYS[2:], values[2:8]):
        out[key] = float("nan") if no_finite and key != "l2" else float(v)
    out.update(numel=numel, dtype=dtype_name(dtype), shape=[int(s) for s in shape])
    if values[8] >= 0:
        out["first_nonfinite"] = [int(i) for i in np.unravel_index(int(values[8]), tuple(shape))]
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
