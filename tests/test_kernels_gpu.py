"""GPU tests of the CuTeDSL kernels against their references/ ops at small shapes (skipped without CUDA)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    pytest.importorskip("cutlass", reason="CuTeDSL is not installed")


@pytest.fixture(scope="module")
def tiny_check():
    from dsv4_kernels.check import run_checks
    return run_checks("tiny", seq=200, do_bench=False, log=lambda s: None)


def test_every_kernel_passes_its_bar_at_tiny_shapes(tiny_check):
    failed = [r for r in tiny_check["rows"] if not r["passed"]]
    assert not failed, failed
    ops = {r["op"] for r in tiny_check["rows"]}
    assert ops == {"rms_norm", "head_rms_norm", "rope", "nvfp4", "kv_cache", "hc_pre", "hc_post", "hc_head"}


@pytest.mark.parametrize("S", [1, 3, 65, 257])
def test_odd_token_counts(S):
    """Partial CTAs: rows past the end are neither read out of bounds into the result nor written."""
    import dsv4_references as ref
    from dsv4_kernels import kv_cache, mhc, norm, rope
    g = torch.Generator(device="cuda").manual_seed(S)
    x = torch.randn(S, 1536, device="cuda", generator=g).bfloat16()
    w = torch.rand(1536, device="cuda", generator=g) + 0.5
    y = norm.rms_norm(x, w, 1e-6)
    assert (y.float() - ref.rms_norm(x.float(), w, 1e-6)).abs().max() <= 2 ** -6
    q = torch.randn(S, 4, 512, device="cuda", generator=g).bfloat16()
    f = ref.rope_freqs(S, 64, 10000.0).cuda()
    assert torch.equal(rope.rope(q, f), ref.apply_rope(q, f)) or \
        (rope.rope(q, f).float() - ref.apply_rope(q.float(), f)).abs().max() <= 2 ** -6
    kv = torch.randn(S, 512, device="cuda", generator=g).bfloat16()
    out, _, _ = kv_cache.round_trip(kv)
    assert torch.equal(out.view(torch.int16), ref.kv_qat(kv, 64).view(torch.int16))
    h = torch.randn(S, 4, 256, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 1024, device="cuda", generator=g) / 32
    sc, base = torch.ones(3, device="cuda"), torch.zeros(24, device="cuda")
    yk, _pk, ck = mhc.hc_pre(h, fn, sc, base, 20, 1e-6, 1e-6)
    yr, _pr, cr = ref.hc_pre(h.float(), fn, sc, base, 20, 1e-6, 1e-6)
    assert (yk.float() - yr).abs().max() <= 2 ** -6 and (ck - cr).abs().max() < 1e-4


@pytest.mark.parametrize("K, nmix", [(1024, 24), (1024, 4), (4 * 4096, 24), (4 * 7168, 4)])
@pytest.mark.parametrize("S", [1, 37, 300])
def test_hc_mix_parts_agree_with_fp32_reference(K, nmix, S):
    """hc_mix on tensor cores (fn as bf16 hi + lo) at every K split it can take, partial CTAs and warps
    included: within 1e-4 of the fp32 reference's mixes, no NaN, and the same bits on a second launch (the
    parts are summed in a fixed order)."""
    from dsv4_kernels import mhc
    from dsv4_references.mhc import _mixes
    g = torch.Generator(device="cuda").manual_seed(K + nmix + S)
    x = torch.randn(S, 4, K // 4, device="cuda", generator=g).bfloat16()
    fn = torch.randn(nmix, K, device="cuda", generator=g) / K ** 0.5
    want = _mixes(x.float(), fn, 1e-6)
    chunks = K // mhc.CHUNK
    for parts in [p for p in (1, 2, 8, 32) if chunks % p == 0]:
        got = mhc.hc_mixes(x, fn, 1e-6, parts=parts)
        err = (got - want).abs().max().item()
        assert not got.isnan().any() and err <= 1e-4, (parts, err)
        assert torch.equal(got, mhc.hc_mixes(x, fn, 1e-6, parts=parts)), parts


@pytest.mark.parametrize("D", [256, 4096])
@pytest.mark.parametrize("S", [1, 17, 300, 2100])
def test_hc_fused_agrees_with_the_reference_and_the_two_kernels(D, S):
    """hc_fused (one pass, parts waiting for each other's mixes) against the fp32 reference: y within bf16
    rounding, post and comb within 1e-4, no NaN, the same bits on a second launch (parts summed in order), hc_head
    too; its counters are left zero; and the two-kernel path agrees to the same tolerance. S = 2100 gives a slot
    several tiles (the pipelined apply and buffer reuse)."""
    import dsv4_references as ref
    from dsv4_kernels import mhc
    g = torch.Generator(device="cuda").manual_seed(D + S)
    x = torch.randn(S, 4, D, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 4 * D, device="cuda", generator=g) / (4 * D) ** 0.5
    sc = 1 + 0.05 * torch.randn(3, device="cuda", generator=g)
    base = 0.01 * torch.randn(24, device="cuda", generator=g)
    base[8:] += 3 * torch.eye(4, device="cuda").flatten()
    yr, pr, cr = ref.hc_pre(x.float(), fn, sc, base, 20, 1e-6, 1e-6)
    bound = yr.abs() * 2 ** -8 + 1e-5
    for fused in (True, False):
        y, p, c = mhc.hc_pre(x, fn, sc, base, 20, 1e-6, 1e-6, fused=fused)
        assert not (y.isnan().any() or p.isnan().any() or c.isnan().any()), fused
        assert ((y.float() - yr).abs() <= bound).all(), (fused, (y.float() - yr).abs().max())
        assert (p - pr).abs().max() < 1e-4 and (c - cr).abs().max() < 1e-4, fused
    y2, p2, c2 = mhc.hc_pre(x, fn, sc, base, 20, 1e-6, 1e-6, fused=True)
    y, p, c = mhc.hc_pre(x, fn, sc, base, 20, 1e-6, 1e-6, fused=True)
    assert torch.equal(y, y2) and torch.equal(p, p2) and torch.equal(c, c2)
    hfn, hsc, hbase = fn[:4], sc[:1], base[:4]
    hr = ref.hc_head(x.float(), hfn, hsc, hbase, 1e-6, 1e-6)
    for fused in (True, False):
        h = mhc.hc_head(x, hfn, hsc, hbase, 1e-6, 1e-6, fused=fused)
        assert ((h.float() - hr).abs() <= hr.abs() * 2 ** -8 + 1e-5).all(), fused
    for kind in ("hc_fused_counters", "hc_fused_flags"):          # every launch leaves them zero
        assert not mhc.scratch(kind, x.device, -(-S // mhc.FUSED_TOKENS), torch.int32).any(), kind


@pytest.mark.parametrize("tuning", [{"part_d": 256, "bufs": 3, "lag": 1, "lead": 0}, {"part_d": 64, "bufs": 6, "lag": 2},
                                    {"part_d": 128, "bufs": 9, "lag": 8, "lead": 7}])
def test_hc_fused_tunings_agree_with_the_reference(tuning):
    """hc_fused at other part widths, buffer counts, lags and leads (the pipeline's bookkeeping: which buffer a
    tile lives in, how far loads run ahead, lag = bufs - 1 with a single tile in flight, the owner publishing in
    the step of its mixes or just before the parts read) within the reference's tolerance, flags and counters
    left zero."""
    import dsv4_references as ref
    from dsv4_kernels import mhc
    S, D = 1500, 4096
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(S, 4, D, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 4 * D, device="cuda", generator=g) / (4 * D) ** 0.5
    sc = 1 + 0.05 * torch.randn(3, device="cuda", generator=g)
    base = 0.01 * torch.randn(24, device="cuda", generator=g)
    yr, pr, cr = ref.hc_pre(x.float(), fn, sc, base, 20, 1e-6, 1e-6)
    y, p, c = mhc.hc_fused(x, fn, sc, base, 20, 1e-6, 1e-6, tuning=tuning)
    assert ((y.float() - yr).abs() <= yr.abs() * 2 ** -8 + 1e-5).all(), (y.float() - yr).abs().max()
    assert (p - pr).abs().max() < 1e-4 and (c - cr).abs().max() < 1e-4
    for kind in ("hc_fused_counters", "hc_fused_flags"):
        assert not mhc.scratch(kind, x.device, -(-S // mhc.FUSED_TOKENS), torch.int32).any(), kind


@pytest.mark.parametrize("block_max", [6.0, 3.0])
def test_nvfp4_codes_of_every_bf16_magnitude(block_max):
    """Every bf16 magnitude up to the block's max, both signs, in blocks whose scale is exactly 1 (max 6) or 1/2
    (max 3) with g = 1: |x| / bs hits every E2M1 rounding threshold and tie, and the codes must be the
    reference's."""
    from dsv4_kernels import nvfp4
    mags = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    mags = mags[mags <= block_max]
    vals = torch.cat([mags, -mags])
    vals = torch.cat([vals, vals.new_zeros(-len(vals) % 15)]).view(-1, 15)
    x = torch.cat([vals.new_full((len(vals), 1), block_max), vals], 1).bfloat16().cuda()
    g = torch.ones(1, device="cuda")
    codes, scales, _ = nvfp4.quantize(x, g)
    rc, rs, _ = nvfp4.reference_quantize(x, g)
    assert torch.equal(scales.view(torch.uint8), rs.view(torch.uint8))
    assert (scales.float() == block_max / 6).all()
    assert torch.equal(codes, rc)


@pytest.mark.parametrize("g", [1.0, 0.3711, 2.9e-5])
def test_nvfp4_codes_at_every_block_scale(g):
    """Blocks led by every bf16 max whose e4m3 scale lies in [2^-9, 448] (every positive finite e4m3 scale,
    non-powers of two included, so bs = e * g has a rounded reciprocal), the other 15 elements every bf16
    magnitude from max / 32 to max with both signs: every rounding threshold of |x| / bs at every scale; the
    kernel's codes (one reciprocal a block, refined per element) must be the reference's IEEE quotients'."""
    from dsv4_kernels import nvfp4
    finite = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    maxes = finite[(finite >= 6 * 2.0 ** -9 * g) & (finite <= 6 * 448 * g)].cuda()
    mbits = maxes.bfloat16().view(torch.int16).int()
    mags = (mbits[:, None] - torch.arange(5 * 128 + 1, device="cuda")).to(torch.int16).view(torch.bfloat16)
    vals = torch.cat([mags, -mags], 1).float()
    vals = torch.cat([vals, vals.new_zeros(len(vals), -vals.size(1) % 15)], 1).view(len(vals), -1, 15)
    x = torch.cat([maxes[:, None, None].expand(-1, vals.size(1), 1), vals], 2).reshape(-1, 16).bfloat16()
    gt = torch.full((1,), g, device="cuda")
    codes, scales, _ = nvfp4.quantize(x, gt)
    rc, rs, _ = nvfp4.reference_quantize(x, gt)
    assert torch.equal(scales.view(torch.uint8), rs.view(torch.uint8))
    assert set(scales.view(torch.uint8).unique().tolist()) == set(range(1, 127))
    assert torch.equal(codes, rc)


@pytest.mark.parametrize("scale", [1.0, 1e-30, 2.0 ** -100, 1e25])
def test_nvfp4_specials_and_extreme_scales_match_the_reference(scale):
    """NaN, +-inf, -0, large and subnormal bf16 values in blocks of their own and among normal values, the
    whole tensor scaled so that block scales fall outside quotient_rn's range (IEEE divisions there); g from
    the amax (NaN or inf with those rows: every block scale NaN, divided by 1 as the reference does) and twice
    that: codes, scales and g bit for bit the reference's (a NaN x codes only its sign)."""
    from dsv4_kernels import nvfp4
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5)) * 3
    x[0, 3], x[1, 17], x[2, 40] = float("nan"), float("inf"), -float("inf")
    x[3, :16] = -0.0
    x[4, 5], x[6, 16:32] = 3e18, -3e18
    x[5, :16] = 1e-40 / max(scale, 1.0)
    x = (x * scale).bfloat16().cuda()
    for rows in (x, x[1:], x[3:]):                              # with NaN and inf, inf only, neither
        for g in (None, 2 * nvfp4.global_scale(rows.float().abs().amax())):
            codes, scales, gs = nvfp4.quantize(rows, g)
            rc, rs, rg = nvfp4.reference_quantize(rows, g)
            assert torch.equal(codes, rc) and torch.equal(scales.view(torch.uint8), rs.view(torch.uint8))
            assert torch.equal(gs.view(torch.int32), rg.view(torch.int32))


def test_nvfp4_quantise_is_bit_exact_and_writes_every_byte():
    from dsv4_kernels import nvfp4

    from dsv4debug.backends.sim import nvfp4_act_quant
    x = (torch.randn(33, 256, device="cuda") * 3).bfloat16()
    codes, scales, gs = nvfp4.quantize(x)
    rc, rs, _rg = nvfp4.reference_quantize(x)
    assert torch.equal(codes, rc) and torch.equal(scales.view(torch.uint8), rs.view(torch.uint8))
    assert torch.equal(nvfp4.dequantize(codes, scales, gs).view(torch.int16), nvfp4_act_quant(x).view(torch.int16))


@pytest.mark.parametrize("rows,n", [(1, 16), (7, 48), (300, 7168), (4096, 7168)])
def test_nvfp4_one_pass_equals_the_two_kernels_and_leaves_its_counters_zero(rows, n):
    """The one-pass quantiser (grid barrier on the amax), in every CTA shape of ONEPASS_CONFIGS, at sizes from
    one block to Pro's 4096 x 7168 (where each CTA holds 7168 blocks on chip and re-reads the rest): codes,
    scales and g bit for bit those of the amax kernel then the quantise given g and of the reference, the
    outlier that sets g placed last in x (the CTA that sees it is the last to arrive only by chance); a second
    launch gives the same bits; the sync counters are zero after each."""
    from dsv4_kernels import nvfp4
    from dsv4_kernels._common import scratch
    x = torch.randn(rows, n, device="cuda", generator=torch.Generator("cuda").manual_seed(rows))
    x[-1, -1] = -4000.0
    x = x.bfloat16()
    two = nvfp4.quantize(x, nvfp4.global_scale(nvfp4.amax(x)))
    ref = nvfp4.reference_quantize(x)
    sync = scratch("nvfp4_sync", x.device, 4, torch.int32)
    for onepass in nvfp4.ONEPASS_CONFIGS:
        one = nvfp4.quantize(x, onepass=onepass)
        again = nvfp4.quantize(x, onepass=onepass)
        for other in (two, ref, again):
            assert torch.equal(one[0], other[0]), onepass
            assert torch.equal(one[1].view(torch.uint8), other[1].view(torch.uint8)), onepass
            assert torch.equal(one[2].view(torch.int32), other[2].view(torch.int32)), onepass
        assert abs(one[2].item() * 2688 / 4000 - 1) < 1e-6, onepass             # the outlier set g
        assert sync.tolist() == [0, 0, 0, 0], onepass


def test_grid_barrier_and_split_k_kernels_on_two_streams_at_once():
    """The one-pass NVFP4 quantiser (grid barrier, launched cooperatively) and hc_pre (hc_mix's K-split
    tickets) queued on two streams at once, each stream on its own input: every result equals the same call
    run alone, since each stream gets its own sync counters, tickets and partials (a shared set would mix the
    two launches' arrivals)."""
    from dsv4_kernels import mhc, nvfp4
    from dsv4_kernels._common import scratch
    g = torch.Generator(device="cuda").manual_seed(11)
    xs = [torch.randn(2048, 7168, device="cuda", generator=g).bfloat16() * (1 + i) for i in range(2)]
    hs = [torch.randn(700, 4, 4096, device="cuda", generator=g).bfloat16() for _ in range(2)]
    fn = torch.randn(24, 4 * 4096, device="cuda", generator=g) / 128
    sc, base = torch.ones(3, device="cuda"), 0.01 * torch.randn(24, device="cuda", generator=g)
    alone = [(nvfp4.quantize(x), mhc.hc_pre(h, fn, sc, base, 20, 1e-6, 1e-6)) for x, h in zip(xs, hs)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    torch.cuda.synchronize()
    together = [None, None]
    for _ in range(3):                                         # queue both streams before waiting on either
        for i, st in enumerate(streams):
            with torch.cuda.stream(st):
                together[i] = (nvfp4.quantize(xs[i]), mhc.hc_pre(hs[i], fn, sc, base, 20, 1e-6, 1e-6))
    torch.cuda.synchronize()
    for (q1, m1), (q2, m2) in zip(alone, together):
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(q1, q2))
        assert all(torch.equal(a, b) for a, b in zip(m1, m2))
    with torch.cuda.stream(streams[0]):
        other = scratch("nvfp4_sync", "cuda", 4, torch.int32)
    assert other.data_ptr() != scratch("nvfp4_sync", "cuda", 4, torch.int32).data_ptr()


def test_kv_paged_write_touches_only_mapped_slots():
    from dsv4_kernels import kv_cache
    kv = torch.randn(100, 512, device="cuda").bfloat16()
    cache = kv_cache.new_cache(4, 64)
    cache.fill_(0xA5)
    slots = torch.arange(100, device="cuda") + 50
    slots[7] = -1                                              # skipped (padding token)
    kv_cache.write(kv, slots, cache)
    flat = cache.view(-1, 584)
    want = kv_cache.reference_pack(kv)
    keep = slots >= 0
    assert torch.equal(flat[slots[keep]], want[keep])
    untouched = torch.ones(flat.size(0), dtype=torch.bool, device="cuda")
    untouched[slots[keep]] = False
    assert bool((flat[untouched] == 0xA5).all())


def test_backend_ops_match_reference_backend():
    """The wired `kernels` backend against the `reference` backend, op by op (same signatures)."""
    import dsv4_references as ref

    from dsv4debug.backends.registry import make_backend
    from dsv4debug.formats import QWeight
    kb = make_backend("kernels", "cuda")
    rb = make_backend("reference", "cuda")
    assert "rms_norm" not in kb.missing_ops() and "sparse_attn" not in kb.missing_ops()
    x = torch.randn(64, 256, device="cuda").bfloat16()
    w = QWeight("n.weight", "f32", {"": (1 + 0.1 * torch.randn(256)).float()})
    d = (kb.rms_norm(x, w, eps=1e-6).float() - rb.rms_norm(x, w, eps=1e-6).float()).abs().max()
    assert d <= 2 ** -6
    q = torch.randn(64, 4, 512, device="cuda").bfloat16()
    d = (kb.head_rms_norm(q, eps=1e-6).float() - ref.head_rms_norm(q.float(), 1e-6)).abs().max()
    assert d <= 2 ** -5
    f = ref.rope_freqs(64, 64, 10000.0).cuda()
    for inv in (False, True):
        assert (kb.rope(q, f, inverse=inv).float() - rb.rope(q, f, inverse=inv).float()).abs().max() <= 2 ** -6
    kv = torch.randn(64, 512, device="cuda").bfloat16()
    assert torch.equal(kb.kv_cache(kv, rope_dim=64, qat=False), ref.kv_qat(kv, 64))


def test_tiny_model_runs_on_kernels_backend(tiny):
    """The whole flow on the tiny checkpoint: kernel ops where they exist, the rest delegated explicitly."""
    from dsv4debug import api
    from dsv4debug.backends.base import FAMILIES
    ids = api.make_tokens(tiny, tokens=list(range(1, 33)))
    own = {"norm", "rope", "kv_cache", "mhc"}
    res = api.run(tiny, ids, candidate="kernels", device="cuda", mode="forced",
                  reference_families=tuple(f for f in FAMILIES if f not in own))
    assert not res.missing_ops or all(op for op in res.missing_ops)
    assert res.verdict["status"] != "nan", res.verdict
