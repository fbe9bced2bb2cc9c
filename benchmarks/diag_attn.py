"""Temporary: where sparse_attn's prefill time goes (variants of the kernel without parts of it)."""
import json
import os
import sys

import torch

from dsv4_kernels import check_attn as C
from dsv4_kernels import sparse_attn as SA

out = os.environ.get("OUT", "/tmp")
rows = []
for shape, layer in () if "--ncu" in sys.argv else (("flash", "csa"), ("flash", "swa"), ("pro", "csa")):
    p = C.make_prefill(shape, layer, 4096, seed=31)
    launch, keep = C.prepared_fp8(p)
    fl = C.flops(p)
    nblk = -(-p["idx"].size(1) // 32)
    for diag in ("", "no_consumer", "no_consumer+no_gather", "no_consumer+no_dequant",
                 "no_gather+no_dequant") if layer == "csa" and shape == "flash" else ("",):
        la = 2
        SA._DIAG, SA._DIAG_LA = diag, la
        t, _ = C.time_fn(launch, 10)
        ctas = p["S"] * (p["H"] // 64)
        per_blk = t / (ctas / 132) / nblk * 1.83e9
        r = dict(shape=shape, layer=layer, fmt="fp8", diag=diag or "full", la=la, us=t * 1e6,
                 tflops=fl / t / 1e12, clk_per_block=per_blk)
        print(json.dumps(r), flush=True)
        rows.append(r)
    SA._DIAG, SA._DIAG_LA = "", 2
    t, _ = C.time_fn(lambda: SA.sparse_attn_bf16(p["q"], p["kv"], p["idx"], p["sink"], 512 ** -0.5), 10)
    r = dict(shape=shape, layer=layer, fmt="bf16", diag="full", us=t * 1e6, tflops=fl / t / 1e12)
    print(json.dumps(r), flush=True)
    rows.append(r)
if rows:
    json.dump(rows, open(f"{out}/diag_attn.json", "w"), indent=1)
if "--ncu" in sys.argv:
    p = C.make_prefill("flash", "csa", 4096, seed=31)
    launch, keep = C.prepared_fp8(p)
    launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
