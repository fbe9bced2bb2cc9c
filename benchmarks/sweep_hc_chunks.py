"""hc_pre / hc_head in token chunks at Pro shapes on a GPU: does the apply kernel's second read of x come from L2
when it follows the mixes of the same chunk, and do the two kernels overlap when the chunks' applies run on a
second stream?

    python3 benchmarks/sweep_hc_chunks.py --out DIR [--tokens 4096]

Each variant is timed by CUDA-graph replay next to the unchunked two kernels, and its outputs are compared with
theirs (the mixes' K split depends on the chunk's token count, so bits may differ within fp32 summation order).
Prints a table and writes DIR/hc_chunks_sweep.json (copy it to benchmarks/results/).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    import torch
    from cutlass import Float32, Int32
    from dsv4_kernels import mhc
    from dsv4_kernels._common import compile_kernel, current_stream, device_arch, ptr
    from dsv4_kernels.check import copy_bandwidth, environment, time_fn
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--fused-only", action="store_true", help="only the two kernels and hc_fused's tunings")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    S, M, D = args.tokens, 4, 7168
    dev = torch.device("cuda")
    xs = [torch.randn(S, M, D, device=dev).bfloat16() for _ in range(2)]
    copy = copy_bandwidth()
    side = torch.cuda.Stream()
    rows = []

    def save():
        doc = {"env": environment(), "shape": [S, M, D], "copy_bandwidth": copy, "rows": rows}
        (args.out / "hc_chunks_sweep.json").write_text(json.dumps(doc, indent=1))

    def apply_into(x, mixes, scale, base, y, post, comb, head):
        s = x.size(0)
        f = compile_kernel("hc_pre_apply", device_arch(dev), D=D, M=M, iters=0 if head else 20, head=head)
        f(ptr(mixes, Float32, 4), ptr(scale, Float32, 4), ptr(base, Float32, 4), ptr(x), ptr(y),
          ptr(post, Float32, 4), ptr(comb, Float32, 4), Int32(s), Float32(1e-6), current_stream())

    def chunked(x, fn, scale, base, chunk, two_streams, head):
        y = torch.empty(S, D, dtype=torch.bfloat16, device=dev)
        post = torch.empty(S, M, dtype=torch.float32, device=dev)
        comb = torch.empty(S, M, M, dtype=torch.float32, device=dev)
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for c0 in range(0, S, chunk):
            sl = slice(c0, min(S, c0 + chunk))
            mixes = mhc.hc_mixes(x[sl], fn, 1e-6)
            outs = (y[sl], post[sl], comb[sl]) if not head else (y[sl], mixes, mixes)
            if two_streams:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    apply_into(x[sl], mixes, scale, base, *outs, head)
            else:
                apply_into(x[sl], mixes, scale, base, *outs, head)
        main.wait_stream(side)
        return (y,) if head else (y, post, comb)

    def measure(head, variants):
        nmix = M if head else (2 + M) * M
        gen = torch.Generator(device=dev).manual_seed(nmix)
        fn = torch.randn(nmix, M * D, device=dev, generator=gen) / (M * D) ** 0.5
        scale = torch.tensor([1.0, 1.05, 0.95], device=dev)
        base = torch.randn(nmix, device=dev, generator=gen) * 0.01
        nbytes = xs[0].numel() * 2 + S * D * 2                     # x once + y: the bar's traffic

        def whole(i):
            if head:
                return (mhc.hc_head(xs[i], fn, scale, base, 1e-6, 1e-6),)
            return mhc.hc_pre(xs[i], fn, scale, base, 20, 1e-6, 1e-6)

        want = whole(0)
        for name, how in variants:
            if how is None:
                run = whole
            elif how[0] == "fused":
                def run(i, tuning=how[1]):
                    out = mhc.hc_fused(xs[i], fn, scale, base, 20, 1e-6, 1e-6, head=head, tuning=tuning)
                    return (out,) if head else out
            else:
                def run(i, c=how[1], two=how[2]):
                    return chunked(xs[i], fn, scale, base, c, two, head)
            got = run(0)
            torch.cuda.synchronize()
            err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
            t = time_fn(run, 2)
            row = {"op": "hc_head" if head else "hc_pre", "variant": name, "us": t["us"], "mode": t["mode"],
                   "GBps": nbytes / t["us"] / 1e3, "of_copy": nbytes / t["us"] / 1e3 / copy["GBps"],
                   "max_abs_diff_vs_two_kernels": err}
            rows.append(row)
            print(f"{row['op']:8s} {name:34s} {t['us']:7.1f} us ({t['mode']}) {row['GBps']:6.0f} GB/s "
                  f"{100 * row['of_copy']:4.0f}% copy  max|diff| {err:.2e}", flush=True)
            save()                                         # row by row: a hung variant keeps the rows before it

    chunk_variants = [("two kernels", None)] + [(f"chunks of {c}{', 2 streams' if two else ''}", ("chunks", c, two))
                                                for two in (False, True) for c in (1024, 512, 256, 128)]
    fused_variants = [(f"hc_fused part_d {p} bufs {b} lag {lag} lead {lead}",
                       ("fused", {"part_d": p, "bufs": b, "lag": lag, "lead": lead}))
                      for p, b, lag, lead in ((256, 3, 2, 1), (256, 3, 1, 0), (128, 9, 4, 1), (128, 9, 3, 1),
                                              (128, 9, 4, 2), (128, 8, 2, 1), (64, 16, 6, 2))]
    if not args.fused_only:
        for head in (False, True):                         # the fused kernel last: a hang loses only its rows
            measure(head, chunk_variants)
    for head in (False, True):
        measure(head, chunk_variants[:1] + fused_variants)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
