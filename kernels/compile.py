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


# ELF .nv.info attributes of a cubin (cuobjdump's EIATTR_*) that say what a kernel needs of an SM
_EIATTR_FRAME_SIZE, _EIATTR_REQNTID, _EIATTR_REGCOUNT = 0x11, 0x10, 0x2f
_SM_REGISTERS = 65536                 # per SM on sm_90 and sm_100, allocated to warps in units of 8 a thread


def cubin_resources(cubin: bytes) -> dict:
    """What ptxas gave a compiled kernel, read from its cubin (no GPU, no cuobjdump): registers a thread,
    local memory a thread (frame bytes: spills and local arrays), the threads a CTA it was built for, and the
    CTAs an SM can hold by registers. With several kernels in one cubin, the largest of each."""
    import struct
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3a)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx][4]
    regs = frame = threads = 0
    for sh_name, *_, offset, size, _link, _info, _align, _entsize in sections:
        name = cubin[strtab + sh_name:cubin.index(b"\0", strtab + sh_name)]
        if not name.startswith(b".nv.info"):
            continue
        info, i = cubin[offset:offset + size], 0
        while i + 4 <= len(info):
            fmt, attr = info[i], info[i + 1]
            if fmt != 4:                                  # no payload past the 4-byte header
                i += 4
                continue
            n, = struct.unpack_from("<H", info, i + 2)
            words = struct.unpack_from(f"<{n // 4}I", info, i + 4)
            if attr == _EIATTR_REGCOUNT:                  # (function, registers)
                regs = max(regs, words[1])
            elif attr == _EIATTR_FRAME_SIZE:              # (function, bytes)
                frame = max(frame, words[1])
            elif attr == _EIATTR_REQNTID:                 # (x, y, z)
                threads = max(threads, words[0] * words[1] * words[2])
            i += 4 + n
    per_cta = -(-regs // 8) * 8 * threads
    return {"registers": regs, "local_bytes": frame, "threads": threads or None,
            "ctas_per_sm_by_registers": _SM_REGISTERS // per_cta if per_cta else None}


def compile_in_child(name: str, cfg: dict, arch: str, ptx_dir: Path | None = None, resources: bool = False,
                     lint: bool = False) -> dict:
    """compile_one in a child process that keeps what ptxas made (CuTeDSL reads CUTE_DSL_KEEP once, at import).
    ptx_dir: the PTX moved to ptx_dir/<kernel>[-<config>].<arch>.ptx, so that two trees' directories, compared
    with `diff -r`, show whether a change alters any kernel. resources: the row gets cubin_resources. lint: the
    row gets `lint`, ptx_lint's findings (warp collectives under lane-dependent branches) as strings."""
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=dump)
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
        ptx = [p.read_text() for p in sorted(Path(dump).glob("*.ptx"))] if row["ok"] else []
        if row["ok"] and lint:
            from .ptx_lint import lint_ptx
            row["lint"] = [str(f) for text in ptx for f in lint_ptx(text)]
        if row["ok"] and ptx_dir is not None:
            stem = name + (f"-{config_str(cfg)}" if cfg else "")
            (ptx_dir / f"{stem}.{arch}.ptx").write_text("".join(ptx))
        if row["ok"] and resources:
            cubins = [cubin_resources(p.read_bytes()) for p in sorted(Path(dump).glob("*.cubin"))]
            row.update({k: max((c[k] for c in cubins if c[k] is not None), default=None) for k in
                        ("registers", "local_bytes", "threads")},
                       ctas_per_sm_by_registers=min((c["ctas_per_sm_by_registers"] for c in cubins
                                                     if c["ctas_per_sm_by_registers"]), default=None))
    return row


def compile_all(archs=ARCHS, subset: str = "all", kernels=None,
                progress: Callable[[int, int, dict], None] | None = None, ptx_dir: Path | None = None,
                resources: bool = False, lint: bool = False) -> list[dict]:
    """Every planned (kernel, config, arch), in process; with ptx_dir (its PTX kept there), resources (its
    registers and local memory) or lint (its PTX linted), each in a child process (compile_in_child)."""
    todo = plan(archs, subset, kernels)
    rows = []
    for i, (name, cfg, arch) in enumerate(todo):
        rows.append(compile_in_child(name, cfg, arch, ptx_dir, resources, lint) if ptx_dir or resources or lint
                    else compile_one(name, cfg, arch))
        if progress:
            progress(i + 1, len(todo), rows[-1])
    return rows
