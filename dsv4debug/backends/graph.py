"""A backend's ops under graph execution (`--graph`): torch.compile, or CUDA-graph capture and replay.

A wrapper backend, so the flow, the Executor and the observers stay as they are: runner.graph_check runs the
candidate eagerly as the primary side and this wrapper as a teacher-forced shadow that gets the very same
inputs op by op, so any difference is that op's own under graph execution.

CUDA graphs are captured per op, not per layer: the flow syncs with the host between ops (the expert token
counts of MoE routing, the embedding's and the hash router's row gathers), which no graph can hold. Each call
copies its inputs into static buffers and its weights to the device (so no host-to-device copy is captured),
warms the op up on a side stream (lazy initialisation, compiles), captures it, replays it, and copies the outputs
out of the graph's memory pool (the static output buffers, freed with the graph) into ordinary tensors. An op
whose capture fails (a host sync: the reference's embedding and hash-routing gathers read host tables) runs
eagerly instead and is named in `not_captured`, never silently.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..errors import BadInput
from ..formats import QWeight
from .base import Backend

# compile backends that run the eager kernels (bitwise equality expected); inductor generates its own
BITWISE_COMPILE_BACKENDS = ("eager", "aot_eager")


class GraphError(Exception):
    """An op failed to compile or to be captured (reported at its site as a graph failure)."""


def parse_graph(spec: str, device: str) -> list[tuple[str, str | None]]:
    """'compile[:BACKEND]' | 'cuda' | 'all' -> [(mode, compile backend)]; CUDA graphs need a CUDA device."""
    mode, _, be = spec.partition(":")
    if mode not in ("compile", "cuda", "all") or (be and mode != "compile"):
        raise BadInput(f"--graph {spec!r}: choose compile[:BACKEND] (torch.compile, inductor by default), "
                       "cuda (CUDA-graph capture and replay) or all")
    if mode in ("cuda", "all") and not (torch.cuda.is_available() and torch.device(device).type == "cuda"):
        raise BadInput(f"--graph {spec}: CUDA graphs need a CUDA GPU and --device cuda "
                       f"(CUDA available: {torch.cuda.is_available()}, device: {device}); "
                       "use --graph compile on the CPU")
    be = be or "inductor"
    if mode != "cuda":
        known = torch._dynamo.list_backends(exclude_tags=())
        if be not in known:
            raise BadInput(f"--graph compile:{be}: unknown torch.compile backend; known: {', '.join(known)}")
    return {"compile": [("compile", be)], "cuda": [("cuda", None)],
            "all": [("compile", be), ("cuda", None)]}[mode]


class GraphBackend(Backend):
    """`inner` with each of its own ops (not those delegated to the reference) run compiled or graph-captured."""

    def __init__(self, inner: Backend, mode: str, compile_backend: str | None = "inductor"):
        super().__init__(inner.device, inner.dtype)
        self.inner, self.mode, self.compile_backend = inner, mode, compile_backend
        self.name = f"{inner.name}@{'compile:' + compile_backend if mode == 'compile' else 'cudagraph'}"
        self.numerics = inner.numerics
        self._ops: dict[str, Any] = {}
        self.not_captured: list[tuple[str, str]] = []     # (op, why) of calls whose capture failed
        if mode == "compile":       # weights resolve outside the graph, which then guards on activations only
            inner.dense = torch.compiler.disable(inner.dense)

    def is_candidate_op(self, op: str) -> bool:
        return self.inner.is_candidate_op(op)

    def op(self, op: str):
        fn = self.inner.op(op)
        if not self.inner.is_candidate_op(op):
            return fn
        if op not in self._ops:
            graphed = (torch.compile(fn, backend=self.compile_backend) if self.mode == "compile"
                       else lambda *a, **kw: self._cuda_graph_call(op, fn, a, kw))
            self._ops[op] = _reporting(op, self.name, graphed)
        return self._ops[op]

    def take_not_captured(self) -> list[tuple[str, str]]:
        out, self.not_captured = self.not_captured, []
        return out

    def _cuda_graph_call(self, op: str, fn, args: tuple, kw: dict) -> Any:
        static = [_static(a, self.device) for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*static, **kw)                              # warm-up: lazy init, weight cache
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                static_out = fn(*static, **kw)
        except RuntimeError as e:   # a host sync (row gathers from host tables): runs eagerly, and is named
            while e.__context__ is not None:              # the capture's own error, not capture_end's
                e = e.__context__
            self.not_captured.append((op, f"{type(e).__name__}: {(str(e).strip() or '?').splitlines()[0][:300]}"))
            del graph
            torch.cuda.synchronize()
            return fn(*args, **kw)
        _refill(static, args)
        graph.replay()
        out = _copy_out(static_out)                        # out of the graph's pool, which goes with it
        torch.cuda.synchronize()
        del graph, static_out
        return out

    def end_stage(self) -> None:
        self.inner.end_stage()


def _reporting(op: str, name: str, fn):
    def call(*args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as e:
            raise GraphError(f"{op} failed under {name}: {type(e).__name__}: {str(e).strip()[:500]}") from e
    return call


def _static(a: Any, device: torch.device) -> Any:
    """A static copy of an activation argument (tensors, and dicts of them); weights moved to the device
    before capture (backends dequantise per call: a host-to-device copy cannot be captured); scalars as
    they are."""
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, dict):
        return {k: _static(v, device) for k, v in a.items()}
    if isinstance(a, QWeight):
        return replace(a, tensors={k: t.to(device) for k, t in a.tensors.items()})
    return a


def _copy_out(out: Any) -> Any:
    return tuple(_copy_out(o) for o in out) if isinstance(out, tuple) else out.clone()


def _refill(static: list, args: tuple) -> None:
    """Fresh inputs into the static buffers, as a serving engine does before each replay."""
    for buf, a in zip(static, args):
        if isinstance(a, torch.Tensor):
            buf.copy_(a)
        elif isinstance(a, dict):
            _refill(list(buf.values()), tuple(a.values()))
