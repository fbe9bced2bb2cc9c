"""Capture format v1: one HDF5 file holds one input and one or more runs: every site's statistics in a
per-run table and, by policy, its tensor. Layout and attributes are documented in captures/README.md; the
tables there are generated from ROOT_ATTRS, RUN_ATTRS, SITE_COLUMNS ... below (`python -m
dsv4debug.capture --doc`).

Writing is asynchronous: `record` starts the statistics (a GPU tensor waits for the site_stats kernel to take
a batch of sites in one launch, or for torch ops, writing into a slab of rows that moves to the host in one
copy per layer; numpy tasks on a worker pool for a host tensor) and the device->host copy of a stored tensor,
then returns; a prepare thread has the pool shuffle, compress and hash the chunks; a writer thread, the only
one touching HDF5, writes them with `write_direct_chunk` and appends the site rows at each `end_layer`, which
returns once everything recorded so far is flushed: a process killed afterwards leaves those layers readable.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import os
import queue
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from numpy.lib.recfunctions import repack_fields
from typing_extensions import Self

from . import __version__
from .errors import BadInput
from .h5chunks import (
    HASH_NAME,
    chunk_shape,
    content_hash,
    encode_chunks,
    encode_rows,
    from_storage,
    read_rows,
    row_chunk,
    source_array,
    storage_array,
)
from .tensorstats import (
    DEVICE_CHUNK,
    HOST_BLOCK,
    PARTIALS,
    STAT_KEYS,
    block_stats,
    combine_blocks,
    combine_segments,
    device_rows,
    dtype_name,
    fill_device_rows,
    host_blocks,
    site_stats_installed,
    stats_columns,
    stats_dict,
)

FORMAT = "dsv4debug-capture"
FORMAT_VERSION = 1
TMP_SUFFIX = ".tmp"
COMPRESSIONS = ("fast", "small")
TASK_BYTES = 4 << 20            # stored bytes encoded per worker task: few tasks, few GIL hand-offs
ENCODE_BYTES = 64 << 20         # a GPU site's tensor bytes encoded per encode_rows call: bounds its temporaries
SYNC_BYTES = 256 << 20          # chunk bytes written between background fsyncs: the disk works while we encode
_STR = h5py.string_dtype()

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
    ("gpu_statistics", "str", ('how the statistics of the GPU sites were computed: "site_stats kernel" (CuTeDSL, '
                               'a launch per batch of sites; the default where CuTeDSL is installed), "torch ops", both with '
                               'their counts (e.g. "site_stats kernel: 412 sites, torch ops: 24 sites", for tensors '
                               'the kernel does not take), or "no GPU sites"; "not known: the capture was not '
                               'closed" in a file whose writer was killed')),
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
    ("delegated_ops", "str", "candidate runs: the ops run by the reference (no kernel, --reference-ops), a,b,c"),
    ("*", "any", "further attributes given to begin_run"),
)
# (column, numpy dtype, type, meaning) of the compound dataset /runs/<run>/sites, one row per site.
SITE_COLUMNS = (
    ("site", _STR, "str", "site name, verbatim (`layers.7.attn.wq_a`, `layers.7.ffn.experts.123`)"),
    ("order", "<i8", "int64", "execution index within the run; rows are in this order"),
    ("layer", "<i8", "int64", "layer index; -1 for global sites (embed, hc_head, norm, logits)"),
    ("family", _STR, "str", "op family (linear, norm, rope, attention, moe ...); may be empty"),
    ("inputs", _STR, "JSON str", "list of the site names whose outputs this op consumed"),
    ("dtype", _STR, "str", "torch dtype of the output, e.g. bfloat16"),
    ("shape", _STR, "JSON str", "shape of the whole output, e.g. [128, 4, 7168]"),
    ("numel", "<i8", "int64", "elements of the whole output"),
    ("nan_count", "<i8", "int64", "NaN elements"),
    ("inf_count", "<i8", "int64", "+-Inf elements"),
    ("min", "<f8", "float64", "minimum over finite elements (NaN when there are none)"),
    ("max", "<f8", "float64", "maximum over finite elements"),
    ("mean", "<f8", "float64", "mean over finite elements"),
    ("std", "<f8", "float64", "standard deviation over finite elements (n-1)"),
    ("absmax", "<f8", "float64", "largest finite |x|"),
    ("l2", "<f8", "float64", "L2 norm over finite elements"),
    ("first_nonfinite", _STR, "JSON str", "coordinates of the first NaN/Inf element in C order, or null"),
    ("stored", "?", "bool", "whether /runs/<run>/tensors/<site> holds the output or its token rows"),
    ("attrs", _STR, "JSON str", "extra attributes given to record(attrs=...); {} if none"),
)
SITE_DTYPE = np.dtype([(name, dtype) for name, dtype, _, _ in SITE_COLUMNS])
TENSOR_ATTRS = (
    ("dtype", "str", "original torch dtype; the dataset holds it losslessly (bf16/fp16/fp8 as float32, bool as uint8)"),
    ("token_slice", "int64[2]", "[start, stop) of dim 0 that is stored, when dim 0 is the token dimension"),
    ("hash", "str", (f'"{HASH_NAME}:<hex>" of the stored tensor\'s bytes in its original dtype, C order '
                     "(float32/float64/int data: the dataset's own bytes; bf16: the top 16 bits of each float32)")),
)
JSON_TABLE_DTYPE = np.dtype([("site", _STR), ("values", _STR)])
JSON_TABLES = (
    ("/metrics/<run>", ("rows (site, values): JSON of metrics.compare or index_agreement for that site; "
                       "attribute `reference`: the run it was compared against")),
    ("/floors", "rows (site, values): JSON {metric: noise floor}; attribute `source`: how they were measured"),
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
# Attributes
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
@dataclass(slots=True)
class _SiteJob:
    run: str
    row: dict[str, Any]                 # site table columns known at record time
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: torch.Tensor | None           # host copy of the stored part, or None
    token_slice: tuple[int, int] | None
    nbytes: int                         # host bytes held until written
    device_block: int = DEVICE_CHUNK            # GPU: elements per PARTIALS row
    device_rows: tuple | None = None            # GPU: (pinned rows, first, count, the copy's event) once flushed
    values: list[float] | None = None           # STAT_VALUES, once combined (GPU: a whole batch at a time)
    ready: Any = None                            # GPU: torch.cuda.Event after the pinned copy of `data`
    encoded: torch.Tensor | None = None          # GPU: pinned chunk streams made by the GPU (_device_encoded)
    host_parts: list[Future] = field(default_factory=list)   # CPU: block_stats futures

    def stat_values(self) -> list[float]:
        if self.values is None:
            numel = int(np.prod(self.shape))
            if self.device_rows is not None:
                rows, first, count, landed = self.device_rows
                landed.synchronize()
                self.values = combine_blocks(list(rows[first:first + count].numpy()), numel, self.device_block)
            else:
                self.values = combine_blocks([part.result() for part in self.host_parts], numel, HOST_BLOCK)
        return self.values


class _StatsSlab:
    """GPU site statistics without a transfer, an event, a queued item or a launch per site. Each site's
    PARTIALS rows have their place in one device slab (grown as needed); record() reserves them and keeps the
    tensor, and launch() writes the rows of every site waiting so far in one site_stats launch per dtype (the
    kernel reads many tensors through a table) before each flush.
    flush() moves every row recorded since the last flush to pinned host memory in one copy (the slab is
    reused behind it, in stream order) and hands the writer thread the batch of waiting sites, whose
    statistics it combines in a few numpy passes (combine_segments). A stats-only site then costs the calling
    thread a little bookkeeping. The slab is flushed at the end of a layer, before any other site is queued
    (the site table keeps execution order), when it would pass MAX_ROWS, when a site's statistics are asked
    for, and with FLUSH_EACH_BATCH at each batch's launch.

    A waiting tensor must not change in place until its launch (the model flow's outputs do not): its
    version counter is checked then, and a change is an error naming the site. `defer=False` launches at
    every record() instead, for outputs of code that may reuse them in place (dsv4debug.hooks)."""

    ROWS, MAX_ROWS = 8192, 1 << 20                      # 0.4 MiB to start; 56 MiB at most
    DEFER_BYTES = 256 << 20                             # tensors kept alive, at most, for a batched launch
    # True: a deferred batch is also flushed, its rows combined and appended by the writer during the forward.
    # Measured on an H200 (Pro layer, 2026-12-03 12:29): +8.8% median vs +4.6% for flushing at end_layer only
    # (the writer's work then contends with the forward's host thread for the GIL); best of each 3.0 vs 3.2%
    FLUSH_EACH_BATCH = False

    def __init__(self, submit: Callable[[list[_SiteJob]], None], defer: bool = True):
        self.submit, self.defer = submit, defer
        self.slabs: dict[torch.device, torch.Tensor] = {}
        self.used: dict[torch.device, int] = {}
        self.waiting: list[tuple[_SiteJob, torch.device]] = []
        self.unlaunched: list[tuple[_SiteJob, torch.Tensor, int, int, str]] = []   # job, tensor, version, row, by
        self.unlaunched_bytes = 0
        self.sites_by: Counter[str] = Counter()           # GPU sites by how their statistics were made

    def add(self, job: _SiteJob, tensor: torch.Tensor, kernel: bool) -> None:
        n, job.device_block, by = device_rows(tensor, kernel)
        self.sites_by[by] += 1
        device = tensor.device
        start = self.used.get(device, 0)
        if start + n > self.MAX_ROWS:
            self.flush()
            start = 0
        slab = self.slabs.get(device)
        if slab is None or len(slab) < start + n:       # rows not yet launched are written into the new slab
            grown = torch.empty(max(self.ROWS, 2 * (start + n)), len(PARTIALS), dtype=torch.float64, device=device)
            if start:
                grown[:start].copy_(slab[:start])
            self.slabs[device] = grown
        self.used[device] = start + n
        job.device_rows = (None, start, n, None)
        self.waiting.append((job, device))
        self.unlaunched.append((job, tensor, tensor._version, start, by))
        self.unlaunched_bytes += tensor.nbytes
        if not self.defer:
            self.launch()
        elif self.unlaunched_bytes >= self.DEFER_BYTES:
            if self.FLUSH_EACH_BATCH:   # the writer combines the batch while the forward goes on: end_layer,
                self.flush()            # which must wait for the GPU, is then left with the sites after it only
            else:
                self.launch()

    def launch(self) -> None:
        """Write the rows of every site recorded since the last launch (a few launches for all of them)."""
        by_device: dict[torch.device, list[tuple[torch.Tensor, int, str]]] = {}
        for job, tensor, version, start, by in self.unlaunched:
            if tensor._version != version:
                raise RuntimeError(f"site {job.row['site']!r} of run {job.run!r} was modified in place after "
                                   "record(), before its statistics were taken; record a copy, or capture with "
                                   "defer_stats=False")
            by_device.setdefault(tensor.device, []).append((tensor, start, by))
        for device, items in by_device.items():
            fill_device_rows(items, self.slabs[device])
        self.unlaunched.clear()
        self.unlaunched_bytes = 0

    def flush(self) -> None:
        if not self.waiting:
            return
        self.launch()
        jobs = [job for job, _ in self.waiting]
        copies = {device: _host_copy(self.slabs[device][:used]) for device, used in self.used.items()}
        for job, device in self.waiting:
            rows, landed = copies[device]
            job.device_rows = (rows, job.device_rows[1], job.device_rows[2], landed)
        self.waiting.clear()
        self.used.clear()
        self.submit(jobs)

    def pending(self, job: _SiteJob) -> bool:
        return job.device_rows is not None and job.device_rows[0] is None


def _combine_batch(jobs: list[_SiteJob]) -> None:
    """Set every flushed job's `values` from its device rows: one combine_segments per pinned copy."""
    by_copy: dict[int, list[_SiteJob]] = {}
    for job in jobs:
        by_copy.setdefault(id(job.device_rows[0]), []).append(job)
    for group in by_copy.values():
        rows, _, _, landed = group[0].device_rows
        landed.synchronize()
        values = combine_segments(rows.numpy(), np.array([j.device_rows[1] for j in group]),
                                  np.array([j.device_rows[2] for j in group]),
                                  np.array([math.prod(j.shape) for j in group]),
                                  np.array([j.device_block for j in group]))
        for job, v in zip(group, values.tolist()):
            job.values = v


@dataclass
class _Encoded:
    job: _SiteJob
    dtype: np.dtype | None = None              # dataset dtype
    small: np.ndarray | None = None            # scalar or empty tensor, written without chunks
    chunk: tuple[int, ...] | None = None
    chunks: list[tuple[list[tuple[int, ...]], Future]] = field(default_factory=list)   # (origins, task)
    hash: Future | None = None


class PendingSite:
    """Returned by record(): `stats()` waits for this site's statistics only (not for its tensor)."""

    def __init__(self, job: _SiteJob, slab: _StatsSlab):
        self._job, self._slab = job, slab

    def stats(self) -> dict[str, Any]:
        if self._slab.pending(self._job):
            self._slab.flush()
        return stats_dict(self._job.stat_values(), self._job.dtype, self._job.shape)


class CaptureWriter:
    """Write one capture. Use as a context manager; close() renames path.tmp to path.

    meta: token_ids (required), model_config (dict or ModelConfig), checkpoint (dict), device, and any other
    str/number/dict items (dicts are stored as JSON). An exception inside the `with` block leaves the
    unfinished path.tmp for inspection instead of renaming it.
    """

    def __init__(self, path: str | Path, meta: Mapping[str, Any], policy: SavePolicy | str = "stats",
                 force: bool = False, compression: str = "fast", workers: int | None = None,
                 max_pending_bytes: int = 2 << 30, stats_kernel: bool | None = None, defer_stats: bool = True):
        self.path = Path(path)
        # GPU site statistics by the site_stats kernel (a launch per batch of sites) or torch ops (~20 launches
        # a site); None: the kernel where CuTeDSL is installed. Both give the same statistics
        # (tests/test_capture.py). defer_stats: batch the sites' launches; their tensors must then not change
        # in place until end_layer (_StatsSlab)
        self.stats_kernel = site_stats_installed() if stats_kernel is None else stats_kernel
        self._slab = _StatsSlab(lambda jobs: self._submit(lambda: self._write_batch(jobs)), defer_stats)
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
        self._file.attrs["gpu_statistics"] = UNCLOSED_STATISTICS      # a killed writer leaves this
        self._file.create_group("runs", track_order=True)
        self._file.flush()
        self._orders: dict[str, int] = {}
        self._seen: dict[str, set[str]] = {}
        self._rows: dict[str, list[np.ndarray]] = {}     # writer thread: site-table rows not yet in their table
        self._pool = ThreadPoolExecutor(workers or os.cpu_count() or 2, thread_name_prefix="capture-encode")
        self._prepare_q: queue.Queue = queue.Queue()
        self._write_q: queue.Queue = queue.Queue(maxsize=4)     # bounds encoded sites waiting for HDF5
        self._pending = _ByteBudget(max_pending_bytes)
        # fsync in the background every SYNC_BYTES, so that close() only waits for the last of the data to reach
        # the disk instead of all of it (the page cache would otherwise hold the whole capture until then)
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="capture-fsync")
        self._sync: Future | None = None
        self._unsynced = 0
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
        if job.data is not None or job.device_rows is None:    # a GPU stats-only site goes through the slab
            self._slab.flush()
            self._pending.acquire(job.nbytes)
            self._prepare_q.put(job)
        return PendingSite(job, self._slab)

    def end_layer(self, run: str, layer: int) -> None:
        """Mark a layer finished: returns once it and everything before it is flushed to the file."""
        self._check_open()
        self._slab.flush()
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
        rows = _json_rows(metrics)
        self._submit(lambda: self._append_json_rows(f"metrics/{candidate_run}", rows, {"reference": reference_run}))

    def write_floors(self, floors: Mapping[str, Mapping[str, float]], source: str = "") -> None:
        """Noise floors per site and metric, e.g. from reference (bf16) vs reference.fp64."""
        self._check_open()
        rows = _json_rows(floors)
        self._submit(lambda: self._append_json_rows("floors", rows, {"source": source}))

    def write_verdict(self, verdict: Mapping[str, Any]) -> None:
        self._check_open()
        text = json.dumps(verdict, default=_json_default)
        self._submit(lambda: self._set_json_attr("verdict", text))

    def close(self) -> Path:
        """Finish writing, mark the file complete, fsync, and rename path.tmp to path."""
        if self._closed:
            return self.path
        self._stop()
        if self._error is not None:
            self._file.close()                       # leaves path.tmp as it is
            self._raise_background_error()
        self._finish_rows()
        self._file.attrs["complete"] = True
        self._file.close()
        _fsync(self.tmp_path)
        os.replace(self.tmp_path, self.path)
        return self.path

    def abort(self) -> Path:
        """Stop, write what was recorded and leave path.tmp (marked incomplete) behind; returns its path."""
        if not self._closed:
            self._stop()
            if self._error is None:
                self._finish_rows()
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
        store, token_slice = (self.policy.decide(site, shape, bool(token_dim) and len(shape) > 0)
                              if self.policy.store else (False, None))
        # inputs and attrs become JSON in the writer thread (_add_row): the caller's thread is the forward's
        row = {"site": site, "order": self._orders[run], "layer": int(layer), "family": family,
               "inputs": list(inputs), "attrs": dict(extra)}
        job = _SiteJob(run, row, tensor.dtype, shape, None, token_slice, 0)
        # detach (~5 us a site) only where autograd could see the copies: the statistics read the data only
        source = tensor.detach() if tensor.requires_grad or not tensor.is_cuda else tensor
        if tensor.is_cuda:
            self._slab.add(job, source, self.stats_kernel)
            if store:
                rows = _rows_of(source, token_slice)
                job.data, job.encoded = _pinned_copy(rows), _device_encoded(rows, self.compression)
                job.ready = torch.cuda.Event()
                job.ready.record()
        else:   # copy now: the caller may reuse its buffer once record() returns
            host = source.clone(memory_format=torch.contiguous_format)
            job.host_parts = [self._pool.submit(block_stats, block) for block in host_blocks(host)]
            job.data = _rows_of(host, token_slice) if store else None
            job.nbytes = host.numel() * host.element_size()
        if job.data is not None and tensor.is_cuda:
            job.nbytes = job.data.nbytes + (job.encoded.nbytes if job.encoded is not None else 0)
        return job

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
        try:
            self._slab.flush()
        except BaseException as e:  # noqa: BLE001 - the sites waiting for these rows are lost: the capture fails
            self._error = self._error or e
        self._prepare_q.put(None)
        for thread in self._threads:
            thread.join()
        self._pool.shutdown()
        self._syncer.shutdown()             # waits for a background fsync still running
        if self._sync is not None and self._sync.exception() is not None:
            self._error = self._error or self._sync.exception()

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
        """Submit the site's hash and chunk encodings; its statistics are awaited only by the write loop, so
        the next site's work is queued while this one's host statistics still run."""
        if job.ready is not None:
            job.ready.synchronize()             # the pinned copy of a GPU tensor has landed
        if job.data is None:
            return _Encoded(job)
        arr, dtype, widen = source_array(job.data)
        digest = self._pool.submit(content_hash, job.data)
        if arr.ndim == 0 or arr.size == 0:
            return _Encoded(job, dtype, small=storage_array(job.data), hash=digest)
        chunk = chunk_shape(arr.shape, dtype.itemsize)
        origins = list(itertools.product(*[range(0, s, c) for s, c in zip(arr.shape, chunk)]))
        if job.encoded is not None:             # the GPU made the streams: one row per chunk, in origin order
            return _Encoded(job, dtype, chunk=chunk, chunks=[(origins, _resolved(list(job.encoded.numpy())))],
                            hash=digest)
        per_task = max(1, TASK_BYTES // (int(np.prod(chunk)) * dtype.itemsize))
        batches = [origins[i:i + per_task] for i in range(0, len(origins), per_task)]
        tasks = [(batch, self._pool.submit(encode_chunks, arr, batch, chunk, self.compression, widen))
                 for batch in batches]
        return _Encoded(job, dtype, chunk=chunk, chunks=tasks, hash=digest)

    def _write_loop(self) -> None:
        while (item := self._write_q.get()) is not None:
            if isinstance(item, _Encoded):
                self._write_site(item)
                self._pending.release(item.job.nbytes)
            else:
                item()

    def _create_run(self, run: str, attrs: dict[str, Any]) -> None:
        group = self._file["runs"].create_group(run)
        _set_attrs(group, attrs)
        group.attrs["layers_completed"] = np.zeros(0, dtype=np.int64)
        group.create_dataset("sites", shape=(0,), maxshape=(None,), dtype=SITE_DTYPE, chunks=(256,))
        group.create_group("tensors", track_order=True)
        self._rows[run] = []

    def _write_batch(self, jobs: list[_SiteJob]) -> None:
        """A slab flush: the statistics of all its sites at once; rows for the stats-only ones (a stored
        site's row follows with its tensor, queued right after). At end_layer the GPU may still be computing the
        statistics while the forward's thread only waits, so the rows go into the site table first, all but
        the statistics' columns (their strings are most of a table write), and those columns follow. None of it
        reaches the file before end_layer's flush (the table's new extent stays in HDF5's metadata cache), and
        a failure takes the rows out again."""
        stats_only = [job for job in jobs if job.data is None]
        if not stats_only:
            _combine_batch(jobs)
            return
        self._append_rows()                             # earlier rows first: the table keeps execution order
        rows, runs = _site_rows(stats_only, stored=False), np.array([job.run for job in stats_only], dtype=object)
        placed = [(self._file[f"runs/{run}/sites"], runs == run) for run in dict.fromkeys(runs)]
        starts = [_append_table(table, rows[mine]) for table, mine in placed]
        try:
            _combine_batch(jobs)
            _set_statistics(rows, stats_only)
            for (table, mine), start in zip(placed, starts):
                _write_statistics(table, start, rows[mine])
        except BaseException:
            for (table, _), start in zip(placed, starts):
                table.resize((start,))
            raise

    def _write_site(self, enc: _Encoded) -> None:
        job = enc.job
        rows = _site_rows([job], stored=enc.dtype is not None)
        _set_statistics(rows, [job])
        self._rows[job.run].append(rows)
        if enc.dtype is None:
            return
        tensors = self._file[f"runs/{job.run}/tensors"]
        if enc.chunk is None:
            dset = tensors.create_dataset(job.row["site"], data=enc.small)
        else:
            dset = tensors.create_dataset(job.row["site"], shape=job.data.shape, dtype=enc.dtype, chunks=enc.chunk,
                                          shuffle=True, compression="gzip", compression_opts=1)
            for origins, encoded in enc.chunks:
                for origin, data in zip(origins, encoded.result()):
                    dset.id.write_direct_chunk(origin, data)
                    self._unsynced += len(data)
            if self._unsynced >= SYNC_BYTES and (self._sync is None or self._sync.done()):
                self._sync, self._unsynced = self._syncer.submit(_fsync, self.tmp_path), 0
        dset.attrs["dtype"] = dtype_name(job.dtype)
        dset.attrs["hash"] = enc.hash.result()
        if job.token_slice is not None:
            dset.attrs["token_slice"] = np.asarray(job.token_slice, dtype=np.int64)

    def _finish_rows(self) -> None:
        """The last site rows, and how the GPU sites' statistics were made (once the writer is stopped)."""
        self._append_rows()
        self._file.attrs["gpu_statistics"] = _statistics_used(self._slab.sites_by)

    def _append_rows(self) -> None:
        for run, rows in self._rows.items():
            if rows:
                _append_table(self._file[f"runs/{run}/sites"], _joined_rows(rows))
                rows.clear()

    def _finish_layer(self, run: str, layer: int, done: threading.Event) -> None:
        self._append_rows()
        group = self._file[f"runs/{run}"]
        group.attrs["layers_completed"] = np.append(group.attrs["layers_completed"], np.int64(layer))
        self._file.flush()
        done.set()

    def _append_json_rows(self, name: str, rows: np.ndarray, attrs: Mapping[str, str]) -> None:
        if name not in self._file:
            self._file.create_dataset(name, shape=(0,), maxshape=(None,), dtype=JSON_TABLE_DTYPE, chunks=(256,))
        table = self._file[name]
        _set_attrs(table, attrs)
        start = table.shape[0]
        table.resize((start + len(rows),))
        table[start:] = rows

    def _set_json_attr(self, key: str, text: str) -> None:
        self._file.attrs[key] = text
        keys = set(plain(self._file.attrs["json_keys"])) | {key}
        self._file.attrs["json_keys"] = np.asarray(sorted(keys), dtype=_STR)


def _site_rows(jobs: Sequence[_SiteJob], stored: bool) -> np.ndarray:
    """Site-table rows of jobs, column by column (a layer's ~400 sites in ~1 ms; a row at a time took 60 us a
    site in the writer thread), all but the statistics (_set_statistics), which may not be in yet: those are
    zero, first_nonfinite "null"."""
    rows = np.zeros(len(jobs), dtype=SITE_DTYPE)
    rows["first_nonfinite"] = "null"
    for key in ("site", "order", "layer", "family"):
        rows[key] = [job.row[key] for job in jobs]
    rows["inputs"] = [_json_list(tuple(job.row["inputs"])) for job in jobs]
    rows["dtype"] = [dtype_name(job.dtype) for job in jobs]
    rows["shape"] = [_json_list(job.shape) for job in jobs]
    rows["stored"] = stored
    rows["attrs"] = [json.dumps(job.row["attrs"], default=_json_default) if job.row["attrs"] else "{}"
                     for job in jobs]
    return rows


def _append_table(table: h5py.Dataset, rows: np.ndarray) -> int:
    """Append rows to a site table; returns where they start."""
    start = table.shape[0]
    table.resize((start + len(rows),))
    table[start:] = rows
    return start


STATISTICS_COLUMNS = (*STAT_KEYS, "numel")             # the numeric ones; first_nonfinite is a string


def _write_statistics(table: h5py.Dataset, start: int, rows: np.ndarray) -> None:
    """The statistics' columns of rows already in table from start (as _site_rows made them): the numeric
    columns in one write, and a site's whole row where it has a non-finite element."""
    table[(slice(start, start + len(rows)), *STATISTICS_COLUMNS)] = repack_fields(rows[list(STATISTICS_COLUMNS)])
    for i in np.flatnonzero(rows["first_nonfinite"] != "null"):
        table[start + i] = rows[i]


def _set_statistics(rows: np.ndarray, jobs: Sequence[_SiteJob]) -> None:
    """The statistics' columns of _site_rows' rows, once the jobs' statistics are in."""
    stats = stats_columns([job.stat_values() for job in jobs], [job.shape for job in jobs])
    for key in STATISTICS_COLUMNS:
        rows[key] = stats[key]
    rows["first_nonfinite"] = ["null" if at is None else json.dumps(at) for at in stats["first_nonfinite"]]


def _joined_rows(parts: list[np.ndarray]) -> np.ndarray:
    """One SITE_DTYPE array of parts; many small parts (a row a stored site) go through tuples, as
    np.concatenate of structured arrays with string objects costs ~20 us a part (a 419-site layer: 8 -> 1 ms),
    and a tuple ~1.3 us a row (the batches of a stats-only layer: concatenated, 0.6 -> 0.25 ms)."""
    if len(parts) <= 4 or 16 * len(parts) <= sum(map(len, parts)):
        return np.concatenate(parts)
    return np.array([row for part in parts for row in part.tolist()], dtype=SITE_DTYPE)


@functools.lru_cache(maxsize=4096)
def _json_list(items: tuple) -> str:          # shapes and input lists repeat from layer to layer
    return json.dumps(list(items))


def _rows_of(t: torch.Tensor, token_slice: tuple[int, int] | None) -> torch.Tensor:
    return t[token_slice[0]:token_slice[1]] if token_slice else t


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.generic, np.ndarray, torch.Tensor)):
        return value.tolist()
    return str(value)


def _json_rows(table: Mapping[str, Mapping[str, Any]]) -> np.ndarray:
    for site in table:
        _check_name("site", site)
    rows = [(site, json.dumps(dict(values), default=_json_default)) for site, values in table.items()]
    return np.array(rows, dtype=JSON_TABLE_DTYPE)


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


class _Copied:
    """The event of a copy that is complete when made (a CPU slab's, in tests of the slab logic)."""

    def synchronize(self) -> None:
        pass


def _host_copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(a host copy of t, an event to synchronize on before reading it): pinned and asynchronous from a GPU."""
    if not t.is_cuda:
        return t.clone(), _Copied()
    host = _pinned_copy(t)
    landed = torch.cuda.Event()
    landed.record()
    return host, landed


def _device_encoded(rows: torch.Tensor, compression: str) -> torch.Tensor | None:
    """A GPU site's chunk streams, [chunks, bytes] in pinned memory (copies in flight), encoded on the GPU by
    encode_rows a slice of whole chunks at a time; None where encode_rows does not apply: the writer's pool
    encodes those from the host copy."""
    chunk_rows = row_chunk(rows.dtype, rows.shape, compression)
    if chunk_rows is None:
        return None
    step = chunk_rows * max(1, ENCODE_BYTES // (chunk_rows * rows[0].nbytes))
    parts = (encode_rows(rows[i:i + step], chunk_rows) for i in range(0, rows.shape[0], step))
    first = next(parts)
    host = torch.empty(-(-rows.shape[0] // chunk_rows), first.shape[1], dtype=torch.uint8, pin_memory=True)
    done = 0
    for part in itertools.chain([first], parts):
        host[done:done + part.shape[0]].copy_(part, non_blocking=True)
        done += part.shape[0]
    return host


def _resolved(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _check_writable(path: Path, tmp: Path, force: bool) -> None:
    if not path.parent.is_dir():
        raise BadInput(f"{path}: its folder {path.parent} does not exist")
    if force:
        tmp.unlink(missing_ok=True)
        return
    if path.exists():
        raise BadInput(f"{path} exists; refusing to overwrite a capture (use --force / force=True)")
    if tmp.exists():
        raise BadInput(f"{tmp} exists: an unfinished capture (inspect or delete it; --force replaces it)")


UNCLOSED_STATISTICS = "not known: the capture was not closed"


def _statistics_used(sites_by: Counter[str]) -> str:
    if not sites_by:
        return "no GPU sites"
    if len(sites_by) == 1:
        return next(iter(sites_by))
    return ", ".join(f"{by}: {n} sites" for by, n in sorted(sites_by.items()))


def _check_name(kind: str, name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise BadInput(f"{kind} name {name!r} is not valid: it must be non-empty and contain no '/'")


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
        self._records: dict[str, dict[str, dict[str, Any]]] = {}

    def runs(self) -> list[str]:
        return list(self._file["runs"].keys())

    def run_attrs(self, run: str) -> dict[str, Any]:
        return {k: plain(v) for k, v in self._run(run).attrs.items()}

    def layers_completed(self, run: str) -> list[int]:
        return [int(x) for x in self._run(run).attrs.get("layers_completed", [])]

    def sites(self, run: str) -> list[str]:
        """Site names in execution order."""
        return list(self._site_records(run))

    def site(self, run: str, site: str) -> dict[str, Any]:
        """One site's record: site, run, order, layer, family, inputs, stored, stats, attrs, tensor (the
        dataset's dtype, hash, token_slice, shape, chunks and bytes, or None)."""
        records = self._site_records(run)
        if site not in records:
            raise BadInput(f"{self.path}: run {run!r} has no site {site!r}")
        dset = self.dataset(run, site)
        return {**records[site], "tensor": _tensor_info(dset) if dset is not None else None}

    def stats(self, run: str, site: str) -> dict[str, Any]:
        return self.site(run, site)["stats"]

    def hash(self, run: str, site: str) -> str | None:
        info = self.site(run, site)["tensor"]
        return info["hash"] if info else None

    def dataset(self, run: str, site: str) -> h5py.Dataset | None:
        return self._run(run)["tensors"].get(site)

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
            yield start, read_rows(dset, start, min(start + step, dset.shape[0]), dtype)

    def metric_runs(self) -> list[str]:
        return list(self._file["metrics"].keys()) if "metrics" in self._file else []

    def metrics(self, candidate_run: str) -> dict[str, dict[str, Any]]:
        """Per-site metrics of candidate_run against its reference (empty if none were written)."""
        return self._json_table(f"metrics/{candidate_run}")

    def metrics_reference(self, candidate_run: str) -> str | None:
        name = f"metrics/{candidate_run}"
        return plain(self._file[name].attrs.get("reference")) if name in self._file else None

    def floors(self) -> dict[str, dict[str, float]]:
        return self._json_table("floors")

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

    def _site_records(self, run: str) -> dict[str, dict[str, Any]]:
        if run not in self._records:
            try:
                rows = self._run(run)["sites"][()]
            except (KeyError, OSError) as e:
                raise BadInput(f"{self.path}: run {run!r} has no readable site table ({e})") from None
            self._records[run] = {rec["site"]: rec for rec in (_site_record(run, row) for row in rows)}
        return self._records[run]

    def _json_table(self, name: str) -> dict[str, dict[str, Any]]:
        if name not in self._file:
            return {}
        table: dict[str, dict[str, Any]] = {}
        for site, values in self._file[name][()]:        # later rows for a site update earlier ones
            table.setdefault(plain(site), {}).update(json.loads(plain(values)))
        return table


def _site_record(run: str, row: np.void) -> dict[str, Any]:
    v = {name: plain(row[name]) for name in SITE_DTYPE.names}
    stats = {key: v[key] for key in (*STAT_KEYS, "numel", "dtype")}
    stats["shape"] = json.loads(v["shape"])
    first_bad = json.loads(v["first_nonfinite"])
    if first_bad is not None:
        stats["first_nonfinite"] = first_bad
    return {"run": run, "site": v["site"], "order": v["order"], "layer": v["layer"], "family": v["family"],
            "inputs": json.loads(v["inputs"]), "stored": bool(v["stored"]), "stats": stats,
            "attrs": json.loads(v["attrs"])}


def _tensor_info(dset: h5py.Dataset) -> dict[str, Any]:
    info = {k: plain(v) for k, v in dset.attrs.items()}
    info.update(shape=list(dset.shape), storage_dtype=str(dset.dtype), chunks=list(dset.chunks or []),
                stored_bytes=int(dset.id.get_storage_size()), logical_bytes=int(dset.size * dset.dtype.itemsize))
    return info


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
    """Markdown tables of every documented attribute and column (pasted into captures/README.md)."""
    out = []
    for title, rows in (("Root `/` attributes", ROOT_ATTRS), ("Run `/runs/<run>` attributes", RUN_ATTRS)):
        out += _table(title, ("attribute", "type", "meaning"), rows)
    columns = [(name, kind, meaning) for name, _, kind, meaning in SITE_COLUMNS]
    out += _table("Site table `/runs/<run>/sites`: one row per site, in execution order",
                  ("column", "type", "meaning"), columns)
    out += _table("Tensor `/runs/<run>/tensors/<site>` attributes", ("attribute", "type", "meaning"), TENSOR_ATTRS)
    out += _table("Metrics and floors", ("dataset", "content"), JSON_TABLES)
    return "\n".join(out)


def _table(title: str, heads: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = [f"#### {title}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| `" + row[0] + "` | " + " | ".join(row[1:]) + " |" for row in rows]
    return [*lines, ""]


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--doc"]:
        sys.exit("usage: python -m dsv4debug.capture --doc")
    print(attribute_doc())
