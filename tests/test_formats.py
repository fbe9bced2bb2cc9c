"""Exact weight formats: hand-computed values, error bounds, the lossless MXFP4 -> NVFP4 cast."""
import math

import pytest
import torch

from dsv4debug.formats import (
    E2M1_VALUES,
    E4M3,
    E8M0,
    QWeight,
    dequantize_all,
    e2m1_encode,
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp4_to_nvfp4,
    nvfp4_dequantize,
    nvfp4_quantize,
    pack_nibbles,
    unpack_nibbles,
)


def e8m0(*bytes_: int) -> torch.Tensor:
    return torch.tensor(bytes_, dtype=torch.uint8).view(E8M0)


def e4m3(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(E4M3)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---- E2M1 codes and nibble packing ---------------------------------------------------------------------------

def test_every_e2m1_code_decodes_to_the_table_with_its_sign():
    codes = torch.cat([torch.arange(16), torch.zeros(16, dtype=torch.int64)]).to(torch.uint8)  # one 32-block
    packed = pack_nibbles(codes[None]).view(torch.int8)                                         # [1, 16]
    values = mxfp4_dequantize(packed, e8m0(127).view(1, 1))[0, :16]                            # scale 2^0
    assert values.tolist() == list(E2M1_VALUES)
    assert torch.signbit(values[8]) and not torch.signbit(values[0])     # code 8 is -0


def test_low_nibble_is_the_even_element():
    packed = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)         # element 0: code 1, element 1: code 2
    values = mxfp4_dequantize(packed.view(torch.int8), e8m0(127).view(1, 1))
    assert values[0, :3].tolist() == [0.5, 1.0, 0.0]


def test_pack_unpack_round_trip_all_bytes():
    packed = torch.arange(256, dtype=torch.uint8)[None]
    assert torch.equal(pack_nibbles(unpack_nibbles(packed)), packed)
    assert torch.equal(unpack_nibbles(packed.view(torch.int8)), unpack_nibbles(packed))


@pytest.mark.parametrize("x, value", [
    (0.0, 0.0), (0.25, 0.0), (0.26, 0.5), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (2.6, 3.0),
    (3.5, 4.0), (5.0, 4.0), (5.1, 6.0), (6.0, 6.0), (100.0, 6.0), (-0.75, -1.0), (-5.0, -4.0), (-7.0, -6.0),
])
def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates(x, value):
    code = e2m1_encode(torch.tensor([x]))
    assert E2M1_VALUES[int(code)] == value


# ---- FP8 blocks ------------------------------------------------------------------------------------------------

def test_fp8_dequantize_e8m0_extremes():
    w = e4m3([[1.0, -448.0, 2.0 ** -9]]).expand(128, 3).contiguous()      # 2^-9: smallest e4m3 subnormal
    for byte, factor in [(0, 2.0 ** -127), (127, 1.0), (254, 2.0 ** 127), (130, 8.0)]:
        got = fp8_block_dequantize(w, e8m0(byte).view(1, 1))
        want = torch.tensor([1.0, -448.0, 2.0 ** -9], dtype=torch.float64) * factor
        assert got[5].tolist() == want.float().tolist(), byte
    assert torch.isnan(fp8_block_dequantize(w, e8m0(255).view(1, 1))).all()


def test_fp8_scales_per_block_with_partial_edge_blocks():
    w = torch.zeros(130, 200)                                            # blocks: 2 x 2, the last ones partial
    w[0, 0] = 1.0                  # block (0,0): amax 1 -> s = 2^-8 (448 * 2^-9 = 0.875 < 1 <= 1.75)
    w[129, 199] = 448.0            # block (1,1): amax 448 exactly -> s = 1
    w[128, 0] = -448.5             # block (1,0): just above 448 -> s = 2
    q, s = fp8_block_quantize(w)   # block (0,1): all zero -> smallest scale, 2^-127
    assert q.shape == (130, 200) and q.dtype == E4M3 and s.shape == (2, 2) and s.dtype == E8M0
    assert s.view(torch.uint8).tolist() == [[127 - 8, 0], [128, 127]]
    d = fp8_block_dequantize(q, s)
    assert d[0, 0] == 1.0 and d[129, 199] == 448.0 and d[128, 0] == -448.0   # -224.25 -> e4m3 -224
    assert (d[:128, 128:] == 0).all()


def test_fp8_quantize_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 520, generator=g) * torch.logspace(-6, 3, 300)[:, None]
    q, s = fp8_block_quantize(w)
    d = fp8_block_dequantize(q, s)
    scale = s.float().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :520]
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4; below the normal range an absolute 2^-10 * s
    assert ((d - w).abs() <= w.abs() * 2 ** -4 + scale * 2 ** -10).all()
    assert (w.abs() <= 448 * scale).all()


# ---- MXFP4 ------------------------------------------------------------------------------------------------------

def test_mxfp4_dequantize_hand_computed_with_extreme_scales():
    codes = torch.tensor([3, 11, 1, 9] + [0] * 28, dtype=torch.uint8)    # 1.5, -1.5, 0.5, -0.5
    packed = pack_nibbles(codes)[None].view(torch.int8)
    for byte, factor in [(0, 2.0 ** -127), (127, 1.0), (254, 2.0 ** 127)]:   # float32 holds all of these
        got = mxfp4_dequantize(packed, e8m0(byte).view(1, 1))[0, :4].double()
        assert got.tolist() == [1.5 * factor, -1.5 * factor, 0.5 * factor, -0.5 * factor], byte


def test_mxfp4_quantize_scale_and_error_bound():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-4, 4, 64)[:, None]
    w[3, :32] = 0.0                                                       # an all-zero block
    q, s = mxfp4_quantize(w)
    assert q.dtype == torch.int8 and q.shape == (64, 128) and s.dtype == E8M0 and s.shape == (64, 8)
    d = mxfp4_dequantize(q, s)
    scale = s.float().repeat_interleave(32, 1)
    assert ((d - w).abs() <= w.abs() / 4 + scale / 4).all()
    ratio = w.abs().view(64, 8, 32).amax(-1) / s.float()                  # scale is the smallest that fits 6
    nonzero = ratio > 0
    assert ((ratio[nonzero] > 3) & (ratio[nonzero] <= 6)).all()
    assert (d[3, :32] == 0).all()


def test_mxfp4_exact_values_survive_quantisation():
    w = torch.tensor([[6.0, -4.0, 3.0, 0.5] * 8]) * 2.0 ** -20
    q, s = mxfp4_quantize(w)
    assert s.view(torch.uint8).item() == 127 - 20
    assert torch.equal(mxfp4_dequantize(q, s), w)


# ---- NVFP4 ------------------------------------------------------------------------------------------------------

def test_nvfp4_global_and_block_scales_hand_computed():
    w = torch.zeros(1, 32)
    w[0, 0] = 2688.0                        # tensor amax = 6 * 448 -> scale_2 = 1; block 0 scale 448
    w[0, 16], w[0, 17] = 3.0, -1.5          # block 1: amax 3 -> block scale e4m3(0.5)
    packed, ws, s2 = nvfp4_quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    assert ws.dtype == E4M3 and ws.float().tolist() == [[448.0, 0.5]]
    assert s2.dtype == torch.float32 and s2.shape == () and float(s2) == 1.0
    assert unpack_nibbles(packed)[0, [0, 16, 17]].tolist() == [7, 7, 8 + 5]
    assert torch.equal(nvfp4_dequantize(packed, ws, s2), w)


def test_nvfp4_dequantize_multiplies_block_scale_and_global_scale():
    codes = torch.tensor([7, 9] + [0] * 14, dtype=torch.uint8)            # 6, -0.5
    packed = pack_nibbles(codes)[None]
    got = nvfp4_dequantize(packed, e4m3([[1.5]]), torch.tensor(0.25))
    assert got[0, :2].tolist() == [6 * 1.5 * 0.25, -0.5 * 1.5 * 0.25]


def test_nvfp4_given_scale_2_is_used_and_default_is_amax_over_2688():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 64, generator=g)
    assert float(nvfp4_quantize(w)[2]) == float(w.abs().max() / 2688.0)
    assert float(nvfp4_quantize(w, 0.125)[2]) == 0.125


def test_nvfp4_quantize_error_bound():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g) * torch.logspace(-2, 2, 64)[:, None]
    packed, ws, s2 = nvfp4_quantize(w)
    d = nvfp4_dequantize(packed, ws, s2)
    block_scale = (ws.float() * s2).repeat_interleave(16, 1)
    block_amax = w.abs().view(64, 8, 16).amax(-1).repeat_interleave(16, 1)
    # E2M1 rounding (|w|/4 + bs/4) plus clipping where e4m3 rounded the block scale down (< amax/16)
    assert ((d - w).abs() <= w.abs() / 4 + block_scale / 4 + block_amax / 16).all()


# ---- lossless MXFP4 -> NVFP4 ------------------------------------------------------------------------------------

def _mxfp4_pair(seed: int):
    g = torch.Generator().manual_seed(seed)
    spread = 2.0 ** torch.randint(-8, 9, (64, 4), generator=g).float().repeat_interleave(32, 1)  # 17 binades
    w1 = torch.randn(64, 128, generator=g) * spread
    w3 = torch.randn(64, 128, generator=g) * 0.01
    return (*mxfp4_quantize(w1), *mxfp4_quantize(w3))


def test_mxfp4_to_nvfp4_is_bit_exact():
    q1, s1, q3, s3 = _mxfp4_pair(4)
    nv1, nv3, lossy = mxfp4_to_nvfp4(q1, s1, q3, s3)
    assert lossy == 0
    k_max = max(int(s1.view(torch.uint8).max()), int(s3.view(torch.uint8).max())) - 127
    assert float(nv1[2]) == float(nv3[2]) == math.ldexp(1.0, k_max - 8)
    assert torch.equal(nv1[0], q1.view(torch.uint8)) and torch.equal(nv3[0], q3.view(torch.uint8))
    assert torch.equal(nvfp4_dequantize(*nv1), mxfp4_dequantize(q1, s1))
    assert torch.equal(nvfp4_dequantize(*nv3), mxfp4_dequantize(q3, s3))
    assert nv1[1].shape == (64, 8) and nv1[1].dtype == E4M3


def test_mxfp4_to_nvfp4_falls_back_and_counts_blocks_out_of_e4m3_range():
    w = torch.ones(2, 96)
    w[0, 32:64] = 2.0 ** -20           # 20 binades below the max: no e4m3 power of two relative to scale_2
    w[1, 64:96] = 0.0                  # all-zero block: also out of range, but reproduced exactly
    q, s = mxfp4_quantize(w)
    nv, none, lossy = mxfp4_to_nvfp4(q, s)
    assert none is None
    d = nvfp4_dequantize(*nv)
    assert lossy == 2                  # the two 16-blocks of w[0, 32:64] underflow
    assert torch.equal(d[:, :32], w[:, :32]) and torch.equal(d[1], w[1])


# ---- QWeight -----------------------------------------------------------------------------------------------------

def test_qweight_shapes_bytes_and_dequantize():
    w = torch.randn(256, 128)
    fp8 = QWeight("layers.0.attn.wq_a", "fp8", dict(zip(("weight", "scale"), fp8_block_quantize(w))))
    mx = QWeight("layers.0.ffn.experts.0.w1", "mxfp4", dict(zip(("weight", "scale"), mxfp4_quantize(w))))
    packed, ws, s2 = nvfp4_quantize(w)
    nv = QWeight("x", "nvfp4", {"weight": packed, "weight_scale": ws, "weight_scale_2": s2,
                                "input_scale": torch.tensor(0.01)})
    plain = QWeight("layers.0.attn_norm.weight", "bf16_plain", {"": torch.ones(256, dtype=torch.bfloat16)})
    assert fp8.shape == mx.shape == nv.shape == (256, 128) and plain.shape == (256,)
    assert fp8.nbytes == 256 * 128 + 2 and mx.nbytes == 256 * 64 + 256 * 4
    assert nv.nbytes == 256 * 64 + 256 * 8 + 8 and plain.nbytes == 512
    assert torch.equal(fp8.dequantize(), fp8_block_dequantize(*fp8.tensors.values()))
    assert torch.equal(mx.dequantize(torch.bfloat16, "cpu"), mxfp4_dequantize(*mx.tensors.values()).bfloat16())
    assert torch.equal(nv.dequantize(), nvfp4_dequantize(packed, ws, s2))
    assert plain.dequantize().dtype == torch.float32 and bits_equal(plain.dequantize(torch.bfloat16),
                                                                    plain.tensors[""])


def test_qweight_rows_dequantize_to_the_rows_of_the_whole_and_refuse_split_blocks():
    """QWeight.rows (the reference's row-chunked dense linears) cuts the scales with the weight, per format."""
    w = torch.randn(300, 256)
    packed, ws, s2 = nvfp4_quantize(w)
    weights = [QWeight("a", "fp8", dict(zip(("weight", "scale"), fp8_block_quantize(w)))),
               QWeight("b", "mxfp4", dict(zip(("weight", "scale"), mxfp4_quantize(w)))),
               QWeight("c", "nvfp4", {"weight": packed, "weight_scale": ws, "weight_scale_2": s2}),
               QWeight("d", "bf16", {"weight": w.bfloat16()})]
    for q in weights:
        whole = q.dequantize(torch.float64)
        for a, b in ((0, 128), (128, 256), (256, 300)):
            assert torch.equal(q.rows(a, b).dequantize(torch.float64), whole[a:b]), (q.fmt, a, b)
    with pytest.raises(ValueError, match="128-row blocks"):
        weights[0].rows(64, 192)


def test_reference_linear_in_row_chunks_equals_the_whole(monkeypatch):
    """Above DENSE_CHUNK_BYTES the reference linear dequantises and multiplies 128-row chunks: the same
    product up to fp64 rounding (where a dense copy is 4x bf16's)."""
    from dsv4debug.backends import reference as backend
    w = torch.randn(640, 256)
    q = QWeight("wo_b", "fp8", dict(zip(("weight", "scale"), fp8_block_quantize(w))))
    x = torch.randn(5, 256, dtype=torch.float64)
    be = backend.ReferenceBackend("cpu", torch.float64)
    whole = be.linear(x, q)
    monkeypatch.setattr(backend, "DENSE_CHUNK_BYTES", 256 * 8 * 200)          # 200 rows -> 128-row chunks
    assert backend._dense_rows(q, torch.float64) == 128
    assert (be.linear(x, q) - whole).abs().max() <= 1e-13 * whole.abs().max()    # BLAS blocking: fp64 rounding
    assert backend._dense_rows(q, torch.bfloat16) == 640                      # bf16 copy fits: one piece


def test_reference_grouped_linear_in_group_chunks_equals_the_whole(monkeypatch):
    """Above DENSE_CHUNK_BYTES the reference wo_a dequantises and multiplies a few head groups at a time: each
    group's product is its own, so the result is the whole one's up to fp64 rounding."""
    from dsv4debug.backends import reference as backend
    groups, rank, width = 4, 128, 96                                       # w [G*R, H*d/G]
    w = torch.randn(groups * rank, width)
    q = QWeight("wo_a", "fp8", dict(zip(("weight", "scale"), fp8_block_quantize(w))))
    o = torch.randn(5, 8, groups * width // 8, dtype=torch.float64)        # [S, H, d]
    be = backend.ReferenceBackend("cpu", torch.float64)
    whole = be.grouped_linear(o, q, groups=groups)
    assert whole.shape == (5, groups * rank)
    monkeypatch.setattr(backend, "DENSE_CHUNK_BYTES", width * 8 * 300)        # 300 rows -> 256: two groups a chunk
    assert backend._dense_rows(q, torch.float64) == 256
    assert (be.grouped_linear(o, q, groups=groups) - whole).abs().max() <= 1e-13 * whole.abs().max()
    monkeypatch.setattr(backend, "DENSE_CHUNK_BYTES", width * 8 * 100)        # under a group: one group a chunk
    assert (be.grouped_linear(o, q, groups=groups) - whole).abs().max() <= 1e-13 * whole.abs().max()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_fused_dequantize_is_bit_identical_to_eager(device):
    """The torch.compile'd dequantisation (the GPU path of every backend) gives the eager values in every
    block format and target dtype, NaN scales included."""
    from dsv4debug.config import preset
    from dsv4debug.schema import block_modules
    from dsv4debug.synth import synth_module
    for fmt in ("mxfp4", "nvfp4", "fp8"):
        cfg = preset("tiny", expert_format=fmt)
        specs = [s for s in block_modules(cfg, 1) if s.fmt in ("fp8", "mxfp4", "nvfp4")][:12]
        for spec in specs:
            w = synth_module(cfg, spec, 1)
            for dtype in (torch.bfloat16, torch.float32, torch.float64):
                a, b = w.dequantize(dtype, device), w.dequantize(dtype, device, fused=True)
                assert a.dtype == b.dtype == dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                                   b.view(-1).view(torch.uint8)), (spec.name, dtype)
        # several weights at once (an expert's three): one graph per format, the same values, in order
        ws = [synth_module(cfg, spec, 1) for spec in specs[:5]]
        together = dequantize_all(ws, torch.bfloat16, device, fused=True)
        assert [bits_equal(t, w.dequantize(torch.bfloat16, device)) for t, w in zip(together, ws)] == [True] * 5
    w = synth_module(preset("tiny"), next(s for s in block_modules(preset("tiny"), 1) if s.fmt == "fp8"), 1)
    w.tensors["scale"].view(torch.uint8)[0, 0] = 255                   # e8m0 NaN
    a, b = w.dequantize(device=device), w.dequantize(device=device, fused=True)
    assert a[:128, :128].isnan().all() and b.isnan().sum() == a.isnan().sum()
    assert torch.equal(a.nan_to_num(), b.nan_to_num())
