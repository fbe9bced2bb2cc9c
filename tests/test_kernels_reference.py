"""CPU tests of the kernels' bit-level torch references and of the integer math the kernels use."""
import dsv4_references as ref
import pytest
import torch

from dsv4debug.backends.sim import nvfp4_act_quant

nvfp4 = pytest.importorskip("dsv4_kernels.nvfp4", reason="CuTeDSL is not installed")
kv_cache = pytest.importorskip("dsv4_kernels.kv_cache", reason="CuTeDSL is not installed")


def _act(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
    x[0, :32] = 0.0
    x[1, :16] = -0.0
    x[2, 3] = 1e4
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("seed", range(3))
def test_nvfp4_reference_matches_sim_bit_for_bit(seed):
    x = _act((64, 512), seed)
    codes, scales, g = nvfp4.reference_quantize(x)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 256)
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == (64, 32)
    v = nvfp4.reference_dequantize(codes, scales, g)
    want = nvfp4_act_quant(x)
    assert torch.equal(v.view(torch.int16), want.view(torch.int16))       # signed zeros included


def test_nvfp4_codes_layout():
    # one block [0.5, -6, 0, 1.5, ...]: low nibble = even element, sign in bit 3
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([0.5, -6.0, 0.0, 1.5])
    codes, scales, g = nvfp4.reference_quantize(x.to(torch.bfloat16))
    assert codes[0, 0].item() == 0x1 | (0xF << 4)          # 0.5 -> 1, -6 -> 8 | 7
    assert codes[0, 1].item() == 0x0 | (0x3 << 4)          # 0 -> 0, 1.5 -> 3
    assert scales[0, 0].float().item() * g.item() == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(3))
def test_kv_layout_reference_matches_kv_qat(seed):
    kv = _act((300, 512), seed)
    kv[5, 64:128] *= 1e4
    packed = kv_cache.reference_pack(kv)
    assert packed.shape == (300, 584) and kv_cache.token_bytes() == 584
    assert torch.equal(packed[:, 583], torch.zeros(300, dtype=torch.uint8))
    assert torch.equal(packed[:, 448:576].contiguous().view(torch.bfloat16), kv[:, 448:])
    out = kv_cache.reference_unpack(packed)
    assert torch.equal(out.view(torch.int16), ref.kv_qat(kv, 64).view(torch.int16))


def test_kv_scale_exponent_from_bits_equals_ceil_log2_for_every_bf16_amax():
    """The kernel takes k = exponent(amax/448) + (mantissa != 0); the reference ceil(log2(amax/448)).
    Equal for every finite positive bf16 amax (and the 1e-4 clamp), on the CPU and with CUDA's x * (1/448)."""
    a = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().clamp(min=1e-4)
    t = a / 448.0
    bits = t.view(torch.int32)
    k_bits = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).int()
    assert torch.equal(k_bits, torch.ceil(torch.log2(t)).int())
    assert torch.equal(k_bits, torch.ceil(torch.log2(a * torch.tensor(1 / 448.0))).int())


def test_e2m1_thresholds_match_reference_rounding():
    """The reference quantiser's E2M1 code = number of thresholds passed; check against e2m1_round on a dense
    grid."""
    a = torch.linspace(0, 7, 70001)
    a = torch.cat([a, torch.tensor([t for t, _ in nvfp4.E2M1_THRESHOLDS])])
    code = sum(((a >= t) if inclusive else (a > t)).int() for t, inclusive in nvfp4.E2M1_THRESHOLDS)
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(lut[code], ref.e2m1_round(a))


def test_e2m1_code_arithmetic_is_the_threshold_count():
    """nvfp4.e2m1_code (the quantise kernel's arithmetic, restated in numpy: the kernel runs only on a GPU)
    gives the reference's threshold count of |q| for every fp32 of [1/8, 8), where all 7 thresholds and their
    ties lie, both signs, for larger values and +-inf, and saturates NaN (an overflowed quotient); breaking
    the 2-bit rounding's ties, the 1.0 seam or the saturation fails here."""
    import numpy as np
    f32 = np.float32
    mags = np.concatenate([np.arange(0x3E000000, 0x41000000, dtype=np.uint32).view(f32),
                           f32([0.0, 1e-30, 0.1, 8.0, 255.9, 1e20, 3e38, np.inf])])
    q = np.concatenate([mags, -mags, f32([np.nan])])
    c = np.minimum(np.abs(q), f32(6))                        # numpy's minimum propagates NaN, PTX min does not
    c = np.where(np.isnan(c), f32(6), c)
    h = np.maximum(c, f32(1))
    g = h * f32(nvfp4.E2M1_SPLIT)
    h = g - (g - h)
    low = np.minimum(c, f32(1)) * f32(2) + f32(nvfp4.ROUND_MAGIC)  # exact product: as the kernel's fma
    code = ((h.view(np.uint32) >> 22).astype(np.int64) - 254 + low.view(np.uint32).astype(np.int64)
            - 0x4B400000)
    a = np.abs(q)
    with np.errstate(invalid="ignore"):
        want = sum(((a >= t) if inclusive else (a > t)).astype(np.int64) for t, inclusive in nvfp4.E2M1_THRESHOLDS)
    want[np.isnan(q)] = 7
    assert np.array_equal(code, want)
