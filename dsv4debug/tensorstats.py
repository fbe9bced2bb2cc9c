"""Statistics of a site's output: NaN/Inf counts, and min, max, mean, std, absmax, L2 over finite values.

Two implementations produce the same per-block partial sums (PARTIALS), which `combine_blocks` turns into
the statistics on the host: `device_stats` runs torch ops where the tensor lives (on a GPU: about 18 small
kernels, no sync, one small tensor to move to the host), `block_stats` runs numpy on one 1-D block of a host
tensor in a worker thread, with the GIL released; `device_rows(kernel=True)` and `fill_device_rows` have the
CuTeDSL site_stats kernel (kernels/stats.py) produce them instead, many tensors in one launch. Sums are
float64, so squares cannot overflow (the host's bf16 blocks sum in float32 where their magnitudes rule overflow
out), and temporaries stay one block large.
"""
from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

STAT_KEYS = ("nan_count", "inf_count", "min", "max", "mean", "std", "absmax", "l2")
# combine_blocks' result: STAT_KEYS then the flat index of the first non-finite element (-1: none)
STAT_VALUES = (*STAT_KEYS, "first_nonfinite")
# one row per block, from device_stats and block_stats alike
PARTIALS = ("nan_count", "finite_count", "min", "max", "sum", "sum_sq", "first_nonfinite")
# elements per step on the device: the temporaries (masks, copies in x's dtype) of a step are ~5 times its size,
# and with 64M elements the fp64 floor run's sites raised a capture's peak GPU memory by ~1 GiB over the run's
DEVICE_CHUNK = 1 << 22
HOST_BLOCK = 1 << 20              # elements per numpy task
_F32_SQUARE_SAFE = 1e16           # |x| below it: a block's float32 sum of squares stays far from overflow


def device_stats(t: torch.Tensor) -> torch.Tensor:
    """float64 [chunks, PARTIALS] computed where t lives (about 18 kernels per 4M elements); nothing waits."""
    x = t.detach().reshape(-1)
    if x.numel() == 0:
        return torch.zeros(0, len(PARTIALS), dtype=torch.float64, device=x.device)
    return torch.stack([_device_partials(x[i:i + DEVICE_CHUNK]) for i in range(0, x.numel(), DEVICE_CHUNK)])


class DeviceRows(NamedTuple):
    rows: int                                   # PARTIALS rows
    block: int                                  # elements per row
    by: str                                     # KERNEL or TORCH_OPS


KERNEL, TORCH_OPS = "site_stats kernel", "torch ops"


def device_rows(t: torch.Tensor, kernel: bool = False) -> DeviceRows:
    """How t's PARTIALS rows are made where it lives: by device_stats, or with `kernel` by the CuTeDSL
    site_stats kernel where it takes t (contiguous bf16/fp32/fp64 CUDA tensors of whole 16-byte vectors; needs
    nvidia-cutlass-dsl), which does many tensors in one launch (fill_device_rows)."""
    if kernel and t.is_cuda:
        layout = _site_stats_module().layout(t)
        if layout is not None:
            return DeviceRows(*layout, KERNEL)
    return DeviceRows(-(-t.numel() // DEVICE_CHUNK), DEVICE_CHUNK, TORCH_OPS)


def fill_device_rows(items: Sequence[tuple[torch.Tensor, int, str]], out: torch.Tensor) -> None:
    """Write the PARTIALS rows of each (tensor, first row, by) of device_rows into `out` (float64 [rows, PARTIALS]
    where the tensors live; a capture's slab of rows, so that no site allocates or copies its own): the
    kernel's tensors in one site_stats launch per dtype, the others by device_stats. Nothing waits."""
    batch = [(t, first) for t, first, by in items if by == KERNEL]
    if batch:
        _site_stats_module().site_stats([t for t, _ in batch], [first for _, first in batch], out, supported=True)
    for t, first, by in items:
        if by == TORCH_OPS and t.numel():
            rows = device_stats(t)
            out[first:first + rows.shape[0]].copy_(rows)


@functools.cache                    # asked at every record(): an import statement costs ~1 us
def _site_stats_module():
    try:
        from dsv4_kernels import stats
    except ImportError as e:
        raise RuntimeError(f"the site_stats kernel needs CuTeDSL (pip install -e '.[gpu]'): {e}") from None
    return stats


def _device_partials(chunk: torch.Tensor) -> torch.Tensor:
    """PARTIALS of one chunk, read in its own dtype (bf16 stays 2 bytes an element; no float64 copy): the sums
    accumulate in float64 inside the reductions. Integers, bools and 1-byte floats (no Inf) are widened."""
    x = chunk if chunk.is_floating_point() and chunk.element_size() > 1 else chunk.double()
    finite = torch.isfinite(x)
    n_finite = finite.sum(dtype=torch.float64)
    kept = torch.where(finite, x, 0)
    first_bad = torch.where(n_finite == x.numel(), -1, finite.to(torch.uint8).argmin())
    return torch.stack([x.isnan().sum(dtype=torch.float64), n_finite,
                        torch.where(finite, x, torch.inf).amin().double(),
                        torch.where(finite, x, -torch.inf).amax().double(), kept.sum(dtype=torch.float64),
                        torch.linalg.vector_norm(kept, dtype=torch.float64).square(), first_bad.double()])


_EMPTY = [0, 0, math.nan, math.nan, math.nan, math.nan, math.nan, 0, -1]


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Statistics of any tensor, synchronously (the runner's per-site statistics, tests): on a GPU by the
    site_stats kernel where CuTeDSL is installed (one launch instead of ~18)."""
    n, block, by = device_rows(t, kernel=t.is_cuda and site_stats_installed())
    rows = torch.empty(n, len(PARTIALS), dtype=torch.float64, device=t.device)
    fill_device_rows([(t.detach(), 0, by)], rows)
    return stats_dict(combine_blocks(list(rows.cpu().numpy()), t.numel(), block), t.dtype, tuple(t.shape))


@functools.cache
def site_stats_installed() -> bool:
    """Whether the CuTeDSL site_stats kernel can be imported (nvidia-cutlass-dsl and dsv4_kernels)."""
    return importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("dsv4_kernels") is not None


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
    """PARTIALS of one block (uint16 = bf16 bits). Sums accumulate in float64 through numpy's buffered
    casts (no float64 copy of the block), or for bf16 in float32 pairwise (below); no BLAS, which would start
    its own threads in every worker."""
    own = block.dtype == np.uint16                  # x is then this function's own float32 copy
    x = _widen_bf16(block) if own else block
    lo, hi = x.min(), x.max()                                 # NaN propagates: one pass tells all-finite
    if np.isfinite(lo) and np.isfinite(hi):
        n_nan, n_finite, first_bad, kept = 0, x.size, -1, x
    else:
        finite = np.isfinite(x)
        n_nan, n_finite, first_bad = int(np.isnan(x).sum()), int(finite.sum()), int(np.argmin(finite))
        kept = np.where(finite, x, 0)
        lo = x[finite].min() if n_finite else np.inf
        hi = x[finite].max() if n_finite else -np.inf
    if own and max(abs(float(lo)), abs(float(hi))) < _F32_SQUARE_SAFE:
        # bf16: float32 squares cannot overflow here, and numpy's pairwise float32 sums err by ~1e-7 log2(n);
        # squared in place (a fresh 4 MiB temporary costs more in page faults than the arithmetic): a third of
        # the time of the float64 casts, the largest cost of a full capture of CPU tensors
        total = np.add.reduce(kept)
        sum_sq = np.add.reduce(np.square(kept, out=kept))
    else:
        total = np.add.reduce(kept, dtype=np.float64)
        sum_sq = np.einsum("i,i->", kept, kept, dtype=np.float64)
    return np.array([n_nan, n_finite, lo, hi, total, sum_sq, first_bad], dtype=np.float64)


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    wide = bits.astype(np.uint32)
    np.left_shift(wide, 16, out=wide)
    return wide.view(np.float32)


def combine_blocks(parts: Sequence[np.ndarray], numel: int, block: int) -> list[float]:
    """STAT_VALUES from PARTIALS rows of consecutive blocks of `block` elements (one site's combine_segments)."""
    if numel == 0 or not len(parts):
        return list(_EMPTY)
    values = combine_segments(np.stack(parts), np.array([0]), np.array([len(parts)]), np.array([numel]),
                              np.array([block]))[0].tolist()
    values[8] = int(values[8])                                  # an index
    return values


def combine_segments(rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, numels: np.ndarray,
                     blocks: np.ndarray) -> np.ndarray:
    """STAT_VALUES of many sites at once: site i owns rows[starts[i]:starts[i] + counts[i]] (consecutive
    blocks of blocks[i] elements, numels[i] in all); returns float64 [sites, STAT_VALUES]. A few numpy passes
    for a whole layer, instead of a loop of Python work per site in the capture's writer thread."""
    out = np.empty((len(starts), len(STAT_VALUES)), dtype=np.float64)
    out[:] = _EMPTY
    ends = starts + counts
    if len(starts) and (np.any(starts[1:] != ends[:-1]) or starts[0] != 0 or ends[-1] != len(rows)):
        raise ValueError("combine_segments takes consecutive segments that cover the rows")
    some = counts > 0
    if not some.any():
        return out
    st, n, blk = starts[some], numels[some].astype(np.float64), blocks[some].astype(np.float64)
    p = rows.astype(np.float64, copy=False)
    n_nan, n_finite = np.add.reduceat(p[:, 0], st), np.add.reduceat(p[:, 1], st)
    lo, hi = np.minimum.reduceat(p[:, 2], st), np.maximum.reduceat(p[:, 3], st)
    total, sumsq = np.add.reduceat(p[:, 4], st), np.add.reduceat(p[:, 5], st)
    # the first non-finite index over the rows that have one (most layers: none; a pass over all rows was
    # half of a Pro layer's combine)
    first = np.full(len(st), np.inf)
    bad_rows = np.flatnonzero(p[:, 6] >= 0)
    if bad_rows.size:
        owner = np.searchsorted(st, bad_rows, side="right") - 1   # each bad row's site (among `some`)
        np.minimum.at(first, owner, (bad_rows - st[owner]) * blk[owner] + p[bad_rows, 6])
    # a sum of squares past float64's range (fp32 values near their max) is inf: the std is then inf, not the
    # NaN of inf - inf
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        mean = np.where(n_finite > 0, total / n_finite, np.nan)
        var = np.maximum((sumsq - total * mean) / np.maximum(n_finite - 1, 1), 0.0)
        var[np.isinf(sumsq)] = np.inf
    out[some] = np.stack([n_nan, n - n_finite - n_nan, lo, hi, mean, np.where(n_finite > 0, np.sqrt(var), np.nan),
                          np.maximum(np.abs(lo), np.abs(hi)), np.sqrt(sumsq), np.where(np.isinf(first), -1, first)],
                         axis=1)
    return out


# ---------------------------------------------------------------------------------------------------------
def stats_columns(values: np.ndarray | Sequence[Sequence[float]], shapes: Sequence[tuple[int, ...]]
                  ) -> dict[str, Any]:
    """The statistics of many sites, column by column, from their STAT_VALUES rows [sites, STAT_VALUES]: a
    capture's writer turns a layer's ~400 sites into site-table rows in a few numpy passes. Extremes and moments
    are NaN where a site has no finite element (its l2 is then 0); first_nonfinite holds coordinates or None."""
    v = np.asarray(values, dtype=np.float64).reshape(len(shapes), len(STAT_VALUES))
    numel = np.array([math.prod(s) for s in shapes], dtype=np.int64)
    nan_count, inf_count = v[:, 0].astype(np.int64), v[:, 1].astype(np.int64)
    finite_only = np.where((nan_count + inf_count == numel)[:, None], np.nan, v[:, 2:7])
    cols: dict[str, Any] = {"nan_count": nan_count, "inf_count": inf_count, **dict(zip(STAT_KEYS[2:7], finite_only.T)),
                            "l2": v[:, 7], "numel": numel}
    cols["first_nonfinite"] = [None if i < 0 else [int(c) for c in np.unravel_index(int(i), s)]
                               for i, s in zip(v[:, 8], shapes)]
    return cols


def stats_dict(values: Sequence[float], dtype: torch.dtype, shape: Sequence[int]) -> dict[str, Any]:
    """The statistics of one site from STAT_VALUES (host floats): stats_columns' values for one site, in
    plain Python (the runner asks per site and run, and numpy's per-call cost would be 5x this)."""
    numel = math.prod(shape)
    n_nan, n_inf = int(values[0]), int(values[1])
    no_finite = n_nan + n_inf == numel
    out: dict[str, Any] = {"nan_count": n_nan, "inf_count": n_inf}
    for key, v in zip(STAT_KEYS[2:], values[2:8]):
        out[key] = float("nan") if no_finite and key != "l2" else float(v)
    out.update(numel=int(numel), dtype=dtype_name(dtype), shape=[int(s) for s in shape])
    if values[8] >= 0:
        out["first_nonfinite"] = [int(i) for i in np.unravel_index(int(values[8]), tuple(shape))]
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
