"""A 61-layer Pro-shaped run and bisection on one GPU (issue 9), with layer streaming.

The model has Pro's real dimensions and 384 experts. Its first --disk-layers layers (default 2), with the
embedding and head, are a real-format checkpoint written to disk (make_checkpoint(first_layers=...), on the
GPU); the other layers are generated on the GPU as they are needed (SyntheticModel over that checkpoint,
bit-identical to the full synthetic model). Measured, each step with its own peak of GPU memory:
  forward   one plain forward per backend (reference, candidate): time per layer (weights read/generated
            and the layer's ops; synchronised at every stage boundary);
  run       `run` (reference vs candidate, per-op forcing and free, fp64 floors): total and per layer;
  capture   the same run with a stats capture of every site: the capture's overhead (give `warmup` first,
            an untimed run, so that neither pays the compiles; a step given twice keeps its best time);
  bisect    `bisect` over all stages (--bisect-axis): total time, probes, culprit;
  memory    `run` with a capture again, untimed, under the allocator's trace: what is live at its peak
            (memory_peak.py).
Peak memory is compared with one layer's stored weights plus the hidden streams (what layer streaming
promises: DESIGN.md "Running real models on one GPU"). --planted FAULT plants a fault in the candidate and
checks that run and bisect name its layer (and run its site).

    python benchmarks/bench_pro61.py --device cuda --out benchmarks/results/pro61-h200.json
    python benchmarks/bench_pro61.py --preset tiny --tokens 64 --out /tmp/tiny61.json     # CPU smoke run

At the default 1024 tokens a reference Pro layer should take ~50-190 ms of GPU work (190 ms measured at
4096 tokens, mostly reading the experts' weights); a run does five passes per layer, two of them in fp64.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

import dsv4debug.api as dd
from dsv4debug.backends.registry import make_backend
from dsv4debug.bisect import bisect
from dsv4debug.checkpoint import Checkpoint
from dsv4debug.config import preset
from dsv4debug.execute import Executor, Side, WeightSource
from dsv4debug.faults import parse_fault
from dsv4debug.model import State, stages
from dsv4debug.runner import candidate_backend
from dsv4debug.schema import block_modules, layer_weight_bytes
from dsv4debug.synth import SyntheticModel, make_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from memory_peak import LivePeak, print_summary


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else None


class StageClock:
    """Seconds per stage from synchronised timestamps at stage boundaries (progress / stage_done callbacks)."""

    def __init__(self, device: str):
        self.device, self.seconds, self._t = device, {}, None

    def start(self, name: str) -> None:
        sync(self.device)
        self._t, self._name = time.perf_counter(), name

    def stop(self) -> None:
        sync(self.device)
        self.seconds[self._name] = self.seconds.get(self._name, 0.0) + time.perf_counter() - self._t


def forward(model, ids: torch.Tensor, backend, device: str) -> dict[str, float]:
    """One streamed forward of `backend`: seconds per stage, weights included."""
    side = Side(backend.name, backend, WeightSource(model))
    clock, state = StageClock(device), State(ids.to(device))
    for stage in stages(model.config, ids.numel(), device):
        clock.start(stage.name)
        ex = Executor(side)
        state = stage.run(ex, state)
        ex.end_stage()
        clock.stop()
    return clock.seconds


def measured(step: str, device: str, results: dict, fn):
    reset_peak(device)
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    results[step] = {"seconds": time.perf_counter() - t0, "peak_bytes": peak(device)}
    print(f"{step}: {results[step]['seconds']:.1f} s, peak {gib(results[step]['peak_bytes'])}", flush=True)
    return out


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def layer_bytes(cfg) -> dict[str, int]:
    """The largest layer's stored weights, and the hidden streams [S, M, D] that travel between layers."""
    return {"layer_weights": layer_weight_bytes(cfg)}


def run(model, ids: torch.Tensor, a: argparse.Namespace, capture: Path | None, clock: StageClock, saved):
    """`dsv4debug run` through the API, timing each stage (progress is called before each one); saved() after
    each stage, so a call cut short keeps the stages it finished."""
    def tick(name: str, i: int, n: int) -> None:
        if i:
            clock.stop()
            saved(clock.seconds)
        clock.start(name)
    result = dd.run(model, ids, candidate=a.candidate, device=a.device, inject=a.planted, capture=capture,
                    save="stats", force=True, progress=tick, layers=a.run_layers)
    clock.stop()
    return result


def compare_generation(cfg, layer: int, device: str) -> dict:
    """One layer generated eagerly and fused (torch.compile'd chunks), module by module: seconds of each
    (synchronised; the fused compile warmed up first, on the layer's first modules, and timed apart) and
    whether every stored byte agrees."""
    names = [m.name for m in block_modules(cfg, layer)]
    eager, fused = SyntheticModel(cfg, device=device), SyntheticModel(cfg, device=device, fused=True)
    sync(device)
    t0 = time.perf_counter()
    for n in {fused.specs[n].fmt: n for n in names}.values():      # one module of each format compiles its graph
        fused.module(n)
    sync(device)
    out = {"layer": layer, "modules": len(names), "compile_s": time.perf_counter() - t0, "eager_s": 0.0,
           "fused_s": 0.0, "differing": []}
    for n in names:
        got = {}
        for key, model in (("eager_s", eager), ("fused_s", fused)):
            sync(device)
            t0 = time.perf_counter()
            got[key] = model.module(n)
            sync(device)
            out[key] += time.perf_counter() - t0
        a, b = got["eager_s"].tensors, got["fused_s"].tensors
        if a.keys() != b.keys() or not all(a[k].dtype == b[k].dtype and torch.equal(
                a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a):
            out["differing"].append(n)
    out["speedup"] = out["eager_s"] / out["fused_s"]
    print(f"generate layer {layer}: eager {out['eager_s']:.2f} s, fused {out['fused_s']:.2f} s "
          f"({out['speedup']:.1f}x; compile {out['compile_s']:.1f} s), {len(out['differing'])} of "
          f"{len(names)} modules differ", flush=True)
    return out


def named_by(verdict: dict) -> dict:
    """The site a run's verdict names: the NaN origin, else the first local divergence, else the first one."""
    return verdict["nan_origin"] or verdict["first_local_divergence"] or verdict["first_divergence"] or {}


def bisect_summary(r) -> dict:
    """One bisect axis's outcome, with the margins that decided it (error / tolerance of every probe)."""
    return {"judged_by": r.judged_by, "culprit": r.culprit_stage, "families": r.culprit_families,
            "message": r.message, "probes": len(r.probes),
            "error_over_tolerance": {p.what: p.rel_l2 / p.tolerance for p in r.probes}}


def each_fault(model, ids: torch.Tensor, a: argparse.Namespace) -> dict:
    """--each: no fault, then every planted fault, in a run and a bisection of its own (--bisect-axis): what
    each names, and in how long. The fault-free case shows neither calls a clean candidate faulty."""
    out = {}
    for spec in [None, *a.planted]:
        one = argparse.Namespace(**{**vars(a), "planted": [spec] if spec else []})
        layer = planted_layer([spec]) if spec else None
        t0 = time.perf_counter()
        entry = {}
        if not a.each_bisect_only:
            v = run(model, ids, one, None, StageClock(a.device), lambda seconds: None).verdict
            named = named_by(v)
            entry = {"run_status": v["status"], "run_named_site": named.get("site"),
                     "run_located": named.get("layer") == layer if spec else v["status"] == "clean"}
        t1 = time.perf_counter()
        axes = bisect(model, ids, a.candidate, a.bisect_axis, device=a.device,
                      faults=[parse_fault(spec)] if spec else [])
        t2 = time.perf_counter()
        want = f"layers.{layer}" if spec else None
        out[spec or "none"] = entry | {
            "run_s": t1 - t0, "bisect_s": t2 - t1, "bisect": {r.axis: bisect_summary(r) for r in axes},
            "bisect_located": {r.axis: r.culprit_stage == want for r in axes if r.axis != "ops"}}
        ran = f"run {entry['run_status']} at {entry['run_named_site']} ({t1 - t0:.0f} s); " if entry else ""
        print(f"{spec or 'no fault'}: {ran}bisect "
              + "; ".join(f"{r.axis} (judged by {r.judged_by}): {r.message}" for r in axes)
              + f" ({t2 - t1:.0f} s)", flush=True)
    return out


def planted_layer(faults: list[str]) -> int | None:
    layers = {int(m.group(1)) for f in faults if (m := re.search(r"@layers\.(\d+)", f))}
    return layers.pop() if len(layers) == 1 else None


def localisation(res: dict) -> dict | None:
    """Whether run and bisect name the planted fault's layer."""
    layer = planted_layer(res["planted"])
    if layer is None:
        return None
    steps = res["steps"]
    out = {"planted_layer": layer}
    if "run" in steps:
        out["run"] = steps["run"]["named_layer"] == layer
    for axis in ("layers", "stages"):
        if axis in steps.get("bisect", {}):
            out[f"bisect {axis}"] = steps["bisect"][axis]["culprit_stage"] == f"layers.{layer}"
    return out


def report(res: dict) -> None:
    b, steps = res["bytes"], res["steps"]
    print(f"\n{res['preset']}: {res['layers']} layers ({res['disk_layers']} from disk), {res['experts']} experts, "
          f"{res['tokens']} tokens, candidate {res['candidate']} on {res['gpu'] or res['device']}")
    print(f"one layer's stored weights {gib(b['layer_weights'])}, streams {gib(b['streams_bf16'])} bf16 / "
          f"{gib(b['streams_fp64'])} fp64")
    print(f"{'step':<22}{'seconds':>10}{'peak':>12}{'peak / (layer + fp64 streams)':>32}")
    for step, d in steps.items():
        ratio = "-" if d["peak_bytes"] is None else f"{d['peak_bytes'] / (b['layer_weights'] + b['streams_fp64']):.2f}"
        print(f"{step:<22}{d['seconds']:>10.1f}{gib(d['peak_bytes']):>12}{ratio:>32}")
    for name, per in res.get("per_layer_s", {}).items():
        layers = [t for s, t in per.items() if s.startswith("layers.")]
        disk = layers[:res["disk_layers"]]
        print(f"forward {name:<14} per layer: mean {sum(layers) / len(layers) * 1e3:.0f} ms, min "
              f"{min(layers) * 1e3:.0f}, max {max(layers) * 1e3:.0f} (disk layers "
              f"{', '.join(f'{t * 1e3:.0f}' for t in disk)} ms)")
    if "run" in steps and "capture" in steps:
        res["capture_overhead"] = steps["capture"]["seconds"] / steps["run"]["seconds"] - 1
        print(f"stats capture overhead: {res['capture_overhead']:+.1%}")
    if "run" in steps:
        print(f"run: {steps['run']['status']} at {steps['run']['named_site']}; ops without a kernel (run by the "
              f"reference): {', '.join(steps['run']['delegated_ops'] + steps['run']['declined_calls']) or 'none'}")
        if lc := steps["run"].get("logits_check"):
            print(f"logits: std {lc['std']:.3g} (bar {lc['std_range']}), {lc['nan_count']} NaN, {lc['inf_count']} Inf")
    for axis in ("layers", "ops", "stages"):
        if axis in steps.get("bisect", {}):
            print(f"bisect {axis}: {steps['bisect'][axis]['message']}")
    res["localised"] = localisation(res)
    if res["localised"]:
        print(f"planted {', '.join(res['planted'])}: located by {res['localised']}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="pro", help="pro (default), flash or tiny (CPU smoke runs)")
    ap.add_argument("--layers", type=int, default=None, help="main layers (default: all of the preset, 61)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: the preset's, 384)")
    ap.add_argument("--disk-layers", type=int, default=2, help="layers written to disk as a checkpoint")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="directory of that checkpoint; reused if it exists (default: a temporary one)")
    ap.add_argument("--tokens", type=int, default=1024, help="sequence length (default 1024)")
    ap.add_argument("--candidate", default="sim", help="candidate backend: sim (default), kernels, reference")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--planted", action="append", default=[], help="fault KIND@SITE[:ARG] in the candidate")
    ap.add_argument("--run-layers", default=None, metavar="A:B",
                    help="run/capture compare layers A..B-1 only (those below run on the reference alone): a "
                         "61-layer run split over device calls")
    ap.add_argument("--each", action="store_true",
                    help="run and bisect each --planted fault on its own (instead of the steps with all of them)")
    ap.add_argument("--each-bisect-only", action="store_true", help="--each without the runs")
    ap.add_argument("--bisect-axis", default="layers", help="layers (default) | ops | both | stages | all")
    ap.add_argument("--steps", default="generate,forward,run,capture,bisect", help="which steps to run")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each run/capture step given twice, "
                    "its second time (where a step's host time goes)")
    ap.add_argument("--eager-weights", action="store_true",
                    help="generate weights eagerly (default on a GPU: torch.compile'd, the same values)")
    ap.add_argument("--out", type=Path, required=True, help="write the results as JSON here")
    a = ap.parse_args(argv)
    steps = set(a.steps.split(","))
    dev = a.device
    if dev == "cpu":
        torch.set_num_threads(1)
    cfg = preset(a.preset, layers=a.layers, experts=a.experts)
    with tempfile.TemporaryDirectory(prefix="pro61-") as tmp:
        ckpt_dir = a.checkpoint or Path(tmp) / f"{cfg.name}-first{a.disk_layers}"
        res: dict = {"preset": cfg.name, "layers": cfg.n_layers, "experts": cfg.n_routed_experts,
                     "disk_layers": a.disk_layers, "tokens": a.tokens, "candidate": a.candidate, "device": dev,
                     "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else platform.processor(),
                     "torch": torch.__version__, "planted": a.planted, "bytes": layer_bytes(cfg), "steps": {}}
        res["bytes"]["streams_bf16"] = a.tokens * cfg.hc_mult * cfg.dim * 2
        res["bytes"]["streams_fp64"] = a.tokens * cfg.hc_mult * cfg.dim * 8
        def save() -> None:                   # after every step: a call cut short keeps what finished
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res, indent=2, default=str) + "\n")

        fused = dev.startswith("cuda") and not a.eager_weights
        res["fused_weights"] = fused
        if "generate" in steps:
            res["generate"] = compare_generation(cfg, min(a.disk_layers, cfg.n_layers - 1), dev)
            save()
        if not (ckpt_dir / "config.json").exists():
            measured("write_checkpoint", dev, res["steps"], lambda: make_checkpoint(
                ckpt_dir, cfg, first_layers=a.disk_layers, device=dev, fused=fused))
        model = SyntheticModel(cfg, device=dev, base=Checkpoint.open(ckpt_dir), fused=fused)
        ids = dd.make_tokens(model, seq_len=a.tokens)
        if a.each:
            res["each"] = each_fault(model, ids, a)
            save()
            return res
        faults = [parse_fault(f) for f in a.planted]
        if "forward" in steps:
            res["per_layer_s"] = {}
            for name, backend in (("reference", make_backend("reference", dev)),
                                  (a.candidate, candidate_backend(a.candidate, "reference", dev))):
                res["per_layer_s"][name] = measured(f"forward_{name}", dev, res["steps"],
                                                    lambda b=backend: forward(model, ids, b, dev))
                save()
        # in the order given; `warmup` is an untimed run (compiles, caches), and a step given twice keeps its
        # best time: single runs move with the host's noise
        for i, step in enumerate([s for s in a.steps.split(",") if s in ("warmup", "run", "capture")]):
            if step == "warmup":
                run(model, ids, a, None, StageClock(dev), lambda seconds: None)     # its result dropped at once
                continue
            clock = StageClock(dev)
            capture = Path(tmp) / f"run{i}.h5" if step == "capture" else None
            def partial(seconds, step=step):
                res.setdefault("unfinished", {})[step] = seconds
                save()
            before = res["steps"].get(step)
            profiler = cProfile.Profile() if a.profile and before is not None else None   # the step's second time
            if profiler:
                profiler.enable()
            r = measured(step, dev, res["steps"], lambda c=capture, k=clock: run(model, ids, a, c, k, partial))
            if profiler:
                profiler.disable()
                print(f"--- host profile of {step} (by own time)")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            if before is not None:
                now = res["steps"][step]
                now["seconds_each"] = before.get("seconds_each", [before["seconds"]]) + [now["seconds"]]
                now["seconds"] = min(now["seconds_each"])
                now["peak_bytes"] = max(now["peak_bytes"] or 0, before["peak_bytes"] or 0) or None
            res.get("unfinished", {}).pop(step, None)
            v = r.verdict
            named = named_by(v)
            res["steps"][step] |= {"status": v["status"], "logits_check": v.get("logits_check"),
                                   "named_site": named.get("site"),
                                   "named_layer": named.get("layer"), "delegated_ops": r.delegated_ops,
                                   "declined_calls": r.declined_calls, "timings_s": r.timings,
                                   "per_stage_s": clock.seconds}
            del r, v                   # its logits (1 GiB on the GPU) would count in the next step's peak
            save()
        if "memory" in steps and dev.startswith("cuda"):      # untimed: recording stacks slows the run
            with LivePeak() as lp:                             # a captured run: the run's blocks and the capture's
                run(model, ids, a, Path(tmp) / "memory.h5", StageClock(dev), lambda seconds: None)
            res["memory_at_peak"] = lp.summary()
            print_summary(res["memory_at_peak"])
            save()
        if "bisect" in steps:
            out = measured("bisect", dev, res["steps"], lambda: bisect(
                model, ids, a.candidate, a.bisect_axis, device=dev, faults=faults))
            res["steps"]["bisect"] |= {r.axis: {k: v for k, v in r.to_dict().items() if k != "probes"}
                                       | {"probes": len(r.probes)} for r in out}
        report(res)
        save()
    return res


def located(res: dict) -> bool:
    """Whether run and bisect named the layer of every planted fault."""
    if "each" in res:
        return all(r.get("run_located", True) and all(r["bisect_located"].values()) for r in res["each"].values())
    return res["localised"] is None or all(v for k, v in res["localised"].items() if k != "planted_layer")


if __name__ == "__main__":
    sys.exit(0 if located(main()) else 1)
