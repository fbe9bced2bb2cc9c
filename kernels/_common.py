"""Shared pieces of the CuTeDSL kernels: target archs, the kernel registry, the compile cache, torch glue and
small in-kernel helpers.

Every kernel in this package is SIMT code (vectorised 128/64-bit global loads and stores, warp shuffles,
shared memory, cp.async): nothing in it is specific to one GPU generation, so each kernel declares both
Hopper (sm_90a, run here on the H200) and Blackwell (sm_100a, compile-checked only). E2M1 is encoded and
decoded with integer code on both (Hopper has no FP4 conversion instructions).

Compiled kernels are cached in-process, keyed by (kernel, configuration, arch). A configuration holds the
static facts the code is specialised on (row width, head dim, flags); token counts, pointers and epsilons are
run-time arguments. `cute.compile` never caches by itself (cutedsl-notes.md section 6), so this cache is the
only one: a process compiles each (kernel, config, arch) once, in ~0.1-0.5 s.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cutlass
from cutlass import Float32, Float64, Int32, Int64, Uint32, cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_stream, make_ptr
from cutlass.cutlass_dsl import T, dsl_user_op

ARCHS: tuple[str, ...] = ("sm_90a", "sm_100a")
BOTH = ARCHS

# --------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelDef:
    """One kernel: how to build its jit launcher for a configuration, where it runs, what CI compiles."""
    name: str                                   # "rmsnorm"
    family: str                                 # op family in dsv4debug.backends.base.OPS ("norm", ...)
    archs: tuple[str, ...]                      # targets it is declared (and compile-checked) for
    build: Callable[..., tuple[Any, tuple]]     # build(**config) -> (jit callable, fake compile arguments)
    configs: tuple[dict, ...]                   # representative configurations compiled by `kernels compile`
    doc: str = ""
    ci_configs: tuple[dict, ...] = field(default=())   # subset compiled by the CPU test (default: configs[:1])

    def ci(self) -> tuple[dict, ...]:
        return self.ci_configs or self.configs[:1]


REGISTRY: dict[str, KernelDef] = {}


def register(kd: KernelDef) -> KernelDef:
    REGISTRY[kd.name] = kd
    return kd


def config_key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


def config_str(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()))


# --------------------------------------------------------------------------------------------------------
# Compile cache
# --------------------------------------------------------------------------------------------------------

_CACHE: dict[tuple, Any] = {}
_COMPILE_SECONDS: dict[tuple, float] = {}
_LOCK = threading.Lock()          # CuTeDSL compilation is not thread-safe (MLIR thread-local state)


def compile_kernel(name: str, arch: str, **config) -> Any:
    """The compiled kernel for (name, config, arch), compiling it on first use (no GPU needed)."""
    key = (name, config_key(config), arch)
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    kd = REGISTRY[name]
    if arch not in kd.archs:
        raise ValueError(f"kernel {name} is not declared for {arch} (declared: {', '.join(kd.archs)})")
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            t0 = time.perf_counter()
            jit_fn, args = kd.build(**config)
            fn = cute.compile[cute.GPUArch(arch)](jit_fn, *args)
            _COMPILE_SECONDS[key] = time.perf_counter() - t0
            _CACHE[key] = fn
    return fn


def compile_seconds(name: str, arch: str, **config) -> float | None:
    return _COMPILE_SECONDS.get((name, config_key(config), arch))


def clear_cache() -> None:
    _CACHE.clear()
    _COMPILE_SECONDS.clear()


# --------------------------------------------------------------------------------------------------------
# Torch glue (imported lazily: compiling needs no torch device)
# --------------------------------------------------------------------------------------------------------

def device_arch(device) -> str:
    """CuTeDSL target of a CUDA device: sm_90a for Hopper, sm_100a for Blackwell B200/GB200."""
    arch = kernel_arch(device)
    if arch is None:
        raise RuntimeError(f"no CuTeDSL kernels are built for {gpu_name(device)} (targets: {', '.join(ARCHS)})")
    return arch


def kernel_arch(device) -> str | None:
    """device_arch, or None for a GPU none of ARCHS runs on (callers with a torch path take it there)."""
    return _arch_of(device if isinstance(device, int) else _device_index(device))   # an int: per record()


def _device_index(device) -> int:
    """The CUDA device index of an int, a name ('cuda', 'cuda:1') or a torch.device (None: the current one)."""
    import torch
    index = device if isinstance(device, int) else torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def gpu_name(device) -> str:
    """'NVIDIA A100-SXM4-80GB (sm_80)': for messages."""
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


@functools.cache
def _arch_of(index: int) -> str | None:      # launchers ask on every call: the query costs ~3 us
    import torch
    return {(9, 0): "sm_90a", (10, 0): "sm_100a"}.get(torch.cuda.get_device_capability(index))


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (launchers size grids by it on every call)."""
    return _sm_count(_device_index(device))


@functools.cache
def _sm_count(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


def runnable_archs() -> set[str]:
    """The targets every registered kernel is declared for: where a pipeline of all of them can run."""
    return set(ARCHS).intersection(*(kd.archs for kd in REGISTRY.values()))


def torch_to_cute(dtype):
    import torch
    table = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32,
             torch.uint8: cutlass.Uint8, torch.int32: cutlass.Int32, torch.int64: cutlass.Int64,
             torch.float8_e4m3fn: cutlass.Float8E4M3FN}
    return table[dtype]


def ptr(t, dtype=None, align: int = 16):
    """A global-memory pointer to tensor t's data for a compiled kernel (checks device and alignment)."""
    if not t.is_cuda:
        raise ValueError("CuTeDSL kernels take CUDA tensors")
    if t.data_ptr() % align:
        raise ValueError(f"tensor data pointer is not {align}-byte aligned (pass a contiguous, fresh tensor)")
    return make_ptr(dtype or torch_to_cute(t.dtype), t.data_ptr(), cute.AddressSpace.gmem, assumed_align=align)


def fake_ptr(dtype, align: int = 16):
    """A pointer argument for compiling without a GPU."""
    return make_ptr(dtype, align, cute.AddressSpace.gmem, assumed_align=align)


def fake_stream():
    return make_fake_stream()


_STREAMS: dict[int, Any] = {}


def current_stream():
    """torch's current CUDA stream as a CUstream (cached by handle: building one costs ~5 us a launch)."""
    import torch
    handle = torch.cuda.current_stream().cuda_stream
    stream = _STREAMS.get(handle)
    if stream is None:
        import cuda.bindings.driver as cuda
        stream = _STREAMS[handle] = cuda.CUstream(handle)
    return stream


_SCRATCH: dict = {}


def scratch(kind: str, device, numel: int, dtype):
    """`numel` elements of a device buffer kept for the process (split-K partials, zeroed tickets that every
    launch leaves zero again), shared by all launches of a kind whose size rounds up to the same power of
    two: a decode of any token count reuses one. Never freed or replaced, since a CUDA graph that captured a
    launch keeps using the buffer it saw. One buffer a stream: launches on two streams at once would otherwise
    share tickets and partials (launches on one stream are ordered, so they may share)."""
    import torch
    size = 1 << max(0, numel - 1).bit_length()
    stream = torch.cuda.current_stream(device).cuda_stream if torch.device(device).type == "cuda" else None
    key = (kind, str(device), dtype, size, stream)
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.zeros(size, dtype=dtype, device=device)
    return buf[:numel]


def check_numel(*tensors) -> None:
    """In-kernel offsets are 32-bit: refuse tensors of 2**31 elements or more instead of overflowing."""
    for t in tensors:
        if t.numel() >= 2 ** 31:
            raise ValueError(f"tensor of {t.numel()} elements is too large for 32-bit kernel offsets")


# --------------------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------------------

def row_geometry(n_vec: int, max_threads: int = 256, min_per_thread: int = 2) -> tuple[int, int]:
    """Threads per row and vectors per thread for a row of n_vec vectors (no remainder, no predication).

    The thread count is the largest power of two dividing n_vec (capped at max_threads), lowered while it
    leaves fewer than `min_per_thread` vectors per thread and stays at least a warp.
    """
    tpr = 1
    while n_vec % (tpr * 2) == 0 and tpr * 2 <= max_threads:
        tpr *= 2
    while tpr > 32 and n_vec // tpr < min_per_thread:
        tpr //= 2
    return tpr, n_vec // tpr


# --------------------------------------------------------------------------------------------------------
# In-kernel helpers
# --------------------------------------------------------------------------------------------------------

@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """Reinterpret an fp32 value as its 32 bits."""
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def f64_bits(x: Float64, *, loc=None, ip=None) -> Int64:
    """Reinterpret an fp64 value as its 64 bits."""
    return Int64(llvm.bitcast(T.i64(), Float64(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def bits_f32(x: Int32, *, loc=None, ip=None) -> Float32:
    """Reinterpret 32 bits as an fp32 value."""
    return Float32(llvm.bitcast(T.f32(), Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def u32_of_i32(x: Int32, *, loc=None, ip=None) -> Uint32:
    return Uint32(Int32(x).ir_value(loc=loc, ip=ip))


def fmax_nan(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx("max.NaN.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[a, b])


def fmin_nan(a: Float32, b: Float32) -> Float32:
    return cute.arch.inline_ptx("min.NaN.f32 {$w0}, {$r0}, {$r1};", write_only_types=[Float32],
                                read_only_args=[a, b])


def ld_cg_f32x2(addr: Int64):
    """Two consecutive fp32 values (8-byte aligned) by one L2-coherent load (split-K partials written by other
    CTAs: never served from a stale L1 line)."""
    return cute.arch.inline_ptx("ld.global.cg.v2.f32 {{$w0}, {$w1}}, [{$r0}];", write_only_types=[Float32, Float32],
                                read_only_args=[addr])


def ld_cg_f32x4(addr: Int64):
    """Four consecutive fp32 values (16-byte aligned) by one L2-coherent load."""
    return cute.arch.inline_ptx("ld.global.cg.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Float32] * 4, read_only_args=[addr])


def ld_cg_f32(addr: Int64):
    """One fp32 value by an L2-coherent load."""
    return cute.arch.inline_ptx("ld.global.cg.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[addr])


def ld_acquire_i32(addr: Int64):
    """A counter written by other CTAs, read with acquire semantics at GPU scope (a flag to spin on)."""
    return cute.arch.inline_ptx("ld.acquire.gpu.global.b32 {$w0}, [{$r0}];", write_only_types=[Int32],
                                read_only_args=[addr])


def ld_shared_v4(addr: Int32):
    return cute.arch.inline_ptx("ld.shared.v4.u32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[Uint32] * 4, read_only_args=[addr])


def ld_shared_v2(addr: Int32):
    return cute.arch.inline_ptx("ld.shared.v2.u32 {{$w0}, {$w1}}, [{$r0}];", write_only_types=[Uint32] * 2,
                                read_only_args=[addr])


def cp_async_16(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32):
    """16 bytes global -> shared, bypassing L1; the bytes past src_bytes (all 16 for 0) are written as zero."""
    cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};",
                         read_only_args=[smem_addr, gmem_addr, src_bytes])


def cp_async_8(smem_addr: Int32, gmem_addr: Int64, src_bytes: Int32):
    """8 bytes global -> shared (8-byte aligned both sides); zero-filled past src_bytes (all 8 for 0)."""
    cute.arch.inline_ptx("cp.async.ca.shared.global [{$r0}], [{$r1}], 8, {$r2};",
                         read_only_args=[smem_addr, gmem_addr, src_bytes])


def st_global_v4(addr: Int64, vals: list):
    """16 bytes to global memory: 4 fp32 or 4 32-bit words (.b32 takes either register type)."""
    cute.arch.inline_ptx("st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", read_only_args=[addr, *vals])


def mma_bf16_16816(a: tuple, b: tuple, c: tuple):
    """D = A B + C, one m16n8k16 bf16 MMA with fp32 accumulators (4 A, 2 B, 4 C registers a lane)."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[Float32] * 4, read_only_args=[*a, *b, *c])


@cute.jit
def last_split_part(ticket: cute.Pointer, parts, lane: Int32):
    """Split-K with a ticket per warp's set of output values (the same set in every part, so warps never wait
    for each other), called once the warp has written its part: counts the part; true (across the warp) in the
    warp that completes the last one, which may then read every part (L2-coherent loads) and which resets the
    ticket for the next launch. The warp barriers order the lanes' stores before lane 0's release and its
    acquire before the lanes' loads, as CUTLASS's split-K semaphores order a CTA's: no GPU-scope fence (with
    two, the W4A16 decode's sum cost ~1 us more on the H200). The FP8 GEMM's split-K still has its own
    ticket code with both fences: moving it here is not yet run on a GPU."""
    cute.arch.sync_warp()
    done = Int32(0)
    if lane == 0:
        done = cute.arch.atomic_add(ticket, Int32(1), sem="acq_rel", scope="gpu")
        if done == parts - 1:
            cute.make_tensor(ticket, cute.make_layout(1))[0] = Int32(0)
    done = cute.arch.shuffle_sync(done, 0)
    cute.arch.sync_warp()
    return done == parts - 1


def group_sum(val, threads: int):
    """Sum over aligned groups of `threads` lanes (a power of two <= 32) by butterfly shuffles."""
    offset = threads // 2
    while offset > 0:
        val = val + cute.arch.shuffle_sync_bfly(val, offset=offset)
        offset //= 2
    return val


def group_max(val, threads: int):
    offset = threads // 2
    while offset > 0:
        val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=offset))
        offset //= 2
    return val


def group_max_int(val, threads: int):
    offset = threads // 2
    while offset > 0:
        other = cute.arch.shuffle_sync_bfly(val, offset=offset)
        val = cutlass.max(val, other)
        offset //= 2
    return val
