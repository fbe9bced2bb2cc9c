"""FP8 paged KV cache in the serving layout (dsv4_references.attention.kv_qat is the numerics).

Per token, 584 bytes (for the 448 non-rope + 64 rope dims of DeepSeek-V4's 512-wide latent):

    [0, 448)    448 e4m3 codes of the non-rope dims, x / 2^k per block of 64 (clamped to +-448, RNE)
    [448, 576)  the 64 rope dims in bf16, unchanged
    [576, 583)  7 ue8m0 scale bytes (k + 127): 2^k is the smallest power of two with amax_block / 2^k <= 448
                (amax clamped below at 1e-4), exactly quant.fp8_sim's pow2_scale
    583         pad (0)

The cache is [num_blocks, block_size, 584] uint8; `slot_mapping[i]` = block * block_size + offset is where
token i is written (negative: skipped, as in vLLM); a sequence is read back through its row of the block
table. k is computed exactly from the fp32 bits of amax / 448 (exponent, plus one unless the mantissa is 0):
for bf16 inputs this equals the reference's ceil(log2(.)) on CPU and on CUDA (amax / 448 is either an exact
power of two or at least 1/112 away from one).

Kernels: `kv_write` (quantise + scatter by slot mapping; 64 threads a token: 56 quantise 8 dims each with an
8-lane shuffle amax per 64-block, 8 copy the rope dims) and `kv_read` (gather by block table + dequantise to
bf16, same thread map). The cache is only 8-byte aligned per token (584 = 8 * 73): cache accesses are 64-bit.
"""
from __future__ import annotations

import cutlass
from cutlass import BFloat16, Float32, Int32, Int64, Uint8, cute

from ._common import (
    BOTH,
    KernelDef,
    bits_f32,
    check_numel,
    compile_kernel,
    current_stream,
    device_arch,
    f32_bits,
    fake_ptr,
    fake_stream,
    group_max_int,
    ptr,
    register,
)

FP8_MAX = 448.0
QBLOCK = 64


def token_bytes(nope: int = 448, rope: int = 64) -> int:
    raw = nope + 2 * rope + nope // QBLOCK
    return (raw + 7) // 8 * 8


class _Geometry:
    def __init__(self, nope: int, rope: int):
        if nope % QBLOCK or rope % 8:
            raise ValueError(f"kv cache: nope={nope} must be a multiple of {QBLOCK}, rope={rope} of 8")
        self.nope, self.rope = nope, rope
        self.d = nope + rope
        self.tb = token_bytes(nope, rope)
        self.tpt = self.d // 8                      # threads per token, 8 dims each
        self.nope_threads = nope // 8
        self.nblk = nope // QBLOCK
        self.threads = 256
        if self.threads % self.tpt:
            raise ValueError(f"kv cache: {self.tpt} threads a token must divide {self.threads}")
        self.tokens_per_cta = self.threads // self.tpt

    def views(self, f8_ptr, r_ptr, s_ptr, p_ptr, nslots):
        """fp8 codes [8, nope/8, slot], rope bf16 [4, 2, rope/8, slot], scales u8 [nblk, slot], pad u8 [slot]."""
        mF = cute.make_tensor(f8_ptr, cute.make_layout((8, self.nope_threads, nslots), stride=(1, 8, self.tb)))
        mR = cute.make_tensor(r_ptr, cute.make_layout((4, 2, self.rope // 8, nslots),
                                                      stride=(1, 4, 8, self.tb // 2)))
        mS = cute.make_tensor(s_ptr, cute.make_layout((self.nblk, nslots), stride=(1, self.tb)))
        mP = cute.make_tensor(p_ptr, cute.make_layout((nslots,), stride=(self.tb,)))
        return mF, mR, mS, mP


class KVWrite(_Geometry):
    """kv bf16 [S, d], slot_mapping int64 [S] -> cache bytes at each token's slot."""

    @cute.jit
    def __call__(self, kv_ptr: cute.Pointer, slot_ptr: cute.Pointer, f8_ptr: cute.Pointer, r_ptr: cute.Pointer,
                 s_ptr: cute.Pointer, p_ptr: cute.Pointer, S: Int32, nslots: Int32, stream):
        mKV = cute.make_tensor(kv_ptr, cute.make_layout((8, self.tpt, S), stride=(1, 8, self.d)))
        mSlot = cute.make_tensor(slot_ptr, cute.make_layout((S,)))
        mF, mR, mS, mP = self.views(f8_ptr, r_ptr, s_ptr, p_ptr, nslots)
        self.kernel(mKV, mSlot, mF, mR, mS, mP, S).launch(
            grid=[cute.ceil_div(S, self.tokens_per_cta), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mKV: cute.Tensor, mSlot: cute.Tensor, mF: cute.Tensor, mR: cute.Tensor, mS: cute.Tensor,
               mP: cute.Tensor, S: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        tok = bidx * self.tokens_per_cta + tidx // self.tpt
        t = tidx % self.tpt
        tok_c = cutlass.min(tok, S - 1)
        rX = cute.make_rmem_tensor((8,), BFloat16)
        cute.autovec_copy(mKV[None, t, tok_c], rX)
        slot = Int64(mSlot[tok_c])
        ok = tok < S and slot >= 0
        rW = cute.recast_tensor(rX, Int32)
        mb = Int32(0)
        for j in cutlass.range_constexpr(4):
            w = rW[j]
            mb = cutlass.max(mb, cutlass.max(w & 0x7FFF, (w >> 16) & 0x7FFF))
        mb = group_max_int(mb, 8)                           # the 8 threads of one 64-dim block
        if t < self.nope_threads:
            amax = cute.arch.fmax(bits_f32(mb << 16), Float32(1e-4))
            q = f32_bits(amax / Float32(FP8_MAX))
            k = ((q >> 23) & 0xFF) - 127 + cutlass.select_((q & 0x7FFFFF) != 0, Int32(1), Int32(0))
            inv = bits_f32((127 - k) << 23)                 # 2^-k, exact
            x = rX.load().to(Float32) * inv
            x = cute.where(x > Float32(FP8_MAX), cute.full_like(x, FP8_MAX), x)
            x = cute.where(x < Float32(-FP8_MAX), cute.full_like(x, -FP8_MAX), x)
            rQ = cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN)
            rQ.store(x.to(cutlass.Float8E4M3FN))
            if ok:
                cute.autovec_copy(rQ, mF[None, t, slot])
                if t % 8 == 0:
                    mS[t // 8, slot] = Uint8(k + 127)
        else:
            if ok:
                j = t - self.nope_threads
                cute.autovec_copy(rX, mR[None, None, j, slot])
                if j == 0:
                    mP[slot] = Uint8(0)


class KVRead(_Geometry):
    """cache + block_table int32 [B, maxb] + seq_lens int32 [B] + out_start int32 [B] -> kv bf16 [T, d]."""

    def __init__(self, nope: int, rope: int, block_size: int):
        super().__init__(nope, rope)
        self.block_size = block_size

    @cute.jit
    def __call__(self, f8_ptr: cute.Pointer, r_ptr: cute.Pointer, s_ptr: cute.Pointer, p_ptr: cute.Pointer,
                 bt_ptr: cute.Pointer, len_ptr: cute.Pointer, start_ptr: cute.Pointer, o_ptr: cute.Pointer,
                 nslots: Int32, B: Int32, maxb: Int32, T: Int32, max_len: Int32, stream):
        mF, mR, mS, _mP = self.views(f8_ptr, r_ptr, s_ptr, p_ptr, nslots)
        mBT = cute.make_tensor(bt_ptr, cute.make_layout((maxb, B), stride=(1, maxb)))
        mLen = cute.make_tensor(len_ptr, cute.make_layout((B,)))
        mStart = cute.make_tensor(start_ptr, cute.make_layout((B,)))
        mO = cute.make_tensor(o_ptr, cute.make_layout((8, self.tpt, T), stride=(1, 8, self.d)))
        self.kernel(mF, mR, mS, mBT, mLen, mStart, mO).launch(
            grid=[cute.ceil_div(max_len, self.tokens_per_cta), B, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mF: cute.Tensor, mR: cute.Tensor, mS: cute.Tensor, mBT: cute.Tensor, mLen: cute.Tensor,
               mStart: cute.Tensor, mO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, seq, _ = cute.arch.block_idx()
        pos = bidx * self.tokens_per_cta + tidx // self.tpt
        t = tidx % self.tpt
        if pos < mLen[seq]:
            slot = Int64(mBT[pos // self.block_size, seq]) * self.block_size + pos % self.block_size
            row = mStart[seq] + pos
            rO = cute.make_rmem_tensor((8,), BFloat16)
            if t < self.nope_threads:
                rQ = cute.make_rmem_tensor((8,), cutlass.Float8E4M3FN)
                cute.autovec_copy(mF[None, t, slot], rQ)
                s = bits_f32((Int32(mS[t // 8, slot]) & 0xFF) << 23)        # 2^k from the ue8m0 byte
                rO.store((rQ.load().to(Float32) * s).to(BFloat16))
            else:
                cute.autovec_copy(mR[None, None, t - self.nope_threads, slot], rO)
            cute.autovec_copy(rO, mO[None, t, row])


def _pointers(cache, nope: int, rope: int, fake: bool = False):
    """Typed pointers into the cache: fp8 codes, rope (bf16), scales, pad."""
    if fake:
        return (fake_ptr(cutlass.Float8E4M3FN, 8), fake_ptr(BFloat16, 8), fake_ptr(Uint8, 1), fake_ptr(Uint8, 1))
    base = cache.data_ptr()
    if base % 8:
        raise ValueError("kv cache must be 8-byte aligned")
    from cutlass.cute.runtime import make_ptr
    g = cute.AddressSpace.gmem
    tb = token_bytes(nope, rope)
    return (make_ptr(cutlass.Float8E4M3FN, base, g, assumed_align=8),
            make_ptr(BFloat16, base + nope, g, assumed_align=8),
            make_ptr(Uint8, base + nope + 2 * rope, g, assumed_align=1),
            make_ptr(Uint8, base + tb - 1, g, assumed_align=1))


def _build_write(nope: int = 448, rope: int = 64):
    return KVWrite(nope, rope), (fake_ptr(BFloat16), fake_ptr(Int64, 8), *_pointers(None, nope, rope, True),
                                 Int32(1), Int32(1), fake_stream())


def _build_read(nope: int = 448, rope: int = 64, block_size: int = 64):
    return KVRead(nope, rope, block_size), (*_pointers(None, nope, rope, True), fake_ptr(Int32, 4),
                                            fake_ptr(Int32, 4), fake_ptr(Int32, 4), fake_ptr(BFloat16),
                                            Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), fake_stream())


register(KernelDef("kv_write", "kv_cache", BOTH, _build_write, configs=({"nope": 448, "rope": 64},),
                   doc="FP8 KV quantise (pow2 scale per 64) + rope bf16 + ue8m0 scales, scatter by slot mapping"))
register(KernelDef("kv_read", "kv_cache", BOTH, _build_read, configs=({"nope": 448, "rope": 64, "block_size": 64},),
                   doc="paged FP8 KV gather by block table + dequantise to bf16"))


# --------------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------------

def new_cache(num_blocks: int, block_size: int, nope: int = 448, rope: int = 64, device="cuda"):
    import torch
    return torch.zeros(num_blocks, block_size, token_bytes(nope, rope), dtype=torch.uint8, device=device)


def write(kv, slot_mapping, cache, rope: int = 64):
    """Quantise kv [S, d] bf16 and write token i at flat slot slot_mapping[i] of cache [nb, bs, 584]."""
    import torch
    kv = kv.contiguous()
    if kv.dtype != torch.bfloat16 or kv.dim() != 2:
        raise ValueError("kv_write takes kv [S, d] bf16")
    nope = kv.size(1) - rope
    if cache.dtype != torch.uint8 or cache.size(-1) != token_bytes(nope, rope):
        raise ValueError(f"cache must be uint8 [..., {token_bytes(nope, rope)}]")
    S = kv.size(0)
    nslots = cache.numel() // cache.size(-1)
    check_numel(kv)
    if S == 0:
        return cache
    slots = slot_mapping.to(device=kv.device, dtype=torch.int64).contiguous()
    fn = compile_kernel("kv_write", device_arch(kv.device), nope=nope, rope=rope)
    fn(ptr(kv), ptr(slots, Int64, 8), *_pointers(cache, nope, rope), Int32(S), Int32(nslots), current_stream())
    return cache


def read_into(cache, block_table, seq_lens, starts, out, max_len: int, rope: int = 64):
    """Gather + dequantise into out [T, d] bf16 with device tensors only (no host sync; CUDA-graph safe):
    block_table [B, maxb] int32, seq_lens [B] int32, starts [B] int32 (first output row of each sequence)."""
    nb, bs, tb = cache.shape
    nope = _nope_of(tb, rope)
    B, maxb = block_table.shape
    check_numel(out)
    if out.numel() == 0 or max_len == 0:
        return out
    fn = compile_kernel("kv_read", device_arch(cache.device), nope=nope, rope=rope, block_size=bs)
    fn(*_pointers(cache, nope, rope), ptr(block_table, Int32, 4), ptr(seq_lens, Int32, 4), ptr(starts, Int32, 4),
       ptr(out), Int32(nb * bs), Int32(B), Int32(maxb), Int32(out.size(0)), Int32(max_len), current_stream())
    return out


def _nope_of(tb: int, rope: int) -> int:
    for n in range(64, tb, 64):
        if token_bytes(n, rope) == tb:
            return n
    raise ValueError(f"cache token size {tb} matches no nope width with rope={rope}")


def read(cache, block_table, seq_lens, rope: int = 64):
    """Gather + dequantise: block_table [B, maxb], seq_lens (host list or tensor) -> kv bf16
    [sum(seq_lens), d], the sequences one after the other, positions 0..len-1 each."""
    import torch
    lens_host = [int(v) for v in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
    d = _nope_of(cache.size(-1), rope) + rope
    dev = cache.device
    bt = block_table.to(device=dev, dtype=torch.int32).contiguous()
    lens = torch.tensor(lens_host, dtype=torch.int32, device=dev)
    starts = torch.tensor([sum(lens_host[:i]) for i in range(len(lens_host))], dtype=torch.int32, device=dev)
    out = torch.empty(sum(lens_host), d, dtype=torch.bfloat16, device=dev)
    return read_into(cache, bt, lens, starts, out, max(lens_host, default=0), rope)


def dequantize_slots(cache, out, rope: int = 64):
    """Every slot of a cache [..., tb] (flat slot order, whatever its paging) dequantised into out [slots, d]
    bf16: kv_read over the identity block table."""
    import torch
    tb = cache.size(-1)
    slots = cache.numel() // tb
    if out.shape != (slots, _nope_of(tb, rope) + rope) or out.dtype != torch.bfloat16:
        raise ValueError(f"dequantize_slots: out must be [{slots}, {_nope_of(tb, rope) + rope}] bf16")
    bs = cache.size(-2) if cache.dim() >= 3 else (64 if slots % 64 == 0 else 1)
    dev = cache.device
    bt = torch.arange(slots // bs, dtype=torch.int32, device=dev)[None]
    lens = torch.full((1,), slots, dtype=torch.int32, device=dev)
    return read_into(cache.reshape(-1, bs, tb), bt, lens, torch.zeros_like(lens), out, slots, rope)


def round_trip(kv, rope: int = 64, block_size: int = 64, generator=None):
    """The serving round trip for one sequence: quantise -> paged write (blocks in shuffled order) -> paged
    read by block table -> dequantise. Returns (kv', cache, block_table)."""
    import torch
    S = kv.size(0)
    nblocks = max(1, -(-S // block_size))
    cache = new_cache(nblocks + 1, block_size, kv.size(1) - rope, rope, kv.device)
    perm = torch.randperm(nblocks + 1, generator=generator)[:nblocks].to(kv.device)
    block_table = perm.to(torch.int32).unsqueeze(0)
    pos = torch.arange(S, device=kv.device)
    slots = perm[pos // block_size].to(torch.int64) * block_size + pos % block_size
    write(kv, slots, cache, rope)
    out = read(cache, block_table, [S], rope)
    return out, cache, block_table


# --------------------------------------------------------------------------------------------------------
# Bit-level torch reference of the layout
# --------------------------------------------------------------------------------------------------------

def reference_pack(kv, rope: int = 64):
    """kv [S, d] bf16 -> uint8 [S, token_bytes] in the serving layout (pure torch, any device)."""
    import torch
    S, d = kv.shape
    nope = d - rope
    xb = kv[:, :nope].float().unflatten(-1, (-1, QBLOCK))
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    k = torch.ceil(torch.log2(amax / FP8_MAX))                            # as quant.pow2_scale
    q = (xb / torch.exp2(k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.zeros(S, token_bytes(nope, rope), dtype=torch.uint8, device=kv.device)
    out[:, :nope] = q.flatten(-2).view(torch.uint8)
    out[:, nope:nope + 2 * rope] = kv[:, nope:].contiguous().view(torch.uint8)
    out[:, nope + 2 * rope:nope + 2 * rope + nope // QBLOCK] = (k.squeeze(-1) + 127).to(torch.uint8)
    return out


def reference_unpack(packed, rope: int = 64):
    """uint8 [S, token_bytes] -> kv bf16 [S, d] (exactly kv_qat's values for packed = reference_pack(kv))."""
    import torch
    nope = _nope_of(packed.size(-1), rope)
    q = packed[:, :nope].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, QBLOCK))
    k = packed[:, nope + 2 * rope:nope + 2 * rope + nope // QBLOCK].float() - 127
    nope_vals = (q * torch.exp2(k).unsqueeze(-1)).flatten(-2).to(torch.bfloat16)
    rope_vals = packed[:, nope:nope + 2 * rope].contiguous().view(torch.bfloat16)
    return torch.cat([nope_vals, rope_vals], -1)
