"""NVFP4 weights repacked for the Hopper W4A16 kernels (kernels/gemm_w4a16.py), in plain torch.

The weights stay 4-bit: the repack only reorders nibbles and re-encodes the e4m3 block scales, once, at
load time. It is exact: `decode_blob` (a torch emulation of the in-register decode) reproduces
`dsv4debug.formats.nvfp4_dequantize` bit for bit, and the tests check it.

Layout (W [N, K] logical, N % 128 == 0, K % 64 == 0; rows in blocks of 64 = one warpgroup's WGMMA A operand):

  blob  uint32 [E, N/64, K/64, 4 warps, 32 lanes, 4 words]  - 2 KiB per (64-row block, 64-wide K chunk)
  sblob uint8  [E, N/64, K/64, 4 warps, 8 groups, 8 bytes] - 256 B per (64-row block, K chunk)
  gscale fp32  [E]                                         - weight_scale_2 * 2**7

Lane l = 4 g + q of warp w holds, for each k16 block j of a chunk, one word: the 8 E2M1 codes of its WGMMA
A fragment (rows r = 16 w + g and r + 8 of the row block; columns 16 j + 2q + {0, 1, 8, 9} of the chunk).
The codes are bit-placed so that four shift-and-mask expressions give bf16x2 words equal to the E2M1 values
times 2**-126 (sign bit 15, magnitude in bits 6..8, both halves):

  out0 = (w << 6) & 0x81C081C0                      rows r,   columns 2q, 2q+1
  out1 = (w << 3) & 0x81C081C0                      rows r+8, columns 2q, 2q+1
  out2 =  w       & 0x81C081C0                      rows r,   columns 2q+8, 2q+9
  out3 = ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000)   rows r+8, 2q+8, 2q+9

Each bf16x2 word is multiplied (bf16, exact) by the block scale held as bf16 s * 2**119; the product is
value * s * 2**-7, exact in bf16 (<= 6 significant bits, no underflow), and the epilogue multiplies the fp32
accumulator by gscale = weight_scale_2 * 2**7.

The scale bytes of lane (g, q) for a chunk are [s(r, j), s(r+8, j)] for j = 0..3, each encoded as
u = (E + 10) << 3 | m for s = 2**E * (1 + m/8) (e4m3 subnormals normalised, E in [-9, 8]); the kernel
rebuilds bf16(s * 2**119) as (u << 4) + (236 << 7) with one PRMT and one IMAD per pair of rows. A zero block
scale becomes u = 0 with its codes cleared (the dequantised block is zero either way); a negative scale
flips the codes' signs. NaN scales are refused.
"""
from __future__ import annotations

import functools

import torch

from dsv4debug.formats import constant_table, exact_compile, on_device

BLOCK_ROWS = 64           # rows per warpgroup block
CTA_ROWS = 128            # rows per CTA (two consumer warpgroups)
CHUNK = 64                # K elements per chunk
SCALE_BIAS = 236          # bf16 exponent offset: E + 10 + 236 = E + 119 + 127
MAG_MASK = 0x81C081C0

# source bit position of code bit b (0..2 magnitude, 3 sign) of output word o, low half (add 16 for high)
_POS = (
    (0, 1, 2, 9),
    (3, 4, 5, 12),
    (6, 7, 8, 15),
    (10, 11, 13, 14),
)


def _check_shape(n: int, k: int) -> None:
    if n % CTA_ROWS or k % CHUNK:
        raise ValueError(f"W4A16 kernels need N % {CTA_ROWS} == 0 and K % {CHUNK} == 0 (got N={n}, K={k})")


def _codes(packed: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)          # [N, K] codes, even element first


def encode_scales(ws: torch.Tensor, check: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 block scales -> (u codes uint8, zero mask, negative mask). check: raise on NaN (one host sync); off
    for scales this package made itself (the MXFP4 -> NVFP4 cast), which cannot be NaN."""
    s = ws.float()
    neg = s < 0
    a = s.abs()
    zero = a == 0
    m, e = torch.frexp(torch.where(zero, torch.ones_like(a), a))     # a = m * 2**e, m in [0.5, 1)
    big_e = e - 1                                                     # a = 2**E * (1 + frac)
    frac = (m * 2 - 1) * 8
    mant = frac.round()
    outside = (frac != mant) | (~zero & ((big_e < -9) | (big_e > 8)))   # cannot happen for real e4m3 bytes
    if check and bool((outside | torch.isnan(s)).any()):              # one host sync for both checks
        if torch.isnan(s).any():
            raise ValueError("NVFP4 block scale is NaN: not representable by the W4A16 kernels")
        raise ValueError("block scale outside the e4m3 range")
    u = ((big_e + 10).to(torch.int32) << 3) | mant.to(torch.int32)
    u = torch.where(zero, torch.zeros_like(u), u)
    return u.to(torch.uint8), zero, neg


def pack_nvfp4(packed: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor | float,
               check_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One NVFP4 weight (uint8 [N, K/2], e4m3 [N, K/16], fp32 scalar) -> (blob, sblob, gscale) with E = 1."""
    n, k = packed.shape[0], packed.shape[1] * 2
    _check_shape(n, k)
    u, zero, neg = encode_scales(weight_scale, check_scales)           # [N, K/16]; checked: one sync
    layout = _fused_layout() if packed.is_cuda else _layout
    blob, sblob = layout(packed, u, zero, neg)
    gscale = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=packed.device).reshape(1) * 128.0
    return blob, sblob, gscale


def _layout(packed: torch.Tensor, u: torch.Tensor, zero: torch.Tensor, neg: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and encoded scales in the kernel's layout: ([1, N/64, K/64, 4, 32, 4] words, [1, ..., 8, 8] bytes)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    codes = _codes(packed).to(torch.int32)                             # [N, K]
    zero16 = zero.repeat_interleave(16, dim=1)
    neg16 = neg.repeat_interleave(16, dim=1)
    codes = torch.where(zero16, torch.zeros_like(codes), codes ^ (neg16.to(torch.int32) << 3))

    # row n = rb*64 + w*16 + h*8 + g ; col k = c*64 + j*16 + s*8 + q*2 + e ; output word o = 2*s + h
    blob = _words(codes, n, k).reshape(1, n // 64, k // 64, 4, 32, 4)

    uu = u.view(n // 64, 4, 2, 8, k // 64, 4)                          # rb w h g c j
    sblob = uu.permute(0, 4, 1, 3, 5, 2).reshape(1, n // 64, k // 64, 4, 8, 8)   # rb c w g (j h)
    return blob.contiguous(), sblob.contiguous()


@functools.cache
def _fused_layout():
    """_layout as one torch.compile'd graph (integer ops only: the same bytes), for GPU tensors: a Pro layer's
    384 experts are repacked on every call."""
    return exact_compile(_layout)


def _spread_table() -> torch.Tensor:
    """int64 [2 s, 2 h, 2 e, 16 codes]: code c of output o = 2 s + h, half e, with its bits b moved to
    _POS[o][b] + 16 e of the lane's word (the bits of the 8 codes of a word are disjoint)."""
    t = torch.zeros(2, 2, 2, 16, dtype=torch.int64)
    for s, h, e, c in ((s, h, e, c) for s in range(2) for h in range(2) for e in range(2) for c in range(16)):
        t[s, h, e, c] = sum(((c >> b) & 1) << (_POS[2 * s + h][b] + 16 * e) for b in range(4))
    return t


_SPREAD = constant_table(_spread_table())


def _words(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[N, K] codes -> int32 words [rb, c, w, g, q, j]: one table lookup per code, summed over the 8 codes
    of a word (a loop of shifts and masks per bit made a Pro layer's expert packing ~2 s of GPU time)."""
    c9 = codes.view(n // 64, 4, 2, 8, k // 64, 4, 2, 4, 2)              # rb w h g c j s q e
    lanes = c9.permute(0, 4, 1, 3, 7, 5, 6, 2, 8).to(torch.int64)        # rb c w g q j s h e
    slot = torch.arange(8, device=codes.device).view(2, 2, 2) * 16       # (s, h, e) -> row of the table
    words = on_device(_SPREAD, codes.device).view(-1)[lanes + slot].sum(dim=(-3, -2, -1))
    return _as_u32(words)


def _as_u32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> int32 tensor with the same bits (torch has no general uint32 math)."""
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)


def interleave_w13(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """Rows of w1 and w3 interleaved by 8: [w1[0:8], w3[0:8], w1[8:16], w3[8:16], ...] (any trailing dims).

    In the W4A16 fragment a thread holds rows r and r+8 of every 16-row group, so after this interleave it
    holds the gate (w1) and up (w3) values of the same intermediate column: SwiGLU fuses into the epilogue.
    """
    n = w1.shape[0]
    if w3.shape != w1.shape or n % 8:
        raise ValueError("w1 and w3 must have the same shape with a multiple of 8 rows")
    return torch.stack([w1.view(n // 8, 8, *w1.shape[1:]), w3.view(n // 8, 8, *w3.shape[1:])], dim=1
                       ).reshape(2 * n, *w1.shape[1:])


def pack_nvfp4_w13(w1, s1, w3, s3, scale_2, check_scales: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused gate/up weight of one expert (w1 and w3 share weight_scale_2, as ModelOpt writes them)."""
    return pack_nvfp4(interleave_w13(w1, w3), interleave_w13(s1, s3), scale_2, check_scales)


def stack_packed(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert packs -> one [E, ...] pack (one launch for all experts)."""
    return (torch.cat([b for b, _, _ in items]), torch.cat([s for _, s, _ in items]),
            torch.cat([g for _, _, g in items]))


# ---- emulation of the kernel's decode (tests) ------------------------------------------------------------

def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """uint16 patterns held in int32 -> float32 values of those bf16 numbers."""
    return (bits.to(torch.int32) << 16).view(torch.float32)


def _bf16_mul(a_bits: torch.Tensor, b_bits: torch.Tensor) -> torch.Tensor:
    prod = _bf16_bits_to_float(a_bits) * _bf16_bits_to_float(b_bits)   # exact here (<= 6 significant bits)
    return prod.to(torch.bfloat16).float()


def decode_blob(blob: torch.Tensor, sblob: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """Emulate the kernel's in-register decode: pack -> fp32 [E, N, K] dequantised weights."""
    E, nb, kc = blob.shape[:3]
    w = blob.to(torch.int64) & 0xFFFFFFFF                              # [E, nb, kc, 4, 32, 4]
    outs = [
        (w << 6) & MAG_MASK,
        (w << 3) & MAG_MASK,
        w & MAG_MASK,
        ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000),
    ]
    u = sblob.to(torch.int64).view(E, nb, kc, 4, 8, 4, 2)              # E rb c w g j h
    sbits = (u << 4) + (SCALE_BIAS << 7)                               # bf16 bits of s * 2**119
    sbits = torch.where(u == 0, torch.zeros_like(sbits), sbits)        # kernel: codes of zero blocks are 0
    res = torch.empty(E, nb, 4, 2, 8, kc, 4, 2, 4, 2, dtype=torch.float32, device=blob.device)
    # dims: E rb w h g c j s q e  (row = rb*64 + w*16 + h*8 + g; col = c*64 + j*16 + s*8 + q*2 + e)
    lanes = torch.arange(32, device=blob.device)
    g_of = lanes // 4
    for o in range(4):
        s_half, h = o // 2, o % 2
        val = outs[o].view(E, nb, kc, 4, 32, 4)                        # E rb c w lane j
        sc = sbits[..., h]                                             # E rb c w g j
        sc_l = sc[:, :, :, :, g_of, :]                                 # E rb c w lane j
        for e in range(2):
            half = (val >> (16 * e)) & 0xFFFF
            prod = _bf16_mul(half, sc_l)                               # E rb c w lane j
            prod = prod.view(E, nb, kc, 4, 8, 4, 4)                    # E rb c w g q j
            res[:, :, :, h, :, :, :, s_half, :, e] = prod.permute(0, 1, 3, 4, 2, 6, 5)
    out = res.reshape(E, nb * 64, kc * 64)
    return out * gscale.view(E, 1, 1)


def emulate_gemm(x: torch.Tensor, pack, n: int, *, route_w=None, units=None, unit_count=None, lim: float = 0.0,
                 grouped: bool = False, epilogue: str = "plain", **_config) -> torch.Tensor:
    """Torch model of one kernels/gemm_w4a16 launch (same arguments): fp32 products of the decoded weights,
    the same epilogues and work units. Used by the CPU tests of the MoE glue and as documentation."""
    w = decode_blob(*pack)                                             # [E, N, K] fp32, gscale applied
    rows = x.shape[0]
    lim = lim if lim > 0 else float("inf")
    out = torch.zeros(rows, n // 2 if epilogue == "swiglu" else n, dtype=torch.bfloat16, device=x.device)
    if grouped:
        us = [tuple(int(v) for v in units[u]) for u in range(int(unit_count[0]))]
    else:
        us = [(0, 0, rows)]
    for e, r0, c in us:
        acc = x[r0:r0 + c].double() @ w[e].double().T                 # [c, n]
        if epilogue == "plain":
            out[r0:r0 + c] = acc.to(torch.bfloat16)
        else:
            a = acc.view(c, n // 16, 2, 8)
            g = a[:, :, 0].reshape(c, n // 2).to(torch.bfloat16).double()
            u = a[:, :, 1].reshape(c, n // 2).to(torch.bfloat16).double()
            h = torch.nn.functional.silu(g.clamp(max=lim)) * u.clamp(-lim, lim) * route_w[r0:r0 + c, None].double()
            out[r0:r0 + c] = h.to(torch.bfloat16)
    return out
