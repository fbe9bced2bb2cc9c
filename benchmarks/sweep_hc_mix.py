"""hc_mix pipeline depth and K split at Pro shapes on a GPU: time, bandwidth, and that every configuration gives
the same bits as the default at the same K split (stages change only the buffering).

    python3 benchmarks/sweep_hc_mix.py --out DIR [--tokens 4096]

Prints a table and writes DIR/hc_mix_sweep.json (copy it to benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    import torch
    from dsv4_kernels import mhc
    from dsv4_kernels._common import sm_count
    from dsv4_kernels.check import copy_bandwidth, environment, same_bytes_copy, time_fn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    S, M, D = args.tokens, 4, 7168
    xs = [torch.randn(S, M, D, device="cuda").bfloat16() for _ in range(2)]
    copy = copy_bandwidth()
    auto = mhc.mix_parts(S, M * D, sm_count(xs[0].device))
    rows = []
    for nmix in (24, 4):
        fn = torch.randn(nmix, M * D, device="cuda") * 1e-2
        nbytes = xs[0].numel() * 2 + fn.numel() * 4 + S * nmix * 4
        same = same_bytes_copy(nbytes, 2, xs[0].device)
        for stages in (2, 3, 4, 5):
            for parts in sorted({auto, 4, 8, 16}):
                want = mhc.hc_mixes(xs[0], fn, 1e-6, parts=parts)
                got = mhc.hc_mixes(xs[0], fn, 1e-6, parts=parts, stages=stages)
                t = time_fn(lambda i, w=fn, p=parts, st=stages: mhc.hc_mixes(xs[i], w, 1e-6, parts=p, stages=st), 2)
                row = {"nmix": nmix, "stages": stages, "parts": parts, "auto": parts == auto,
                       "us": t["us"], "mode": t["mode"], "GBps": nbytes / t["us"] / 1e3,
                       "of_copy": nbytes / t["us"] / 1e3 / copy["GBps"], "of_same_size_copy": same["us"] / t["us"],
                       "bit_identical_to_4_stages": bool(torch.equal(got, want))}
                rows.append(row)
                print(f"nmix {nmix:2d} stages {stages} parts {parts:2d}{'*' if row['auto'] else ' '} "
                      f"{t['us']:7.1f} us {row['GBps']:6.0f} GB/s {100 * row['of_copy']:4.0f}% copy "
                      f"{100 * row['of_same_size_copy']:4.0f}% same-size  identical={row['bit_identical_to_4_stages']}",
                      flush=True)
    doc = {"env": environment(), "shape": [S, M, D], "copy_bandwidth": copy, "rows": rows}
    (args.out / "hc_mix_sweep.json").write_text(json.dumps(doc, indent=1))
    return 0 if all(r["bit_identical_to_4_stages"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
