"""Side-by-side runs of a candidate pipeline against the reference, stage by stage (layer streaming).

Per stage (embed, each layer, head) and with that stage's weights loaded once:
  1. the reference runs (bf16) as the primary; shadows get the reference's inputs op by op:
     the candidate (teacher-forced per op: its *local* error) and the reference in high precision
     (the *local* noise floor);
  2. the reference runs free in high precision (the *accumulated* noise floor);
  3. the candidate runs free on its own streams (the *accumulated* error);
  4. with per-layer forcing, the candidate runs the layer on the reference's layer input.
Every output is compared as it appears against the reference's output of the same site, then the stage's
weights and activations are dropped.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .backends.base import OPS, Backend, family_of
from .backends.registry import backend_class, make_backend
from .config import ModelConfig
from .errors import BadInput
from .execute import (
    ROUTER_PINS,
    Executor,
    ModuleCache,
    OpEvent,
    Side,
    WeightSource,
    check_faults_target_sites,
)
from .faults import Fault
from .metrics import CHUNK_ELEMS, compare_fast, index_agreement
from .model import State, stages
from .schema import layer_weight_bytes
from .tensorstats import tensor_stats
from .verdict import DEFAULT_BUDGET, judge, summarize, with_logits_check

# Relative-L2 error that quantised serving numerics (FP8 activations per 1x128, NVFP4 activations per 16 for
# experts) are expected to add, per op family: e4m3 keeps 4 significant bits (relative rounding error
# <= 2**-4, ~2.5% RMS), e2m1 keeps 2 (<= 2**-2, ~10% RMS with per-16 scales). Bars are ~2x those RMS values.
QUANTIZED_LOCAL_BARS = {"linear": 0.06, "experts": 0.25}
# After many layers the streams carry every op's quantisation error; a healthy FP8/FP4 pipeline stays above
# cosine ~0.98 (field-notes.md's bar for the full attention pipeline): rel L2 ~0.2; expert outputs, with
# NVFP4 activations on both GEMMs, twice that.
QUANTIZED_FREE_BARS = {"experts": 0.5}
QUANTIZED_FREE_BAR = 0.25

# forced top-k sees the reference's own scores: only exactly equal scores may be ordered differently
EXACT_TIE = 1e-30
INDEX_SITE_SUFFIXES = ("topk_ids", "indexer.topk")


def is_index_site(site: str) -> bool:
    return site.endswith(INDEX_SITE_SUFFIXES)


def scores_site_of(site: str) -> str:
    """The site holding the scores a top-k selection was made from."""
    return site.removesuffix("topk_ids") + "scores" if site.endswith("topk_ids") else site[:-4] + "scores"


@dataclass
class RunOptions:
    candidate: str = "sim"
    reference: str = "reference"
    mode: str = "both"                        # free | forced | both
    forcing: str = "op"                       # teacher-forcing granularity: op | layer
    layers: range | None = None               # main layers to run (default all)
    device: str = "cpu"
    qat: bool = True                          # the QAT simulations inside model.py (KV fp8, indexer fp4)
    floor_dtype: torch.dtype = torch.float64
    faults: list[Fault] = field(default_factory=list)
    budget: float = DEFAULT_BUDGET            # tolerance = budget x noise floor
    reference_families: tuple[str, ...] = ()  # op families or ops the candidate side runs on the reference
    reference_below: int = 0                  # layers < this run entirely on the reference backend (bisect)
    pin_router: str | None = None             # free candidate routes with the reference's ids | ids+weights

    def __post_init__(self):
        if self.mode not in ("free", "forced", "both"):
            raise BadInput(f"--mode {self.mode!r}: choose free, forced or both")
        if self.forcing not in ("op", "layer"):
            raise BadInput(f"--forcing {self.forcing!r}: choose op or layer")
        if self.pin_router not in (None, *ROUTER_PINS):
            raise BadInput(f"--pin-router {self.pin_router!r}: choose {' or '.join(ROUTER_PINS)}")
        check_budget(self.budget)


def check_budget(budget: float) -> None:
    """A tolerance in multiples of the noise floor must be positive (<= 0 calls every site divergent)."""
    if not budget > 0:
        raise BadInput(f"--budget {budget}: the tolerance in multiples of the noise floor must be > 0")


@dataclass
class SiteResult:
    """Everything known about one site after a run."""
    site: str
    layer: int
    family: str
    op: str
    order: int
    ref_stats: dict[str, Any] = field(default_factory=dict)
    local: dict[str, Any] | None = None       # forced candidate vs reference
    free: dict[str, Any] | None = None        # free-running candidate vs reference
    local_floor: float | None = None          # reference vs high-precision reference, same inputs
    free_floor: float | None = None           # reference vs high-precision reference, both free-running
    local_bar: float = 0.0                    # error the candidate's declared numerics add (quantisation)
    free_bar: float = 0.0
    nan: dict[str, dict[str, Any]] = field(default_factory=dict)   # run -> first non-finite output info
    free_stats: dict[str, Any] | None = None  # the free candidate's output statistics (the logits only)

    def record(self, kind: str, budget: float) -> dict[str, Any]:
        """A verdict.py record; the quantisation bar enters as an effective floor of bar / budget."""
        metrics = self.local if kind == "local" else self.free
        floor = self.local_floor if kind == "local" else self.free_floor
        if kind == "free" and floor is None:
            floor = self.local_floor
        bar = self.local_bar if kind == "local" else max(self.free_bar, self.local_bar)
        eff = max(floor or 0.0, bar / budget)
        return {"site": self.site, "layer": self.layer, "family": self.family, "op": self.op,
                "metrics": metrics, "floor": {"rel_l2": eff} if eff else {}}

    def judge(self, kind: str, budget: float) -> dict[str, Any] | None:
        return judge(self.record(kind, budget), budget)

    def to_dict(self, budget: float) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["judge_local"], d["judge_free"] = self.judge("local", budget), self.judge("free", budget)
        return d


def _first_nonfinite(t: torch.Tensor, ref: torch.Tensor | None) -> dict[str, Any] | None:
    """First NaN, or Inf where the reference is finite (masked scores are -inf by design)."""
    if not t.is_floating_point():
        return None
    bad = torch.isnan(t)
    if ref is not None and ref.shape == t.shape:
        bad |= torch.isinf(t) & torch.isfinite(ref)
    if not bool(bad.any()):
        return None
    flat = int(bad.view(-1).nonzero()[0])
    coord = [int(c) for c in torch.unravel_index(torch.tensor(flat), t.shape)]
    return {"coord": coord, "value": float(t.view(-1)[flat]), "count": int(bad.sum())}


def _tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """NaN and Inf counts, absmax and RMS of the finite values (tensorstats: one transfer, no compaction)."""
    st = tensor_stats(t.detach())
    n_finite = st["numel"] - st["nan_count"] - st["inf_count"]
    return {"shape": st["shape"], "dtype": st["dtype"], "nan": st["nan_count"], "inf": st["inf_count"],
            "absmax": st["absmax"], "rms": st["l2"] / math.sqrt(n_finite) if n_finite else float("nan")}


def _inputs_finite(inputs: list[torch.Tensor]) -> bool:
    """No NaN in any floating input (-inf is a legitimate mask value in scores)."""
    return not any(bool(torch.isnan(t).any()) for t in inputs if t.is_floating_point())


def delegated(op: str, names: tuple[str, ...]) -> bool:
    """Whether `op` is delegated by a list of op names and op families."""
    return op in names or family_of(op) in names


class HybridBackend(Backend):
    """The candidate with some op families or single ops delegated to the reference (explicit, named in the
    backend's name): bisection probes, and ops a candidate does not implement. Calls the candidate declines
    (`Backend.unsupported`) run on the reference too, and are listed in `declined` ("op (reason)")."""

    def __init__(self, candidate: Backend, reference: Backend, families: tuple[str, ...]):
        super().__init__(candidate.device, candidate.dtype)
        self.candidate, self.reference, self.families = candidate, reference, families
        self.name = f"{candidate.name}+{reference.name}[{','.join(families)}]"
        self.numerics = candidate.numerics
        self.declined: set[str] = set()

    def op(self, op: str):
        if not self.is_candidate_op(op):
            return self.reference.op(op)
        fn = self.candidate.op(op)

        def call(*args, **kw):
            why = self.candidate.unsupported(op, args)
            if why is None:
                return fn(*args, **kw)
            self.declined.add(f"{op} ({why})")
            return self.reference.op(op)(*args, **kw)
        return call

    def is_candidate_op(self, op: str) -> bool:
        return not delegated(op, self.families)

    def end_stage(self) -> None:
        self.candidate.end_stage()
        self.reference.end_stage()


def candidate_backend(name: str, reference: str, device: str, families: tuple[str, ...] = ()) -> HybridBackend:
    """The candidate backend with the ops it does not implement, and `families`, run by the reference."""
    candidate = make_backend(name, device)
    missing = tuple(op for op in candidate.missing_ops() if not delegated(op, families))
    return HybridBackend(candidate, make_backend(reference, device), tuple(families) + missing)


def delegated_ops(candidate: str, families: tuple[str, ...] = ()) -> list[str]:
    """The ops a run of `candidate` gives to the reference: those it lacks and those delegated explicitly."""
    missing = backend_class(candidate).missing_ops()
    return [op for op in OPS if op in missing or delegated(op, families)]


class Comparator:
    """Compares each side's outputs with the reference's as they appear, and keeps the site results."""

    def __init__(self, candidate_numerics: str, budget: float, local_run: str, free_run: str,
                 hi_local_run: str, hi_free_run: str, ref_run: str):
        self.quantized = candidate_numerics == "quantized"
        self.budget = budget
        self.runs = {"ref": ref_run, "local": local_run, "free": free_run, "hi_local": hi_local_run,
                     "hi_free": hi_free_run}
        self.results: dict[str, SiteResult] = {}
        self.ref_out: dict[str, torch.Tensor] = {}        # this stage's reference outputs
        self.ids: dict[str, dict[str, torch.Tensor]] = {}  # run -> gate site -> expert ids (expert alignment)
        self.score_err: dict[str, float] = {}              # scores site -> max |cand - ref| (free tie margin)
        self.order = 0

    # -- observer ------------------------------------------------------------------------------------
    def observe(self, ev: OpEvent, layer: int) -> None:
        # a gate's scores are judged before its top-k ids: their error is the ids' tie margin
        for site, out in sorted(ev.outputs, key=lambda o: not o[0].endswith("scores")):
            if site.endswith("topk_ids"):
                self.ids.setdefault(ev.run, {})[site] = out
            if ev.run == self.runs["ref"]:
                self._observe_ref(ev, site, out, layer)
            elif site in self.ref_out:
                self._observe_other(ev, site, out)

    def _observe_ref(self, ev: OpEvent, site: str, out: torch.Tensor, layer: int) -> None:
        self.ref_out[site] = out
        r = self.results.setdefault(site, SiteResult(site, layer, ev.family, ev.op, self.order))
        self.order += 1
        r.ref_stats = _tensor_stats(out)
        self._set_bars(r)
        if r.ref_stats["nan"]:                  # (Inf is judged against the reference: never its own)
            self._note_nan(r, ev, out, self.runs["ref"], out)

    def _observe_other(self, ev: OpEvent, site: str, out: torch.Tensor) -> None:
        r = self.results[site]
        kind = next((k for k, run in self.runs.items() if run == ev.run), None)
        if kind is None:
            return
        if kind in ("local", "free"):
            self._note_nan(r, ev, out, ev.run, self.ref_out[site])
        if kind == "free" and site == "logits":        # the seeds' bar: finite, with a plausible spread
            r.free_stats = tensor_stats(out.detach())
        ref, cand = self._aligned(site, ev.run, self.ref_out[site], out)
        if ref is None:
            return
        if kind in ("hi_local", "hi_free"):
            err = rel_l2(ref, cand) if not is_index_site(site) else 0.0
            setattr(r, "local_floor" if kind == "hi_local" else "free_floor", _finite_or(err, 0.0))
            return
        if is_index_site(site):
            m = self._index_metrics(site, ref, cand, kind)
        else:
            m = dict(compare_fast(ref, cand), kind="values")
            if kind == "free" and site.endswith("scores"):
                self.score_err[site] = m["max_abs"] if math.isfinite(m["max_abs"]) else float("inf")
        setattr(r, kind, m)

    def _index_metrics(self, site: str, ref: torch.Tensor, cand: torch.Tensor, kind: str) -> dict[str, Any]:
        scores = self.ref_out.get(scores_site_of(site))
        # forced: the candidate selected from the very same scores, so only exact ties may flip;
        # free: its scores carry its accumulated error, flips within that error are ties
        margin = pair_tie_margin(self.score_err.get(scores_site_of(site), 0.0)) if kind == "free" else EXACT_TIE
        m = index_agreement(ref, cand, scores, tie_margin=margin)
        return dict(m, kind="index")

    def _aligned(self, site: str, run: str, ref: torch.Tensor, cand: torch.Tensor):
        """Expert outputs hold the rows of the tokens routed to that expert, which differ between free runs:
        compare the tokens both sides routed there."""
        if ".ffn.experts." not in site:
            return (ref, cand) if ref.shape == cand.shape else (None, None)
        gate = site.rsplit(".experts.", 1)[0] + ".gate.topk_ids"
        e = int(site.rsplit(".", 1)[1])
        ref_tok = (self.ids[self.runs["ref"]][gate] == e).any(-1).nonzero().squeeze(-1).tolist()
        cand_tok = (self.ids[run][gate] == e).any(-1).nonzero().squeeze(-1).tolist()
        if ref_tok == cand_tok:
            return ref, cand
        both = sorted(set(ref_tok) & set(cand_tok))
        if not both:
            return None, None
        ri = {t: i for i, t in enumerate(ref_tok)}
        ci = {t: i for i, t in enumerate(cand_tok)}
        return ref[[ri[t] for t in both]], cand[[ci[t] for t in both]]

    def _note_nan(self, r: SiteResult, ev: OpEvent, out: torch.Tensor, run: str, ref: torch.Tensor) -> None:
        if run in r.nan:
            return
        bad = _first_nonfinite(out, ref)
        if bad is not None:
            bad["inputs_finite"] = _inputs_finite(ev.inputs)
            bad["input_stats"] = [_tensor_stats(t) for t in ev.inputs if t.is_floating_point()]
            r.nan[run] = bad

    def _set_bars(self, r: SiteResult) -> None:
        if self.quantized:
            r.local_bar = QUANTIZED_LOCAL_BARS.get(r.family, 0.0)
            r.free_bar = QUANTIZED_FREE_BARS.get(r.family, QUANTIZED_FREE_BAR)

    def end_stage(self) -> None:
        self.ref_out.clear()
        self.ids.clear()


def pair_tie_margin(score_err: float) -> float:
    """The reference gap below which two ids may legitimately swap rank when every score may be off by up to
    score_err: one may rise and the other fall, so twice the error."""
    return 2 * score_err


def rel_l2(ref: torch.Tensor, other: torch.Tensor, chunk: int = CHUNK_ELEMS) -> float:
    """||other - ref|| / ||ref|| over positions finite in both (floors need only this, and fast): in fp32 unless
    both are fp64 (the difference of bf16 values is exact in fp32), squares summed in fp64, masked without
    compacting (no size to wait for on a GPU), both norms read in one transfer. In chunks of `chunk` elements:
    whole-tensor temporaries of the fp64 floor run's [S, H, d] sites took 1.5 GiB at a Pro run's peak."""
    dt = torch.promote_types(torch.promote_types(ref.dtype, other.dtype), torch.float32)
    flat_r, flat_o = ref.reshape(-1), other.reshape(-1)
    sq = torch.zeros(2, dtype=torch.float64, device=ref.device)
    for i in range(0, flat_r.numel(), chunk):
        r, o = flat_r[i:i + chunk].to(dt), flat_o[i:i + chunk].to(dt)
        both = torch.isfinite(r) & torch.isfinite(o)
        r = torch.where(both, r, 0.0)
        sq += torch.stack([torch.linalg.vector_norm(r, dtype=torch.float64),
                           torch.linalg.vector_norm(torch.where(both, o - r, 0.0), dtype=torch.float64)]).square()
    den, num = sq.sqrt().tolist()
    return num / den if den > 0 else 0.0


def _finite_or(x: float, default: float) -> float:
    return x if math.isfinite(x) else default


@dataclass
class RunResult:
    config: ModelConfig
    options: RunOptions
    sites: list[SiteResult]
    logits: dict[str, torch.Tensor]
    verdict: dict[str, Any]
    timings: dict[str, float]
    missing_ops: list[str]          # ops the candidate has no implementation (kernel) of
    delegated_ops: list[str]        # ops its side ran on the reference: missing_ops and --reference-ops
    declined_calls: list[str]       # "op (reason)": calls of implemented ops it had no kernel for
    memory: dict[str, Any] | None = None    # gpu_peak of the run (None off CUDA)

    @property
    def diverged(self) -> bool:
        return self.verdict["status"] in ("nan", "diverged", "garbage-logits")


def _verdict(results: list[SiteResult], candidate_runs: list[str], budget: float) -> dict[str, Any]:
    """NaN origin from the live finiteness of each op's inputs; divergences by verdict.summarize."""
    nan_origin = None
    for run in candidate_runs:          # forced first: it pins the op even when the NaN spreads downstream
        r = next((r for r in results if run in r.nan and r.nan[run]["inputs_finite"]), None)
        if r is not None:
            nan_origin = {"site": r.site, "run": run, "layer": r.layer, "family": r.family, **r.nan[run]}
            break
    free = [r.record("free", budget) for r in results if r.free is not None]
    local = [r.record("local", budget) for r in results if r.local is not None]
    v = summarize(free, local, budget)   # NaN origins come from the live checks below, not from statistics
    v["nan_origin"] = nan_origin
    if nan_origin:
        v["status"] = "nan"
        v["message"] = (f"NaN/Inf first produced by {nan_origin['site']} ({nan_origin['run']}) "
                        f"from finite inputs; " + v["message"])
    return with_logits_check(v, next((r.free_stats for r in results if r.site == "logits"), None))


def parse_layers(text: str | None, cfg: ModelConfig) -> range | None:
    """'A:B' (python slice of main layers), 'A' (one layer) or None (all)."""
    if not text:
        return None
    try:
        parts = [int(p) if p else None for p in text.split(":")]
        rng = range(cfg.n_layers)[slice(*parts)] if len(parts) > 1 else range(parts[0], parts[0] + 1)
    except (ValueError, TypeError):
        raise BadInput(f"--layers {text!r}: expected A:B or A") from None
    if not rng or rng.start >= cfg.n_layers or rng.start < 0:
        raise BadInput(f"--layers {text!r}: {'selects no layer' if not rng else 'out of range'}; the model has "
                       f"layers 0..{cfg.n_layers - 1}")
    return rng


RECORDED_RUNS = ("reference", "candidate", "candidate.forced")


def run(checkpoint, token_ids: torch.Tensor, opts: RunOptions, recorder=None,
        progress: Callable[[str, int, int], None] | None = None,
        stage_done: Callable[[int], None] | None = None) -> RunResult:
    """Run reference and candidate side by side, stage by stage.

    recorder(event, layer) receives every output of the reference, candidate and forced-candidate runs
    (e.g. a capture writer); progress(stage_name, index, total) is called before each stage and
    stage_done(layer) after each compared stage (-1 embed, n_layers head).
    With opts.layers = A:B, layers below A run on the reference only (both sides start layer A from the
    reference's streams) and the head runs only when B is the last layer.
    """
    with current_device(opts.device):
        return _run(checkpoint, token_ids, opts, recorder, progress, stage_done)


def current_device(device: str | torch.device) -> contextlib.AbstractContextManager:
    """A CUDA `device` (cuda:1) made the current one for the block: CuTeDSL kernels launch on the current
    device's stream, and a capture's events and pinned copies are ordered on it. Checks the device first."""
    device = checked_device(device)
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()


def checked_device(device: str | torch.device) -> torch.device:
    """The device, or BadInput naming it when it is malformed or not on this machine."""
    try:
        device = torch.device(device)
    except RuntimeError:
        raise BadInput(f"--device {device}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInput(f"--device {device}: this machine has no CUDA GPU (torch {torch.__version__}"
                           f"{'' if torch.version.cuda else ', a CPU-only build'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BadInput(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type != "cpu":
        raise BadInput(f"--device {device}: runs on cpu or cuda")
    return device


def on_its_device(fn: Callable) -> Callable:
    """fn runs with its `device` argument current (current_device)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        with current_device(bound.arguments["device"]):
            return fn(*args, **kwargs)
    return wrapper


def _run(checkpoint, token_ids: torch.Tensor, opts: RunOptions, recorder, progress, stage_done) -> RunResult:
    cfg = checkpoint.config
    dev = opts.device
    ids = token_ids.to(dev)
    cand_backend = candidate_backend(opts.candidate, opts.reference, dev, opts.reference_families)
    candidate = cand_backend.candidate
    reference = make_backend(opts.reference, dev)
    hi_dtype = opts.floor_dtype
    modules = ModuleCache(checkpoint)                     # a stage's weights read once for all sides

    def side(run: str, backend: Backend, faults=()) -> Side:
        return Side(run, backend, WeightSource(checkpoint, list(faults), modules), list(faults))

    ref_side = side("reference", reference)
    hi = "reference." + str(hi_dtype).removeprefix("torch.").replace("float", "fp")
    hi_local = side(hi + ".local", make_backend(opts.reference, dev, hi_dtype))
    hi_free = side(hi, make_backend(opts.reference, dev, hi_dtype))
    cand_forced = side("candidate.forced", cand_backend, opts.faults)
    cand_free = side("candidate", cand_backend, opts.faults)
    if opts.pin_router:
        cand_free.pin = opts.pin_router
        cand_free.pinned = lambda site: tuple(cmp.ref_out[s] for s in (site, site + ".topk_ids", site + ".scores"))
    cand_below = side("candidate", make_backend(opts.reference, dev))      # bisect: layers below k
    do_forced = opts.mode in ("forced", "both")
    do_free = opts.mode in ("free", "both")

    cmp = Comparator(candidate.numerics, opts.budget, "candidate.forced", "candidate", hi_local.run,
                     hi_free.run, ref_side.run)
    layers = opts.layers or range(cfg.n_layers)
    check_faults_target_sites(opts.faults, lambda: site_names(cfg, ids.numel(), layers))
    all_stages = [s for s in stages(cfg, ids.numel(), dev, opts.qat)
                  if s.layer < layers.stop or layers.stop == cfg.n_layers]

    st_ref = st_hi = st_cand = State(ids)
    timings: dict[str, float] = {}
    reset_gpu_peak(dev)
    for n, stage in enumerate(all_stages):
        if progress:
            progress(stage.name, n, len(all_stages))
        if 0 <= stage.layer < layers.start or (stage.layer < 0 and layers.start > 0):
            st_ref = st_hi = st_cand = _run_stage(stage, ref_side, st_ref, None)     # warm-up: reference only
            modules.clear()
            continue

        def observer(ev: OpEvent, layer=stage.layer) -> None:
            cmp.observe(ev, layer)
            if recorder is not None and ev.run in RECORDED_RUNS:
                recorder(ev, layer)

        shadows = [(cand_forced, candidate.dtype)] if do_forced and opts.forcing == "op" else []
        if do_forced:                       # local floors judge forced runs only; free runs have their own
            shadows.append((hi_local, hi_dtype))
        t0 = time.perf_counter()
        new_ref = _run_stage(stage, ref_side, st_ref, observer, shadows)
        _add(timings, "reference+shadows", t0)
        if do_free:
            t0 = time.perf_counter()
            st_hi = _run_stage(stage, hi_free, st_hi, observer)
            _add(timings, "floor", t0)
            t0 = time.perf_counter()
            below = stage.layer < opts.reference_below
            st_cand = _run_stage(stage, cand_below if below else cand_free, st_cand, observer)
            _add(timings, "candidate", t0)
        if do_forced and opts.forcing == "layer":
            _run_stage(stage, cand_forced, st_ref, observer)
        st_ref = new_ref
        modules.clear()
        cmp.end_stage()
        if stage_done:
            stage_done(stage.layer)
    results = sorted(cmp.results.values(), key=lambda r: r.order)
    runs = (["candidate.forced"] if do_forced else []) + (["candidate"] if do_free else [])
    logits = {"reference": st_ref.h} | ({"candidate": st_cand.h} if do_free else {})
    return RunResult(cfg, opts, results, logits, _verdict(results, runs, opts.budget), timings,
                     candidate.missing_ops(), delegated_ops(opts.candidate, opts.reference_families),
                     sorted(cand_backend.declined), gpu_peak(cfg, ids.numel(), dev))


def reset_gpu_peak(device: str | torch.device) -> None:
    """Start gpu_peak's measurement (nothing off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gpu_peak(cfg: ModelConfig, n_tokens: int, device: str | torch.device) -> dict[str, Any] | None:
    """Peak GPU memory since reset_gpu_peak, against what streaming a layer at a time must hold: the largest
    layer's stored weights plus the fp64 hidden streams [S, hc_mult, dim] of the floor run. None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    peak, weights = torch.cuda.max_memory_allocated(device), layer_weight_bytes(cfg)
    streams = n_tokens * cfg.hc_mult * cfg.dim * torch.float64.itemsize
    return {"peak_bytes": peak, "layer_weight_bytes": weights, "fp64_stream_bytes": streams,
            "ratio": peak / (weights + streams)}


def _run_stage(stage, side: Side, state: State, observer, shadows=()) -> State:
    ex = Executor(side, list(shadows), observer)
    out = stage.run(ex, state)
    ex.end_stage()
    return out


def _add(timings: dict[str, float], key: str, t0: float) -> None:
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0


def site_names(cfg: ModelConfig, seqlen: int = 8, layers: range | None = None) -> list[str]:
    """Every site of a forward (meta tensors: no compute), in execution order, for validation and docs."""
    return [s["site"] for s in site_table(cfg, seqlen, layers)]


def site_table(cfg: ModelConfig, seqlen: int = 8, layers: range | None = None) -> list[dict[str, Any]]:
    """Sites with op, family and output shape/dtype from a dry run of the flow on the shape-only backend."""
    from .backends.shapes import trace_sites
    return trace_sites(cfg, seqlen, layers)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, with NaN equal to NaN (a deterministic NaN is still deterministic)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.nan_to_num(), b.nan_to_num()) if a.is_floating_point() else torch.equal(a, b)


@on_its_device
def repeat_check(checkpoint, token_ids: torch.Tensor, candidate: str, repeats: int = 2, device: str = "cpu",
                 qat: bool = True, faults: list[Fault] = ()) -> dict[str, Any]:
    """Bitwise determinism of a backend: each stage runs `repeats` times on the same input; the first site
    whose outputs differ between repetitions is named (with how many elements and by how much)."""
    if repeats < 2:
        raise BadInput(f"--repeat {repeats}: needs at least 2 runs to compare")
    backend = candidate_backend(candidate, "reference", device)
    side = Side("candidate", backend, WeightSource(checkpoint, list(faults)), list(faults))
    state = State(token_ids.to(device))
    compared, first = 0, None
    for stage in stages(checkpoint.config, token_ids.numel(), device, qat):
        outs: list[dict[str, torch.Tensor]] = []
        for _ in range(repeats):
            seen: dict[str, torch.Tensor] = {}
            new_state = _run_stage(stage, side, state, lambda ev, seen=seen: seen.update(ev.outputs))
            outs.append(seen)
        for site, t in outs[0].items():
            compared += 1
            for other in outs[1:]:
                u = other[site]
                if first is None and not _bitwise_equal(t, u):
                    diff = (u.double() - t.double()).abs() if u.shape == t.shape else None
                    first = {"site": site, "layer": stage.layer,
                             "mismatches": int((diff != 0).sum()) if diff is not None else None,
                             "max_abs": float(diff.nan_to_num(nan=math.inf).max()) if diff is not None else None}
        state = new_state
    return {"backend": candidate, "repeats": repeats, "sites_compared": compared,
            "deterministic": first is None, "first_difference": first}


@on_its_device
def graph_check(checkpoint, token_ids: torch.Tensor, candidate: str, graph: str = "compile", device: str = "cpu",
                qat: bool = True, faults: list[Fault] = (), layers: range | None = None,
                reference_ops: tuple[str, ...] = (), budget: float = DEFAULT_BUDGET,
                bitwise: bool | None = None) -> list[dict[str, Any]]:
    """Eager against graph execution of a backend (--graph): compile[:BACKEND] (torch.compile, inductor by
    default), cuda (CUDA-graph capture and replay, per op) or all; one report per mode.

    The candidate runs eagerly and drives the flow; the same backend under graph execution shadows it op by op
    on the very same inputs, so a difference is that op's own. Bitwise equality is expected from CUDA graphs
    and from compile backends that run the eager kernels (eager, aot_eager); inductor fuses and reorders
    arithmetic, so there (or with bitwise=False) a value site fails only past `budget` x its local noise
    floor (the reference in bf16 against fp64 on the same inputs, as in run), and top-k ids only on flips
    that the op's score differences cannot explain. Names the first site that is not bitwise equal and the
    first that fails, with the largest difference and its coordinates; an op that fails to compile or to be
    captured fails at its site."""
    import torch._dynamo

    from .backends.graph import BITWISE_COMPILE_BACKENDS, GraphBackend, GraphError, parse_graph
    modes = parse_graph(graph, device)
    cfg = checkpoint.config
    layers = layers or range(cfg.n_layers)
    check_faults_target_sites(list(faults), lambda: site_names(cfg, token_ids.numel(), layers))

    modules = ModuleCache(checkpoint)

    def side(run: str, backend: Backend, mode: str | None = None) -> Side:
        b = GraphBackend(backend, mode, compile_backend) if mode else backend
        return Side(run, b, WeightSource(checkpoint, list(faults), modules), list(faults))

    reports = []
    for mode, compile_backend in modes:
        exact = (mode == "cuda" or compile_backend in BITWISE_COMPILE_BACKENDS) if bitwise is None else bitwise
        # ops the candidate lacks run on the reference (named by run), so only its own ops are graphed
        primary = side("candidate", candidate_backend(candidate, "reference", device, reference_ops))
        graphed = side("candidate.graph", candidate_backend(candidate, "reference", device, reference_ops), mode)
        shadows = [(graphed, primary.backend.dtype)]
        if not exact:                       # local floors: the reference in bf16 and fp64 on the same inputs
            shadows += [(side("reference", make_backend("reference", device)), torch.bfloat16),
                        (side("reference.fp64", make_backend("reference", device, torch.float64)), torch.float64)]
        check = _GraphCompare(exact, budget, primary.backend.numerics == "quantized", len(shadows) + 1,
                              graphed.backend)
        state = State(token_ids.to(device))
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=64):
            for stage in stages(cfg, token_ids.numel(), device, qat):
                if stage.layer >= layers.stop and layers.stop < cfg.n_layers:
                    break
                warmup = 0 <= stage.layer < layers.start or (stage.layer < 0 and layers.start > 0)
                try:
                    state = _run_stage(stage, primary, state, None if warmup else check.observer(stage.layer),
                                       () if warmup else shadows)
                    modules.clear()
                except GraphError as e:
                    check.failed_op(str(e))
                    break
        reports.append({"backend": candidate, "graph": mode if mode == "cuda" else f"compile:{compile_backend}",
                        "bitwise_expected": exact, "budget": budget, "sites_compared": check.compared,
                        "sites_bitwise": check.bitwise, "agrees": check.first_failure is None,
                        "first_difference": check.first_difference, "first_failure": check.first_failure,
                        "not_captured": check.not_captured})
    return reports


class _GraphCompare:
    """graph_check's observer: each op's outputs, eager against graph (and the floors' shadows), as they come."""

    def __init__(self, exact: bool, budget: float, quantized: bool, runs: int, graphed: Backend):
        self.exact, self.budget, self.quantized, self.runs, self.graphed = exact, budget, quantized, runs, graphed
        self.not_captured: dict[str, dict[str, Any]] = {}     # op -> first site, calls, why (ran eagerly)
        self.pending: dict[str, dict[str, OpEvent]] = {}
        self.compared = self.bitwise = 0
        self.first_difference: dict[str, Any] | None = None
        self.first_failure: dict[str, Any] | None = None
        self.current: tuple[OpEvent, int] | None = None       # the op the shadows are running

    def observer(self, layer: int) -> Callable[[OpEvent], None]:
        def observe(ev: OpEvent) -> None:
            if ev.run == "candidate":
                self.current = (ev, layer)
            elif ev.run == "candidate.graph":
                for op, why in self.graphed.take_not_captured():
                    self.not_captured.setdefault(op, {"site": ev.site, "calls": 0, "error": why})["calls"] += 1
            evs = self.pending.setdefault(ev.site, {})
            evs[ev.run] = ev
            if len(evs) == self.runs:
                del self.pending[ev.site]
                self._compare(evs, layer)
        return observe

    def failed_op(self, error: str) -> None:
        ev, layer = self.current
        rec = {"site": ev.site, "layer": layer, "op": ev.op, "family": ev.family, "error": error}
        self.first_difference = self.first_difference or rec
        self.first_failure = self.first_failure or rec

    def _compare(self, evs: dict[str, OpEvent], layer: int) -> None:
        e, g = evs["candidate"], evs["candidate.graph"]
        eo, go = dict(e.outputs), dict(g.outputs)
        tied = None              # tokens whose top-k ids flipped on a tie: their routing weights differ too
        for site in sorted(eo, key=lambda s: not is_index_site(s)):
            a, b = eo[site], go[site]
            self.compared += 1
            if _bitwise_equal(a, b):
                self.bitwise += 1
                continue
            rec = {"site": site, "layer": layer, "op": e.op, "family": e.family, **_where_differ(a, b)}
            if a.shape != b.shape or a.dtype != b.dtype:
                fails = True
            elif is_index_site(site):
                # the gate returns its scores (their differences are the tie margin); indexer_topk's scores
                # are its input, the same on both sides: only exact ties may flip
                ss = scores_site_of(site)
                scores = eo.get(ss, e.inputs[0])
                margin = pair_tie_margin(float((go[ss].double() - scores.double()).abs().nan_to_num().max())) \
                    if ss in eo else EXACT_TIE
                m = index_agreement(a, b, scores, tie_margin=margin)
                rec |= {k: m[k] for k in ("flips", "ties", "hard_flips")}
                fails = self.exact or m["hard_flips"] > 0
                tied = ((a != b).any(-1), a.shape)
            else:
                if tied is not None and a.shape == tied[1]:
                    a, b = a[~tied[0]], b[~tied[0]]
                rec["rel_l2"] = rel_l2(a, b)
                fails = self.exact
                if not self.exact:
                    floor = _finite_or(rel_l2(dict(evs["reference"].outputs)[site],
                                              dict(evs["reference.fp64"].outputs)[site]), 0.0)
                    bar = QUANTIZED_LOCAL_BARS.get(e.family, 0.0) if self.quantized else 0.0
                    r = SiteResult(site, layer, e.family, e.op, 0, local=compare_fast(a, b), local_floor=floor,
                                   local_bar=bar)
                    j = r.judge("local", self.budget)
                    rec |= {"floor": j["floor"], "x_floor": j["x_floor"]}
                    fails = j["exceeds"]
            self.first_difference = self.first_difference or rec
            if fails and self.first_failure is None:
                self.first_failure = rec


def _where_differ(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """How many elements differ, the largest difference (inf where only one side is NaN) and where."""
    if a.shape != b.shape:
        return {"mismatches": None, "max_abs": None, "coord": None,
                "shapes": [list(a.shape), list(b.shape)], "dtypes": [str(a.dtype), str(b.dtype)]}
    x, y = a.double(), b.double()
    differ = (x != y) & ~(x.isnan() & y.isnan())
    diff = torch.where(differ, (x - y).abs().nan_to_num(nan=math.inf), 0.0)
    at = int(diff.view(-1).argmax())
    return {"mismatches": int(differ.sum()), "max_abs": float(diff.view(-1)[at]),
            "coord": [int(c) for c in torch.unravel_index(torch.tensor(at), a.shape)],
            "eager": float(x.view(-1)[at]), "graph": float(y.view(-1)[at])}


def moe_diagnostics(result: RunResult) -> dict[int, dict[str, Any]]:
    """Per MoE layer: tokens per expert, each expert's local error on its tokens (reference inputs), and the
    router's top-k agreement with flips against margin (forced and free)."""
    out: dict[int, dict[str, Any]] = {}
    for r in result.sites:
        if ".ffn." not in r.site:
            continue
        d = out.setdefault(r.layer, {"tokens_per_expert": {}, "expert_local_rel_l2": {}, "expert_x_floor": {},
                                     "routing": {}})
        if ".ffn.experts." in r.site:
            e = int(r.site.rsplit(".", 1)[1])
            d["tokens_per_expert"][e] = r.ref_stats["shape"][0]
            if r.local is not None:
                d["expert_local_rel_l2"][e] = r.local["rel_l2"]
                d["expert_x_floor"][e] = (r.judge("local", result.options.budget) or {}).get("x_floor")
        elif r.site.endswith("gate.topk_ids"):
            for kind, m in (("forced", r.local), ("free", r.free)):
                if m is not None:
                    d["routing"][kind] = {k: m[k] for k in ("agreement_mean", "flips", "ties", "hard_flips")}
    return out
