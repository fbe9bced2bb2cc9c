"""CuTeDSL compile checks on CPU (CI): every kernel, every declared configuration, every declared arch.

Compilation needs no GPU: launchers are traced with fake pointers/streams and compiled with
cute.compile[GPUArch(arch)] down to a cubin (ptxas runs). These (kernel, config, arch) compiles take ~20 s on
a 2-core machine (hc_mix, ~3 s each, dominates).
"""
import json

import pytest

pytest.importorskip("cutlass", reason="CuTeDSL (nvidia-cutlass-dsl 4.8.1) is not installed")

from dsv4_kernels import load_all
from dsv4_kernels._common import ARCHS, row_geometry
from dsv4_kernels.compile import compile_one, plan

# this file covers the kernels of kernels/{norm,rope,nvfp4,kv_cache,mhc,stats}.py; the GEMM kernels have their own
# test
OWN = ("norm", "rope", "nvfp4", "kv_cache", "mhc", "stats")
PLAN = [p for p in plan(ARCHS, "all") if load_all()[p[0]].build.__module__.rsplit(".", 1)[-1] in OWN]


def test_every_kernel_declares_hopper_and_a_config():
    reg = load_all()
    assert set(reg) >= {"rmsnorm", "rope", "nvfp4_amax", "nvfp4_quant", "nvfp4_dequant", "kv_write", "kv_read", "site_stats",
                        "hc_mix", "hc_pre_apply", "hc_post"}
    for kd in reg.values():
        assert "sm_90a" in kd.archs and kd.configs, kd.name
    # every declared (kernel, arch) pair has at least one planned compile
    planned = {(k, a) for k, _, a in PLAN}
    assert planned == {(k, a) for k, kd in reg.items() for a in kd.archs
                       if kd.build.__module__.rsplit(".", 1)[-1] in OWN}


@pytest.mark.parametrize("name,cfg,arch", PLAN, ids=[f"{k}-{a}-{'-'.join(f'{x}{y}' for x, y in sorted(c.items()))}"
                                                     for k, c, a in PLAN])
def test_compiles(name, cfg, arch):
    row = compile_one(name, cfg, arch)
    assert row["ok"], f"{name} {cfg} {arch}: {row['error']}\n{row.get('traceback')}"


def test_row_geometry_covers_rows_exactly():
    for n_vec in (16, 32, 64, 128, 192, 512, 896, 3584):
        tpr, nv = row_geometry(n_vec)
        assert tpr * nv == n_vec and tpr & (tpr - 1) == 0 and tpr <= 256


def test_cli_compile_json(capsys):
    from dsv4debug.cli import main
    with pytest.raises(SystemExit) as e:
        main(["kernels", "compile", "--json", "--kernel", "rmsnorm", "--subset", "ci", "--arch", "sm_90a"])
    assert e.value.code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and {r["kernel"] for r in doc["rows"]} == {"rmsnorm"}
    assert all(r["arch"] == "sm_90a" and r["seconds"] > 0 for r in doc["rows"])


def test_cli_compile_lint_reports_findings_and_exits_1(capsys, monkeypatch):
    """--lint: each row carries its PTX findings (none for rmsnorm), and a finding fails the command (exit 1)
    with the kernel and the instruction on stderr."""
    from dsv4_kernels import compile as kc

    from dsv4debug.cli import main
    args = ["kernels", "compile", "--kernel", "rmsnorm", "--subset", "ci", "--arch", "sm_90a", "--lint"]
    with pytest.raises(SystemExit) as e:
        main([*args, "--json"])
    assert e.value.code == 0
    assert [r["lint"] for r in json.loads(capsys.readouterr().out)["rows"]] == [[], []]
    real = kc.compile_in_child
    monkeypatch.setattr(kc, "compile_in_child", lambda *a, **k: {**real(*a, **k), "lint": ["k: line 9: `bar.sync 0`"]})
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 1 and "lint: rmsnorm sm_90a" in capsys.readouterr().err


def test_cli_compile_writes_each_configs_ptx_and_never_overwrites(tmp_path, capsys):
    """--ptx: one file per (kernel, config, arch) holding that config's PTX (the same bytes from two compiles,
    so a diff of two trees' directories shows only real changes); a directory with files in it is refused."""
    from dsv4debug.cli import main
    out = tmp_path / "ptx"
    args = ["kernels", "compile", "--json", "--kernel", "rmsnorm", "--subset", "ci", "--arch", "sm_90a"]
    for d in (out, tmp_path / "again"):
        with pytest.raises(SystemExit) as e:
            main([*args, "--ptx", str(d)])
        assert e.value.code == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["rmsnorm-n=512,weighted=False.sm_90a.ptx", "rmsnorm-n=7168,weighted=True.sm_90a.ptx"]
    for name in files:
        text = (out / name).read_text()
        assert ".target sm_90a" in text and text == (tmp_path / "again" / name).read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args, "--ptx", str(out)])
    assert e.value.code == 2 and "not an empty directory" in capsys.readouterr().err


def test_cli_compile_rejects_unknown_arch(capsys):
    from dsv4debug.cli import main
    with pytest.raises(SystemExit) as e:
        main(["kernels", "compile", "--arch", "sm_80"])
    assert e.value.code == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present: `kernels check` would run")
def test_cli_check_without_gpu_exits_2(capsys):
    from dsv4debug.cli import main
    with pytest.raises(SystemExit) as e:
        main(["kernels", "check", "--shapes", "tiny"])
    assert e.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_site_stats_table_covers_every_tensor_once():
    """site_stats' launch table (a row a site: address, vectors, first output row, first CTA) with the
    kernel's rule for a CTA (its site is the row whose CTAs include it; its block is its offset from that row's
    first CTA) tiles each tensor's 16-byte vectors exactly once, in blocks of BLOCK_VECTORS, with the site's
    rows consecutive from its first row."""
    import numpy as np
    from dsv4_kernels.stats import BLOCK_VECTORS, _table
    addresses, vectors, firsts = [4096, 1 << 40, 77 << 20], [1, 3 * BLOCK_VECTORS, 2 * BLOCK_VECTORS + 5], [3, 10, 0]
    table, n_cta = _table(addresses, vectors, firsts)
    assert table.dtype == np.int64 and table.shape == (3, 4) and n_cta == 1 + 3 + 3
    ctas = []                                   # (address, vectors, output row) of each CTA, as the kernel reads
    for cta in range(n_cta):
        site = [i for i, (_, n_vec, _, start) in enumerate(table) if start <= cta < start + -(-n_vec // BLOCK_VECTORS)]
        assert len(site) == 1
        address, n_vec, first, start = table[site[0]]
        block = cta - start
        ctas.append((address + 16 * BLOCK_VECTORS * block, min(n_vec - block * BLOCK_VECTORS, BLOCK_VECTORS),
                     first + block))
    ctas = np.array(ctas)
    for address, n_vec, first in zip(addresses, vectors, firsts):
        mine = ctas[(ctas[:, 0] >= address) & (ctas[:, 0] < address + 16 * n_vec)]
        assert list(mine[:, 2]) == list(range(first, first + len(mine)))
        assert list(mine[:, 0]) == [address + 16 * BLOCK_VECTORS * b for b in range(len(mine))]
        assert mine[:, 1].sum() == n_vec and (mine[:-1, 1] == BLOCK_VECTORS).all() and mine[-1, 1] > 0


def test_resources_read_from_the_cubin():
    """--resources: registers, local memory and threads come from the cubin ptxas wrote. hc_mix runs 128 threads
    (.reqntid), each holding 24 fp32 accumulators and a chunk's x words and fn hi + lo fragments, so it needs
    more than 96 registers, at most 255, and was written to keep them unspilled."""
    from dsv4_kernels.compile import compile_in_child
    row = compile_in_child("hc_mix", {"K": 4 * 7168, "nmix": 24, "parts": 8}, "sm_90a", resources=True)
    assert row["ok"], row["error"]
    assert row["threads"] == 128 and 96 < row["registers"] <= 255 and row["local_bytes"] == 0
    assert row["ctas_per_sm_by_registers"] == 65536 // (-(-row["registers"] // 8) * 8 * 128)


def test_nvfp4_quant_grid_fits_its_residency():
    """nvfp4_quant's grid-stride launch sizes its grid to QUANT_CTAS_PER_SM CTAs an SM: the cubin's registers must
    let that many reside at once, or the last CTAs run as a second wave (and more idle SMs than a loop saves)."""
    from dsv4_kernels.compile import compile_in_child
    from dsv4_kernels.nvfp4 import QUANT_CTAS_PER_SM
    row = compile_in_child("nvfp4_quant", {}, "sm_90a", resources=True)
    assert row["ok"], row["error"]
    assert row["ctas_per_sm_by_registers"] >= QUANT_CTAS_PER_SM


def test_nvfp4_one_pass_grid_is_co_resident():
    """nvfp4_quant_onepass spins on a grid-wide counter, so its grid (one CTA an SM) must all be resident at
    once: its shared memory (HELD blocks of 32 bytes) fits one CTA in the 227 KiB an SM allows, and for every
    CTA shape its registers let that one CTA reside, without spills."""
    from dsv4_kernels.compile import compile_in_child
    from dsv4_kernels.nvfp4 import HELD, ONEPASS_CONFIGS
    for cfg in ONEPASS_CONFIGS:
        assert HELD * 32 + cfg["threads"] // 32 * 4 <= 227 * 1024
        for arch in ("sm_90a", "sm_100a"):
            row = compile_in_child("nvfp4_quant_onepass", cfg, arch, resources=True)
            assert row["ok"], row["error"]
            assert row["threads"] == cfg["threads"] and row["ctas_per_sm_by_registers"] >= 1, (cfg, arch, row)
            assert row["local_bytes"] == 0, (cfg, arch, row)


def _run_fixture(script: str, keep: str, dump, *args):
    """tests/fixtures/<script> ARCH DUMP ARGS in a child process that keeps what ptxas made (CUTE_DSL_KEEP=keep)
    in dump; its last line of output, as JSON."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, CUTE_DSL_KEEP=keep, CUTE_DSL_DUMP_DIR=str(dump))
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "fixtures" / script), "sm_90a", str(dump),
                           *args], env=env, capture_output=True, text=True, check=False, cwd=dump)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_resources_see_local_memory(tmp_path):
    """A kernel whose register array is indexed at run time lives in local memory: cubin_resources says so, so
    the spill check below can fail."""
    usage = _run_fixture("spilling_kernel.py", "cubin", tmp_path)
    assert usage["local_bytes"] >= 64 * 4 and usage["threads"] == 32 and usage["registers"] > 0


def test_lint_finds_the_warp_index_taken_inside_the_lane_zero_branch(tmp_path):
    """The hang of the one-pass quantiser's first GPU launch, compiled by CuTeDSL: the warp index (a full-mask
    shfl.sync) inside `if lane_idx() == 0` is one finding, naming the shfl.sync; taken before the branch, none."""
    found = {}
    for mode in ("hang", "fixed"):
        (tmp_path / mode).mkdir()
        found[mode] = _run_fixture("lane_branch_kernel.py", "ptx", tmp_path / mode, mode)
    assert len(found["hang"]) == 1 and "shfl.sync.idx" in found["hang"][0], found
    assert found["fixed"] == []


_PTX = """.visible .entry k(
.param .u64 p
)
{{
.reg .pred %p<4>; .reg .b32 %r<9>;
mov.u32 %r1, %tid.x;
{setup}
@%p1 bra $L__BB0_2;
{body}
$L__BB0_2:
ret;
}}
"""


@pytest.mark.parametrize("setup,body,flagged", [
    ("setp.ne.s32 %p1, %r1, 0;", "shfl.sync.bfly.b32 %r2, %r1, 1, 31, -1;", True),       # if tidx == 0
    ("mov.u32 %r3, %laneid; setp.gt.u32 %p1, %r3, 3;", "vote.sync.ballot.b32 %r2, %p2, -1;", True),
    ("setp.ne.s32 %p1, %r1, 0;", "shfl.sync.bfly.b32 %r2, %r1, 1, 31, 1;", False),       # a mask of lane 0 only
    ("setp.ge.u32 %p1, %r1, 128;", "shfl.sync.bfly.b32 %r2, %r1, 1, 31, -1;", False),     # whole warps: tidx < 128
    ("shr.u32 %r4, %r1, 5; setp.ne.s32 %p1, %r4, 0;", "bar.sync 1, 32;", False),         # warp 0 only
    ("and.b32 %r4, %r1, 31; setp.ne.s32 %p1, %r4, 0;", "bar.sync 0;", True),            # lane 0 only
    ("setp.ne.s32 %p1, %r1, 0;", ("@%p2 bra $L__BB0_2;\nmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                                  "{%r2, %r3, %r4, %r5}, {%r6, %r7, %r8, %r1}, {%r6, %r7}, {%r2, %r3, %r4, %r5};"),
     True),
])
def test_lint_rules_on_small_ptx(setup, body, flagged):
    """Which branches the lint calls lane-dependent (the thread id, the lane id, and what is computed from them,
    but not whole-warp tests such as tidx < 128 or the warp index) and which instructions are collectives (full
    membermask, or .aligned)."""
    from dsv4_kernels.ptx_lint import lint_ptx
    found = lint_ptx(_PTX.format(setup=setup, body=body))
    assert bool(found) == flagged, found


def test_lint_sees_a_loop_whose_trip_count_depends_on_the_lane():
    """A backward branch on a lane-dependent predicate: lanes leave the loop at different trips, so a
    full-mask shuffle in its body is a finding."""
    from dsv4_kernels.ptx_lint import lint_ptx
    ptx = _PTX.format(setup="mov.u32 %r2, 0;", body="").replace("@%p1 bra $L__BB0_2;", (
        "$L__BB0_1:\nshfl.sync.bfly.b32 %r3, %r2, 1, 31, -1;\nadd.s32 %r2, %r2, 1;\n"
        "setp.lt.u32 %p1, %r2, %r1;\n@%p1 bra $L__BB0_1;"))
    (finding,) = lint_ptx(ptx)
    assert "shfl.sync.bfly" in finding.instruction


def test_no_kernel_spills_or_has_a_warp_collective_under_a_lane_branch():
    """Every kernel's CI configuration for sm_90a keeps its values in registers (a change that makes ptxas
    spill, a performance cliff no CPU test would otherwise see, fails here with the kernel's name), and its PTX
    has no warp collective under a lane-dependent branch (a hang on the GPU)."""
    from dsv4_kernels.compile import compile_all
    rows = compile_all(["sm_90a"], "ci", resources=True, lint=True)
    assert all(r["ok"] for r in rows), [(r["kernel"], r["error"]) for r in rows if not r["ok"]]
    spilled = [(r["kernel"], r["config"], r["local_bytes"]) for r in rows if r["local_bytes"]]
    assert not spilled, spilled
    assert all(r["registers"] for r in rows)
    linted = [(r["kernel"], r["config"], r["lint"]) for r in rows if r["lint"]]
    assert not linted, linted


def test_hc_mix_parts_fill_one_cta_an_sm():
    """hc_mix splits K until its grid would pass one CTA an SM (the H100 sweep: Pro 4096 tokens, 4 parts 94.7 us
    against 102.9 at 8 and 119.9 at 16), keeping whole 64-feature chunks a part."""
    from dsv4_kernels.mhc import CHUNK, MIX_TOKENS, mix_parts
    for S, K, want in ((4096, 28672, 4), (1024, 28672, 16), (70, 28672, 32), (8192, 28672, 2), (65536, 28672, 1)):
        parts = mix_parts(S, K, 132)
        assert parts == want, (S, parts)
        assert (K // CHUNK) % parts == 0
        assert parts == 1 or -(-S // MIX_TOKENS) * parts <= 132


def test_nvfp4_one_pass_refuses_a_cta_shape_it_does_not_build():
    """quantize(x, onepass=...) takes only the CTA shapes of ONEPASS_CONFIGS (the ones compiled, linted and
    tested for co-residency), and says so before anything runs."""
    import torch
    from dsv4_kernels import nvfp4
    with pytest.raises(ValueError, match="onepass=.*not one of the compiled CTA shapes"):
        nvfp4.quantize(torch.zeros(4, 64, dtype=torch.bfloat16), onepass={"threads": 2048, "unroll": 1})
