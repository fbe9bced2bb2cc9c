"""In-place RoPE (the 64 rope dims of every 512-wide row) at Pro q shape on a GPU: rows a thread (unroll)
against two copies of the same bytes timed alike: contiguous, and with the kernel's strided pattern (128 of
every 1024 bytes). Checks each unroll gives the bits of the default.

    python3 benchmarks/sweep_rope_inplace.py --out DIR

Prints a table and writes DIR/rope_inplace_sweep.json (copy it to benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    import dsv4_references as ref
    import torch
    from dsv4_kernels import rope as R
    from dsv4_kernels.check import copy_bandwidth, environment, same_bytes_copy, time_fn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    S, H, d = 4096, 128, 512
    torch.manual_seed(0)
    freqs = ref.rope_freqs(S, 64, 10000.0, 0, 1.0).cuda()
    x0 = torch.randn(S, H, d, device="cuda").bfloat16()
    xs = [x0.clone() for _ in range(2)]             # rotated again at every timed call; x0 stays as made
    nbytes = 2 * S * H * 64 * 2 + S * 32 * 8
    copy = copy_bandwidth()
    same = same_bytes_copy(nbytes, 2, xs[0].device)
    ys = [torch.empty_like(x) for x in xs]
    strided = time_fn(lambda i: ys[i][..., d - 64:].copy_(xs[i][..., d - 64:]), 2)
    want = R.rope_(x0.clone(), freqs)
    rows = []
    for unroll in (1, 2, 4, 8):
        got = R.rope_(x0.clone(), freqs, unroll=unroll)
        t = time_fn(lambda i, u=unroll: R.rope_(xs[i], freqs, unroll=u), 2)
        row = {"unroll": unroll, "us": t["us"], "mode": t["mode"], "GBps": nbytes / t["us"] / 1e3,
               "of_copy": nbytes / t["us"] / 1e3 / copy["GBps"], "of_same_size_copy": same["us"] / t["us"],
               "of_strided_copy": strided["us"] / t["us"], "bit_identical": bool(torch.equal(got, want))}
        rows.append(row)
        print(f"unroll {unroll}: {t['us']:6.1f} us {row['GBps']:6.0f} GB/s {100 * row['of_copy']:4.0f}% copy "
              f"{100 * row['of_same_size_copy']:4.0f}% same-size {100 * row['of_strided_copy']:4.0f}% strided copy "
              f"identical={row['bit_identical']}", flush=True)
    print(f"same-size copy {same['us']:.1f} us, strided copy of the rope dims {strided['us']:.1f} us")
    doc = {"env": environment(), "shape": [S, H, d], "bytes": nbytes, "copy_bandwidth": copy,
           "same_size_copy": same, "strided_copy_us": strided["us"], "rows": rows}
    (args.out / "rope_inplace_sweep.json").write_text(json.dumps(doc, indent=1))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
