"""The issue-6 kernels still under their bandwidth bar, at Pro shapes, once each between cudaProfilerStart and
Stop (after a warm-up call), for Nsight Compute's pipe and memory tables:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
        --section Occupancy --section WarpStateStats python3 benchmarks/ncu_kernels.py [--ops a,b]

Needs a GPU and the dsv4_kernels / dsv4_references import names (benchmarks/gpu_session.sh sets them up).
"""
import argparse
import math

import torch


def cases():
    import dsv4_references as ref
    from dsv4_kernels import mhc, norm, nvfp4, rope
    S, D, M = 4096, 7168, 4
    x = torch.randn(S, D, device="cuda").bfloat16()
    q = torch.randn(S, 128, 512, device="cuda").bfloat16()
    kv = torch.randn(S, 512, device="cuda").bfloat16()
    streams = torch.randn(S, M, D, device="cuda").bfloat16()
    fn = torch.randn(24, M * D, device="cuda") / math.sqrt(M * D)
    freqs = ref.rope_freqs(S, 64, 10000.0).cuda()
    g = nvfp4.global_scale(nvfp4.amax(x))
    w512 = torch.ones(512, device="cuda")
    return {
        "nvfp4_quant": lambda: nvfp4.quantize(x, g),
        "rope_inplace": lambda: rope.rope_(q, freqs),
        "kv_norm": lambda: norm.rms_norm(kv, w512, 1e-6),
        "hc_mix": lambda: mhc.hc_mixes(streams, fn, 1e-6),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="nvfp4_quant,rope_inplace,kv_norm,hc_mix")
    args = ap.parse_args()
    table = cases()
    ops = args.ops.split(",")
    for op in ops:
        table[op]()                        # compile and warm outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for op in ops:
        table[op]()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled:", ", ".join(ops))


if __name__ == "__main__":
    main()
