"""Bisection when per-op capture is impossible or too large: hybrid forwards judged on the final logits.

--axis layers: stages below k (embed, layers, head in order) run on the reference, the rest on the
candidate; binary search for the last k that still diverges: that stage holds the fault.
--axis ops: op families moved one at a time to the reference; a family stays on the candidate only if the
divergence disappears without it, leaving a minimal set of candidate families that reproduces it.
--axis stages: not a search but a sweep, each stage alone on the candidate from the reference's input to it;
it finds faults too small to move the logits beyond the whole model's noise, at one pass of each side.
"The reference" here is the judge: by default a quantising candidate's simulator (`judge_for`), which rounds
as the candidate does, so that what separates them is accumulation noise, not quantisation noise.
"""
from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .backends.base import FAMILIES, Backend
from .backends.registry import backend_class, make_backend
from .checkpoint import Checkpoint
from .errors import BadInput
from .execute import Executor, ModuleCache, Side, WeightSource, check_faults_target_sites
from .faults import Fault
from .metrics import MIN_FLOORS
from .model import State, stages
from .runner import (
    QUANTIZED_FREE_BAR,
    candidate_backend,
    check_budget,
    current_device,
    gpu_peak,
    rel_l2,
    reset_gpu_peak,
    site_names,
)

# Tolerance at the logits in multiples of their floor (the judge in bf16 against itself in fp64, accumulated
# over the whole model). Two independent bf16 implementations differ from each other by about sqrt(2) floors, so
# 2 floors is the least that does not call a clean bf16 candidate divergent; the runner's per-site budget (8)
# would hide most single-op faults here, since the accumulated floor is far larger than a local one.
BISECT_BUDGET = 2.0
# The stage sweep's second rule: a correct candidate's error, in floors, is nearly the same on every layer
# (kernels on 4 Pro layers on the H200: 0.67-0.69 floors, routing pinned; 0.85-0.89 on the tiny model), so a
# layer over STAGE_OUTLIER x the layers' median, and over STAGE_OUTLIER_MIN floors, is out of line with the
# others: the swapped experts and the fused-scale bug of issue 9 are 3.3x and 1.6x the median on Pro, the
# latter under 2 floors.
# It needs STAGE_OUTLIER_LAYERS layers to take a median; a fault in most layers moves the median and is left
# to the first rule.
STAGE_OUTLIER, STAGE_OUTLIER_MIN, STAGE_OUTLIER_LAYERS = 1.25, 0.5, 3
# The binary search's culprit must carry this fraction of the tolerance itself: the error with the candidate from
# the culprit on, less (in quadrature) the error with it after the culprit. A fault that moves the logits only
# about as far as the tolerance otherwise lands on whichever stage's noise tips the sum over the line (a KV cache
# never written in layer 2 of 4 Pro layers, at 1.01x tolerance, was named layers.0 on a step of 0.25x).
LAYER_STEP_MIN = 0.5


@dataclass
class Probe:
    what: str                        # "<judge> below <stage>", "<judge> for <families>", "<stage> on ..."
    candidate_stages: list[str]
    candidate_families: list[str]
    rel_l2: float
    tolerance: float
    nan: bool
    floor: float | None = None       # stage probes: the stage's own floor (rel_l2 / floor: its error in floors)

    @property
    def diverged(self) -> bool:
        return self.nan or not self.rel_l2 <= self.tolerance


@dataclass
class BisectResult:
    axis: str
    judged_by: str                   # the backend the candidate's logits are compared with
    probes: list[Probe] = field(default_factory=list)
    culprit_stage: str | None = None
    culprit_families: list[str] | None = None
    message: str = ""
    memory: dict[str, Any] | None = None      # runner.gpu_peak since the search began (None off CUDA)

    @property
    def diverged(self) -> bool:
        """A culprit was named, or the logits diverge though none could be (an inconclusive search)."""
        located = self.culprit_stage is not None or self.culprit_families is not None
        return located or (self.axis != "stages" and bool(self.probes) and self.probes[0].diverged)

    def to_dict(self) -> dict[str, Any]:
        return {"axis": self.axis, "judged_by": self.judged_by, "diverged": self.diverged,
                "culprit_stage": self.culprit_stage, "culprit_families": self.culprit_families,
                "message": self.message, "memory": self.memory,
                "probes": [dict(p.__dict__, diverged=p.diverged) for p in self.probes]}


def judge_for(candidate: str) -> str:
    """The backend a candidate is judged against by default: its simulator when it quantises and declares
    one (the same rounding in PyTorch: what is left is accumulation noise, far below the quantisation noise
    that would otherwise hide a wrong expert or a stale cache), else the bf16 reference."""
    cls = backend_class(candidate)
    return cls.simulator if cls.numerics == "quantized" and cls.simulator else "reference"


class Bisector:
    def __init__(self, model: Checkpoint, token_ids: torch.Tensor, candidate: str, reference: str | None = None,
                 device: str = "cpu", qat: bool = True, faults: list[Fault] = (), budget: float = BISECT_BUDGET,
                 on_probe: Callable[[Probe], None] | None = None, free_routing: bool = False,
                 progress: Callable[[str, int, int], None] | None = None):
        check_budget(budget)
        self.model, self.ids, self.device, self.qat = model, token_ids.to(device), device, qat
        # every probe and floor routes by the judge's expert ids unless free_routing: a near-tie that flips
        # moves a token's whole expert output, and the fp64 floor flips many more than a bf16 candidate (on the
        # tiny model pinning cut the logits' floor 3.6x and a score-routed layer's 3.7x); the weights stay each
        # side's own, so a scoring bug still shows, a wrong selection only with free_routing (or in `run`)
        self.pin = None if free_routing else "ids"
        reference = reference or judge_for(candidate)
        try:
            backend_class(reference)
        except BadInput as e:
            raise BadInput(f"--reference {reference}: {e}") from None
        self.candidate_name = candidate
        self.candidate = candidate_backend(candidate, reference, device)
        self.reference_name = reference
        self.reference = make_backend(reference, device)
        self.same_rounding = candidate == reference        # the judge as candidate (planted faults)
        self.faults = list(faults)
        check_faults_target_sites(self.faults, lambda: site_names(model.config, token_ids.numel()))
        self.budget, self.on_probe, self.progress = budget, on_probe, progress   # progress(what, stage, of)
        self.stages = stages(model.config, token_ids.numel(), device, qat)
        # the judge's input to every stage and its final output, kept on the host: a probe "judge below stage
        # k" starts from the k-th and runs only the candidate's stages (one weight read per stage, not two)
        self.ref_states: list[State] = []
        self.routes: dict[str, torch.Tensor] = {}      # the judge's gate outputs by output name, on the host
        self.ref_logits = self._forward(self.reference, 0, [], keep_states=True, phase="judge")
        # a quantising candidate judged by a bf16 reference is allowed its quantisation noise
        self.unmatched_quantization = self.candidate.numerics == "quantized" and self.reference.numerics != "quantized"
        self.bar = QUANTIZED_FREE_BAR if self.unmatched_quantization else 0.0
        self._floor: float | None = None

    @property
    def floor(self) -> float:
        """The logits' floor: the judge in bf16 against itself in fp64 (measured on first use)."""
        if self._floor is None:
            self._floor = MIN_FLOORS["rel_l2"]
            if not self.same_rounding:
                hi = self._forward(self.hi, 0, [], phase="fp64 floor")
                self._floor = max(rel_l2(hi, self.ref_logits.to(hi.dtype)), self._floor)
        return self._floor

    @property
    def tolerance(self) -> float:
        return max(self.budget * self.floor, self.bar)

    @functools.cached_property
    def hi(self) -> Backend:
        """The judge in fp64: the floors' other side."""
        return make_backend(self.reference_name, self.device, torch.float64)

    def _run_stage(self, ex: Executor, k: int, state: State, phase: str) -> State:
        if self.progress:
            self.progress(f"{phase}: {self.stages[k].name}", k, len(self.stages))
        state = self.stages[k].run(ex, state)
        ex.end_stage()
        return state

    def _forward(self, backend: Backend, start: int, faults: list[Fault], keep_states: bool = False,
                 phase: str = "probe") -> torch.Tensor:
        """Stages start.. on `backend`, from the judge's input to stage `start`."""
        side = Side(backend.name, backend, WeightSource(self.model, faults), faults,
                    pin=None if keep_states else self.pin, pinned=self._pinned)
        state = _to(self.ref_states[start], self.device) if start else State(self.ids)
        observer = self._keep_routes if keep_states else None
        for k in range(start, len(self.stages)):
            if keep_states:
                self.ref_states.append(_to(state, "cpu"))
            state = self._run_stage(Executor(side, observer=observer), k, state, phase)
        if keep_states:
            self.ref_states.append(_to(state, "cpu"))
        return state.h

    def _keep_routes(self, event) -> None:
        if event.op == "gate":
            self.routes.update({name: t.cpu() for name, t in event.outputs})

    def _pinned(self, site: str) -> tuple:
        return tuple(self.routes[s].to(self.device) for s in (site, f"{site}.topk_ids", f"{site}.scores"))

    def _report(self, probe: Probe) -> Probe:
        if self.on_probe:
            self.on_probe(probe)
        return probe

    def _probe(self, what: str, below: int, ref_families: tuple[str, ...]) -> Probe:
        cand = self.candidate
        if ref_families:
            cand = candidate_backend(self.candidate_name, self.reference_name, self.device, ref_families)
        err, nan = _error(self.ref_logits, self._forward(cand, below, self.faults))
        return self._report(Probe(what, [s.name for i, s in enumerate(self.stages) if i >= below],
                                  [f for f in FAMILIES if f not in ref_families], err, self.tolerance, nan))

    def _stage_probe(self, k: int, modules: ModuleCache) -> Probe:
        """Stage k alone on the candidate, from the judge's input to it, against the judge's output; its
        floor is the judge's own stage in fp64 from the same input (one read of the weights for both)."""
        inp, want = _to(self.ref_states[k], self.device), self.ref_states[k + 1].h.to(self.device)
        cand = Side(self.candidate.name, self.candidate, WeightSource(self.model, self.faults, modules), self.faults,
                    pin=self.pin, pinned=self._pinned)
        got = self._run_stage(Executor(cand), k, inp, "sweep").h
        floor = MIN_FLOORS["rel_l2"]
        if not self.same_rounding:
            hi = Side("fp64", self.hi, WeightSource(self.model, [], modules), pin=self.pin, pinned=self._pinned)
            wide = self._run_stage(Executor(hi), k, _to(inp, self.device, torch.float64), "sweep, fp64").h
            floor = max(rel_l2(wide, want.to(wide.dtype)), floor)
        modules.clear()
        err, nan = _error(want, got)
        return Probe(f"{self.stages[k].name} on {self.reference_name}'s input", [self.stages[k].name],
                     list(FAMILIES), err, max(self.budget * floor, self.bar), nan, floor)

    def _clean_message(self, probe: Probe) -> str:
        msg = (f"the candidate does not diverge at the logits (rel L2 {probe.rel_l2:.3g} <= {probe.tolerance:.3g}): "
               "nothing to bisect; `--axis stages` judges each stage alone, against one stage's noise")
        if self.unmatched_quantization:
            msg += (f"; judged by {self.reference_name}, a quantising candidate is allowed its quantisation noise "
                    "there, which hides faults smaller than it: judge it by a simulator of its quantisation "
                    "(--reference), or `dsv4debug run`, which compares every op on the reference's inputs")
        return msg

    def layers(self) -> BisectResult:
        res = BisectResult("layers", self.reference_name)
        first = self._probe("candidate everywhere", 0, ())
        res.probes.append(first)
        if not first.diverged:
            res.message = self._clean_message(first)
            return res
        lo, hi = 0, len(self.stages)           # diverges with stages >= lo on the candidate; clean at hi
        by_start = {0: first}
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = by_start[mid] = self._probe(f"{self.reference_name} below {self.stages[mid].name}", mid, ())
            res.probes.append(p)
            lo, hi = (mid, hi) if p.diverged else (lo, mid)
        with_it, without = by_start[lo], by_start.get(hi)       # hi == len(stages): the judge's own logits
        name, step = self.stages[lo].name, culprit_step(with_it, without)
        if step < LAYER_STEP_MIN:
            res.message = (f"inconclusive: the logits diverge only {first.rel_l2 / first.tolerance:.2f}x the "
                           f"tolerance, and the search's last step ({name}) carries {step:.2f}x of it, under "
                           f"{LAYER_STEP_MIN:g}x: the fault is within the model's accumulated noise here; "
                           "`--axis stages` judges each stage alone, against one stage's noise")
            return res
        res.culprit_stage = name
        res.message = (f"divergence enters at {name}: with {self.reference_name} up to it the candidate diverges "
                       f"({with_it.rel_l2 / with_it.tolerance:.2f}x tolerance), with {self.reference_name} through "
                       "it the candidate is clean"
                       + (f" ({without.rel_l2 / without.tolerance:.2f}x)" if without else ""))
        return res

    def ops(self) -> BisectResult:
        res = BisectResult("ops", self.reference_name)
        on_ref: tuple[str, ...] = ()
        first = self._probe("candidate everywhere", 0, on_ref)
        res.probes.append(first)
        if not first.diverged:
            res.message = self._clean_message(first)
            return res
        for fam in FAMILIES:
            trial = on_ref + (fam,)
            p = self._probe(f"{self.reference_name} for {', '.join(trial)}", 0, trial)
            res.probes.append(p)
            if p.diverged:
                on_ref = trial            # still diverges without this family: not needed to reproduce
        res.culprit_families = [f for f in FAMILIES if f not in on_ref]
        if res.culprit_families:
            res.message = ("minimal candidate op families reproducing the divergence: "
                           + ", ".join(res.culprit_families))
        else:
            res.message = (f"the divergence persists with every op family on {self.reference_name}: the candidate "
                           "reads different weights (packing, scales) - see weight faults / checkpoint verify")
        return res

    def stage_sweep(self) -> BisectResult:
        """Each stage alone on the candidate, on the judge's input: no error carried in from earlier stages,
        so a fault has only to stand out from one stage's rounding noise, not from the whole model's at the
        logits. One candidate pass and one fp64 pass of the judge, stage by stage."""
        res = BisectResult("stages", self.reference_name)
        modules = ModuleCache(self.model)
        res.probes = [self._stage_probe(k, modules) for k in range(len(self.stages))]
        layers = [p for p in res.probes if p.candidate_stages[0].startswith("layers.")]
        in_floors = [p.rel_l2 / p.floor for p in layers]
        if len(in_floors) >= STAGE_OUTLIER_LAYERS:
            typical = statistics.median(in_floors)
            for p in layers:
                p.tolerance = min(p.tolerance, max(STAGE_OUTLIER * typical, STAGE_OUTLIER_MIN) * p.floor)
            how = f"beyond {self.budget:g} floors or {STAGE_OUTLIER:g}x the layers' median of {typical:.3g} floors"
            if typical == 0:                                # the judge as candidate: any difference at all
                how = f"from {self.reference_name}'s, which rounds the same way"
        else:
            how = f"beyond {self.budget:g} floors"
        for p in res.probes:
            self._report(p)
        bad = [p.candidate_stages[0] for p in res.probes if p.diverged]
        if bad:
            res.culprit_stage = bad[0]
            res.message = (f"divergence enters at {bad[0]}: on {self.reference_name}'s input its output differs "
                           f"{how}" + (f" (also: {', '.join(bad[1:])})" if bad[1:] else ""))
        else:
            worst = max(res.probes, key=lambda p: p.rel_l2 / p.tolerance)
            res.message = (f"no stage on {self.reference_name}'s input differs {how} (closest: "
                           f"{worst.candidate_stages[0]}, rel L2 {worst.rel_l2:.3g} <= {worst.tolerance:.3g})")
        return res


def culprit_step(with_it: Probe, without: Probe | None) -> float:
    """What the stage between two probes adds to the logits' error, in tolerances: the error with the candidate
    from that stage on, less in quadrature the error with it after the stage (None: the judge's own logits)."""
    if with_it.nan:
        return math.inf
    rest = without.rel_l2 if without else 0.0
    return math.sqrt(max(with_it.rel_l2 ** 2 - rest ** 2, 0.0)) / with_it.tolerance


def _error(want: torch.Tensor, got: torch.Tensor) -> tuple[float, bool]:
    """(rel L2 of got against want, whether got has a NaN: then the error is inf)."""
    nan = bool(torch.isnan(got).any())
    return (math.inf if nan else rel_l2(want, got)), nan


def _to(state: State, device: torch.device | str, dtype: torch.dtype | None = None) -> State:
    """The state on `device`; its floating streams in `dtype` if given (token ids stay int64)."""
    def move(v):
        if not isinstance(v, torch.Tensor):
            return v
        return v.to(device, dtype) if dtype is not None and v.is_floating_point() else v.to(device)
    return State(**{f.name: move(getattr(state, f.name)) for f in fields(state)})


def bisect(model: Checkpoint, token_ids: torch.Tensor, candidate: str, axis: str = "layers",
           **kw: Any) -> list[BisectResult]:
    """Each axis of `axis` (comma-separated; "both" is layers,ops and "all" adds stages) over one Bisector."""
    aliases = {"both": ("layers", "ops"), "all": ("layers", "ops", "stages")}
    names = list(dict.fromkeys(n for part in axis.split(",") for n in aliases.get(part, (part,))))
    if bad := [n for n in names if n not in ("layers", "ops", "stages")]:
        raise BadInput(f"--axis {bad[0]!r}: choose layers, ops, stages (comma-separated), both or all")
    device = kw.get("device", "cpu")
    with current_device(device):
        reset_gpu_peak(device)
        b = Bisector(model, token_ids, candidate, **kw)
        run = {"layers": b.layers, "ops": b.ops, "stages": b.stage_sweep}
        results = []
        for name in names:
            results.append(run[name]())
            results[-1].memory = gpu_peak(model.config, token_ids.numel(), device)
    return results
