"""Executing the model flow on one or more sides.

A *side* is a backend plus the weights it reads and the faults planted in it. `Executor` is the `ctx` of
dsv4debug/model.py: it runs each op on the primary side (whose outputs drive the flow) and on any number of
shadow sides that receive the primary's inputs (teacher forcing per op), and reports every output to an
observer. A free run is an Executor with no shadows.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .backends.base import OPS, Backend, UnsupportedOp, family_of
from .errors import BadInput
from .faults import Fault, apply_activation_fault, apply_weight_faults
from .formats import QWeight
from .model import W


class ModuleCache:
    """A checkpoint's modules of the current stage, read (or generated) once and shared by every side that
    runs the stage: a layer's weights are in memory once, however many sides (reference, forced and free
    candidate, fp64 floors) read them. Whoever drives the stages clears it after each one."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        self._modules: dict[str, QWeight] = {}

    def module(self, name: str) -> QWeight:
        if name not in self._modules:
            self._modules[name] = self.checkpoint.module(name)
        return self._modules[name]

    def clear(self) -> None:
        self._modules.clear()


class WeightSource:
    """Modules read from a checkpoint for the current stage, with weight faults applied (unless `clean`: for
    ops a side delegates to the reference, which loads its own weights); cleared per stage.

    `modules`: a ModuleCache shared with other sides of the same stages (its owner clears it); by default the
    source has its own, cleared with it."""

    def __init__(self, checkpoint, faults: list[Fault] = (), modules: ModuleCache | None = None):
        self.faults = [f for f in faults if f.on_weights]
        self.modules = modules or ModuleCache(checkpoint)
        self._owns_modules = modules is None
        self._cache: dict[tuple[str, bool], QWeight] = {}

    def get(self, name: str, clean: bool = False) -> QWeight:
        key = (name, clean or not self.faults)
        if key not in self._cache:
            self._cache[key] = apply_weight_faults([] if key[1] else self.faults, name, self.modules.module)
        return self._cache[key]

    def clear(self) -> None:
        self._cache.clear()
        if self._owns_modules:
            self.modules.clear()


ROUTER_PINS = ("ids", "ids+weights")


@dataclass
class Side:
    run: str                                   # capture run name: reference, candidate, candidate.forced, ...
    backend: Backend
    weights: WeightSource
    faults: list[Fault] = field(default_factory=list)
    # router pinning: the gate's expert ids (and weights) come from `pinned(site)` (the reference's outputs),
    # separating routing error from expert-kernel error in a free run
    pin: str | None = None
    pinned: Callable[[str], tuple] | None = None

    def __post_init__(self):
        self.faults = [f for f in self.faults if not f.on_weights]

    def call(self, site: str, op: str, args: tuple, kw: dict) -> Any:
        own = self.backend.is_candidate_op(op)
        resolved = [self.weights.get(a.name, clean=not own) if isinstance(a, W) else a for a in args]
        if op == "gate" and self.pin:
            return self._pinned_gate(site, resolved, kw)
        try:
            out = self.backend.op(op)(*resolved, **kw)
        except UnsupportedOp as e:
            raise UnsupportedOp(f"{e} (site {site})") from None
        for f in self.faults:
            if own and f.matches(site):
                out = _map_first(out, lambda t, f=f: apply_activation_fault(f, site, t))
        return out

    def _pinned_gate(self, site: str, args: list, kw: dict) -> Any:
        """Route by the reference's ids: the candidate's gate weighs them with its own scores, as a hash
        layer would (a per-position table), unless the weights are pinned too."""
        ref_weights, ref_ids, _ = self.pinned(site)
        x, w, bias, _, _ = args
        table = QWeight(f"{site}.pinned_ids", "i64", {"": ref_ids.cpu()})
        positions = torch.arange(ref_ids.size(0), device=ref_ids.device)
        weights, ids, scores = self.backend.op("gate")(x, w, bias, table, positions, **kw)
        return (ref_weights if self.pin == "ids+weights" else weights), ids, scores

    def end_stage(self) -> None:
        self.backend.end_stage()
        self.weights.clear()


def _map_first(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return (fn(out[0]), *out[1:]) if isinstance(out, tuple) else fn(out)


def cast_activations(args: tuple, dtype: torch.dtype) -> tuple:
    """Shadows in another precision get the primary's floating activations cast to their dtype.

    Integer ids, complex rope tables and fp32 side outputs (mHC post/comb, routing weights) keep their
    dtype unless the shadow is fp64, where everything floating is widened.
    """
    def cast(a):
        widen = isinstance(a, torch.Tensor) and a.is_floating_point() and (
            a.dtype in (torch.bfloat16, torch.float16) or dtype == torch.float64)
        if widen:
            return a.to(dtype)
        if isinstance(a, dict):
            return {k: cast(v) for k, v in a.items()}
        return a
    return tuple(cast(a) for a in args)


@dataclass
class OpEvent:
    """One op executed on one side: what an observer sees."""
    site: str
    op: str
    family: str
    run: str
    outputs: list[tuple[str, torch.Tensor]]    # (site name, tensor): first output at `site`, others suffixed
    inputs: list[torch.Tensor]                 # the activation tensors the op read


def named_outputs(site: str, op: str, out: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(out, tuple):
        return [(site, out)]
    extra = OPS[op][2]
    return [(site, out[0])] + [(f"{site}.{n}", t) for n, t in zip(extra, out[1:])]


def activation_inputs(args: tuple) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            flat.append(a)
        elif isinstance(a, dict):
            flat.extend(v for v in a.values() if isinstance(v, torch.Tensor))
    return flat


class Executor:
    """The flow's ctx: primary side drives, shadows get the primary's inputs, observer sees every output."""

    def __init__(self, primary: Side, shadows: list[tuple[Side, torch.dtype]] = (),
                 observer: Callable[[OpEvent], None] | None = None):
        self.primary = primary
        self.shadows = list(shadows)
        self.observer = observer

    def __call__(self, site: str, op: str, *args: Any, **kw: Any) -> Any:
        out = self.primary.call(site, op, args, kw)
        self._notify(site, op, self.primary.run, out, args)
        for side, dtype in self.shadows:
            shadow_args = cast_activations(args, dtype)
            self._notify(site, op, side.run, side.call(site, op, shadow_args, kw), shadow_args)
        return out

    def _notify(self, site: str, op: str, run: str, out: Any, args: tuple) -> None:
        if self.observer is not None:
            self.observer(OpEvent(site, op, family_of(op), run, named_outputs(site, op, out),
                                  activation_inputs(args)))

    def end_stage(self) -> None:
        self.primary.end_stage()
        for side, _ in self.shadows:
            side.end_stage()


def check_faults_target_sites(faults: list[Fault], site_names: Callable[[], list[str]]) -> None:
    """Every activation fault must match at least one site of this run (typos are bad input, not no-ops).
    site_names is called only when there is one (tracing the flow's sites takes a second on the tiny model)."""
    if all(f.on_weights for f in faults):
        return
    sites = site_names()
    for f in faults:
        if not f.on_weights and not any(f.matches(s) for s in sites):
            near = [s for s in sites if f.target.split(".")[-1] in s][:5]
            raise BadInput(f"--inject {f}: no site matches '{f.target}'"
                           + (f"; did you mean {', '.join(near)}?" if near else ""))
