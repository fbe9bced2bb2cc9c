"""Exact weight formats of DeepSeek-V4 checkpoints (dsv4-architecture.md 4.4-4.6), pure vectorised torch.

* FP8 block: e4m3 weight [out, in], e8m0 scale per 128x128 block (power of two).
* MXFP4: int8 nibble pairs [out, in/2] (low nibble = even element), e8m0 scale per 32 along `in`.
* NVFP4: uint8 nibble pairs [out, in/2], e4m3 scale per 16 along `in`, fp32 global scale_2.

Every quantiser computes its power-of-two scales with integer exponent arithmetic (no log2 rounding), so
results are bit-identical on CPU and GPU.
"""
from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP8_BLOCK, MXFP4_BLOCK, NVFP4_BLOCK = 128, 32, 16
E4M3_MAX, E2M1_MAX = 448.0, 6.0

_CONSTANTS: list[torch.Tensor] = []                       # lookup tables, registered by constant_table
_CONSTANTS_ON: dict[tuple[int, str], torch.Tensor] = {}


def constant_table(table: torch.Tensor) -> torch.Tensor:
    """Register a module-level lookup table for `on_device` (and for exact_compile's priming)."""
    _CONSTANTS.append(table)
    return table


def on_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A registered table on `device`, copied there once: a copy per call is a synchronous host-to-device
    transfer, which a CUDA graph cannot capture. Primed outside torch.compile (exact_compile), a compiled
    graph reads the device copy as a constant instead of copying the host table on every call."""
    key = (id(table), str(device))
    if key not in _CONSTANTS_ON:
        _CONSTANTS_ON[key] = table.to(device)
    return _CONSTANTS_ON[key]


# code -> value; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_TABLE = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# byte -> (value of low nibble, value of high nibble): one gather decodes two elements
_PAIR_TABLE = constant_table(                                          # [256, 2]
    torch.stack([E2M1_TABLE.repeat(16), E2M1_TABLE.repeat_interleave(16)], dim=-1))
# midpoints between neighbouring E2M1 magnitudes; a tie rounds to the even code, which is the upper
# neighbour at 0.75, 1.75 and 3.5 and the lower one at the others
_E2M1_MIDPOINTS = constant_table(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))

PLAIN_FORMATS = ("bf16_plain", "f32", "i64")


# ---- small exact helpers ---------------------------------------------------------------------------

def pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, exact, for integer e in [-127, 127]: the float32 bit pattern (2^-127 is subnormal),
    the value an e8m0 byte e + 127 decodes to, in integer ops that torch.compile lowers everywhere."""
    biased = e.to(torch.int32) + 127
    return torch.where(biased > 0, biased << 23, 1 << 22).view(torch.float32)


def e8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent of e8m0 scales, int32 (byte 255, NaN, gives 128)."""
    return scale.view(torch.uint8).to(torch.int32) - 127


def e8m0_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (or their bytes, uint8) as float32: 2^(byte - 127), NaN for byte 255; what .float() of an
    e8m0 tensor gives, by a 256-entry table that torch.compile fuses into its consumer (it has no e8m0 type,
    and the bit-pattern view pow2 builds ends a fused kernel: two kernels and an fp32 round trip)."""
    return on_device(_E8M0_TABLE, scale.device)[scale.view(torch.uint8).long()]


_E8M0_TABLE = constant_table(torch.where(torch.arange(256) == 255, torch.nan, pow2(torch.arange(256) - 127)))


def pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest integer e with amax <= qmax * 2**e, clamped to e8m0's [-127, 127]; int32.

    From frexp: amax = m * 2**x, qmax = q * 2**p with m, q in [0.5, 1); then e = x - p + (m > q).
    """
    q, p = math.frexp(qmax)
    m, x = torch.frexp(amax.float())
    e = x - p + (m > q).to(torch.int32)
    return torch.where(amax > 0, e, -127).clamp(-127, 127)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to E2M1 codes, ties to even; saturates at 6."""
    a = x.abs()
    # the number of midpoints below a
    code = torch.bucketize(a, on_device(_E2M1_MIDPOINTS, x.device), out_int32=True).to(torch.uint8)
    code += (a == 0.75) | (a == 1.75) | (a == 3.5)
    return code | ((x < 0).to(torch.uint8) << 3)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes 0..15 -> [..., n] uint8; the even element goes in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] int8/uint8 -> [..., 2n] uint8 codes."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def e2m1_decode(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] packed bytes -> [..., 2n] float32 values."""
    return on_device(_PAIR_TABLE, packed.device)[packed.view(torch.uint8).long()].flatten(-2)


# ---- FP8 128x128 blocks --------------------------------------------------------------------------------

def _block_grid(w: torch.Tensor, block: int) -> torch.Tensor:
    """[out, in] -> zero-padded float32 [R, block, C, block]."""
    out, inp = w.shape
    r, c = -(-out // block), -(-inp // block)
    padded = F.pad(w.float(), (0, c * block - inp, 0, r * block - out))
    return padded.view(r, block, c, block)


def fp8_block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (e4m3 [out, in], e8m0 [ceil(out/128), ceil(in/128)]); s = 2^ceil(log2(amax/448))."""
    out, inp = w.shape
    grid = _block_grid(w, FP8_BLOCK)                                   # [R, 128, C, 128]
    e = pow2_exponent(grid.abs().amax(dim=(1, 3)), E4M3_MAX)           # [R, C]
    q = (grid * pow2(-e)[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    q = q.flatten(2).flatten(0, 1)[:out, :inp]                         # [out, in]
    return q.contiguous(), (e + 127).to(torch.uint8).view(E8M0)


def fp8_block_dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[r, c] = float(w[r, c]) * 2^(scale[r//128, c//128] - 127), float32 [out, in]."""
    out, inp = w.shape
    c = scale.shape[1]
    rows = e8m0_float(scale).repeat_interleave(FP8_BLOCK, dim=0)[:out]  # [out, C]
    x = w.float()
    if inp != c * FP8_BLOCK:                                           # partial last column block
        x = F.pad(x, (0, c * FP8_BLOCK - inp))
    return (x.view(out, c, FP8_BLOCK) * rows[:, :, None]).flatten(1)[:, :inp]


# ---- MXFP4: E2M1 with an e8m0 scale per 32 -------------------------------------------------------------

def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in/2], e8m0 [out, in/32]); scale = smallest 2^k with amax/2^k <= 6."""
    out, inp = w.shape
    blocks = w.float().view(out, inp // MXFP4_BLOCK, MXFP4_BLOCK)
    e = pow2_exponent(blocks.abs().amax(dim=-1), E2M1_MAX)              # [out, in/32]
    codes = e2m1_encode(blocks * pow2(-e)[..., None]).view(out, inp)
    return pack_nibbles(codes).view(torch.int8), (e + 127).to(torch.uint8).view(E8M0)


def mxfp4_dequantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W[r, c] = E2M1[nibble(r, c)] * 2^(scale[r, c//32] - 127), float32 [out, in]."""
    return _scaled_blocks(w, e8m0_float(scale), MXFP4_BLOCK)


def _scaled_blocks(w: torch.Tensor, block_scale: torch.Tensor, block: int) -> torch.Tensor:
    """Packed E2M1 [out, in/2] times one float32 scale per `block` values -> float32 [out, in], laid out as
    [blocks, block] so that a compiled kernel's index math divides by constants only. With [out, in] (dynamic
    sizes) it divided by both for every element: the likely reason the fused MXFP4 dequantisation ran at
    ~210 GB/s on the H200 (262 us per [3072, 7168] expert matrix; not re-measured since)."""
    out, half = w.shape
    values = e2m1_decode(w.reshape(-1, block // 2))                    # [out*in/block, block]
    return (values * block_scale.reshape(-1, 1)).view(out, 2 * half)


# ---- NVFP4: E2M1 with an e4m3 scale per 16 and an fp32 global scale ---------------------------------------

def nvfp4_quantize(w: torch.Tensor, scale_2: float | torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (uint8 [out, in/2], e4m3 [out, in/16], fp32 scalar scale_2), ModelOpt style.

    scale_2 = amax / (6 * 448) unless given; block scale = e4m3(block_amax / (6 * scale_2)).
    """
    out, inp = w.shape
    blocks = w.float().view(out, inp // NVFP4_BLOCK, NVFP4_BLOCK)
    if scale_2 is None:
        amax = blocks.abs().amax()
        scale_2 = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0)
    scale_2 = torch.as_tensor(scale_2, dtype=torch.float32, device=w.device).reshape(())
    block_amax = blocks.abs().amax(dim=-1)                             # [out, in/16]
    ws = (block_amax / (E2M1_MAX * scale_2)).clamp(max=E4M3_MAX).to(E4M3)
    divisor = ws.float() * scale_2
    divisor = torch.where(divisor > 0, divisor, 1.0)                   # all-zero (or underflowed) blocks
    codes = e2m1_encode(blocks / divisor[..., None]).view(out, inp)
    return pack_nibbles(codes), ws, scale_2


def nvfp4_dequantize(w: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor) -> torch.Tensor:
    """W[r, c] = E2M1[nibble(r, c)] * float(weight_scale[r, c//16]) * weight_scale_2, float32 [out, in]."""
    return _scaled_blocks(w, weight_scale.float() * weight_scale_2.float(), NVFP4_BLOCK)


NVFP4Triple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _cast_one(w: torch.Tensor, s: torch.Tensor, k_max: int, scale_2: torch.Tensor, all_exact: bool
              ) -> tuple[NVFP4Triple, int]:
    """One MXFP4 tensor -> NVFP4 with the shared scale_2 = 2^(k_max - 8); returns the triple and lossy blocks.
    all_exact: every block's exponent is known to be within 17 of k_max (no check, no host sync)."""
    k = e8m0_exponent(s).repeat_interleave(2, dim=-1)                   # [out, in/16], each 32-block = two 16s
    d = k - (k_max - 8)                                                 # block scale exponent relative to scale_2
    exact = d >= -9                                                     # 2^-9 is e4m3's smallest subnormal
    ws = pow2(d.clamp(-9, 8)).to(E4M3)
    packed = w.view(torch.uint8)
    if all_exact or bool(exact.all()):
        return (packed.clone(), ws, scale_2), 0
    # blocks too small for e4m3 relative to scale_2: re-quantise their values with data-derived scales
    source = mxfp4_dequantize(w, s)
    fb_packed, fb_ws, _ = nvfp4_quantize(source, scale_2)
    ws = torch.where(exact, ws.float(), fb_ws.float()).to(E4M3)
    packed = torch.where(exact.repeat_interleave(NVFP4_BLOCK // 2, dim=-1), packed, fb_packed)
    out, inp = source.shape
    changed = (nvfp4_dequantize(packed, ws, scale_2) != source).view(out, inp // NVFP4_BLOCK, NVFP4_BLOCK)
    return (packed, ws, scale_2), int(changed.any(dim=-1).sum())


def mxfp4_to_nvfp4(w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor | None = None,
                   s3: torch.Tensor | None = None) -> tuple[NVFP4Triple, NVFP4Triple | None, int]:
    """Lossless MXFP4 -> NVFP4 cast (ModelOpt `--cast_mxfp4_to_nvfp4`, dsv4-architecture.md 4.6).

    scale_2 = 2^(k_max - 8), k_max = largest e8m0 exponent over w1 and w3 (they share scale_2); each 16-block
    scale is 2^(k_j - (k_max - 8)) in e4m3 and the nibbles are copied bit for bit. Blocks whose exponent is
    more than 17 below k_max fall back to data-derived scales. Returns (nv1, nv3 or None, lossy block count).
    """
    ks = [e8m0_exponent(s) for s in (s1, s3) if s is not None]
    k_max, k_min = torch.stack([torch.stack([k.max() for k in ks]).max(),
                                torch.stack([k.min() for k in ks]).min()]).tolist()   # the one host sync
    scale_2 = torch.tensor(math.ldexp(1.0, k_max - 8), dtype=torch.float32, device=w1.device)
    all_exact = k_min >= k_max - 17                                     # every block scale fits e4m3 exactly
    nv1, lossy1 = _cast_one(w1, s1, k_max, scale_2, all_exact)
    if w3 is None or s3 is None:
        return nv1, None, lossy1
    nv3, lossy3 = _cast_one(w3, s3, k_max, scale_2, all_exact)
    return nv1, nv3, lossy1 + lossy3


# ---- a stored weight with its format -------------------------------------------------------------------

@dataclass
class QWeight:
    """One module's stored tensors, keyed by suffix ('weight', 'scale', 'weight_scale', 'weight_scale_2',
    'input_scale'; '' for a plain tensor). `fmt` as schema.ModuleSpec.fmt."""
    name: str
    fmt: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        """Logical shape: [out, in] for linears (in counts elements, not packed bytes)."""
        if self.fmt in PLAIN_FORMATS:
            return tuple(self.tensors[""].shape)
        out, inp = self.tensors["weight"].shape
        return (out, inp * 2) if self.fmt in ("mxfp4", "nvfp4") else (out, inp)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def rows(self, a: int, b: int) -> QWeight:
        """Output rows [a, b) of a linear's weight, scales alongside (views, no copy); a and b on the format's
        scale blocks (fp8: 128 rows; b may also be the last row)."""
        out = self.shape[0]
        block = 128 if self.fmt == "fp8" else 1
        if not (0 <= a < b <= out and a % block == 0 and (b % block == 0 or b == out)):
            raise ValueError(f"{self.name}: rows [{a}, {b}) of {out} do not fall on {self.fmt}'s {block}-row blocks")

        def cut(key: str, t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0 or key in ("weight_scale_2", "input_scale"):       # per-tensor scalars
                return t
            return t[a // block:-(-b // block)] if (key == "scale" and self.fmt == "fp8") else t[a:b]
        return QWeight(self.name, self.fmt, {k: cut(k, t) for k, t in self.tensors.items()})

    def dequantize(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                   fused: bool = False) -> torch.Tensor:
        """The exact logical values (float32 arithmetic), cast to `dtype`; plain tensors are just cast.
        fused: block formats through one torch.compile'd graph (the same values; on a GPU a few kernels
        instead of ~10 passes with an int64 gather, most of a reference layer's GPU time at 4096 tokens)."""
        if fused and self.fmt in _DEQUANTIZERS:
            return dequantize_all([self], dtype, device, fused=True)[0]
        t = {k: v.to(device) if device is not None else v for k, v in self.tensors.items()}
        if self.fmt in _DEQUANTIZERS:
            dequantize, names = _DEQUANTIZERS[self.fmt]
            values = dequantize(*(t[k] for k in names))
        elif self.fmt in PLAIN_FORMATS:
            values = t[""]
        elif self.fmt == "bf16":
            values = t["weight"]
        else:
            raise ValueError(f"{self.name}: unknown format {self.fmt!r}")
        return values.to(dtype)


def dequantize_all(weights: Sequence[QWeight], dtype: torch.dtype, device: torch.device | str | None = None,
                   fused: bool = False) -> list[torch.Tensor]:
    """QWeight.dequantize of several weights. fused: the block-format ones of each format through one
    compiled graph, so one host dispatch (~170 us on an H200 host: guards and the graph's launch) serves
    them all, e.g. an expert's w1, w3 and w2, in a reference forward that the host's launches bound."""
    out: list[torch.Tensor | None] = [None] * len(weights)
    groups: dict[str, list[int]] = {}
    for i, w in enumerate(weights):
        if fused and w.fmt in _DEQUANTIZERS:
            groups.setdefault(w.fmt, []).append(i)
        else:
            out[i] = w.dequantize(dtype, device)
    for fmt, members in groups.items():
        names = _DEQUANTIZERS[fmt][1]
        stored = [_compilable(weights[i].tensors[k].to(device) if device is not None else weights[i].tensors[k])
                  for i in members for k in names]
        for i, values in zip(members, _fused_dequantizer(fmt, dtype, len(members))(*stored)):
            out[i] = values
    return out


# ---- torch.compile with eager's rounding -------------------------------------------------------------------

def exact_compile(fn: Callable, dynamic: bool = True) -> Callable:
    """torch.compile(fn) (one graph; dynamic shapes unless `dynamic` is False) that rounds as eager does: precision casts emulated, which
    also keeps Triton from contracting a multiply and an add into an FMA. The recompile limit is raised: callers
    compile partials of one function (one code object, one cache of graphs) for every format and dtype, and
    fullgraph=True turns a hit limit into an error. The lookup tables are put on the arguments' devices first,
    so that the graph reads them there (as constants) instead of copying them from the host each call."""
    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True, options={"emulate_precision_casts": True})
    import torch._dynamo.config as dynamo_config

    def run(*args):
        for device in {a.device for a in args if isinstance(a, torch.Tensor)}:
            for table in _CONSTANTS:
                on_device(table, device)
        # set and restored by hand: config.patch() builds a class a call (~40 us of a reference layer's
        # ~400 calls, on a host that bounds the forward); under a lock, or two threads could restore each
        # other's raised limit for good
        with _RECOMPILE_LIMIT_LOCK:
            limit = dynamo_config.recompile_limit
            dynamo_config.recompile_limit = max(limit, 128)
            try:
                return compiled(*args)
            finally:
                dynamo_config.recompile_limit = limit
    return run


_RECOMPILE_LIMIT_LOCK = threading.Lock()


# format -> (dequantiser, the stored tensors it takes)
_DEQUANTIZERS: dict[str, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    "fp8": (fp8_block_dequantize, ("weight", "scale")),
    "mxfp4": (mxfp4_dequantize, ("weight", "scale")),
    "nvfp4": (nvfp4_dequantize, ("weight", "weight_scale", "weight_scale_2")),
}


def _compilable(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E8M0 else t          # e8m0_float reads the bytes


def _dequantized(fmt: str, dtype: torch.dtype, *tensors: torch.Tensor) -> torch.Tensor:
    return _DEQUANTIZERS[fmt][0](*tensors).to(dtype)


def _dequantized_many(fmt: str, dtype: torch.dtype, n: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """n weights of one format, their stored tensors in order, as one graph."""
    k = len(tensors) // n
    return tuple(_dequantized(fmt, dtype, *tensors[i * k:(i + 1) * k]) for i in range(n))


@functools.cache
def _fused_dequantizer(fmt: str, dtype: torch.dtype, n: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    # static shapes: a model has a handful of weight shapes, and the static kernels ran 2-3x faster on the H200
    return exact_compile(functools.partial(_dequantized_many, fmt, dtype, n), dynamic=False)
