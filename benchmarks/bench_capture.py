"""Capture I/O benchmark: every number is a ratio against a baseline measured in the same run.

1. full-capture write rate vs a raw sequential write of the same bytes (numpy tofile + fsync); with GPU
   tensors also the writer with its chunks encoded on the host (its path before GPU encoding), side by side;
2. diff read rate (stream_compare over every site of two captures, B = A plus noise, as when their hashes
   differ) vs plain h5py reads of the same datasets;
3. stats-only capture overhead vs the same forward-like loop of matmuls without capture.

Rates count the tensors' own bytes (bf16: 2 per element) moved per second. Reads hit the page cache for
both sides alike (the files were just written), so they measure decode and compare cost, not the disk.

    python benchmarks/bench_capture.py [--device cuda] [--mib 512] [--dir SCRATCH_ON_THE_DISK]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import h5py
import torch

from dsv4debug import capture
from dsv4debug.capture import CaptureReader, CaptureWriter
from dsv4debug.diff import stream_compare


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def activations(mib: int, device: str, tokens: int = 128, dim: int = 4096) -> list[torch.Tensor]:
    """bf16 [tokens, 4, dim] tensors (the hidden-stream shape, 4 MiB each) adding up to `mib` MiB."""
    per = tokens * 4 * dim * 2
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(tokens, 4, dim, generator=g, device=device).bfloat16() for _ in range(max(1, mib * 2**20 // per))]


def raw_write(path: Path, tensors: list[torch.Tensor], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            t.cpu().view(torch.int16).numpy().tofile(f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def capture_write(path: Path, tensors: list[torch.Tensor], tokens: int, device: str, compression: str,
                  host_encoded: bool = False) -> float:
    device_encoded = capture._device_encoded
    if host_encoded:                        # the GPU sites' chunks encoded by the writer's pool instead
        capture._device_encoded = lambda rows, compression: None
    try:
        sync(device)
        t0 = time.perf_counter()
        with CaptureWriter(path, {"token_ids": list(range(tokens))}, "full", force=True,
                           compression=compression) as w:
            for i, t in enumerate(tensors):
                w.record("reference", f"layers.{i}.ffn", t, layer=i)
        return time.perf_counter() - t0     # close() includes the fsync
    finally:
        capture._device_encoded = device_encoded


def raw_read(a: Path, b: Path) -> float:
    t0 = time.perf_counter()
    for path in (a, b):
        with h5py.File(path, "r") as f:
            for dset in f["runs/reference/tensors"].values():
                dset[()]
    return time.perf_counter() - t0


def diff_read(a: Path, b: Path) -> float:
    t0 = time.perf_counter()
    with CaptureReader(a) as ra, CaptureReader(b) as rb:
        for site in ra.sites("reference"):
            stream_compare(ra, rb, "reference", "reference", site)
    return time.perf_counter() - t0


def forward_loop(layers: int, sites: int, tokens: int, dim: int, device: str, writer=None) -> float:
    g = torch.Generator(device=device).manual_seed(1)
    compute = torch.float32 if device == "cpu" else torch.bfloat16     # CPUs without bf16 units: 40x slower
    weights = [(torch.randn(dim, dim, generator=g, device=device) / dim ** 0.5).to(compute) for _ in range(sites)]
    h = torch.randn(tokens, dim, generator=g, device=device).bfloat16()
    sync(device)
    t0 = time.perf_counter()
    for layer in range(layers):
        for s, w in enumerate(weights):
            h = torch.nn.functional.rms_norm(h.to(compute) @ w, (dim,)).bfloat16()
            if writer is not None:
                writer.record("reference", f"layers.{layer}.site{s}", h, layer=layer)
        if writer is not None:
            writer.end_layer("reference", layer)
    sync(device)
    return time.perf_counter() - t0


def stats_overhead(path: Path, args) -> dict[str, float]:
    shape = (args.layers, args.sites, args.tokens, args.dim, args.device)
    forward_loop(1, *shape[1:])                                     # warm up kernels and allocator
    plain = min(forward_loop(*shape) for _ in range(3))
    captured = []
    for _ in range(3):
        with CaptureWriter(path, {"token_ids": list(range(args.tokens))}, "stats", force=True) as w:
            captured.append(forward_loop(*shape, writer=w))
    return {"plain_s": plain, "stats_capture_s": min(captured), "overhead": min(captured) / plain - 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--mib", type=int, default=512, help="bf16 tensor bytes written by the full capture")
    p.add_argument("--tokens", type=int, default=128, help="forward loop: rows of the activations")
    p.add_argument("--dim", type=int, default=2048, help="forward loop: width of the square matmuls")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--sites", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="rounds of (raw, captures) and of (raw read, diff)")
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    p.add_argument("--out", default=None, help="default: results/capture.json on cpu, capture_<device>.json else")
    args = p.parse_args()
    name = "capture.json" if args.device == "cpu" else f"capture_{args.device.replace(':', '')}.json"
    args.out = args.out or str(Path(__file__).parent / "results" / name)

    tensors = activations(args.mib, args.device)
    nbytes = sum(t.numel() * 2 for t in tensors)
    results: dict = {"device": args.device, "host": platform.node(), "cpus": os.cpu_count(),
                     "torch": torch.__version__, "tensor_mib": nbytes / 2**20, "args": vars(args)}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        variants = [("fast", "fast", False), ("small", "small", False)]
        if args.device != "cpu":
            variants.insert(1, ("fast_host_encoded", "fast", True))
        # rounds of (raw write, each capture) back to back, so that the disk's and the host's drift hits all of
        # them alike: each round's ratio, their median, and the best of each kind against the best raw write
        times: dict[str, list[float]] = {"raw": [], **{name: [] for name, _, _ in variants}}
        for name, compression, host_encoded in variants:    # untimed: pinned buffers, first kernels, imports
            capture_write(tmp / f"{name}.h5", tensors, tensors[0].shape[0], args.device, compression, host_encoded)
        for _ in range(args.rounds):
            times["raw"].append(raw_write(tmp / "raw.bin", tensors, args.device))
            for name, compression, host_encoded in variants:
                times[name].append(capture_write(tmp / f"{name}.h5", tensors, tensors[0].shape[0], args.device,
                                                 compression, host_encoded))
        raw = min(times["raw"])
        results["raw_write_mib_s"] = nbytes / raw / 2**20
        for name, _, _ in variants:
            results[f"capture_{name}"] = {
                "write_mib_s": nbytes / min(times[name]) / 2**20, "vs_raw": raw / min(times[name]),
                "vs_raw_median": statistics.median(r / t for r, t in zip(times["raw"], times[name])),
                "seconds": times[name], "file_mib": (tmp / f"{name}.h5").stat().st_size / 2**20}
        results["raw_write_seconds"] = times["raw"]
        # diff compares different data, as it does when hashes differ: B is A plus noise of ~1 bf16 ULP
        for t in tensors:
            t.add_(torch.randn_like(t) * t.abs() * 2**-8)
        capture_write(tmp / "fast_b.h5", tensors, tensors[0].shape[0], args.device, "fast")
        reads: dict[str, list[float]] = {"raw": [], "diff": []}
        for _ in range(args.rounds):
            reads["raw"].append(raw_read(tmp / "fast.h5", tmp / "fast_b.h5"))
            reads["diff"].append(diff_read(tmp / "fast.h5", tmp / "fast_b.h5"))
        raw_r, diff_r = min(reads["raw"]), min(reads["diff"])
        results["diff_read"] = {"raw_h5py_mib_s": 2 * nbytes / raw_r / 2**20,
                                "diff_mib_s": 2 * nbytes / diff_r / 2**20, "vs_raw": raw_r / diff_r,
                                "vs_raw_median": statistics.median(r / d for r, d in zip(reads["raw"], reads["diff"])),
                                "seconds": reads}
        results["stats_only"] = stats_overhead(tmp / "stats.h5", args)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


def print_table(r: dict) -> None:
    def row(name: str, rate: float, entry: dict | None, extra: str = "") -> tuple[str, str, str, str]:
        return (name, f"{rate:.0f} MiB/s{extra}", f"{entry['vs_raw']:.2f}" if entry else "1.00",
                f"{entry['vs_raw_median']:.2f}" if entry else "1.00")
    rows = [row("raw sequential write (tofile+fsync)", r["raw_write_mib_s"], None),
            *(row(f"full capture, {c}", r[f"capture_{c}"]["write_mib_s"], r[f"capture_{c}"],
                  f" ({r[f'capture_{c}']['file_mib']:.0f} MiB file)")
              for c in ("fast", "fast_host_encoded", "small") if f"capture_{c}" in r),
            row("raw h5py read of both files", r["diff_read"]["raw_h5py_mib_s"], None),
            row("diff (stream_compare every site)", r["diff_read"]["diff_mib_s"], r["diff_read"]),
            ("forward loop, no capture", f"{r['stats_only']['plain_s'] * 1e3:.0f} ms", "1.00", ""),
            ("forward loop, stats-only capture", f"{r['stats_only']['stats_capture_s'] * 1e3:.0f} ms",
             f"{1 + r['stats_only']['overhead']:.3f}", "")]
    print(f"device {r['device']}, {r['cpus']} CPUs, {r['tensor_mib']:.0f} MiB of bf16 tensors, "
          f"{r['args']['rounds']} rounds")
    print(f"{'measurement':40s} {'rate / time':34s} {'best':6s} median of rounds")
    for name, value, best, median in rows:
        print(f"{name:40s} {value:34s} {best:6s} {median}")


if __name__ == "__main__":
    main()
