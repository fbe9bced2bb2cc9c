"""The Python API: everything the CLI does, importable.

    import dsv4debug.api as dd
    model = dd.open_model()                         # the embedded tiny model (or a checkpoint directory)
    tokens = dd.make_tokens(model, seq_len=64)
    out = dd.reference(model, tokens, dtype="bf16", keep_sites="layers.2.attn.*")
    out.logits, out.sites["layers.2.attn.sparse_attn"]
    result = dd.run(model, tokens, candidate="sim", capture="run.h5")
    result.verdict["message"]
"""
from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .backends.registry import make_backend
from .checkpoint import Checkpoint
from .errors import BadInput
from .execute import Executor, OpEvent, Side, WeightSource
from .faults import Fault, parse_fault
from .model import State, stages
from .runner import RunOptions, RunResult, delegated_ops, on_its_device, parse_layers
from .runner import run as run_side_by_side
from .synth import default_checkpoint

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp64": torch.float64, "float64": torch.float64}


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise BadInput(f"dtype {name!r}: choose bf16, fp32 or fp64")
    return DTYPES[name]


def open_model(path: str | Path | None = None) -> Checkpoint:
    """A checkpoint directory (validated, lazily read), or the embedded tiny model when path is None."""
    return Checkpoint.open(default_checkpoint() if path is None else Path(path))


def make_tokens(model: Checkpoint, tokens: str | list[int] | None = None, prompt: str | None = None,
                seq_len: int | None = None, seed: int = 0) -> torch.Tensor:
    """Token ids from a list / "1,2,3" string, from a prompt (needs a tokenizer in the checkpoint directory
    and the optional `transformers` package), or `seq_len` deterministic pseudo-random ids (default 256)."""
    given = sum(x is not None for x in (tokens, prompt, seq_len))
    if given > 1:
        raise BadInput("give one of --tokens, --prompt, --seq-len")
    vocab = model.config.vocab_size
    if prompt is not None:
        ids = _tokenize(model.path, prompt)
    elif tokens is not None:
        try:
            ids = [int(t) for t in (tokens.split(",") if isinstance(tokens, str) else tokens)]
        except ValueError:
            raise BadInput(f"--tokens {tokens!r}: expected comma-separated integers") from None
    else:
        n = 256 if seq_len is None else seq_len
        if n < 1:
            raise BadInput(f"--seq-len {n}: must be >= 1")
        g = torch.Generator().manual_seed(seed)
        return torch.randint(2, vocab, (n,), generator=g)
    if not ids:
        raise BadInput("no tokens given")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BadInput(f"token id {bad[0]} outside the vocabulary 0..{vocab - 1}")
    return torch.tensor(ids, dtype=torch.long)


def _tokenize(path: Path, prompt: str) -> list[int]:
    if not (Path(path) / "tokenizer.json").exists():
        raise BadInput(f"--prompt needs a tokenizer: {path}/tokenizer.json not found (use --tokens instead)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise BadInput("--prompt needs the optional package `transformers` (pip install transformers)") from None
    return AutoTokenizer.from_pretrained(str(path)).encode(prompt)


@dataclass
class ReferenceOutput:
    logits: torch.Tensor                                   # [S, vocab] fp32 (fp64 in the fp64 run)
    sites: dict[str, torch.Tensor] = field(default_factory=dict)
    mtp_logits: torch.Tensor | None = None                 # [S, vocab] draft of token t+2 (mtp=True)


@on_its_device
def reference(model: Checkpoint, token_ids: torch.Tensor, dtype: str | torch.dtype = "bf16",
              device: str = "cpu", qat: bool = True, keep_sites: str | None = None, stream: bool = True,
              backend: str = "reference", faults: list[str] | None = None, mtp: bool = False,
              progress: Callable[[str, int, int], None] | None = None) -> ReferenceOutput:
    """One forward of `backend` (the reference by default) with layer streaming.

    keep_sites: a glob of site names whose outputs are returned (on CPU). stream=False keeps every
    layer's weights cached (for checking that streaming changes nothing)."""
    plan = [parse_fault(f) for f in faults or []]
    side = Side(backend, make_backend(backend, device, dtype_of(dtype)), WeightSource(model, plan), plan)
    kept: dict[str, torch.Tensor] = {}

    def keep(ev: OpEvent) -> None:
        for site, t in ev.outputs:
            if fnmatch.fnmatchcase(site, keep_sites):
                kept[site] = t.detach().cpu()

    ex = Executor(side, (), keep if keep_sites else None)
    state = State(token_ids.to(device))
    all_stages = stages(model.config, token_ids.numel(), device, qat, mtp=mtp)
    for n, stage in enumerate(all_stages):
        if progress:
            progress(stage.name, n, len(all_stages))
        state = stage.run(ex, state)
        if stream:
            ex.end_stage()
    return ReferenceOutput(state.h, kept, state.mtp_logits)


def run(model: Checkpoint, token_ids: torch.Tensor, candidate: str = "sim", reference_backend: str = "reference",
        mode: str = "both", forcing: str = "op", layers: str | None = None, device: str = "cpu",
        qat: bool = True, inject: list[str] | None = None, budget: float | None = None,
        capture: str | Path | None = None, save: str = "stats", force: bool = False,
        floor_dtype: str = "fp64", progress: Callable[[str, int, int], None] | None = None,
        **options: Any) -> RunResult:
    """Reference and candidate side by side; optionally recorded into an HDF5 capture."""
    opts = RunOptions(candidate=candidate, reference=reference_backend, mode=mode, forcing=forcing,
                      layers=parse_layers(layers, model.config), device=device, qat=qat,
                      floor_dtype=dtype_of(floor_dtype), faults=[parse_fault(f) for f in inject or []],
                      **({"budget": budget} if budget is not None else {}), **options)
    from .capture import CaptureWriter, as_policy
    as_policy(save)                                   # a bad policy fails before any work (BadInput)
    if capture is None:
        if save != "stats":
            raise BadInput(f"save policy {save!r} without a capture: pass capture=FILE (--capture) to store tensors")
        return run_side_by_side(model, token_ids, opts, progress=progress)
    meta = capture_meta(model, token_ids, opts)
    writer = CaptureWriter(capture, meta, save, force=force)
    producers: dict[str, dict[int, str]] = {}    # run -> data_ptr -> site: names the inputs of each op
    try:
        for run_name, attrs in writer_runs(opts).items():
            writer.begin_run(run_name, attrs)

        def record(ev: OpEvent, layer: int) -> None:
            made = producers.setdefault(ev.run, {})
            inputs = [made[t.data_ptr()] for t in ev.inputs if t.data_ptr() in made]
            for site, t in ev.outputs:
                # expert outputs hold the rows of their routed tokens: dim 0 is not the sequence
                writer.record(ev.run, site, t, layer=layer, family=ev.family, inputs=inputs,
                              token_dim=False if ".ffn.experts." in site else None)
                made[t.data_ptr()] = site

        def flush(layer: int) -> None:          # a killed run keeps every finished layer
            producers.clear()                   # freed tensors' addresses are reused by the next stage
            for r in writer_runs(opts):
                writer.end_layer(r, layer)

        result = run_side_by_side(model, token_ids, opts, recorder=record, progress=progress, stage_done=flush)
        write_results(writer, result)
    except BadInput:
        writer.abort().unlink(missing_ok=True)       # bad input: nothing half-written is left behind
        raise
    except BaseException:
        writer.abort()                               # a crash keeps the finished layers in OUT.h5.tmp
        raise
    writer.close()
    return result


def writer_runs(opts: RunOptions) -> dict[str, dict[str, Any]]:
    """The recorded runs with their attributes."""
    runs = {"reference": {"backend": opts.reference, "dtype": "bfloat16", "mode": "free"}}
    ops = ",".join(delegated_ops(opts.candidate, opts.reference_families))
    if opts.mode != "free":
        runs["candidate.forced"] = {"backend": opts.candidate, "dtype": "bfloat16", "mode": "forced",
                                    "forcing": opts.forcing, "delegated_ops": ops}
    if opts.mode != "forced":
        runs["candidate"] = {"backend": opts.candidate, "dtype": "bfloat16", "mode": "free",
                             "pin_router": opts.pin_router or "none", "delegated_ops": ops}
    return runs


def capture_meta(model: Checkpoint, token_ids: torch.Tensor, opts: RunOptions) -> dict[str, Any]:
    return {"token_ids": token_ids.tolist(), "model_config": model.config.to_dict(),
            "checkpoint": model.identity, "device": opts.device,
            "options": {"candidate": opts.candidate, "reference": opts.reference, "mode": opts.mode,
                        "forcing": opts.forcing, "qat": opts.qat, "budget": opts.budget,
                        "pin_router": opts.pin_router, "faults": [str(f) for f in opts.faults],
                        "delegated_ops": delegated_ops(opts.candidate, opts.reference_families),
                        "tool_version": __version__}}


def write_results(writer, result: RunResult) -> None:
    """Per-site metrics of each candidate run, the noise floors and the verdict."""
    local = {r.site: r.local for r in result.sites if r.local is not None}
    free = {r.site: r.free for r in result.sites if r.free is not None}
    if local:
        writer.write_metrics("candidate.forced", local)
    if free:
        writer.write_metrics("candidate", free)
    floors = {r.site: {"rel_l2_local": r.local_floor, "rel_l2_free": r.free_floor,
                       "bar_local": r.local_bar, "bar_free": r.free_bar}
              for r in result.sites if r.local_floor is not None or r.free_floor is not None}
    writer.write_floors({s: {k: v for k, v in f.items() if v is not None} for s, f in floors.items()},
                        source=f"reference (bf16) vs reference ({result.options.floor_dtype})")
    writer.write_verdict(dict(result.verdict, declined_calls=result.declined_calls))


__all__ = ["Fault", "ReferenceOutput", "RunResult", "make_tokens", "open_model", "reference", "run"]
