"""`dsv4debug kernels compile|check`: CuTeDSL compile table (no GPU needed) and the GPU correctness + speed table."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ..errors import BadInput
from . import finite_json

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="CuTeDSL kernels: compile for sm_90a/sm_100a without a GPU; check and time them on one.")
out = Console()
err = Console(stderr=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document instead of tables")]


def _need_cutedsl() -> None:
    try:
        import cutlass  # noqa: F401
    except ImportError as e:
        raise BadInput(f"CuTeDSL is not installed (pip install 'dsv4debug[gpu]', nvidia-cutlass-dsl 4.8.1): {e}") \
            from None


def compile_cmd(arch: Annotated[str, typer.Option(help="comma-separated targets")] = "sm_90a,sm_100a",
                subset: Annotated[str, typer.Option(help="all: every declared configuration; ci: one or two "
                                                    "representative configurations per kernel")] = "all",
                kernel: Annotated[list[str] | None, typer.Option(help="only these kernels (repeatable)")] = None,
                ptx: Annotated[Path | None, typer.Option(
                    help="also write each config's PTX into this new (or empty) directory, one compile process "
                         "per config: `diff -r` two trees' directories to see whether a change alters a kernel")]
                = None,
                resources: Annotated[bool, typer.Option(
                    "--resources", help="also read each compiled kernel's registers a thread, local memory (spills) "
                                        "and CTAs an SM holds by registers from its cubin, one compile process "
                                        "per config")] = False,
                lint: Annotated[bool, typer.Option(
                    "--lint", help="also lint each config's PTX for warp collectives (full-mask shfl.sync, "
                                   "mma.sync, bar.sync, ...) under a lane-dependent branch, which hang or "
                                   "misbehave on the GPU; one compile process per config")] = False,
                as_json: JsonOpt = False) -> None:
    """Compile every kernel for each target arch on this machine (no GPU: CUTE_DSL_ARCH-style targets, fake
    tensors). Exit 1 when any compile fails or, with --lint, any PTX has a finding."""
    _need_cutedsl()
    from dsv4_kernels import load_all
    from dsv4_kernels._common import ARCHS
    from dsv4_kernels.compile import compile_all
    archs = [a.strip() for a in arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise BadInput(f"--arch {','.join(bad)}: kernels are declared for {', '.join(ARCHS)} only")
    if subset not in ("all", "ci"):
        raise BadInput("--subset must be 'all' or 'ci'")
    reg = load_all()
    unknown = [k for k in (kernel or []) if k not in reg]
    if unknown:
        raise BadInput(f"unknown kernel(s) {', '.join(unknown)}; known: {', '.join(reg)}")
    if ptx is not None:
        if ptx.exists() and (not ptx.is_dir() or any(ptx.iterdir())):
            raise BadInput(f"--ptx {ptx}: not an empty directory (PTX files are never overwritten)")
        ptx.mkdir(parents=True, exist_ok=True)

    def progress(i: int, n: int, row: dict) -> None:
        if not as_json:
            err.print(f"[{i}/{n}] {row['kernel']} {row['arch']} {row['config']}: "
                      f"{'ok' if row['ok'] else 'FAILED'} {row['seconds']:.2f}s", highlight=False)

    import time
    t0 = time.perf_counter()
    rows = compile_all(archs, subset, kernel, progress, ptx, resources, lint)
    total = time.perf_counter() - t0
    ok = all(r["ok"] and not r.get("lint") for r in rows)
    if as_json:
        print(json.dumps({"archs": archs, "subset": subset, "total_seconds": round(total, 2), "ok": ok,
                          "rows": [{k: v for k, v in r.items() if k != "traceback"} for r in rows]}, indent=1))
    else:
        t = Table(title=f"CuTeDSL compile ({len(rows)} kernels x configs x archs, {total:.1f} s)")
        usage = ("registers", "local_bytes", "threads", "ctas_per_sm_by_registers") if resources else ()
        usage += ("lint",) if lint else ()
        for col in ("kernel", "family", "arch", "config", "seconds", *usage, "ok"):
            t.add_column({"registers": "regs", "local_bytes": "local B", "ctas_per_sm_by_registers": "CTAs/SM",
                          "seconds": "s"}.get(col, col), no_wrap=col in ("kernel", "config"))
        for r in rows:
            t.add_row(r["kernel"], r["family"], r["arch"], r["config"] or "-", f"{r['seconds']:.2f}",
                      *(_fmt(len(r["lint"]) if c == "lint" and "lint" in r else r.get(c)) for c in usage),
                      "[green]ok[/]" if r["ok"] else f"[red]FAILED[/] {r['error']}")
        out.print(t)
        for r in rows:
            if not r["ok"]:
                err.print(f"{r['kernel']} {r['arch']} {r['config']}:\n{r.get('traceback', '')}", highlight=False)
            for finding in r.get("lint") or ():
                err.print(f"lint: {r['kernel']} {r['arch']} {r['config']}: {finding}", highlight=False)
    raise typer.Exit(0 if ok else 1)


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def check_cmd(shapes: Annotated[str, typer.Option(help="pro | flash | tiny (model presets)")] = "pro",
              seq: Annotated[int | None, typer.Option(help="tokens (default: 4096 for pro/flash, 256 tiny)")]
              = None,
              bench: Annotated[bool, typer.Option("--bench", help="time kernels against torch in the same run")]
              = False,
              compile_baselines: Annotated[bool, typer.Option(help="include torch.compile baselines with --bench")]
              = True,
              output: Annotated[Path | None, typer.Option("--output", "-o", help="also write the JSON here")]
              = None,
              family: Annotated[list[str] | None, typer.Option(help="only these families (repeatable): norm, rope, "
                                                              "nvfp4, kv_cache, mhc, gemm")] = None,
              as_json: JsonOpt = False) -> None:
    """Every kernel against its references/ op at real shapes on this machine's GPU (exit 1 if any fails)."""
    import torch
    if shapes not in ("pro", "flash", "tiny"):
        raise BadInput(f"--shapes {shapes!r}: choose pro, flash or tiny")
    if seq is not None and seq < 1:
        raise BadInput("--seq must be >= 1")
    if not torch.cuda.is_available():
        raise BadInput("kernels check needs a CUDA GPU and this machine has none; nothing was checked "
                       "(`dsv4debug kernels compile` checks compilation without a GPU)")
    _need_cutedsl()
    from dsv4_kernels._common import ARCHS, gpu_name, kernel_arch
    from dsv4_kernels.check import Checker, run_checks
    if kernel_arch(torch.cuda.current_device()) is None:
        raise BadInput(f"the kernels are built for {', '.join(ARCHS)}; this GPU is "
                       f"{gpu_name(torch.cuda.current_device())}: nothing was checked")
    bad = [f for f in family or [] if f not in Checker.FAMILIES]
    if bad:
        raise BadInput(f"--family {', '.join(bad)}: choose from {', '.join(Checker.FAMILIES)}")
    log = (lambda s: err.print(s, highlight=False)) if not as_json else (lambda s: print(s, file=sys.stderr))
    doc = run_checks(shapes, seq, bench, compile_baselines, log=log, families=tuple(family or ()) or None)
    doc = finite_json(doc)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(doc, indent=1))
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        print_table(doc)
    raise typer.Exit(0 if doc["passed"] else 1)


_RESULT_COLOURS = {"skip": "yellow", "pass": "green", "FAIL": "red"}


def print_table(doc: dict) -> None:
    from dsv4_kernels.check import result_label
    env = doc["env"]
    t = Table(title=f"kernels check: {doc['preset']} shapes, {doc['seq']} tokens, {env.get('gpu', '?')}, "
                    f"torch {env['torch']}, CuTeDSL {env['cutedsl']}")
    cols = ["op", "case", "shape", "cos", "max err", "ulp", "NaN", "bar", "result"]
    if doc["bench"]:
        cols += ["kernel us", "torch best us", "speedup", "GB/s", "% copy", "% same-size copy"]
    for c in cols:
        t.add_column(c)
    for r in doc["rows"]:
        result = result_label(r)
        cells = [r["op"], r["case"], r["shape"], _fmt(r["cos"], ".7f"), _fmt(r["max_err"]), _fmt(r["max_ulp"]),
                 str(r["nan"]), r.get("not_run") or r["bar"] + (f" ({r['note']})" if r["note"] else ""),
                 f"[{_RESULT_COLOURS[result]}]{result}[/]"]
        if doc["bench"]:
            b = r.get("bench") or {}
            k = b.get("kernel", {})
            cells += [_fmt(k.get("us"), ".1f"),
                      (_fmt(b.get("torch_best_us"), ".1f") + f" ({b['torch_best']})") if b.get("torch_best") else "-",
                      _fmt(b.get("speedup"), ".2f"), _fmt(b.get("GBps"), ".0f"),
                      _fmt(100 * b["of_copy"], ".0f") if b.get("of_copy") else "-",
                      _fmt(100 * b["of_copy_same_bytes"], ".0f") if b.get("of_copy_same_bytes") else "-"]
        t.add_row(*cells)
    out.print(t)
    if doc.get("copy_bandwidth"):
        out.print(f"device copy bandwidth (read + write): {doc['copy_bandwidth']['GBps']:.0f} GB/s (% copy); "
                  "% same-size copy: a copy_ of the kernel's own bytes, timed alike, over the kernel's time")


def register(app_root: typer.Typer) -> None:
    app.command("compile", help="Compile every kernel for sm_90a / sm_100a on this machine (no GPU needed); "
                "table of kernel, arch, config, seconds, ok. Exit 1 on any failure.")(compile_cmd)
    app.command("check", help="GPU: each kernel against its references/ op at real shapes (cosine, max error, "
                "NaN, bar, pass/fail); --bench times them against torch. Exit 1 on a failure, 2 without a GPU."
                )(check_cmd)
    app_root.add_typer(app, name="kernels", help="CuTeDSL kernels: compile (no GPU) and check (GPU).")

