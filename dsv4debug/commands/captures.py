"""`inspect`, `report` and `diff`: read captures; tables with rich, one JSON document with --json."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress, TextColumn
from rich.table import Table

from ..capture import CaptureReader
from ..diff import diff_captures, load_rules
from ..report import (
    STAT_COLUMNS,
    build_report,
    collapse_experts,
    fmt,
    inspect_capture,
    render_html,
)
from ..verdict import DEFAULT_BUDGET
from . import print_json

console = Console()
FAILING = ("nan", "diverged")      # verdict statuses for which `report` exits 1

FileArg = Annotated[Path, typer.Argument(help="capture file (.h5; an unfinished .h5.tmp is read too)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document to stdout instead of tables")]


def register(app: typer.Typer) -> None:
    app.command("inspect", help="Runs, sites, policies, sizes and completeness of a capture.")(inspect)
    app.command("report", help="Per-layer tables, metrics vs reference and the verdict; --html for a page. "
                "Exit 1 when the verdict finds NaN/Inf or a divergence.")(report)
    app.command("diff", help="Compare two captures site by site; exit 1 when a site exceeds its rule.")(diff)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


_SHORT_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "float64": "fp64", "float16": "fp16"}


# ---------------------------------------------------------------------------------------------------------
def inspect(file: FileArg, as_json: JsonOpt = False) -> None:
    with CaptureReader(file) as reader:
        info = inspect_capture(reader)
    if as_json:
        print_json(info)
        return
    state = "[green]complete[/]" if info["complete"] else "[bold red]INCOMPLETE[/] (writer killed or still running)"
    console.print(f"[bold]{info['file']}[/] {_mib(info['size_bytes'])}, {state}; format v{info['format_version']} "
                  f"by dsv4debug {info['tool_version']} at {info['created_utc']}")
    console.print(f"model {info['model']}, {info['tokens']} tokens, device {info['device']}, torch "
                  f"{info['torch_version']}, CuTeDSL {info['cutedsl_version']}; save policy "
                  f"[cyan]{info['save_policy']}[/], compression {info['compression']}")
    # short cells, the run's name never cut: the table must read in 80 columns (a pipe, a CI log)
    table = Table()
    for heading in ("run", "backend", "dtype", "mode", "sites/stored", "non-finite", "layers", "MiB stored/all"):
        table.add_column(heading, no_wrap=heading == "run")
    for r in info["runs"]:
        layers = r["layers_completed"]
        done = f"{len(layers)} (last {layers[-1]})" if layers else "0"
        dtype = str(r["dtype"] or "")
        table.add_row(r["run"], str(r["backend"] or ""), _SHORT_DTYPES.get(dtype, dtype), str(r["mode"] or ""),
                      f"{r['sites']}/{r['stored']}", str(r["nonfinite_sites"]), done,
                      f"{r['stored_bytes'] / 2**20:.1f}/{r['logical_bytes'] / 2**20:.1f}")
    console.print(table)
    console.print(f"metrics for: {', '.join(info['metrics_for']) or '-'}; floors: {info['floors']} sites; "
                  f"verdict: {info['verdict'] or '-'}")


# ---------------------------------------------------------------------------------------------------------
def report(file: FileArg,
           html_out: Annotated[Path | None, typer.Option("--html", help="write a self-contained HTML page")] = None,
           budget: Annotated[float, typer.Option(help="a site diverges above budget x its noise floor")]
           = DEFAULT_BUDGET,
           as_json: JsonOpt = False) -> None:
    with CaptureReader(file) as reader:
        rep = build_report(reader, budget)
    if html_out is not None:
        html_out.write_text(render_html(rep))
    if as_json:
        print_json(rep)
    else:
        _print_report(rep, html_out)
    if rep["verdict"].get("status") in FAILING:
        raise typer.Exit(1)


def _print_report(rep: dict[str, Any], html_out: Path | None) -> None:
    for run, records in rep["runs"].items():
        console.print(_run_table(run, records, run in rep["metric_runs"], rep["metric_runs"].get(run)))
    _print_verdict(rep["verdict"], rep["verdict_source"])
    if html_out is not None:
        console.print(f"HTML report written to {html_out}")


def _run_table(run: str, records: list[dict], with_metrics: bool, reference: str | None) -> Table:
    """One row per site (experts folded per layer), a section per layer; compact enough for 100 columns."""
    title = f"run {run}" + (f" vs {reference}" if with_metrics else "")
    columns = ["site", "shape", "nan/inf", "mean", "std", "absmax"]
    columns += ["cosine", "rel_l2|flips", "max_ulp", "x floor"] if with_metrics else ["min", "max"]
    table = Table(*columns, title=title, title_justify="left")
    layer = None
    for rec in collapse_experts(records):
        if rec["layer"] != layer:
            layer = rec["layer"]
            table.add_section()
        stats, metrics, judged = rec["stats"], rec.get("metrics") or {}, rec.get("judged") or {}
        bad = stats.get("nan_count") or stats.get("inf_count") or judged.get("exceeds")
        name = rec["site"] + (f" ({rec['experts']}, worst {rec['worst'].rsplit('.', 1)[-1]})"
                              if rec.get("worst") else "")
        row = [name, f"{stats.get('dtype', '')}{stats.get('shape', '')}",
               f"{stats.get('nan_count', 0)}/{stats.get('inf_count', 0)}",
               *(fmt(stats.get(k)) for k in ("mean", "std", "absmax"))]
        if with_metrics:
            error = metrics.get("flip_rate", metrics.get("rel_l2"))
            row += [fmt(metrics.get("cosine")), fmt(error), fmt(metrics.get("max_ulp")), fmt(judged.get("x_floor"))]
        else:
            row += [fmt(stats.get("min")), fmt(stats.get("max"))]
        table.add_row(*row, style="red" if bad else None)
    return table


def _print_verdict(verdict: dict[str, Any], source: str) -> None:
    color = {"clean": "green", "no-reference": "cyan"}.get(verdict.get("status"), "bold red")
    console.print(f"[{color}]verdict: {verdict.get('status')}[/] - {verdict.get('message', '')} ({source})")
    origin = verdict.get("nan_origin")
    if origin:
        count = origin.get("nan_count", origin.get("count"))
        where = origin.get("first_nonfinite", origin.get("coord"))
        console.print(f"  NaN origin: [bold]{origin['site']}[/] (layer {origin.get('layer')}), {count} non-finite, "
                      f"first at {where}")
        for name, stats in (origin.get("inputs") or {}).items():
            console.print(f"    input {name}: " + (", ".join(f"{k}={fmt(stats.get(k))}" for k in STAT_COLUMNS)
                                                   if stats else "not recorded"))
    for key, label in (("first_local_divergence", "bug (local error)"), ("first_divergence", "symptom (accumulated)")):
        item = verdict.get(key)
        if item:
            console.print(f"  {label}: [bold]{item['site']}[/] {item.get('metric', 'rel_l2')}="
                          f"{fmt(item.get('error', item.get('rel_l2')))} = {fmt(item.get('x_floor'))}x floor "
                          f"(floor {fmt(item.get('floor'))}, tolerance {fmt(item.get('tolerance'))})")
    if verdict.get("gain") is not None:
        console.print(f"  gain from bug to symptom: {fmt(verdict['gain'])}x")
    logits = verdict.get("logits_check")
    if logits and not logits["ok"]:
        console.print(f"  [bold red]logits look like garbage[/]: std {fmt(logits['std'])} outside "
                      f"{logits['std_range']} or non-finite ({logits['nan_count']} NaN, {logits['inf_count']} Inf)")


# ---------------------------------------------------------------------------------------------------------
def diff(a: Annotated[Path, typer.Argument(help="first capture (the reference side of the metrics)")],
         b: Annotated[Path, typer.Argument(help="second capture")],
         run_a: Annotated[str | None, typer.Option("--run-a", help="run of A (default: candidate or the only one)")]
         = None,
         run_b: Annotated[str | None, typer.Option("--run-b", help="run of B (default: the same name as A's)")]
         = None,
         rules: Annotated[Path | None, typer.Option("--rules", help="TOML rules: [default] and [[rule]] sites=REGEX")]
         = None,
         as_json: JsonOpt = False) -> None:
    rule_set = load_rules(rules)
    with Progress(TextColumn("diff {task.completed} sites {task.description}"), console=Console(stderr=True),
                  transient=True, disable=as_json or not sys.stderr.isatty()) as progress:
        task = progress.add_task("", total=None)
        result = diff_captures(a, b, run_a, run_b, rule_set,
                               on_site=lambda r: progress.update(task, advance=1, description=r["site"]))
    if as_json:
        print_json(result)
    else:
        _print_diff(result)
    if not result["clean"]:
        raise typer.Exit(1)


def _print_diff(result: dict[str, Any]) -> None:
    table = Table("site", "status", "mode", "details", title=f"{result['a']} [{result['run_a']}] vs "
                  f"{result['b']} [{result['run_b']}]", title_justify="left")
    for site in result["sites"]:
        if site["status"] in ("identical", "ignored") or (site["status"] == "ok" and not site["violations"]):
            continue
        details = "; ".join(site["violations"])
        table.add_row(site["site"], site["status"], site["mode"] or "", details,
                      style="red" if site["violations"] else None)
    if table.row_count:
        console.print(table)
    counts = ", ".join(f"{n} {status}" for status, n in sorted(result["counts"].items()))
    if result["clean"]:
        console.print(f"[green]clean[/]: {counts}")
    else:
        console.print(f"[bold red]differences exceed the rules[/]: {counts}; first: {result['first_failure']}")
