"""Numerical comparison of a candidate tensor against a reference: float metrics, bf16 ULPs, index agreement.

Everything is computed in float64, chunk by chunk, on the tensors' device, so memory stays bounded by one
chunk whatever the tensor size; NaN and Inf are counted and excluded from the float metrics, never fatal.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

CHUNK_ELEMS = 1 << 22
BF16_MANTISSA_BITS = 7
BF16_MIN_SPACING_EXP = -133          # spacing of bf16 subnormals (and of zero): 2^-133

# Order of the per-chunk values moved to the host in one transfer.
_SUMS = ("ref_nan", "ref_inf", "cand_nan", "cand_inf", "nonfinite_mismatch", "mismatches", "compared",
         "dot", "ref_sq", "cand_sq", "err_sq", "ulp_within_1", "ulp_within_2", "ulp_within_4")
_MAXES = ("max_abs", "max_rel", "max_ulp")         # each followed by its flat index, ref and cand values


def bf16_ulp(ref: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |ref| (float64 in, float64 out): 2^(floor(log2|ref|) - 7), and 2^-133 at
    and below bf16's subnormals. At an exact power of two this is the spacing above it (below it is half).

    2^floor(log2|ref|) is ref with its sign and mantissa bits cleared: one integer pass, then float ones
    (integer shifts and clamps cost several times more per element on a CPU).
    """
    power = (ref.view(torch.int64) & _F64_EXPONENT).view(torch.float64)
    return power.mul_(2.0 ** -BF16_MANTISSA_BITS).clamp_(min=2.0 ** BF16_MIN_SPACING_EXP)


_F64_EXPONENT = 0x7FF << 52


class MetricAccumulator:
    """Streams (reference, candidate) chunks in flat C order; result() gives compare()'s dict."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = tuple(shape)
        self.sums = dict.fromkeys(_SUMS, 0.0)
        self.maxes = {key: (-1.0, -1, math.nan, math.nan) for key in _MAXES}   # value, flat index, ref, cand
        self.first_mismatch = -1

    def update(self, ref: torch.Tensor, cand: torch.Tensor, offset: int) -> None:
        """Add one chunk; offset is the flat index of its first element in the whole tensor."""
        self.add(chunk_values(ref, cand), offset)

    def add(self, values: list[float], offset: int) -> None:
        """Add one chunk's chunk_values (computed anywhere, e.g. in a worker thread); chunks in order."""
        for key, value in zip(_SUMS, values):
            self.sums[key] += value
        rest = values[len(_SUMS):]
        for i, key in enumerate(_MAXES):
            value, index, ref_value, cand_value = rest[4 * i:4 * i + 4]
            if value > self.maxes[key][0]:
                self.maxes[key] = (value, offset + int(index), ref_value, cand_value)
        first = int(rest[-1])
        if self.first_mismatch < 0 and first >= 0:
            self.first_mismatch = offset + first

    def result(self) -> dict[str, Any]:
        s = self.sums
        out: dict[str, Any] = {"numel": int(np.prod(self.shape)), "compared": int(s["compared"])}
        out.update(cosine=_cosine(s["dot"], s["ref_sq"], s["cand_sq"]), rel_l2=_rel_l2(s["err_sq"], s["ref_sq"]),
                   sqnr_db=_sqnr_db(s["ref_sq"], s["err_sq"]))
        for key in _MAXES:
            value, index, ref_value, cand_value = self.maxes[key]
            has = index >= 0 and value > 0
            out[key] = value if has else 0.0
            out[f"{key}_index"] = self._coords(index) if has else None
            if key == "max_abs":
                out["max_abs_ref"], out["max_abs_cand"] = (ref_value, cand_value) if has else (None, None)
        compared = max(s["compared"], 1)
        for n in (1, 2, 4):
            out[f"ulp_within_{n}"] = s[f"ulp_within_{n}"] / compared if s["compared"] else math.nan
        for key in ("ref_nan", "ref_inf", "cand_nan", "cand_inf", "nonfinite_mismatch", "mismatches"):
            out[key] = int(s[key])
        out["first_mismatch_index"] = self._coords(self.first_mismatch) if self.first_mismatch >= 0 else None
        return out

    def _coords(self, flat: int) -> list[int]:
        return [int(i) for i in np.unravel_index(flat, self.shape)] if self.shape else []


def chunk_values(ref: torch.Tensor, cand: torch.Tensor) -> list[float]:
    """What MetricAccumulator.add takes for one chunk of (reference, candidate)."""
    return _chunk_values(ref.reshape(-1), cand.reshape(-1)).tolist()


def _chunk_values(ref: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """_SUMS, then (value, flat index, ref, cand) of each of _MAXES, then the first mismatch (-1: none)."""
    r, c = ref.double(), cand.double()
    if ref.device.type == "cpu":
        return _finite_chunk_values(r, c)
    return _general_chunk_values(r, c)


def _finite_chunk_values(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """_chunk_values of a chunk with no NaN/Inf on either side, in about half the passes (dot products, one
    mask for the relative error, ULP counts from one bincount); a chunk that has some (its squared norms are
    then not finite: float64 squares of bf16/float32 values cannot overflow) goes to the general path.
    Meant for host tensors: the extra sync it costs would stall a GPU."""
    ref_sq, cand_sq = torch.dot(r, r), torch.dot(c, c)
    if not (math.isfinite(ref_sq) and math.isfinite(cand_sq)):
        return _general_chunk_values(r, c)
    err = (c - r).abs_()
    abs_r = r.abs()
    rel = (err / abs_r).masked_fill_(abs_r == 0, 0)
    ulp = err / bf16_ulp(r)
    n = r.numel()
    maxes = []
    for values in (err, rel, ulp):
        i = int(values.argmax())
        maxes += [float(values[i]), i, float(r[i]), float(c[i])]
    within = torch.bincount(ulp.clamp_(max=5).ceil_().long(), minlength=6).cumsum(0)   # ulp <= 0, 1, ... 5
    mismatches = n - int(within[0])                     # ulp is 0 exactly where err is (the spacing is > 0)
    first = _first_nonzero(err) if mismatches else -1
    sums = [0, 0, 0, 0, 0, mismatches, n, float(torch.dot(r, c)), float(ref_sq), float(cand_sq),
            float(torch.dot(err, err)), int(within[1]), int(within[2]), int(within[4])]
    return torch.tensor([*sums, *maxes, first], dtype=torch.float64)


def _first_nonzero(x: torch.Tensor, probe: int = 4096) -> int:
    """Index of x's first non-zero (x has one): a short probe first, since where two tensors differ they
    usually differ early, and a whole pass over the chunk only when the probe finds none."""
    hits = x[:probe].nonzero()
    return int(hits[0]) if len(hits) else int((x != 0).to(torch.uint8).argmax())


def _general_chunk_values(r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    r_nan, c_nan, r_inf, c_inf = r.isnan(), c.isnan(), r.isinf(), c.isinf()
    both = ~(r_nan | c_nan | r_inf | c_inf)
    same_nonfinite = (r_nan & c_nan) | (r_inf & (r == c))
    nonfinite_mismatch = ~both & ~same_nonfinite
    mismatch = (r != c) & ~same_nonfinite
    r0, c0 = torch.where(both, r, 0), torch.where(both, c, 0)
    err = (c0 - r0).abs()
    rel = torch.where(r0 != 0, err / r0.abs(), 0)
    ulp = err / bf16_ulp(r0)
    sums = [r_nan.sum(), r_inf.sum(), c_nan.sum(), c_inf.sum(), nonfinite_mismatch.sum(), mismatch.sum(),
            both.sum(), (r0 * c0).sum(), (r0 * r0).sum(), (c0 * c0).sum(), (err * err).sum(),
            (both & (ulp <= 1)).sum(), (both & (ulp <= 2)).sum(), (both & (ulp <= 4)).sum()]
    maxes = []
    for values in (err, rel, ulp):
        i = values.argmax()
        maxes += [values[i], i, r[i], c[i]]
    first = torch.where(mismatch.any(), mismatch.to(torch.uint8).argmax(), -1)
    return torch.stack([v.to(torch.float64) for v in (*sums, *maxes, first)]).cpu()


def _cosine(dot: float, ref_sq: float, cand_sq: float) -> float:
    if ref_sq == 0 or cand_sq == 0:
        return 1.0 if ref_sq == cand_sq else 0.0
    return dot / math.sqrt(ref_sq * cand_sq)


def _rel_l2(err_sq: float, ref_sq: float) -> float:
    if ref_sq == 0:
        return 0.0 if err_sq == 0 else math.inf
    return math.sqrt(err_sq / ref_sq)


def _sqnr_db(ref_sq: float, err_sq: float) -> float:
    if err_sq == 0:
        return math.inf
    return 10 * math.log10(ref_sq / err_sq) if ref_sq > 0 else -math.inf


def compare(ref: torch.Tensor, cand: torch.Tensor, chunk_elems: int = CHUNK_ELEMS) -> dict[str, Any]:
    """Metrics of cand against ref (same shape), over the elements where both are finite.

    Keys: numel, compared, cosine, rel_l2, sqnr_db, max_abs (+ _index coordinates, _ref, _cand values),
    max_rel (|err| / |ref| over ref != 0, + _index), max_ulp (+ _index) and ulp_within_1/2/4 (fractions)
    in bf16 ULPs at the reference value, ref_nan, ref_inf, cand_nan, cand_inf, nonfinite_mismatch
    (positions where finiteness or the non-finite value differs), mismatches (elements not bitwise equal in
    value) and first_mismatch_index.
    """
    if tuple(ref.shape) != tuple(cand.shape):
        raise ValueError(f"compare: shapes differ, reference {tuple(ref.shape)} vs candidate {tuple(cand.shape)}")
    acc = MetricAccumulator(tuple(ref.shape))
    ref_flat, cand_flat = ref.detach().reshape(-1), cand.detach().reshape(-1)
    for start in range(0, ref_flat.numel(), chunk_elems):
        acc.update(ref_flat[start:start + chunk_elems], cand_flat[start:start + chunk_elems], start)
    return acc.result()


def compare_fast(ref: torch.Tensor, cand: torch.Tensor) -> dict[str, Any]:
    """compare(), with a shortcut for the common case of bitwise-identical finite tensors (ops a candidate
    shares with the reference): one torch.equal instead of ~30 float64 passes."""
    if ref.dtype == cand.dtype and torch.equal(ref, cand) and bool(torch.isfinite(ref).all()):
        n = ref.numel()
        out: dict[str, Any] = {"numel": n, "compared": n, "cosine": 1.0, "rel_l2": 0.0, "sqnr_db": math.inf}
        for key in _MAXES:
            out |= {key: 0.0, f"{key}_index": None}
        out |= {"max_abs_ref": None, "max_abs_cand": None, "ulp_within_1": 1.0, "ulp_within_2": 1.0,
                "ulp_within_4": 1.0, "ref_nan": 0, "ref_inf": 0, "cand_nan": 0, "cand_inf": 0,
                "nonfinite_mismatch": 0, "mismatches": 0, "first_mismatch_index": None}
        return out
    return compare(ref, cand)


# ---------------------------------------------------------------------------------------------------------
# Index outputs (top-k ids, routing)
# ---------------------------------------------------------------------------------------------------------
def index_agreement(ref_ids: torch.Tensor, cand_ids: torch.Tensor, ref_scores: torch.Tensor | None = None,
                    tie_margin: float = 0.0, chunk_elems: int = CHUNK_ELEMS) -> dict[str, Any]:
    """Per-token set agreement of two [N, k] id tensors (-1 entries are padding).

    agreement of a token = |ref ∩ cand| / max(|ref|, |cand|) (1 when both are empty). A flip is an id the
    reference selected and the candidate did not. With ref_scores ([N, E]: the reference's score of every
    id), flips are paired lowest-scored dropped id with best-scored added id; a pair whose reference score
    gap is below tie_margin is a tie (a legitimate reordering of near-equal scores), the others are
    untied (hard_flips). flip_rate = untied flips / reference selections: the error metric of index sites.
    """
    if ref_ids.shape != cand_ids.shape or ref_ids.dim() != 2:
        raise ValueError(f"index_agreement: need two [N, k] tensors, got {tuple(ref_ids.shape)} "
                         f"and {tuple(cand_ids.shape)}")
    n, k = ref_ids.shape
    universe = _universe(ref_ids, cand_ids, ref_scores)
    rows = max(1, chunk_elems // max(universe, 1))
    parts = [_agreement_rows(ref_ids[i:i + rows], cand_ids[i:i + rows], universe,
                             None if ref_scores is None else ref_scores[i:i + rows], tie_margin)
             for i in range(0, n, rows)]
    agreement = torch.cat([p["agreement"] for p in parts])
    flips = torch.cat([p["flips"] for p in parts])
    ties = torch.cat([p["ties"] for p in parts])
    selected = sum(int(p["selected"]) for p in parts)
    untied = flips - ties
    out: dict[str, Any] = {
        "tokens": n, "k": k,
        "agreement_mean": float(agreement.mean()) if n else 1.0,
        "agreement_min": float(agreement.min()) if n else 1.0,
        "agreement_min_token": int(agreement.argmin()) if n else -1,
        "exact_tokens": float((flips == 0).double().mean()) if n else 1.0,
        "flips": int(flips.sum()), "ties": int(ties.sum()), "hard_flips": int(untied.sum()),
        "flip_rate": float(untied.sum()) / selected if selected else 0.0,
        "tokens_with_untied_flips": int((untied > 0).sum()),
        "first_untied_flip_token": int((untied > 0).to(torch.uint8).argmax()) if (untied > 0).any() else None,
    }
    return out


def _universe(ref_ids: torch.Tensor, cand_ids: torch.Tensor, ref_scores: torch.Tensor | None) -> int:
    largest = int(max(ref_ids.max(), cand_ids.max())) + 1 if ref_ids.numel() else 1
    return max(largest, ref_scores.shape[1] if ref_scores is not None else 0)


def _membership(ids: torch.Tensor, universe: int) -> torch.Tensor:
    """[rows, universe] bool mask of the ids present in each row (padding -1 ignored)."""
    mask = torch.zeros(ids.shape[0], universe + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(ids < 0, universe, ids).long(), True)
    return mask[:, :universe]


def _agreement_rows(ref_ids, cand_ids, universe, scores, tie_margin) -> dict[str, torch.Tensor]:
    ref_mask, cand_mask = _membership(ref_ids, universe), _membership(cand_ids, universe)
    common = (ref_mask & cand_mask).sum(1)
    larger = torch.maximum(ref_mask.sum(1), cand_mask.sum(1))
    agreement = torch.where(larger > 0, common.double() / larger.clamp(min=1).double(), 1.0)
    dropped, added = ref_mask & ~cand_mask, cand_mask & ~ref_mask
    flips = dropped.sum(1)
    ties = torch.zeros_like(flips)
    if scores is not None and bool(flips.any()):
        ties = _tied_pairs(scores[:, :universe].double(), dropped, added, tie_margin)
    return {"agreement": agreement, "flips": flips, "ties": ties, "selected": ref_mask.sum()}


def _tied_pairs(scores, dropped, added, tie_margin) -> torch.Tensor:
    """Per row: pairs (i-th lowest dropped, i-th best added) whose reference score gap < tie_margin."""
    width = int(max(dropped.sum(1).max(), added.sum(1).max()))
    low_dropped = torch.where(dropped, scores, torch.inf).sort(dim=1).values[:, :width]
    best_added = torch.where(added, scores, -torch.inf).sort(dim=1, descending=True).values[:, :width]
    gap = low_dropped - best_added
    return (torch.isfinite(gap) & (gap < tie_margin)).sum(1)


# ---------------------------------------------------------------------------------------------------------
# Noise floors
# ---------------------------------------------------------------------------------------------------------
# Smallest floor a verdict divides by, per metric. A site computed exactly in the reference (an embedding
# lookup, a copy) has floor 0 against fp64, yet its bf16 output is still one rounding away from any other
# correct implementation: 2^-9 is the RMS relative error of one bf16 rounding (unit roundoff 2^-8, errors
# spread over +-u/2..u), so an error below it is never called a divergence. For index sites one untied flip
# per 1000 selections is the same idea: below it, call it noise.
MIN_FLOORS = {"rel_l2": 2.0 ** -9, "flip_rate": 1e-3}


def floor_ratio(err: float, floor: float | None, min_floor: float) -> float:
    """err in units of its noise floor ("x floor"); the floor is raised to min_floor; NaN/Inf err -> inf."""
    if err is None or not math.isfinite(err):
        return math.inf
    base = max(floor if floor is not None and math.isfinite(floor) else 0.0, min_floor)
    return err / base
