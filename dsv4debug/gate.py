"""CI regression gate: a capture's per-site metrics against a golden capture's (same site, same run).

`dsv4debug run` stores, per candidate run (`candidate` free-running, `candidate.forced` teacher-forced), each
site's comparison against the reference (`/metrics/<run>`) and the noise floors (`/floors`). The gate reads
those of a new capture and of a baseline ("golden") capture of the same input and judges the change, site by
site, against budgets rather than fixed thresholds:

- x floor (the error in units of the site's noise floor: rel_l2, or flip_rate for top-k ids; both captures
  in units of the *baseline's* floor, so floor jitter between machines moves nothing) may grow by
  `x_floor` (default 20 %) of the baseline's value, and always by at least `x_floor_slack` floors (default 1),
  so a site that was bitwise equal and is now one bf16 rounding off does not flap;
- SQNR may drop by `sqnr_db` (default 1 dB); SQNR above that of an error of one noise floor counts as that
  value (an error within the floor is noise, and "infinite" SQNR of identical tensors is not a baseline);
- no new NaN/Inf (more NaN or Inf elements than the baseline, or NaN/Inf where the reference is finite);
- for index sites (top-k ids), the flips not explained by ties (flip_rate counts untied flips only) follow
  the x floor budget, so agreement lost to near-equal scores is not a regression.
A site of the baseline that the capture lacks fails (an unexpected skip); a site only in the capture is
reported as new. Rules (TOML) change budgets per site regex or ignore sites: see load_gate_rules.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .capture import CaptureReader
from .diff import RULE_KEYS as DIFF_RULE_KEYS
from .diff import _read_toml
from .errors import BadInput
from .metrics import MIN_FLOORS, floor_ratio
from .verdict import site_error

# ---------------------------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------------------------
BUDGET_KEYS = {
    "x_floor": "allowed growth of the error in noise floors, relative to the baseline (0.2 = +20 %); "
               "false turns the check off",
    "x_floor_slack": "the x floor may always grow by at least this many floors (absolute)",
    "sqnr_db": "allowed SQNR drop in dB; false turns the check off",
    "cosine": "allowed drop of the cosine similarity (absolute, e.g. 1e-4); off unless given",
    "allow_nonfinite": "true: new NaN/Inf elements are not a failure",
}
RULE_KEYS = {
    "sites": "regular expression searched in site names (re.search); required in a rule",
    "runs": "list of runs the rule applies to (default: every gated run)",
    "ignore": "true: matching sites are not judged (reported as skipped)",
    **BUDGET_KEYS,
}
_OPTIONAL = ("x_floor", "sqnr_db", "cosine")      # numeric budgets that `false` turns off


@dataclass(frozen=True)
class GateRule:
    """Budgets for the sites matching `sites` (re.search) in `runs` (None: all runs)."""
    sites: str = ""
    runs: tuple[str, ...] | None = None
    ignore: bool = False
    x_floor: float | None = 0.20
    x_floor_slack: float = 1.0
    sqnr_db: float | None = 1.0
    cosine: float | None = None
    allow_nonfinite: bool = False
    name: str = "default budgets"          # how messages refer to it: "rule 2 (line 14)"

    def matches(self, run: str, site: str) -> bool:
        return (self.runs is None or run in self.runs) and re.search(self.sites, site) is not None

    def budgets(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in BUDGET_KEYS}


@dataclass(frozen=True)
class GateRules:
    default: GateRule = GateRule()
    rules: tuple[GateRule, ...] = ()
    source: str = "built-in defaults"

    def for_site(self, run: str, site: str) -> GateRule:
        """The first [[rule]] matching (run, site), or the default."""
        return next((rule for rule in self.rules if rule.matches(run, site)), self.default)


def load_gate_rules(path: str | Path | None) -> GateRules:
    """Gate rules from TOML; None gives the built-in defaults.

        [default]                      # optional: budgets for every site (keys of BUDGET_KEYS)
        x_floor = 0.2
        [[rule]]                       # the first rule whose `sites` regex matches a site decides it
        sites = '\\.ffn\\.experts\\.\\d+$'
        runs = ["candidate"]           # optional
        x_floor = 0.5                  # keys not given come from [default]
        [[rule]]
        sites = '^layers\\.5\\.'
        ignore = true

    Any mistake is a BadInput naming the file, the line and the rule (messages avoid square brackets: the
    CLI prints them with rich markup).
    """
    if path is None:
        return GateRules()
    path = Path(path)
    data = _read_toml(path)          # shared with `diff`: BadInput with the line and column of a syntax error
    text = path.read_text()
    default_line, rule_lines = _table_lines(text)
    where_file = f"rules file {path}"
    for key in data:
        if key not in ("default", "rule"):
            line = _top_key_line(text, key)
            raise BadInput(f"{where_file}{_at(line)}: unknown top-level key {key!r}; use a table 'default' "
                           "and tables 'rule' (TOML headers default and rule in brackets)")
    default_table = data.get("default", {})
    if not isinstance(default_table, dict):
        raise BadInput(f"{where_file}{_at(_top_key_line(text, 'default'))}: "
                       "'default' must be a table")
    default = _make_rule(where_file, text, "table 'default'", default_line, GateRule(), default_table, is_default=True)
    tables = data.get("rule", [])
    if not isinstance(tables, list):
        raise BadInput(f"{where_file}{_at(_top_key_line(text, 'rule'))}: 'rule' must be an "
                       "array of tables (double brackets around rule)")
    rules = []
    for i, table in enumerate(tables):
        line = rule_lines[i] if i < len(rule_lines) and len(rule_lines) == len(tables) else None
        rules.append(_make_rule(where_file, text, f"rule {i + 1}", line, default, table, is_default=False))
    return GateRules(default, tuple(rules), source=str(path))


def _make_rule(where_file: str, text: str, name: str, line: int | None, base: GateRule, table: Any,
               is_default: bool) -> GateRule:
    label = name + (f" (line {line})" if line else "")

    def fail(message: str, key: str | None = None) -> BadInput:
        at = _at(_key_line(text, line, key) or line)
        sites = table.get("sites") if isinstance(table, dict) else None
        return BadInput(f"{where_file}{at}: {name}" + (f" (sites {sites!r})" if isinstance(sites, str) else "")
                        + f": {message}")

    if not isinstance(table, dict):
        raise fail("must be a table")
    allowed = BUDGET_KEYS if is_default else RULE_KEYS
    for key in table:
        if key not in allowed:
            hint = " (sites, runs and ignore belong in the rule tables)" if key in RULE_KEYS else \
                " (a `dsv4debug diff` threshold; the gate takes budgets relative to the baseline)" \
                if key in DIFF_RULE_KEYS else ""
            raise fail(f"unknown key {key!r}{hint}; known keys: {', '.join(allowed)}", key)
    values: dict[str, Any] = {}
    for key, value in table.items():
        values[key] = _check_value(key, value, lambda msg, key=key: fail(msg, key))
    if not is_default:
        if "sites" not in values:
            raise fail("needs sites = 'REGEX' (a regular expression on site names)")
        try:
            re.compile(values["sites"])
        except re.error as e:
            raise fail(f"bad regular expression {values['sites']!r} ({e})", "sites") from None
    return replace(base, **values, name=label)


def _check_value(key: str, value: Any, fail) -> Any:
    if key == "sites":
        if not isinstance(value, str):
            raise fail("sites must be a string: a regular expression on site names")
        return value
    if key == "runs":
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or not value:
            raise fail("runs must be a list of run names, e.g. runs = [\"candidate.forced\"]")
        return tuple(value)
    if key in ("ignore", "allow_nonfinite"):
        if not isinstance(value, bool):
            raise fail(f"{key} must be true or false")
        return value
    if value is False and key in _OPTIONAL:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
        off = " (or false to turn the check off)" if key in _OPTIONAL else ""
        raise fail(f"{key} must be a finite number >= 0{off}, got {value!r}")
    return float(value)


_HEADER = re.compile(r"^\s*\[")


def _table_lines(text: str) -> tuple[int | None, list[int]]:
    """Line numbers of the [default] header and of each [[rule]] header."""
    default, rules = None, []
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*\[\s*default\s*\]", line):
            default = n
        elif re.match(r"^\s*\[\[\s*rule\s*\]\]", line):
            rules.append(n)
    return default, rules


def _key_line(text: str, header: int | None, key: str | None) -> int | None:
    """The line assigning `key` in the table whose header is on line `header` (1-based)."""
    if not header or not key:
        return None
    lines = text.splitlines()
    pattern = re.compile(rf"""^\s*(?:{re.escape(key)}|"{re.escape(key)}"|'{re.escape(key)}')\s*[=.]""")
    for n in range(header, len(lines)):          # lines[header] is the line after the header
        if _HEADER.match(lines[n]):
            return None
        if pattern.match(lines[n]):
            return n + 1
    return None


def _top_key_line(text: str, key: str) -> int | None:
    """The line defining a top-level key: `key = ...` before the first table, or a [key] / [[key]] header."""
    before_tables = True
    for n, line in enumerate(text.splitlines(), 1):
        if _HEADER.match(line):
            before_tables = False
            if re.match(rf"^\s*\[+\s*[\"']?{re.escape(key)}[\"']?\s*[\].]", line):
                return n
        elif before_tables and re.match(rf"""^\s*["']?{re.escape(key)}["']?\s*[=.]""", line):
            return n
    return None


def _at(line: int | None) -> str:
    return f" line {line}" if line else ""


# ---------------------------------------------------------------------------------------------------------
# Per-site values
# ---------------------------------------------------------------------------------------------------------
def floor_key(run: str, metric: str, floors: Mapping[str, Any]) -> float | None:
    """The noise floor of `metric` for `run`: {metric}_local for teacher-forced runs, {metric}_free for
    free-running ones (what dsv4debug run writes), else a plain {metric} entry."""
    local = run.endswith(".forced")
    for key in ((f"{metric}_local", f"{metric}_free") if local else (f"{metric}_free", f"{metric}_local")) + (metric,):
        if floors.get(key) is not None:
            return float(floors[key])
    return None


def site_values(run: str, metrics: Mapping[str, Any] | None, stats: Mapping[str, Any] | None,
                floors: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the gate judges of one site of one run."""
    metrics, stats = metrics or {}, stats or {}
    out: dict[str, Any] = {"has_metrics": bool(metrics),
                           "nan_count": int(stats.get("nan_count") or 0), "inf_count": int(stats.get("inf_count") or 0),
                           "first_nonfinite": stats.get("first_nonfinite"),
                           "nonfinite_mismatch": int(metrics.get("nonfinite_mismatch") or 0)}
    error = site_error(metrics)
    if error is None:
        return out
    metric, value = error
    floor = floor_key(run, metric, floors or {})
    min_floor = MIN_FLOORS.get(metric, 0.0)
    out.update(kind="index" if metric == "flip_rate" else "values", metric=metric, error=value, floor=floor,
               effective_floor=max(floor or 0.0, min_floor), x_floor=floor_ratio(value, floor, min_floor))
    if metric == "flip_rate":
        for key in ("agreement_mean", "flips", "ties", "hard_flips"):
            out[key] = metrics.get(key)
    else:
        for key in ("sqnr_db", "cosine", "rel_l2", "max_abs"):
            if metrics.get(key) is not None:
                out[key] = float(metrics[key])
    return out


def _sqnr_ceiling(base: Mapping[str, Any], cand: Mapping[str, Any]) -> float:
    """SQNR of an error of one noise floor (the smaller of the two sides' floors)."""
    return -20.0 * math.log10(max(base["effective_floor"], cand["effective_floor"]))


def judge_site(run: str, site: str, base: Mapping[str, Any], cand: Mapping[str, Any], rule: GateRule
               ) -> list[dict[str, Any]]:
    """The checks of one site: metric, baseline and capture values, limit, budget used, ok, message."""
    checks: list[dict[str, Any]] = []
    if not rule.allow_nonfinite:
        grew = [f"{key.split('_')[0]} {base[key]} -> {cand[key]}" for key in ("nan_count", "inf_count")
                if cand[key] > base[key]]
        if cand["nonfinite_mismatch"] > base["nonfinite_mismatch"]:
            grew.append(f"NaN/Inf where the reference is finite at {base['nonfinite_mismatch']} -> "
                        f"{cand['nonfinite_mismatch']} elements")
        first = f" (first at {cand['first_nonfinite']})" if cand.get("first_nonfinite") else ""
        checks.append({"metric": "nonfinite", "baseline": base["nan_count"] + base["inf_count"],
                       "capture": cand["nan_count"] + cand["inf_count"], "limit": base["nan_count"] + base["inf_count"],
                       "used": math.inf if grew else 0.0, "ok": not grew,
                       "message": "new NaN/Inf: " + ", ".join(grew) + first if grew else ""})
    if "x_floor" not in base or "x_floor" not in cand:
        return checks
    if base["metric"] != cand["metric"]:
        checks.append({"metric": "kind", "baseline": base["metric"], "capture": cand["metric"], "limit": None,
                       "used": math.inf, "ok": False,
                       "message": f"judged by {cand['metric']} here but by {base['metric']} in the baseline"})
        return checks
    if rule.x_floor is not None:
        old, new = base["x_floor"], cand["x_floor"]
        allowance = max(rule.x_floor * old, rule.x_floor_slack) if math.isfinite(old) else math.inf
        checks.append(_growth_check("x_floor", old, new, allowance,
                                    f"{cand['metric']} {_f(base['error'])} -> {_f(cand['error'])}, "
                                    f"x floor {_f(old)} -> {_f(new)} > limit {_f(old + allowance)} "
                                    f"(+{rule.x_floor:.0%} or {_f(rule.x_floor_slack)} floor)"))
    if rule.sqnr_db is not None and "sqnr_db" in base and "sqnr_db" in cand:
        ceiling = _sqnr_ceiling(base, cand)
        old, new = (_clamp_sqnr(v["sqnr_db"], ceiling) for v in (base, cand))
        drop = 0.0 if old == new else old - new
        used = drop / rule.sqnr_db if rule.sqnr_db > 0 else (math.inf if drop > 0 else 0.0)
        checks.append({"metric": "sqnr_db", "baseline": base["sqnr_db"], "capture": cand["sqnr_db"],
                       "limit": old - rule.sqnr_db, "used": used, "ok": not drop > rule.sqnr_db,
                       "message": f"SQNR {_f(old)} -> {_f(new)} dB, down {_f(drop)} dB > {_f(rule.sqnr_db)} dB"})
    if rule.cosine is not None and "cosine" in base and "cosine" in cand:
        old, new = base["cosine"], cand["cosine"]
        drop = old - new if not math.isnan(new) else math.inf
        used = drop / rule.cosine if rule.cosine > 0 else (math.inf if drop > 0 else 0.0)
        checks.append({"metric": "cosine", "baseline": old, "capture": new, "limit": old - rule.cosine,
                       "used": used, "ok": not drop > rule.cosine,
                       "message": f"cosine {old:.6f} -> {new:.6f}, down {drop:.3g} > {rule.cosine:.3g}"})
    return checks


def _growth_check(metric: str, old: float, new: float, allowance: float, message: str) -> dict[str, Any]:
    grow = new - old if not (math.isinf(new) and math.isinf(old)) else 0.0
    if allowance > 0:
        used = grow / allowance if math.isfinite(allowance) else 0.0
    else:
        used = math.inf if grow > 0 else 0.0
    return {"metric": metric, "baseline": old, "capture": new, "limit": old + allowance, "used": used,
            "ok": not grow > allowance, "improved": -grow > allowance, "message": message}


def _clamp_sqnr(value: float, ceiling: float) -> float:
    if value is None or math.isnan(value):
        return -math.inf
    return min(value, ceiling)


def _f(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return f"{x:.4g}"
    return str(x)


# ---------------------------------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------------------------------
STATUS_ORDER = ("regressed", "missing", "new", "improved", "ok", "ignored")   # worst first


def gate(capture: str | Path, baseline: str | Path, rules: GateRules | None = None,
         runs: Sequence[str] | None = None, top: int = 10) -> dict[str, Any]:
    """Judge `capture` against `baseline`, per (run, site). Returns a JSON-able document:

    status pass | fail, runs, counts per status, entries (one per run and site, baseline order then new
    sites), first_regression, worst (the `top` entries using most of their budget), missing, new, the two
    captures' verdicts and notes (provenance differences that are not fatal).
    """
    rules = rules or GateRules()
    with CaptureReader(baseline) as b, CaptureReader(capture) as c:
        if not b.complete:
            raise BadInput(f"baseline {baseline} is an incomplete capture (its writer did not finish); "
                           "regenerate it (python captures/regenerate.py)")
        notes = _check_comparable(c, b)
        if not c.complete:
            notes.append(f"capture {capture} is incomplete (writer killed or still running): the sites it "
                         "did not reach are missing")
        gated = _gated_runs(b, runs)
        entries: list[dict[str, Any]] = []
        for run in gated:
            entries += _gate_run(b, c, run, rules, notes)
        doc = {"capture": str(capture), "baseline": str(baseline), "runs": gated, "rules": rules.source,
               "capture_candidate": _candidate_of(c), "baseline_candidate": _candidate_of(b),
               "capture_verdict": _verdict_line(c.verdict()), "baseline_verdict": _verdict_line(b.verdict()),
               "notes": notes}
    counts = {status: sum(e["status"] == status for e in entries) for status in STATUS_ORDER}
    failing = [e for e in entries if e["status"] in ("regressed", "missing")]
    judged = [e for e in entries if e["status"] in ("regressed", "improved", "ok") and e["checks"]]
    worst = sorted((e for e in judged if e["used"] > 0), key=lambda e: -e["used"])[:top]
    doc.update(status="fail" if failing else "pass", counts=counts, sites=len({e["site"] for e in entries}),
               first_regression=_first(failing), worst=worst,
               missing=[{"site": e["site"], "run": e["run"]} for e in entries if e["status"] == "missing"],
               new=[{"site": e["site"], "run": e["run"]} for e in entries if e["status"] == "new"],
               entries=entries)
    return doc


def _first(failing: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failing entry earliest in execution order (ties: the teacher-forced run, where the bug is)."""
    if not failing:
        return None
    best = min(failing, key=lambda e: (e["order"], not e["run"].endswith(".forced")))
    return {k: best[k] for k in ("site", "run", "status", "reasons", "layer")}


def _gated_runs(b: CaptureReader, wanted: Sequence[str] | None) -> list[str]:
    available = [run for run in b.metric_runs() if b.metrics(run)]
    if not available:
        raise BadInput(f"baseline {b.path} has no per-site metrics (/metrics/<run>): write it with "
                       "`dsv4debug run --capture` or python captures/regenerate.py")
    if not wanted:
        return available
    for run in wanted:
        if run not in available:
            raise BadInput(f"--run {run!r}: the baseline {b.path} has metrics for {', '.join(available)}")
    return list(dict.fromkeys(wanted))


def _check_comparable(c: CaptureReader, b: CaptureReader) -> list[str]:
    """Inputs must match (else the comparison means nothing: BadInput); other differences become notes."""
    tokens_c, tokens_b = list(c.meta.get("token_ids", [])), list(b.meta.get("token_ids", []))
    if tokens_c != tokens_b:
        first = next((i for i, (x, y) in enumerate(zip(tokens_c, tokens_b)) if x != y), min(len(tokens_c), len(tokens_b)))
        raise BadInput(f"capture {c.path} and baseline {b.path} ran different inputs: {len(tokens_c)} vs "
                       f"{len(tokens_b)} token ids, first difference at position {first}; capture the "
                       "baseline's tokens (python captures/regenerate.py) or refresh the baseline with --update")
    config_c, config_b = c.meta.get("model_config") or {}, b.meta.get("model_config") or {}
    if config_c != config_b:
        keys = sorted(k for k in set(config_c) | set(config_b) if config_c.get(k) != config_b.get(k))
        raise BadInput(f"capture {c.path} and baseline {b.path} ran different models: model_config differs in "
                       f"{', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")
    notes = []
    sha_c = (c.meta.get("checkpoint") or {}).get("sha256")
    sha_b = (b.meta.get("checkpoint") or {}).get("sha256")
    if sha_c and sha_b and sha_c != sha_b:
        notes.append(f"checkpoint content differs (index sha256 {sha_c[:12]} vs baseline {sha_b[:12]})")
    for key in ("device", "torch_version"):
        if c.meta.get(key) != b.meta.get(key):
            notes.append(f"{key}: {c.meta.get(key)} (baseline {b.meta.get(key)})")
    return notes


def _candidate_of(reader: CaptureReader) -> str | None:
    return (reader.meta.get("options") or {}).get("candidate")


def _verdict_line(verdict: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not verdict:
        return None
    out: dict[str, Any] = {"status": verdict.get("status"), "message": verdict.get("message", "")}
    for key in ("nan_origin", "first_local_divergence", "first_divergence"):
        item = verdict.get(key)
        if item:
            out[key] = {"site": item.get("site"), "x_floor": item.get("x_floor")}
    return out


def _site_orders(reader: CaptureReader, run: str) -> dict[str, dict[str, Any]]:
    """site -> its row (order, layer, stats) for the run; {} when the run is not in the file."""
    if run not in reader.runs():
        return {}
    return {site: reader.site(run, site) for site in reader.sites(run)}


def _gate_run(b: CaptureReader, c: CaptureReader, run: str, rules: GateRules, notes: list[str]
              ) -> list[dict[str, Any]]:
    base_rows, cand_rows = _site_orders(b, run), _site_orders(c, run)
    base_metrics, cand_metrics = b.metrics(run), c.metrics(run)
    base_floors, cand_floors = b.floors(), c.floors()
    if not cand_rows and not cand_metrics:
        notes.append(f"run {run!r} is not in the capture (runs: {', '.join(c.runs()) or 'none'}): "
                     "every site of it is missing")
    _note_floor_change(run, base_floors, cand_floors, notes)
    base_sites = list(dict.fromkeys([*base_rows, *base_metrics]))
    cand_sites = list(dict.fromkeys([*cand_rows, *cand_metrics]))
    in_cand, in_base = set(cand_sites), set(base_sites)
    entries = []
    for order, site in enumerate(base_sites):
        rule = rules.for_site(run, site)
        row = base_rows.get(site, {})
        entry = {"site": site, "run": run, "order": order, "layer": row.get("layer"), "rule": rule.name,
                 "checks": [], "reasons": [], "used": 0.0, "baseline": None, "capture": None}
        base_v = site_values(run, base_metrics.get(site), row.get("stats"), base_floors.get(site))
        entry["baseline"] = base_v
        if rule.ignore:
            entry["status"] = "ignored"
        elif site not in in_cand:
            entry["status"] = "missing"
            entry["reasons"] = [f"in the baseline but not in the capture's run {run!r} (unexpected skip)"]
        else:
            # both sides in units of the baseline's floor: the golden's yardstick, immune to floor jitter
            cand_v = site_values(run, cand_metrics.get(site), cand_rows.get(site, {}).get("stats"),
                                 base_floors.get(site) or cand_floors.get(site))
            entry["capture"] = cand_v
            _judge_entry(entry, run, site, base_v, cand_v, rule)
        entries.append(entry)
    for site in cand_sites:
        if site not in in_base:
            rule = rules.for_site(run, site)
            row = cand_rows.get(site, {})
            entries.append({"site": site, "run": run, "order": len(base_sites) + len(entries), "layer": row.get("layer"),
                            "rule": rule.name, "status": "ignored" if rule.ignore else "new", "checks": [],
                            "reasons": ["not in the baseline: not judged"], "used": 0.0, "baseline": None,
                            "capture": site_values(run, cand_metrics.get(site), row.get("stats"),
                                                   cand_floors.get(site))})
    return entries


def _note_floor_change(run: str, base_floors: Mapping[str, Any], cand_floors: Mapping[str, Any],
                       notes: list[str]) -> None:
    """A note when the capture's own noise floors differ from the baseline's by more than 25 % somewhere
    (another machine, torch or reference implementation): the gate keeps judging in the baseline's floors."""
    worst, where = 0.0, None
    for site, floors in base_floors.items():
        mine = cand_floors.get(site) or {}
        for metric in ("rel_l2", "flip_rate"):
            a, b = floor_key(run, metric, floors), floor_key(run, metric, mine)
            if a is None or b is None:
                continue
            lo = MIN_FLOORS[metric]
            change = abs(max(a, lo) - max(b, lo)) / max(a, lo)
            if change > worst:
                worst, where = change, site
    note = f"run {run!r}: noise floors differ from the baseline's by up to {worst:.0%} (at {where})"
    if worst > 0.25 and note not in notes:
        notes.append(note + "; errors are judged in the baseline's floors")


def _judge_entry(entry: dict[str, Any], run: str, site: str, base_v: dict[str, Any], cand_v: dict[str, Any],
                 rule: GateRule) -> None:
    checks = judge_site(run, site, base_v, cand_v, rule)
    if base_v["has_metrics"] and not cand_v["has_metrics"]:
        checks.append({"metric": "metrics", "baseline": "present", "capture": "absent", "limit": None,
                       "used": math.inf, "ok": False,
                       "message": f"no metrics for this site in the capture's /metrics/{run}"})
    entry["checks"] = checks
    entry["reasons"] = [check["message"] for check in checks if not check["ok"]]
    entry["used"] = max((check["used"] for check in checks), default=0.0)
    if entry["reasons"]:
        entry["status"] = "regressed"
    elif any(check.get("improved") for check in checks):
        entry["status"] = "improved"
    else:
        entry["status"] = "ok"


# ---------------------------------------------------------------------------------------------------------
# Outputs: per-site grouping, JUnit XML, markdown
# ---------------------------------------------------------------------------------------------------------
def by_site(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One item per site (every gated run folded in), first appearance order; status = the worst."""
    sites: dict[str, dict[str, Any]] = {}
    for entry in doc["entries"]:
        item = sites.setdefault(entry["site"], {"site": entry["site"], "layer": entry["layer"], "entries": []})
        item["entries"].append(entry)
    for item in sites.values():
        item["status"] = min((e["status"] for e in item["entries"]), key=STATUS_ORDER.index)
    return list(sites.values())


def junit_xml(doc: Mapping[str, Any]) -> str:
    """JUnit XML: one <testcase> per site; <failure> for a regressed or missing site (the reasons of each
    run), <skipped> for a site ignored by a rule or new (not in the baseline, so not judged)."""
    items = by_site(doc)
    failures = sum(item["status"] in ("regressed", "missing") for item in items)
    skipped = sum(item["status"] in ("ignored", "new") for item in items)
    suites = ET.Element("testsuites", name="dsv4debug gate", tests=str(len(items)), failures=str(failures),
                        errors="0", skipped=str(skipped))
    suite = ET.SubElement(suites, "testsuite", name=f"dsv4debug gate {Path(doc['capture']).name} vs "
                          f"{Path(doc['baseline']).name}", tests=str(len(items)), failures=str(failures),
                          errors="0", skipped=str(skipped), time="0")
    props = ET.SubElement(suite, "properties")
    for key in ("capture", "baseline", "rules"):
        ET.SubElement(props, "property", name=key, value=str(doc[key]))
    ET.SubElement(props, "property", name="runs", value=",".join(doc["runs"]))
    for item in items:
        layer = item["layer"]
        group = f"layers.{layer}" if isinstance(layer, int) and layer >= 0 else "global"
        case = ET.SubElement(suite, "testcase", classname=f"dsv4debug.gate.{group}", name=item["site"], time="0")
        lines = [f"[{e['run']}] {reason}" for e in item["entries"] for reason in e["reasons"]
                 if e["status"] in ("regressed", "missing")]
        if item["status"] in ("regressed", "missing"):
            kind = "regression" if item["status"] == "regressed" else "missing-site"
            failure = ET.SubElement(case, "failure", message=_xml_text(lines[0]), type=kind)
            failure.text = _xml_text("\n".join(lines))
        elif item["status"] == "ignored":
            ET.SubElement(case, "skipped", message=_xml_text(f"ignored by {item['entries'][0]['rule']}"))
        elif item["status"] == "new":
            ET.SubElement(case, "skipped", message="new site: not in the baseline, not judged")
        else:
            ET.SubElement(case, "system-out").text = _xml_text("; ".join(
                f"[{e['run']}] {short_values(e)} ({e['status']})" for e in item["entries"]))
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


_XML_BAD = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _xml_text(text: str) -> str:
    return _XML_BAD.sub("?", text)


def short_values(entry: Mapping[str, Any]) -> str:
    base, cand = entry.get("baseline") or {}, entry.get("capture") or {}
    if "x_floor" not in cand:
        return "statistics only"
    text = f"{cand['metric']} {_f(base.get('error'))} -> {_f(cand['error'])}, x floor {_f(base.get('x_floor'))} -> " \
           f"{_f(cand['x_floor'])}"
    if "sqnr_db" in cand:
        text += f", SQNR {_f(base.get('sqnr_db'))} -> {_f(cand['sqnr_db'])} dB"
    return text


def markdown_summary(doc: Mapping[str, Any], top: int = 10) -> str:
    """A GitHub-flavoured markdown summary (for $GITHUB_STEP_SUMMARY): verdict, first regression, the
    capture's first divergence, the worst sites by budget used, missing and new sites."""
    counts = doc["counts"]
    failed = doc["status"] == "fail"
    n_fail = counts["regressed"] + counts["missing"]
    head = (f"### {'❌' if failed else '✅'} dsv4debug gate: "
            + (f"FAIL, {n_fail} regression{'s' if n_fail != 1 else ''}" if failed else "PASS"))
    lines = [head, "",
             f"Capture `{doc['capture']}` (candidate `{doc['capture_candidate']}`) against baseline "
             f"`{doc['baseline']}` (candidate `{doc['baseline_candidate']}`); runs "
             + ", ".join(f"`{r}`" for r in doc["runs"]) + f"; rules: {doc['rules']}.", "",
             "| sites | regressed | missing | improved | ok | new | ignored |", "|---|---|---|---|---|---|---|",
             (f"| {doc['sites']} | {counts['regressed']} | {counts['missing']} | {counts['improved']} | "
              f"{counts['ok']} | {counts['new']} | {counts['ignored']} |"), ""]
    first = doc["first_regression"]
    if first:
        lines.append(f"**First regression:** `{first['site']}` ({first['run']}): {_md(first['reasons'][0])}")
    else:
        lines.append("**First regression:** none")
    lines.append("")
    lines.append("**First divergence (capture's verdict):** " + _verdict_md(doc["capture_verdict"])
                 + "; baseline: " + _verdict_md(doc["baseline_verdict"]))
    for note in doc["notes"]:
        lines += ["", f"> note: {_md(note)}"]
    lines += ["", "#### Worst sites (budget used; over 100 % fails)", ""]
    worst = doc["worst"][:top]
    if worst:
        lines += ["| site | run | check | baseline | now | limit | budget used | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in worst:
            check = max(e["checks"], key=lambda ch: ch["used"])
            lines.append(f"| `{e['site']}` | {e['run']} | {check['metric']} | {_f(check['baseline'])} | "
                         f"{_f(check['capture'])} | {_f(check['limit'])} | {_pct(check['used'])} | "
                         f"{'**' + e['status'] + '**' if e['status'] == 'regressed' else e['status']} |")
    else:
        lines.append("No site's error grew.")
    failing = [e for e in doc["entries"] if e["status"] == "regressed" and e not in worst]
    if failing:
        lines += ["", f"Further regressed sites ({len(failing)}): " + ", ".join(
            f"`{e['site']}` ({e['run']})" for e in failing[:30]) + (" ..." if len(failing) > 30 else "")]
    for key, title in (("missing", "Missing sites (in the baseline, not in the capture: fail)"),
                       ("new", "New sites (not in the baseline: reported, not judged)")):
        items = doc[key]
        if items:
            lines += ["", f"#### {title}: {len(items)}", "",
                      ", ".join(f"`{i['site']}` ({i['run']})" for i in items[:40]) + (" ..." if len(items) > 40 else "")]
    return "\n".join(lines) + "\n"


def _pct(used: float) -> str:
    return "inf" if math.isinf(used) else f"{used:.0%}"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _verdict_md(verdict: Mapping[str, Any] | None) -> str:
    if not verdict:
        return "none stored"
    return f"{verdict.get('status')}: {_md(verdict.get('message', ''))}"


# ---------------------------------------------------------------------------------------------------------
# Refreshing a baseline (only with --update)
# ---------------------------------------------------------------------------------------------------------
def update_baseline(capture: str | Path, baseline: str | Path, rules: GateRules | None = None,
                    runs: Sequence[str] | None = None, top: int = 10) -> dict[str, Any]:
    """Copy `capture` over `baseline` (atomically) after comparing them. Returns {"updated", "previous":
    the gate document of the capture against the old baseline, or None when there was none or it ran other
    inputs ("reason" says so)}."""
    capture, baseline = Path(capture), Path(baseline)
    with CaptureReader(capture) as c:
        if not c.complete:
            raise BadInput(f"{capture} is an incomplete capture: it cannot become a baseline")
        if not [run for run in c.metric_runs() if c.metrics(run)]:
            raise BadInput(f"{capture} has no per-site metrics (/metrics/<run>): it cannot become a baseline")
    previous, reason = None, "no baseline existed"
    if baseline.exists():
        if baseline.resolve() == capture.resolve():
            return {"updated": False, "previous": None, "reason": "the capture is the baseline already"}
        try:
            previous, reason = gate(capture, baseline, rules, runs, top), None
        except BadInput as e:
            with CaptureReader(baseline):     # not a capture at all: refuse to overwrite it
                pass
            reason = f"not comparable with the old baseline ({e})"
    baseline.parent.mkdir(parents=True, exist_ok=True)
    tmp = baseline.with_name(baseline.name + ".update-tmp")
    shutil.copyfile(capture, tmp)
    os.replace(tmp, baseline)
    return {"updated": True, "previous": previous, "reason": reason}


# ---------------------------------------------------------------------------------------------------------
# Golden captures (captures/regenerate.py)
# ---------------------------------------------------------------------------------------------------------
GOLDEN_SEQ_LEN = 64
GOLDEN_SEED = 0
GOLDEN_SAVE = "sites:^logits$,tokens:0:4"          # statistics of every site + 4 token rows of the logits
GOLDENS = {
    "tiny-reference": {"candidate": "reference"},   # reference vs reference: every site bitwise equal
    "tiny-sim": {"candidate": "sim"},               # FP8/NVFP4 quantisation simulator vs reference
}


def write_golden(name: str, out_dir: str | Path, force: bool = True) -> Path:
    """Run the golden `name` on the embedded tiny model (seeded synthetic checkpoint, GOLDEN_SEQ_LEN tokens
    of make_tokens(seed=GOLDEN_SEED), CPU, one torch thread for bit-reproducibility) into out_dir/NAME.h5."""
    if name not in GOLDENS:
        raise BadInput(f"golden {name!r}: choose one of {', '.join(GOLDENS)}")
    import torch

    from . import api
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = api.open_model()
        tokens = api.make_tokens(model, seq_len=GOLDEN_SEQ_LEN, seed=GOLDEN_SEED)
        out = Path(out_dir) / f"{name}.h5"
        out.parent.mkdir(parents=True, exist_ok=True)
        api.run(model, tokens, device="cpu", mode="both", capture=out, save=GOLDEN_SAVE, force=force,
                **GOLDENS[name])
    finally:
        torch.set_num_threads(threads)
    return out


def golden_names(names: Iterable[str] | None) -> list[str]:
    names = list(names or GOLDENS)
    for name in names:
        if name not in GOLDENS:
            raise BadInput(f"golden {name!r}: choose from {', '.join(GOLDENS)}")
    return names


__all__ = ["GOLDENS", "GateRule", "GateRules", "gate", "junit_xml", "load_gate_rules", "markdown_summary",
           "update_baseline", "write_golden"]
