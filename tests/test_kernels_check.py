"""Dry run of the GPU check harness on the CPU: every kernel launcher replaced by a torch stand-in computing
the same values, so the harness itself (shapes, bars, table) is exercised without a GPU."""
import dsv4_references as ref
import pytest
import torch

from dsv4debug.backends.sim import nvfp4_act_quant

pytest.importorskip("cutlass", reason="CuTeDSL is not installed")

from dsv4_kernels import check, kv_cache, mhc, norm, nvfp4, rope

MINE = ("norm", "rope", "nvfp4", "kv_cache", "mhc")


@pytest.fixture
def torch_kernels(monkeypatch):
    bf = torch.bfloat16
    monkeypatch.setattr(norm, "rms_norm", lambda x, w, eps, out=None: ref.rms_norm(x.float(), w, eps).to(bf))
    monkeypatch.setattr(norm, "head_rms_norm", lambda q, eps, out=None: ref.head_rms_norm(q.float(), eps).to(bf))
    monkeypatch.setattr(rope, "rope", lambda x, f, inverse=False, out=None: ref.apply_rope(x, f, inverse))
    monkeypatch.setattr(rope, "rope_", lambda x, f, inverse=False: x.copy_(ref.apply_rope(x, f, inverse)))
    monkeypatch.setattr(nvfp4, "quantize", lambda x, g=None: nvfp4.reference_quantize(x, g))
    monkeypatch.setattr(nvfp4, "dequantize", lambda c, s, g, out=None: nvfp4.reference_dequantize(c, s, g))
    monkeypatch.setattr(nvfp4, "act_quant", nvfp4_act_quant)
    monkeypatch.setattr(nvfp4, "amax", lambda x: x.float().abs().amax().reshape(1))

    def write(kv, slots, cache, r=64):
        cache.view(-1, cache.size(-1))[slots] = kv_cache.reference_pack(kv, r)
        return cache

    def read_into(cache, bt, lens, starts, out, max_len, r=64):
        bs = cache.size(1)
        pos = torch.arange(max_len)
        slots = bt[0].long()[pos // bs] * bs + pos % bs
        return out.copy_(kv_cache.reference_unpack(cache.view(-1, cache.size(-1))[slots], r))

    monkeypatch.setattr(kv_cache, "write", write)
    monkeypatch.setattr(kv_cache, "read_into", read_into)
    monkeypatch.setattr(kv_cache, "round_trip", lambda kv, r=64, bs=64, generator=None: (ref.kv_qat(kv, r), None, None))

    def hc_pre(x, fn, scale, base, iters, neps, heps, fused=False):
        y, p, c = ref.hc_pre(x.float(), fn, scale, base, iters, neps, heps)
        return y.to(bf), p, c

    def hc_pre_apply(x, mixes, scale, base, iters, heps):
        y, p, c = ref.hc_pre_apply(x.float(), mixes, scale, base, iters, heps)
        return y.to(bf), p, c

    from dsv4_references.mhc import _mixes
    monkeypatch.setattr(mhc, "hc_pre", hc_pre)
    monkeypatch.setattr(mhc, "hc_pre_apply", hc_pre_apply)
    monkeypatch.setattr(mhc, "hc_mixes", lambda x, fn, eps: _mixes(x.float(), fn, eps))
    monkeypatch.setattr(mhc, "hc_post", lambda a, r, p, c: ref.hc_post(a.float(), r.float(), p, c).to(bf))
    monkeypatch.setattr(mhc, "hc_head",
                        lambda x, fn, s, b, ne, he, fused=False: ref.hc_head(x.float(), fn, s, b, ne, he).to(bf))


def test_check_harness_dry_run_on_cpu(torch_kernels):
    doc = check.run_checks("tiny", seq=70, do_bench=False, log=lambda s: None, device="cpu", families=MINE)
    failed = [(r["op"], r["case"], r["bar"], r["note"]) for r in doc["rows"] if not r["passed"]]
    assert not failed
    assert len(doc["rows"]) == 25
    lines = check.format_rows(doc)
    assert len(lines) >= 26


def test_bars_catch_a_wrong_kernel(torch_kernels, monkeypatch):
    """A kernel that is off by one bf16 ulp everywhere, or writes a wrong byte, must fail its bar."""
    bf = torch.bfloat16
    monkeypatch.setattr(norm, "rms_norm",
                        lambda x, w, eps, out=None: (ref.rms_norm(x.float(), w, eps) * (1 + 2 ** -6)).to(bf))

    def bad_pack(kv, r=64):
        p = kv_cache.reference_pack(kv, r).clone()
        p[3, 10] ^= 1
        return p
    def bad_write(kv, slots, cache, r=64):
        cache.view(-1, cache.size(-1)).index_copy_(0, slots, bad_pack(kv, r))
        return cache
    monkeypatch.setattr(kv_cache, "write", bad_write)
    doc = check.run_checks("tiny", seq=70, do_bench=False, log=lambda s: None, device="cpu", families=MINE)
    bad = {(r["op"], r["case"]) for r in doc["rows"] if not r["passed"]}
    assert ("rms_norm", "attn_norm") in bad
    assert ("kv_cache", "quantise + paged write") in bad


def test_bench_paths_dry_run_on_cpu(torch_kernels, monkeypatch):
    """--bench: every kernel closure and torch baseline is called (timing faked: CUDA events need a GPU)."""
    calls = []

    def fake_time(fn, nsets, reps=20):
        for i in range(nsets):
            fn(i)
        calls.append(nsets)
        return {"us": 1.0 + len(calls), "eager_us": 2.0, "mode": "fake"}
    monkeypatch.setattr(check, "time_fn", fake_time)
    monkeypatch.setattr(check, "copy_bandwidth", lambda: {"bytes_per_copy": 1, "us": 1.0, "GBps": 4300.0})
    monkeypatch.setattr(check, "compiled", lambda fn: fn)
    doc = check.run_checks("tiny", seq=70, do_bench=True, log=lambda s: None, device="cpu", families=MINE)
    benched = [r for r in doc["rows"] if r["bench"]]
    assert all("error" not in r["bench"] for r in benched), [r["bench"] for r in benched if "error" in r["bench"]]
    for r in benched:
        assert not any("error" in b for b in r["bench"]["baselines"].values()), (r["case"], r["bench"])
        assert r["bench"]["speedup"] > 0 and "compiled" in r["bench"]["baselines"]
        assert r["bench"]["of_copy_same_bytes"] > 0 and r["bench"]["copy_same_bytes"]["mode"] == "fake"
    assert len(benched) >= 16
    assert any("% copy" in line or "%copy" in line for line in check.format_rows(doc))


def test_families_without_a_kernel_for_the_gpu_say_so(torch_kernels):
    """On a Blackwell (sm_100a) the Hopper-only GEMMs are not built: their family gets a row saying so (listed
    under `not_run`, shown as skip) instead of a crash at the first launch or a silent gap; the others run.
    On the Hopper every family has its kernels."""
    from dsv4_kernels import load_all
    load_all()
    from dsv4_kernels._common import REGISTRY
    assert set(check.Checker.KERNELS) == set(check.Checker.FAMILIES)
    assert all(k in REGISTRY for kernels in check.Checker.KERNELS.values() for k in kernels)
    chk = check.Checker("tiny", 70, False, log=lambda s: None, device="cpu")
    assert all(chk.not_built(f) == [] for f in check.Checker.FAMILIES)          # CPU dry run: all stand-ins
    chk.arch = "sm_90a"
    assert all(chk.not_built(f) == [] for f in check.Checker.FAMILIES)
    chk.arch = "sm_100a"
    assert chk.not_built("gemm") == ["fp8_block_gemm", "w4a16_gemm"] and chk.not_built("norm") == []
    rows = chk.run(("norm", "gemm"))
    gemm = [r for r in rows if r.op == "gemm"]
    assert len(gemm) == 1 and gemm[0].passed and gemm[0].not_run == "fp8_block_gemm, w4a16_gemm: built for sm_90a only"
    assert all(r.passed and not r.not_run for r in rows if r.op != "gemm") and len(rows) > 1
    doc = {"rows": [r.as_dict() for r in rows], "bench": False}
    lines = check.format_rows(doc)
    assert any(" skip" in ln and "not built for sm_100a" in ln for ln in lines)
    assert any("not run: fp8_block_gemm" in ln for ln in lines)
