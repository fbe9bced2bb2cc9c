"""Bisection when per-op capture is impossible or too large: hybrid forwards judged on the final logits.

--axis layers: stages below k (embed, layers, head in order) run on the reference, the rest on the
candidate; binary search for the last k that still diverges: that stage holds the fault.
--axis ops: op families moved one at a time to the reference; a family stays on the candidate only if the
divergence disappears without it, leaving a minimal set of candidate families that reproduces it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .backends.base import FAMILIES, Backend
from .backends.registry import make_backend
from .checkpoint import Checkpoint
from .errors import BadInput
from .execute import Executor, Side, WeightSource, check_faults_target_sites
from .faults import Fault
from .metrics import MIN_FLOORS
from .model import State, stages
from .runner import QUANTIZED_FREE_BAR, candidate_backend, rel_l2, site_names

# Tolerance at the logits in multiples of their floor (the reference in bf16 against fp64, accumulated over
# the whole model). Two independent bf16 implementations differ from each other by about sqrt(2) floors, so
# 2 floors is the least that does not call a clean bf16 candidate divergent; the runner's per-site budget (8)
# would hide most single-op faults here, since the accumulated floor is far larger than a local one.
BISECT_BUDGET = 2.0


@dataclass
class Probe:
    what: str                        # "reference below stage k" or "reference families {...}"
    candidate_stages: list[str]
    candidate_families: list[str]
    rel_l2: float
    tolerance: float
    nan: bool

    @property
    def diverged(self) -> bool:
        return self.nan or not self.rel_l2 <= self.tolerance


@dataclass
class BisectResult:
    axis: str
    probes: list[Probe] = field(default_factory=list)
    culprit_stage: str | None = None
    culprit_families: list[str] | None = None
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"axis": self.axis, "culprit_stage": self.culprit_stage, "culprit_families": self.culprit_families,
                "message": self.message, "probes": [dict(p.__dict__, diverged=p.diverged) for p in self.probes]}


class Bisector:
    def __init__(self, model: Checkpoint, token_ids: torch.Tensor, candidate: str, reference: str = "reference",
                 device: str = "cpu", qat: bool = True, faults: list[Fault] = (), budget: float = BISECT_BUDGET,
                 on_probe: Callable[[Probe], None] | None = None):
        self.model, self.ids, self.device, self.qat = model, token_ids.to(device), device, qat
        self.candidate_name = candidate
        self.candidate = candidate_backend(candidate, reference, device)
        self.reference_name = reference
        self.reference = make_backend(reference, device)
        self.faults = list(faults)
        check_faults_target_sites(self.faults, site_names(model.config, token_ids.numel()))
        self.on_probe = on_probe
        self.stages = stages(model.config, token_ids.numel(), device, qat)
        # the reference's input to every stage, kept on the host: a probe "reference below stage k" starts
        # from the k-th and runs only the candidate's stages (one weight read per stage, not two)
        self.ref_inputs: list[State] = []
        ref_logits = self._forward(self.reference, 0, [], keep_inputs=True)
        self.floor = MIN_FLOORS["rel_l2"]
        if candidate != reference:          # the reference as candidate (planted faults) rounds identically
            hi_logits = self._forward(make_backend(reference, device, torch.float64), 0, [])
            self.floor = max(rel_l2(hi_logits, ref_logits.to(hi_logits.dtype)), self.floor)
        bar = QUANTIZED_FREE_BAR if self.candidate.numerics == "quantized" else 0.0
        self.ref_logits = ref_logits
        self.tolerance = max(budget * self.floor, bar)

    def _forward(self, backend: Backend, start: int, faults: list[Fault], keep_inputs: bool = False
                 ) -> torch.Tensor:
        """Stages start.. on `backend`, from the reference's input to stage `start`."""
        side = Side(backend.name, backend, WeightSource(self.model, faults), faults)
        state = _to(self.ref_inputs[start], self.device) if start else State(self.ids)
        for stage in self.stages[start:]:
            if keep_inputs:
                self.ref_inputs.append(_to(state, "cpu"))
            ex = Executor(side)
            state = stage.run(ex, state)
            ex.end_stage()
        return state.h

    def _probe(self, what: str, below: int, ref_families: tuple[str, ...]) -> Probe:
        cand = self.candidate
        if ref_families:
            cand = candidate_backend(self.candidate_name, self.reference_name, self.device, ref_families)
        logits = self._forward(cand, below, self.faults)
        nan = bool(torch.isnan(logits).any())
        err = rel_l2(self.ref_logits, logits) if not nan else math.inf
        probe = Probe(what, [s.name for i, s in enumerate(self.stages) if i >= below],
                      [f for f in FAMILIES if f not in ref_families], err, self.tolerance, nan)
        if self.on_probe:
            self.on_probe(probe)
        return probe

    def _clean_message(self, probe: Probe) -> str:
        msg = (f"the candidate does not diverge at the logits (rel L2 {probe.rel_l2:.3g} <= {probe.tolerance:.3g}): "
               "nothing to bisect")
        if self.candidate.numerics == "quantized":
            msg += ("; a quantising candidate is allowed its quantisation noise there, which hides faults smaller "
                    "than it: `dsv4debug run` compares every op on the reference's inputs and finds those")
        return msg

    def layers(self) -> BisectResult:
        res = BisectResult("layers")
        first = self._probe("candidate everywhere", 0, ())
        res.probes.append(first)
        if not first.diverged:
            res.message = self._clean_message(first)
            return res
        lo, hi = 0, len(self.stages)           # diverges with stages >= lo on the candidate; clean at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            p = self._probe(f"reference below {self.stages[mid].name}", mid, ())
            res.probes.append(p)
            lo, hi = (mid, hi) if p.diverged else (lo, mid)
        res.culprit_stage = self.stages[lo].name
        res.message = (f"divergence enters at {res.culprit_stage}: with the reference up to it the candidate "
                       f"diverges, with the reference through it the candidate is clean")
        return res

    def ops(self) -> BisectResult:
        res = BisectResult("ops")
        on_ref: tuple[str, ...] = ()
        first = self._probe("candidate everywhere", 0, on_ref)
        res.probes.append(first)
        if not first.diverged:
            res.message = self._clean_message(first)
            return res
        for fam in FAMILIES:
            trial = on_ref + (fam,)
            p = self._probe(f"reference for {', '.join(trial)}", 0, trial)
            res.probes.append(p)
            if p.diverged:
                on_ref = trial            # still diverges without this family: not needed to reproduce
        res.culprit_families = [f for f in FAMILIES if f not in on_ref]
        if res.culprit_families:
            res.message = ("minimal candidate op families reproducing the divergence: "
                           + ", ".join(res.culprit_families))
        else:
            res.message = ("the divergence persists with every op family on the reference: the candidate "
                           "reads different weights (packing, scales) - see weight faults / checkpoint verify")
        return res


def _to(state: State, device: torch.device | str) -> State:
    moved = {f.name: getattr(state, f.name) for f in fields(state)}
    return State(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def bisect(model: Checkpoint, token_ids: torch.Tensor, candidate: str, axis: str = "layers",
           **kw: Any) -> list[BisectResult]:
    if axis not in ("layers", "ops", "both"):
        raise BadInput(f"--axis {axis!r}: choose layers, ops or both")
    b = Bisector(model, token_ids, candidate, **kw)
    return ([b.layers()] if axis in ("layers", "both") else []) + ([b.ops()] if axis in ("ops", "both") else [])
