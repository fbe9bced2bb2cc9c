"""Compare two captures site by site (`dsv4debug diff`), streaming, against per-site rules.

Sites whose stored tensors have equal content hashes are not loaded; stored tensors are compared one HDF5
chunk of rows at a time, so memory is bounded by a chunk whatever the model size; where a tensor was not
stored on either side, the statistics are compared instead (|l2_a - l2_b| / l2_a is a lower bound of
rel_l2, so it can only under-report).
"""
from __future__ import annotations

import functools
import math
import os
import re
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from .capture import CaptureReader, plain
from .errors import BadInput
from .h5chunks import from_storage, read_rows
from .metrics import MetricAccumulator, chunk_values


@dataclass(frozen=True)
class Rule:
    """Thresholds for the sites whose name matches `sites` (re.search). None disables a check."""
    sites: str = ""
    ignore: bool = False
    allow_nonfinite: bool = False          # NaN/Inf present on one side only is a violation unless allowed
    cosine_min: float | None = 0.999
    rel_l2_max: float | None = 1e-2
    max_abs_max: float | None = None
    max_ulp_max: float | None = None
    sqnr_min_db: float | None = None
    mismatches_max: int | None = 0         # integer tensors (top-k ids): elements that differ

    def matches(self, site: str) -> bool:
        return re.search(self.sites, site) is not None


RULE_KEYS = tuple(f.name for f in fields(Rule))


@dataclass(frozen=True)
class Rules:
    default: Rule = Rule()
    rules: tuple[Rule, ...] = ()

    def for_site(self, site: str) -> Rule:
        """The first [[rule]] matching the site, or the default."""
        return next((rule for rule in self.rules if rule.matches(site)), self.default)


def load_rules(path: str | Path | None) -> Rules:
    """Rules from TOML: an optional [default] table and [[rule]] tables with `sites = "REGEX"`."""
    if path is None:
        return Rules()
    data = _read_toml(Path(path))
    unknown = set(data) - {"default", "rule"}
    if unknown:
        raise BadInput(f"rules file {path}: unknown top-level keys {sorted(unknown)}; "
                       "use a 'default' table and 'rule' tables")
    default = _make_rule(path, "table 'default'", Rule(), data.get("default", {}), need_sites=False)
    rules = tuple(_make_rule(path, f"rule {i + 1}", default, table, need_sites=True)
                  for i, table in enumerate(data.get("rule", [])))
    return Rules(default, rules)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:      # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise BadInput(f"reading the rules file {path} needs Python >= 3.11 or `pip install tomli`") from None
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"rules file {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"rules file {path}: not valid TOML ({e})") from None


def _make_rule(path, where: str, base: Rule, table: Any, need_sites: bool) -> Rule:
    if not isinstance(table, dict):
        raise BadInput(f"rules file {path}: {where} must be a table")
    unknown = set(table) - set(RULE_KEYS)
    if unknown:
        raise BadInput(f"rules file {path}: {where}: unknown keys {sorted(unknown)}; known: {', '.join(RULE_KEYS)}")
    if need_sites and not isinstance(table.get("sites"), str):
        raise BadInput(f"rules file {path}: {where} needs sites = \"REGEX\" (a regular expression on site names)")
    try:
        re.compile(table.get("sites", ""))
    except re.error as e:
        raise BadInput(f"rules file {path}: {where}: bad regular expression ({e})") from None
    return replace(base, **table)


# ---------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------
def tensor_violations(m: Mapping[str, Any], rule: Rule, integer: bool) -> list[str]:
    """Human-readable rule violations of compare()-style metrics."""
    out = []
    if m["nonfinite_mismatch"] and not rule.allow_nonfinite:
        out.append(f"NaN/Inf differ at {m['nonfinite_mismatch']} elements (first at {m['first_mismatch_index']})")
    if integer:
        if rule.mismatches_max is not None and m["mismatches"] > rule.mismatches_max:
            out.append(f"{m['mismatches']} elements differ > {rule.mismatches_max} "
                       f"(first at {m['first_mismatch_index']})")
        return out
    where = f" (max |err| {m['max_abs']:.4g} at {m['max_abs_index']}: {m['max_abs_ref']} vs {m['max_abs_cand']})"
    checks = [("cosine", m["cosine"], rule.cosine_min, "<"), ("rel_l2", m["rel_l2"], rule.rel_l2_max, ">"),
              ("max_abs", m["max_abs"], rule.max_abs_max, ">"), ("max_ulp", m["max_ulp"], rule.max_ulp_max, ">"),
              ("sqnr_db", m["sqnr_db"], rule.sqnr_min_db, "<")]
    for name, value, bound, op in checks:
        if bound is not None and (value < bound if op == "<" else value > bound):
            out.append(f"{name} {value:.6g} {op} {bound}{where if m['max_abs_index'] else ''}")
    return out


def stats_metrics(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    l2_a, l2_b = a.get("l2", 0.0), b.get("l2", 0.0)
    if l2_a:
        l2_rel = abs(l2_a - l2_b) / l2_a
    else:
        l2_rel = 0.0 if l2_a == l2_b else math.inf
    return {"l2_rel_diff": l2_rel, "nan_count": [a.get("nan_count"), b.get("nan_count")],
            "inf_count": [a.get("inf_count"), b.get("inf_count")],
            "mean": [a.get("mean"), b.get("mean")], "absmax": [a.get("absmax"), b.get("absmax")]}


def stats_violations(a: Mapping[str, Any], b: Mapping[str, Any], m: Mapping[str, Any], rule: Rule) -> list[str]:
    out = []
    if a.get("shape") != b.get("shape") or a.get("dtype") != b.get("dtype"):
        out.append(f"shape/dtype differ: {a.get('shape')} {a.get('dtype')} vs {b.get('shape')} {b.get('dtype')}")
    counts_differ = m["nan_count"][0] != m["nan_count"][1] or m["inf_count"][0] != m["inf_count"][1]
    if counts_differ and not rule.allow_nonfinite:
        out.append(f"NaN/Inf counts differ: nan {m['nan_count']}, inf {m['inf_count']}")
    if rule.rel_l2_max is not None and m["l2_rel_diff"] > rule.rel_l2_max:
        out.append(f"|l2 difference| / l2 {m['l2_rel_diff']:.6g} > rel_l2 {rule.rel_l2_max} "
                   "(statistics only: tensors not stored)")
    return out


# ---------------------------------------------------------------------------------------------------------
# The diff
# ---------------------------------------------------------------------------------------------------------
def pick_run(reader: CaptureReader, wanted: str | None) -> str:
    runs = reader.runs()
    if wanted is not None:
        if wanted not in runs:
            raise BadInput(f"{reader.path}: no run {wanted!r}; runs are {', '.join(runs) or '(none)'}")
        return wanted
    if not runs:
        raise BadInput(f"{reader.path}: capture has no runs")
    return "candidate" if "candidate" in runs and len(runs) > 1 else runs[0]


def diff_sites(a: CaptureReader, b: CaptureReader, run_a: str, run_b: str, rules: Rules) -> Iterator[dict[str, Any]]:
    """One result per site (A's order, then sites only in B): status identical | ok | exceeds | ignored |
    only_in_a | only_in_b, the mode used (hash, tensor, stats), metrics and violations."""
    sites_a, sites_b = a.sites(run_a), b.sites(run_b)
    in_b = set(sites_b)
    for site in sites_a:
        rule = rules.for_site(site)
        if site not in in_b:
            yield _result(site, "only_in_a", rule, violations=[f"missing from {b.path} run {run_b!r}"])
        elif rule.ignore:
            yield _result(site, "ignored", rule)
        else:
            yield _diff_site(a, b, run_a, run_b, site, rule)
    in_a = set(sites_a)
    for site in sites_b:
        if site not in in_a:
            rule = rules.for_site(site)
            yield _result(site, "only_in_b", rule, violations=[f"missing from {a.path} run {run_a!r}"])


def _result(site: str, status: str, rule: Rule, mode: str | None = None, metrics: dict | None = None,
            violations: list[str] | None = None) -> dict[str, Any]:
    if rule.ignore and status != "ignored":
        status, violations = "ignored", []
    return {"site": site, "status": status, "mode": mode, "metrics": metrics or {}, "violations": violations or []}


def _diff_site(a, b, run_a, run_b, site, rule) -> dict[str, Any]:
    info_a, info_b = a.site(run_a, site), b.site(run_b, site)
    ta, tb = info_a["tensor"], info_b["tensor"]
    if ta and tb and ta["hash"] == tb["hash"] and ta["dtype"] == tb["dtype"]:
        return _result(site, "identical", rule, "hash")
    if ta and tb and ta["shape"] == tb["shape"] and ta.get("token_slice") == tb.get("token_slice"):
        metrics = stream_compare(a, b, run_a, run_b, site)
        integer = not getattr(torch, ta["dtype"]).is_floating_point
        violations = tensor_violations(metrics, rule, integer)
        return _result(site, "exceeds" if violations else "ok", rule, "tensor", metrics, violations)
    metrics = stats_metrics(info_a["stats"], info_b["stats"])
    violations = stats_violations(info_a["stats"], info_b["stats"], metrics, rule)
    if ta and tb:
        violations.insert(0, f"stored shapes or token slices differ: {ta['shape']} {ta.get('token_slice')} "
                             f"vs {tb['shape']} {tb.get('token_slice')}")
    return _result(site, "exceeds" if violations else "ok", rule, "stats", metrics, violations)


def stream_compare(a: CaptureReader, b: CaptureReader, run_a: str, run_b: str, site: str) -> dict[str, Any]:
    """compare() of two stored tensors, one chunk of rows of A at a time (A is the reference side)."""
    dset_b = b.dataset(run_b, site)
    dtype_b = plain(dset_b.attrs["dtype"])
    acc = MetricAccumulator(tuple(dset_b.shape))
    row_elems = max(1, math.prod(dset_b.shape[1:])) if dset_b.ndim else 1
    pool, window = _metric_pool()
    pending: deque[tuple[Future, int]] = deque()        # chunks in flight, at most `window` (bounded memory)
    for start, block_a in a.row_blocks(run_a, site):
        rows = block_a.shape[0] if block_a.ndim else 1
        block_b = read_rows(dset_b, start, start + rows, dtype_b) if dset_b.ndim else from_storage(dset_b[()], dtype_b)
        pending.append((pool.submit(chunk_values, block_a, block_b), start * row_elems))
        if len(pending) >= window:
            acc.add(*_first_done(pending))
    while pending:
        acc.add(*_first_done(pending))
    return acc.result()


def _first_done(pending: deque[tuple[Future, int]]) -> tuple[list[float], int]:
    future, offset = pending.popleft()
    return future.result(), offset


@functools.cache
def _metric_pool() -> tuple[ThreadPoolExecutor, int]:
    """Threads for chunk metrics (torch ops, GIL released) while the calling thread reads and decodes the next
    chunks (h5py and numpy, GIL held): the two overlap, and on a many-core host the metrics run side by side."""
    workers = min(4, max(1, (os.cpu_count() or 2) // 4))     # each op also takes torch's intra-op threads
    return ThreadPoolExecutor(workers, thread_name_prefix="diff-metrics"), 2 * workers


def diff_captures(path_a: str | Path, path_b: str | Path, run_a: str | None = None, run_b: str | None = None,
                  rules: Rules | None = None, on_site: Callable[[dict[str, Any]], None] | None = None
                  ) -> dict[str, Any]:
    """Diff two capture files; `on_site` sees each site's result as it is produced."""
    rules = rules or Rules()
    with CaptureReader(path_a) as a, CaptureReader(path_b) as b:
        ra = pick_run(a, run_a)
        rb = pick_run(b, run_b if run_b is not None else (ra if ra in b.runs() else None))
        results = []
        for result in diff_sites(a, b, ra, rb, rules):
            results.append(result)
            if on_site:
                on_site(result)
    counts: dict[str, int] = {}
    for result in results:
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    failing = [r for r in results if r["violations"] and r["status"] != "ignored"]
    return {"a": str(path_a), "b": str(path_b), "run_a": ra, "run_b": rb, "counts": counts,
            "clean": not failing, "first_failure": failing[0]["site"] if failing else None, "sites": results}
