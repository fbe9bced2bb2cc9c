"""Verdicts from per-site records: NaN origin, first divergence over the noise floor, worst sites.

Pure functions on plain dicts, so the runner can call them live and `report` from a capture file. A record:

    {"site": "layers.3.attn.wq_a", "layer": 3, "family": "linear", "inputs": ["layers.3.attn_norm"],
     "stats": {...},       # statistics of this run's output (tensorstats.stats_dict: nan_count, inf_count ...)
     "metrics": {...},     # optional: metrics.compare / index_agreement of this run against the reference
     "floor": {...}}       # optional: noise floor per metric name for this site (e.g. {"rel_l2": 0.002})

Records are in execution order. Inputs that were not recorded are assumed finite.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .metrics import MIN_FLOORS, floor_ratio

# A site diverges when its error exceeds budget x its noise floor. BF16 floors (reference vs fp64) suit a
# BF16 candidate; a quantised candidate (FP8/NVFP4) should be judged against floors measured with the
# simulator backend, or with a larger budget, or it diverges everywhere by design.
DEFAULT_BUDGET = 8.0
# field-notes.md: healthy logits are finite with a standard deviation between 0.5 and 50.
LOGITS_STD_RANGE = (0.5, 50.0)

Record = Mapping[str, Any]


def _nonfinite(stats: Mapping[str, Any] | None) -> bool:
    return bool(stats) and stats.get("nan_count", 0) + stats.get("inf_count", 0) > 0


def nan_origin(records: Sequence[Record]) -> dict[str, Any] | None:
    """The first site whose inputs are all finite and whose output is not, or None when all is finite.

    Also lists other such sites (`other_origins`): independent origins, e.g. a second broken expert.
    """
    finite: dict[str, bool] = {}
    stats_of: dict[str, Mapping[str, Any]] = {}
    origins = []
    for rec in records:
        bad = _nonfinite(rec.get("stats"))
        inputs = list(rec.get("inputs") or [])
        if bad and all(finite.get(name, True) for name in inputs):
            origins.append(rec)
        finite[rec["site"]] = not bad
        stats_of[rec["site"]] = rec.get("stats") or {}
    if not origins:
        return None
    first = origins[0]
    stats = first.get("stats") or {}
    inputs = list(first.get("inputs") or [])
    return {"site": first["site"], "layer": first.get("layer"), "family": first.get("family", ""),
            "nan_count": stats.get("nan_count", 0), "inf_count": stats.get("inf_count", 0),
            "first_nonfinite": stats.get("first_nonfinite"),
            "inputs": {name: stats_of.get(name) for name in inputs},
            "unrecorded_inputs": [name for name in inputs if name not in stats_of],
            "other_origins": [rec["site"] for rec in origins[1:]]}


def site_error(metrics: Mapping[str, Any] | None) -> tuple[str, float] | None:
    """(metric name, error) that judges a site: flip_rate for index sites, rel_l2 otherwise; a NaN/Inf that
    the reference does not have is an infinite error."""
    if not metrics:
        return None
    metric = "flip_rate" if "flip_rate" in metrics else "rel_l2"
    if metric not in metrics:
        return None
    if metrics.get("nonfinite_mismatch", 0) > 0:
        return metric, math.inf
    value = metrics[metric]
    return metric, math.inf if value is None else float(value)


def judge(rec: Record, budget: float = DEFAULT_BUDGET) -> dict[str, Any] | None:
    """The site's error in units of its floor, and whether it exceeds the budget; None without metrics."""
    error = site_error(rec.get("metrics"))
    if error is None:
        return None
    metric, value = error
    floor = (rec.get("floor") or {}).get(metric)
    min_floor = MIN_FLOORS.get(metric, 0.0)
    ratio = floor_ratio(value, floor, min_floor)
    return {"site": rec["site"], "layer": rec.get("layer"), "family": rec.get("family", ""), "metric": metric,
            "error": value, "floor": floor, "min_floor": min_floor, "x_floor": ratio, "budget": budget,
            "tolerance": budget * max(floor or 0.0, min_floor), "exceeds": ratio > budget}


def first_divergence(records: Sequence[Record], budget: float = DEFAULT_BUDGET) -> dict[str, Any] | None:
    """The first site (execution order) whose error exceeds budget x its noise floor."""
    for rec in records:
        verdict = judge(rec, budget)
        if verdict is not None and verdict["exceeds"]:
            return verdict
    return None


def worst_sites(records: Sequence[Record], n: int = 10, budget: float = DEFAULT_BUDGET) -> list[dict[str, Any]]:
    """The n sites with the largest error in units of their floor, largest first."""
    judged = [v for v in (judge(rec, budget) for rec in records) if v is not None]
    return sorted(judged, key=lambda v: -v["x_floor"])[:n]


def summarize(records: Sequence[Record], forced_records: Sequence[Record] | None = None,
              budget: float = DEFAULT_BUDGET, n_worst: int = 10) -> dict[str, Any]:
    """The verdict of a run.

    records: the free-running candidate (accumulated error: where the symptom appears). forced_records:
    the teacher-forced candidate (local error: the first site over its floor is the bug). gain is the
    symptom's x floor over the bug's x floor: how much the error was amplified on the way.
    """
    origin = nan_origin(records)
    symptom = first_divergence(records, budget)
    bug = first_divergence(forced_records, budget) if forced_records else None
    has_metrics = any(rec.get("metrics") for rec in [*records, *(forced_records or [])])
    status = "nan" if origin else "diverged" if (symptom or bug) else "clean" if has_metrics else "no-reference"
    verdict = {"status": status, "budget": budget, "nan_origin": origin, "first_divergence": symptom,
               "first_local_divergence": bug, "gain": _gain(symptom, bug),
               "worst": worst_sites(records, n_worst, budget),
               "worst_local": worst_sites(forced_records or [], n_worst, budget),
               "message": _message(status, origin, symptom, bug)}
    rec = next((r for r in records if r["site"] == "logits"), None)
    return with_logits_check(verdict, rec.get("stats") if rec else None)


def with_logits_check(verdict: dict[str, Any], stats: Mapping[str, Any] | None) -> dict[str, Any]:
    """The verdict with the check of the logits' statistics (None: no logits); one that is clean (or unjudged)
    but whose logits fail it becomes garbage-logits: within the floors of a reference as broken as its
    candidate, or never compared."""
    verdict["logits_check"] = logits = logits_check(stats)
    if logits and not logits["ok"] and verdict["status"] in ("clean", "no-reference"):
        verdict["status"] = "garbage-logits"
        verdict["message"] = (f"the logits look like garbage: std {logits['std']:.3g} outside "
                              f"{logits['std_range']}, {logits['nan_count']} NaN, {logits['inf_count']} Inf; "
                              + verdict["message"])
    return verdict


def logits_check(stats: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Are the logits (by their statistics) finite with a plausible spread? Garbage output is never called a
    success."""
    if not stats:
        return None
    std = stats.get("std", math.nan)
    low, high = LOGITS_STD_RANGE
    ok = not _nonfinite(stats) and low <= std <= high
    return {"ok": ok, "std": std, "std_range": [low, high], "nan_count": stats.get("nan_count", 0),
            "inf_count": stats.get("inf_count", 0)}


def _gain(symptom: Mapping[str, Any] | None, bug: Mapping[str, Any] | None) -> float | None:
    if not symptom or not bug or not bug["x_floor"]:
        return None
    return symptom["x_floor"] / bug["x_floor"]


def _message(status: str, origin, symptom, bug) -> str:
    if status == "nan":
        return f"NaN/Inf first produced by {origin['site']} from finite inputs"
    if status == "no-reference":
        return "no metrics against a reference: only statistics were judged (no NaN/Inf found)"
    if status == "clean":
        return "every site within its noise-floor budget"
    parts = []
    if bug:
        parts.append(f"local error first exceeds its floor at {bug['site']} ({_times_floor(bug['x_floor'])})")
    if symptom:
        parts.append(f"accumulated error first exceeds its floor at {symptom['site']} "
                     f"({_times_floor(symptom['x_floor'])})")
    return "; ".join(parts)


def _times_floor(x: float) -> str:
    return f"{x:.3g}x floor" if math.isfinite(x) else "non-finite error"
