"""NVFP4 activation quantise with the global scale from x's own amax: the one-pass kernel (nvfp4_quant_onepass,
every CTA shape of ONEPASS_CONFIGS) against the two kernels (amax, then quantise given g), side by side in one
run, bit-compared, at sizes from one block to [8192, 7168]; the 1 GiB copy measured in the same run. Writes
OUT/nvfp4_onepass.json row by row.

Then the floor of any one-pass design at Pro's shape: no code can be computed before the global amax, so the
time is at least one DRAM read of x (the amax kernel, input sets rotated past the L2) plus the quantiser's
arithmetic over every block: the given-g kernel on L2-resident eighths and quarters of x (the same buffer each
call), the difference of the two times (free of the launch and ramp) scaled by 8.

    PYTHONPATH=.:/tmp/pp python3 benchmarks/bench_nvfp4_onepass.py --out /tmp/dsv4-results/nvfp4
"""
import argparse
import json
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="4x16,16x64,300x7168,2048x7168,4096x7168,8192x7168")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch
    from dsv4_kernels import nvfp4
    from dsv4_kernels.check import copy_bandwidth, environment, n_sets, time_fn
    t0 = time.perf_counter()
    env, copy = environment(), copy_bandwidth()
    rows = []
    print(f"copy {copy['GBps']:.0f} GB/s", flush=True)
    for spec in args.shapes.split(","):
        s, n = map(int, spec.split("x"))
        nbytes = quantise_bytes(s, n)
        k = n_sets(nbytes)
        gen = torch.Generator(device="cuda").manual_seed(s)
        xs = [(torch.randn(s, n, device="cuda", generator=gen) * 3).bfloat16() for _ in range(k)]
        two = nvfp4.quantize(xs[0], nvfp4.global_scale(nvfp4.amax(xs[0])))
        t2 = time_fn(lambda i, xs=xs: nvfp4.quantize(xs[i], nvfp4.global_scale(nvfp4.amax(xs[i]))), k)
        row = {"shape": [s, n], "bytes": nbytes, "sets": k, "mode": t2["mode"], "two_kernels_us": t2["us"],
               "two_kernels_of_copy": nbytes / t2["us"] / 1e3 / copy["GBps"], "one_pass": []}
        print(f"[{time.perf_counter() - t0:5.1f}s] {spec:>10s} two kernels {t2['us']:7.1f} us "
              f"({100 * row['two_kernels_of_copy']:3.0f}% copy)", flush=True)
        for cfg in nvfp4.ONEPASS_CONFIGS:
            one = nvfp4.quantize(xs[0], onepass=cfg)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(one, two))
            t1 = time_fn(lambda i, xs=xs, cfg=cfg: nvfp4.quantize(xs[i], onepass=cfg), k)
            of_copy = nbytes / t1["us"] / 1e3 / copy["GBps"]
            row["one_pass"].append({"config": cfg, "bit_identical": same, "us": t1["us"], "of_copy": of_copy,
                                    "speedup": t2["us"] / t1["us"]})
            print(f"[{time.perf_counter() - t0:5.1f}s] {'':>10s} one pass {cfg['threads']:4d}x{cfg['unroll']} "
                  f"{t1['us']:7.1f} us ({100 * of_copy:3.0f}% copy)  {t2['us'] / t1['us']:.2f}x  "
                  f"bits {'same' if same else 'DIFFER'}", flush=True)
        rows.append(row)
        write(args.out, env, copy, rows, None)
    floor = one_pass_floor(copy)
    print(f"[{time.perf_counter() - t0:5.1f}s] floor at 4096x7168: amax (DRAM read) {floor['amax_us']:.1f} us + "
          f"arithmetic (L2-resident, marginal) {floor['arithmetic_us']:.1f} us = {floor['floor_us']:.1f} us "
          f"({100 * floor['floor_of_copy']:.0f}% copy; the 80% bar needs {floor['bar_us']:.1f} us)", flush=True)
    write(args.out, env, copy, rows, floor)
    return 0


def quantise_bytes(rows: int, n: int) -> int:
    """x read once, codes and scales written."""
    return rows * n * 2 + rows * n // 2 + rows * n // 16


def one_pass_floor(copy, rows=4096, n=7168):
    import torch
    from dsv4_kernels import nvfp4
    from dsv4_kernels.check import n_sets, time_fn
    nbytes = quantise_bytes(rows, n)
    k = n_sets(rows * n * 2)
    gen = torch.Generator(device="cuda").manual_seed(7)
    xs = [(torch.randn(rows, n, device="cuda", generator=gen) * 3).bfloat16() for _ in range(k)]
    t_amax = time_fn(lambda i: nvfp4.amax(xs[i]), k)["us"]
    part = {}
    for frac in (8, 4):
        xp = xs[0][: rows // frac].contiguous()
        g = nvfp4.global_scale(nvfp4.amax(xp))
        part[frac] = time_fn(lambda i, xp=xp, g=g: nvfp4.quantize(xp, g), 1)["us"]
    arithmetic = 8 * (part[4] - part[8])
    floor = t_amax + arithmetic
    return {"shape": [rows, n], "amax_us": t_amax, "quantise_l2_eighth_us": part[8],
            "quantise_l2_quarter_us": part[4], "arithmetic_us": arithmetic, "floor_us": floor,
            "floor_of_copy": nbytes / floor / 1e3 / copy["GBps"],
            "bar_us": nbytes / (0.8 * copy["GBps"]) / 1e3}


def write(out, env, copy, rows, floor):
    (out / "nvfp4_onepass.json").write_text(json.dumps(
        {"env": env, "copy_bandwidth": copy, "rows": rows, "floor": floor}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
