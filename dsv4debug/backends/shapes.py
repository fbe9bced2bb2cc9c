"""A shape-only backend: runs the model flow on meta tensors to list every site with its shape and dtype.

Weights are never read (the weight source only knows the schema), so the site list of a Pro-shaped model
costs milliseconds. Routing is a fixed round-robin so every code path of the flow is walked.
"""
from __future__ import annotations

from typing import Any

import dsv4_references as ref
import torch

from ..config import ModelConfig
from ..formats import QWeight
from ..schema import all_modules
from .base import OPS
from .kernels import KERNEL_MODULES
from .reference import ReferenceBackend

META = torch.device("meta")


class _SchemaWeights:
    """A weight source that knows names and logical shapes only."""

    def __init__(self, cfg: ModelConfig):
        self.specs = {m.name: m for m in all_modules(cfg)}

    def get(self, name: str, clean: bool = False) -> QWeight:
        spec = self.specs[name]
        return QWeight(name, "meta", {"shape": torch.empty(spec.shape, device=META)})

    def clear(self) -> None:
        pass


class ShapeBackend(ReferenceBackend):
    name = "shapes"

    def __init__(self, cfg: ModelConfig):
        super().__init__(META)
        self.cfg = cfg

    def dense(self, w, dtype):
        return None if w is None else torch.empty(w.tensors["shape"].shape, device=META, dtype=dtype)

    # meta tensors take no memory: never in chunks
    def _by_rows(self, w, dtype, used, product, unit=1):
        return product(self.dense(w, dtype), 0, w.tensors["shape"].shape[0])

    def grouped_linear(self, o, w, *, groups):
        return ref.grouped_linear(o, self.dense(w, o.dtype), groups)

    def embed(self, ids, w):
        return torch.empty(ids.numel(), self.cfg.dim, device=META, dtype=self.dtype)

    def gate(self, x, w, bias, tid2eid, token_ids, *, topk, route_scale):
        n, e = x.size(0), self.cfg.n_routed_experts
        ids = (torch.arange(n)[:, None] * topk + torch.arange(topk)[None, :]) % e      # every expert used
        weights = torch.full((n, topk), 1.0 / topk)
        return weights, ids, torch.empty(n, e, device=META)

    # elementwise-heavy ops are slow on meta tensors: their shapes are immediate
    def hc_pre(self, x, fn, scale, base, *, iters, norm_eps, hc_eps):
        m = x.size(-2)
        return (torch.empty_like(x[..., 0, :]), torch.empty(x.size(0), m, device=META),
                torch.empty(x.size(0), m, m, device=META))

    def expert(self, x, w1, w3, w2, route_w, *, limit):
        return torch.empty_like(x)

    def moe_combine(self, n_tokens, expert_out, expert_tokens, shared):
        return torch.empty_like(shared)


def trace_sites(cfg: ModelConfig, seqlen: int = 8, layers: range | None = None) -> list[dict[str, Any]]:
    from ..execute import Executor, Side
    from ..model import State, stages

    table: list[dict[str, Any]] = []

    def observer(ev, layer):
        for site, t in ev.outputs:
            table.append({"site": site, "layer": layer, "op": ev.op, "family": ev.family,
                          "reference": "dsv4_references." + OPS[ev.op][1] if ev.op != "embed" else OPS[ev.op][1],
                          "kernel": KERNEL_MODULES.get(ev.op, "-"),
                          "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")})

    side = Side("shapes", ShapeBackend(cfg), _SchemaWeights(cfg))  # type: ignore[arg-type]
    state = State(torch.zeros(seqlen, dtype=torch.long))
    for stage in stages(cfg, seqlen, META, True, layers):
        ex = Executor(side, (), lambda ev, layer=stage.layer: observer(ev, layer))
        state = stage.run(ex, state)
    return table
