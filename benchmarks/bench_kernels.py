"""One GPU session for the CuTeDSL kernels: compile on the device, check at tiny/Pro/Flash shapes, benchmark.

Writes one JSON per step under --out (so a run cut short keeps what finished) and prints the tables.
Every step runs under a deadline: steps that would start after it are recorded as skipped, not run.

    python3 benchmarks/bench_kernels.py --out DIR [--deadline 540] [--steps tiny,pro,flash]

On the project's H200 sessions (see /work/shared/gpu/README.md): stage the CuTeDSL bundle, then
    . /tmp/site/env.sh; mkdir -p /tmp/pp; ln -sfn $PWD/kernels /tmp/pp/dsv4_kernels;
    ln -sfn $PWD/references /tmp/pp/dsv4_references; PYTHONPATH=/tmp/pp:$PWD:$PYTHONPATH python3 ...
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds after which no step starts")
    ap.add_argument("--steps", default="compile,tiny,pro,flash")
    ap.add_argument("--pro-compile-baselines", action="store_true", default=True)
    ap.add_argument("--flash-compile-baselines", action="store_true", default=False)
    ap.add_argument("--families", default="norm,rope,nvfp4,kv_cache,mhc", help="check families (gemm: issue 7)")
    ap.add_argument("--pytest", action="store_true", help="also run tests/test_kernels_gpu.py")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    steps = args.steps.split(",")
    families = tuple(args.families.split(","))
    import torch
    log(f"torch {torch.__version__}, cuda {torch.version.cuda}, gpu {torch.cuda.get_device_name(0)}")
    import cutlass  # noqa: F401
    log("cutlass imported")
    from dsv4_kernels.check import environment, print_rows, run_checks
    summary = {"env": environment(), "steps": {}}
    failed = False

    def save():
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

    def step(name: str, est: float, fn) -> None:
        nonlocal failed
        left = args.deadline - (time.perf_counter() - T0)
        if name not in steps:
            return
        if left < est:
            summary["steps"][name] = {"skipped": f"deadline: {left:.0f}s left, step needs ~{est:.0f}s"}
            log(f"skip {name}: {left:.0f}s left")
            save()
            return
        log(f"step {name}")
        t = time.perf_counter()
        try:
            doc = fn()
            ok = doc.get("passed", doc.get("ok", True))
            failed |= not ok
            summary["steps"][name] = {"seconds": round(time.perf_counter() - t, 1), "ok": ok}
            (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str))
        except Exception:                           # noqa: BLE001 - recorded, the next step still runs
            failed = True
            summary["steps"][name] = {"error": traceback.format_exc(limit=8)}
            log(traceback.format_exc(limit=8))
        save()

    def compile_step():
        from dsv4_kernels import load_all
        from dsv4_kernels.compile import compile_all
        mine = [k for k, kd in load_all().items() if kd.family in ("norm", "rope", "kv_cache", "mhc")
                or k.startswith("nvfp4_")]
        rows = compile_all(["sm_90a"], kernels=mine)
        for r in rows:
            if not r["ok"]:
                log(f"compile FAILED {r['kernel']} {r['config']}: {r['error']}")
        log(f"compiled {len(rows)} kernel configs for sm_90a in {sum(r['seconds'] for r in rows):.1f}s")
        return {"ok": all(r["ok"] for r in rows), "rows": rows}

    def checks(preset, bench, compile_baselines, seq=None):
        def run():
            doc = run_checks(preset, seq, bench, compile_baselines, log=log, families=families)
            print_rows(doc, log)
            return doc
        return run

    step("compile", 60, compile_step)
    step("tiny", 30, checks("tiny", False, False))
    step("pro", 60, checks("pro", True, args.pro_compile_baselines))
    step("flash", 60, checks("flash", True, args.flash_compile_baselines))
    def pytest_step():
        import subprocess
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                            "tests/test_kernels_gpu.py"], capture_output=True, text=True, timeout=240, check=False)
        (args.out / "pytest_gpu.txt").write_text(r.stdout + r.stderr)
        for line in (r.stdout + r.stderr).splitlines()[-25:]:
            log(line)
        return {"ok": r.returncode == 0, "returncode": r.returncode}

    if args.pytest:
        steps.append("pytest")
    step("pytest", 60, pytest_step)
    log(f"done: {'FAILED' if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
