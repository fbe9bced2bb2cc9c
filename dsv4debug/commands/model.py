"""Commands that run the model: run, bisect, sites, doctor."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .. import api
from ..backends.base import FAMILIES, OPS
from ..bisect import BISECT_BUDGET
from ..errors import BadInput
from . import print_json

console = Console(stderr=True)
out = Console()

CheckpointArg = typer.Argument(None, help="Checkpoint directory (default: the embedded tiny model).")


def _progress(enabled: bool):
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=True, disable=not enabled)


def _stage_callback(progress: Progress):
    task = None

    def cb(stage: str, i: int, total: int) -> None:
        nonlocal task
        if task is None:
            task = progress.add_task(stage, total=total)
        progress.update(task, completed=i, description=stage)
    return cb


def _threads_for(model, device: str) -> None:
    """Small models on the CPU run faster on one thread: their ops are too short for OpenMP to pay, and
    on a busy machine its barriers make them 10x slower. Real shapes keep torch's default."""
    import torch
    if device == "cpu" and model.config.dim <= 1024:
        torch.set_num_threads(1)


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "inf" if math.isinf(x) else f"{x:.{digits}g}"
    return str(x)


def _print_verdict(result) -> None:
    v = result.verdict
    colour = {"clean": "green", "diverged": "red", "nan": "bold red",
              "garbage-logits": "bold red"}.get(v["status"], "yellow")
    out.print(f"[{colour}]{v['status'].upper()}[/]: {v['message']}", highlight=False)
    asked = [op for op in result.delegated_ops if op not in result.missing_ops]
    lacking = result.missing_ops + result.declined_calls
    for label, ops in (("ops without a kernel (run by the reference)", lacking),
                       ("ops delegated by --reference-ops (run by the reference)", asked)):
        if ops:
            out.print(f"[yellow]{label}: {', '.join(ops)}[/]", highlight=False)
    t = Table(title="verdict", show_lines=False)
    named = [d["site"] for d in (v.get(k) for k in ("nan_origin", "first_local_divergence", "first_divergence")) if d]
    for col in ("", "site", "layer", "family", "error", "x floor", "tolerance"):
        t.add_column(col, **_site_width(named) if col == "site" else {})
    n = v.get("nan_origin")
    if n:
        t.add_row("NaN origin", n["site"], _fmt(n["layer"]), n["family"], f"{n['count']} non-finite",
                  f"first at {n['coord']}", n["run"])
    for label, key in (("bug (local)", "first_local_divergence"), ("symptom (free)", "first_divergence")):
        d = v.get(key)
        if d:
            t.add_row(label, d["site"], _fmt(d["layer"]), d["family"], _fmt(d["error"]), _fmt(d["x_floor"]),
                      _fmt(d["tolerance"]))
    if v.get("gain") is not None:
        t.add_row("gain", "", "", "", "", _fmt(v["gain"]), "")
    if t.row_count:
        out.print(t)
    _print_memory(result.memory)
    worst = [w for w in (v.get("worst_local") or v.get("worst") or []) if w["x_floor"] > 0]
    if worst:
        w = Table(title="worst sites (x floor)")
        for col in ("site", "family", "error", "floor", "x floor"):
            w.add_column(col, **_site_width([row["site"] for row in worst[:8]]) if col == "site" else {})
        for row in worst[:8]:
            w.add_row(row["site"], row["family"], _fmt(row["error"]), _fmt(row["floor"]), _fmt(row["x_floor"]))
        out.print(w)


def _print_memory(memory: dict[str, Any] | None, what: str = "") -> None:
    """runner.gpu_peak's numbers in a line (nothing off CUDA)."""
    if memory:
        gib = 2 ** 30
        out.print(f"peak GPU memory{what}: {memory['peak_bytes'] / gib:.2f} GiB = {memory['ratio']:.2f}x the largest "
                  f"layer's stored weights ({memory['layer_weight_bytes'] / gib:.2f} GiB) and fp64 hidden streams "
                  f"({memory['fp64_stream_bytes'] / gib:.2f} GiB)", highlight=False)


def _site_width(sites: list[str]) -> dict:
    """A site column that narrow terminals (and pipes: 80 columns) never cut: the name is what one acts on."""
    return {"no_wrap": True, "min_width": max(map(len, sites), default=4)}


def run(checkpoint: Path | None = CheckpointArg,
        tokens: str | None = typer.Option(None, help="Comma-separated token ids."),
        prompt: str | None = typer.Option(None, help="Text (needs tokenizer.json and transformers)."),
        seq_len: int | None = typer.Option(None, help="Pseudo-random token ids of this length (default 256)."),
        candidate: str = typer.Option("sim", help="Candidate backend (reference, sim, kernels, or a plugin)."),
        reference: str = typer.Option("reference", help="Reference backend."),
        mode: str = typer.Option("both", help="free | forced | both."),
        forcing: str = typer.Option("op", help="Teacher forcing granularity: op | layer."),
        layers: str | None = typer.Option(None, help="Main layers to compare, A:B (earlier ones run on the reference)."),
        device: str = typer.Option("cpu", help="cpu | cuda."),
        capture: Path | None = typer.Option(None, help="Write an HDF5 capture here."),
        save: str = typer.Option("stats", help="stats | full | tokens:A:B | sites:REGEX (comma-combinable)."),
        force: bool = typer.Option(False, help="Overwrite an existing capture."),
        inject: list[str] = typer.Option([], help="Plant a fault KIND@SITE[:ARG] in the candidate (repeatable)."),
        reference_ops: str | None = typer.Option(None, help="Ops or op families the candidate runs on the "
                                                 f"reference, explicitly (families: {', '.join(FAMILIES)})."),
        qat: bool = typer.Option(True, help="QAT simulations (KV fp8, indexer fp4) in model.py."),
        budget: float | None = typer.Option(None, help="Tolerance in multiples of the noise floor (default 8)."),
        pin_router: str | None = typer.Option(None, help="The free candidate routes with the reference's "
                                                 "expert ids (ids) or ids and weights (ids+weights)."),
        repeat: int = typer.Option(1, help="Also run the candidate N times per stage: bitwise determinism."),
        graph: str | None = typer.Option(None, help="Also run every candidate op under graph execution on the "
                                         "eager run's inputs and compare: compile[:BACKEND] (torch.compile, "
                                         "inductor by default) | cuda (CUDA graphs) | all."),
        moe: bool = typer.Option(False, help="Print MoE diagnostics: tokens and local error per expert, routing."),
        json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        ) -> None:
    """Run reference and candidate side by side and name where NaN or divergence starts."""
    model = api.open_model(checkpoint)
    _threads_for(model, device)
    ids = api.make_tokens(model, tokens, prompt, seq_len)
    fams = tuple(f for f in (reference_ops or "").split(",") if f)
    unknown = [f for f in fams if f not in FAMILIES and f not in OPS]
    if unknown:
        raise BadInput(f"--reference-ops: {unknown[0]!r} is neither an op family ({', '.join(FAMILIES)}) "
                       f"nor an op ({', '.join(OPS)})")
    if capture is not None and capture.exists() and not force:
        raise BadInput(f"{capture} exists; pass --force to overwrite it")
    if graph:
        from ..backends.graph import parse_graph
        parse_graph(graph, device)
    with _progress(not json_out and sys.stderr.isatty()) as progress:
        result = api.run(model, ids, candidate=candidate, reference_backend=reference, mode=mode, forcing=forcing,
                         layers=layers, device=device, qat=qat, inject=inject, budget=budget, capture=capture,
                         save=save, force=force, reference_families=fams, pin_router=pin_router,
                         progress=_stage_callback(progress))
    graphs = None
    if graph:
        from ..runner import graph_check
        kw = {"budget": budget} if budget is not None else {}
        graphs = graph_check(model, ids, candidate, graph, device, qat, [api.parse_fault(f) for f in inject],
                             api.parse_layers(layers, model.config), fams, **kw)
    determinism = None
    if repeat > 1:
        from ..faults import parse_fault
        from ..runner import repeat_check
        determinism = repeat_check(model, ids, candidate, repeat, device, qat, [parse_fault(f) for f in inject])
    failed = (result.diverged or (determinism is not None and not determinism["deterministic"])
              or any(not g["agrees"] for g in graphs or ()))
    if json_out:
        from ..runner import moe_diagnostics
        doc = {"verdict": result.verdict, "determinism": determinism, "graph": graphs,
               "missing_ops": result.missing_ops,
               "delegated_ops": result.delegated_ops, "declined_calls": result.declined_calls,
               "moe": moe_diagnostics(result),
               "timings_s": result.timings, "memory": result.memory,
               "capture": str(capture) if capture else None,
               "sites": [r.to_dict(result.options.budget) for r in result.sites]}
        print_json(doc)
    else:
        _print_verdict(result)
        if moe:
            _print_moe(result)
        if determinism is not None:
            d = determinism["first_difference"]
            out.print(f"determinism over {repeat} runs: " + ("[green]bitwise identical[/]" if d is None else
                      f"[red]first difference at {d['site']}[/] ({d['mismatches']} elements, max {d['max_abs']})"))
        for g in graphs or ():
            _print_graph(g)
        if capture:
            out.print(f"capture written: {capture}")
    raise typer.Exit(1 if failed else 0)


def _print_graph(g: dict[str, Any]) -> None:
    d, f = g["first_difference"], g["first_failure"]
    status = ("[green]bitwise identical[/]" if d is None else "[green]agrees within the noise floor[/]"
              if f is None else "[red]differs[/]")
    out.print(f"eager vs {g['graph']} ({'bitwise' if g['bitwise_expected'] else 'noise floor'}, "
              f"{g['sites_bitwise']}/{g['sites_compared']} sites bitwise): {status}", highlight=False)
    for label, r in (("first failure", f), ("first difference", d if d is not f else None)):
        if r is None:
            continue
        if r.get("error") or r["mismatches"] is None:
            what = r.get("error") or f"shapes {r['shapes']}, dtypes {r['dtypes']}"
        else:
            what = (f"{r['mismatches']} elements differ, max |diff| {_fmt(r['max_abs'])} at {r['coord']} "
                    f"(eager {_fmt(r['eager'])}, graph {_fmt(r['graph'])})"
                    + (f", {_fmt(r['x_floor'])}x floor" if "x_floor" in r else ""))
        out.print(f"  {label}: {r['site']} (layer {r['layer']}, op {r['op']}): {what}", highlight=False)
    for op, n in g["not_captured"].items():
        out.print(f"  not captured (ran eagerly): {op}, {n['calls']} calls from {n['site']}: {n['error']}",
                  highlight=False)


def _print_moe(result) -> None:
    from ..runner import moe_diagnostics
    t = Table(title="MoE: tokens / local error (x floor) per expert; routing agreement")
    for col in ("layer", "experts (tokens: x floor)", "worst expert", "routing forced", "routing free"):
        t.add_column(col)
    for layer, d in sorted(moe_diagnostics(result).items()):
        xf = {e: x for e, x in d["expert_x_floor"].items() if x is not None}
        cells = " ".join(f"{e}({n}:{_fmt(xf.get(e), 2)})" for e, n in sorted(d["tokens_per_expert"].items()))
        worst = max(xf, key=xf.get) if xf else None
        routing = [d["routing"].get(k) for k in ("forced", "free")]
        t.add_row(str(layer), cells, "-" if worst is None else f"{worst} ({_fmt(xf[worst])}x)",
                  *("-" if r is None else f"{r['agreement_mean']:.3f}, {r['hard_flips']} hard / {r['ties']} ties"
                    for r in routing))
    out.print(t)


def bisect(checkpoint: Path | None = CheckpointArg,
           tokens: str | None = typer.Option(None, help="Comma-separated token ids."),
           seq_len: int | None = typer.Option(None, help="Pseudo-random token ids of this length (default 256)."),
           candidate: str = typer.Option("sim", help="Candidate backend."),
           reference: str | None = typer.Option(
               None, help="Backend the candidate is judged by (default: a quantising candidate's simulator, "
                          "e.g. sim-w4a16 for kernels, which rounds as it does; else reference)."),
           axis: str = typer.Option("layers", help="layers (binary search on the logits) | ops (knockout of op "
                                                     "families) | both | stages (each stage on the judge's input: "
                                                     "finds faults below the logits' noise) | all."),
           device: str = typer.Option("cpu", help="cpu | cuda."),
           inject: list[str] = typer.Option([], help="Plant a fault KIND@SITE[:ARG] in the candidate."),
           qat: bool = typer.Option(True, help="QAT simulations in model.py."),
           budget: float = typer.Option(BISECT_BUDGET, help="Tolerance in multiples of the noise floor."),
           free_routing: bool = typer.Option(False, "--free-routing",
                                             help="Let the candidate choose its own experts (default: every "
                                                  "probe routes by the judge's ids; a wrong selection shows "
                                                  "only with this)."),
           json_out: bool = typer.Option(False, "--json", help="Print the whole search as JSON."),
           ) -> None:
    """Binary search over layers or knockout over op families, judged on the final logits; or a sweep of the
    stages, each on the judge's input."""
    from ..bisect import bisect as run_bisect
    from ..faults import parse_fault
    model = api.open_model(checkpoint)
    _threads_for(model, device)
    ids = api.make_tokens(model, tokens, None, seq_len)

    def show(p) -> None:
        if not json_out:
            mark = "[red]diverges[/]" if p.diverged else "[green]clean[/]"
            out.print(f"probe: {p.what:<40} rel_l2 {_fmt(p.rel_l2)} (tol {_fmt(p.tolerance)}) {mark}",
                      highlight=False)

    with _progress(not json_out and sys.stderr.isatty()) as progress:
        results = run_bisect(model, ids, candidate, axis, reference=reference, device=device, qat=qat,
                             faults=[parse_fault(f) for f in inject], on_probe=show, budget=budget,
                             free_routing=free_routing, progress=_stage_callback(progress))
    if json_out:
        print_json([r.to_dict() for r in results])
    else:
        for r in results:
            out.print(f"[bold]{r.axis}[/]: {r.message}", highlight=False)
            _print_memory(r.memory, f" (since the search began, through {r.axis})")
    raise typer.Exit(1 if any(r.diverged for r in results) else 0)


def sites(preset: str | None = typer.Option(None, help="tiny | flash | pro (default: the checkpoint's)."),
          checkpoint: Path | None = typer.Option(None, help="Checkpoint directory."),
          seq_len: int = typer.Option(256, help="Sequence length for the shapes."),
          markdown: bool = typer.Option(False, help="Print a markdown table (as in captures/sites-*.md)."),
          json_out: bool = typer.Option(False, "--json")) -> None:
    """Every site of the forward with op, family, reference op, shape and dtype (generated from the flow)."""
    from ..config import preset as make_preset
    from ..runner import site_table
    cfg = make_preset(preset) if preset else api.open_model(checkpoint).config
    table = site_table(cfg, seq_len)
    if json_out:
        print_json(table)
        return
    if markdown:
        print(f"# Sites of the `{cfg.name}` model at {seq_len} tokens\n\n"
              f"Generated by `dsv4debug sites --preset {cfg.name} --seq-len {seq_len} --markdown`.\n")
        print("| site | op | family | shape | dtype | reference op | kernel |\n|---|---|---|---|---|---|---|")
        for r in table:
            print(f"| `{r['site']}` | {r['op']} | {r['family']} | {r['shape']} | {r['dtype']} | "
                  f"`{r['reference']}` | {r['kernel']} |")
        return
    t = Table(title=f"{len(table)} sites of {cfg.name} at {seq_len} tokens")
    for col in ("site", "op", "family", "shape", "dtype", "reference op", "kernel"):
        t.add_column(col)
    for row in table:
        t.add_row(row["site"], row["op"], row["family"], str(row["shape"]), row["dtype"], row["reference"],
                  row["kernel"])
    out.print(t)


def doctor(json_out: bool = typer.Option(False, "--json")) -> None:
    """The environment: Python, torch, CUDA GPU, CuTeDSL."""
    import platform

    import torch
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "sm": f"sm_{p.major}{p.minor}", "gpu_memory_gib": round(p.total_memory / 2**30, 1)}
    from importlib.metadata import PackageNotFoundError, version
    try:
        info["cutedsl"] = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        info["cutedsl"] = "not installed"
    from ..backends.registry import available
    info["backends"] = available()
    if json_out:
        print_json(info)
        return
    t = Table(title="dsv4debug doctor")
    t.add_column("item")
    t.add_column("value")
    for k, v in info.items():
        t.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
    out.print(t)


def repro(capture: Path = typer.Argument(..., help="A capture written by `dsv4debug run --capture`."),
          site: str = typer.Option(..., help="The site to reproduce, e.g. layers.3.ffn.experts.5."),
          out_dir: Path = typer.Argument(..., help="Directory for the reproducer."),
          checkpoint: Path | None = typer.Option(None, help="Checkpoint (default: the one the capture names)."),
          device: str = typer.Option("cpu", help="cpu | cuda."),
          force: bool = typer.Option(False, help="Overwrite a non-empty OUT_DIR.")) -> None:
    """Write one op's inputs, weights and config, with the command that replays it alone."""
    import torch

    from ..capture import CaptureReader
    from ..faults import parse_fault
    from ..repro import make_repro
    meta = CaptureReader(capture).meta
    opts = meta.get("options") or {}
    if not isinstance(opts, dict) or "candidate" not in opts:
        raise BadInput(f"{capture}: no run options recorded (was it written by `dsv4debug run`?)")
    model = api.open_model(checkpoint or Path(meta["checkpoint"]["path"]))
    ids = torch.tensor(meta["token_ids"], dtype=torch.long)
    target = make_repro(model, ids, site, out_dir, opts["candidate"], [parse_fault(f) for f in opts["faults"]],
                        qat=opts.get("qat", True), device=device, force=force)
    out.print(json.loads((target / "repro.json").read_text())["command"], highlight=False, soft_wrap=True)


def repro_run(repro_dir: Path = typer.Argument(..., help="A directory written by `dsv4debug repro`."),
              candidate: str | None = typer.Option(None, help="Candidate backend (default: the recorded one)."),
              inject: list[str] = typer.Option([], help="Activation faults to replay (KIND@SITE[:ARG])."),
              device: str = typer.Option("cpu", help="cpu | cuda."),
              clean_weights: bool = typer.Option(False, help="Give the candidate the clean weights, not the "
                                                 "ones the recorded candidate read (weight faults)."),
              json_out: bool = typer.Option(False, "--json")) -> None:
    """Replay one op with the reference and the candidate and compare them."""
    from ..repro import replay
    r = replay(repro_dir, candidate, inject, device, clean_weights=clean_weights)
    if json_out:
        print_json(r)
    else:
        m = r["metrics"]
        mark = "[red]DIVERGES[/]" if r["diverged"] else "[green]within floor[/]"
        out.print(f"{r['site']} ({r['op']}): {r['candidate']} vs reference: rel_l2 {_fmt(m.get('rel_l2'))}, "
                  f"cosine {_fmt(m.get('cosine'))}, max_abs {_fmt(m.get('max_abs'))}, floor {_fmt(r['floor'])}, "
                  f"{_fmt(r['x_floor'])}x floor {mark}", highlight=False)
    raise typer.Exit(1 if r["diverged"] else 0)


def register(app: typer.Typer) -> None:
    app.command()(run)
    app.command()(bisect)
    app.command()(sites)
    app.command()(doctor)
    app.command()(repro)
    app.command("repro-run")(repro_run)
