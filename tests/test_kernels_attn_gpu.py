"""GPU tests of the attention-path kernels against dsv4_references (skipped without CUDA).

The same harness runs on CPU with torch stand-ins in tests/test_kernels_attn_compile.py. On the H200
(2026-11-30) all 31 pass; the first run found the consumer thread-id bug of sparse_attn, which the CPU
models could not see.
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    pytest.importorskip("cutlass", reason="CuTeDSL is not installed")


def test_single_key_probe_is_exact():
    """One valid key a token: the output must be that key row bit for bit (gather, dequant, P.V layout)."""
    from dsv4_kernels import check_attn as C
    for shape in ("flash", "pro"):
        res = C.single_key_probe(shape, S=48)
        assert res["passed"], res


@pytest.mark.parametrize("layer", ["swa", "hca", "csa"])
@pytest.mark.parametrize("shape", ["flash", "pro"])
def test_prefill_matches_reference(shape, layer):
    from dsv4_kernels import check_attn as C
    p = C.make_prefill(shape, layer, 1024 if layer != "csa" else 2100, seed=1)
    for fmt in ("fp8", "bf16"):
        row = C.check_case(p, fmt)
        assert row["passed"], row


@pytest.mark.parametrize("shape,layer,B,L", [("flash", "csa", 4, 8192), ("pro", "hca", 2, 65536),
                                             ("pro", "csa", 3, 16384), ("flash", "swa", 5, 300)])
def test_decode_with_splits_matches_reference(shape, layer, B, L):
    from dsv4_kernels import check_attn as C
    from dsv4_kernels import sparse_attn as SA
    p = C.make_decode(shape, layer, B, L, seed=2)
    assert SA.choose_splits(B, p["H"], p["idx"].size(1)) >= 1
    for ns in (None, 1, 2, 7):                          # forced splits exercise the combine kernel
        row = C.check_case(p, "fp8", ns)
        assert row["passed"], row


def test_edge_cases():
    """Tokens with no key (o = 0), ids past the caches (skipped), K not a multiple of the block, 4 heads
    (padded to 64 inside), a dominant sink."""
    import dsv4_references as ref
    from dsv4_kernels import sparse_attn as SA
    g = torch.Generator(device="cuda").manual_seed(3)
    S, H, N, K = 37, 4, 500, 77
    q = torch.randn(S, H, 512, device="cuda", generator=g).bfloat16()
    kv = ref.kv_qat(torch.randn(N, 512, device="cuda", generator=g).bfloat16(), 64)
    idx = torch.randint(0, N, (S, K), device="cuda", generator=g)
    idx[5] = -1
    idx[6, :40] = -1
    sink = torch.tensor([0.0, 3.0, 30.0, -30.0], device="cuda")
    want = ref.sparse_attn(q, kv, sink, idx, 512 ** -0.5)
    for ns in (None, 1, 3):
        got = SA.sparse_attn_bf16(q, kv, idx, sink, 512 ** -0.5, ns)
        assert got.shape == (S, H, 512)
        assert float(got[5].float().abs().max()) == 0.0
        assert float((got.float() - want.float()).abs().max()) <= 2 ** -6 * float(want.float().abs().max()) + 1e-6
        far = idx.clone()
        far[:, 0] = N + 1000
        skip = idx.clone()
        skip[:, 0] = -1
        assert torch.equal(SA.sparse_attn_bf16(q, kv, far, sink, 512 ** -0.5, ns),
                           SA.sparse_attn_bf16(q, kv, skip, sink, 512 ** -0.5, ns))


def test_kernel_follows_its_cpu_model():
    """The kernel against emulate() (same order of operations): far tighter than against the reference."""
    from dsv4_kernels import check_attn as C
    from dsv4_kernels import sparse_attn as SA
    p = C.make_prefill("flash", "hca", 1500, seed=4)
    q, idx = p["q"][-64:], p["idx"][-64:]
    got = SA.sparse_attn_bf16(q, p["kv"], idx, p["sink"], 512 ** -0.5, 1)
    cfg = SA.launch_config("bf16")                                   # the model of the default configuration
    model = SA.emulate(q, SA.rows_from_bf16(p["kv"]), idx, p["sink"], 512 ** -0.5, bn=cfg["bn"],
                       scores=cfg.get("scores", "dims"))
    assert C.cos(got, model) >= 0.99999
    assert float((got.float() - model.float()).abs().max()) <= 2 ** -7 * float(model.float().abs().max())


def test_backend_sparse_attn_matches_reference_backend():
    from dsv4_kernels import check_attn as C

    from dsv4debug.backends.registry import make_backend
    from dsv4debug.formats import QWeight
    kb = make_backend("kernels", "cuda")
    rb = make_backend("reference", "cuda")
    assert "sparse_attn" not in kb.missing_ops()
    p = C.make_prefill("flash", "csa", 600, seed=5)
    sink = QWeight("layers.2.attn.attn_sink", "f32", {"": p["sink"].float().cpu()})
    got = kb.sparse_attn(p["q"], p["kv"], sink, p["idx"], scale=512 ** -0.5)
    want = rb.sparse_attn(p["q"], p["kv"], sink, p["idx"], scale=512 ** -0.5)
    assert C.cos(got, want) >= 0.999


@pytest.mark.parametrize("shape,S", [("flash", 4096), ("pro", 8192)])
def test_indexer_matches_reference(shape, S):
    from dsv4_kernels import check_attn as C
    row = C.check_indexer(C.make_indexer(shape, S, seed=6))
    assert row["passed"], row


@pytest.mark.parametrize("ratio", [0, 4])
def test_topk_kernel_equals_its_model(ratio):
    """Radix select on the device = topk_model bit for bit (threshold, tie rule, order), long rows included."""
    from dsv4_kernels import indexer as IX
    g = torch.Generator(device="cuda").manual_seed(8)
    for S, T, k in ((64, 70000, 1024), (300, 1500, 512), (3, 100, 512)):
        scores = torch.randn(S, T, device="cuda", generator=g).bfloat16()
        scores[:, ::5] = scores[:, 1:2]                                  # heavy ties
        if ratio:
            vis = torch.arange(T, device="cuda")[None, :] < (torch.arange(S, device="cuda")[:, None] + 1) // ratio
            scores = scores.masked_fill(~vis, float("-inf"))
        scores[1] = float("-inf")
        got = IX.indexer_topk(scores, k, ratio)
        assert torch.equal(got.cpu(), IX.topk_model(scores.cpu(), k, ratio)), (S, T, k)


def test_scores_kernel_follows_its_model():
    from dsv4_kernels import check_attn as C
    from dsv4_kernels import indexer as IX
    p = C.make_indexer("flash", 1000, seed=9)
    got = IX.indexer_scores(p["q"], p["k"], p["w"], 4)
    want = IX.scores_model(p["q"], p["k"], p["w"], 4)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert float((got[fin].float() - want[fin].float()).abs().max()) <= 2 ** -8 * float(want[fin].float().abs().max())


def test_backend_indexer_ops_match_reference_backend():
    import dsv4_references as ref

    from dsv4debug.backends.registry import make_backend
    from dsv4debug.metrics import index_agreement
    kb = make_backend("kernels", "cuda")
    rb = make_backend("reference", "cuda")
    g = torch.Generator(device="cuda").manual_seed(10)
    S, T = 400, 100
    for IH in (4, 64):                                  # tiny preset (4 heads, padded) and the real 64
        q = ref.indexer_q(torch.randn(S, IH, 128, device="cuda", generator=g).bfloat16(),
                          ref.rope_freqs(S, 64, 160000.0, 65536, 16.0).cuda())
        k = ref.fp4_sim(torch.randn(T, 128, device="cuda", generator=g).bfloat16(), 32)
        w = torch.randn(S, IH, device="cuda", generator=g).bfloat16()
        sk = kb.indexer_scores(q, k, w, ratio=4, weight_scale=128 ** -0.5 * IH ** -0.5)
        sr = rb.indexer_scores(q, k, w, ratio=4, weight_scale=128 ** -0.5 * IH ** -0.5)
        fin = torch.isfinite(sr)
        assert torch.equal(torch.isinf(sk), torch.isinf(sr))
        assert float((sk[fin].float() - sr[fin].float()).abs().max()) <= 2 ** -7 * float(sr[fin].float().abs().max())
        ik, ir = kb.indexer_topk(sr, k=16), rb.indexer_topk(sr, k=16)
        assert ik.dtype == ir.dtype and ik.shape == ir.shape
        agr = index_agreement(ir, ik, sr.float().nan_to_num(neginf=-1e30), tie_margin=1e-6)
        assert agr["hard_flips"] == 0


@pytest.mark.parametrize("kind", ["main_csa", "main_hca", "indexer"])
def test_compressor_matches_reference(kind):
    from dsv4_kernels import check_attn as C
    row = C.check_compressor(C.make_compressor("flash", kind, 1024 + 7, seed=12))
    assert row["passed"], row


def test_compress_pool_follows_its_model():
    import dsv4_references as ref
    from dsv4_kernels import check_attn as C
    from dsv4_kernels import compressor as CP
    for kind in C.COMPRESSORS:
        p = C.make_compressor("flash", kind, 1024, seed=13)
        ratio, dc = p["ratio"], p["dc"]
        T = p["S"] // ratio
        y = p["x"].float() @ torch.cat([p["wkv"], p["wgate"]]).float().T
        C_ = p["wkv"].size(0)
        cs = torch.view_as_real(p["freqs"][:T * ratio:ratio]).float().contiguous()
        for post in (("hadamard_fp4", "hadamard") if p["rotate"] else ("fp8", "none")):
            got = CP.compress_pool(y[:, :C_], y[:, C_:], p["ape"], p["norm_w"], cs, ratio, post, 1e-6, dc)
            want = CP.pool_model(y[:, :C_], y[:, C_:], p["ape"], p["norm_w"], cs, ratio, post, 1e-6, dc)
            assert C.cos(got, want) >= 0.99999 and float((got == want).float().mean()) >= 0.95, (kind, post)
    assert ref is not None


def test_backend_compressor_matches_reference_backend():
    from dsv4_kernels import check_attn as C

    from dsv4debug.backends.registry import make_backend
    from dsv4debug.formats import QWeight
    kb = make_backend("kernels", "cuda")
    rb = make_backend("reference", "cuda")
    for kind in C.COMPRESSORS:
        p = C.make_compressor("flash", kind, 600, seed=14)
        f32 = lambda n, t: QWeight(n, "f32", {"": t.float().cpu()})
        bf = lambda n, t: QWeight(n, "bf16_plain", {"": t.cpu()})
        args = (p["x"], bf("c.wkv", p["wkv"]), bf("c.wgate", p["wgate"]), f32("c.ape", p["ape"]),
                f32("c.norm.weight", p["norm_w"]), p["freqs"])
        kw = {"ratio": p["ratio"], "rope_dim": 64, "eps": 1e-6, "rotate": p["rotate"], "qat": True}
        got, want = kb.compressor(*args, **kw), rb.compressor(*args, **kw)
        assert C.cos(got, want) >= 0.9999, kind
        kb.end_stage()
        rb.end_stage()


@pytest.mark.parametrize("qat", [True, False])
def test_indexer_q_kernel(qat):
    import dsv4_references as ref
    from dsv4_kernels import compressor as CP

    from dsv4debug.backends.registry import make_backend
    g = torch.Generator(device="cuda").manual_seed(15)
    S, IH = 333, 64
    q = torch.randn(S, IH, 128, device="cuda", generator=g).bfloat16()
    freqs = ref.rope_freqs(S, 64, 160000.0, 65536, 16.0).cuda()
    got = CP.indexer_q(q, freqs, qat)
    assert float((got == CP.indexer_q_model(q, freqs, qat)).float().mean()) >= 0.99
    want = make_backend("reference", "cuda").indexer_q(q, freqs, qat=qat)
    kb = make_backend("kernels", "cuda").indexer_q(q, freqs, qat=qat)
    from dsv4_kernels import check_attn as C
    assert C.cos(kb, want) >= 0.9999 and float((kb == want).float().mean()) >= 0.95


@pytest.mark.parametrize("m,n,k", [(1, 128, 64), (300, 1024, 4096), (4099, 2048, 7168), (77, 512, 256)])
def test_bf16_gemm_f32(m, n, k):
    """bf16 x bf16 -> fp32 GEMM = the fp32 product of the bf16 values up to summation order."""
    from dsv4_kernels import compressor as CP
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    got = CP.bf16_gemm_f32(x, w)
    want = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-6


@pytest.mark.parametrize("shape,layer,S", [("flash", "csa", 700), ("pro", "hca", 1100), ("flash", "swa", 300)])
def test_dequantise_first_is_bit_identical_to_in_kernel_dequant(shape, layer, S):
    """The prefill path (caches dequantised once by kv_read, then the bf16 kernel) must give the FP8 kernel's
    output bit for bit: the same exact dequantisation, the same order of operations; with KV splits too."""
    from dsv4_kernels import check_attn as C
    from dsv4_kernels import sparse_attn as SA
    p = C.make_prefill(shape, layer, S, seed=6)
    _, (ca, cb, slot) = C.prepared_fp8(p)
    q, sink = p["q"].contiguous(), p["sink"].float().contiguous()
    assert SA.dequant_first(S, slot.size(1), (ca.numel() + (cb.numel() if cb is not None else 0)) // 584)
    for ns in (1, 3):
        inkernel = SA.sparse_attn_fp8(q, slot, sink, ca, 512 ** -0.5, cb, ns, dequant="kernel")
        first = SA.sparse_attn_fp8(q, slot, sink, ca, 512 ** -0.5, cb, ns, dequant="first")
        assert torch.equal(inkernel, first), (shape, layer, ns)
    auto = SA.sparse_attn_fp8(q, slot, sink, ca, 512 ** -0.5, cb, dequant="auto")
    assert torch.equal(auto, SA.sparse_attn_fp8(q, slot, sink, ca, 512 ** -0.5, cb))


@pytest.mark.parametrize("shape,layer,S", [("flash", "csa", 700), ("pro", "hca", 300), ("flash", "swa", 40)])
def test_pipelined_consumers_are_bit_identical(shape, layer, S):
    """The bf16 kernel with software-pipelined consumers (S of block j before P.V of block j - 1) does the same
    operations in the same order as the plain one: the same bits, whole and with KV splits (1 to 3 blocks a
    split, so the pipeline's first and last block coincide too); also past a single key block (K <= 32)."""
    from dsv4_kernels import check_attn as C
    from dsv4_kernels import sparse_attn as SA
    p = C.make_prefill(shape, layer, S, seed=9)
    q, sink, kv, idx = p["q"].contiguous(), p["sink"].float().contiguous(), p["kv"].contiguous(), p["idx"]
    for ns in (1, 3, 40):
        for k in (idx.size(1), 32, 5):
            args = ("bf16", q, idx[:, :k].contiguous(), sink, kv, None, kv.size(0), 0, 512 ** -0.5, ns, 32)
            assert torch.equal(SA._launch(*args, pipelined=False), SA._launch(*args, pipelined=True)), (ns, k)


def test_dequantize_slots_matches_the_reference_unpack():
    """Every slot of a paged cache (3-d, and a flat 2-d view) dequantised in slot order, as the reference reads it."""
    from dsv4_kernels import kv_cache
    from dsv4_kernels import sparse_attn as SA
    g = torch.Generator(device="cuda").manual_seed(8)
    rows = torch.randn(200, 512, device="cuda", generator=g).bfloat16()
    cache, slots = SA.page_rows(rows, 16)
    want = kv_cache.reference_unpack(cache.view(-1, 584))
    for c in (cache, cache.view(-1, 584)):
        out = torch.empty(cache.numel() // 584, 512, dtype=torch.bfloat16, device="cuda")
        kv_cache.dequantize_slots(c, out)
        assert torch.equal(out, want)
    assert torch.equal(want[slots], kv_cache.reference_unpack(kv_cache.reference_pack(rows)))


@pytest.mark.parametrize("scores", ["dims", "keys"])
@pytest.mark.parametrize("shape,layer,S", [("flash", "csa", 700), ("pro", "hca", 300), ("flash", "swa", 40)])
def test_block_of_64_follows_its_model(shape, layer, S, scores):
    """The bf16 kernel with 64-key blocks (scores split by dims: one exchange buffer behind a barrier; or by keys:
    row maxima and P exchanged) against its CPU model at the same block width and scheme, and the reference;
    whole and with KV splits, K of one block, of a block and a key, and of 5 keys (the second consumer's
    half empty)."""
    import dsv4_references as ref
    from dsv4_kernels import check_attn as C
    from dsv4_kernels import sparse_attn as SA
    p = C.make_prefill(shape, layer, S, seed=10)
    q, sink, kv, idx = p["q"].contiguous(), p["sink"].float().contiguous(), p["kv"].contiguous(), p["idx"]
    scale = 512 ** -0.5
    for ns in (1, 3):
        for k in (idx.size(1), 64, 65, 5):
            ik = idx[:, :k].contiguous()
            got = SA._launch("bf16", q, ik, sink, kv, None, kv.size(0), 0, scale, ns, 64, 1, False, scores)
            model = SA.emulate(q, SA.rows_from_bf16(kv), ik, sink, scale, bn=64, num_splits=ns, scores=scores)
            assert C.cos(got, model) >= 0.99999, (ns, k)
            assert float((got.float() - model.float()).abs().max()) <= 2 ** -7 * float(model.float().abs().max())
            assert C.cos(got, ref.sparse_attn(q, kv, sink, ik, scale)) >= 0.999, (ns, k)


@pytest.mark.parametrize("scores", ["dims", "keys"])
def test_block_of_64_single_key_is_exact(scores):
    """One valid key a token at any column of a 64-key block (either consumer's half under scores="keys"), the
    rest skipped, sink negligible: the output is the key row bit for bit; a token with no key gives zeros."""
    import dsv4_references as ref
    from dsv4_kernels import sparse_attn as SA
    g = torch.Generator(device="cuda").manual_seed(11)
    S, H, N, K = 130, 64, 400, 150
    kv = ref.kv_qat(torch.randn(N, 512, device="cuda", generator=g).bfloat16(), 64)
    q = torch.randn(S, H, 512, device="cuda", generator=g).bfloat16()
    idx = torch.full((S, K), -1, dtype=torch.long, device="cuda")
    key = torch.randint(0, N, (S,), device="cuda", generator=g)
    idx[torch.arange(S, device="cuda"), torch.arange(S, device="cuda") % K] = key
    idx[7] = -1
    sink = torch.full((H,), -1e4, device="cuda")
    for ns in (1, 2):
        got = SA._launch("bf16", q, idx, sink, kv, None, N, 0, 512 ** -0.5, ns, 64, 1, False, scores)
        want = kv[key].unsqueeze(1).expand(S, H, 512).clone()
        want[7] = 0
        assert torch.equal(got, want), ns
