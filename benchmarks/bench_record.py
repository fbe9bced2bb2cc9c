"""The host cost of recording one site into a GPU stats capture, and of its parts.

A Pro layer records ~430 sites (384 of them experts' outputs) and its reference forward is bound by the
host's launches, so a capture's overhead is what record() costs the calling thread, not GPU time. Measured
per call over many calls (host time from the first call to the last's return, without waiting for the GPU;
the GPU time of the same calls next to it): the eager statistics (device_stats), the site_stats kernel and
its launcher's pieces, a pinned 1-row copy and an event (what each site cost before the rows slab), and
CaptureWriter.record itself, stats-only, with either statistics, against a loop that only launches a matmul.

    python benchmarks/bench_record.py --out DIR        # writes DIR/record.json (default: results/)
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from dsv4debug import tensorstats as ts
from dsv4debug.capture import CaptureWriter

RESULTS = Path(__file__).parent / "results"
CALLS = 400


BACKLOG_CYCLES = 200_000_000        # ~0.1 s of GPU sleep queued ahead of the calls


def per_call(fn, calls: int = CALLS) -> dict[str, float]:
    """Host and GPU microseconds per call of fn (after a warm-up call), and the host time per call again with
    the GPU ~0.1 s behind (a queued sleep), as in a forward whose host runs ahead: a call that waits for the GPU
    anywhere (a hidden synchronisation) shows there as the backlog's length, and little of the backlog is left
    after the calls (`backlog_left_ms`)."""
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    torch.cuda._sleep(BACKLOG_CYCLES)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    host_busy = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    backlog_left = time.perf_counter() - t1
    return {"host_us": host / calls * 1e6, "gpu_us": start.elapsed_time(end) / calls * 1e3,
            "host_us_gpu_behind": host_busy / calls * 1e6, "backlog_left_ms": backlog_left * 1e3}


def stats_calls(shape) -> list[tuple[str, dict[str, float]]]:
    """A site's statistics, eager and by the site_stats kernel (one tensor a launch, and 64 sites a launch
    as a capture batches them: per site), with a matmul launch for scale."""
    from cutlass import Float64, Int32, Int64
    from dsv4_kernels import _common, stats
    x = torch.randn(*shape, device="cuda").bfloat16()
    w = torch.randn(shape[1], 64, device="cuda").bfloat16()
    batch = [torch.randn(*shape, device="cuda").bfloat16() for _ in range(64)]
    firsts = [i * stats.n_rows(x) for i in range(64)]
    out = torch.empty(64 * stats.n_rows(x), 7, dtype=torch.float64, device="cuda")
    fn = _common.compile_kernel("site_stats", "sm_90a", dtype="bf16")
    table, n_cta = stats._table([x.data_ptr()], [x.numel() // 8], [0])
    table = torch.from_numpy(table).cuda()
    args = (_common.ptr(table, Int64, 8), _common.ptr(out, Float64, 8), Int32(1), Int32(n_cta), Int32(out.shape[0]),
            _common.current_stream())
    one_call_of_64 = per_call(lambda i: stats.site_stats(batch, firsts, out), calls=CALLS // 8)
    staging, (table_64, _) = stats._staging(out.device), stats._table([t.data_ptr() for t in batch],
                                                                      [t.numel() // 8 for t in batch], firsts)
    return [("matmul [.., 7168] @ [7168, 64] (a launch, for scale)", per_call(lambda i: x @ w)),
            ("eager device_stats", per_call(lambda i: ts.device_stats(x))),
            ("site_stats kernel, launcher, one site", per_call(lambda i: stats.site_stats([x], [0], out))),
            ("site_stats kernel, launcher, 64 sites a call (per site)",
             {k: v if k == "backlog_left_ms" else v / 64 for k, v in one_call_of_64.items()}),
            ("site_stats kernel, compiled function only", per_call(lambda i: fn(*args))),
            ("site_stats launcher piece: 64 sites' table to the device",
             per_call(lambda i: staging.to_device(table_64), calls=CALLS // 8))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    from cutlass import Float64
    from dsv4_kernels import _common
    rows: list[dict] = []

    def add(part: str, shape, r: dict[str, float]) -> None:
        rows.append({"part": part, "shape": list(shape), **r})

    for shape in ((64, 7168), (4096, 7168)):
        for part, r in stats_calls(shape):
            add(part, shape, r)
    one = torch.empty(1, 7, dtype=torch.float64, device="cuda")
    add("launcher piece: ptr()", (1, 7), per_call(lambda i: _common.ptr(one, Float64, 8)))
    add("launcher piece: current_stream()", (), per_call(lambda i: _common.current_stream()))
    add("launcher piece: compile cache lookup", (), per_call(
        lambda i: _common.compile_kernel("site_stats", "sm_90a", dtype="bf16")))
    add("launcher piece: device_arch()", (), per_call(lambda i: _common.device_arch(one.device)))
    add("pinned copy of one row", (1, 7), per_call(lambda i: torch.empty(1, 7, dtype=torch.float64,
                                                                         pin_memory=True).copy_(one, non_blocking=True)))
    add("cuda Event() + record()", (), per_call(lambda i: torch.cuda.Event().record()))
    # why a per-CTA launch table (~7000 int64 x 3 a Pro batch) waited for the GPU: its copy, from a slice of a
    # pinned tensor and from a whole one, by size
    for n in (64, 8192):
        whole = torch.zeros(n, 3, dtype=torch.int64, pin_memory=True)
        ring = torch.zeros(4, n, 3, dtype=torch.int64, pin_memory=True)
        add("pinned copy to the device, whole pinned tensor", (n, 3),
            per_call(lambda i, whole=whole: whole.to("cuda", non_blocking=True)))
        add("pinned copy to the device, slice of a pinned tensor", (n, 3),
            per_call(lambda i, ring=ring: ring[i % 4].to("cuda", non_blocking=True)))

    ids = list(range(64))
    sites = [torch.randn(64, 7168, device="cuda").bfloat16() for _ in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        for kernel in (False, True):
            with CaptureWriter(Path(tmp) / f"r{kernel}.h5", {"token_ids": ids}, "stats", stats_kernel=kernel) as wr:
                def record(i: int, wr=wr) -> None:
                    wr.record("r", f"layers.0.s{i}_{time.perf_counter_ns()}", sites[i % 8], layer=0)
                r = per_call(record)
                t0 = time.perf_counter()
                wr.end_layer("r", 0)
                r["end_layer_ms"] = (time.perf_counter() - t0) * 1e3
            add(f"CaptureWriter.record, stats only ({'site_stats' if kernel else 'eager'})", (64, 7168), r)
    print(f"{'part':58} {'shape':>14} {'host us':>8} {'gpu us':>8} {'host us, GPU behind':>20} {'backlog left ms':>16}")
    for r in rows:
        print(f"{r['part']:58} {tuple(r['shape'])!s:>14} {r['host_us']:8.1f} {r['gpu_us']:8.1f} "
              f"{r['host_us_gpu_behind']:20.1f} {r['backlog_left_ms']:16.1f}")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "calls": CALLS, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "record.json").write_text(json.dumps(result, indent=1))
    print(f"written {args.out / 'record.json'}")


if __name__ == "__main__":
    main()
