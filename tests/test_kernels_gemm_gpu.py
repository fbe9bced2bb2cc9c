"""GPU tests of the GEMM kernels (FP8 block-scaled linear, NVFP4 W4A16 linear, grouped MoE) and of the kernels
backend's linear / expert ops, at small and real shapes (skipped without CUDA)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    pytest.importorskip("cutlass", reason="CuTeDSL is not installed")


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(0)


@pytest.mark.parametrize("m", [1, 77, 300])
def test_fp8_linear_within_sim_error(gen, m):
    from dsv4_kernels import check_gemm as C
    rows = C.check_fp8("flash", ms=(m,), gen=gen, log=lambda s: None)
    bad = [r.as_dict() for r in rows if not r.passed]
    assert not bad, bad


@pytest.mark.parametrize("cluster_n", [1, 2])
def test_fp8_tile_raster_changes_no_bit(gen, cluster_n):
    """Tiles rastered in groups of M rows (tile_coords) compute each tile as launch order does: the same bits for
    groups of 1 (launch order), 3 (a partial last group: 11 rows of tiles) and every row, and every tile written."""
    from dsv4_kernels import check_gemm as C
    from dsv4_kernels import gemm_fp8 as K
    q, s, _ = C.rand_fp8_weight(1024, 1024, gen)
    sb = K.weight_scales(s)
    xq, sa = K.fp8_act_quant(C._randn((1400, 1024), gen))
    want = K.fp8_gemm(xq, sa, q, sb, config=K.Fp8Config(128, 1, cluster_n, 1))
    assert bool(want.isfinite().all())
    for group_m in (3, 11, 0):
        got = K.fp8_gemm(xq, sa, q, sb, config=K.Fp8Config(128, 1, cluster_n, group_m))
        assert torch.equal(got, want), group_m


@pytest.mark.parametrize("tile_n", [128, 64])
def test_fp8_split_k_is_deterministic_and_reusable(gen, tile_n):
    """Split-K GEMMs: the same bits on every call (parts summed in split order; the tickets reset for the next
    launch), rows past M untouched (also in clusters), and within fp32 summation error of the unsplit GEMM."""
    from dsv4_kernels import check_gemm as C
    from dsv4_kernels import gemm_fp8 as K
    q, s, _ = C.rand_fp8_weight(512, 2048, gen)
    sb = K.weight_scales(s)
    xq, sa = K.fp8_act_quant(C._randn((77, 2048), gen))
    whole = K.fp8_gemm(xq, sa, q, sb, config=K.Fp8Config(tile_n))
    for split in (2, 4, 16):
        a = K.fp8_gemm(xq, sa, q, sb, config=K.Fp8Config(tile_n, split))
        b = K.fp8_gemm(xq, sa, q, sb, config=K.Fp8Config(tile_n, split))
        assert torch.equal(a, b), split
        assert (a.float() - whole.float()).abs().max() <= 2 ** -7 * whole.float().abs().max(), split
    big = torch.full((78, 512), 7.0, dtype=torch.bfloat16, device="cuda")
    K.fp8_gemm(xq, sa, q, sb, out=big[:77], config=K.Fp8Config(tile_n, 4, 2))
    assert torch.equal(big[:77], K.fp8_gemm(xq, sa, q, sb, config=K.Fp8Config(tile_n, 4, 2)))
    assert bool((big[77] == 7.0).all())


@pytest.mark.parametrize("tile_n", [128, 64])
def test_fp8_clusters_share_a_and_change_no_bit(gen, tile_n):
    """A tile multicast to a cluster of two CTAs along N: the same bits as each CTA loading its own, across
    several row tiles, a partial last one and a grid of many waves."""
    from dsv4_kernels import check_gemm as C
    from dsv4_kernels import gemm_fp8 as K
    q, s, _ = C.rand_fp8_weight(2048, 1024, gen)
    sb = K.weight_scales(s)
    for m in (1, 300, 4096):
        xq, sa = K.fp8_act_quant(C._randn((m, 1024), gen))
        alone = K.fp8_gemm(xq, sa, q, sb, config=K.Fp8Config(tile_n))
        assert torch.equal(K.fp8_gemm(xq, sa, q, sb, config=K.Fp8Config(tile_n, 1, 2)), alone), m


def test_w4a16_clusters_share_x_and_change_no_bit(gen):
    """Activation tiles multicast to clusters of two CTAs along N: dense (partial last token tile) and grouped
    (units past the count, experts with no tokens) give the same bits as CTAs loading their own."""
    from dsv4_kernels import check_gemm as C
    from dsv4_kernels import gemm_w4a16, moe, w4_pack
    q, ws, s2, _ = C.rand_nvfp4_weight(1024, 2048, gen)
    pack = w4_pack.pack_nvfp4(q, ws, s2)
    x = C._randn((600, 2048), gen)
    cfg = {"n_tok": 128, "t_max": 2}
    alone = gemm_w4a16.w4a16_linear(x, pack, 1024, config=cfg)
    assert torch.equal(gemm_w4a16.w4a16_linear(x, pack, 1024, config=cfg | {"cluster_n": 2}), alone)
    w13, w2, _ = C.make_moe_weights(8, 512, 256, gen)
    x = C._randn((300, 512), gen)
    ids, w = C.random_routing(300, 8, 4, gen)
    cfg = {"n_tok": 64, "t_max": 2, "tile_k": 128}
    alone = moe.moe_routed(x, ids, w, w13, w2, 8, C.LIMIT, config=cfg)
    assert torch.equal(moe.moe_routed(x, ids, w, w13, w2, 8, C.LIMIT, config=cfg | {"cluster_n": 2}), alone)


@pytest.mark.parametrize("d,k", [(7168, 6), (4096, 6), (512, 2)])
def test_moe_gather_sum_is_the_slot_order_fp32_loop(gen, d, k):
    """The combine kernel gives the bits of the permuting copy plus k fp32 passes in slot order, and touches
    only the rows a token routes to (rows nobody names hold NaN)."""
    from dsv4_kernels import moe
    T = 333
    rows = torch.randn(T * k + 5, d, device="cuda", generator=gen).bfloat16()
    rows[-5:] = float("nan")
    src = torch.randperm(T * k, device="cuda", generator=gen)
    want = torch.zeros(T, d, device="cuda")
    for j in range(k):
        want += rows.index_select(0, src).view(T, k, d)[:, j].float()
    assert torch.equal(moe.gather_sum(rows, src, k), want)


def test_w4a16_linear_and_fused_swiglu(gen):
    from dsv4_kernels import check_gemm as C
    rows = C.check_w4("flash", ms=(1, 16, 130), gen=gen, log=lambda s: None)
    bad = [r.as_dict() for r in rows if not r.passed]
    assert not bad, bad


def test_grouped_moe(gen):
    from dsv4_kernels import check_gemm as C
    rows = C.check_moe("flash", E_small=12, tokens=(40, 700), gen=gen, log=lambda s: None)
    bad = [r.as_dict() for r in rows if not r.passed]
    assert not bad, bad


@pytest.mark.parametrize("m", [1, 5, 8, 9, 16])
def test_w4a16_gemv_is_the_decoded_gemm_at_every_split(gen, m):
    """The decode kernel at every split of K and CTA size: each output within its bf16 rounding and fp32
    summation error of fp64 math on the decoded weights, the same bits call after call (tickets reset), and
    an `out` view's other rows untouched."""
    from dsv4_kernels import check_gemm as C
    from dsv4_kernels import gemm_w4a16 as K
    from dsv4_kernels import w4_pack
    q, ws, s2, wd = C.rand_nvfp4_weight(1024, 2048, gen)
    pack = w4_pack.pack_nvfp4(q, ws, s2)
    x = C._randn((m, 2048), gen)
    want = x.double() @ wd.double().T
    bound = 2 ** -8 * want.abs() + 2 ** -20 * (x.double().abs() @ wd.double().abs().T)
    for split in K.gemv_splits(2048):
        for warps in (4, 8):
            a = K.w4a16_gemv(x, pack, 1024, split, warps)
            assert torch.equal(a, K.w4a16_gemv(x, pack, 1024, split, warps)), (split, warps)
            assert bool(((a.double() - want).abs() <= bound).all()), (split, warps)
    big = torch.full((m + 1, 1024), 7.0, dtype=torch.bfloat16, device="cuda")
    K.w4a16_linear(x, pack, 1024, out=big[:m])
    assert torch.equal(big[:m], K.w4a16_linear(x, pack, 1024)) and bool((big[m] == 7.0).all())


def _mxfp4_expert(dim: int, inter: int, g: torch.Generator) -> list:
    """w1, w3, w2 of one MXFP4 expert of random weights (host tensors, as a checkpoint holds them)."""
    from dsv4debug.formats import QWeight, mxfp4_quantize
    ws = []
    for name, shape in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter))):
        a, sc = mxfp4_quantize(torch.randn(*shape, generator=g) * shape[1] ** -0.5)
        ws.append(QWeight(f"layers.0.ffn.experts.0.{name}", "mxfp4", {"weight": a, "scale": sc}))
    return ws


def test_backend_linear_and_expert_ops():
    """The kernels backend's ops against the reference backend on synthetic checkpoint weights."""
    from dsv4debug.backends.kernels import KernelsBackend
    from dsv4debug.backends.reference import ReferenceBackend
    from dsv4debug.backends.sim import SimBackend
    from dsv4debug.config import preset
    from dsv4debug.formats import QWeight, fp8_block_quantize
    cfg = preset("flash")
    g = torch.Generator().manual_seed(1)
    D, I = cfg.dim, cfg.moe_inter_dim
    kb, rb, sb = KernelsBackend("cuda"), ReferenceBackend("cuda"), SimBackend("cuda")
    x = torch.randn(37, D, generator=g).bfloat16().cuda()
    q, s = fp8_block_quantize(torch.randn(1024, D, generator=g) * D ** -0.5)
    w = QWeight("layers.0.attn.wq_a", "fp8", {"weight": q, "scale": s})
    got, ref, sim = kb.linear(x, w), rb.linear(x, w), sb.linear(x, w)
    e_k = float((got.double() - ref.double()).norm() / ref.double().norm())
    e_s = float((sim.double() - ref.double()).norm() / ref.double().norm())
    assert e_k <= 1.1 * e_s
    ws = _mxfp4_expert(D, I, g)
    rw = torch.rand(37, generator=g).cuda()
    got = kb.expert(x, *ws, rw, limit=cfg.swiglu_limit)
    want = rb.expert(x, *ws, rw, limit=cfg.swiglu_limit)
    cos = torch.nn.functional.cosine_similarity(got.flatten().double(), want.flatten().double(), 0)
    assert cos >= 0.999 and torch.isfinite(got).all()


def test_sim_w4a16_rounds_as_the_kernels_do():
    """bisect judges the kernels by sim-w4a16 (Backend.simulator): on an FP8 linear and an MXFP4 expert, the
    kernels land several times closer to it than to the bf16 reference (linear) or to the W4A4 `sim` (expert),
    which is what lets faults below the quantisation noise stand out."""
    from dsv4debug.backends.kernels import KernelsBackend
    from dsv4debug.backends.reference import ReferenceBackend
    from dsv4debug.backends.registry import make_backend
    from dsv4debug.config import preset
    from dsv4debug.formats import QWeight, fp8_block_quantize
    from dsv4debug.runner import rel_l2
    cfg = preset("flash")
    g = torch.Generator().manual_seed(2)
    D, I = cfg.dim, cfg.moe_inter_dim
    kb = KernelsBackend("cuda")
    judge, ref, w4a4 = make_backend(kb.simulator, "cuda"), ReferenceBackend("cuda"), make_backend("sim", "cuda")
    x = torch.randn(200, D, generator=g).bfloat16().cuda()
    q, s = fp8_block_quantize(torch.randn(1024, D, generator=g) * D ** -0.5)
    w = QWeight("layers.0.attn.wq_a", "fp8", {"weight": q, "scale": s})
    got = kb.linear(x, w)
    assert rel_l2(judge.linear(x, w), got) * 4 <= rel_l2(ref.linear(x, w), got)
    ws = _mxfp4_expert(D, I, g)
    rw = torch.rand(200, generator=g).cuda()
    got = kb.expert(x, *ws, rw, limit=cfg.swiglu_limit)
    near = rel_l2(judge.expert(x, *ws, rw, limit=cfg.swiglu_limit), got)
    assert near * 4 <= rel_l2(w4a4.expert(x, *ws, rw, limit=cfg.swiglu_limit), got)


@pytest.mark.parametrize("preset_name", ["flash", "pro"])
def test_backend_grouped_linear_is_the_reference_up_to_summation_order(preset_name):
    """wo_a on the kernels backend (one bf16 GEMM per head group) against the reference's einsum: the same
    exact products, so only the fp32 summation order and one bf16 rounding differ."""
    from dsv4debug.backends.kernels import KernelsBackend
    from dsv4debug.backends.reference import ReferenceBackend
    from dsv4debug.config import preset
    from dsv4debug.formats import QWeight, fp8_block_quantize
    from dsv4debug.runner import rel_l2
    cfg = preset(preset_name)
    g = torch.Generator().manual_seed(3)
    G, R, H, d = cfg.o_groups, cfg.o_lora_rank, cfg.n_heads, cfg.head_dim
    o = torch.randn(300, H, d, generator=g).bfloat16().cuda()
    q, s = fp8_block_quantize(torch.randn(G * R, H * d // G, generator=g) * (H * d // G) ** -0.5)
    w = QWeight("layers.0.attn.wo_a", "fp8", {"weight": q, "scale": s})
    kb = KernelsBackend("cuda")
    assert kb.unsupported("grouped_linear", (o, w)) is None
    got, want = kb.grouped_linear(o, w, groups=G), ReferenceBackend("cuda").grouped_linear(o, w, groups=G)
    assert got.shape == want.shape == (300, G * R) and got.dtype == torch.bfloat16
    assert rel_l2(want, got) <= 2 ** -8


def test_backend_logits_are_the_fp32_head_up_to_summation_order():
    from dsv4debug.backends.kernels import KernelsBackend
    from dsv4debug.backends.reference import ReferenceBackend
    from dsv4debug.formats import QWeight
    from dsv4debug.runner import rel_l2
    g = torch.Generator().manual_seed(4)
    x = torch.randn(77, 4096, generator=g).bfloat16().cuda()
    w = QWeight("head.weight", "bf16_plain", {"": (torch.randn(129280, 4096, generator=g) * 0.02).bfloat16()})
    kb = KernelsBackend("cuda")
    assert kb.unsupported("logits", (x, w)) is None
    got, want = kb.logits(x, w), ReferenceBackend("cuda").logits(x, w)
    assert got.dtype == want.dtype == torch.float32 and rel_l2(want, got) <= 1e-5
