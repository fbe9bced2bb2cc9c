"""Compile every kernel for its target archs without a GPU (`dsv4debug kernels compile`, the CPU CI test).

Compilation needs no device: the launchers are traced with fake pointers and a fake stream and compiled for
the requested arch with `cute.compile[cute.GPUArch(arch)]` (PTX + ptxas cubin). Each (kernel, config, arch)
is compiled in a fresh cache so the times are real compile times.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from . import load_all
from ._common import ARCHS, compile_kernel, config_key, config_str


def plan(archs=ARCHS, subset: str = "all", kernels=None) -> list[tuple[str, dict, str]]:
    """(kernel, config, arch) triples: every declared arch in `archs`; subset "all" or "ci" configs."""
    reg = load_all()
    out = []
    for name, kd in reg.items():
        if kernels and name not in kernels:
            continue
        configs = kd.configs if subset == "all" else kd.ci()
        for arch in archs:
            if arch not in kd.archs:
                continue
            for cfg in configs:
                out.append((name, cfg, arch))
    return out


def compile_one(name: str, cfg: dict, arch: str) -> dict:
    from . import _common
    reg = load_all()
    key = (name, config_key(cfg), arch)
    _common._CACHE.pop(key, None)
    t0 = time.perf_counter()
    row = {"kernel": name, "family": reg[name].family, "arch": arch, "config": config_str(cfg)}
    try:
        compile_kernel(name, arch, **cfg)
        row.update(ok=True, error=None)
    except Exception as e:                      # noqa: BLE001 - reported per row
        msg = str(e).strip().splitlines()
        row.update(ok=False, error=(msg[0] if msg else type(e).__name__)[:300],
                   traceback=traceback.format_exc(limit=4))
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def compile_with_ptx(name: str, cfg: dict, arch: str, out_dir: Path) -> dict:
    """compile_one in a child process that keeps the PTX (CuTeDSL reads CUTE_DSL_KEEP once, at import), moved to
    out_dir/<kernel>[-<config>].<arch>.ptx: two trees' directories, compared with `diff -r`, show whether a
    change alters any kernel."""
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=dump)
        code = ("import json, sys; from dsv4_kernels.compile import compile_one; "
                "print(json.dumps(compile_one(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])))")
        proc = subprocess.run([sys.executable, "-c", code, name, json.dumps(cfg), arch], env=env,
                              capture_output=True, text=True, check=False)
        try:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = {"kernel": name, "family": "", "arch": arch, "config": config_str(cfg), "ok": False,
                   "error": (proc.stderr.strip().splitlines() or ["the compile process died"])[-1][:300],
                   "seconds": 0.0}
        ptx = sorted(Path(dump).glob("*.ptx"))
        if row["ok"]:
            stem = name + (f"-{config_str(cfg)}" if cfg else "")
            (out_dir / f"{stem}.{arch}.ptx").write_text("".join(p.read_text() for p in ptx))
    return row


def compile_all(archs=ARCHS, subset: str = "all", kernels=None,
                progress: Callable[[int, int, dict], None] | None = None, ptx_dir: Path | None = None
                ) -> list[dict]:
    """Every planned (kernel, config, arch), in process; with ptx_dir, each in a child keeping its PTX there."""
    todo = plan(archs, subset, kernels)
    rows = []
    for i, (name, cfg, arch) in enumerate(todo):
        rows.append(compile_with_ptx(name, cfg, arch, ptx_dir) if ptx_dir else compile_one(name, cfg, arch))
        if progress:
            progress(i + 1, len(todo), rows[-1])
    return rows
