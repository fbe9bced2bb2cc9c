"""`gate`: a capture against a golden capture, per site, with budgets; JUnit XML and markdown for CI."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..errors import BadInput
from ..gate import gate as run_gate
from ..gate import junit_xml, load_gate_rules, markdown_summary, short_values, update_baseline
from . import print_json

console = Console()

HELP = ("Compare a capture's per-site metrics with a baseline (golden) capture's: exit 1 when a site's error "
        "grows beyond its budget (x floor +20 % / 1 floor, SQNR -1 dB, new NaN/Inf, untied top-k flips) or a "
        "baseline site is missing; 2 on bad input. --update copies the capture over the baseline.")


def register(app: typer.Typer) -> None:
    app.command("gate", help=HELP)(gate)


def gate(capture: Annotated[Path, typer.Argument(help="the capture to judge (from dsv4debug run --capture)")],
         baseline: Annotated[Path, typer.Option("--baseline", help="the golden capture of the same input")],
         rules: Annotated[Path | None, typer.Option("--rules", help="TOML: a table 'default' of budgets, then "
                                                    "'rule' tables: sites = REGEX with budgets or ignore = true")] = None,
         junit: Annotated[Path | None, typer.Option("--junit", help="write JUnit XML: one test case per site")]
         = None,
         summary: Annotated[Path | None, typer.Option("--summary", help="write a markdown summary (e.g. "
                                                      "$GITHUB_STEP_SUMMARY)")] = None,
         runs: Annotated[list[str] | None, typer.Option("--run", help="gate this run only (repeatable; default: "
                                                        "every run with metrics in the baseline)")] = None,
         update: Annotated[bool, typer.Option("--update", help="replace the baseline with the capture (after "
                                              "printing what changed); exit 0")] = False,
         top: Annotated[int, typer.Option("--top", help="worst sites to list")] = 10,
         as_json: Annotated[bool, typer.Option("--json", help="print one JSON document instead of tables")]
         = False) -> None:
    if top < 1:
        raise BadInput(f"--top {top}: must be >= 1")
    rule_set = load_gate_rules(rules)
    if update:
        if not baseline.exists() and baseline.suffix != ".h5":
            raise BadInput(f"--baseline {baseline}: a new baseline must be an .h5 file")
        result = update_baseline(capture, baseline, rule_set, runs, top)
        doc = result["previous"]
        if doc is not None:
            _write_outputs(doc, junit, summary, top)
        if as_json:
            print_json(result)
            return
        if doc is not None:
            _print(doc, top, updating=True)
        _print_update(result, capture, baseline, top)
        return
    if not baseline.exists():
        raise BadInput(f"--baseline {baseline}: no such file (create it deliberately with --update)")
    doc = run_gate(capture, baseline, rule_set, runs, top)
    _write_outputs(doc, junit, summary, top)
    if as_json:
        print_json(doc)
    else:
        _print(doc, top)
    if doc["status"] != "pass":
        raise typer.Exit(1)


def _write_outputs(doc: dict[str, Any], junit: Path | None, summary: Path | None, top: int) -> None:
    for path, text in ((junit, junit_xml), (summary, markdown_summary)):
        if path is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text(doc) if text is junit_xml else text(doc, top), encoding="utf-8")
        except OSError as e:
            raise BadInput(f"cannot write {path}: {e}") from None


def _print(doc: dict[str, Any], top: int, updating: bool = False) -> None:
    counts = doc["counts"]
    console.print(f"[bold]{doc['capture']}[/] (candidate {doc['capture_candidate']}) vs baseline "
                  f"[bold]{doc['baseline']}[/] (candidate {doc['baseline_candidate']}); runs "
                  f"{', '.join(doc['runs'])}; rules: {doc['rules']}", highlight=False)
    for note in doc["notes"]:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    failing = [e for e in doc["entries"] if e["status"] in ("regressed", "missing")]
    shown = failing[:top] + [e for e in doc["worst"] if e not in failing][:max(0, top - len(failing))]
    labels = {"regressed": "[bold red]REGRESSED[/]", "missing": "[bold red]MISSING[/]  "}
    for e in shown:
        used = "inf" if e["used"] == float("inf") else f"{e['used']:.0%}"
        budget = f", {used} of budget" if e["checks"] else ""
        label = labels.get(e["status"], f"[dim]{e['status']:<9}[/]")
        details = "; ".join(e["reasons"]) or short_values(e)
        console.print(f"{label} [bold]{e['site']}[/] ({e['run']}{budget}): {details}", highlight=False)
    if len(failing) > top:
        console.print(f"... and {len(failing) - top} more failing sites (--top, --json, --junit)")
    if doc["new"]:
        names = ", ".join(f"{i['site']} ({i['run']})" for i in doc["new"][:10])
        console.print(f"[cyan]new sites[/] (not in the baseline, not judged): {len(doc['new'])}: {names}"
                      + (" ..." if len(doc["new"]) > 10 else ""), highlight=False)
    verdict = doc["capture_verdict"]
    if verdict:
        console.print(f"capture's verdict: {verdict['status']} - {verdict['message']}", highlight=False)
    tally = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    if doc["status"] == "pass":
        console.print(f"[green]PASS[/]: {doc['sites']} sites, {tally}"
                      + ("; some sites improved: refresh the baseline with --update"
                         if counts["improved"] and not updating else ""))
    else:
        first = doc["first_regression"]
        console.print(f"[bold red]FAIL[/]: {tally}; first: {first['site']} ({first['run']}): {first['reasons'][0]}",
                      highlight=False)


def _print_update(result: dict[str, Any], capture: Path, baseline: Path, top: int) -> None:
    if not result["updated"]:
        console.print(f"baseline {baseline} not changed: {result['reason']}")
        return
    doc = result["previous"]
    if doc is None:
        console.print(f"[bold]baseline {baseline} written[/] from {capture} ({result['reason']})", highlight=False)
        return
    counts = doc["counts"]
    changed = {k: counts[k] for k in ("regressed", "missing", "improved", "new") if counts[k]}
    what = ", ".join(f"{n} {k}" for k, n in changed.items()) or "no site changed beyond its budget"
    console.print(f"[bold]baseline {baseline} updated[/] from {capture}: {what} "
                  f"(was {'failing' if doc['status'] == 'fail' else 'passing'})", highlight=False)
    improved = [e for e in doc["entries"] if e["status"] == "improved"]
    for e in improved[:top]:
        console.print(f"  improved {e['site']} ({e['run']}): {short_values(e)}", highlight=False)
    if len(improved) > top:
        console.print(f"  ... and {len(improved) - top} more improved sites")
