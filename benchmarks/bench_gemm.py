"""GEMM kernels on the GPU: correctness and speed side by side in one run (issue 7).

    python benchmarks/bench_gemm.py --out DIR            # every phase, each in a subprocess with a timeout
    python benchmarks/bench_gemm.py --phase smoke --out DIR

Phases (each writes DIR/<phase>.json; the driver then writes DIR/gemm.json and prints a summary):
  smoke  fast correctness of every kernel, with a decode probe (x = identity: the output is the decoded
         weight, so a layout bug shows as a pattern) - the later phases run only if it passes
  check  the check rows at Pro and Flash shapes (kernels/check_gemm.py: FP8 vs the sim bar, W4A16 and the
         grouped MoE vs the reference, cos >= 0.999)
  bench  FP8 linear and NVFP4 W4A16 linear against cuBLAS BF16 on the dequantised weights (M = 1..4096)
  moe    the Pro MoE layer (384 experts, top-6; 256 and 4096 tokens) against a loop of per-expert cuBLAS BF16
  decode the W4A16 rows of bench at M = 1 and 16 (every decode configuration of both kernels timed) and the
         Pro FP8 rows at M = 16
  fp8    the FP8 rows of bench alone (bench takes longer than one step of a device call leaves it)
A hung or crashing kernel costs one phase (timeout), not the run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("smoke", "bench", "moe", "check", "decode", "fp8")
DEFAULT_PHASES = PHASES[:4]       # their timeouts fit one device call (< 600 s); decode is a part of bench
TIMEOUTS = {"smoke": 100, "bench": 170, "moe": 140, "check": 120, "decode": 120, "fp8": 260}


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------------------

def _try(results: dict, name: str, fn):
    t0 = time.perf_counter()
    try:
        results[name] = fn()
        results[name + "_s"] = round(time.perf_counter() - t0, 2)
    except Exception as e:                              # noqa: BLE001 - recorded, the phase goes on
        results[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc()[-4000:]}
        log(f"  {name}: ERROR {type(e).__name__}: {str(e)[:500]}")
    import torch
    torch.cuda.synchronize()


def probe_w4(n: int, k: int, m: int, config: dict, gen) -> dict:
    """x = identity rows: out[t, j] = W[j, t]; report where the kernel's decoded weights differ."""
    import torch
    from dsv4_kernels import gemm_w4a16 as K
    from dsv4_kernels import w4_pack
    from dsv4_kernels.check_gemm import rand_nvfp4_weight
    q, ws, s2, wd = rand_nvfp4_weight(n, k, gen)
    pack = w4_pack.pack_nvfp4(q, ws, s2)
    x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
    cols = torch.arange(m) * max(1, k // m) % k                       # spread over every K split
    x[torch.arange(m), cols] = 1.0
    got = K.w4a16_linear(x, pack, n, config=config).float()          # [m, n]
    want = wd[:, cols].T.contiguous()                                 # [m, n] fp32 (exact values)
    bad = ((got - want).abs() > want.abs() * 2.0 ** -7).nonzero()     # more than one bf16 rounding away
    res = {"config": str(config), "n": n, "k": k, "m": m, "mismatches": int(bad.shape[0]),
           "nan": int((~torch.isfinite(got)).sum())}
    if bad.shape[0]:
        res["first"] = [(int(t), int(j), float(got[t, j]), float(want[t, j])) for t, j in bad[:12].tolist()]
        # which weights did the kernel deliver? match a few wrong values against the weight's column
        res["nonzero_frac"] = float((got != 0).float().mean())
    log(f"  probe w4 {n}x{k} m={m} {config}: mismatches {res['mismatches']} nan {res['nan']}"
        + (f" first {res.get('first', [])[:4]}" if bad.shape[0] else ""))
    return res


def phase_smoke() -> dict:
    import torch
    import torch.nn.functional as F
    from dsv4_kernels import check_gemm as C
    from dsv4_kernels import gemm_fp8, gemm_w4a16, moe, w4_pack
    gen = torch.Generator(device="cuda").manual_seed(1)
    r: dict = {}
    t0 = time.perf_counter()
    for name, kern, cfg in (("fp8_act_quant", "fp8_act_quant", {}), ("fp8_block_gemm", "fp8_block_gemm", {}),
                            ("fp8_split", "fp8_block_gemm", {"split_k": True}),
                            ("fp8_cluster", "fp8_block_gemm", {"cluster_n": 2}),
                            ("w4_decode", "w4a16_gemm", {"n_tok": 16}),
                            ("w4_wide", "w4a16_gemm", {"n_tok": 128, "t_max": 2}),
                            ("w4_gemv", "w4a16_gemv", {"tok_tiles": 2, "chunks": 4, "split": 4})):
        from dsv4_kernels._common import compile_kernel
        t = time.perf_counter()
        _try(r, f"compile_{name}", lambda kern=kern, cfg=cfg: compile_kernel(kern, "sm_90a", **cfg) and True)
        r[f"compile_{name}_s"] = round(time.perf_counter() - t, 2)
    r["compile_total_s"] = round(time.perf_counter() - t0, 2)
    log(f"  compiled smoke kernels in {r['compile_total_s']} s")

    def fp8():
        from dsv4debug.backends.sim import fp8_act_quant as sim_quant
        x = C._randn((200, 7168), gen)
        x[3, :128] *= 50
        xq, sa = gemm_fp8.fp8_act_quant(x)
        vals = (xq.float() * sa.T.repeat_interleave(128, 1)).to(torch.bfloat16)
        diff = int((vals.view(torch.int16) != sim_quant(x).view(torch.int16)).sum())
        q, s, wd = C.rand_fp8_weight(1536, 7168, gen)
        got = gemm_fp8.fp8_linear(x, q, gemm_fp8.weight_scales(s))
        want = x.double() @ wd.double().T
        simv = F.linear(sim_quant(x), wd.bfloat16())
        out = {"act_quant_mismatches": diff, "rel_kernel": C.rel_l2(got, want), "rel_sim": C.rel_l2(simv, want),
               "cos_vs_sim": C.compare(got.float(), simv.float())["cos"], "nan": int((~torch.isfinite(got)).sum())}
        out["ok"] = diff == 0 and out["rel_kernel"] <= 1.1 * out["rel_sim"] and out["cos_vs_sim"] >= 0.9999
        log(f"  fp8 smoke: {out}")
        return out

    def w4_probe():
        return [probe_w4(256, 128, 16, {"n_tok": 16}, gen),
                probe_w4(256, 256, 256, {"n_tok": 128, "t_max": 2}, gen),
                probe_w4(256, 1024, 16, {"gemv": True, "split": 4}, gen),
                probe_w4(384, 512, 5, {"gemv": True, "split": 1}, gen)]

    def w4_rand():
        out = []
        for m in (1, 16, 300):
            q, ws, s2, wd = C.rand_nvfp4_weight(3072, 7168, gen)
            pack = w4_pack.pack_nvfp4(q, ws, s2)
            x = C._randn((m, 7168), gen)
            got = gemm_w4a16.w4a16_linear(x, pack, 3072)
            mm = C.compare(got.float(), (x.double() @ wd.double().T).float())
            out.append({"m": m, "cos": mm["cos"], "nan": mm["nan"], "config": str(gemm_w4a16.pick_dense_config(m, 3072, 7168))})
            log(f"  w4 smoke m={m}: cos {mm['cos']:.7f} nan {mm['nan']}")
        return out

    def moe_small():
        out = []
        E, D, I, k = 8, 512, 256, 4
        w13, w2, dense = C.make_moe_weights(E, D, I, gen)
        for T, cfg in ((32, {"n_tok": 16, "t_max": 1}), (200, {"n_tok": 64, "t_max": 2, "tile_k": 128})):
            x = C._randn((T, D), gen)
            ids, w = C.random_routing(T, E, k, gen)
            got = moe.moe_routed(x, ids, w, w13, w2, E, C.LIMIT, config=cfg)
            mm = C.compare(got, C.reference_moe(x, ids, w, dense))
            out.append({"T": T, "config": str(cfg), "cos": mm["cos"], "nan": mm["nan"]})
            log(f"  moe smoke T={T} {cfg}: cos {mm['cos']:.7f} nan {mm['nan']}")
        return out

    _try(r, "fp8", fp8)
    _try(r, "w4_probe", w4_probe)
    _try(r, "w4_rand", w4_rand)
    _try(r, "moe_small", moe_small)
    ok = (isinstance(r.get("fp8"), dict) and r["fp8"].get("ok")
          and isinstance(r.get("w4_probe"), list) and all(p["mismatches"] == 0 and p["nan"] == 0 for p in r["w4_probe"])
          and isinstance(r.get("w4_rand"), list) and all(p["cos"] >= 0.999 and p["nan"] == 0 for p in r["w4_rand"])
          and isinstance(r.get("moe_small"), list) and all(p["cos"] >= 0.999 and p["nan"] == 0 for p in r["moe_small"]))
    r["passed"] = bool(ok)
    return r


def phase_check() -> dict:
    import torch
    from dsv4_kernels import check_gemm as C
    gen = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for preset in ("pro", "flash"):
        for fn, kw in ((C.check_fp8, {"ms": (16, 256)}), (C.check_w4, {"ms": (1, 16, 256)}),
                       (C.check_moe, {"tokens": (256, 1024)})):
            try:
                rows += [r.as_dict() | {"preset": preset} for r in fn(preset, gen=gen, log=log, **kw)]
            except Exception as e:                      # noqa: BLE001
                rows.append({"op": fn.__name__, "preset": preset, "passed": False,
                             "error": f"{type(e).__name__}: {str(e)[:1500]}", "traceback": traceback.format_exc()[-3000:]})
                log(f"  {fn.__name__} {preset}: ERROR {e}")
            torch.cuda.empty_cache()
    return {"rows": rows, "passed": all(r.get("passed") for r in rows)}


def phase_bench(w4: bool = True) -> dict:
    import torch
    from dsv4_kernels import check_gemm as C
    from dsv4_kernels.check import copy_bandwidth
    gen = torch.Generator(device="cuda").manual_seed(3)
    r: dict = {}
    _try(r, "copy", copy_bandwidth)
    _try(r, "cublas_peak", C.cublas_peak)
    log(f"  copy {r.get('copy')} cuBLAS {r.get('cublas_peak')}")
    if w4:
        _try(r, "w4_pro", lambda: C.bench_w4("pro", gen=gen, log=log))
        _try(r, "w4_flash", lambda: C.bench_w4("flash", gen=gen, log=log))
    _try(r, "fp8_pro", lambda: C.bench_fp8("pro", gen=gen, log=log))
    _try(r, "fp8_flash", lambda: C.bench_fp8("flash", ms=(16, 2048), gen=gen, log=log))
    return r


def phase_decode() -> dict:
    import torch
    from dsv4_kernels import check_gemm as C
    from dsv4_kernels.check import copy_bandwidth
    gen = torch.Generator(device="cuda").manual_seed(3)
    r: dict = {}
    _try(r, "copy", copy_bandwidth)
    for preset in ("pro", "flash"):
        _try(r, f"w4_{preset}", lambda preset=preset: C.bench_w4(preset, ms=(1, 16), gen=gen, log=log))
    _try(r, "fp8_pro", lambda: C.bench_fp8("pro", ms=(16,), gen=gen, log=log))
    return r


def phase_moe() -> dict:
    import torch
    from dsv4_kernels import check_gemm as C
    gen = torch.Generator(device="cuda").manual_seed(4)
    r: dict = {}
    _try(r, "moe_pro", lambda: C.bench_moe("pro", gen=gen, log=log))
    return r


# --------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------

def run_phase(name: str, out: Path) -> None:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    from dsv4_kernels.check import environment
    res = {"phase": name, "env": environment()}
    res |= {"smoke": phase_smoke, "check": phase_check, "bench": phase_bench, "moe": phase_moe,
            "decode": phase_decode, "fp8": lambda: phase_bench(w4=False)}[name]()
    res["seconds"] = round(time.perf_counter() - t0, 1)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))


def summary(doc: dict) -> list[str]:
    lines = []
    sm = doc.get("smoke", {})
    lines.append(f"smoke passed: {sm.get('passed')}")
    ch = doc.get("check", {})
    for row in ch.get("rows", []):
        lines.append(f"check {row.get('preset')} {row.get('op')} {row.get('case', '')}: "
                     f"{'PASS' if row.get('passed') else 'FAIL'} cos={row.get('cos')} {row.get('note', '')[:90]}"
                     + (f" {row.get('error', '')[:200]}" if row.get("error") else ""))
    for phase, key in [("bench", k) for k in ("w4_pro", "w4_flash", "fp8_pro", "fp8_flash")] + [
            ("decode", "w4_pro"), ("decode", "w4_flash"), ("decode", "fp8_pro"), ("fp8", "fp8_pro"), ("fp8", "fp8_flash")]:
        b = doc.get(phase, {})
        for r in b.get(key, []) if isinstance(b.get(key), list) else [b.get(key)]:
            if isinstance(r, dict) and "us" in r:
                lines.append(f"{r['kind']} {r['preset']} {r['name']} M={r['m']}: {r['us']:.1f} us vs cuBLAS bf16 "
                             f"{r['cublas_bf16_us']:.1f} us -> x{r['speedup']:.2f}")
            elif r:
                lines.append(f"{key}: {str(r)[:300]}")
    m = doc.get("moe", {}).get("moe_pro")
    for r in m if isinstance(m, list) else [m]:
        if isinstance(r, dict) and "us" in r:
            lines.append(f"moe pro T={r['tokens']}: {r['us']:.0f} us vs loop cuBLAS bf16 {r['loop_cublas_bf16_us']:.0f} us"
                         f" -> x{r['speedup']:.2f} (sample cos {r['sample_cos']:.6f}, {r['best_config']})")
        elif r:
            lines.append(f"moe: {str(r)[:300]}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--phase", choices=PHASES)
    ap.add_argument("--phases", default=",".join(DEFAULT_PHASES))
    ap.add_argument("--force", action="store_true", help="run the later phases even if smoke fails")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.phase:
        run_phase(a.phase, out)
        return 0
    doc: dict = {"phases": {}}
    for name in a.phases.split(","):
        t0 = time.perf_counter()
        log(f"== phase {name}")
        try:
            p = subprocess.run([sys.executable, __file__, "--phase", name, "--out", str(out)], timeout=TIMEOUTS[name],
                               check=False)
            status = f"exit {p.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timeout after {TIMEOUTS[name]} s"
        doc["phases"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 1)}
        f = out / f"{name}.json"
        if f.exists():
            doc[name] = json.loads(f.read_text())
        log(f"== phase {name}: {status} ({doc['phases'][name]['seconds']} s)")
        if name == "smoke" and not doc.get("smoke", {}).get("passed") and not a.force:
            log("smoke failed: skipping the later phases (--force runs them anyway)")
            break
    (out / "gemm.json").write_text(json.dumps(doc, indent=1, default=str))
    log("\n".join(summary(doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
