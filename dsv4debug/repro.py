"""One-op reproducers: `dsv4debug repro CAPTURE --site SITE OUT/` and its replay.

The capture names the checkpoint, the tokens, the candidate and its planted faults. The reference flow is
re-run up to the site (layer streaming) and the op's exact inputs are taken there; OUT/ then holds:
  repro.pt     op name, activation inputs, keyword arguments, the weight modules (clean and as the candidate
               reads them), the routing when the op is an expert
  repro.json   site, op, family, candidate, faults, config, and the command that replays it
so the op can be replayed with the reference (bf16 and fp64) and the candidate anywhere, without the model.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import torch

from .backends.base import OPS
from .backends.registry import backend_class, make_backend
from .config import ModelConfig
from .errors import BadInput
from .execute import Executor, Side, WeightSource, cast_activations
from .faults import Fault, parse_fault
from .metrics import MIN_FLOORS, compare_fast
from .model import State, W, stages
from .runner import QUANTIZED_LOCAL_BARS, on_its_device

FORMAT = "dsv4debug-repro"


class _Tapped(Exception):
    def __init__(self, op: str, args: tuple, kw: dict):
        self.op, self.args, self.kw = op, args, kw


class _Tap:
    """A ctx that runs the reference until the target site's op is called, then stops with its inputs."""

    def __init__(self, inner: Executor, site: str):
        self.inner, self.site = inner, site

    def __call__(self, site: str, op: str, *args: Any, **kw: Any) -> Any:
        if site == self.site:
            raise _Tapped(op, args, kw)
        return self.inner(site, op, *args, **kw)


def op_site(cfg: ModelConfig, site: str, seqlen: int) -> str:
    """The site whose op produces `site` (a secondary output like `...gate.topk_ids` belongs to `...gate`)."""
    from .runner import site_table
    rows = {r["site"]: r for r in site_table(cfg, seqlen)}
    if site not in rows and not site.split(".")[-1].isdigit():
        raise BadInput(f"site {site!r} is not a site of this model (see `dsv4debug sites`)")
    for name in (site, site.rsplit(".", 1)[0]):
        op = rows.get(name, {}).get("op")
        if op and (name == site or site.rsplit(".", 1)[1] in OPS[op][2]):
            return name
    return site          # an expert that the shape trace did not route to: still an op site


@on_its_device
def make_repro(model, token_ids: torch.Tensor, site: str, out_dir: Path, candidate: str,
               faults: list[Fault], qat: bool = True, device: str = "cpu", force: bool = False) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise BadInput(f"{out_dir} exists and is not empty; pass --force to overwrite")
    cfg = model.config
    target = op_site(cfg, site, token_ids.numel())
    ref_side = Side("reference", make_backend("reference", device), WeightSource(model))
    cand_weights = WeightSource(model, faults)
    state = State(token_ids.to(device))
    tapped = None
    for stage in stages(cfg, token_ids.numel(), device, qat):
        ex = Executor(ref_side)
        try:
            state = stage.run(_Tap(ex, target), state)
        except _Tapped as t:
            tapped = t
            break
        ex.end_stage()
    if tapped is None:
        raise BadInput(f"site {site!r} was not reached on these tokens (an expert no token was routed to?)")
    names = [a.name for a in tapped.args if isinstance(a, W)]
    doc = {
        "op": tapped.op,
        "args": [("weight", a.name) if isinstance(a, W) else ("value", _cpu(a)) for a in tapped.args],
        "kw": tapped.kw,
        "weights": {n: _qweight_dict(ref_side.weights.get(n)) for n in names},
        "candidate_weights": {n: _qweight_dict(cand_weights.get(n)) for n in names},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(doc, out_dir / "repro.pt")
    meta = {"format": FORMAT, "site": target, "requested_site": site, "op": tapped.op,
            "family": OPS[tapped.op][0], "reference_op": "dsv4_references." + OPS[tapped.op][1],
            "candidate": candidate, "faults": [str(f) for f in faults], "config": cfg.to_dict(),
            "command": f"dsv4debug repro-run {shlex.quote(str(out_dir))} --candidate {candidate}"
                       + "".join(f" --inject {shlex.quote(str(f))}" for f in faults
                                 if not f.on_weights and f.matches(target))}
    (out_dir / "repro.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def _cpu(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu()
    if isinstance(a, dict):
        return {k: _cpu(v) for k, v in a.items()}
    return a


def _qweight_dict(w) -> dict[str, Any]:
    return {"fmt": w.fmt, "tensors": {k: v.detach().cpu() for k, v in w.tensors.items()}}


class _SavedWeights:
    def __init__(self, modules: dict[str, dict]):
        from .formats import QWeight
        self.modules = {n: QWeight(n, m["fmt"], dict(m["tensors"])) for n, m in modules.items()}

    def get(self, name: str, clean: bool = False):
        return self.modules[name]

    def clear(self) -> None:
        pass


@on_its_device
def replay(repro_dir: Path, candidate: str | None = None, inject: list[str] = (), device: str = "cpu",
           budget: float = 8.0, clean_weights: bool = False) -> dict[str, Any]:
    """Run the saved op with the reference (bf16, fp64) and the candidate; compare as the runner does.

    The candidate reads the weights as the recorded candidate read them (weight faults included) unless
    clean_weights."""
    repro_dir = Path(repro_dir)
    try:
        meta = json.loads((repro_dir / "repro.json").read_text())
        doc = torch.load(repro_dir / "repro.pt", weights_only=False)
    except (OSError, ValueError, RuntimeError) as e:
        raise BadInput(f"{repro_dir}: not a dsv4debug repro directory ({e})") from None
    if meta.get("format") != FORMAT:
        raise BadInput(f"{repro_dir}/repro.json: not a dsv4debug repro (format {meta.get('format')!r})")
    candidate = candidate or meta["candidate"]
    args = tuple(W(v) if kind == "weight" else _to(v, device) for kind, v in doc["args"])
    faults = [parse_fault(f) for f in inject]

    def call(backend_name: str, dtype: torch.dtype, weights: dict, fs: list[Fault]) -> Any:
        side = Side(backend_name, make_backend(backend_name, device, dtype), _SavedWeights(weights), fs)
        return side.call(meta["site"], meta["op"], cast_activations(args, dtype), doc["kw"])

    ref = _first(call("reference", torch.bfloat16, doc["weights"], []))
    hi = _first(call("reference", torch.float64, doc["weights"], []))
    weights = doc["weights"] if clean_weights else doc["candidate_weights"]
    cand = _first(call(candidate, torch.bfloat16, weights, faults))
    m = compare_fast(ref, cand) if ref.is_floating_point() else {"equal": bool(torch.equal(ref, cand))}
    floor = compare_fast(hi, ref.to(hi.dtype))["rel_l2"] if ref.is_floating_point() else 0.0
    err = m.get("rel_l2", 0.0 if m.get("equal", True) else float("inf"))
    bar = QUANTIZED_LOCAL_BARS.get(meta["family"], 0.0) if backend_class(candidate).numerics == "quantized" else 0.0
    tolerance = max(budget * max(floor, MIN_FLOORS["rel_l2"]), bar)
    return {"site": meta["site"], "op": meta["op"], "candidate": candidate, "metrics": m, "floor": floor,
            "x_floor": err / max(floor, MIN_FLOORS["rel_l2"]), "tolerance": tolerance, "budget": budget,
            "quantization_bar": bar, "diverged": not err <= tolerance}


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _to(v: Any, device: str) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(device)
    if isinstance(v, dict):
        return {k: _to(x, device) for k, x in v.items()}
    return v

