"""What `inspect` and `report` show about a capture, as plain dicts; the HTML report with inline SVG charts."""
from __future__ import annotations

import html
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .capture import CaptureReader
from .verdict import DEFAULT_BUDGET, judge, nan_origin, summarize

EXPERT_SITE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)$")


# ---------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------
def inspect_capture(reader: CaptureReader) -> dict[str, Any]:
    meta = reader.meta
    model = meta.get("model_config")
    return {
        "file": str(reader.path), "size_bytes": reader.path.stat().st_size, "complete": reader.complete,
        **{k: meta.get(k) for k in ("format_version", "tool_version", "created_utc", "device", "torch_version",
                                     "cutedsl_version", "save_policy", "compression", "checkpoint")},
        "model": model.get("name") if isinstance(model, dict) else None,
        "tokens": len(meta.get("token_ids", [])),
        "runs": [_run_summary(reader, run) for run in reader.runs()],
        "metrics_for": reader.metric_runs(), "floors": len(reader.floors()),
        "verdict": (reader.verdict() or {}).get("status"),
    }


def _run_summary(reader: CaptureReader, run: str) -> dict[str, Any]:
    sites = [reader.site(run, s) for s in reader.sites(run)]
    stored = [s["tensor"] for s in sites if s["tensor"]]
    attrs = reader.run_attrs(run)
    return {"run": run, "backend": attrs.get("backend"), "dtype": attrs.get("dtype"), "mode": attrs.get("mode"),
            "sites": len(sites), "stored": len(stored), "layers_completed": attrs.get("layers_completed", []),
            "nonfinite_sites": sum(1 for s in sites if s["stats"].get("nan_count") or s["stats"].get("inf_count")),
            "stored_bytes": sum(t["stored_bytes"] for t in stored),
            "logical_bytes": sum(t["logical_bytes"] for t in stored)}


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------
def run_mode(reader: CaptureReader, run: str) -> str:
    """forced or free: the run's `mode` attribute, else guessed from its name (candidate.forced/.local)."""
    if run in reader.runs():
        mode = reader.run_attrs(run).get("mode")
        if mode:
            return "forced" if mode in ("forced", "local") else "free"
    return "forced" if run.endswith((".forced", ".local")) else "free"


def run_records(reader: CaptureReader, run: str, budget: float = DEFAULT_BUDGET) -> list[dict[str, Any]]:
    """verdict-style records of a run: stats, metrics against its reference and floors where present."""
    metrics, floors, mode = reader.metrics(run), reader.floors(), run_mode(reader, run)
    records = []
    for site in reader.sites(run):
        info = reader.site(run, site)
        rec = {"site": site, "layer": info["layer"], "family": info["family"], "inputs": info["inputs"],
               "stats": info["stats"], "metrics": metrics.get(site), "floor": floor_for(floors.get(site), mode),
               "stored": info["stored"]}
        rec["judged"] = judge(rec, budget)
        records.append(rec)
    return records


def floor_for(floor: Mapping[str, Any] | None, mode: str) -> dict[str, Any] | None:
    """Floors keyed by metric; the runner also writes rel_l2_local / rel_l2_free (forced / free-running)."""
    if not floor:
        return None
    out = dict(floor)
    if "rel_l2" not in out:
        out["rel_l2"] = floor.get("rel_l2_local" if mode == "forced" else "rel_l2_free")
    return out


def build_report(reader: CaptureReader, budget: float = DEFAULT_BUDGET) -> dict[str, Any]:
    runs = {run: run_records(reader, run, budget) for run in reader.runs()}
    stored_verdict = reader.verdict()
    return {"inspect": inspect_capture(reader), "budget": budget, "runs": runs,
            "metric_runs": {run: reader.metrics_reference(run) for run in reader.metric_runs()},
            "nan_origins": {run: nan_origin(records) for run, records in runs.items()},
            "verdict": stored_verdict or compute_verdict(reader, runs, budget),
            "verdict_source": "file" if stored_verdict else "computed from the capture"}


def compute_verdict(reader: CaptureReader, runs: Mapping[str, list[dict]], budget: float) -> dict[str, Any]:
    judged = [run for run in reader.metric_runs() if run in runs]
    free = [run for run in judged if run_mode(reader, run) == "free"]
    forced = [run for run in judged if run_mode(reader, run) == "forced"]
    if free or forced:
        main = free[0] if free else forced[0]
        verdict = summarize(runs[main], runs[forced[0]] if free and forced else None, budget)
        verdict.update(run=main, forced_run=forced[0] if forced else None)
        return verdict
    main = "candidate" if "candidate" in runs else next(iter(runs), None)
    verdict = summarize(runs.get(main, []), None, budget)
    verdict["run"] = main
    return verdict


def layer_curves(report: Mapping[str, Any]) -> tuple[str, dict[str, list[tuple[float, float]]]]:
    """Per-layer worst error in x floor for runs with metrics; otherwise per-layer largest |x| of each run."""
    metric_runs = list(report["metric_runs"])
    if metric_runs:
        return "worst error per layer (x noise floor)", {
            run: _per_layer(report["runs"].get(run, []), lambda r: (r["judged"] or {}).get("x_floor"))
            for run in metric_runs}
    return "largest |x| per layer", {
        run: _per_layer(records, lambda r: r["stats"].get("absmax")) for run, records in report["runs"].items()}


def _per_layer(records: Sequence[Mapping[str, Any]], value) -> list[tuple[float, float]]:
    worst: dict[int, float] = {}
    for rec in records:
        v = value(rec)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            worst[rec["layer"]] = max(worst.get(rec["layer"], -math.inf), v)
    return sorted(worst.items())


def expert_cells(report: Mapping[str, Any]) -> tuple[str, dict[tuple[int, int], float]]:
    """(layer, expert) -> x floor of the first run with metrics, else std of the first run's output."""
    metric_runs = list(report["metric_runs"])
    run = metric_runs[0] if metric_runs else next(iter(report["runs"]), None)
    cells = {}
    for rec in report["runs"].get(run, []):
        match = EXPERT_SITE.match(rec["site"])
        if match:
            judged = rec["judged"]
            cells[(int(match[1]), int(match[2]))] = judged["x_floor"] if metric_runs and judged else \
                rec["stats"].get("std", math.nan)
    label = f"{run}: error x noise floor" if metric_runs else f"{run}: std of expert output"
    return label, cells


# ---------------------------------------------------------------------------------------------------------
# SVG
# ---------------------------------------------------------------------------------------------------------
PALETTE = ("#440154", "#3b528b", "#21918c", "#5ec962", "#fde725")     # viridis stops
SERIES_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _color(t: float) -> str:
    t = min(max(t, 0.0), 1.0) * (len(PALETTE) - 1)
    i = min(int(t), len(PALETTE) - 2)
    a, b = (tuple(int(c[k:k + 2], 16) for k in (1, 3, 5)) for c in PALETTE[i:i + 2])
    return "#" + "".join(f"{round(x + (y - x) * (t - i)):02x}" for x, y in zip(a, b))


def _log(v: float) -> float:
    return math.log10(max(v, 1e-30))


def svg_line_chart(series: Mapping[str, Sequence[tuple[float, float]]], title: str,
                   width: int = 760, height: int = 300) -> str:
    """Lines over layers on a log y axis; infinite values are drawn at the top as red dots."""
    points = [(x, y) for line in series.values() for x, y in line]
    finite = [y for _, y in points if math.isfinite(y) and y > 0]
    if not points or not finite:
        return f"<p>{html.escape(title)}: nothing to plot</p>"
    left, right, top, bottom = 60, 150, 28, 36
    xs = [x for x, _ in points]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = math.floor(_log(min(finite))), math.ceil(_log(max(finite)))
    y1 = max(y1, y0 + 1)

    def px(x):
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y):
        v = y1 if not math.isfinite(y) else _log(y)
        return top + (y1 - v) / (y1 - y0) * (height - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="11">',
           f'<text x="{left}" y="16" font-weight="bold">{html.escape(title)}</text>']
    for e in range(y0, y1 + 1):
        y = py(10.0 ** e)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#ddd"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">1e{e}</text>')
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{height - bottom + 14}" text-anchor="middle">{int(x)}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">layer '
               '(-1: embedding and head)</text>')
    for i, (name, line) in enumerate(series.items()):
        color = SERIES_COLORS[i % len(SERIES_COLORS)]
        drawn = [(px(x), py(y)) for x, y in line if y > 0 or not math.isfinite(y)]
        if drawn:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in drawn)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="{4 if not math.isfinite(y) else 2.5}" '
                f'fill="{"#e00" if not math.isfinite(y) else color}"><title>{html.escape(name)} layer {x}: {y:.4g}'
                '</title></circle>' for x, y in line if y > 0 or not math.isfinite(y)]
        out.append(f'<rect x="{width - right + 12}" y="{top + 16 * i}" width="12" height="3" fill="{color}"/>'
                   f'<text x="{width - right + 30}" y="{top + 16 * i + 5}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def svg_heatmap(cells: Mapping[tuple[int, int], float], title: str, width: int = 760) -> str:
    """Layers (rows) x experts (columns), colour on a log scale; red = non-finite, grey = not recorded."""
    if not cells:
        return f"<p>{html.escape(title)}: no expert sites (layers.L.ffn.experts.E) in this capture</p>"
    layers = sorted({layer for layer, _ in cells})
    n_experts = max(e for _, e in cells) + 1
    cell_w = max(2.0, (width - 80) / n_experts)
    cell_h = 14
    finite = [v for v in cells.values() if math.isfinite(v) and v > 0]
    lo, hi = (_log(min(finite)), _log(max(finite))) if finite else (0.0, 1.0)
    span = max(hi - lo, 1e-9)
    height = 60 + cell_h * len(layers)
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{80 + cell_w * n_experts:.0f}" height="{height}" '
           'font-size="11">'), f'<text x="4" y="16" font-weight="bold">{html.escape(title)}</text>']
    for row, layer in enumerate(layers):
        y = 28 + row * cell_h
        out.append(f'<text x="74" y="{y + 11}" text-anchor="end">layer {layer}</text>')
        for expert in range(n_experts):
            v = cells.get((layer, expert))
            fill = "#eee" if v is None else "#e00" if not math.isfinite(v) else _color((_log(v) - lo) / span)
            label = "not recorded" if v is None else f"{v:.4g}"
            out.append(f'<rect x="{80 + expert * cell_w:.1f}" y="{y}" width="{cell_w:.1f}" height="{cell_h - 1}" '
                       f'fill="{fill}"><title>layer {layer} expert {expert}: {label}</title></rect>')
    y = height - 18
    out += [f'<rect x="{80 + i * 20}" y="{y}" width="20" height="10" fill="{_color(i / 9)}"/>' for i in range(10)]
    out.append(f'<text x="80" y="{y + 22}">{10 ** lo:.3g}</text><text x="280" y="{y + 22}" text-anchor="end">'
               f'{10 ** hi:.3g}</text><text x="300" y="{y + 9}">log scale; red: NaN/Inf; grey: not recorded</text>')
    out.append("</svg>")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------------------------------------
CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}td.l,th.l{text-align:left}tr.layer td{background:#f3f3f3;
font-weight:bold;text-align:left}.bad{background:#fdd}.verdict{padding:8px 12px;border-radius:6px;margin:12px 0}
.nan,.diverged{background:#fdd}.clean{background:#dfd}.no-reference{background:#eef}code{font-size:12px}"""
STAT_COLUMNS = ("nan_count", "inf_count", "min", "max", "mean", "std", "absmax")
METRIC_COLUMNS = ("cosine", "rel_l2", "max_ulp", "flip_rate")


def fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_html(report: Mapping[str, Any]) -> str:
    info, verdict = report["inspect"], report["verdict"]
    curve_title, curves = layer_curves(report)
    heat_title, cells = expert_cells(report)
    parts = [(f"<!doctype html><html><head><meta charset='utf-8'><title>dsv4debug report {html.escape(info['file'])}"
             f"</title><style>{CSS}</style></head><body>"),
             (f"<h1>dsv4debug report</h1><p><code>{html.escape(info['file'])}</code> - model "
             f"{html.escape(str(info['model']))}, {info['tokens']} tokens, device {html.escape(str(info['device']))}, "
             f"torch {html.escape(str(info['torch_version']))}, CuTeDSL {html.escape(str(info['cutedsl_version']))}, "
             f"{'complete' if info['complete'] else '<b>INCOMPLETE</b>'}</p>"),
             _verdict_html(verdict, report["verdict_source"]),
             "<h2>Error per layer</h2>", svg_line_chart(curves, curve_title),
             "<h2>Experts x layers</h2>", svg_heatmap(cells, heat_title)]
    for run, records in report["runs"].items():
        parts += [f"<h2>Run {html.escape(run)}</h2>", _run_table(records, run in report["metric_runs"])]
    parts.append("</body></html>")
    return "\n".join(parts)


def _verdict_html(verdict: Mapping[str, Any], source: str) -> str:
    status = verdict.get("status", "")
    rows = []
    for key in ("nan_origin", "first_local_divergence", "first_divergence"):
        item = verdict.get(key)
        if item:
            detail = ", ".join(f"{k}={fmt(v)}" for k, v in item.items() if k not in ("inputs", "site"))
            rows.append(f"<li>{key}: <b>{html.escape(item['site'])}</b> ({html.escape(detail)})</li>")
    return (f"<div class='verdict {html.escape(status)}'><b>Verdict: {html.escape(status)}</b> - "
            f"{html.escape(verdict.get('message', ''))} <small>({html.escape(source)})</small><ul>{''.join(rows)}"
            "</ul></div>")


def collapse_experts(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records with each layer's expert sites folded into one row showing the worst expert."""
    out: list[dict[str, Any]] = []
    groups: dict[int, dict[str, Any]] = {}
    for rec in records:
        match = EXPERT_SITE.match(rec["site"])
        if not match:
            out.append(dict(rec))
            continue
        layer = int(match[1])
        if layer not in groups:
            groups[layer] = {**rec, "site": f"layers.{layer}.ffn.experts.*", "experts": 0}
            out.append(groups[layer])
        group = groups[layer]
        group["experts"] += 1
        if _worse(rec, group):
            group.update({k: rec[k] for k in ("stats", "metrics", "judged", "floor")}, worst=rec["site"])
    return out


def _worse(rec: Mapping[str, Any], than: Mapping[str, Any]) -> bool:
    a, b = rec.get("judged"), than.get("judged")
    if a and b:
        return a["x_floor"] > b["x_floor"]
    return (rec["stats"].get("absmax") or 0) > (than["stats"].get("absmax") or 0)


def _run_table(records: Sequence[Mapping[str, Any]], with_metrics: bool) -> str:
    heads = ["site", "family", "dtype", "shape", *STAT_COLUMNS]
    if with_metrics:
        heads += [*METRIC_COLUMNS, "x floor"]
    rows = [f"<table><tr>{''.join(f'<th>{h}</th>' for h in heads)}</tr>"]
    layer = None
    for rec in collapse_experts(records):
        if rec["layer"] != layer:
            layer = rec["layer"]
            rows.append(f"<tr class='layer'><td colspan='{len(heads)}'>layer {layer}</td></tr>")
        stats, metrics, judged = rec["stats"], rec.get("metrics") or {}, rec.get("judged") or {}
        bad = stats.get("nan_count") or stats.get("inf_count") or judged.get("exceeds")
        name = rec["site"] + (f" ({rec['experts']}, worst {rec['worst']})" if rec.get("worst") else "")
        cells = [f"<td class='l'>{html.escape(name)}</td>", f"<td class='l'>{html.escape(rec['family'])}</td>",
                 f"<td>{stats.get('dtype', '')}</td>", f"<td>{stats.get('shape', '')}</td>"]
        cells += [f"<td>{fmt(stats.get(k))}</td>" for k in STAT_COLUMNS]
        if with_metrics:
            cells += [f"<td>{fmt(metrics.get(k))}</td>" for k in METRIC_COLUMNS]
            cells.append(f"<td>{fmt(judged.get('x_floor'))}</td>")
        rows.append(f"<tr{' class=bad' if bad else ''}>{''.join(cells)}</tr>")
    rows.append("</table>")
    return "\n".join(rows)
