"""`dsv4debug checkpoint make|info|verify`: thin wrappers over dsv4debug.checkpoint."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ..checkpoint import Checkpoint, make_checkpoint
from ..config import preset
from ..errors import BadInput
from . import print_json

app = typer.Typer(no_args_is_help=True, add_completion=False)
console = Console()
err_console = Console(stderr=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout.")]


@contextmanager
def _progress():
    """A byte progress bar on stderr (stdout stays clean for --json)."""
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as progress:
        yield progress


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c)
    for row in rows:
        table.add_row(*(str(v) for v in row))
    return table


@app.command()
def make(
    out: Annotated[Path, typer.Argument(help="Directory to create (must not exist or be empty).")],
    preset_name: Annotated[str, typer.Option("--preset", help="tiny | flash | pro")] = "tiny",
    layers: Annotated[int | None, typer.Option(help="Keep only the first N main layers.")] = None,
    experts: Annotated[int | None, typer.Option(help="Routed experts per layer.")] = None,
    experts_format: Annotated[str, typer.Option("--experts-format", help="mxfp4 | nvfp4 | fp8")] = "mxfp4",
    seed: Annotated[int, typer.Option(help="Values depend on (seed, tensor name) only.")] = 0,
    force: Annotated[bool, typer.Option(help="Replace an existing checkpoint at OUT.")] = False,
    device: Annotated[str, typer.Option(help="Generate on this torch device (same bits everywhere).")] = "cpu",
) -> None:
    """Write a synthetic checkpoint in the real formats, names and shard layout."""
    cfg = preset(preset_name, layers, experts)
    t0 = time.perf_counter()
    with _progress() as progress:
        make_checkpoint(out, cfg, seed=seed, experts_format=experts_format, force=force, progress=progress,
                        device=device)
    ident = Checkpoint.open(out).identity
    console.print(f"wrote {out}: {cfg.name} preset, {cfg.n_layers} layers + {cfg.n_mtp_layers} MTP, "
                  f"{cfg.n_routed_experts} experts ({ident['expert_format']}), {ident['n_files']} shards, "
                  f"{ident['n_tensors']} tensors, {_size(ident['total_bytes'])} in {time.perf_counter() - t0:.1f} s")


@app.command()
def info(directory: Annotated[Path, typer.Argument(help="Checkpoint directory or .safetensors file.")],
         json_out: JsonFlag = False) -> None:
    """Config summary, layer types and routing per layer, formats and sizes."""
    report = Checkpoint.open(directory).info()
    if json_out:
        print_json(report)
        return
    ident, cfg = report["identity"], report["config"]
    console.print(_table("checkpoint", ["key", "value"], [
        ["path", ident["path"]], ["format", ident["format"]], ["files", ident["n_files"]],
        ["tensors", ident["n_tensors"]], ["size", _size(ident["total_bytes"])],
        [f"sha256 ({ident['sha256_of']})", ident["sha256"][:16] + "..."]]))
    console.print(_table("config", ["key", "value"], [[k, v] for k, v in cfg.items()]))
    console.print(_table("layers", ["layer", "module prefix", "attention", "ratio", "routing", "experts", "size"], [
        [r["layer"], r["prefix"], r["type"], r["compress_ratio"], r["routing"], r["experts"], _size(r["bytes"])]
        for r in report["layers"]]))
    console.print(_table("module formats", ["format", "modules", "tensors", "size"], [
        [f, r["modules"], r["tensors"], _size(r["bytes"])] for f, r in report["formats"].items()]))
    console.print(_table("dtypes", ["dtype", "tensors", "size"], [
        [d, r["tensors"], _size(r["bytes"])] for d, r in report["dtypes"].items()]))
    for w in report["warnings"]:
        err_console.print(f"[yellow]warning:[/] {w}", highlight=False)


@app.command()
def verify(directory: Annotated[Path, typer.Argument(help="Checkpoint directory or .safetensors file.")],
           json_out: JsonFlag = False) -> None:
    """Read every tensor: packing, scales (e8m0 NaN, e4m3 NaN, NVFP4 global scales), NaN/Inf, routing tables."""
    try:
        ckpt = Checkpoint.open(directory)
        with _progress() as progress:
            report = ckpt.verify(progress=progress)
    except BadInput as e:
        if json_out:
            print_json({"ok": False, "path": str(directory), "error": str(e)})
        raise
    if json_out:
        print_json(report)
        return
    for w in report["warnings"]:
        err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
    console.print(f"[green]ok[/]: {report['modules']} modules, {report['tensors']} tensors, "
                  f"{_size(report['bytes_read'])} checked in {report['seconds']:.1f} s")
