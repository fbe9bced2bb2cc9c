"""Reference forward speed, and the cost of stats capture on it.

CPU (CI-like machine): the tiny preset, full forward of 256 tokens (target <= 10 s on 2 cores).
GPU (--device cuda): one Pro-shaped layer (real dimensions, 384 experts) at 4096 tokens, generated on the
GPU, against the time its matrix FLOPs take at the cuBLAS bf16 rate measured in the same run (target
<= 2x), and the same layer with a stats-only capture recording every site (target <= +3%). Next to it, the
floor no bf16 reference that dequantises its experts can beat: the routed experts' bf16 weights written once
and read once, at the copy rate measured in the same run (`dequant_traffic_floor_seconds`).

    python benchmarks/bench_reference.py                      # CPU, tiny
    python benchmarks/bench_reference.py --device cuda        # GPU, Pro layer
Results go to benchmarks/results/reference-<device>.json.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import platform
import pstats
import re
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import dsv4debug.api as dd
from dsv4debug.config import preset
from dsv4debug.execute import Executor, Side, WeightSource
from dsv4debug.model import State, stages
from dsv4debug.runner import candidate_backend

RESULTS = Path(__file__).parent / "results"
# the capture's stats slab with other settings, timed in the same pairs (GPU only): name -> _StatsSlab attributes
SLAB_VARIANTS: dict[str, dict] = {}
REPEATS = 25                  # interleaved (forward, capture) pairs, after one untimed capture: single forwards
                              # of one run spread by up to 1.7x on some machines of the pool


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def host_then_gpu(fn, device: str) -> tuple[float, float]:
    """(seconds until fn returns on the host, seconds more until the device has finished its work)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    sync(device)
    return t1 - t0, time.perf_counter() - t1


def bench_tiny_cpu(seq_len: int) -> dict:
    model = dd.open_model()
    tokens = dd.make_tokens(model, seq_len=seq_len)
    dd.reference(model, tokens[:8])                              # warm-up (imports, allocator)
    t = timed(lambda: dd.reference(model, tokens), "cpu", repeat=3)
    return {"case": f"tiny preset, {seq_len} tokens, full forward (bf16 reference)", "seconds": t,
            "target_seconds": 10.0, "threads": torch.get_num_threads(), "meets_target": t <= 10.0}


class GcClock:
    """A gc callback adding the time spent in garbage collections (and their count) to a dict."""

    def __init__(self, into: dict):
        self.into, self.t0 = into, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.into["gc"] += time.perf_counter() - self.t0
            self.into["gc_runs"] += 1
            self.into["gc_full_runs"] += info["generation"] == 2


def layer_matmul_flops(cfg, layer: int, S: int, routed_tokens: int) -> float:
    """Matrix FLOPs (2 per MAC) of one layer's GEMMs and attention scores/values at S tokens."""
    D, H, d, Q, G, R, I = (cfg.dim, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank,
                           cfg.moe_inter_dim)
    ratio = cfg.compress_ratio(layer)
    macs = S * (D * Q + Q * H * d + D * d + H * d * R + G * R * D)                 # q, kv, wo_a, wo_b
    macs += S * 3 * D * I + routed_tokens * 3 * D * I + S * D * cfg.n_routed_experts   # shared, routed, gate
    if ratio:
        c = 2 if ratio == 4 else 1
        macs += S * 2 * D * c * d                                                  # compressor wkv, wgate
    keys = cfg.window_size + (min(cfg.index_topk, S // 4) if ratio == 4 else (S // ratio if ratio else 0))
    if ratio == 4:
        IH, ID = cfg.index_n_heads, cfg.index_head_dim
        macs += S * (Q * IH * ID + D * IH + 2 * D * 2 * ID) + S * (S // 4) * IH * ID
    macs += S * H * keys * d * 2                                                   # QK^T and PV
    return 2.0 * macs


def cublas_rate(device: str, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.matmul(a, b)
    t = timed(lambda: [torch.matmul(a, b) for _ in range(10)], device, repeat=3) / 10
    return 2.0 * n ** 3 / t


def copy_rate(device: str, nbytes: int = 2**30) -> float:
    """Device copy bandwidth (read + write bytes a second), best of 3 eager copies of nbytes."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, repeat=3)


def bench_pro_layer(device: str, seq_len: int, layer: int, profile: bool = False, backend_name: str = "reference",
                    repeats: int = REPEATS) -> dict:
    from dsv4debug.capture import CaptureWriter
    from dsv4debug.synth import SyntheticModel
    cfg = preset("pro")
    model = SyntheticModel(cfg, seed=0, device=device, fused=True)
    stage = stages(cfg, seq_len, device, True)[layer + 1]
    g = torch.Generator(device=device).manual_seed(0)
    h = (torch.randn(seq_len, cfg.hc_mult, cfg.dim, device=device, generator=g)).bfloat16()
    ids = torch.randint(0, cfg.vocab_size, (seq_len,), device=device, generator=g)
    backend = candidate_backend(backend_name, "reference", device)
    side = Side(backend_name, backend, WeightSource(model))
    routed = seq_len * cfg.n_activated_experts

    def forward(observer=None):
        return stage.run(Executor(side, (), observer), State(ids, h))

    t_cold = timed(forward, device)                      # generates + dequantises the layer's weights
    t_warm = timed(forward, device, repeat=3)            # weights cached: the forward itself
    def profiled(what: str, fn) -> None:                 # where a warm run's time goes, by op and kernel
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
        print(f"--- {what}")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    def host_profiled(what: str, fn) -> None:
        prof = cProfile.Profile()
        prof.enable()
        fn()
        sync(device)
        prof.disable()
        print(f"--- host profile: {what}")
        stats = pstats.Stats(prof).sort_stats("tottime")
        stats.print_stats(30)
        print(f"--- host profile: {what}, the capture's own functions (cumulative)")
        stats.sort_stats("cumulative").print_stats(r"capture|tensorstats|dsv4_kernels|kernels/|cutlass|bench_reference", 40)

    if profile:
        profiled("forward", forward)
    # a stats-only capture of every site against the plain forward, interleaved (forward, capture) pairs so
    # that the host's drift hits both: the median ratio, and the best of each. The statistics a capture takes
    # by default: the site_stats kernel on a GPU, torch ops on the CPU (on a GPU those are profiled once, as
    # a scale: a launch series a site); the observer alone (a no-op) for scale.
    kernel = device.startswith("cuda")
    ratios: dict[str, list[float]] = {"observer": [], "capture": [], **{v: [] for v in SLAB_VARIANTS}}
    t_capture, t_plain_all = [], []
    t_variants: dict[str, list[float]] = {v: [] for v in SLAB_VARIANTS}
    plain_gc = {"gc": 0.0, "gc_runs": 0, "gc_full_runs": 0}
    with tempfile.TemporaryDirectory() as tmp:
        def stats_writer(key, stats_kernel: bool, slab_settings: dict) -> CaptureWriter:
            writer = CaptureWriter(Path(tmp) / f"bench-{key}.h5", {"token_ids": ids.tolist()}, "stats",
                                   stats_kernel=stats_kernel)
            for name, value in slab_settings.items():
                setattr(writer._slab, name, value)
            return writer
        # by statistics (True: the site_stats kernel), and the slab's other settings side by side
        writers = {k: stats_writer(k, k, {}) for k in {kernel, False}}
        writers.update({v: stats_writer(v, kernel, settings) for v, settings in SLAB_VARIANTS.items()})
        spent: dict[str, float] = {}                      # the last capture's host time, by part

        def captured(key, rep) -> None:                   # every site's stats, flushed at the layer's end
            writer, run = writers[key], f"rep{rep}"
            spent.clear()
            spent.update({"record": 0.0, "sites": 0, "slab_add": 0.0, "launch": 0.0, "launches": 0, "flush": 0.0,
                          "flushes": 0, "end_layer": 0.0, "gc": 0.0, "gc_runs": 0, "gc_full_runs": 0,
                          "writer_batches": 0.0, "writer_finish_layer": 0.0})
            slab = writer._slab                            # the slab's parts, timed apart (each includes the next)

            def timed_part(name: str, fn, count: str | None = None):
                def wrapper(*args):
                    t0 = time.perf_counter()
                    fn(*args)
                    spent[name] += time.perf_counter() - t0
                    if count:
                        spent[count] += 1
                return wrapper
            slab.add = timed_part("slab_add", slab.add)
            slab.flush = timed_part("flush", slab.flush, "flushes")
            slab.launch = timed_part("launch", slab.launch, "launches")
            # the writer thread's part of end_layer: statistics and rows of a batch, the table and HDF5 flush
            writer._write_batch = timed_part("writer_batches", writer._write_batch)
            finish_layer = writer._finish_layer

            def timed_finish_layer(run, layer, done):     # timed before end_layer's caller is released
                t0 = time.perf_counter()
                finish_layer(run, layer, threading.Event())
                spent["writer_finish_layer"] += time.perf_counter() - t0
                done.set()
            writer._finish_layer = timed_finish_layer

            def record(ev) -> None:
                t0 = time.perf_counter()
                for s, t in ev.outputs:
                    writer.record(run, s, t, layer=layer)
                spent["record"] += time.perf_counter() - t0
                spent["sites"] += len(ev.outputs)

            gc_clock = GcClock(spent)
            gc.callbacks.append(gc_clock)
            try:
                t0 = time.perf_counter()
                forward(record)
                t1 = time.perf_counter()
                writer.end_layer(run, layer)
                spent["end_layer"] = time.perf_counter() - t1
                spent["total"] = time.perf_counter() - t0
            finally:
                gc.callbacks.remove(gc_clock)
                del slab.add, slab.flush, slab.launch, writer._write_batch, writer._finish_layer

        def plain_forward() -> None:
            plain_gc.update(gc=0.0, gc_runs=0, gc_full_runs=0)
            gc_clock = GcClock(plain_gc)
            gc.callbacks.append(gc_clock)
            try:
                forward()
            finally:
                gc.callbacks.remove(gc_clock)

        for k in [kernel, *SLAB_VARIANTS]:
            captured(k, "warm-up")                         # compiles and first-use allocations, untimed
        for rep in range(repeats):
            t_plain = timed(plain_forward, device)
            t_plain_all.append(t_plain)
            ratios["observer"].append(timed(lambda: forward(lambda ev: None), device) / t_plain)
            for variant in SLAB_VARIANTS:
                t = timed(lambda rep=rep, variant=variant: captured(variant, rep), device)
                t_variants[variant].append(t)
                ratios[variant].append(t / t_plain)
            t = timed(lambda rep=rep: captured(kernel, rep), device)
            t_capture.append(t)
            ratios["capture"].append(t / t_plain)
        parts = dict(spent)
        overhead = {k: statistics.median(v) - 1 for k, v in ratios.items()}
        # the host's noise moves single forwards by +-20%: the best of each kind is the steadier comparison
        overhead_best = min(t_capture) / min(t_plain_all) - 1
        print(f"stats capture ({'site_stats kernel' if kernel else 'torch ops'}): {overhead['capture']:+.1%} median "
              f"of {repeats} pairs, {overhead_best:+.1%} best of each")
        for variant, times in t_variants.items():
            print(f"  slab variant {variant}: {overhead[variant]:+.1%} median, "
                  f"{min(times) / min(t_plain_all) - 1:+.1%} best")
        print("capture host time by part (the last capture, seconds):", parts, "plain forward's gc:", plain_gc)
        if profile:
            for k in dict.fromkeys((kernel, False)):     # by statistics (the slab variants are not profiled)
                profiled(f"forward with a stats capture ({'site_stats kernel' if k else 'torch ops'})",
                         lambda k=k: captured(k, f"profile-{k}"))
            host, gpu = host_then_gpu(forward, device)
            print(f"plain: forward's host time {host:.4f} s, then the GPU {gpu:.4f} s")
            writer = writers[kernel]                 # the capture's cost after the GPU is done: end_layer's tail
            host, gpu = host_then_gpu(lambda: forward(
                lambda ev: [writer.record("tail", s, t, layer=layer) for s, t in ev.outputs]), device)
            t0 = time.perf_counter()
            writer.end_layer("tail", layer)
            print(f"stats capture: forward's host time {host:.4f} s, then the GPU {gpu:.4f} s, then end_layer "
                  f"{time.perf_counter() - t0:.4f} s")
            host_profiled("forward", forward)       # the Python functions the capture adds to the host's time
            host_profiled("forward with a stats capture", lambda: captured(kernel, "cprofile"))
        for writer in writers.values():
            writer.abort()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    rate = cublas_rate(device)
    flops = layer_matmul_flops(cfg, layer, seq_len, routed)
    ideal = flops / rate
    # what a reference that dequantises the routed experts to bf16 cannot go below: each expert that received
    # tokens has its three matrices written in bf16 once and read once by its GEMMs, at the copy rate
    experts = set()
    forward(lambda ev: experts.update(s for s, _ in ev.outputs if re.search(r"\.ffn\.experts\.\d+$", s)))
    bf16_expert_bytes = len(experts) * 3 * cfg.dim * cfg.moe_inter_dim * 2
    copy = copy_rate(device)
    floor = 2 * bf16_expert_bytes / copy
    return {"case": f"Pro layer {layer} ({cfg.layer_type(layer)}), {seq_len} tokens, 384 experts",
            "backend": backend_name,
            "layer_type": cfg.layer_type(layer), "matmul_tflop": flops / 1e12, "cublas_tflops": rate / 1e12,
            "ideal_seconds": ideal, "forward_seconds_warm": t_warm, "forward_seconds_cold": t_cold,
            "ratio_to_ideal": t_warm / ideal, "target_ratio": 2.0, "meets_target": t_warm / ideal <= 2.0,
            "experts_with_tokens": len(experts), "bf16_expert_gb": bf16_expert_bytes / 1e9, "copy_GBps": copy / 1e9,
            "dequant_traffic_floor_seconds": floor, "floor_ratio_to_ideal": floor / ideal,
            "capture_pairs": repeats, "capture_ratios": ratios, "observer_overhead": overhead["observer"],
            "capture_statistics": "site_stats kernel" if kernel else "torch ops",
            "stats_capture_seconds": min(t_capture), "capture_overhead": overhead["capture"],
            "capture_overhead_best_of_each": overhead_best, "forward_seconds_each": t_plain_all,
            "capture_seconds_each": t_capture, "slab_variants": {v: {"settings": SLAB_VARIANTS[v],
            "median_overhead": overhead[v], "best_overhead": min(t) / min(t_plain_all) - 1, "seconds_each": t}
            for v, t in t_variants.items()}, "capture_host_parts": parts, "plain_forward_gc": plain_gc,
            "capture_target": 0.03, "peak_gpu_gib": peak,
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--layers", default="2,3", help="Pro layers to time on the GPU (2 = CSA, 3 = HCA)")
    ap.add_argument("--profile", action="store_true", help="print torch profiler tables of one warm forward, and of one with the stats capture")
    ap.add_argument("--backend", default="reference", help="backend of the Pro layer (default the reference)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON result")
    ap.add_argument("--slab-variants", action="store_true",
                    help="GPU: also time captures whose stats slab flushes each batch, and with 1 GiB batches")
    ap.add_argument("--repeats", type=int, default=REPEATS, help="interleaved (forward, capture) pairs")
    args = ap.parse_args()
    if args.slab_variants and args.device != "cpu":
        SLAB_VARIANTS.update({"flush_each_batch": {"FLUSH_EACH_BATCH": True},
                              "batches_1GiB": {"DEFER_BYTES": 1 << 30}})
    rows = []
    if args.device == "cpu":
        rows.append(bench_tiny_cpu(args.seq_len or 256))
    else:
        for layer in (int(x) for x in args.layers.split(",")):
            rows.append(bench_pro_layer(args.device, args.seq_len or 4096, layer, args.profile, args.backend,
                                        args.repeats))
            torch.cuda.empty_cache()
    doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
           "python": platform.python_version(), "machine": platform.machine(), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.backend == "reference" else f"-{args.backend}"
    out = args.out / f"reference-{args.device.split(':')[0]}{suffix}.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    for r in rows:
        print(json.dumps(r))
    print(f"written {out}")


if __name__ == "__main__":
    main()
