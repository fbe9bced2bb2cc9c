"""Dequantisation of Pro-shaped FP4 expert weights ([3072, 7168], NVFP4 and MXFP4) on a GPU, against the
device's copy bandwidth measured in the same run: the reference dequantises every routed expert's three
matrices for each forward, which made it most of a reference layer's GPU time at 4096 tokens.

Formulations, all checked bit-identical to eager dequantisation: eager (~10 passes with an int64 gather),
the fused torch.compile'd graph for static shapes (what QWeight.dequantize(fused=True) runs on a GPU), the
same graph compiled for dynamic shapes (--code writes each graph's Triton code). E2M1 decoded by arithmetic
instead of the table gather was tried on 2026-12-04: slower (173 vs 157 us NVFP4, 202 vs 109 us MXFP4) and,
compiled for the GPU, not bit-identical. Then an expert's three matrices as three fused calls against one
dequantize_all call (one compiled graph, one host dispatch): the reference forward is bound by the host.

    python benchmarks/bench_dequant.py --out DIR [--code DIR]   # writes DIR/dequant.json (default: results/)
"""
from __future__ import annotations

import argparse
import functools
import json
from datetime import datetime, timezone
from pathlib import Path

import torch
from bench_record import per_call
from dsv4_kernels.check_attn import time_fn

from dsv4debug import formats as F

RESULTS = Path(__file__).parent / "results"


def gpu_seconds(fn) -> float:
    """Median CUDA-event time of fn, eager (the kernels checks' timer)."""
    fn()
    return time_fn(fn, graph=False)[0]


def stored(fmt: str, w: torch.Tensor) -> list[torch.Tensor]:
    if fmt == "nvfp4":
        return list(F.nvfp4_quantize(w))
    packed, scale = F.mxfp4_quantize(w)
    return [packed, scale.view(torch.uint8)]


def write_code(folder: Path, name: str, fn, tensors) -> None:
    """The Triton code inductor generated for fn (to see what a slow variant's kernel does)."""
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    _, code = run_and_get_code(fn, *tensors)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name.replace(' ', '_').replace(',', '')}.py").write_text("\n\n".join(code))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--code", type=Path, default=None, help="write each compiled variant's Triton code here")
    args = ap.parse_args()
    torch.manual_seed(0)
    out_f, in_f = 3072, 7168
    w = torch.randn(out_f, in_f, device="cuda") * 0.02
    src = torch.empty(out_f, in_f, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = gpu_seconds(lambda: dst.copy_(src))
    copy_rate = 2 * src.numel() * 2 / copy_s                           # read + write, bytes/s
    rows = []
    for fmt in ("nvfp4", "mxfp4"):
        tensors = stored(fmt, w)
        moved = sum(t.numel() * t.element_size() for t in tensors) + out_f * in_f * 2
        dequantize = functools.partial(F._dequantized, fmt, torch.bfloat16)
        want = dequantize(*tensors)
        variants = {"eager": dequantize,
                    "fused, dynamic shapes": F.exact_compile(dequantize),
                    "fused, static shapes": F.exact_compile(dequantize, dynamic=False)}
        for name, fn in variants.items():
            if args.code and name != "eager":
                write_code(args.code, f"{fmt} {name}", fn, tensors)
            got = fn(*tensors)
            exact = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
            s = gpu_seconds(lambda fn=fn, tensors=tensors: fn(*tensors))
            rows.append({"format": fmt, "variant": name, "us": s * 1e6, "GB/s": moved / s / 1e9,
                         "of_copy_bandwidth": moved / s / copy_rate, "bit_identical": exact})
    expert = []                      # an expert's w1, w3 [3072, 7168] and w2 [7168, 3072]: dispatches
    for fmt in ("nvfp4", "mxfp4"):
        names = F._DEQUANTIZERS[fmt][1]
        ws = [F.QWeight(f"w{i}", fmt, dict(zip(names, F.nvfp4_quantize(m) if fmt == "nvfp4" else F.mxfp4_quantize(m))))
              for i, m in enumerate((w, w, w.t().contiguous()))]
        ways = {"three fused calls": lambda ws=ws: [q.dequantize(torch.bfloat16, "cuda", fused=True) for q in ws],
                "one dequantize_all call": lambda ws=ws: F.dequantize_all(ws, torch.bfloat16, "cuda", fused=True)}
        for name, fn in ways.items():
            expert.append({"format": fmt, "variant": name, **per_call(lambda i, fn=fn: fn(), calls=20)})
    print(f"copy bandwidth (bf16 [{out_f}, {in_f}] copy_): {copy_rate / 1e9:.0f} GB/s")
    print(f"{'format':7} {'variant':24} {'us':>8} {'GB/s':>7} {'x copy':>7} exact")
    for r in rows:
        print(f"{r['format']:7} {r['variant']:24} {r['us']:8.1f} {r['GB/s']:7.0f} {r['of_copy_bandwidth']:7.2f} "
              f"{r['bit_identical']}")
    print("an expert's three matrices, back to back (host: the calling thread's time a call; gpu: until done)")
    for r in expert:
        print(f"{r['format']:7} {r['variant']:24} host {r['host_us']:8.1f} us  gpu {r['gpu_us']:8.1f} us")
    result = {"expert_matrices": expert, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": [out_f, in_f], "copy_GBps": copy_rate / 1e9, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dequant.json").write_text(json.dumps(result, indent=1))
    print(f"written {args.out / 'dequant.json'}")


if __name__ == "__main__":
    main()
