"""Backends by name: the built-in ones and any registered under the `dsv4debug.backends` entry point.

A user's package adds its kernels as a candidate with, in its pyproject.toml:
    [project.entry-points."dsv4debug.backends"]
    mykernels = "mypkg.dsv4:MyBackend"      # a dsv4debug.backends.base.Backend subclass
"""
from __future__ import annotations

from importlib.metadata import entry_points

import torch

from ..errors import BadInput
from .base import Backend

BUILTIN = {
    "reference": "dsv4debug.backends.reference:ReferenceBackend",
    "sim": "dsv4debug.backends.sim:SimBackend",
    "sim-w4a16": "dsv4debug.backends.sim:SimW4A16Backend",
    "kernels": "dsv4debug.backends.kernels:KernelsBackend",
}
_registered: dict[str, type[Backend]] = {}


def register(name: str, cls: type[Backend]) -> None:
    """Register a backend class in-process (tests, notebooks); entry points do the same for packages."""
    _registered[name] = cls


def available() -> dict[str, str]:
    names = dict(BUILTIN)
    for ep in entry_points(group="dsv4debug.backends"):
        names.setdefault(ep.name, ep.value)
    names.update({n: f"{c.__module__}:{c.__qualname__}" for n, c in _registered.items()})
    return names


def backend_class(name: str) -> type[Backend]:
    if name in _registered:
        return _registered[name]
    eps = {ep.name: ep for ep in entry_points(group="dsv4debug.backends")}
    if name in eps:
        cls = eps[name].load()
    elif name in BUILTIN:
        module, attr = BUILTIN[name].split(":")
        cls = getattr(__import__(module, fromlist=[attr]), attr)
    else:
        raise BadInput(f"unknown backend {name!r}; available: {', '.join(sorted(available()))}")
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BadInput(f"backend {name!r} ({cls!r}) is not a dsv4debug.backends.base.Backend subclass")
    return cls


def make_backend(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> Backend:
    return backend_class(name)(device, dtype)
