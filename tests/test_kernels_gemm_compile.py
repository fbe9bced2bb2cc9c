"""GEMM kernels on CPU (CI): compile for sm_90a with fake tensors, PTX contents, and the exactness of the
NVFP4 repack and of the MoE grouping glue (through a torch model of the kernel).

The WGMMA kernels compile in ~1-3 s each; the repack and glue tests run in well under a second.
"""
import os
import re

import pytest
import torch

pytest.importorskip("cutlass", reason="CuTeDSL (nvidia-cutlass-dsl 4.8.1) is not installed")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from dsv4_kernels import gemm_fp8, gemm_w4a16, moe, w4_pack
from dsv4_kernels._common import REGISTRY, compile_kernel

from dsv4debug.formats import (
    mxfp4_quantize,
    mxfp4_to_nvfp4,
    nvfp4_dequantize,
    nvfp4_quantize,
)

CI = ([("fp8_act_quant", {})] + [("fp8_block_gemm", c) for c in REGISTRY["fp8_block_gemm"].configs]
      + [("w4a16_gemm", c) for c in REGISTRY["w4a16_gemm"].ci()] + [("w4a16_gemv", c) for c in REGISTRY["w4a16_gemv"].ci()]
      + [("moe_gather_sum", c) for c in REGISTRY["moe_gather_sum"].ci()])
CI_ARCH = [(n, c, a) for n, c in CI for a in REGISTRY[n].archs]


@pytest.mark.parametrize("name,cfg,arch", CI_ARCH,
                         ids=[f"{n}-{a}-{'-'.join(f'{k}{v}' for k, v in c.items())}" for n, c, a in CI_ARCH])
def test_compiles_for_each_declared_arch(name, cfg, arch):
    from dsv4_kernels import _common
    _common._CACHE.pop((name, _common.config_key(cfg), arch), None)
    assert compile_kernel(name, arch, **cfg) is not None


def test_wgmma_kernels_are_hopper_only():
    assert REGISTRY["w4a16_gemm"].archs == ("sm_90a",)
    assert REGISTRY["fp8_block_gemm"].archs == ("sm_90a",)
    with pytest.raises(ValueError, match="not declared"):
        compile_kernel("w4a16_gemm", "sm_100a", n_tok=16)


def test_ptx_has_register_sourced_bf16_wgmma_and_no_fp4_conversion(ptx_of):
    ptx = ptx_of(gemm_w4a16._build, n_tok=16, grouped=True, epilogue="swiglu")
    wg = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert wg and all(".bf16.bf16" in ln for ln in wg)
    a_ops = [re.search(r"\}, \{([^}]*)\}", ln).group(1) for ln in wg]
    assert all(len(re.findall(r"%r\d+", a)) == 4 for a in a_ops)      # A operand: 4 registers (RS form)
    assert "e2m1" not in ptx and "mul.rn.bf16x2" in ptx and "cp.async.bulk.shared" in ptx


@pytest.mark.parametrize("cfg", [{"n_tok": 16, "tile_k": 128},
                                 {"n_tok": 16, "grouped": True, "epilogue": "swiglu"}], ids=["decode", "moe"])
def test_ptx_wgmma_groups_have_no_branch(cfg, ptx_of):
    """With one token sub-tile, a stage's WGMMAs are issued without a branch between fence and commit: under
    one, ptxas waits for them at the commit (C7519) and the next stage's decode no longer overlaps them."""
    ptx = ptx_of(gemm_w4a16._build, **cfg)
    groups = re.findall(r"wgmma\.fence\.sync\.aligned;(.*?)wgmma\.commit_group", ptx, re.DOTALL)
    assert groups and all("wgmma.mma_async" in g and not re.search(r"\bbra\b", g) for g in groups)


@pytest.mark.parametrize("tok_tiles", [1, 2])
def test_ptx_gemv_requests_every_byte_before_its_first_mma(tok_tiles, ptx_of):
    """The decode kernel: all of a warp's fragment and scale copies (and x's) are issued as cp.async groups
    before the first MMA, one group a chunk waited on in order; per k16 block one ldmatrix and one
    m16n8k16 MMA per 8 tokens; the last warp loads every part of its fragments at once, ordered by one
    atomic and warp barriers (no GPU-scope fence); no local memory."""
    chunks, split = 6, 5
    ptx = ptx_of(gemm_w4a16._build_gemv, tok_tiles=tok_tiles, chunks=chunks, split=split)
    mma = [m.start() for m in re.finditer(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)]
    assert len(mma) == 4 * chunks * tok_tiles
    assert ptx.count(f"ldmatrix.sync.aligned.m8n8.x{2 * tok_tiles}.shared.b16") == 4 * chunks
    copies = [m.start() for m in re.finditer(r"cp\.async\.cg\.shared\.global", ptx)]
    assert len(copies) >= 2 * chunks and max(copies) < min(mma)
    assert ptx.count("cp.async.commit_group") == chunks + 1
    waits = [int(w) for w in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)]
    assert waits == [chunks] + list(range(chunks - 1, -1, -1))
    assert ptx.count("ld.global.cg.v4.f32") == split * tok_tiles        # every part's loads in one round
    assert ptx.count("atom.") == 1 and "fence.acq_rel.gpu" not in ptx and "membar" not in ptx
    assert ".local" not in ptx and "e2m1" not in ptx


def test_ptx_gemv_without_split_has_no_workspace(ptx_of):
    ptx = ptx_of(gemm_w4a16._build_gemv, tok_tiles=1, chunks=4, split=1, warps=4)
    assert "atom." not in ptx and "ld.global.cg" not in ptx and ptx.count("mma.sync.aligned") == 16


@pytest.mark.parametrize("tile_n", gemm_fp8.TILE_NS)
def test_ptx_fp8_gemm_and_quant(tile_n, ptx_of):
    gemm = ptx_of(gemm_fp8._build_gemm, tile_n=tile_n)
    assert f"wgmma.mma_async.sync.aligned.m64n{tile_n}k32.f32.e4m3.e4m3" in gemm
    # the epilogue: tile_n / 4 bf16 pairs a thread (cvt.rn.bf16x2), swapped within quads, stored as 16-byte
    # vectors (8 a thread for 128-wide tiles)
    pairs = tile_n // 4
    assert gemm.count("cvt.rn.bf16x2.f32") == pairs
    assert gemm.count("st.global") == gemm.count("st.global.v4.b32") == pairs // 4
    assert "atom." not in gemm                          # no split-K tickets without split-K
    quant = ptx_of(gemm_fp8._build_quant)
    # 4 conversions of two values a vector, VECS vectors a thread
    assert quant.count("cvt.rn.satfinite.e4m3x2.f32") == 4 * gemm_fp8.Fp8ActQuant.vecs and "div.rn.f32" in quant


@pytest.mark.parametrize("tile_n", gemm_fp8.TILE_NS)
def test_ptx_fp8_split_k_writes_and_sums_pairs(tile_n, ptx_of):
    """Split-K: a thread's tile_n / 2 fp32 values go to the workspace as 8-byte pairs, one acq_rel ticket a warp,
    and the last warp's sum loads pairs of two parts at once (the loop over parts unrolled by 2)."""
    ptx = ptx_of(gemm_fp8._build_gemm, tile_n=tile_n, split_k=True)
    assert "multicast" not in ptx
    pairs = tile_n // 4
    assert ptx.count("st.global.v2.b32") == pairs
    assert ptx.count("atom.global.acq_rel.add") == 1
    assert ptx.count("ld.global.cg.v2.f32") == 3 * pairs
    assert ptx.count("st.global.v4.b32") == pairs // 4 and ptx.count("cvt.rn.bf16x2.f32") == pairs


def test_ptx_fp8_cluster_multicasts_a(ptx_of):
    """cluster_n = 2: A by a multicast TMA, B by a plain one, stages released in both CTAs, a cluster barrier
    before the CTAs leave; without a cluster none of it."""
    ptx = ptx_of(gemm_fp8._build_gemm, cluster_n=2)
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln]
    assert sum("multicast::cluster" in ln for ln in loads) == sum("multicast" not in ln for ln in loads) >= 1
    assert "mbarrier.arrive.shared::cluster" in ptx and "barrier.cluster.wait" in ptx
    alone = ptx_of(gemm_fp8._build_gemm)
    assert "multicast" not in alone and "barrier.cluster" not in alone


def test_ptx_w4a16_cluster_multicasts_x(ptx_of):
    """MoE prefill in clusters of two: the activation tile by a multicast TMA, each CTA's own weights by bulk
    copies, a cluster barrier at the end; alone, none of it."""
    cfg = {"n_tok": 64, "t_max": 2, "grouped": True, "tile_k": 128}
    ptx = ptx_of(gemm_w4a16._build, **cfg, cluster_n=2)
    assert sum("cp.async.bulk.tensor" in ln and "multicast::cluster" in ln for ln in ptx.splitlines()) >= 1
    assert "cp.async.bulk.shared::cluster.global" in ptx and "barrier.cluster.wait" in ptx
    alone = ptx_of(gemm_w4a16._build, **cfg)
    assert "multicast" not in alone and "barrier.cluster" not in alone


def test_moe_prefill_pairs_ctas_where_both_gemms_can():
    """Prefill-sized groups run in clusters of two when both GEMMs' N have an even count of 128-row tiles (Pro:
    2I = 6144, D = 7168), alone otherwise; decode-sized groups never."""
    assert moe.pick_grouped_config(4096 * 6, 384, (6144, 7168))["cluster_n"] == 2
    assert "cluster_n" not in moe.pick_grouped_config(4096 * 6, 384, (6144, 384))
    assert "cluster_n" not in moe.pick_grouped_config(4096 * 6, 384)
    assert "cluster_n" not in moe.pick_grouped_config(16 * 6, 384, (6144, 7168))


def test_split_k_scratch_is_shared_by_sizes_in_one_power_of_two():
    """Decodes of every token count reuse one partials buffer (sizes 5 and 7 share the buffer of 8): no buffer
    per shape piling up over a long run; another size class or kind gets its own."""
    from dsv4_kernels._common import scratch
    a, b = scratch("test_part", "cpu", 5, torch.float32), scratch("test_part", "cpu", 7, torch.float32)
    assert a.numel() == 5 and b.numel() == 7 and a.data_ptr() == b.data_ptr()
    assert scratch("test_part", "cpu", 9, torch.float32).data_ptr() != a.data_ptr()
    assert scratch("test_tickets", "cpu", 5, torch.int32).data_ptr() != a.data_ptr()
    assert not scratch("test_tickets", "cpu", 5, torch.int32).any()         # tickets start at zero


def test_fp8_gemm_refuses_an_output_it_cannot_write():
    import torch
    xq, w = torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.zeros(128, 128, dtype=torch.float8_e4m3fn)
    sa, sb = torch.ones(1, 4), torch.ones(1, 1)
    for out in (torch.empty(4, 128), torch.empty(4, 256, dtype=torch.bfloat16),
                torch.empty(128, 4, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="contiguous bf16"):
            gemm_fp8.fp8_gemm(xq, sa, w, sb, out)


def test_invalid_configs_are_refused():
    with pytest.raises(ValueError):
        gemm_w4a16.W4A16Gemm(n_tok=12)
    with pytest.raises(ValueError):
        gemm_fp8.Fp8BlockGemm(tile_n=256)
    with pytest.raises(ValueError, match="tok_tiles"):
        gemm_w4a16.W4A16Gemv(3, 4, 1)
    with pytest.raises(ValueError, match="chunks"):
        gemm_w4a16.W4A16Gemv(2, gemm_w4a16.GEMV_MAX_CHUNKS + 1, 2)
    with pytest.raises(ValueError, match="split"):
        gemm_w4a16.W4A16Gemv(2, 4, gemm_w4a16.GEMV_MAX_SPLIT + 1)
    with pytest.raises(ValueError, match="warps"):
        gemm_w4a16.W4A16Gemv(2, 4, 2, warps=2)
    with pytest.raises(ValueError, match="multiple of 8"):
        moe.MoeGatherSum(7164, 6)
    with pytest.raises(ValueError, match="bf16 rows"):
        moe.gather_sum(torch.zeros(4, 64), torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="whole tokens of 6"):
        moe.gather_sum(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32), 6)


def test_gemv_launcher_refuses_what_it_cannot_run():
    pack = (torch.zeros(1, 4, 16, 4, 32, 4, dtype=torch.int32), torch.zeros(1, 4, 16, 4, 8, 8, dtype=torch.uint8),
            torch.ones(1))                                                     # a [256, 1024] weight
    x = torch.zeros(17, 1024, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 16 tokens"):
        gemm_w4a16.w4a16_gemv(x, pack, 256, split=1)
    with pytest.raises(ValueError, match="contiguous bf16 \\[4, 256\\]"):
        gemm_w4a16.w4a16_gemv(x[:4], pack, 256, split=1, out=torch.empty(4, 512, dtype=torch.bfloat16)[:, :256])
    assert gemm_w4a16.w4a16_linear(x[:0], pack, 256).shape == (0, 256)            # no tokens: no launch
    with pytest.raises(ValueError, match="splits of K = 1024"):
        gemm_w4a16.w4a16_gemv(x[:4], pack, 256, split=3)
    with pytest.raises(ValueError, match="GEMM asks"):
        gemm_w4a16.w4a16_gemv(x[:4], pack, 512, split=1)
    assert gemm_w4a16.gemv_splits(1024) == [1, 2, 4, 8, 16]
    assert gemm_w4a16.gemv_splits(7168) == [7, 8, 14, 16, 28]


def test_fp8_config_fills_the_sms():
    """pick_config on the H200's 132 SMs, the choices measured best there (benchmarks/results/gemm.json): above
    256 rows 64-wide tiles only where 128-wide ones leave most SMs idle, K whole, A shared in clusters of two
    (the short K loop of wq_b too, measured on an H100 after the grouped raster); in decode K split until a
    row of tiles fills the SMs, in clusters."""
    pick, C = gemm_fp8.pick_config, gemm_fp8.Fp8Config
    assert pick(2048, 512, 7168, 132) == C(64, 1, 2)    # Pro wkv: 64 CTAs of 128 x 128 -> 128 of 128 x 64
    assert pick(4096, 512, 7168, 132) == C(128, 1, 2)   # 128 CTAs
    assert pick(2048, 1536, 7168, 132) == C(128, 1, 2)  # Pro wq_a: 1.45 waves, 64-wide 2.9; split gains nothing
    assert pick(2048, 7168, 16384, 132) == C(128, 1, 2)  # wo_b: 6.8 waves
    assert pick(4096, 1152, 7168, 132) == C(128, 1, 1)  # 9 tiles along N: no pairs
    assert pick(2048, 65536, 1536, 132) == C(128, 1, 2)  # wq_b: 12 k-tiles, in clusters too (grouped raster)
    assert pick(16, 1536, 7168, 132) == C(64, 4, 2)     # decode wq_a: 24 tiles -> 96 CTAs of 14 k-tiles
    assert pick(16, 65536, 1536, 132) == C(128, 1, 2)   # wq_b: 512 tiles fill the SMs
    for m, n, k in ((1, 512, 7168), (16, 7168, 3072), (256, 4096, 8192)):
        t, split, cluster, _ = pick(m, n, k, 132)
        assert t in gemm_fp8.TILE_NS and (k // 128) % split == 0 and split <= gemm_fp8.MAX_SPLIT
        assert (n // t) % cluster == 0


@pytest.mark.parametrize("n_tiles,m_tiles,cluster_n", [(512, 32, 1), (56, 32, 2), (4, 13, 2), (12, 3, 1)])
def test_raster_is_a_permutation_grouped_down_m(n_tiles, m_tiles, cluster_n):
    """Every (N tile, M tile) once; a cluster's CTAs one row and adjacent columns; launch order walks the rows
    of a group first (Pro wq_b at M = 4096: one group of all 32 rows, so its first 132 CTAs read 5 B tiles)."""
    from dsv4_kernels._tma_gemm import raster, raster_group
    for group_m in {1, 5, m_tiles, raster_group(m_tiles * 128, 1536, 128, 1)}:
        order = [raster(bx, by, n_tiles, m_tiles, group_m, cluster_n)
                 for by in range(m_tiles) for bx in range(n_tiles)]
        assert sorted(order) == [(x, y) for x in range(n_tiles) for y in range(m_tiles)]
        for i in range(0, len(order), cluster_n):
            pair = order[i:i + cluster_n]
            assert {y for _, y in pair} == {pair[0][1]} and [x for x, _ in pair] == list(range(pair[0][0], pair[0][0] + cluster_n))
        rows = min(group_m, m_tiles)                    # the first clusters launched walk down column 0
        assert order[:rows * cluster_n] == [(x, y) for y in range(rows) for x in range(cluster_n)]
    assert raster_group(4096, 1536, 128, 1) == 32 and raster_group(4096, 16384, 128, 1) == 8


def test_fp8_gemm_refuses_a_split_that_does_not_divide_k():
    import torch
    xq, w = torch.zeros(4, 384, dtype=torch.float8_e4m3fn), torch.zeros(128, 384, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cannot split K = 384 into 2"):
        gemm_fp8.fp8_gemm(xq, torch.ones(3, 4), w, torch.ones(1, 3), config=gemm_fp8.Fp8Config(128, 2))
    with pytest.raises(ValueError, match="cannot group 1 tiles along N in clusters of 2"):
        gemm_fp8.fp8_gemm(xq, torch.ones(3, 4), w, torch.ones(1, 3), config=gemm_fp8.Fp8Config(128, 1, 2))


# ---- the NVFP4 repack is exact ------------------------------------------------------------------------

def _exact_product(q, ws, s2):
    """fp64 value * e4m3 scale * global scale (the kernel applies the global scale to fp32 sums)."""
    from dsv4debug.formats import e2m1_decode
    vals = e2m1_decode(q).double()
    n, k = vals.shape
    return (vals.view(n, k // 16, 16) * ws.double()[..., None] * float(s2)).view(n, k)


def test_pack_roundtrip_nvfp4_quantised():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.05
    w[:3, :16] = 0.0                                  # zero blocks
    w[5, 32:48] *= 1e-4                               # tiny block (e4m3 subnormal or zero scale)
    q, ws, s2 = nvfp4_quantize(w)
    dec = w4_pack.decode_blob(*w4_pack.pack_nvfp4(q, ws, s2))[0].double()
    want = _exact_product(q, ws, s2)
    assert torch.allclose(dec, want, rtol=2 ** -23, atol=0)
    assert torch.equal(dec.float(), nvfp4_dequantize(q, ws, s2)) or \
        (dec.float() - nvfp4_dequantize(q, ws, s2)).abs().max() <= 2 ** -20 * w.abs().max()


def test_pack_mxfp4_cast_is_bit_exact_with_subnormal_scales():
    g = torch.Generator().manual_seed(1)
    w1, w3 = torch.randn(128, 256, generator=g) * 0.02, torch.randn(128, 256, generator=g) * 0.02
    w1[0, :32] *= 2.0 ** -14                          # 14 exponents below the max: e4m3 subnormal block scale
    a1, a3 = mxfp4_quantize(w1), mxfp4_quantize(w3)
    nv1, nv3, lossy = mxfp4_to_nvfp4(*a1, *a3)
    assert lossy == 0 and (nv1[1].float() < 2 ** -6).any()
    dec = w4_pack.decode_blob(*w4_pack.pack_nvfp4_w13(nv1[0], nv1[1], nv3[0], nv3[1], nv1[2]))[0]
    want = w4_pack.interleave_w13(nvfp4_dequantize(*nv1), nvfp4_dequantize(*nv3))
    assert torch.equal(dec, want)


def test_pack_negative_and_zero_scales():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 64, generator=g)
    q, ws, s2 = nvfp4_quantize(w)
    ws = ws.float()
    ws[0, 0] = -ws[0, 0]
    ws[1, 1] = 0.0
    ws = ws.to(torch.float8_e4m3fn)
    dec = w4_pack.decode_blob(*w4_pack.pack_nvfp4(q, ws, s2))[0].double()
    assert torch.allclose(dec, _exact_product(q, ws, s2), rtol=2 ** -23, atol=0)
    with pytest.raises(ValueError):
        w4_pack.pack_nvfp4(q[:100], ws[:100], s2)   # N must be a multiple of 128


# ---- MoE grouping glue through the torch model of the kernel -------------------------------------------

def _experts(E, D, I, g):
    p13, p2, dense = [], [], []
    for _ in range(E):
        w1, w3, w2 = (torch.randn(I, D, generator=g) * D ** -0.5, torch.randn(I, D, generator=g) * D ** -0.5,
                      torch.randn(D, I, generator=g) * I ** -0.5)
        s2 = (torch.maximum(w1.abs().amax(), w3.abs().amax()) / 2688).float()
        a1, a3, a2 = nvfp4_quantize(w1, s2), nvfp4_quantize(w3, s2), nvfp4_quantize(w2)
        p13.append(w4_pack.pack_nvfp4_w13(a1[0], a1[1], a3[0], a3[1], s2))
        p2.append(w4_pack.pack_nvfp4(*a2))
        dense.append(tuple(nvfp4_dequantize(*a).bfloat16() for a in (a1, a3, a2)))
    return w4_pack.stack_packed(p13), w4_pack.stack_packed(p2), dense


@pytest.mark.parametrize("cfg", [{"n_tok": 16, "t_max": 1}, {"n_tok": 8, "t_max": 2}, {"n_tok": 64, "t_max": 2}])
def test_moe_glue_matches_reference_experts(monkeypatch, cfg):
    import dsv4_references as ref
    monkeypatch.setattr(moe, "w4a16_launch", w4_pack.emulate_gemm)
    monkeypatch.setattr(moe, "gather_sum", lambda rows, src, k: rows[src].view(-1, k, rows.shape[1]).float().sum(1))
    g = torch.Generator().manual_seed(3)
    E, D, I, k, T = 5, 128, 128, 2, 37
    w13, w2, dense = _experts(E, D, I, g)
    x = torch.randn(T, D, generator=g).bfloat16()
    wts, ids = torch.rand(T, E, generator=g).topk(k, -1)
    ids[0] = torch.tensor([4, 1])                   # unsorted slots
    wts = (wts / wts.sum(-1, keepdim=True)).float()
    y = moe.moe_routed(x, ids, wts, w13, w2, E, 10.0, config=cfg)
    want = torch.zeros(T, D)
    for e in torch.unique(ids).tolist():
        hit = ids == e
        tok = hit.any(-1).nonzero().squeeze(-1)
        want.index_add_(0, tok, ref.expert(x[tok], *dense[e], 10.0, (wts * hit).sum(-1)[tok]).float())
    cos = torch.nn.functional.cosine_similarity(y.flatten().double(), want.flatten().double(), 0)
    assert cos > 0.9999


def test_route_plan_units_cover_every_row_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [3, 0]])
    plan = moe.route_plan(ids, 6, chunk=2)
    n = int(plan.ucount)
    units = plan.units[:n].tolist()
    assert plan.units.shape[0] == -(-ids.numel() // 2) + 6
    covered = [r for _, r0, c in units for r in range(r0, r0 + c)]
    assert covered == list(range(ids.numel()))
    assert all(0 < c <= 2 for _, _, c in units)
    assert [e for e, _, _ in units] == sorted(e for e, _, _ in units)
    # rows of one expert hold its tokens in ascending order
    flat = ids.flatten()[plan.order]
    assert torch.equal(flat, flat.sort().values)


@pytest.mark.parametrize("m", [1, 7, 16, 40, 300, 4096])
@pytest.mark.parametrize("n,k", [(3072, 7168), (7168, 3072), (2048, 4096), (4096, 2048), (6144, 7168), (256, 64 * 37)])
def test_dense_configs_are_legal(m, n, k):
    """Every pick is a legal kernel configuration; decode takes the mma.sync kernel wherever it can split K
    (K = 37 chunks cannot be: a prime above the most parts), else the WGMMA kernel."""
    cfg = gemm_w4a16.pick_dense_config(m, n, k)
    assert cfg.get("gemv", False) == (m <= 16 and k != 64 * 37)
    if cfg.get("gemv"):
        assert m <= 16 and cfg["split"] in gemm_w4a16.gemv_splits(k)
        gemm_w4a16.W4A16Gemv(1 if m <= 8 else 2, k // 64 // cfg["split"], cfg["split"])
        return
    assert (k // 64) % (cfg.get("tile_k", 64) // 64) == 0
    gemm_w4a16.W4A16Gemm(**cfg)                                                 # a valid kernel config


@pytest.mark.parametrize("m", [1, 16, 40, 300])
def test_swiglu_configs_are_wgmma_configs(m):
    """The fused w1|w3 + SwiGLU runs the WGMMA kernel at every M (the decode kernel has no such epilogue), with
    128-wide K stages in decode."""
    cfg = gemm_w4a16.pick_swiglu_config(m, 6144, 7168)
    gemm_w4a16.W4A16Gemm(**cfg, epilogue="swiglu")
    assert "gemv" not in cfg and (m > 16 or cfg == {"n_tok": 16, "tile_k": 128})


def test_decode_config_is_the_h200_best():
    """Decode runs the mma.sync kernel with 8 K chunks a warp: the fastest split on the H200 for all four expert
    shapes at M = 1 and 16 (Pro w1 / w2, Flash w1 / w2: splits 14, 6, 8, 4; 2026-12-03 17:46)."""
    picks = [gemm_w4a16.pick_dense_config(m, n, k) for m in (1, 16)
             for n, k in ((3072, 7168), (7168, 3072), (2048, 4096), (4096, 2048))]
    assert all(c["gemv"] for c in picks) and [c["split"] for c in picks] == [14, 6, 8, 4] * 2
    assert gemm_w4a16.pick_gemv_split(64 * 20) == 2                   # nearest to 8 chunks: 10 (not 5)

def test_pack_expert_from_checkpoint_weights():
    """The backend's per-expert packing (MXFP4 cast and NVFP4) decodes to the reference's dequantised weights."""
    from dsv4debug.formats import QWeight
    g = torch.Generator().manual_seed(4)
    D, I = 128, 256
    raw = {n: torch.randn(*s, generator=g) * s[1] ** -0.5 for n, s in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I)))}
    mx = [QWeight(f"e.{n}", "mxfp4", dict(zip(("weight", "scale"), mxfp4_quantize(w), strict=True)))
          for n, w in raw.items()]
    p13, p2 = moe.pack_expert(*mx)
    want13 = w4_pack.interleave_w13(mx[0].dequantize(), mx[1].dequantize())
    assert torch.equal(w4_pack.decode_blob(*p13)[0], want13)
    assert torch.equal(w4_pack.decode_blob(*p2)[0], mx[2].dequantize())
    s2 = torch.tensor(0.01)
    nv = []
    for n, w in raw.items():
        q, ws, sc2 = nvfp4_quantize(w, s2 if n != "w2" else None)
        nv.append(QWeight(f"e.{n}", "nvfp4", {"weight": q, "weight_scale": ws, "weight_scale_2": sc2}))
    p13, p2 = moe.pack_expert(*nv)
    got = w4_pack.decode_blob(*p13)[0]
    want = w4_pack.interleave_w13(nv[0].dequantize(), nv[1].dequantize())
    assert (got - want).abs().max() <= 2 ** -22 * want.abs().max()
    bad = QWeight("e.w3", "nvfp4", dict(nv[1].tensors, weight_scale_2=torch.tensor(0.02)))
    with pytest.raises(ValueError, match="weight_scale_2"):
        moe.pack_expert(nv[0], bad, nv[2])


def test_fused_layout_writes_the_eager_bytes():
    """The torch.compile'd repack (the GPU path) equals the eager one, zero and negative scales included."""
    from dsv4_kernels import w4_pack
    g = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (256, 192), dtype=torch.uint8, generator=g)
    scale = (torch.rand(256, 24, generator=g) * 8 - 2).to(torch.float8_e4m3fn)
    scale[3, :4] = 0
    u, zero, neg = w4_pack.encode_scales(scale)
    for a, b in zip(w4_pack._layout(packed, u, zero, neg), w4_pack._fused_layout()(packed, u, zero, neg)):
        assert a.dtype == b.dtype and torch.equal(a, b)
