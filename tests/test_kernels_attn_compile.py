"""Attention-path kernels on CPU (CI): sm_90a compiles, PTX contents, and the CPU model of the sparse
attention kernel's arithmetic (kernels/sparse_attn.emulate) against dsv4_references.attention.sparse_attn.

Nothing here runs a kernel: the kernels are compiled for sm_90a with fake tensors. The numerical tests run
`emulate`, a torch model of the kernel's order of operations (block tiling, the two 256-dim partial score
tiles, exp2-domain online softmax, bf16 P, fp32 accumulation, sink, KV splits and their combine), and the
producer's FP8 dequantisation on the real cache bytes.
"""
import os
import re
import shutil
import subprocess
import time

import pytest
import torch

pytest.importorskip("cutlass", reason="CuTeDSL (nvidia-cutlass-dsl 4.8.1) is not installed")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import dsv4_references as ref
from dsv4_kernels import kv_cache, sparse_attn
from dsv4_kernels._common import REGISTRY, compile_kernel, config_key

torch.set_num_threads(1)

SA_CI = [("sparse_attn", c) for c in REGISTRY["sparse_attn"].ci()] + [("sparse_attn_combine", {"d": 512})]


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


# ---- compile ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,cfg", SA_CI, ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in c.items())}" for n, c in SA_CI])
def test_compiles_for_hopper(name, cfg):
    from dsv4_kernels import _common
    _common._CACHE.pop((name, config_key(cfg), "sm_90a"), None)
    t0 = time.perf_counter()
    assert compile_kernel(name, "sm_90a", **cfg) is not None
    assert time.perf_counter() - t0 < 60


def test_wgmma_kernel_is_hopper_only_and_configs_are_checked():
    assert REGISTRY["sparse_attn"].archs == ("sm_90a",)
    with pytest.raises(ValueError, match="not declared"):
        compile_kernel("sparse_attn", "sm_100a", kv="fp8", bn=32, lookahead=2, split=False)
    with pytest.raises(ValueError):
        sparse_attn.SparseAttn(kv="fp4")
    with pytest.raises(ValueError, match="shared memory"):
        sparse_attn.SparseAttn(kv="fp8", bn=64, lookahead=4)
    with pytest.raises(ValueError, match="plain consumers"):
        sparse_attn.SparseAttn(kv="bf16", bn=64, scores="keys", pipelined=True)
    with pytest.raises(ValueError, match="bn=64"):
        sparse_attn.SparseAttn(kv="bf16", bn=32, scores="keys")
    assert sparse_attn.SparseAttn(kv="bf16", bn=64, lookahead=1).xchg_bufs == 1      # 64 KB tiles: one buffer
    assert sparse_attn.SparseAttn(kv="bf16", bn=32, lookahead=1).xchg_bufs == 2


def test_ptx_sparse_attn_block_of_64(ptx_of):
    """bn = 64: dims scores are m64n64 WGMMAs over 256 dims, keys scores m64n32 over all 512 dims (half the
    block's keys a consumer), and P.V covers all 64 keys (4 k steps, P from registers) either way; no local
    memory (the keys scheme's P halves are indexed statically)."""
    dims = ptx_of(sparse_attn._build, kv="bf16", bn=64, lookahead=1, split=False)
    keys = ptx_of(sparse_attn._build, kv="bf16", bn=64, lookahead=1, split=False, scores="keys")
    count = (lambda ptx, shape: sum(shape in ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln))
    assert count(dims, "m64n64k16.f32.bf16.bf16") == 16 and count(dims, "m64n256k16.f32.bf16.bf16") == 4
    assert count(keys, "m64n32k16.f32.bf16.bf16") == 32 and count(keys, "m64n256k16.f32.bf16.bf16") == 4
    assert ".local" not in dims and ".local" not in keys


@pytest.fixture(scope="module")
def fp8_ptx(ptx_of):
    return ptx_of(sparse_attn._build, kv="fp8", bn=32, lookahead=2, split=False)


def test_ptx_sparse_attn_fp8(fp8_ptx):
    ptx = fp8_ptx
    wg = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    qk = [ln for ln in wg if "m64n32k16.f32.bf16.bf16" in ln]
    pv = [ln for ln in wg if "m64n256k16.f32.bf16.bf16" in ln]
    assert len(qk) == 16 and len(pv) == 2 and len(wg) == 18         # 256/16 k-steps of S; 32/16 of P.V
    a_ops = [re.search(r"\}, \{([^}]*)\}", ln).group(1) for ln in pv]
    assert all(len(re.findall(r"%r\d+", a)) == 4 for a in a_ops)   # P.V: A (P) from registers
    assert "cvt.rn.f16x2.e4m3x2" in ptx                              # in-kernel FP8 dequantisation
    assert "cp.async.ca.shared.global" in ptx and "cp.async.cg.shared.global" in ptx
    assert "fence.proxy.async.shared::cta" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert ".local" not in ptx                                       # no local-memory arrays


def test_launch_defaults_are_registered_configurations():
    """What the launchers compile by default (lookahead and pipelining per KV format, split or not) is among the
    registered configurations, so `dsv4debug kernels compile` checks the kernels that actually run."""
    registered = {config_key(c) for c in REGISTRY["sparse_attn"].configs}
    for kv in ("fp8", "bf16"):
        for split in (False, True):
            assert config_key({**sparse_attn.launch_config(kv), "split": split}) in registered, (kv, split)


def test_pipelined_consumers_keep_one_p_v_in_flight(ptx_of):
    """bf16 with pipelined consumers: the same WGMMAs, a wait that leaves one group (the P.V) in flight, and one
    more tile stage in shared memory than the plain kernel; the FP8 kernel refuses the option."""
    plain = ptx_of(sparse_attn._build, kv="bf16", bn=32, lookahead=1, split=False)
    piped = ptx_of(sparse_attn._build, kv="bf16", bn=32, lookahead=1, split=False, pipelined=True)
    count = (lambda ptx, shape: sum(shape in ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln))
    for shape in ("m64n32k16.f32.bf16.bf16", "m64n256k16.f32.bf16.bf16"):
        assert count(piped, shape) > 0 and count(plain, shape) > 0
    leave_one = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+1;")
    assert leave_one.search(piped) and not leave_one.search(plain)
    assert (sparse_attn.SparseAttn(kv="bf16", lookahead=1, pipelined=True).kv_stages
            == sparse_attn.SparseAttn(kv="bf16", lookahead=1).kv_stages + 1)
    with pytest.raises(ValueError, match="kv='bf16' only"):
        sparse_attn.SparseAttn(kv="fp8", pipelined=True)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
def test_ptxas_registers_and_no_spills(fp8_ptx, tmp_path):
    # the DSL emits PTX ISA 9.4; the toolkit's ptxas may be older: CUDA 13.0 ptxas takes 9.0
    src = re.sub(r"^\.version \d+\.\d+", ".version 9.0", fp8_ptx, count=1, flags=re.MULTILINE)
    (tmp_path / "k.ptx").write_text(src)
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         check=False, capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "version" in out.stderr.lower():
        pytest.skip(f"ptxas refuses the PTX version: {out.stderr.strip()[:200]}")
    assert out.returncode == 0, out.stderr
    info = out.stderr + out.stdout
    assert "0 bytes spill stores, 0 bytes spill loads" in info
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    assert regs * sparse_attn.SparseAttn.threads <= 65536


# ---- the producer's FP8 dequantisation is exact --------------------------------------------------------------

def test_dequant_rows_is_kv_qat():
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(300, 512, generator=g) * torch.logspace(-3, 2, 300)[:, None]).bfloat16()
    kv[5, :64] = 0                                                   # all-zero block (amax floor)
    packed = kv_cache.reference_pack(kv)
    got = sparse_attn.dequant_rows(packed)
    assert torch.equal(got.view(torch.int16), kv_cache.reference_unpack(packed).view(torch.int16))
    assert torch.equal(got.view(torch.int16), ref.kv_qat(kv, 64).view(torch.int16))
    # re-quantising kv_qat'd rows is lossless, so the FP8 cache carries the flow's (QAT) KV exactly
    again = sparse_attn.dequant_rows(kv_cache.reference_pack(got))
    assert torch.equal(again.view(torch.int16), got.view(torch.int16))


# ---- CPU model against the reference -------------------------------------------------------------------------

def _problem(S, H, K, N, gen, q_gain=1.0, sink_gain=1.0, pad=0.1):
    q = (torch.randn(S, H, 512, generator=gen) * q_gain).bfloat16()
    kv = ref.kv_qat(torch.randn(N, 512, generator=gen).bfloat16(), 64)
    idx = torch.randint(0, N, (S, K), generator=gen)
    idx[torch.rand(S, K, generator=gen) < pad] = -1
    sink = torch.randn(H, generator=gen) * sink_gain
    return q, kv, idx, sink


@pytest.mark.parametrize("bn,scores", [(32, "dims"), (64, "dims"), (64, "keys")])
@pytest.mark.parametrize("q_gain", [1.0, 4.0])
@pytest.mark.parametrize("K", [128, 200, 640])
def test_emulate_matches_reference(K, q_gain, bn, scores):
    """The CPU model of every consumer scheme (block width, scores split by dims or by keys) is the reference."""
    g = torch.Generator().manual_seed(K)
    q, kv, idx, sink = _problem(6, 16, K, 900, g, q_gain=q_gain)
    scale = 512 ** -0.5
    want = ref.sparse_attn(q, kv, sink, idx, scale)
    got = sparse_attn.emulate(q, sparse_attn.rows_from_bf16(kv), idx, sink, scale, bn=bn, scores=scores)
    assert _cos(got, want) >= 0.9999
    assert (got.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()


def test_emulate_keys_split_keeps_a_sum_per_consumer():
    """scores="keys" sums each half of a block's probabilities on its own: a key in the second half alone
    (the first half all skipped) must give the same output as scoring it whole, and splits still agree."""
    g = torch.Generator().manual_seed(5)
    q, kv, idx, sink = _problem(4, 8, 256, 500, g)
    idx[:, :32] = -1                                                 # first half of the first block empty
    scale = 512 ** -0.5
    dims = sparse_attn.emulate(q, sparse_attn.rows_from_bf16(kv), idx, sink, scale, bn=64)
    for z in (1, 3):
        keys = sparse_attn.emulate(q, sparse_attn.rows_from_bf16(kv), idx, sink, scale, bn=64, num_splits=z,
                                   scores="keys")
        assert _cos(keys, dims) >= 0.99999


def test_emulate_splits_agree_and_empty_rows_give_zero():
    g = torch.Generator().manual_seed(1)
    q, kv, idx, sink = _problem(4, 8, 640, 700, g)
    idx[1] = -1                                                      # a token with no key at all
    idx[2, :400] = -1                                                # whole splits empty for this token
    scale = 512 ** -0.5
    want = ref.sparse_attn(q, kv, sink, idx, scale)
    assert float(want[1].float().abs().max()) == 0.0
    one = sparse_attn.emulate(q, sparse_attn.rows_from_bf16(kv), idx, sink, scale)
    for z in (2, 5, 20):
        many = sparse_attn.emulate(q, sparse_attn.rows_from_bf16(kv), idx, sink, scale, num_splits=z)
        assert _cos(many, want) >= 0.9999 and _cos(many, one) >= 0.99999
        assert float(many[1].float().abs().max()) == 0.0


def test_emulate_sink_is_raw_not_scaled():
    g = torch.Generator().manual_seed(2)
    q, kv, idx, _ = _problem(3, 8, 128, 300, g)
    sink = torch.linspace(-4, 6, 8)                                  # from negligible to dominant
    scale = 512 ** -0.5
    got = sparse_attn.emulate(q, sparse_attn.rows_from_bf16(kv), idx, sink, scale)
    assert _cos(got, ref.sparse_attn(q, kv, sink, idx, scale)) >= 0.9999
    assert _cos(got, ref.sparse_attn(q, kv, sink * scale, idx, scale)) < 0.999


def _paged(rows, block_size, gen):
    """rows [n, 512] -> (cache [nb, bs, 584] with shuffled blocks, slot of each row)."""
    n = rows.size(0)
    nb = max(1, -(-n // block_size))
    perm = torch.randperm(nb + 1, generator=gen)[:nb]
    cache = torch.zeros(nb + 1, block_size, sparse_attn.ROW_BYTES, dtype=torch.uint8)
    pos = torch.arange(n)
    slots = perm[pos // block_size] * block_size + pos % block_size
    cache.view(-1, sparse_attn.ROW_BYTES)[slots] = kv_cache.reference_pack(rows)
    return cache, slots


def test_emulate_fp8_paged_two_caches_matches_reference():
    """The serving layout: window KV and compressed entries in two paged FP8 caches, idx translated to slots
    (v < slots(A) in A, else B); the result equals the reference on the flow's joint KV (QAT rows)."""
    g = torch.Generator().manual_seed(3)
    S, T, H = 40, 10, 16
    win = ref.kv_qat(torch.randn(S, 512, generator=g).bfloat16(), 64)
    comp = ref.kv_qat(torch.randn(T, 512, generator=g).bfloat16(), 64)
    kv = torch.cat([win, comp])
    idx = ref.assemble_idxs(ref.window_idxs(S, 16), ref.causal_compressed_idxs(S, 4)[:, :T], S)
    q = torch.randn(S, H, 512, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    ca, sa = _paged(win, 16, g)
    cb, sb = _paged(comp, 16, g)
    n_a = ca.numel() // sparse_attn.ROW_BYTES
    slot_idx = torch.where(idx < 0, idx, torch.where(idx < S, sa[idx.clamp(0, S - 1)],
                                                     n_a + sb[(idx - S).clamp(0, T - 1)]))
    scale = 512 ** -0.5
    want = ref.sparse_attn(q, kv, sink, idx, scale)
    got = sparse_attn.emulate(q, sparse_attn.rows_from_fp8(ca, cb), slot_idx, sink, scale)
    assert _cos(got, want) >= 0.9999
    # slots past the end of B are skipped like -1
    bad = slot_idx.clone()
    bad[:, -1] = n_a + cb.numel() // sparse_attn.ROW_BYTES + 5
    skip = slot_idx.clone()
    skip[:, -1] = -1
    assert torch.equal(sparse_attn.emulate(q, sparse_attn.rows_from_fp8(ca, cb), bad, sink, scale),
                       sparse_attn.emulate(q, sparse_attn.rows_from_fp8(ca, cb), skip, sink, scale))


def test_choose_splits():
    assert sparse_attn.choose_splits(4096, 128, 1152) == 1          # prefill: many CTAs, partials only cost
    assert sparse_attn.choose_splits(64, 128, 1152) == 1             # 128 CTAs: one wave already
    assert sparse_attn.choose_splits(1, 64, 640) > 4                 # one token: split to fill the GPU
    assert sparse_attn.choose_splits(1, 128, 65664) == sparse_attn.MAX_SPLITS    # 16 splits of 129 blocks
    assert sparse_attn.choose_splits(1, 64, 1) == 1                  # one block: nothing to split


def test_dequantise_first_for_prefills_not_for_decodes_over_a_pool(monkeypatch):
    """dequant="auto": prefills (each cache row read by many tokens) dequantise the caches once, decodes over a
    long pool read rows once and dequantise in the kernel; chosen before any launch; forced by "first"/"kernel";
    "auto" is the default."""
    assert sparse_attn.dequant_first(4096, 128 + 1024, 4096 + 1024 + 128)          # Pro CSA prefill
    assert sparse_attn.dequant_first(4096, 128, 4096 + 64)                          # SWA prefill
    assert not sparse_attn.dequant_first(64, 1152, 64 * (128 + 16384))              # Pro CSA decode, 64 x 64K
    assert not sparse_attn.dequant_first(1, 1152, 1152)                             # one token
    assert not sparse_attn.dequant_first(1 << 20, 1152, (1 << 20) + 64)            # bf16 copy past 1 GiB
    ca, cb = kv_cache.new_cache(5, 64, device="cpu"), kv_cache.new_cache(2, 64, device="cpu")
    with pytest.raises(ValueError, match=r"out must be \[320, 512\] bf16"):
        kv_cache.dequantize_slots(ca, torch.empty(10, 512, dtype=torch.bfloat16))
    calls = []

    def launch(kv_fmt, q, idx, sink, src_a, src_b, n_a, n_b, *args):
        calls.append((kv_fmt, src_a.dtype, tuple(src_a.shape), n_a, n_b))
        return q

    def dequantize(cache, out, rope=64):
        out.copy_(kv_cache.reference_unpack(cache.view(-1, 584)))

    monkeypatch.setattr(sparse_attn, "_launch", launch)
    monkeypatch.setattr(kv_cache, "dequantize_slots", dequantize)
    q = torch.zeros(300, 4, 512, dtype=torch.bfloat16)
    idx = torch.zeros(300, 200, dtype=torch.int32)
    first, inkernel = ("bf16", torch.bfloat16, (448, 512), 448, 0), ("fp8", torch.uint8, (5, 64, 584), 320, 128)
    for mode, want in (("auto", first), ("first", first), ("kernel", inkernel), (None, first)):
        kw = {} if mode is None else {"dequant": mode}                 # the default: "auto" (timed 2026-12-07)
        sparse_attn.sparse_attn_fp8(q, idx, torch.zeros(4), ca, 0.1, cb, **kw)
        assert calls.pop() == want, mode
    sparse_attn.sparse_attn_fp8(q[:1], idx[:1], torch.zeros(4), ca, 0.1, cb, dequant="auto")   # one token
    assert calls.pop() == inkernel
    with pytest.raises(ValueError, match="dequant must be"):
        sparse_attn.sparse_attn_fp8(q, idx, torch.zeros(4), ca, 0.1, cb, dequant="once")


def test_split_cost_model_ranks_the_measured_decode_sweeps():
    """The forced-split sweeps (benchmarks/results: H200 2026-11-30, H100 2026-12-05 after the producer fixes,
    with the launch's own pick): in every decode case, the split count up to MAX_SPLITS that the cost model ranks
    cheapest among those measured ran within 15% of the fastest one measured, and the sum over the cases is
    within 2% of the best (the old K / 448 heuristic was 1.8x slower in sum)."""
    for name in ("attention.json", "attention-h100-2026-12-05.json"):
        _replay_split_sweeps(name)


def _replay_split_sweeps(name: str):
    import json
    from pathlib import Path
    res = json.loads((Path(__file__).parents[1] / "benchmarks/results" / name).read_text())

    def sweeps(o):
        if isinstance(o, dict):
            if "split_sweep_s" in o:
                yield o
            for v in o.values():
                yield from sweeps(v)
        elif isinstance(o, list):
            for v in o:
                yield from sweeps(v)

    best_sum = pick_sum = 0.0
    cases = list(sweeps(res))
    assert len(cases) >= 18
    for r in cases:
        hp = -(-r["H"] // 64) * 64
        measured = {int(z): t for z, t in r["split_sweep_s"].items()}
        if "splits_auto" in r and r["splits_auto"] <= sparse_attn.MAX_SPLITS:
            measured.setdefault(r["splits_auto"], r["kernel_s"])
        pick = min(measured, key=lambda z: (sparse_attn.split_cost_us(r["S"], hp, r["K"], z), z))
        best = min(measured.values())
        assert measured[pick] <= 1.15 * best, (r["shape"], r["layer"], r["S"], pick, measured)
        best_sum += best
        pick_sum += measured[pick]
    assert pick_sum <= 1.02 * best_sum


def test_roofline_of_the_speed_bars():
    """Pro decode does 128 heads x 4 x 512 FLOP a 584-byte FP8 key (449 FLOP/B): 60% of a 4.19 TB/s copy on its
    KV bytes asks 1129 TFLOP/s, more than the 989 TFLOP/s bf16 spec; Flash's 64 heads ask half. A kernel that
    runs at the slower of the two limits is at 100% of the roofline."""
    from dsv4_kernels.check_attn import roofline
    peaks = {"copy_gbps": 4190.0, "cublas_bf16_tflops": 770.0}
    pro = roofline(128 * 4 * 512, 584, 1.0, peaks)
    assert pro["flop_per_byte"] == pytest.approx(448.9, abs=0.1)
    assert pro["tflops_for_copy_bar"] == pytest.approx(0.6 * 4190 * 128 * 4 * 512 / 584 / 1000)
    assert pro["tflops_for_copy_bar"] > 989
    assert roofline(64 * 4 * 512, 584, 1.0, peaks)["tflops_for_copy_bar"] == pytest.approx(pro["tflops_for_copy_bar"] / 2)
    fl, nb = 1e12, 1e9                               # MMA-bound: 1.30 ms of MMAs against 0.24 ms of copy
    at_roof = roofline(fl, nb, fl / 770e12, peaks)
    assert at_roof["pct_of_roofline"] == pytest.approx(100.0)
    assert roofline(fl, nb, 2 * fl / 770e12, peaks)["pct_of_roofline"] == pytest.approx(50.0)


def test_paged_glue_with_torch_stand_ins(monkeypatch):
    """sparse_attn_paged (the kernels backend's op): paging of window and compressed rows, slot translation,
    skipped ids; the two kernels replaced by torch stand-ins (reference_pack, emulate)."""
    def write(kv, slots, cache, rope=64):
        cache.view(-1, cache.size(-1))[slots] = kv_cache.reference_pack(kv, rope)
        return cache

    seen = {}

    def fp8(q, slot, sink, ca, scale, cb=None, num_splits=None):
        seen["slot"] = slot
        return sparse_attn.emulate(q, sparse_attn.rows_from_fp8(ca, cb), slot, sink, scale)

    monkeypatch.setattr(kv_cache, "write", write)
    monkeypatch.setattr(sparse_attn, "sparse_attn_fp8", fp8)
    g = torch.Generator().manual_seed(4)
    for S, ratio in ((70, 4), (70, 128), (150, 0)):
        T = S // ratio if ratio else 0
        kv = ref.kv_qat(torch.randn(S + T, 512, generator=g).bfloat16(), 64)
        idx = ref.window_idxs(S, 128)
        if ratio:
            idx = ref.assemble_idxs(idx, ref.causal_compressed_idxs(S, ratio), S)
        q = torch.randn(S, 4, 512, generator=g).bfloat16()
        sink = torch.randn(4, generator=g)
        got = sparse_attn.sparse_attn_paged(q, kv, sink, idx, 512 ** -0.5, block_size=16, generator=g)
        want = ref.sparse_attn(q, kv, sink, idx, 512 ** -0.5)
        assert _cos(got, want) >= 0.9999, (S, ratio)
        assert torch.equal(seen["slot"] < 0, idx < 0)


@pytest.fixture
def torch_attn_kernels(monkeypatch):
    """The attention kernels replaced by their CPU models (emulate on the caches / rows they would read)."""
    def write(kv, slots, cache, rope=64):
        cache.view(-1, cache.size(-1))[slots] = kv_cache.reference_pack(kv, rope)
        return cache

    def fp8(q, slot, sink, ca, scale, cb=None, num_splits=None, dequant="auto"):   # either way the same output
        return sparse_attn.emulate(q, sparse_attn.rows_from_fp8(ca, cb), slot, sink, scale,
                                   num_splits=num_splits or 1)

    def bf16(q, kv, idx, sink, scale, num_splits=None, bn=32):
        return sparse_attn.emulate(q, sparse_attn.rows_from_bf16(kv), idx, sink, scale, num_splits=num_splits or 1)

    monkeypatch.setattr(kv_cache, "write", write)
    monkeypatch.setattr(sparse_attn, "sparse_attn_fp8", fp8)
    monkeypatch.setattr(sparse_attn, "sparse_attn_bf16", bf16)


def test_check_harness_dry_run_on_cpu(torch_attn_kernels):
    from dsv4_kernels import check_attn as C
    probe = C.single_key_probe("flash", S=8, device="cpu")
    assert probe["passed"], probe
    for layer in ("swa", "hca", "csa"):
        p = C.make_prefill("flash", layer, 300, device="cpu")
        p["q"] = p["q"][-6:]                                             # the last tokens see the most keys
        p["idx"], p["S"] = p["idx"][-6:], 6
        for fmt, ns in (("fp8", None), ("bf16", 3)):
            row = C.check_case(p, fmt, ns)
            assert row["passed"], row
        assert row["K"] == {"swa": 128, "hca": 128 + 2, "csa": 128 + 75}[layer]
    d = C.make_decode("pro", "csa", B=2, L=4096, device="cpu")
    assert d["idx"].shape == (2, 128 + 1024) and C.flops(d) == 2 * 1152 * 128 * 2048
    d["q"] = d["q"][:, :8]
    d["sink"], d["H"] = d["sink"][:8], 8
    assert C.check_case(d, "fp8", 4)["passed"]
    # the torch baseline is the same math
    assert C.cos(C.torch_baseline(d), ref.sparse_attn(d["q"], d["kv"], d["sink"], d["idx"], 512 ** -0.5)) > 0.9999


def test_check_bars_catch_a_wrong_kernel(torch_attn_kernels, monkeypatch):
    from dsv4_kernels import check_attn as C
    good = sparse_attn.sparse_attn_fp8

    def sink_scaled(q, slot, sink, ca, scale, cb=None, num_splits=None):  # a classic bug: sink * scale
        return good(q, slot, sink * scale, ca, scale, cb, num_splits)

    def dropped_rope(q, slot, sink, ca, scale, cb=None, num_splits=None):  # a layout bug: rope dims lost
        o = good(q, slot, sink, ca, scale, cb, num_splits).clone()
        o[..., 448:] = 0
        return o

    p = C.make_prefill("flash", "hca", 300, device="cpu")
    p["q"], p["idx"], p["S"] = p["q"][-4:], p["idx"][-4:], 4
    p["sink"] = p["sink"] * 3
    for bad in (sink_scaled, dropped_rope):
        monkeypatch.setattr(sparse_attn, "sparse_attn_fp8", bad)
        assert not C.check_case(p, "fp8")["passed"], bad.__name__
    monkeypatch.setattr(sparse_attn, "sparse_attn_fp8", dropped_rope)
    assert not C.single_key_probe("flash", S=4, device="cpu")["passed"]


# ---- indexer: compile and CPU models ------------------------------------------------------------------------

@pytest.mark.parametrize("name,cfg", [("indexer_scores", {"tokens_per_cta": 32}), ("indexer_topk", {})])
def test_indexer_compiles_for_hopper(name, cfg):
    from dsv4_kernels import _common, indexer  # noqa: F401 - registers the kernels
    _common._CACHE.pop((name, config_key(cfg), "sm_90a"), None)
    assert compile_kernel(name, "sm_90a", **cfg) is not None


def test_indexer_ptx(ptx_of):
    from dsv4_kernels import indexer
    ptx = ptx_of(indexer._build_scores)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 8     # K = 128
    assert "cvt.rn.bf16.f32" in ptx                   # the reference's bf16 rounding points are kept
    top = ptx_of(indexer._build_topk)
    assert "atom.shared.cta.add" in top and "vote.sync.ballot" in top and "popc" in top


def _indexer_problem(S, T, gen, ratio=4):
    import dsv4_references as ref
    q = ref.indexer_q(torch.randn(S, 64, 128, generator=gen).bfloat16(),
                      ref.rope_freqs(S, 64, 160000.0, 65536, 16.0))
    k = ref.fp4_sim(ref.rotate_activation(torch.randn(T, 128, generator=gen).bfloat16()), 32)
    w = (torch.randn(S, 64, generator=gen) * 0.5).bfloat16() * (128 ** -0.5 * 64 ** -0.5)
    return q, k, w


def test_scores_model_is_the_reference():
    """The scores kernel's rounding points are the reference's: the model equals the bf16 reference except
    for fp32 summation order (at most one bf16 rounding apart, almost always identical)."""
    from dsv4_kernels import indexer
    g = torch.Generator().manual_seed(5)
    S, T = 40, 10
    q, k, w = _indexer_problem(S, T, g)
    want = ref.indexer_scores(q, k, w, 4)
    got = indexer.scores_model(q, k, w, 4)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    d = (got[fin].float() - want[fin].float()).abs()
    assert float(d.max()) <= 2 ** -8 * float(want[fin].float().abs().max())
    assert float((d == 0).float().mean()) > 0.9


@pytest.mark.parametrize("ratio", [0, 4])
def test_topk_model_selects_torch_topk_values(ratio):
    """Same multiset of selected scores as torch.topk (ties at the k-th value may pick other ids), -1 where
    fewer than k entries are finite; ids above the k-th value first, then the tied ones, each ascending."""
    from dsv4_kernels import indexer
    g = torch.Generator().manual_seed(6)
    S, T, k = 300, 700, 64
    scores = torch.randn(S, T, generator=g).bfloat16()                # bf16: many exact ties
    scores[:, ::7] = scores[:, 3:4]                                     # more ties
    if ratio:
        vis = torch.arange(T)[None, :] < (torch.arange(S)[:, None] + 1) // ratio
        scores = scores.masked_fill(~vis, float("-inf"))
    scores[5, :] = float("-inf")
    got = indexer.topk_model(scores, k, ratio)
    want = ref.indexer_topk(scores, k)
    assert got.shape == want.shape
    assert torch.equal((got < 0).sum(1), (want < 0).sum(1))
    for s in range(S):
        gi, wi = got[s][got[s] >= 0], want[s][want[s] >= 0]
        vals = scores[s, gi].float()
        assert torch.equal(vals.sort().values, scores[s, wi].float().sort().values)
        if int(torch.isfinite(scores[s].float()).sum()) <= k:   # every finite entry: ascending ids
            assert torch.equal(gi, gi.sort().values)
        else:                                         # ids above the k-th value, then the tied ones, ascending
            above = vals > vals.min()
            n_above = int(above.sum())
            assert bool(above[:n_above].all())
            for part in (gi[:n_above], gi[n_above:]):
                assert torch.equal(part, part.sort().values)


def test_topk_model_without_ties_is_exactly_the_set():
    from dsv4_kernels import indexer
    g = torch.Generator().manual_seed(7)
    S, T, k = 50, 2000, 512
    perm = torch.stack([torch.randperm(T, generator=g) for _ in range(S)])
    scores = (perm.to(torch.int16) + 0x3000).view(torch.bfloat16)      # consecutive bf16 patterns: distinct
    got = indexer.topk_model(scores, k)
    want = ref.indexer_topk(scores, k)
    assert torch.equal(got.sort(1).values, want.sort(1).values)


def test_indexer_check_dry_run_on_cpu(monkeypatch):
    """The indexer check with the kernels replaced by their CPU models passes; a top-k kernel that breaks
    ties differently from its model, or a scores kernel that drops the relu, fails it."""
    from dsv4_kernels import check_attn as C
    from dsv4_kernels import indexer as IX
    monkeypatch.setattr(IX, "indexer_scores", lambda q, k, w, ratio, tokens_per_cta=32: IX.scores_model(q, k, w, ratio))
    monkeypatch.setattr(IX, "indexer_topk", lambda s, k, ratio=0: IX.topk_model(s, k, ratio))
    p = C.make_indexer("flash", 600, device="cpu")
    p["topk"] = 64
    row = C.check_indexer(p)
    assert row["passed"], row
    monkeypatch.setattr(IX, "indexer_topk", lambda s, k, ratio=0: ref.indexer_topk(s, k))
    assert not C.check_indexer(p)["topk_kernel_equals_model"]
    monkeypatch.setattr(IX, "indexer_topk", lambda s, k, ratio=0: IX.topk_model(s, k, ratio))
    monkeypatch.setattr(IX, "indexer_scores", lambda q, k, w, ratio, tokens_per_cta=32:
                        ref.indexer_scores(q, k, w, ratio) + ref.indexer_scores(-q, k, w, ratio))
    assert not C.check_indexer(p)["passed"]


def test_scores_op_pads_heads_and_scales_weights(monkeypatch):
    """The backend's indexer_scores glue (weight scale in bf16, heads padded to 64) on the kernel's CPU model
    equals the reference backend's op up to summation order."""
    from dsv4_kernels import indexer as IX
    monkeypatch.setattr(IX, "indexer_scores", lambda q, k, w, ratio, tokens_per_cta=32: IX.scores_model(q, k, w, ratio))
    g = torch.Generator().manual_seed(11)
    S, T, IH = 60, 15, 4
    q = torch.randn(S, IH, 128, generator=g).bfloat16()
    k = torch.randn(T, 128, generator=g).bfloat16()
    w = torch.randn(S, IH, generator=g).bfloat16()
    scale = 128 ** -0.5 * IH ** -0.5
    got = IX.scores_op(q, k, w, 4, scale)
    want = ref.indexer_scores(q, k, w * scale, 4)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert float((got[fin].float() - want[fin].float()).abs().max()) <= 2 ** -8 * float(want[fin].float().abs().max())
    with pytest.raises(ValueError):
        IX.scores_op(torch.zeros(2, 65, 128).bfloat16(), k, torch.zeros(2, 65).bfloat16(), 4, 1.0)


# ---- compressor ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [{"dc": 512, "ratio": 4, "post": "fp8"}, {"dc": 512, "ratio": 128, "post": "fp8"},
                                 {"dc": 128, "ratio": 4, "post": "hadamard_fp4"}])
def test_compress_pool_compiles(cfg):
    from dsv4_kernels import _common, compressor  # noqa: F401 - registers the kernel
    for arch in ("sm_90a", "sm_100a"):
        _common._CACHE.pop(("compress_pool", config_key(cfg), arch), None)
        assert compile_kernel("compress_pool", arch, **cfg) is not None


def test_kernel_hadamard_order_is_sylvester():
    from dsv4_kernels import compressor as CP
    g = torch.Generator().manual_seed(12)
    x = torch.randn(5, 128, generator=g, dtype=torch.float64)
    want = ref.rotate_activation(x) * 128 ** 0.5
    assert torch.allclose(CP.fwht_lanes_model(x), want, atol=1e-10)


def _compressor_problem(S, D, dc, ratio, gen):
    c = 2 if ratio == 4 else 1
    x = torch.randn(S, D, generator=gen).bfloat16()
    wkv = (torch.randn(c * dc, D, generator=gen) * D ** -0.5).bfloat16()
    wgate = (torch.randn(c * dc, D, generator=gen) * D ** -0.5).bfloat16()
    ape = torch.randn(ratio, c * dc, generator=gen) * 0.3
    norm_w = 1 + 0.1 * torch.randn(dc, generator=gen)
    freqs = ref.rope_freqs(S, 64, 160000.0, 65536, 16.0)
    return x, wkv, wgate, ape, norm_w, freqs


@pytest.mark.parametrize("dc,ratio,rotate,qat", [(512, 4, False, True), (512, 128, False, True),
                                                 (128, 4, True, True), (512, 4, False, False),
                                                 (128, 4, True, False)])
def test_compress_model_matches_reference(monkeypatch, dc, ratio, rotate, qat):
    """compress_op (torch fp32 projections + the pooling kernel) with the kernel replaced by its CPU model
    equals dsv4_references.compress up to fp32 summation order."""
    from dsv4_kernels import compressor as CP
    monkeypatch.setattr(CP, "compress_pool", CP.pool_model)
    g = torch.Generator().manual_seed(dc + ratio)
    S = 2 * ratio * 4 + 3                                             # a partial block at the end
    x, wkv, wgate, ape, norm_w, freqs = _compressor_problem(S, 256, dc, ratio, g)
    want = ref.compress(x, wkv.float(), wgate.float(), ape, norm_w, freqs, ratio, 64, 1e-6, rotate, qat)
    got = CP.compress_op(x, wkv, wgate, ape, norm_w, freqs, ratio, 64, 1e-6, rotate, qat)
    assert got.shape == want.shape == (S // ratio, dc) and got.dtype == torch.bfloat16
    assert _cos(got, want) >= 0.9999
    assert float((got == want).float().mean()) >= 0.9


@pytest.mark.parametrize("qat", [True, False])
def test_indexer_q_compiles_and_model_matches_reference(qat):
    from dsv4_kernels import _common
    from dsv4_kernels import compressor as CP
    _common._CACHE.pop(("indexer_q", config_key({"qat": qat}), "sm_90a"), None)
    assert compile_kernel("indexer_q", "sm_90a", qat=qat) is not None
    g = torch.Generator().manual_seed(13)
    S, IH = 50, 8
    q = torch.randn(S, IH, 128, generator=g).bfloat16()
    freqs = ref.rope_freqs(S, 64, 160000.0, 65536, 16.0)
    want = ref.indexer_q(q, freqs, qat)
    got = CP.indexer_q_model(q, freqs, qat)
    assert _cos(got, want) >= 0.9999 and float((got == want).float().mean()) >= 0.95


def test_bench_script_dry_run_on_cpu(torch_attn_kernels, monkeypatch, tmp_path):
    """benchmarks/bench_attention.py's phases on the CPU at toy sizes, kernels replaced by their models, CUDA
    timing by a wall clock: catches plumbing errors before GPU time is spent on them."""
    import importlib.util
    import time as _time

    from dsv4_kernels import check_attn as C
    from dsv4_kernels import compressor as CP
    from dsv4_kernels import indexer as IX
    spec = importlib.util.spec_from_file_location("bench_attention", os.path.join(
        os.path.dirname(__file__), "..", "benchmarks", "bench_attention.py"))
    B = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(B)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(IX, "indexer_scores", lambda q, k, w, ratio, tokens_per_cta=32: IX.scores_model(q, k, w, ratio))
    monkeypatch.setattr(IX, "indexer_topk", lambda s, k, ratio=0: IX.topk_model(s, k, ratio))
    monkeypatch.setattr(CP, "compress_pool", CP.pool_model)
    monkeypatch.setattr(CP, "bf16_gemm_f32", lambda x, w: x.float() @ w.float().T)
    mp, md, mi, mc = C.make_prefill, C.make_decode, C.make_indexer, C.make_compressor

    def small_prefill(shape, layer, S, device="cuda", seed=0, qat=True):
        p = mp(shape, layer, 300, device="cpu", seed=seed, qat=qat)
        p["q"], p["idx"], p["S"] = p["q"][-3:, :8], p["idx"][-3:], 3
        p["sink"], p["H"] = p["sink"][:8], 8
        return p

    def small_decode(shape, layer, B_, L, device="cuda", seed=0):
        p = md(shape, layer, 2, 600, device="cpu", seed=seed)
        p["q"], p["sink"], p["H"] = p["q"][:, :8], p["sink"][:8], 8
        return p

    def timer(fn, reps=1, graph=True):
        t = _time.perf_counter()
        fn()
        return _time.perf_counter() - t, "cpu"

    monkeypatch.setattr(C, "make_prefill", small_prefill)
    monkeypatch.setattr(C, "make_decode", small_decode)
    monkeypatch.setattr(C, "make_indexer", lambda shape, S, device="cuda", seed=0: {**mi(shape, 256, device="cpu", seed=seed), "topk": 16})
    monkeypatch.setattr(C, "make_compressor", lambda shape, kind, S, device="cuda", seed=0: mc(shape, kind, 256 + 3, device="cpu", seed=seed))
    monkeypatch.setattr(C, "time_fn", timer)
    monkeypatch.setattr(C, "device_peaks", lambda: {"cublas_bf16_tflops": 700.0, "copy_gbps": 4300.0,
                                                    "spec_bf16_dense_tflops": 989.4})
    monkeypatch.setattr("dsv4_kernels.check.environment", lambda: {"dry_run": True})
    monkeypatch.setattr("dsv4_kernels._common.compile_kernel", lambda *a, **k: True)
    monkeypatch.setattr(C, "single_key_probe", lambda *a, **k: {"passed": True, "dry_run": True})
    for phase in ("smoke", "check", "bench"):
        res = B.run_phase(phase, tmp_path)
        assert "error" not in res, res.get("traceback")
        if phase != "bench":
            assert res["passed"], [r for r in res["rows"] if not r.get("passed")]
        else:
            assert all("error" not in r for r in res["rows"]), [r for r in res["rows"] if "error" in r][:1]
        assert (tmp_path / f"{phase}.json").exists() and (tmp_path / f"{phase}.partial.json").exists()


def test_bf16_gemm_f32_compiles_and_accumulates(ptx_of):
    from dsv4_kernels import _common
    from dsv4_kernels import compressor as CP
    _common._CACHE.pop(("bf16_gemm_f32", (), "sm_90a"), None)
    assert compile_kernel("bf16_gemm_f32", "sm_90a") is not None
    ptx = ptx_of(CP._build_gemm)
    wg = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert len(wg) == 4 and all("m64n128k16.f32.bf16.bf16" in ln for ln in wg)
    assert "cp.async.bulk.tensor.2d" in ptx
    # the scale-d predicate of every WGMMA is a constant 1: each k-block accumulates into the zeroed acc
    preds = re.findall(r"setp.ne.b32 p, (%r\d+), 0;", ptx)
    assert preds and all(re.search(rf"mov.b32 \t{re.escape(r)}, 1;", ptx) for r in set(preds))
