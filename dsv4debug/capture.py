"""Capture format v1: one HDF5 file holds one input and one or more runs, every site's statistics and, by
policy, its tensor. Layout and attributes are documented in captures/README.md; the attribute tables there
come from the *_ATTRS tuples below (`python -m dsv4debug.capture --doc` prints them).

Writing is asynchronous: `record` computes statistics on the tensor's device, starts the device->host copy
and returns; a prepare thread converts tensors and has a worker pool shuffle, compress and hash the chunks;
a writer thread, the only one touching HDF5, writes them with `write_direct_chunk`. `end_layer` returns once
everything recorded so far is flushed, so a process killed afterwards leaves those layers readable.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import queue
import re
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from typing_extensions import Self

from . import __version__
from .errors import BadInput

FORMAT = "dsv4debug-capture"
FORMAT_VERSION = 1
HASH_NAME = "blake2b-256"
TMP_SUFFIX = ".tmp"
CHUNK_BYTES = 1 << 20           # target stored bytes per HDF5 chunk: large enough for throughput, small for diff
STATS_CHUNK = 1 << 24           # elements per float64 step of the statistics
COMPRESSIONS = ("fast", "small")
STAT_KEYS = ("nan_count", "inf_count", "min", "max", "mean", "std", "absmax", "l2")

# (name, type, meaning): the documented attributes, printed by --doc into captures/README.md.
ROOT_ATTRS = (
    ("format", "str", f'always "{FORMAT}"'),
    ("format_version", "int", f"{FORMAT_VERSION}; readers refuse other versions"),
    ("tool_version", "str", "dsv4debug version that wrote the file"),
    ("created_utc", "str", "ISO 8601 time the capture was started"),
    ("complete", "bool", "true once the writer closed the file; false in a killed or crashed capture"),
    ("token_ids", "int64[T]", "the input: token ids (T tokens)"),
    ("model_config", "JSON str", "ModelConfig.to_dict() of the model that ran"),
    ("checkpoint", "JSON str", "checkpoint identity (path, index hash, format ...) as the runner gives it"),
    ("device", "str", "device the runs executed on (GPU name or cpu)"),
    ("torch_version", "str", "torch.__version__"),
    ("cutedsl_version", "str", 'nvidia-cutlass-dsl version, or "not installed"'),
    ("save_policy", "str", "the SavePolicy text deciding which tensors were stored"),
    ("compression", "str", "chunk compression mode: fast | small (both decode with shuffle+deflate)"),
    ("json_keys", "str[]", "names of root attributes holding JSON text (decoded by the reader)"),
    ("verdict", "JSON str", "optional: the verdict (dsv4debug.verdict.summarize) when the runner wrote one"),
)
RUN_ATTRS = (
    ("backend", "str", "backend name (reference, sim, kernels, or a plugin)"),
    ("dtype", "str", "compute dtype of the run (bfloat16, float32, float64)"),
    ("mode", "str", "free (each side carries its state) or forced (candidate given the reference inputs)"),
    ("layers_completed", "int64[]", "layers whose end_layer flush finished, in order"),
    ("*", "any", "further attributes given to begin_run"),
)
SITE_ATTRS = (
    ("order", "int", "execution index of the site within its run (0, 1, 2 ...)"),
    ("layer", "int", "layer index; -1 for global sites (embed, hc_head, norm, logits)"),
    ("family", "str", "op family (linear, norm, rope, attention, moe, ...); may be empty"),
    ("inputs", "JSON str", "list of the site names whose outputs this op consumed"),
    ("dtype", "str", "torch dtype of the site's output, e.g. bfloat16"),
    ("shape", "int64[]", "shape of the full output tensor"),
    ("numel", "int", "number of elements of the full output"),
    ("nan_count", "int", "NaN elements"),
    ("inf_count", "int", "+-Inf elements"),
    ("min", "float64", "minimum over finite elements (NaN if none)"),
    ("max", "float64", "maximum over finite elements"),
    ("mean", "float64", "mean over finite elements"),
    ("std", "float64", "standard deviation over finite elements (n-1)"),
    ("absmax", "float64", "largest finite |x|"),
    ("l2", "float64", "L2 norm over finite elements"),
    ("first_nonfinite", "int64[]", "coordinates of the first NaN/Inf element in C order (only when there is one)"),
    ("stored", "bool", "whether the dataset `tensor` holds (a slice of) the output"),
    ("*", "any", "extra attributes given to record(attrs=...)"),
)
TENSOR_ATTRS = (
    ("dtype", "str", "original torch dtype; the dataset holds it losslessly (bf16/fp16/fp8 as float32, bool as uint8)"),
    ("token_slice", "int64[2]", "[start, stop) of dim 0 that is stored, when dim 0 is the token dimension"),
    ("hash", "str", (f'"{HASH_NAME}:<hex>" of the stored tensor\'s bytes in its original dtype, C order '
                    "(float32/float64/int data: the dataset's own bytes; bf16: the top 16 bits of each float32)")),
)
FLOOR_METRIC_ATTRS = (
    ("/metrics/<run> reference", "str", "run the candidate run was compared against"),
    ("/metrics/<run>/<site> *", "float/int/str", "output of dsv4debug.metrics.compare or index_agreement"),
    ("/floors source", "str", "how the floors were measured, e.g. reference (bf16) vs reference.fp64"),
    ("/floors/<site> *", "float", "noise floor per metric for this site (same names as the metrics)"),
)


# ---------------------------------------------------------------------------------------------------------
# Save policy
# ---------------------------------------------------------------------------------------------------------
_CLAUSE = re.compile(r",(?=(?:stats|full|tokens:|sites:))")   # split on commas that start a clause only


@dataclass(frozen=True)
class SavePolicy:
    """Which sites keep their tensor, and which token rows.

    Clauses joined by ',': `stats` (no tensors), `full` (every tensor, all tokens), `tokens:A:B` (token rows
    [A, B) of every stored tensor), `sites:REGEX` (only sites where re.search(REGEX, name) matches; several
    are OR-ed). `tokens:` or `sites:` alone imply storing. Dim 0 is the token dimension when it equals the
    number of input tokens (or when the runner says so with record(token_dim=...)); other tensors are stored
    whole.
    """
    text: str = "stats"
    store: bool = False
    sites: re.Pattern | None = None
    tokens: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str) -> SavePolicy:
        clauses = [c for c in _CLAUSE.split(text.strip()) if c]
        if not clauses:
            raise BadInput(f"save policy {text!r} is empty; use stats, full, tokens:A:B or sites:REGEX")
        store, sites, tokens = False, [], None
        for clause in clauses:
            if clause == "stats":
                if len(clauses) > 1:
                    raise BadInput(f"save policy {text!r}: 'stats' stores no tensors and cannot be combined")
            elif clause == "full":
                store = True
            elif clause.startswith("tokens:"):
                tokens, store = _parse_tokens(text, clause), True
            elif clause.startswith("sites:"):
                sites.append(_parse_regex(text, clause[len("sites:"):]))
                store = True
            else:
                raise BadInput(f"save policy {text!r}: unknown clause {clause!r}; "
                               "use stats, full, tokens:A:B or sites:REGEX joined by ','")
        pattern = re.compile("|".join(f"(?:{s})" for s in sites)) if sites else None
        return cls(text=text, store=store, sites=pattern, tokens=tokens)

    def decide(self, site: str, shape: Sequence[int], token_dim: bool) -> tuple[bool, tuple[int, int] | None]:
        """(store?, token rows [a, b) to store or None for the whole tensor)."""
        if not self.store or (self.sites is not None and not self.sites.search(site)):
            return False, None
        if not token_dim:
            return True, None
        a, b = self.tokens or (0, shape[0])
        return True, (min(a, shape[0]), min(b, shape[0]))


def _parse_tokens(text: str, clause: str) -> tuple[int, int]:
    parts = clause.split(":")
    try:
        a, b = int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        a = b = -1
    if len(parts) != 3 or not 0 <= a < b:
        raise BadInput(f"save policy {text!r}: {clause!r} must be tokens:A:B with 0 <= A < B")
    return a, b


def _parse_regex(text: str, regex: str) -> str:
    try:
        re.compile(regex)
    except re.error as e:
        raise BadInput(f"save policy {text!r}: bad regular expression {regex!r} ({e})") from None
    return regex


def as_policy(policy: SavePolicy | str) -> SavePolicy:
    return policy if isinstance(policy, SavePolicy) else SavePolicy.parse(policy)


# ---------------------------------------------------------------------------------------------------------
# Statistics on the device
# ---------------------------------------------------------------------------------------------------------
def device_stats(t: torch.Tensor) -> torch.Tensor:
    """float64 [nan, inf, min, max, mean, std, absmax, l2, first non-finite flat index or -1] on t's device.

    min/max/mean/std/l2 are over finite values only, summed in float64 chunk by chunk (temporaries stay
    bounded; bf16 squares cannot overflow). On CPU a tensor found all-finite by one aminmax pass (NaN
    propagates through it) skips the masking; on GPU the masked path always runs, so nothing syncs.
    """
    x = t.detach().reshape(-1)
    if x.numel() == 0:
        nan = float("nan")
        return torch.tensor([0, 0, nan, nan, nan, nan, nan, 0, -1], dtype=torch.float64, device=x.device)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = x.double()          # integers, bool and fp8 formats (which most reductions do not support)
    if x.device.type == "cpu":
        lo, hi = torch.aminmax(x)
        if bool(torch.isfinite(lo) & torch.isfinite(hi)):
            return _finite_stats(x, lo.double(), hi.double())
    return _masked_stats(x)


def _finite_stats(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    total = sumsq = torch.zeros((), dtype=torch.float64, device=x.device)
    for chunk in x.split(STATS_CHUNK):
        xd = chunk.double()
        total, sumsq = total + xd.sum(), sumsq + torch.dot(xd, xd)
    zero = torch.zeros_like(total)
    return _pack(zero, torch.full_like(total, x.numel()), lo, hi, total, sumsq, zero - 1, x.numel())


def _masked_stats(x: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    n_nan = n_finite = total = sumsq = zero
    lo, hi, first_bad = zero + torch.inf, zero - torch.inf, zero - 1
    for start in range(0, x.numel(), STATS_CHUNK):
        xd = x[start:start + STATS_CHUNK].double()
        finite = torch.isfinite(xd)
        kept = torch.where(finite, xd, 0)
        n_nan, n_finite = n_nan + xd.isnan().sum(), n_finite + finite.sum()
        total, sumsq = total + kept.sum(), sumsq + torch.dot(kept, kept)
        lo = torch.minimum(lo, torch.where(finite, xd, torch.inf).amin())
        hi = torch.maximum(hi, torch.where(finite, xd, -torch.inf).amax())
        bad_here = (~finite).to(torch.uint8).argmax() + start
        first_bad = torch.where((first_bad < 0) & ~finite.all(), bad_here.double(), first_bad)
    return _pack(n_nan, n_finite, lo, hi, total, sumsq, first_bad, x.numel())


def _pack(n_nan, n_finite, lo, hi, total, sumsq, first_bad, numel: int) -> torch.Tensor:
    n_finite = n_finite.double()
    mean = total / n_finite
    var = ((sumsq - total * mean) / (n_finite - 1).clamp(min=1)).clamp(min=0)
    absmax = torch.maximum(lo.abs(), hi.abs())
    values = (n_nan, numel - n_finite - n_nan, lo, hi, mean, var.sqrt(), absmax, sumsq.sqrt(), first_bad)
    return torch.stack([v.double() for v in values])


def stats_dict(values: Sequence[float], dtype: torch.dtype, shape: Sequence[int]) -> dict[str, Any]:
    """The statistics attributes of one site from device_stats' values (host floats)."""
    n_nan, n_inf = int(values[0]), int(values[1])
    no_finite = n_nan + n_inf == int(np.prod(shape))
    out: dict[str, Any] = {"nan_count": n_nan, "inf_count": n_inf}
    for key, v in zip(STAT_KEYS[2:], values[2:8]):
        out[key] = float("nan") if no_finite and key != "l2" else float(v)
    out.update(numel=int(np.prod(shape)), dtype=dtype_name(dtype), shape=[int(s) for s in shape])
    if values[8] >= 0:
        out["first_nonfinite"] = [int(i) for i in np.unravel_index(int(values[8]), tuple(shape))]
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------
# Chunk encoding: shuffle + deflate streams built per byte plane
# ---------------------------------------------------------------------------------------------------------
# A chunk of n elements of itemsize s is stored shuffled (byte plane 0 of every element, then plane 1 ...),
# then deflated, exactly what HDF5's shuffle and deflate filters produce, so h5py and h5dump decode it.
# We build the zlib stream plane by plane: all-zero planes (the low half of a bf16 value widened to float32)
# become a few bytes, other planes are deflated Huffman-only ("small") or kept as stored blocks ("fast").
# Stored blocks cost a memcpy; general deflate runs at ~40-80 MB/s per core and would not keep up with disk.
_ZLIB_HEADER = b"\x78\x01"
_FINAL_EMPTY_BLOCK = b"\x01\x00\x00\xff\xff"
_ADLER_MOD = 65521


@functools.lru_cache(maxsize=64)
def _zero_plane_deflate(n: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_RLE)
    return c.compress(bytes(n)) + c.flush(zlib.Z_SYNC_FLUSH)


def _adler32_of_zeros(adler: int, n: int) -> int:
    low, high = adler & 0xFFFF, adler >> 16
    return (((high + n * low) % _ADLER_MOD) << 16) | low


def _stored_blocks(data: np.ndarray) -> list:
    view = memoryview(data).cast("B")
    parts = []
    for i in range(0, len(view), 0xFFFF):
        piece = view[i:i + 0xFFFF]
        parts += [struct.pack("<BHH", 0, len(piece), len(piece) ^ 0xFFFF), piece]
    return parts


def _huffman_deflate(data: np.ndarray) -> bytes:
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return c.compress(data) + c.flush(zlib.Z_SYNC_FLUSH)


def shuffled_planes(chunk: np.ndarray, widen_bf16: bool = False) -> list[np.ndarray | int]:
    """HDF5's shuffle of a chunk as byte planes. widen_bf16: the chunk holds bf16 bits (uint16) that the
    dataset stores as float32, whose two low byte planes are zero (an int n stands for n zero bytes)."""
    planes = list(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1, chunk.itemsize).T.copy())
    return [chunk.size, chunk.size, *planes] if widen_bf16 else planes


def encode_planes(planes: Sequence[np.ndarray | int], compression: str) -> bytes:
    """The zlib stream of the concatenated planes, for write_direct_chunk under filters [shuffle, deflate]."""
    parts, adler = [_ZLIB_HEADER], 1
    for plane in planes:
        if isinstance(plane, int) or not plane.any():
            n = plane if isinstance(plane, int) else plane.size
            parts.append(_zero_plane_deflate(n))
            adler = _adler32_of_zeros(adler, n)
            continue
        adler = zlib.adler32(plane, adler)
        packed = _huffman_deflate(plane) if compression == "small" else None
        parts += [packed] if packed is not None and len(packed) < plane.size else _stored_blocks(plane)
    parts += [_FINAL_EMPTY_BLOCK, struct.pack(">I", adler)]
    return b"".join(parts)


def _encode_chunk(region: np.ndarray, compression: str, widen_bf16: bool) -> bytes:
    return encode_planes(shuffled_planes(region, widen_bf16), compression)


def chunk_shape(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Whole trailing dims while they fit in CHUNK_BYTES, then as many rows of the next dim as fit."""
    chunk = list(shape)
    budget = max(1, CHUNK_BYTES // itemsize)
    for i in range(len(shape) - 1, -1, -1):
        if budget >= shape[i]:
            budget //= max(shape[i], 1)
            continue
        chunk[i] = max(1, budget)
        chunk[:i] = [1] * i
        break
    return tuple(max(1, c) for c in chunk)


def _chunk_at(arr: np.ndarray, origin: tuple[int, ...], chunk: tuple[int, ...]) -> np.ndarray:
    """The chunk starting at origin, zero-padded to the full chunk shape at the dataset's edges."""
    region = arr[tuple(slice(o, o + c) for o, c in zip(origin, chunk))]
    if region.shape == chunk:
        return region
    padded = np.zeros(chunk, dtype=arr.dtype)
    padded[tuple(slice(0, s) for s in region.shape)] = region
    return padded


# ---------------------------------------------------------------------------------------------------------
# Storage dtypes
# ---------------------------------------------------------------------------------------------------------
def storage_array(t: torch.Tensor) -> np.ndarray:
    """A host tensor as the numpy array we store: lossless, in a type plain HDF5 readers know."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:   # bf16 is the top half of a float32: widen by shifting, exact and fast
        bits = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
        return (bits << 16).view(np.float32)
    if t.dtype == torch.bool:
        return t.numpy().view(np.uint8)
    if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        return t.float().numpy()    # fp16 and fp8 formats are exactly representable in float32
    return t.numpy()


def from_storage(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of storage_array (bit-exact for bf16, NaN payloads included)."""
    arr = np.asarray(arr)
    if dtype == "bfloat16":
        return torch.from_numpy((arr.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr.copy() if not arr.flags.c_contiguous else arr).to(getattr(torch, dtype))


def source_array(t: torch.Tensor) -> tuple[np.ndarray, np.dtype, bool]:
    """(array to cut chunks from, dataset dtype, whether it holds bf16 bits widened while encoding).

    bf16 is never materialised as float32: its bits are the float32's top half, so the encoder emits two
    zero byte planes and the bf16 bytes shuffled.
    """
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), np.dtype(np.float32), True
    arr = storage_array(t)
    return arr, arr.dtype, False


def content_hash(t: torch.Tensor) -> str:
    """blake2b-256 of a host tensor's bytes in its own dtype, C order."""
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{HASH_NAME}:{hashlib.blake2b(data, digest_size=32).hexdigest()}"


# ---------------------------------------------------------------------------------------------------------
# Attribute encoding
# ---------------------------------------------------------------------------------------------------------
def _attr_value(key: str, value: Any) -> Any:
    if isinstance(value, (bool, int, float, str, np.integer, np.floating, np.bool_)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, bool)) for v in value):
        return np.asarray(value)
    raise TypeError(f"attribute {key!r}: {type(value).__name__} is not a number, string or list of numbers")


def _set_attrs(obj: h5py.HLObject, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        if value is not None:
            obj.attrs[key] = _attr_value(key, value)


def plain(value: Any) -> Any:
    """An HDF5 attribute value as plain Python (str, int, float, bool, list)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _versions() -> dict[str, str]:
    from importlib import metadata
    try:
        cutedsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        cutedsl = "not installed"
    return {"torch_version": str(torch.__version__), "cutedsl_version": cutedsl}


def _default_device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------------------
@dataclass
class _SiteJob:
    run: str
    site: str
    attrs: dict[str, Any]               # order, layer, family, inputs, extra
    dtype: torch.dtype
    shape: tuple[int, ...]
    stats: torch.Tensor                 # host (pinned when CUDA) float64 [9]
    data: torch.Tensor | None           # host copy of the stored part, or None
    token_slice: tuple[int, int] | None
    ready: Any                          # torch.cuda.Event or None
    nbytes: int


@dataclass
class _Encoded:
    job: _SiteJob
    stats: dict[str, Any]
    stored: bool
    dtype: np.dtype | None = None              # dataset dtype
    small: np.ndarray | None = None            # scalar or empty tensor, written without chunks
    chunk: tuple[int, ...] | None = None
    chunks: list[tuple[tuple[int, ...], Future]] = field(default_factory=list)
    hash: Future | None = None


class PendingSite:
    """Returned by record(): `stats()` waits for this site's statistics only (not for its tensor)."""

    def __init__(self, job: _SiteJob):
        self._job = job

    def stats(self) -> dict[str, Any]:
        if self._job.ready is not None:
            self._job.ready.synchronize()
        return stats_dict(self._job.stats.tolist(), self._job.dtype, self._job.shape)


class CaptureWriter:
    """Write one capture. Use as a context manager; close() renames path.tmp to path.

    meta: token_ids (required), model_config (dict or ModelConfig), checkpoint (dict), device, and any other
    str/number/dict items (dicts are stored as JSON). An exception inside the `with` block leaves the
    unfinished path.tmp for inspection instead of renaming it.
    """

    def __init__(self, path: str | Path, meta: Mapping[str, Any], policy: SavePolicy | str = "stats",
                 force: bool = False, compression: str = "fast", workers: int | None = None,
                 max_pending_bytes: int = 2 << 30):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + TMP_SUFFIX)
        self.policy = as_policy(policy)
        if compression not in COMPRESSIONS:
            raise BadInput(f"compression {compression!r}: choose one of {', '.join(COMPRESSIONS)}")
        self.compression = compression
        _check_writable(self.path, self.tmp_path, force)
        self.n_tokens = len(meta.get("token_ids", ()))
        self._file = h5py.File(self.tmp_path, "w")
        _keep_metadata_in_cache(self._file)
        _set_root_attrs(self._file, meta, self.policy.text, compression)
        self._file.create_group("runs", track_order=True)
        self._file.flush()
        self._orders: dict[str, int] = {}
        self._seen: dict[str, set[str]] = {}
        self._pool = ThreadPoolExecutor(workers or os.cpu_count() or 2, thread_name_prefix="capture-encode")
        self._prepare_q: queue.Queue = queue.Queue()
        self._write_q: queue.Queue = queue.Queue(maxsize=4)     # bounds encoded sites waiting for HDF5
        self._pending = _ByteBudget(max_pending_bytes)
        self._error: BaseException | None = None
        self._closed = False
        self._threads = [threading.Thread(target=self._guard, args=(self._prepare_loop,), daemon=True),
                         threading.Thread(target=self._guard, args=(self._write_loop,), daemon=True)]
        for thread in self._threads:
            thread.start()

    # ---- public API ---------------------------------------------------------------------------------
    def begin_run(self, run: str, attrs: Mapping[str, Any] | None = None) -> None:
        """Create /runs/<run> with its attributes (backend, dtype, mode ...). record() calls it if needed."""
        self._check_open()
        _check_name("run", run)
        if run in self._orders:
            raise BadInput(f"run {run!r} already begun in {self.tmp_path}")
        self._orders[run], self._seen[run] = 0, set()
        self._submit(lambda: self._create_run(run, dict(attrs or {})))

    def record(self, run: str, site: str, tensor: torch.Tensor, *, layer: int, family: str = "",
               inputs: Sequence[str] = (), attrs: Mapping[str, Any] | None = None,
               token_dim: bool | None = None) -> PendingSite:
        """Record one site's output. token_dim: whether dim 0 is the token dim (default: dim 0 == #tokens)."""
        self._check_open()
        _check_name("site", site)
        if run not in self._orders:
            self.begin_run(run)
        if site in self._seen[run]:
            raise BadInput(f"site {site!r} recorded twice in run {run!r}")
        self._seen[run].add(site)
        job = self._site_job(run, site, tensor, layer, family, inputs, attrs or {}, token_dim)
        self._orders[run] += 1
        self._pending.acquire(job.nbytes)
        self._prepare_q.put(job)
        return PendingSite(job)

    def end_layer(self, run: str, layer: int) -> None:
        """Mark a layer finished: returns once it and everything before it is flushed to the file."""
        self._check_open()
        done = threading.Event()
        self._submit(lambda: self._finish_layer(run, layer, done))
        while not done.wait(0.1):
            self._raise_background_error()
        self._raise_background_error()

    def write_metrics(self, candidate_run: str, metrics: Mapping[str, Mapping[str, Any]],
                      reference_run: str = "reference") -> None:
        """Per-site comparison results (metrics.compare / index_agreement dicts) of candidate_run."""
        self._check_open()
        _check_name("run", candidate_run)
        self._submit(lambda: self._write_table(f"metrics/{candidate_run}", metrics, {"reference": reference_run}))

    def write_floors(self, floors: Mapping[str, Mapping[str, float]], source: str = "") -> None:
        """Noise floors per site and metric, e.g. from reference (bf16) vs reference.fp64."""
        self._check_open()
        self._submit(lambda: self._write_table("floors", floors, {"source": source}))

    def write_verdict(self, verdict: Mapping[str, Any]) -> None:
        self._check_open()
        text = json.dumps(verdict, default=str)
        self._submit(lambda: self._set_json_attr("verdict", text))

    def close(self) -> Path:
        """Finish writing, mark the file complete, fsync, and rename path.tmp to path."""
        if self._closed:
            return self.path
        self._stop()
        self._raise_background_error()
        self._file.attrs["complete"] = True
        self._file.close()
        _fsync(self.tmp_path)
        os.replace(self.tmp_path, self.path)
        return self.path

    def abort(self) -> Path:
        """Stop, flush what was written and leave path.tmp (marked incomplete) behind; returns its path."""
        if not self._closed:
            self._stop()
            self._file.close()
        return self.tmp_path

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ---- caller side --------------------------------------------------------------------------------
    def _site_job(self, run, site, tensor, layer, family, inputs, extra, token_dim) -> _SiteJob:
        shape = tuple(tensor.shape)
        if token_dim is None:
            token_dim = len(shape) > 0 and shape[0] == self.n_tokens
        store, token_slice = self.policy.decide(site, shape, bool(token_dim) and len(shape) > 0)
        data = tensor.detach()[token_slice[0]:token_slice[1]] if token_slice else tensor.detach()
        stats = device_stats(tensor)
        ready = None
        if tensor.is_cuda:
            stats = _pinned_copy(stats)
            data = _pinned_copy(data) if store else None
            ready = torch.cuda.Event()
            ready.record()
        else:   # the caller may reuse its buffer once record() returns
            data = data.clone(memory_format=torch.contiguous_format) if store else None
        attrs = {"order": self._orders[run], "layer": int(layer), "family": family,
                 "inputs": json.dumps(list(inputs)), **_check_extra(site, extra)}
        nbytes = data.numel() * data.element_size() if data is not None else 0
        return _SiteJob(run, site, attrs, tensor.dtype, shape, stats, data, token_slice, ready, nbytes)

    def _submit(self, action: Callable[[], None]) -> None:
        self._prepare_q.put(action)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"capture {self.path} is closed")
        self._raise_background_error()

    def _raise_background_error(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"capture writer for {self.tmp_path} failed: {self._error!r}") from self._error

    def _stop(self) -> None:
        self._closed = True
        self._prepare_q.put(None)
        for thread in self._threads:
            thread.join()
        self._pool.shutdown()

    # ---- background ---------------------------------------------------------------------------------
    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except Exception as e:   # noqa: BLE001 - surfaced to the caller on its next call
            self._error = e
            self._pending.release_all()
            self._write_q.put(None)

    def _prepare_loop(self) -> None:
        while (item := self._prepare_q.get()) is not None:
            self._write_q.put(self._encode(item) if isinstance(item, _SiteJob) else item)
            if self._error is not None:
                return
        self._write_q.put(None)

    def _encode(self, job: _SiteJob) -> _Encoded:
        if job.ready is not None:
            job.ready.synchronize()
        stats = stats_dict(job.stats.tolist(), job.dtype, job.shape)
        if job.data is None:
            return _Encoded(job, stats, stored=False)
        arr, dtype, widen = source_array(job.data)
        digest = self._pool.submit(content_hash, job.data)
        if arr.ndim == 0 or arr.size == 0:
            return _Encoded(job, stats, True, dtype, small=storage_array(job.data), hash=digest)
        chunk = chunk_shape(arr.shape, dtype.itemsize)
        chunks = [(origin, self._pool.submit(_encode_chunk, _chunk_at(arr, origin, chunk), self.compression, widen))
                  for origin in itertools.product(*[range(0, s, c) for s, c in zip(arr.shape, chunk)])]
        return _Encoded(job, stats, True, dtype, chunk=chunk, chunks=chunks, hash=digest)

    def _write_loop(self) -> None:
        while (item := self._write_q.get()) is not None:
            if isinstance(item, _Encoded):
                self._write_site(item)
                self._pending.release(item.job.nbytes)
            else:
                item()

    def _create_run(self, run: str, attrs: dict[str, Any]) -> None:
        group = self._file["runs"].create_group(run)
        group.create_group("sites", track_order=True)
        attrs.setdefault("layers_completed", np.zeros(0, dtype=np.int64))
        _set_attrs(group, {k: v for k, v in attrs.items() if k != "layers_completed"})
        group.attrs["layers_completed"] = attrs["layers_completed"]

    def _write_site(self, enc: _Encoded) -> None:
        job = enc.job
        group = self._file[f"runs/{job.run}/sites"].create_group(job.site)
        _set_attrs(group, {**job.attrs, **enc.stats, "stored": enc.stored})
        if not enc.stored:
            return
        if enc.chunk is None:
            dset = group.create_dataset("tensor", data=enc.small)
        else:
            dset = group.create_dataset("tensor", shape=job.data.shape, dtype=enc.dtype, chunks=enc.chunk,
                                        shuffle=True, compression="gzip", compression_opts=1)
            for origin, encoded in enc.chunks:
                dset.id.write_direct_chunk(origin, encoded.result())
        dset.attrs["dtype"] = dtype_name(job.dtype)
        dset.attrs["hash"] = enc.hash.result()
        if job.token_slice is not None:
            dset.attrs["token_slice"] = np.asarray(job.token_slice, dtype=np.int64)

    def _finish_layer(self, run: str, layer: int, done: threading.Event) -> None:
        group = self._file[f"runs/{run}"]
        group.attrs["layers_completed"] = np.append(group.attrs["layers_completed"], np.int64(layer))
        self._file.flush()
        done.set()

    def _write_table(self, name: str, rows: Mapping[str, Mapping[str, Any]], attrs: Mapping[str, str]) -> None:
        table = self._file.require_group(name)
        _set_attrs(table, attrs)
        for site, values in rows.items():
            _check_name("site", site)
            row = table.require_group(site)
            _set_attrs(row, values)

    def _set_json_attr(self, key: str, text: str) -> None:
        self._file.attrs[key] = text
        keys = set(plain(self._file.attrs["json_keys"])) | {key}
        self._file.attrs["json_keys"] = np.asarray(sorted(keys), dtype=h5py.string_dtype())


class _ByteBudget:
    """Blocks record() while more than `limit` bytes of host copies wait to be written."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()

    def release_all(self) -> None:
        with self.cond:
            self.used, self.limit = 0, 1 << 62
            self.cond.notify_all()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _check_writable(path: Path, tmp: Path, force: bool) -> None:
    if force:
        tmp.unlink(missing_ok=True)
        return
    if path.exists():
        raise BadInput(f"{path} exists; refusing to overwrite a capture (use --force / force=True)")
    if tmp.exists():
        raise BadInput(f"{tmp} exists: an unfinished capture (inspect or delete it; --force replaces it)")


def _check_name(kind: str, name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise BadInput(f"{kind} name {name!r} is not valid: it must be non-empty and contain no '/'")


def _check_extra(site: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    reserved = {name for name, _, _ in SITE_ATTRS} - {"*"}
    clash = sorted(reserved & set(extra))
    if clash:
        raise BadInput(f"site {site!r}: extra attributes {clash} clash with reserved capture attributes")
    return dict(extra)


def _keep_metadata_in_cache(f: h5py.File) -> None:
    """Keep metadata in memory between flushes: a kill then leaves the file as of the last flush, instead
    of one where evicted new B-tree or heap nodes point at objects that were never written."""
    config = f.id.get_mdc_config()
    config.set_initial_size = True
    config.initial_size = config.max_size = 128 << 20
    config.min_size = 1 << 20
    config.incr_mode = config.flash_incr_mode = config.decr_mode = 0
    config.evictions_enabled = False
    f.id.set_mdc_config(config)


def _set_root_attrs(f: h5py.File, meta: Mapping[str, Any], policy: str, compression: str) -> None:
    if "token_ids" not in meta:
        raise BadInput("capture meta needs token_ids (the input of every run in the file)")
    root = {"format": FORMAT, "format_version": FORMAT_VERSION, "tool_version": __version__,
            "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "complete": False,
            "device": _default_device(), **_versions(), "save_policy": policy, "compression": compression}
    json_keys = []
    for key, value in meta.items():
        if key == "token_ids":
            root[key] = np.asarray(torch.as_tensor(value).cpu(), dtype=np.int64).reshape(-1)
        elif hasattr(value, "to_dict") or isinstance(value, (dict, list)):
            root[key] = json.dumps(value.to_dict() if hasattr(value, "to_dict") else value, default=str)
            json_keys.append(key)
        else:
            root[key] = value
    for key, value in root.items():
        f.attrs[key] = value
    f.attrs["json_keys"] = np.asarray(sorted(json_keys), dtype=h5py.string_dtype())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------------------
class CaptureReader:
    """Read a capture (also an unfinished `.tmp` one, reported as incomplete). Bad files raise BadInput."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = _open_capture(self.path)
        self.meta = _read_meta(self._file)
        self.complete = bool(self.meta.get("complete")) and not self.path.name.endswith(TMP_SUFFIX)
        self._sites: dict[str, list[str]] = {}

    def runs(self) -> list[str]:
        return list(self._file["runs"].keys())

    def run_attrs(self, run: str) -> dict[str, Any]:
        return {k: plain(v) for k, v in self._run(run).attrs.items()}

    def layers_completed(self, run: str) -> list[int]:
        return [int(x) for x in self._run(run).attrs.get("layers_completed", [])]

    def sites(self, run: str) -> list[str]:
        """Site names in execution order; sites cut off by a crash (attributes missing) are left out."""
        if run not in self._sites:
            group = self._run(run)["sites"]
            named = [(int(group[name].attrs["order"]), name) for name in group if "order" in group[name].attrs]
            self._sites[run] = [name for _, name in sorted(named)]
        return self._sites[run]

    def site(self, run: str, site: str) -> dict[str, Any]:
        """Everything about one site: the record dict used by reports and verdicts (see README)."""
        group = self._site_group(run, site)
        attrs = {k: plain(v) for k, v in group.attrs.items()}
        record = {"run": run, "site": site, "layer": attrs.pop("layer"), "order": attrs.pop("order"),
                  "family": attrs.pop("family", ""), "inputs": json.loads(attrs.pop("inputs", "[]")),
                  "stored": bool(attrs.pop("stored", False))}
        record["stats"] = {k: attrs.pop(k) for k in (*STAT_KEYS, "numel", "dtype", "shape", "first_nonfinite")
                           if k in attrs}
        record["tensor"] = self._tensor_info(group) if record["stored"] else None
        record["attrs"] = attrs
        return record

    def stats(self, run: str, site: str) -> dict[str, Any]:
        return self.site(run, site)["stats"]

    def hash(self, run: str, site: str) -> str | None:
        info = self.site(run, site)["tensor"]
        return info["hash"] if info else None

    def dataset(self, run: str, site: str) -> h5py.Dataset | None:
        group = self._site_group(run, site)
        return group.get("tensor")

    def tensor(self, run: str, site: str) -> torch.Tensor:
        """The stored tensor (or its token slice) in its original dtype."""
        dset = self.dataset(run, site)
        if dset is None:
            raise BadInput(f"{self.path}: site {site!r} of run {run!r} has statistics only (no stored tensor); "
                           "capture with --save full, tokens:A:B or sites:REGEX to keep tensors")
        return from_storage(dset[()], plain(dset.attrs["dtype"]))

    def row_blocks(self, run: str, site: str) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) along dim 0, one chunk's worth at a time, in the original dtype."""
        dset = self.dataset(run, site)
        dtype = plain(dset.attrs["dtype"])
        if dset.ndim == 0 or dset.chunks is None:
            yield 0, from_storage(dset[()], dtype)
            return
        step = dset.chunks[0]
        for start in range(0, dset.shape[0], step):
            yield start, from_storage(dset[start:start + step], dtype)

    def metric_runs(self) -> list[str]:
        return list(self._file["metrics"].keys()) if "metrics" in self._file else []

    def metrics(self, candidate_run: str) -> dict[str, dict[str, Any]]:
        """Per-site metrics of candidate_run against its reference (empty if none were written)."""
        return self._table(f"metrics/{candidate_run}")

    def metrics_reference(self, candidate_run: str) -> str | None:
        name = f"metrics/{candidate_run}"
        return plain(self._file[name].attrs.get("reference")) if name in self._file else None

    def floors(self) -> dict[str, dict[str, float]]:
        return self._table("floors")

    def verdict(self) -> dict[str, Any] | None:
        return self.meta.get("verdict")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------
    def _run(self, run: str) -> h5py.Group:
        if run not in self._file["runs"]:
            raise BadInput(f"{self.path}: no run {run!r}; runs are {', '.join(self.runs()) or '(none)'}")
        return self._file["runs"][run]

    def _site_group(self, run: str, site: str) -> h5py.Group:
        sites = self._run(run)["sites"]
        if site not in sites:
            raise BadInput(f"{self.path}: run {run!r} has no site {site!r}")
        return sites[site]

    def _tensor_info(self, group: h5py.Group) -> dict[str, Any]:
        dset = group["tensor"]
        info = {k: plain(v) for k, v in dset.attrs.items()}
        info.update(shape=list(dset.shape), storage_dtype=str(dset.dtype), chunks=list(dset.chunks or []),
                    stored_bytes=int(dset.id.get_storage_size()), logical_bytes=int(dset.size * dset.dtype.itemsize))
        return info

    def _table(self, name: str) -> dict[str, dict[str, Any]]:
        if name not in self._file:
            return {}
        return {site: {k: plain(v) for k, v in row.attrs.items()} for site, row in self._file[name].items()}


def _open_capture(path: Path) -> h5py.File:
    if not path.exists():
        raise BadInput(f"{path}: no such file")
    if not h5py.is_hdf5(path):
        raise BadInput(f"{path} is not an HDF5 file, so not a dsv4debug capture")
    try:
        f = h5py.File(path, "r", locking=False)   # a live capture may be inspected while being written
    except OSError as e:
        raise BadInput(f"{path}: cannot open the HDF5 file, it is truncated or corrupt ({e})") from None
    fmt = plain(f.attrs.get("format", ""))
    version = plain(f.attrs.get("format_version", -1))
    if fmt != FORMAT:
        f.close()
        raise BadInput(f"{path} is an HDF5 file but not a dsv4debug capture (root attribute format={fmt!r})")
    if version != FORMAT_VERSION:
        f.close()
        raise BadInput(f"{path}: capture format version {version} is not supported; this dsv4debug "
                       f"({__version__}) reads version {FORMAT_VERSION}")
    if "runs" not in f:
        f.close()
        raise BadInput(f"{path}: capture has no /runs group (corrupt or not written by dsv4debug)")
    return f


def _read_meta(f: h5py.File) -> dict[str, Any]:
    meta = {k: plain(v) for k, v in f.attrs.items()}
    for key in meta.get("json_keys", []):
        meta[key] = json.loads(meta[key])
    return meta


# ---------------------------------------------------------------------------------------------------------
# Documentation
# ---------------------------------------------------------------------------------------------------------
def attribute_doc() -> str:
    """Markdown tables of every documented attribute (pasted into captures/README.md)."""
    sections = (("Root `/`", ROOT_ATTRS), ("Run `/runs/<run>`", RUN_ATTRS),
                ("Site `/runs/<run>/sites/<site>`", SITE_ATTRS),
                ("Dataset `/runs/<run>/sites/<site>/tensor`", TENSOR_ATTRS),
                ("Metrics and floors", FLOOR_METRIC_ATTRS))
    out = []
    for title, rows in sections:
        out += [f"#### {title}", "", "| attribute | type | meaning |", "|---|---|---|"]
        out += [f"| `{name}` | {kind} | {meaning} |" for name, kind, meaning in rows]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--doc"]:
        sys.exit("usage: python -m dsv4debug.capture --doc")
    print(attribute_doc())
