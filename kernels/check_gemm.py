"""GPU checks and benchmarks of the GEMM kernels (FP8 block-scaled linear, NVFP4 W4A16 linear, grouped MoE).

Rows use kernels/check.py's Row, so `dsv4debug kernels check` can list them with the other kernels
(`check_gemms(checker)`); `benchmarks/bench_gemm.py` runs the full side-by-side benchmark.

Bars (issue 7):
- FP8 linear: relative L2 error against the fp64 product of the exact operands no more than 1.1 x what the
  `sim` backend's pipeline gives (sim.fp8_act_quant + bf16 GEMM on the dequantised weight), cosine against
  sim >= 0.9999, no NaN; the activation quantiser bit-identical to sim.fp8_act_quant.
- W4A16 linear and the MoE: cosine against the reference op on the dequantised weights >= 0.999, no NaN.
Timing: CUDA-graph replay, median, weights rotated over sets larger than L2; baselines in the same run:
cuBLAS BF16 (torch) on the dequantised weights, and for the MoE a loop of per-expert cuBLAS BF16 GEMMs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ._common import sm_count
from .check import Row, compare, n_sets, time_fn

# (name, out, in) of the FP8 linears of one layer and the NVFP4 expert projections
FP8_SHAPES = {
    "pro": [("wq_a", 1536, 7168), ("wq_b", 65536, 1536), ("wkv", 512, 7168), ("wo_b", 7168, 16384),
            ("shared.w1", 3072, 7168), ("shared.w2", 7168, 3072)],
    "flash": [("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("wo_b", 4096, 8192),
              ("shared.w1", 2048, 4096), ("shared.w2", 4096, 2048)],
}
W4_SHAPES = {
    "pro": [("expert.w1", 3072, 7168), ("expert.w2", 7168, 3072)],
    "flash": [("expert.w1", 2048, 4096), ("expert.w2", 4096, 2048)],
}
MOE_DIMS = {"pro": {"E": 384, "D": 7168, "I": 3072, "k": 6}, "flash": {"E": 256, "D": 4096, "I": 2048, "k": 6}}
LIMIT = 10.0


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _randn(shape, gen, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


# --------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------

def rand_fp8_weight(n: int, k: int, gen):
    from dsv4debug.formats import fp8_block_dequantize, fp8_block_quantize
    w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
    # a few blocks with larger/smaller scales, as real checkpoints have
    w[:128] *= 8.0
    w[-128:, :128] *= 1 / 16
    q, s = fp8_block_quantize(w)
    return q, s, fp8_block_dequantize(q, s)


def rand_nvfp4_weight(n: int, k: int, gen):
    from dsv4debug.formats import nvfp4_dequantize, nvfp4_quantize
    w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
    w[:, :16] = 0.0                                  # an all-zero block
    q, ws, s2 = nvfp4_quantize(w)
    return q, ws, s2, nvfp4_dequantize(q, ws, s2)


def rand_pack_fast(E: int, n: int, k: int, gen):
    """Random packed NVFP4 weights of the kernels' layout (random codes, realistic block scales), E experts:
    timing data for full-size layers, no quantiser pass."""
    blob = torch.randint(-2 ** 31, 2 ** 31 - 1, (E, n // 64, k // 64, 4, 32, 4), dtype=torch.int32,
                         device="cuda", generator=gen)
    sblob = torch.randint(60, 110, (E, n // 64, k // 64, 4, 8, 8), dtype=torch.uint8, device="cuda",
                          generator=gen)
    gs = torch.full((E,), 2.0 ** -10, device="cuda")
    return blob, sblob, gs


# --------------------------------------------------------------------------------------------------------
# FP8 linear
# --------------------------------------------------------------------------------------------------------

def fp8_configs(m: int, n: int, k: int) -> list:
    """The configurations a row checks and times: each tile width whole, K in two parts, A shared by clusters
    of two along N, what pick_config chooses (first), the same without a cluster and in plain launch order
    (one row of tiles after another, the raster before tile groups)."""
    from . import gemm_fp8 as K
    picked = K.pick_config(m, n, k, sm_count("cuda"))
    cands = [K.Fp8Config(t) for t in K.TILE_NS] + [K.Fp8Config(t, 1, 2) for t in K.TILE_NS]
    cands += [K.Fp8Config(128, 2)] if (k // 128) % 2 == 0 else []
    cands += [picked._replace(cluster_n=1), picked._replace(group_m=1)]
    return [picked] + list(dict.fromkeys(c for c in cands if c != picked))


def check_fp8(preset: str, ms=(16, 4096), gen=None, do_bench=False, log=print) -> list[Row]:
    from dsv4debug.backends.sim import fp8_act_quant as sim_quant

    from . import gemm_fp8 as K
    rows = []
    for name, n, k in FP8_SHAPES[preset]:
        q, s, wd = rand_fp8_weight(n, k, gen)
        sb = K.weight_scales(s)
        wb = wd.to(torch.bfloat16)
        for m in ms:
            x = _randn((m, k), gen)
            x[0, :128] *= 100.0                       # an outlier block
            want = (x.double() @ wd.double().T)
            simv = F.linear(sim_quant(x), wb)
            e_s = rel_l2(simv, want)
            # every configuration of fp8_configs (the picked one first), each within the bar
            got = {c: K.fp8_linear(x, q, sb, config=c) for c in fp8_configs(m, n, k)}
            e_k = {c: rel_l2(y, want) for c, y in got.items()}
            c_sim = {c: compare(y.float(), simv.float())["cos"] for c, y in got.items()}
            worst = max(got, key=lambda c: e_k[c])
            m_ref = compare(got[worst].float(), want.float())
            ok = (all(int(y.isnan().sum()) == 0 for y in got.values()) and max(e_k.values()) <= 1.1 * e_s + 1e-6
                  and min(c_sim.values()) >= 0.9999)
            tiles = ", ".join(f"{c} {e_k[c]:.3e} cos(sim) {c_sim[c]:.7f}" for c in got)
            rows.append(Row("linear", f"fp8 {name} M={m}", f"[{m}, {k}] x [{n}, {k}]",
                            "rel_l2(fp64 ref) <= 1.1 x sim's, cos(sim) >= 0.9999", ok, m_ref["cos"],
                            m_ref["max_err"], None, m_ref["nan"],
                            note=f"rel_l2 sim {e_s:.3e}; tiles {tiles}"))
            log(f"  fp8 {preset} {name} M={m}: {'PASS' if ok else 'FAIL'} sim {e_s:.3e} {tiles}")
            del x, got, want, simv
        # the activation quantiser against sim, bit for bit
        x = _randn((512, k), gen)
        x[1, 128:256] = 0.0
        x[2, :128] *= 1e-6
        xq, sa = K.fp8_act_quant(x)
        vals = (xq.float() * sa.T.repeat_interleave(128, 1)).to(torch.bfloat16)
        want = sim_quant(x)
        diff = int((vals.view(torch.int16) != want.view(torch.int16)).sum())
        rows.append(Row("linear", f"fp8_act_quant K={k}", f"[512, {k}]", "bit-identical to sim.fp8_act_quant",
                        diff == 0, mismatches=diff))
        del q, s, wd, wb
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------------
# NVFP4 W4A16 linear
# --------------------------------------------------------------------------------------------------------

def check_w4(preset: str, ms=(1, 16, 4096), gen=None, log=print) -> list[Row]:
    from . import gemm_w4a16 as K
    from . import w4_pack
    rows = []
    for name, n, k in W4_SHAPES[preset]:
        q, ws, s2, wd = rand_nvfp4_weight(n, k, gen)
        pack = w4_pack.pack_nvfp4(q, ws, s2)
        wb = wd.to(torch.bfloat16)
        for m in ms:
            x = _randn((m, k), gen)
            got = K.w4a16_linear(x, pack, n)
            want = x.double() @ wd.double().T
            cub = F.linear(x, wb)
            mm = compare(got.float(), want.float())
            ok = mm["nan"] == 0 and mm["cos"] >= 0.999
            rows.append(Row("linear", f"nvfp4 {name} M={m}", f"[{m}, {k}] x [{n}, {k}]",
                            "cos(fp64 ref on dequantised W) >= 0.999", ok, mm["cos"], mm["max_err"], None,
                            mm["nan"], note=f"rel_l2 kernel {rel_l2(got, want):.3e} / cuBLAS bf16 "
                                            f"{rel_l2(cub, want):.3e}; config "
                                            f"{K.pick_dense_config(m, n, k)}"))
            log(f"  w4a16 {preset} {name} M={m}: {'PASS' if ok else 'FAIL'} cos {mm['cos']:.7f}")
        # fused gate/up (interleaved w1/w3) with the SwiGLU epilogue, dense
        if name.endswith("w1"):
            from dsv4debug.formats import nvfp4_dequantize, nvfp4_quantize
            w3 = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
            q3, ws3, _ = nvfp4_quantize(w3, s2)           # w3 shares w1's global scale
            wd3 = nvfp4_dequantize(q3, ws3, s2)
            p13 = w4_pack.pack_nvfp4_w13(q, ws, q3, ws3, s2)
            for m in (16, 300):
                x = _randn((m, k), gen)
                rw = torch.rand(m, device="cuda", generator=gen)
                h = K.w4a16_launch(x, p13, 2 * n, route_w=rw, lim=LIMIT, epilogue="swiglu",
                                   **K.pick_swiglu_config(m, 2 * n, k))
                g = (x.double() @ wd.double().T).to(torch.bfloat16).double()
                u = (x.double() @ wd3.double().T).to(torch.bfloat16).double()
                want = F.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT) * rw.double()[:, None]
                mm = compare(h.float(), want.float())
                ok = mm["nan"] == 0 and mm["cos"] >= 0.999
                rows.append(Row("expert", f"nvfp4 w13+swiglu M={m}", f"[{m}, {k}] x [2x{n}, {k}]",
                                "cos(fp64 ref) >= 0.999", ok, mm["cos"], mm["max_err"], None, mm["nan"]))
                log(f"  w13 swiglu {preset} M={m}: {'PASS' if ok else 'FAIL'} cos {mm['cos']:.7f}")
        del q, ws, wd, wb, pack
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------------
# MoE (grouped)
# --------------------------------------------------------------------------------------------------------

def make_moe_weights(E: int, D: int, I: int, gen):
    """Real NVFP4 experts (quantised gaussians), their packs and dequantised bf16 weights."""
    from dsv4debug.formats import nvfp4_dequantize, nvfp4_quantize

    from . import w4_pack
    p13s, p2s, w1s, w3s, w2s = [], [], [], [], []
    for _ in range(E):
        w1 = torch.randn(I, D, device="cuda", generator=gen) * D ** -0.5
        w3 = torch.randn(I, D, device="cuda", generator=gen) * D ** -0.5
        w2 = torch.randn(D, I, device="cuda", generator=gen) * I ** -0.5
        s2 = (torch.maximum(w1.abs().amax(), w3.abs().amax()) / (6 * 448)).float()
        a1, a3, a2 = nvfp4_quantize(w1, s2), nvfp4_quantize(w3, s2), nvfp4_quantize(w2)
        p13s.append(w4_pack.pack_nvfp4_w13(a1[0], a1[1], a3[0], a3[1], s2))
        p2s.append(w4_pack.pack_nvfp4(*a2))
        w1s.append(nvfp4_dequantize(*a1).bfloat16())
        w3s.append(nvfp4_dequantize(*a3).bfloat16())
        w2s.append(nvfp4_dequantize(*a2).bfloat16())
    return w4_pack.stack_packed(p13s), w4_pack.stack_packed(p2s), (w1s, w3s, w2s)


def reference_moe(x, ids, w, dense) -> torch.Tensor:
    """dsv4_references experts + combine on the dequantised bf16 weights (the reference backend's path)."""
    import dsv4_references as ref
    w1s, w3s, w2s = dense
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        hit = ids == e
        tok = hit.any(-1).nonzero().squeeze(-1)
        rw = (w * hit).sum(-1)[tok]
        y.index_add_(0, tok, ref.expert(x[tok], w1s[e], w3s[e], w2s[e], LIMIT, rw).float())
    return y


def random_routing(T: int, E: int, k: int, gen, skew: bool = True):
    scores = torch.rand(T, E, device="cuda", generator=gen)
    if skew:                                      # some popular experts, some never chosen
        scores = scores * torch.linspace(0.5, 1.5, E, device="cuda")
        scores[:, :3] = -1.0
    w, ids = scores.topk(k, dim=-1)
    w = w.abs() + 0.1
    return ids, (w / w.sum(-1, keepdim=True) * 2.5).float()


def check_moe(preset: str, E_small: int = 24, tokens=(256, 4096), gen=None, log=print) -> list[Row]:
    from . import moe as K
    dims = MOE_DIMS[preset]
    D, I, k = dims["D"], dims["I"], dims["k"]
    w13, w2, dense = make_moe_weights(E_small, D, I, gen)
    rows = []
    for T in tokens:
        x = _randn((T, D), gen)
        ids, w = random_routing(T, E_small, k, gen)
        got = K.moe_routed(x, ids, w, w13, w2, E_small, LIMIT)
        want = reference_moe(x, ids, w, dense)
        mm = compare(got, want)
        ok = mm["nan"] == 0 and mm["cos"] >= 0.999
        rows.append(Row("expert", f"moe grouped T={T} E={E_small}", f"[{T}, {D}] top{k} I={I}",
                        "cos(reference experts, dequantised W) >= 0.999", ok, mm["cos"], mm["max_err"], None,
                        mm["nan"], note=f"config {K.pick_grouped_config(T * k, E_small, (2 * I, D))}"))
        log(f"  moe {preset} T={T} E={E_small}: {'PASS' if ok else 'FAIL'} cos {mm['cos']:.7f}")
    return rows


def check_gemms(chk) -> None:
    """Add the GEMM rows to a kernels/check.py Checker (correctness; speed is benchmarks/bench_gemm.py)."""
    if chk.preset not in FP8_SHAPES:                  # GEMM rows at the real Pro / Flash shapes only
        return
    preset = chk.preset
    for r in check_fp8(preset, gen=chk.gen, log=lambda s: None) + check_w4(preset, gen=chk.gen, log=lambda s: None) \
            + check_moe(preset, gen=chk.gen, log=lambda s: None):
        chk.add(r)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------
# Benchmarks
# --------------------------------------------------------------------------------------------------------

def _t(fn: Callable[[int], Any], nsets: int, reps: int = 20) -> float:
    return time_fn(fn, nsets, reps)["us"]


def bench_fp8(preset: str, ms=(16, 2048, 4096), gen=None, log=print) -> list[dict]:
    out = []
    for name, n, k in FP8_SHAPES[preset]:
        out += _bench_fp8_shape(preset, name, n, k, ms, gen, log)
        torch.cuda.empty_cache()
    return out


def _bench_fp8_shape(preset, name, n, k, ms, gen, log) -> list[dict]:
    from . import gemm_fp8 as K
    q, s, wd = rand_fp8_weight(n, k, gen)
    sb = K.weight_scales(s)
    ns_k, ns_b = n_sets(n * k), n_sets(2 * n * k)
    qs = [q.clone() for _ in range(ns_k)]
    wbs = [wd.to(torch.bfloat16) for _ in range(ns_b)]
    out = []
    for m in ms:
        x = _randn((m, k), gen)
        xq, sa = K.fp8_act_quant(x)
        y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        t_cub = _t(lambda i, x=x: torch.mm(x, wbs[i].T), ns_b)
        # every configuration of fp8_configs timed side by side; the row's time is the one pick_config chooses
        by_cfg = {c: (_t(lambda i, x=x, c=c: K.fp8_linear(x, qs[i], sb, config=c), ns_k),
                      _t(lambda i, xq=xq, sa=sa, y=y, c=c: K.fp8_gemm(xq, sa, qs[i], sb, y, c), ns_k))
                  for c in fp8_configs(m, n, k)}
        picked = K.pick_config(m, n, k, sm_count(x.device))
        t_full, t_gemm = by_cfg[picked]
        flops = 2 * m * n * k
        # speedup_shared_quant: the GEMM alone, as a linear whose x another linear quantised (wq_a and wkv)
        r = {"kind": "fp8_linear", "preset": preset, "name": name, "m": m, "n": n, "k": k, "us": t_full,
             "gemm_us": t_gemm, "cublas_bf16_us": t_cub, "speedup": t_cub / t_full,
             "speedup_shared_quant": t_cub / t_gemm, "config": str(picked),
             "by_config": {str(c): {"us": a, "gemm_us": b} for c, (a, b) in by_cfg.items()},
             "tflops": flops / t_full / 1e6, "cublas_tflops": flops / t_cub / 1e6}
        out.append(r)
        tiles = " ".join(f"{c} {a:.1f}/{b:.1f}" for c, (a, b) in by_cfg.items())
        log(f"  fp8 {preset} {name:10s} M={m:5d}: {t_full:9.1f} us (gemm {t_gemm:9.1f}, {picked}) cuBLAS bf16 "
            f"{t_cub:9.1f} us  x{r['speedup']:.2f} (shared quant x{r['speedup_shared_quant']:.2f})  "
            f"{r['tflops']:.0f} TFLOP/s  [{tiles}]")
    return out


def bench_w4(preset: str, ms=(1, 16, 2048, 4096), gen=None, log=print, tune: bool = True) -> list[dict]:
    out = []
    for name, n, k in W4_SHAPES[preset]:
        out += _bench_w4_shape(preset, name, n, k, ms, gen, log, tune)
        torch.cuda.empty_cache()
    return out


def _w4_candidates(m: int, n: int, k: int, tune: bool) -> list[dict]:
    from .gemm_w4a16 import pick_dense_config, pick_swiglu_config
    cands = [pick_dense_config(m, n, k)]
    if tune and m <= 16:
        from .gemm_w4a16 import gemv_splits
        cands += [c for sp in gemv_splits(k) for c in ({"gemv": True, "split": sp},
                                                       {"gemv": True, "split": sp, "warps": 4}) if c not in cands]
        cands.append(pick_swiglu_config(m, n, k))              # the WGMMA kernel (the fused SwiGLU's in decode)
    if tune and m >= 2048:
        for c in ({"n_tok": 128, "t_max": 2, "tile_k": 128}, {"n_tok": 128, "t_max": 1},
                  {"n_tok": 64, "t_max": 4, "tile_k": 128}):
            if c not in cands:
                cands.append(c)
    return cands


def _bench_w4_shape(preset, name, n, k, ms, gen, log, tune) -> list[dict]:
    from . import gemm_w4a16 as K
    pack = rand_pack_fast(1, n, k, gen)
    wbytes = pack[0].numel() * 4 + pack[1].numel()
    ns_k, ns_b = n_sets(wbytes), n_sets(2 * n * k)
    packs = [tuple(t.clone() for t in pack) for _ in range(ns_k)]
    wbs = [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(ns_b)]
    out = []
    for m in ms:
        x = _randn((m, k), gen)
        cands = _w4_candidates(m, n, k, tune)
        times = {}
        for c in cands:
            try:
                times[str(c)] = _t(lambda i, x=x, c=c: K.w4a16_linear(x, packs[i], n, config=c), ns_k)
            except Exception as e:                      # noqa: BLE001 - recorded
                times[str(c)] = f"error: {str(e).splitlines()[0][:160]}"
        ok_times = {c: t for c, t in times.items() if isinstance(t, float)}
        best = min(ok_times, key=ok_times.get)
        t_cub = _t(lambda i, x=x: torch.mm(x, wbs[i].T), ns_b)
        r = {"kind": "w4a16_linear", "preset": preset, "name": name, "m": m, "n": n, "k": k,
             "us": ok_times[best], "best_config": best, "default_us": ok_times.get(str(cands[0])),
             "configs": times, "cublas_bf16_us": t_cub, "speedup": t_cub / ok_times[best],
             "weight_GBps": wbytes / ok_times[best] / 1e3, "cublas_weight_GBps": 2 * n * k / t_cub / 1e3,
             "tflops": 2 * m * n * k / ok_times[best] / 1e6}
        out.append(r)
        log(f"  w4a16 {preset} {name:10s} M={m:5d}: {r['us']:9.1f} us cuBLAS bf16 {t_cub:9.1f} us  "
            f"x{r['speedup']:.2f}  ({best})")
    return out


def bench_moe(preset: str = "pro", tokens=(256, 4096), gen=None, log=print, check_tokens: int = 4,
              tune: bool = True) -> list[dict]:
    """Full-size routed-expert layer: ours (one launch per GEMM for all experts) vs a loop of per-expert
    cuBLAS BF16 GEMMs (w1|w3 as one GEMM, SwiGLU over all rows at once, w2) on bf16 weights.

    Timing weights are random (values do not change either side's speed); a sample of tokens is checked
    against the reference on the dequantised weights of the experts they use."""
    d = MOE_DIMS[preset]
    E, D, I = d["E"], d["D"], d["I"]
    w13 = rand_pack_fast(E, 2 * I, D, gen)
    w2 = rand_pack_fast(E, D, I, gen)
    # bf16 baseline weights: per expert [2I, D] (w1 and w3 stacked) and [D, I]
    b13 = torch.randn(E, 2 * I, D, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(D ** -0.5)
    b2 = torch.randn(E, D, I, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(I ** -0.5)
    out = [_bench_moe_tokens(preset, T, w13, w2, b13, b2, gen, log, check_tokens, tune) for T in tokens]
    torch.cuda.empty_cache()
    return out


def _moe_candidates(pairs: int, E: int, widths: tuple[int, ...], tune: bool) -> list[dict]:
    from .moe import pick_grouped_config
    cands = [pick_grouped_config(pairs, E, widths)]
    extra = ([{"n_tok": 32, "t_max": 4, "tile_k": 128}, {"n_tok": 64, "t_max": 2, "tile_k": 64},
              {"n_tok": 128, "t_max": 1, "tile_k": 128}, {"n_tok": 64, "t_max": 2, "tile_k": 128}]
             if pairs > 16 * E
             else [{"n_tok": 16, "t_max": 1, "tile_k": 128}, {"n_tok": 8, "t_max": 2, "tile_k": 64}])
    return cands + [c for c in extra if tune and c not in cands]


def _bench_moe_tokens(preset, T, w13, w2, b13, b2, gen, log, check_tokens, tune) -> dict:
    from . import moe as K
    from . import w4_pack
    d = MOE_DIMS[preset]
    E, D, I, k = d["E"], d["D"], d["I"], d["k"]
    x = _randn((T, D), gen)
    ids, w = random_routing(T, E, k, gen, skew=False)
    # baseline: tokens grouped by expert (host-known counts), per-expert GEMMs
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    xs = x.index_select(0, order // k)
    rw = w.reshape(-1)[order]
    hbuf = torch.empty(T * k, 2 * I, dtype=torch.bfloat16, device="cuda")
    ybuf = torch.empty(T * k, D, dtype=torch.bfloat16, device="cuda")
    segs, a = [], 0
    for e, c in enumerate(counts):
        if c:
            segs.append((e, a, a + c))
        a += c

    def baseline(_i):
        for e, s0, s1 in segs:
            torch.mm(xs[s0:s1], b13[e].T, out=hbuf[s0:s1])
        g, u = hbuf.split(I, dim=1)
        h = (F.silu(g.float().clamp(max=LIMIT)) * u.float().clamp(-LIMIT, LIMIT) * rw[:, None]).bfloat16()
        for e, s0, s1 in segs:
            torch.mm(h[s0:s1], b2[e].T, out=ybuf[s0:s1])
        return ybuf

    def ours(_i, cfg=None):
        return K.moe_routed(x, ids, w, w13, w2, E, LIMIT, config=cfg)

    cands = _moe_candidates(T * k, E, (2 * I, D), tune)
    times = {}
    for c in cands:
        try:
            times[str(c)] = _t(lambda i, c=c: ours(i, c), 1, reps=5)
        except Exception as e:                          # noqa: BLE001
            times[str(c)] = f"error: {str(e).splitlines()[0][:160]}"
    ok_times = {c: t for c, t in times.items() if isinstance(t, float)}
    best = min(ok_times, key=ok_times.get)
    t_base = _t(baseline, 1, reps=3)
    # sampled correctness of the full-size run (default configuration)
    y = ours(0)
    sample = torch.arange(check_tokens, device="cuda")
    dense: tuple[dict, dict, dict] = ({}, {}, {})
    for e in torch.unique(ids[sample]).tolist():
        full13 = w4_pack.decode_blob(w13[0][e:e + 1], w13[1][e:e + 1], w13[2][e:e + 1])[0]
        dense[0][e] = full13.view(I // 8, 2, 8, D)[:, 0].reshape(I, D).bfloat16()
        dense[1][e] = full13.view(I // 8, 2, 8, D)[:, 1].reshape(I, D).bfloat16()
        dense[2][e] = w4_pack.decode_blob(w2[0][e:e + 1], w2[1][e:e + 1], w2[2][e:e + 1])[0].bfloat16()
    want = reference_moe(x[sample], ids[sample], w[sample], dense)
    mm = compare(y[sample], want)
    r = {"kind": "moe", "preset": preset, "experts": E, "topk": k, "tokens": T, "dim": D, "inter": I,
         "us": ok_times[best], "best_config": best, "default_us": ok_times.get(str(cands[0])), "configs": times,
         "loop_cublas_bf16_us": t_base, "speedup": t_base / ok_times[best], "sample_cos": mm["cos"],
         "sample_nan": mm["nan"], "experts_hit": sum(1 for c in counts if c)}
    log(f"  moe {preset} E={E} T={T}: {r['us']:9.1f} us  loop cuBLAS bf16 {t_base:9.1f} us  "
        f"x{r['speedup']:.2f}  sample cos {mm['cos']:.6f} ({best})")
    return r


def cublas_peak() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = _t(lambda i: a @ b, 1, reps=10)
    return {"bf16_8192_TFLOPs": 2 * 8192 ** 3 / us / 1e6}

