"""Checkpoint I/O benchmark on the CPU: synthetic `make`, a full dequantising read, and verify.

Targets (tiny preset, 2 cores): `dsv4debug checkpoint make --preset tiny` <= 5 s end to end, reading every module
dequantised <= 2 s. Baselines measured in the same run: torch.randn of as many elements plus a raw write of
as many bytes (for make), the CLI's bare startup (for the end-to-end make), the official `safetensors` package
reading every tensor raw (for read).
Each timing is the best of --repeat runs, for each torch thread count in --threads. The load average is
recorded because on a shared machine other processes inflate multi-threaded timings badly.

    python benchmarks/bench_checkpoint.py [--preset tiny] [--threads 2 1] [--out benchmarks/results/checkpoint.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from dsv4debug.checkpoint import Checkpoint, make_checkpoint
from dsv4debug.config import preset
from dsv4debug.schema import all_modules

TARGETS = {"cli_make_s": 5.0, "read_dequantize_s": 2.0}


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_all(path: Path) -> None:
    ckpt = Checkpoint.open(path)
    for name in ckpt.specs:
        ckpt.module(name).dequantize()


def read_raw_safetensors(path: Path) -> None:
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():                   # noqa: SIM118 (safe_open has no __iter__)
                f.get_tensor(name)


def make_baseline(path: Path, n_elements: int, n_bytes: int) -> None:
    torch.randn(n_elements)
    with open(path, "wb") as f:
        f.write(bytes(n_bytes))


def timed_python(code: str, *args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True)
    return time.perf_counter() - t0


def cli_make(out: Path, preset_name: str) -> float:
    return timed_python("from dsv4debug.cli import main; main()", "checkpoint", "make", str(out),
                        "--preset", preset_name, "--force")


def cli_startup() -> float:
    """What every CLI call pays before any work: Python, torch and every command module imported."""
    return timed_python("from dsv4debug.cli import _register; _register()")


def measure(tmp: Path, preset_name: str, repeat: int) -> dict[str, float]:
    cfg = preset(preset_name)
    out = tmp / "ckpt"
    make_s = best(lambda: make_checkpoint(out, cfg, force=True), repeat)
    n_elements = sum(math.prod(m.shape) for m in all_modules(cfg))
    n_bytes = sum(e.nbytes for e in Checkpoint.open(out).entries.values())
    return {
        "make_s": make_s,
        "make_baseline_s": best(lambda: make_baseline(tmp / "raw.bin", n_elements, n_bytes), repeat),
        "read_dequantize_s": best(lambda: read_all(out), repeat),
        "read_raw_safetensors_s": best(lambda: read_raw_safetensors(out), repeat),
        "verify_s": best(lambda: Checkpoint.open(out).verify(), repeat),
        "cli_make_s": min(cli_make(tmp / "cli", preset_name) for _ in range(repeat)),
        "cli_startup_s": min(cli_startup() for _ in range(repeat)),
        "elements": n_elements, "bytes": n_bytes,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    args = p.parse_args()
    results: dict = {"preset": args.preset, "host": platform.node(), "cpus": os.cpu_count(),
                     "torch": torch.__version__, "targets": TARGETS, "load_avg_before": os.getloadavg()[0],
                     "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads:
            torch.set_num_threads(threads)
            env_threads = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = str(threads)             # for the CLI subprocess
            results["runs"][str(threads)] = measure(Path(tmp), args.preset, args.repeat)
            if env_threads is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
    results["load_avg_after"] = os.getloadavg()[0]
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def print_table(r: dict) -> None:
    rows = [("make_s", "make_checkpoint (in process)"), ("make_baseline_s", "  baseline: randn + raw write"),
            ("cli_make_s", "dsv4debug checkpoint make (end to end)"),
            ("cli_startup_s", "  of which CLI startup (imports)"),
            ("read_dequantize_s", "open + dequantise every module"),
            ("read_raw_safetensors_s", "  baseline: safetensors, every tensor raw"),
            ("verify_s", "verify (read + check every tensor)")]
    any_run = next(iter(r["runs"].values()))
    print(f"preset {r['preset']}: {any_run['elements'] / 1e6:.1f} M elements, {any_run['bytes'] / 2**20:.1f} MiB; "
          f"{r['cpus']} CPUs, load average {r['load_avg_before']:.2f} -> {r['load_avg_after']:.2f}")
    threads = list(r["runs"])
    print(f"{'measurement':44s}" + "".join(f"{t + ' thr':>10s}" for t in threads) + "    target")
    for key, label in rows:
        target = f"<= {TARGETS[key]:.0f} s" if key in TARGETS else ""
        print(f"{label:44s}" + "".join(f"{r['runs'][t][key]:9.2f}s" for t in threads) + f"    {target}")


if __name__ == "__main__":
    main()
