"""GPU correctness and speed table of the kernels (`dsv4debug kernels check`).

Every kernel runs on fresh random inputs at the model's real shapes and is compared with its references/ op:

- norms, rope, mHC: against the fp32 twin of the reference (the op on upcast inputs); bar "bf16": at most one
  bf16 ulp from the fp32 value everywhere (what one rounding of the exact result allows) and cosine >= 0.99999;
  mHC post/comb (fp32 outputs): max abs error <= 1e-4;
- NVFP4: codes, e4m3 scales and the global scale bit-identical to a bit-level torch quantiser
  (nvfp4.reference_quantize), dequantised values bit-identical to dsv4debug.backends.sim.nvfp4_act_quant;
- FP8 KV cache: the cache bytes written at each slot bit-identical to the serving layout built by torch
  (kv_cache.reference_pack), the paged read bit-identical to references' kv_qat (fp8_sim), and cosine of the
  round trip against the input >= 0.9997.

With bench=True each kernel is timed (CUDA-graph replay of many launches, rotating input sets larger than L2)
against the torch formulations of the same op in the same run: the reference op as written (eager),
torch.compile of it, and a fused torch op where one exists. Achieved bandwidth counts each input read once and
each output written once, against the device's device-to-device copy bandwidth measured in the same run.
"""
from __future__ import annotations

import datetime
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

SHAPES = ("pro", "flash", "tiny")
DEFAULT_SEQ = {"pro": 4096, "flash": 4096, "tiny": 256}


# --------------------------------------------------------------------------------------------------------
# Metrics and bars
# --------------------------------------------------------------------------------------------------------

def _chunks(n: int, step: int = 1 << 25):
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """cosine (fp64), max abs error, max error in bf16 ulps of the wanted value, non-finite count of got."""
    g, w = got.reshape(-1), want.reshape(-1)
    dot = gg = ww = 0.0
    max_err = max_ulp = 0.0
    nonfinite = 0
    for a, b in _chunks(g.numel()):
        x, y = g[a:b].double(), w[a:b].double()
        nonfinite += int((~torch.isfinite(x)).sum())
        dot += float((x * y).sum())
        gg += float((x * x).sum())
        ww += float((y * y).sum())
        err = (x - y).abs()
        max_err = max(max_err, float(err.max()) if err.numel() else 0.0)
        e = torch.floor(torch.log2(y.abs().clamp(min=2.0 ** -126)))
        max_ulp = max(max_ulp, float((err / torch.exp2(e - 7)).max()) if err.numel() else 0.0)
    cos = dot / math.sqrt(gg * ww) if gg > 0 and ww > 0 else (1.0 if gg == ww else 0.0)
    return {"cos": cos, "max_err": max_err, "max_ulp": max_ulp, "nan": nonfinite}


def bits_equal(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, int]:
    """Bit-identical (dtype and every bit, signed zeros included); number of differing elements."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, -1
    itype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    diff = int((got.contiguous().view(itype) != want.contiguous().view(itype)).sum())
    return diff == 0, diff


@dataclass
class Row:
    op: str
    case: str
    shape: str
    bar: str
    passed: bool
    cos: float | None = None
    max_err: float | None = None
    max_ulp: float | None = None
    nan: int = 0
    mismatches: int | None = None
    note: str = ""
    bench: dict[str, Any] = field(default_factory=dict)
    not_run: str = ""                       # why the check did not run (no kernel for this GPU); passed stays True

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _archs(kernel: str) -> tuple[str, ...]:
    from ._common import REGISTRY
    return REGISTRY[kernel].archs


def bf16_row(op, case, shape, got, want, note="") -> Row:
    m = compare(got, want)
    ok = m["nan"] == 0 and m["max_ulp"] <= 1.0 and m["cos"] >= 0.99999
    return Row(op, case, shape, "bf16: <=1 ulp of fp32 ref, cos>=0.99999", ok, m["cos"], m["max_err"],
               m["max_ulp"], m["nan"], note=note)


def sum_row(op, case, shape, got, want, terms_abs, note="") -> Row:
    """Bar for weighted sums of a few terms (mHC, the rope rotation): one bf16 rounding of the fp32 value plus 2^-19 of the summed
    term magnitudes (16 fp32 ulps: accumulation order, FMA contraction and the kernel's own fp32 weights).
    Where the terms cancel, the bf16 ulp of the tiny result is far below the fp32 noise of the terms, so a
    pure ulp bar would fail any correct implementation that does not sum in the reference's exact order."""
    m = compare(got, want)
    g, w, t = got.double(), want.double(), terms_abs.double()
    e = torch.floor(torch.log2(w.abs().clamp(min=2.0 ** -126)))
    allow = torch.exp2(e - 7) + t * 2.0 ** -19
    worst = float(((g - w).abs() / allow).max())
    ok = m["nan"] == 0 and worst <= 1.0 and m["cos"] >= 0.99999
    return Row(op, case, shape, "bf16 sum: err <= 1 ulp + 2^-19 sum|terms|, cos>=0.99999", ok, m["cos"],
               m["max_err"], None, m["nan"], note=(note + "; " if note else "") + f"err/allowance {worst:.3g}")


def abs_row(op, case, shape, got, want, tol=1e-4) -> Row:
    m = compare(got, want)
    ok = m["nan"] == 0 and m["max_err"] <= tol
    return Row(op, case, shape, f"fp32: max abs err <= {tol:g}", ok, m["cos"], m["max_err"], None, m["nan"])


def exact_row(op, case, shape, got, want, what: str, cos_pair=None, cos_bar=None, ref_cos=None) -> Row:
    """Bit-identity bar; with cos_pair=(got_part, input_part) also the format's cosine against the input,
    compared at the 4 decimals the field notes report it with (ref_cos: the reference simulation's own)."""
    ok, diff = bits_equal(got, want)
    m = compare(got.float() if got.is_floating_point() else got.double(),
                want.float() if want.is_floating_point() else want.double()) if got.shape == want.shape else {}
    bar = f"bit-identical to {what}"
    note = ""
    if cos_pair is not None:
        c = compare(cos_pair[0].float(), cos_pair[1].float())["cos"]
        note = f"cos vs input {c:.6f}" + (f" (reference simulation: {ref_cos:.6f})" if ref_cos is not None else "")
        bar += f", cos vs input >= {cos_bar} at 4 decimals"
        ok = ok and round(c, 4) >= cos_bar
    return Row(op, case, shape, bar, ok, m.get("cos"), m.get("max_err"), None, m.get("nan", 0), diff, note)


# --------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------

L2_BYTES = 60 << 20


def n_sets(bytes_per_call: int) -> int:
    """Input sets to rotate through so that one pass over them is several times the L2."""
    return max(1, min(8, math.ceil(4 * L2_BYTES / max(bytes_per_call, 1))))


def time_fn(fn: Callable[[int], Any], nsets: int, reps: int = 20) -> dict[str, Any]:
    """Median microseconds per call of fn(i % nsets): CUDA-graph replay (device time) and eager calls
    (includes the host's launch cost). Graph capture falls back to eager timing if it fails."""
    for i in range(nsets):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def eager() -> float:
        samples = []
        for _ in range(5):
            start.record()
            for i in range(reps):
                fn(i % nsets)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / reps)
        return sorted(samples)[len(samples) // 2]

    out: dict[str, Any] = {"eager_us": eager()}
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(0)                                   # warm on the side stream before capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for i in range(reps):
                fn(i % nsets)
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(7):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / reps)
        out["graph_us"] = sorted(samples)[len(samples) // 2]
        out["us"] = out["graph_us"]
        out["mode"] = "graph"
    except Exception as e:                          # noqa: BLE001 - recorded
        out["us"] = out["eager_us"]
        out["mode"] = f"eager (graph capture failed: {str(e).splitlines()[0][:120]})"
    return out


def copy_bandwidth() -> dict[str, Any]:
    """The device's copy bandwidth (read + write) of 1 GiB: the faster of eager calls and graph replay. Under
    graph replay a device-to-device copy_ measured 2.77 TB/s on the H200, eagerly 4.19 TB/s (2026-12-02/03),
    and kernels timed by replay reached 132-153% of the slower figure: the bars read against the faster."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = time_fn(lambda i: dst.copy_(src), 1, reps=10)
    us = min(t["eager_us"], t.get("graph_us", t["eager_us"]))
    return {"bytes_per_copy": 2 * n, "us": us, "GBps": 2 * n / us / 1e3, "eager_GBps": 2 * n / t["eager_us"] / 1e3,
            "graph_GBps": 2 * n / t["graph_us"] / 1e3 if "graph_us" in t else None}


_COMPILED: dict[Any, Any] = {}


def compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def bench(kernel: Callable[[int], Any], baselines: dict[str, Callable[[int], Any]], nbytes: int, nsets: int,
          copy_gbps: float | None, device: torch.device) -> dict[str, Any]:
    res: dict[str, Any] = {"bytes": nbytes, "sets": nsets}
    k = time_fn(kernel, nsets)
    res["kernel"] = k
    res["baselines"] = {}
    for name, fn in baselines.items():
        try:
            res["baselines"][name] = time_fn(fn, nsets)
        except Exception as e:                      # noqa: BLE001 - a baseline that cannot run is reported
            res["baselines"][name] = {"error": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}
    timed = {n: b["us"] for n, b in res["baselines"].items() if "us" in b}
    if timed:
        best = min(timed, key=timed.get)
        res["torch_best"] = best
        res["torch_best_us"] = timed[best]
        res["speedup"] = timed[best] / k["us"]
    res["GBps"] = nbytes / k["us"] / 1e3
    if copy_gbps:
        res["of_copy"] = res["GBps"] / copy_gbps
    res["copy_same_bytes"] = same_bytes_copy(nbytes, nsets, device)
    res["of_copy_same_bytes"] = res["copy_same_bytes"]["us"] / k["us"]
    return res


def same_bytes_copy(nbytes: int, nsets: int, device: torch.device) -> dict[str, Any]:
    """A copy_ moving the kernel's own bytes (half read, half written), timed the same way over as many
    buffer sets: the device's copy rate at that size. A few-MB kernel is bound by launch and ramp-up as much as
    by bandwidth, and the 1 GiB copy's rate is out of reach for it; this says how far it is from a copy."""
    half = max(nbytes // 2, 16)
    src = [torch.empty(half, dtype=torch.uint8, device=device) for _ in range(nsets)]
    dst = [torch.empty_like(t) for t in src]
    t = time_fn(lambda i: dst[i].copy_(src[i]), nsets)
    return {"us": t["us"], "mode": t["mode"], "GBps": 2 * half / t["us"] / 1e3}


# --------------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------------

def _bf16(shape, scale=1.0, gen=None):
    return (torch.randn(*shape, device=gen.device, generator=gen) * scale).to(torch.bfloat16)


def _shape(*dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


class Checker:
    def __init__(self, preset: str, seq: int | None, do_bench: bool, compile_baselines: bool = True,
                 seed: int = 0, log: Callable[[str], None] = print, device: str = "cuda"):
        self.dev = torch.device(device)
        from dsv4debug.config import preset as make_preset
        self.cfg = make_preset(preset)
        self.preset = preset
        self.S = seq or DEFAULT_SEQ[preset]
        self.do_bench = do_bench
        self.compile_baselines = compile_baselines
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.log = log
        self.rows: list[Row] = []
        self.copy = copy_bandwidth() if do_bench else None
        # the GPU's kernel target (None for the CPU dry run, whose stand-ins run everything)
        from ._common import kernel_arch
        self.arch = kernel_arch(self.dev) if self.dev.type == "cuda" else None

    # -- helpers
    def add(self, row: Row, bench_fn: Callable[[], dict] | None = None) -> None:
        if bench_fn is not None and self.do_bench:
            try:
                row.bench = bench_fn()
            except Exception as e:                  # noqa: BLE001
                row.bench = {"error": str(e).splitlines()[0][:200] if str(e) else type(e).__name__}
        self.rows.append(row)
        self.log(f"  {row.op:14s} {row.case:22s} {row.shape:20s} {'PASS' if row.passed else 'FAIL'}"
                 + (f"  cos={row.cos:.7f}" if row.cos is not None else "")
                 + (f" max_ulp={row.max_ulp:.3g}" if row.max_ulp is not None else "")
                 + (f" mismatches={row.mismatches}" if row.mismatches is not None else "")
                 + (f"  x{row.bench['speedup']:.2f} vs {row.bench['torch_best']}" if row.bench.get("speedup")
                    else ""))

    def _bench(self, kernel, baselines, nbytes):
        base = dict(baselines)
        if self.compile_baselines:
            for name, fn in list(baselines.items()):
                if name.startswith("eager") and getattr(fn, "_compilable", None) is not None:
                    base["compiled"] = fn._compilable
        copy = self.copy["GBps"] if self.copy else None
        return lambda: bench(kernel, base, nbytes, self._sets, copy, self.dev)

    def sets(self, nbytes: int) -> int:
        self._sets = n_sets(nbytes) if self.do_bench else 1
        return self._sets

    # -- ops
    FAMILIES = ("norm", "rope", "nvfp4", "kv_cache", "mhc", "gemm")
    KERNELS: ClassVar[dict[str, tuple[str, ...]]] = {          # the kernels each family's checks launch
        "norm": ("rmsnorm",), "rope": ("rope",), "nvfp4": ("nvfp4_amax", "nvfp4_quant", "nvfp4_quant_onepass", "nvfp4_dequant"),
        "kv_cache": ("kv_write", "kv_read"), "mhc": ("hc_mix", "hc_pre_apply", "hc_post"),
        "gemm": ("fp8_act_quant", "fp8_block_gemm", "w4a16_gemm", "w4a16_gemv")}

    def not_built(self, family: str) -> list[str]:
        """The family's kernels that are not built for this GPU (the Hopper-only GEMMs on a Blackwell)."""
        return [k for k in self.KERNELS[family] if self.arch is not None and self.arch not in _archs(k)]

    def _check_gemms(self):
        from .check_gemm import check_gemms
        check_gemms(self)

    def run(self, families=None) -> list[Row]:
        """Every family's checks (or those named); a family whose check raises gets a failing row."""
        t0 = time.perf_counter()
        steps = {"norm": self.check_norms, "rope": self.check_rope, "nvfp4": self.check_nvfp4,
                 "kv_cache": self.check_kv, "mhc": self.check_mhc, "gemm": self._check_gemms}
        for fam, fn in steps.items():
            if families and fam not in families:
                continue
            missing = self.not_built(fam)
            if missing:                             # said in the table, not skipped silently, and not a failure
                archs = sorted({a for k in missing for a in _archs(k)})
                self.rows.append(Row(fam, f"not built for {self.arch}", "-", "no kernel to check on this GPU", True,
                                     not_run=f"{', '.join(missing)}: built for {', '.join(archs)} only"))
                self.log(f"  {fam:14s} not run: {self.rows[-1].not_run}")
                continue
            try:
                fn()
            except Exception as e:                  # noqa: BLE001 - a crash is a failed check, not a lost table
                import traceback
                self.log(traceback.format_exc(limit=6))
                self.rows.append(Row(fam, "check raised", "-", "runs without error", False,
                                     note=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
        self.seconds = time.perf_counter() - t0
        return self.rows

    def check_norms(self):
        import dsv4_references as ref

        from . import norm as K
        cfg, S, eps = self.cfg, self.S, self.cfg.norm_eps
        for case, n in (("attn_norm", cfg.dim), ("q_norm", cfg.q_lora_rank), ("kv_norm", cfg.head_dim)):
            nbytes = S * n * 2 * 2 + n * 4
            k = self.sets(nbytes)
            xs = [_bf16((S, n), 2.0, self.gen) for _ in range(k)]
            w = 1 + 0.05 * torch.randn(n, device=self.dev, generator=self.gen)
            wb = w.to(torch.bfloat16)
            got = K.rms_norm(xs[0], w, eps)
            self.add(bf16_row("rms_norm", case, _shape(S, n), got, ref.rms_norm(xs[0].float(), w, eps)),
                     self._bench(lambda i, xs=xs, w=w: K.rms_norm(xs[i], w, eps),
                                 {"eager": _with_compiled(lambda i, xs=xs, w=w: ref.rms_norm(xs[i], w, eps),
                                                          lambda i, xs=xs, w=w: compiled(ref.rms_norm)(xs[i], w, eps)),
                                  # the fused torch kernel needs the weight in the input dtype (speed baseline)
                                  "F.rms_norm": lambda i, xs=xs, wb=wb, n=n:
                                      torch.nn.functional.rms_norm(xs[i], (n,), wb, eps)},
                                 nbytes))
        H, d = cfg.n_heads, cfg.head_dim
        nbytes = S * H * d * 4
        k = self.sets(nbytes)
        qs = [_bf16((S, H, d), 1.0, self.gen) for _ in range(k)]
        got = K.head_rms_norm(qs[0], eps)
        self.add(bf16_row("head_rms_norm", "q_head_norm", _shape(S, H, d), got,
                          ref.head_rms_norm(qs[0].float(), eps)),
                 self._bench(lambda i: K.head_rms_norm(qs[i], eps),
                             {"eager": _with_compiled(lambda i: ref.head_rms_norm(qs[i], eps),
                                                      lambda i: compiled(ref.head_rms_norm)(qs[i], eps)),
                              "F.rms_norm": lambda i: torch.nn.functional.rms_norm(qs[i], (d,), None, eps)},
                             nbytes))

    def check_rope(self):
        import dsv4_references as ref

        from . import rope as K
        cfg, S = self.cfg, self.S
        H, d, r = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        plain = ref.rope_freqs(S, r, cfg.rope_theta).to(self.dev)
        yarn = ref.rope_freqs(S, r, cfg.compress_rope_theta, cfg.original_seq_len, cfg.rope_factor,
                              cfg.beta_fast, cfg.beta_slow).to(self.dev)
        cs_yarn = K.cos_sin(yarn)
        cs_plain = K.cos_sin(plain)
        for case, heads, freqs, cs, inverse in (("q_rope (yarn)", H, yarn, cs_yarn, False),
                                                ("o_rope inverse (yarn)", H, yarn, cs_yarn, True),
                                                ("kv_rope (plain)", 0, plain, cs_plain, False)):
            shape = (S, heads, d) if heads else (S, d)
            nbytes = 2 * math.prod(shape) * 2 + cs.numel() * 4
            k = self.sets(nbytes)
            xs = [_bf16(shape, 1.0, self.gen) for _ in range(k)]
            got = K.rope(xs[0], freqs, inverse)
            want = ref.apply_rope(xs[0].float(), freqs, inverse)
            bf16_ref = ref.apply_rope(xs[0], freqs, inverse)
            same = bits_equal(got, bf16_ref)[1]
            terms = _rope_terms(xs[0], r)
            self.add(sum_row("rope", case, _shape(*shape), got, want, terms,
                             note=f"{same} elements differ from the bf16 reference"),
                     self._bench(lambda i, xs=xs, freqs=freqs, cs=cs, inverse=inverse: K.rope(xs[i], freqs, inverse),
                                 {"eager": _with_compiled(lambda i, xs=xs, freqs=freqs, cs=cs, inverse=inverse: ref.apply_rope(xs[i], freqs, inverse),
                                                          lambda i, xs=xs, freqs=freqs, cs=cs, inverse=inverse: compiled(_rope_real)(xs[i], cs, inverse))},
                                 nbytes))
            if heads and not inverse:           # the in-place serving form: only the rope dims move
                x2 = xs[0].clone()
                K.rope_(x2, freqs, inverse)
                nb_in = 2 * S * heads * r * 2 + cs.numel() * 4
                self.add(sum_row("rope", "q_rope in place", _shape(*shape), x2, want, terms),
                         self._bench(lambda i, xs=xs, freqs=freqs, cs=cs, inverse=inverse: K.rope_(xs[i], freqs, inverse),
                                     {"eager": _with_compiled(lambda i, xs=xs, freqs=freqs, cs=cs, inverse=inverse: _rope_inplace_torch(xs[i], cs, inverse),
                                                              lambda i, xs=xs, freqs=freqs, cs=cs, inverse=inverse: compiled(_rope_inplace_torch)(
                                                                  xs[i], cs, inverse))},
                                     nb_in))

    def check_nvfp4(self):
        from dsv4debug.backends.sim import nvfp4_act_quant

        from . import nvfp4 as K
        cfg, S = self.cfg, self.S
        n = cfg.dim
        nbytes = S * n * 2 + S * n // 2 + S * n // 16
        k = self.sets(nbytes)
        xs = []
        for _ in range(k):
            x = torch.randn(S, n, device=self.dev, generator=self.gen) \
                * torch.exp(torch.randn(S, 1, device=self.dev, generator=self.gen))
            x[0, :32] = 0.0                     # zero blocks and a negative zero: the bs == 0 path
            x[1, :16] = -0.0
            x[2, 5] = 300.0                     # an outlier that sets the global scale
            xs.append(x.to(torch.bfloat16))
        qs = [K.quantize(x) for x in xs]
        codes, scales, g = qs[0]
        rc, rs, rg = K.reference_quantize(xs[0])
        ok_c, dc = bits_equal(codes, rc)
        ok_s, ds = bits_equal(scales, rs)
        ok_g, _ = bits_equal(g, rg)
        row = Row("nvfp4", "quantise codes+scales", _shape(S, n), "bit-identical to torch bit-level quantiser",
                  ok_c and ok_s and ok_g, mismatches=dc + ds + (0 if ok_g else 1),
                  note=f"codes {dc} / scales {ds} / global {'ok' if ok_g else 'differs'}")
        torch_quant = {"eager": _with_compiled(lambda i: K.reference_quantize(xs[i]),
                                               lambda i: compiled(K.reference_quantize)(xs[i]))}
        self.add(row, self._bench(lambda i: K.quantize(xs[i]), torch_quant, nbytes))
        # the same work in two kernels (the global amax, a read of x, then the quantise given g) side by side,
        # and each of them measured against the copy rate on its own bytes
        two = K.quantize(xs[0], K.global_scale(K.amax(xs[0])))
        ok = all(bits_equal(a, b)[0] for a, b in zip(two, (codes, scales, g)))
        self.add(Row("nvfp4", "quantise, two kernels", _shape(S, n), "bit-identical to the one-pass row", ok),
                 self._bench(lambda i: K.quantize(xs[i], K.global_scale(K.amax(xs[i]))), torch_quant, nbytes))
        self.add(exact_row("nvfp4", "amax (global scale)", _shape(S, n), K.amax(xs[0]),
                           xs[0].float().abs().amax().reshape(1), "torch abs().amax()"),
                 self._bench(lambda i: K.amax(xs[i]), {"eager": _with_compiled(
                     lambda i: _abs_amax(xs[i]), lambda i: compiled(_abs_amax)(xs[i]))}, S * n * 2))
        gs = [K.global_scale(x.float().abs().amax()) for x in xs]
        given = K.quantize(xs[0], gs[0])
        ok = all(bits_equal(a, b)[0] for a, b in zip(given, (codes, scales, g)))
        self.add(Row("nvfp4", "quantise, given g", _shape(S, n), "bit-identical to the row above", ok),
                 self._bench(lambda i: K.quantize(xs[i], gs[i]),
                             {"eager": _with_compiled(lambda i: K.reference_quantize(xs[i], gs[i]),
                                                      lambda i: compiled(K.reference_quantize)(xs[i], gs[i]))},
                             nbytes))
        got = K.dequantize(codes, scales, g)
        self.add(exact_row("nvfp4", "dequantise", _shape(S, n), got, nvfp4_act_quant(xs[0]),
                           "sim.nvfp4_act_quant"),
                 self._bench(lambda i: K.dequantize(*qs[i]),
                             {"eager": _with_compiled(lambda i: K.reference_dequantize(*qs[i]),
                                                      lambda i: compiled(K.reference_dequantize)(*qs[i]))},
                             nbytes))
        self.add(exact_row("nvfp4", "round trip", _shape(S, n), K.act_quant(xs[0]), nvfp4_act_quant(xs[0]),
                           "sim.nvfp4_act_quant"),
                 self._bench(lambda i: K.act_quant(xs[i]),
                             {"eager": _with_compiled(lambda i: nvfp4_act_quant(xs[i]),
                                                      lambda i: compiled(nvfp4_act_quant)(xs[i]))},
                             S * n * 2 * 2))


    def check_kv(self):
        import dsv4_references as ref

        from . import kv_cache as K
        cfg, S = self.cfg, self.S
        d, r, bs = cfg.head_dim, cfg.rope_head_dim, 64
        tb = K.token_bytes(d - r, r)
        nbytes = S * d * 2 + S * tb
        k = self.sets(nbytes)
        xs = []
        for _ in range(k):
            kv = torch.randn(S, d, device=self.dev, generator=self.gen)     # unit RMS, as after kv_norm
            kv[0, :64] = 1e-5                   # amax below the 1e-4 clamp
            kv[1, 64:128] *= 1e4                # scales above 1 (ue8m0 bytes >= 128)
            xs.append(kv.to(torch.bfloat16))
        nblocks = -(-S // bs)
        cache = K.new_cache(nblocks + 3, bs, d - r, r, self.dev)
        perm = torch.randperm(nblocks + 3, device=self.dev, generator=self.gen)[:nblocks]
        pos = torch.arange(S, device=self.dev)
        slots = (perm[pos // bs] * bs + pos % bs).to(torch.int64)
        K.write(xs[0], slots, cache, r)
        flat = cache.view(-1, tb)
        self.add(exact_row("kv_cache", "quantise + paged write", _shape(S, d), flat[slots],
                           K.reference_pack(xs[0], r), "torch serving-layout packer"),
                 self._bench(lambda i: K.write(xs[i], slots, cache, r),
                             {"eager": _with_compiled(lambda i: flat.index_copy_(0, slots, K.reference_pack(xs[i], r)),
                                                      lambda i: flat.index_copy_(0, slots, compiled(K.reference_pack)(
                                                          xs[i], r)))},
                             nbytes))
        K.write(xs[0], slots, cache, r)         # the write benchmark above left the last input set there
        bt = perm.to(torch.int32).unsqueeze(0).contiguous()
        lens = torch.tensor([S], dtype=torch.int32, device=self.dev)
        starts = torch.zeros(1, dtype=torch.int32, device=self.dev)
        out = torch.empty(S, d, dtype=torch.bfloat16, device=self.dev)
        K.read_into(cache, bt, lens, starts, out, S, r)
        want = ref.kv_qat(xs[0], r)
        # the format's cosine on the unit-RMS (post kv_norm) tokens, not on the planted edge-case rows 0-1
        ref_cos = compare(want[2:].float(), xs[0][2:].float())["cos"]
        self.add(exact_row("kv_cache", "paged read + dequantise", _shape(S, d), out, want, "kv_qat (fp8_sim)",
                           cos_pair=(out[2:], xs[0][2:]), cos_bar=0.9997, ref_cos=ref_cos),
                 self._bench(lambda i: K.read_into(cache, bt, lens, starts, out, S, r),
                             {"eager": _with_compiled(lambda i: K.reference_unpack(flat[slots], r),
                                                      lambda i: compiled(_gather_unpack)(flat, slots, r))},
                             nbytes))
        # the backend op: the whole serving round trip, against the reference's simulation
        rt = K.round_trip(xs[0], r, bs)[0]
        self.add(exact_row("kv_cache", "round trip (backend op)", _shape(S, d), rt, want, "kv_qat (fp8_sim)",
                           cos_pair=(rt[2:], xs[0][2:]), cos_bar=0.9997, ref_cos=ref_cos),
                 self._bench(lambda i: (K.write(xs[i], slots, cache, r),
                                        K.read_into(cache, bt, lens, starts, out, S, r)),
                             {"eager": _with_compiled(lambda i: ref.kv_qat(xs[i], r),
                                                      lambda i: compiled(ref.kv_qat)(xs[i], r))},
                             2 * nbytes))

    def check_mhc(self):
        import dsv4_references as ref

        from . import mhc as K
        cfg, S = self.cfg, self.S
        M, D = cfg.hc_mult, cfg.dim
        nmix = (2 + M) * M
        iters, neps, heps = cfg.hc_sinkhorn_iters, cfg.norm_eps, cfg.hc_eps
        g = self.gen
        fn = torch.randn(nmix, M * D, device=self.dev, generator=g) / math.sqrt(M * D)
        scale = 1 + 0.05 * torch.randn(3, device=self.dev, generator=g)
        base = 0.01 * torch.randn(nmix, device=self.dev, generator=g)
        base[2 * M:] += 3 * torch.eye(M, device=self.dev).flatten()
        nbytes = S * M * D * 2 + S * D * 2 + S * (M + M * M) * 4
        k = self.sets(nbytes)
        xs = [_bf16((S, M, D), 1.0, g) for _ in range(k)]
        _, post, comb = K.hc_pre(xs[0], fn, scale, base, iters, neps, heps)    # post, comb: the default path
        wy, wpost, wcomb = ref.hc_pre(xs[0].float(), fn, scale, base, iters, neps, heps)
        xa = xs[0].float().abs()
        pre_torch = {"eager": _with_compiled(lambda i: ref.hc_pre(xs[i], fn, scale, base, iters, neps, heps),
                                             lambda i: compiled(ref.hc_pre)(xs[i], fn, scale, base, iters, neps,
                                                                            heps))}
        # the whole op by each path the launcher has, side by side: the two kernels and the opt-in one pass
        paths = {True: "one pass, hc_fused", False: "two kernels"}
        if not K.fused_fits(D, M, _sms(self.dev)):
            paths.pop(True)
        for fused, how in paths.items():
            self.add(sum_row("hc_pre", f"y (weighted stream sum; {how})", _shape(S, M, D),
                             K.hc_pre(xs[0], fn, scale, base, iters, neps, heps, fused=fused)[0], wy,
                             xa.sum(-2)),                     # pre <= 1 + eps
                     self._bench(lambda i, f=fused: K.hc_pre(xs[i], fn, scale, base, iters, neps, heps, fused=f),
                                 pre_torch, nbytes))
        self.add(abs_row("hc_pre", "post", _shape(S, M), post, wpost))
        self.add(abs_row("hc_pre", "comb (Sinkhorn)", _shape(S, M, M), comb, wcomb))
        from dsv4_references.mhc import _mixes

        def mixes_row(op: str, w):
            """hc_mix on the projection w, timed on its own traffic (x, w, the mixes); -> the fp32 mixes."""
            want = _mixes(xs[0].float(), w, neps)
            self.add(abs_row(op, "mixes (hc_mix kernel)", _shape(S, w.size(0)), K.hc_mixes(xs[0], w, neps), want,
                             tol=1e-4),
                     self._bench(lambda i: K.hc_mixes(xs[i], w, neps),
                                 {"eager": _with_compiled(lambda i: _mixes(xs[i], w, neps),
                                                          lambda i: compiled(_mixes)(xs[i], w, neps))},
                                 S * M * D * 2 + w.numel() * 4 + S * w.size(0) * 4))
            return want

        # hc_pre's two kernels, each timed on its own traffic: the mixes (24 fp32 dot products a token over x),
        # then the Sinkhorn and the weighted sum, fed the fp32 mixes
        wm = mixes_row("hc_pre", fn)
        self.add(sum_row("hc_pre", "y (hc_pre_apply kernel)", _shape(S, M, D),
                         K.hc_pre_apply(xs[0], wm, scale, base, iters, heps)[0],
                         ref.hc_pre_apply(xs[0].float(), wm, scale, base, iters, heps)[0], xa.sum(-2)),
                 self._bench(lambda i: K.hc_pre_apply(xs[i], wm, scale, base, iters, heps),
                             {"eager": _with_compiled(
                                 lambda i: ref.hc_pre_apply(xs[i], wm, scale, base, iters, heps),
                                 lambda i: compiled(ref.hc_pre_apply)(xs[i], wm, scale, base, iters, heps))},
                             nbytes))
        # hc_post
        a_s = [_bf16((S, D), 1.0, g) for _ in range(k)]
        nb_post = S * D * 2 + 2 * S * M * D * 2 + S * (M + M * M) * 4
        got = K.hc_post(a_s[0], xs[0], wpost, wcomb)
        terms = (wpost.abs().unsqueeze(-1) * a_s[0].float().abs().unsqueeze(-2)
                 + (wcomb.abs().unsqueeze(-1) * xa.unsqueeze(-2)).sum(-3))
        self.add(sum_row("hc_post", "new streams", _shape(S, M, D), got,
                         ref.hc_post(a_s[0].float(), xs[0].float(), wpost, wcomb), terms),
                 self._bench(lambda i: K.hc_post(a_s[i], xs[i], wpost, wcomb),
                             {"eager": _with_compiled(lambda i: ref.hc_post(a_s[i], xs[i], wpost, wcomb),
                                                      lambda i: compiled(ref.hc_post)(a_s[i], xs[i], wpost, wcomb))},
                             nb_post))
        # hc_head (ParallelHead): 4 mixes, sigmoid weights, no Sinkhorn
        hfn = torch.randn(M, M * D, device=self.dev, generator=g) / math.sqrt(M * D)
        hscale = 1 + 0.05 * torch.randn(1, device=self.dev, generator=g)
        hbase = 0.01 * torch.randn(M, device=self.dev, generator=g)
        head_torch = {"eager": _with_compiled(lambda i: ref.hc_head(xs[i], hfn, hscale, hbase, neps, heps),
                                              lambda i: compiled(ref.hc_head)(xs[i], hfn, hscale, hbase, neps,
                                                                              heps))}
        want = ref.hc_head(xs[0].float(), hfn, hscale, hbase, neps, heps)
        mixes_row("hc_head", hfn)
        for fused, how in paths.items():
            self.add(sum_row("hc_head", f"y ({how})", _shape(S, M, D),
                             K.hc_head(xs[0], hfn, hscale, hbase, neps, heps, fused=fused), want, xa.sum(-2)),
                     self._bench(lambda i, f=fused: K.hc_head(xs[i], hfn, hscale, hbase, neps, heps, fused=f),
                                 head_torch, S * M * D * 2 + S * D * 2))


def _sms(dev) -> int:
    """SMs of the device the check runs on (0 for the CPU dry run)."""
    dev = torch.device(dev)
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0


def _abs_amax(t):
    return t.abs().amax()


def _with_compiled(eager, compiled_fn):
    eager._compilable = compiled_fn
    return eager


def _rope_terms(x, r: int):
    """|x0| + |x1| of each interleaved rope pair (the magnitudes a rotated value sums), 0 on the other dims,
    which rope must leave bit-identical."""
    t = torch.zeros_like(x, dtype=torch.float32)
    pair = x[..., -r:].float().abs().unflatten(-1, (r // 2, 2)).sum(-1, keepdim=True)
    t[..., -r:] = pair.expand(*pair.shape[:-1], 2).flatten(-2)
    return t


def _rope_real(x, cs, inverse: bool):
    """RoPE in real arithmetic (what torch.compile fuses best): x [S, ..., d], cs [S, r/2, 2]."""
    r = 2 * cs.size(1)
    shape = (cs.size(0),) + (1,) * (x.dim() - 2) + (cs.size(1),)
    c, s = cs[..., 0].reshape(shape), cs[..., 1].reshape(shape)
    s = -s if inverse else s
    xr = x[..., -r:].float().unflatten(-1, (-1, 2))
    a, b = xr[..., 0], xr[..., 1]
    rot = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-r], rot], -1)


def _rope_inplace_torch(x, cs, inverse: bool):
    r = 2 * cs.size(1)
    x[..., -r:] = _rope_real(x[..., -r:], cs, inverse)
    return x


def _gather_unpack(flat, slots, rope):
    from .kv_cache import reference_unpack
    return reference_unpack(flat[slots], rope)


# --------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    from importlib.metadata import version
    info: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda}
    try:
        info["cutedsl"] = version("nvidia-cutlass-dsl")
    except Exception:                               # noqa: BLE001
        info["cutedsl"] = "unknown"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "sm": f"sm_{p.major}{p.minor}", "sms": p.multi_processor_count,
                 "gpu_memory_gib": round(p.total_memory / 2 ** 30, 1)}
    return info


def run_checks(preset: str = "pro", seq: int | None = None, do_bench: bool = False,
               compile_baselines: bool = True, log: Callable[[str], None] = print,
               device: str = "cuda", families=None) -> dict[str, Any]:
    from . import load_all
    from ._common import _COMPILE_SECONDS
    load_all()
    torch.backends.cuda.matmul.allow_tf32 = False
    chk = Checker(preset, seq, do_bench, compile_baselines, log=log, device=device)
    log(f"kernels check: preset {preset}, {chk.S} tokens, bench={do_bench}")
    rows = chk.run(families)
    return {"env": environment(), "preset": preset, "seq": chk.S, "bench": do_bench,
            "copy_bandwidth": chk.copy, "seconds": round(chk.seconds, 1),
            "compile_seconds": {f"{k[0]}[{','.join(f'{a}={b}' for a, b in k[1])}]@{k[2]}": round(v, 3)
                                for k, v in _COMPILE_SECONDS.items()},
            "passed": all(r.passed for r in rows), "not_run": [r.op for r in rows if r.not_run],
            "rows": [r.as_dict() for r in rows]}


def result_label(row: dict[str, Any]) -> str:
    """A row's result as the tables print it: skip (no kernel for this GPU), pass or FAIL."""
    return "skip" if row.get("not_run") else "pass" if row["passed"] else "FAIL"


def format_rows(doc: dict[str, Any]) -> list[str]:
    """Plain-text table lines of a run_checks document."""
    def f(v, spec=".3g"):
        return "-" if v is None else (format(v, spec) if isinstance(v, float) else str(v))
    head = f"{'op':14s} {'case':26s} {'shape':20s} {'cos':>10s} {'max err':>9s} {'ulp':>6s} {'NaN':>4s} {'ok':4s}"
    if doc["bench"]:
        head += (f" {'kernel us':>10s} {'torch us':>10s} {'best torch':>12s} {'speedup':>8s} {'GB/s':>6s} {'%copy':>6s}"
                 f" {'%same':>6s}")
    lines = [head]
    for r in doc["rows"]:
        line = (f"{r['op']:14s} {r['case'][:26]:26s} {r['shape']:20s} {f(r['cos'], '.7f'):>10s} "
                f"{f(r['max_err']):>9s} {f(r['max_ulp']):>6s} {r['nan']:>4d} {result_label(r):4s}")
        b = r.get("bench") or {}
        if doc["bench"] and b.get("kernel"):
            line += (f" {f(b['kernel']['us'], '.1f'):>10s} {f(b.get('torch_best_us'), '.1f'):>10s} "
                     f"{b.get('torch_best', '-'):>12s} {f(b.get('speedup'), '.2f'):>8s} {f(b.get('GBps'), '.0f'):>6s} "
                     f"{f(100 * b['of_copy'], '.0f') if b.get('of_copy') else '-':>6s} "
                     f"{f(100 * b['of_copy_same_bytes'], '.0f') if b.get('of_copy_same_bytes') else '-':>6s}")
        elif doc["bench"] and b.get("error"):
            line += f" bench error: {b['error'][:80]}"
        lines.append(line)
        if r.get("not_run"):
            lines.append(f"{'':14s}   not run: {r['not_run']}")
        elif not r["passed"] or r.get("note"):
            lines.append(f"{'':14s}   bar: {r['bar']}" + (f"; {r['note']}" if r.get("note") else "")
                         + (f"; mismatches {r['mismatches']}" if r.get("mismatches") else ""))
    if doc.get("copy_bandwidth"):
        lines.append(f"device copy bandwidth (read + write): {doc['copy_bandwidth']['GBps']:.0f} GB/s (%copy); "
                     "%same: a copy_ of the kernel's own bytes, timed alike, over the kernel's time")
    return lines


def print_rows(doc: dict[str, Any], log: Callable[[str], None] = print) -> None:
    for line in format_rows(doc):
        log(line)
