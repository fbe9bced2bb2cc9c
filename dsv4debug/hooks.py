"""Capture any PyTorch model into the dsv4debug capture format with forward hooks.

    from dsv4debug.hooks import capture
    with capture(model, "hf.h5", mapping="hf", save="full") as cap:     # transformers' DeepseekV4
        model(input_ids=ids)
    # dsv4debug diff ours.h5 hf.h5 --run-a reference --run-b hf --rules captures/rules/hf.toml

Forward pre/post hooks on every module of `module` hand each call to the name map (dsv4debug.name_maps):
the map says which of our sites the call yields (`layers.7.attn.wq_a`, `embed`, `logits` ...) and how to
get it from the output or the inputs (batch dimension of 1 dropped, per-head views re-laid out as ours,
fused outputs split). Modules the map does not know are recorded under their own qualified names
(`unmapped="record"`, default) or not at all (`unmapped="skip"`); `exclude=REGEX` hooks nothing on the
modules it matches. Statistics are always recorded; tensors by the save policy, as for our own captures.

The hooks never change the forward: they return None, edit nothing in place, and only read; if capturing
fails (a full disk, an unexpected output), the capture stops, a warning is issued, the model carries on,
and close() raises the error. In stats mode nothing synchronises with the device except what the capture
format needs: the token ids (read once, from the first forward's input_ids) and the layer flushes
(`flush="layer"`: each layer's rows are on disk once the layer's last site was recorded, so a crash keeps
the finished layers; `flush="forward"` flushes once per forward instead).

Runs: the first forward is recorded as run `run` (default: the map's name, "hf" or "vllm"), later ones as
`run.step1`, `run.step2` ... up to `forwards` forwards (default 1: e.g. the prefill of a generate()).
Records arriving after a forward returned (vLLM computes logits after the model's forward) belong to it.
"""
from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from .capture import TMP_SUFFIX, CaptureWriter, as_policy
from .errors import BadInput
from .name_maps import BUILTIN, SKIP, Call, NameMap, Tap, from_user, generic_take, model_config_of, resolve

HEAD_SITES = ("hc_head", "norm", "logits")
_LAYER_SITE = re.compile(r"^layers\.(\d+)\.")
_LAYER_MODULE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_LAYER_CONTAINER = re.compile(r"(?:^|\.)layers\.(\d+)$")

def resolve_map(mapping: Any) -> NameMap | None:
    """A NameMap from a built-in name ("hf", "vllm"), a NameMap, a dict or a callable; None: no map."""
    if mapping is None or isinstance(mapping, NameMap):
        return mapping
    if isinstance(mapping, str):
        if mapping not in BUILTIN:
            raise BadInput(f"mapping {mapping!r}: built-in maps are {', '.join(BUILTIN)}; or pass a dict "
                           "{module name: site} or a callable(module name, module) -> site")
        return BUILTIN[mapping]
    if isinstance(mapping, Mapping) or callable(mapping):
        return from_user(mapping)
    raise BadInput(f"mapping must be 'hf', 'vllm', a NameMap, a dict or a callable, not {type(mapping).__name__}")


class HookCapture:
    """A running capture; `close()` finishes the file (renames OUT.tmp to OUT), `abort()` leaves OUT.tmp.

    Attributes: path, run, sites (list of (run, site) recorded), unmapped (qualified names recorded under
    their own names), error (what stopped the capture, or None), forwards_seen.
    """

    def __init__(self, module: nn.Module, out: str | Path, mapping: Any = "hf", save: str = "stats",
                 meta: Mapping[str, Any] | None = None, force: bool = False, run: str | None = None,
                 forwards: int | None = 1, unmapped: str = "record", exclude: str | None = None,
                 flush: str = "layer", compression: str = "fast"):
        if unmapped not in ("record", "skip"):
            raise BadInput(f"unmapped={unmapped!r}: use 'record' or 'skip'")
        if flush not in ("layer", "forward"):
            raise BadInput(f"flush={flush!r}: use 'layer' or 'forward'")
        if forwards is not None and forwards < 1:
            raise BadInput(f"forwards={forwards}: must be >= 1 (or None for every forward)")
        self.root = module
        self.path = Path(out)
        self.nmap = resolve_map(mapping)
        self.run = run or (self.nmap.name if self.nmap is not None else "torch")
        self.policy = as_policy(save)
        self.meta = dict(meta or {})
        self.force, self.compression, self.flush = force, compression, flush
        self.forwards, self.unmapped_policy = forwards, unmapped
        self.exclude = re.compile(exclude) if exclude else None
        tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        if not force and (self.path.exists() or tmp.exists()):
            raise BadInput(f"{self.path if self.path.exists() else tmp} exists; refusing to overwrite a capture "
                           "(force=True replaces it)")

        self.sites: list[tuple[str, str]] = []
        self.unmapped: list[str] = []
        self.error: BaseException | None = None
        self.forwards_seen = 0
        self._modules = dict(module.named_modules())
        self._dims = dict(self.nmap.dims(module)) if self.nmap is not None else {}
        self._head_layer = self._dims.get("n_layers", self._count_layers())
        self._plan: dict[str, tuple[tuple[Tap, ...], dict[str, Any]]] = {}
        self._generic: set[str] = set()
        self._writer: CaptureWriter | None = None
        self._handles: list[Any] = []
        self._busy = False
        self._active = False
        self._closed = False
        self._current_run = self.run
        self._n_tokens = 0
        self._seen: set[str] = set()
        self._calls: Counter[str] = Counter()
        self._running: dict[str, tuple[tuple, dict]] = {}
        self._state: dict[Any, Any] = {}
        self._pending: set[int] = set()
        self._flushed: set[tuple[str, int]] = set()
        self._plan_modules()
        if "token_ids" in self.meta:
            self._open_writer(torch.as_tensor(self.meta["token_ids"]).reshape(-1))
        self._install()

    # ---- public ---------------------------------------------------------------------------------------
    def close(self) -> Path:
        """Remove the hooks, flush and finish the capture; raises the error that stopped it, if any."""
        if self._closed:
            return self.path
        self._remove_hooks()
        self._closed = True
        if self.error is not None:
            raise self.error
        if self._writer is None:
            raise BadInput(f"no forward of {type(self.root).__name__} ran while capturing into {self.path}: "
                           "nothing to write (or pass meta={'token_ids': ...} to write an empty capture)")
        self._flush_all()
        return self._writer.close()

    def abort(self) -> Path | None:
        """Remove the hooks and leave the unfinished OUT.tmp (every flushed layer readable)."""
        self._remove_hooks()
        self._closed = True
        return self._writer.abort() if self._writer is not None else None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ---- set-up ---------------------------------------------------------------------------------------
    def _count_layers(self) -> int:
        found = {int(m.group(1)) for name in self._modules if (m := _LAYER_CONTAINER.search(name))}
        return max(found) + 1 if found else -1

    def _plan_modules(self) -> None:
        for name, mod in self._modules.items():
            if self.exclude is not None and self.exclude.search(name):
                continue
            taps, groups = resolve(self.nmap, name, mod) if self.nmap is not None else (None, {})
            if taps is None and self.unmapped_policy == "record":
                taps, groups = (Tap(name.replace("{", "{{").replace("}", "}}") or "output", generic_take),), {}
                self._generic.add(name)
            self._plan[name] = (() if taps in (None, SKIP) else taps, groups)

    def _install(self) -> None:
        for name, mod in self._modules.items():
            if name not in self._plan and mod is not self.root:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post_hook(name), with_kwargs=True))

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active = False

    def _open_writer(self, token_ids: torch.Tensor) -> None:
        meta = dict(self.meta)
        meta["token_ids"] = [int(t) for t in token_ids.tolist()]
        if "model_config" not in meta:
            cfg = model_config_of(self.root)
            if cfg is not None:
                meta["model_config"] = cfg
        meta.setdefault("source", "hooks")
        meta.setdefault("engine", self.nmap.engine if self.nmap is not None and self.nmap.engine else "torch")
        meta.setdefault("mapping", self.nmap.name if self.nmap is not None else "none")
        meta.setdefault("module_class", type(self.root).__name__)
        param = next(self.root.parameters(), None)
        if "device" not in meta and param is not None:
            meta["device"] = (torch.cuda.get_device_name(param.device) if param.device.type == "cuda"
                              else str(param.device))
        # an engine may reuse a module's output in place (vLLM's fused residual norms): statistics at record()
        self._writer = CaptureWriter(self.path, meta, self.policy, force=self.force, compression=self.compression,
                                     defer_stats=False)
        self._param_dtype = str(param.dtype).removeprefix("torch.") if param is not None else ""

    # ---- hooks ----------------------------------------------------------------------------------------
    def _pre_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._busy or self.error is not None or self._closed:
                return
            self._busy = True
            try:
                if module is self.root:
                    self._begin_forward(args, kwargs)
                if self._active:
                    self._running[name] = (args, kwargs)
                    self._run_taps(name, module, args, kwargs, None, "pre")
            except BaseException as e:    # noqa: BLE001 - never break the model's forward
                self._fail(e)
            finally:
                self._busy = False
            return
        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._busy or self.error is not None or self._closed:
                return
            self._busy = True
            try:
                if self._active:
                    self._run_taps(name, module, args, kwargs, output, "post")
                    self._calls[name] += 1
                    self._running.pop(name, None)
                    if self.nmap is None or self.nmap.layer_end_site is None:
                        m = _LAYER_CONTAINER.search(name)
                        if m and self.flush == "layer":
                            self._flush_through(int(m.group(1)))
                if module is self.root:
                    self._end_forward()
            except BaseException as e:    # noqa: BLE001
                self._fail(e)
            finally:
                self._busy = False
            return
        return hook

    def _begin_forward(self, args: tuple, kwargs: dict) -> None:
        index = self.forwards_seen
        self.forwards_seen += 1
        self._active = self.forwards is None or index < self.forwards
        if not self._active:
            return
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        if ids is not None:
            if ids.dim() == 2 and ids.shape[0] != 1:
                raise BadInput(f"capture records one sequence; this forward has a batch of {ids.shape[0]} "
                               "(call the model with input_ids of shape [1, S] or [S])")
            self._n_tokens = ids.numel()
        if self._writer is None:
            if ids is None:
                raise BadInput("capture needs the token ids: call the model with input_ids, or pass "
                               "meta={'token_ids': [...]}")
            self._open_writer(ids.detach().reshape(-1).cpu())
        if ids is None:
            self._n_tokens = self._writer.n_tokens
        self._current_run = self.run if index == 0 else f"{self.run}.step{index}"
        self._seen.clear()
        self._calls.clear()
        self._running.clear()
        self._state.clear()
        self._writer.begin_run(self._current_run, {
            "backend": self.nmap.engine if self.nmap is not None and self.nmap.engine else "torch",
            "dtype": self._param_dtype, "mode": "free", "mapping": self.nmap.name if self.nmap else "none",
            "module_class": type(self.root).__name__, "forward": index})

    def _end_forward(self) -> None:
        if self._active:
            self._flush_all()

    def _run_taps(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any, when: str) -> None:
        taps, groups = self._plan.get(name, ((), {}))
        if not taps:
            return
        call = Call(name=name, module=module, args=args, kwargs=kwargs, output=output, n_tokens=self._n_tokens,
                    calls=self._calls[name], groups=groups, dims=self._dims, running=self._running,
                    state=self._state, modules=self._modules)
        with torch.no_grad():
            for tap in taps:
                if tap.when != when:
                    continue
                tensor = tap.take(call)
                if isinstance(tensor, torch.Tensor):
                    self._record(tap.site_name(groups), tensor, tap, call)

    def _record(self, site: str, tensor: torch.Tensor, tap: Tap, call: Call) -> None:
        base, k = site, 0
        while site in self._seen:
            k += 1
            site = f"{base}#{k}"
        self._seen.add(site)
        layer = self._layer_of(site, call.name)
        attrs: dict[str, Any] = {"module": call.name, "module_class": type(call.module).__name__}
        if tap.note:
            attrs["note"] = tap.note
        if tap.covers:
            attrs["covers"] = list(tap.covers)
        if tap.extra:
            attrs["extra"] = True
        if tap.when == "pre":
            attrs["from"] = "input"
        self._writer.record(self._current_run, site, tensor, layer=layer, family=tap.family, attrs=attrs)
        self.sites.append((self._current_run, site))
        if call.name in self._generic and call.name not in self.unmapped:
            self.unmapped.append(call.name)
        self._pending.add(layer)
        end = self.nmap.layer_end_site if self.nmap is not None else None
        if self.flush == "layer" and end and layer >= 0 and site == f"layers.{layer}.{end}":
            self._flush_through(layer)

    def _layer_of(self, site: str, module_name: str) -> int:
        m = _LAYER_SITE.match(site)
        if m:
            return int(m.group(1))
        if site == "embed":
            return -1
        if site in HEAD_SITES:
            return self._head_layer
        m = _LAYER_MODULE.search(module_name)
        return int(m.group(1)) if m else -1

    def _flush_through(self, layer: int) -> None:
        """end_layer for every pending layer <= layer, in order (the embedding's -1 first)."""
        for pending in sorted(x for x in self._pending if x <= layer):
            if (self._current_run, pending) not in self._flushed:    # later rows go out with the next flush
                self._writer.end_layer(self._current_run, pending)
                self._flushed.add((self._current_run, pending))
            self._pending.discard(pending)

    def _flush_all(self) -> None:
        if self._writer is not None and self._pending:
            self._flush_through(max(self._pending))

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._active = False
        where = ""
        if self._writer is not None:
            where = f"; what was flushed is in {self._writer.abort()}"
        warnings.warn(f"dsv4debug capture into {self.path} stopped: {error!r}; the model runs on{where}",
                      RuntimeWarning, stacklevel=3)


def start_capture(module: nn.Module, out: str | Path, mapping: Any = "hf", save: str = "stats",
                  meta: Mapping[str, Any] | None = None, force: bool = False, **options: Any) -> HookCapture:
    """Install the hooks and return the HookCapture; call `.close()` when the forward(s) are done.
    Options: run, forwards, unmapped ('record' | 'skip'), exclude (regex), flush ('layer' | 'forward'),
    compression ('fast' | 'small')."""
    return HookCapture(module, out, mapping=mapping, save=save, meta=meta, force=force, **options)


@contextmanager
def capture(module: nn.Module, out: str | Path, mapping: Any = "hf", save: str = "stats",
            meta: Mapping[str, Any] | None = None, force: bool = False, **options: Any) -> Iterator[HookCapture]:
    """Record every forward of `module` inside the block (see the module docstring); the file is
    finished when the block ends, or left as OUT.tmp if it raises."""
    cap = start_capture(module, out, mapping=mapping, save=save, meta=meta, force=force, **options)
    try:
        yield cap
    except BaseException:
        cap.abort()
        raise
    cap.close()


__all__ = ["HookCapture", "capture", "resolve_map", "start_capture"]
