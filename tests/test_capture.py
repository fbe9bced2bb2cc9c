"""Capture format v1: policies, round trips, crash safety, validation, and the inspect/report/diff commands."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dsv4debug import cli
from dsv4debug.capture import (
    FORMAT_VERSION,
    CaptureReader,
    CaptureWriter,
    SavePolicy,
    attribute_doc,
    chunk_shape,
    )
from dsv4debug.errors import BadInput
from dsv4debug.h5chunks import (
    chunk_at,
    encode_chunks,
    encode_rows,
    encode_shuffled,
    row_chunk,
    shuffled,
    source_array,
)

T = 12


def meta():
    return {"token_ids": list(range(T)), "model_config": {"name": "tiny"}, "checkpoint": {"path": "synthetic"}}


def run_main(*args: str) -> int:
    """The real entry point (BadInput -> 2)."""
    try:
        cli.main([str(a) for a in args])
    except SystemExit as e:
        return e.code
    return 0


def run_app(*args: str):
    """The typer app in standalone mode, where typer.Exit(1) becomes exit code 1."""
    cli._register()
    return CliRunner().invoke(cli.app, [str(a) for a in args])


def write_chain(path, perturb=None, policy="full"):
    """A small two-run capture: 3 layers of 3 sites, metrics and floors, optional perturbed element."""
    g = torch.Generator().manual_seed(0)
    with CaptureWriter(path, meta(), policy) as w:
        for run in ("reference", "candidate"):
            w.begin_run(run, {"backend": run, "dtype": "bfloat16", "mode": "free"})
        prev = []
        for layer in range(3):
            for name in ("attn_norm", "attn.wq_a", "ffn"):
                site = f"layers.{layer}.{name}"
                x = torch.randn(T, 4, 32, generator=g).bfloat16()
                cand = x.clone()
                if perturb and perturb[0] == site:
                    cand[perturb[1]] += 10
                w.record("reference", site, x, layer=layer, family=name, inputs=prev)
                w.record("candidate", site, cand, layer=layer, family=name, inputs=prev)
                prev = [site]
            w.end_layer("reference", layer)
            w.end_layer("candidate", layer)
    return path


# ---------------------------------------------------------------------------------------------------------
# policy
# ---------------------------------------------------------------------------------------------------------
def test_policy_parsing():
    assert not SavePolicy.parse("stats").decide("layers.0.ffn", (T, 8), True)[0]
    assert SavePolicy.parse("full").decide("x", (T, 8), True) == (True, (0, T))
    assert SavePolicy.parse("full").decide("x", (5, 8), False) == (True, None)
    policy = SavePolicy.parse("tokens:0:4,sites:attn")
    assert policy.decide("layers.1.attn.wq_a", (T, 8), True) == (True, (0, 4))
    assert policy.decide("layers.1.ffn", (T, 8), True)[0] is False
    # a regex with a comma inside stays one clause; several sites: clauses are OR-ed
    policy = SavePolicy.parse("sites:experts\\.\\d{1,2}$,sites:^embed$")
    assert policy.decide("layers.0.ffn.experts.12", (3, 8), False)[0]
    assert policy.decide("embed", (T, 8), True)[0]
    assert not policy.decide("layers.0.ffn.experts.123", (3, 8), False)[0]
    assert SavePolicy.parse("tokens:8:100").decide("x", (T, 2), True) == (True, (8, T))


@pytest.mark.parametrize("bad", ["", "everything", "tokens:4:2", "tokens:a:b", "sites:(", "stats,full"])
def test_policy_errors_name_the_policy(bad):
    with pytest.raises(BadInput, match="policy"):
        SavePolicy.parse(bad)


# ---------------------------------------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------------------------------------
def test_round_trip_stats_and_tensors(tmp_path):
    path = tmp_path / "c.h5"
    x = torch.randn(T, 4, 300).bfloat16()
    x[2, 1, 5] = float("nan")
    x[3, 0, 0] = float("inf")
    tensors = {
        "embed": x,
        "layers.0.attn.indexer.topk": torch.randint(-1, 50, (T, 6)),
        "layers.0.ffn.experts.123": torch.randn(5, 7000),                 # many chunks, not token-major
        "layers.0.attn.q_norm": torch.randn(T, 3).to(torch.float8_e4m3fn),
        "layers.0.mask": torch.rand(T, 9) > 0.5,
        "layers.0.scalar": torch.tensor(2.5, dtype=torch.float64),
        "layers.0.empty": torch.zeros(0, 4),
    }
    with CaptureWriter(path, meta(), "full") as w:
        w.begin_run("reference", {"backend": "reference", "dtype": "bfloat16", "mode": "free"})
        for i, (site, t) in enumerate(tensors.items()):
            w.record("reference", site, t, layer=-1 if i == 0 else 0, family="f", inputs=["embed"] if i else [],
                     attrs={"note": "hi"} if i == 1 else None)
        w.end_layer("reference", 0)
    with CaptureReader(path) as r:
        assert r.complete and r.runs() == ["reference"]
        assert r.sites("reference") == list(tensors)
        assert r.run_attrs("reference")["backend"] == "reference"
        assert r.meta["model_config"] == {"name": "tiny"} and r.meta["token_ids"] == list(range(T))
        assert r.meta["gpu_statistics"] == "no GPU sites"          # what was used, not what was configured
        for site, t in tensors.items():
            back = r.tensor("reference", site)
            assert back.dtype == t.dtype and back.shape == t.shape
            if t.dtype == torch.bfloat16:      # bit-exact, NaN payload included
                assert torch.equal(back.view(torch.int16), t.view(torch.int16))
            else:
                assert torch.equal(back.float().nan_to_num(), t.float().nan_to_num())
        s = r.stats("reference", "embed")
        finite = x.float()[torch.isfinite(x.float())]
        assert (s["nan_count"], s["inf_count"], s["numel"]) == (1, 1, x.numel())
        assert s["first_nonfinite"] == [2, 1, 5] and s["dtype"] == "bfloat16" and s["shape"] == [T, 4, 300]
        assert s["min"] == finite.min().item() and s["max"] == finite.max().item()
        assert s["mean"] == pytest.approx(finite.double().mean().item(), abs=1e-6)
        assert s["std"] == pytest.approx(finite.double().std().item(), rel=1e-5)
        assert s["l2"] == pytest.approx(finite.double().norm().item(), rel=1e-5)
        site = r.site("reference", "layers.0.attn.indexer.topk")
        assert site["inputs"] == ["embed"] and site["attrs"] == {"note": "hi"} and site["layer"] == 0
        assert site["tensor"]["token_slice"] == [0, T]
        assert r.hash("reference", "embed").startswith("sha256:")
        assert r.layers_completed("reference") == [0]


def test_plain_h5py_reads_stored_tensors_and_hash(tmp_path):
    """No dsv4debug needed: float32 data through the standard shuffle+deflate filters; hash of the bf16 bytes."""
    import hashlib
    x = torch.randn(T, 2000).bfloat16()
    for compression in ("fast", "small"):
        path = tmp_path / f"{compression}.h5"
        with CaptureWriter(path, meta(), "full", compression=compression) as w:
            w.record("reference", "layers.0.ffn", x, layer=0)
        with h5py.File(path, "r") as f:
            dset = f["runs/reference/tensors/layers.0.ffn"]
            data = dset[()]
            assert dset.dtype == np.float32 and dset.compression == "gzip" and dset.shuffle
            assert np.array_equal(data, x.float().numpy())
            bf16_bytes = (data.view(np.uint32) >> 16).astype("<u2").tobytes()
            digest = hashlib.sha256(bf16_bytes).hexdigest()
            assert dset.attrs["hash"] == f"sha256:{digest}"
            assert f.attrs["format_version"] == FORMAT_VERSION


def test_writer_fsyncs_in_the_background_every_sync_bytes(tmp_path, monkeypatch):
    """Each SYNC_BYTES of chunks written, the writer fsyncs the unfinished file in the background (close() then
    waits only for the rest to reach the disk); the capture reads back bit-exact."""
    import dsv4debug.capture as cap
    synced, fsync = [], cap._fsync
    monkeypatch.setattr(cap, "SYNC_BYTES", 1 << 20)
    monkeypatch.setattr(cap, "_fsync", lambda path: synced.append(path) or fsync(path))
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(T, 1 << 17, generator=g) for _ in range(4)]            # 6 MiB each
    path = tmp_path / "c.h5"
    with CaptureWriter(path, meta(), "full") as w:
        for i, t in enumerate(tensors):
            w.record("reference", f"layers.{i}.ffn", t, layer=i)
    assert synced.count(w.tmp_path) >= 2, synced            # one or more in the background, one at close
    with CaptureReader(path) as r:
        for i, t in enumerate(tensors):
            assert torch.equal(r.tensor("reference", f"layers.{i}.ffn"), t)


def test_row_blocks_decode_what_hdf5_decodes(tmp_path):
    """diff's own chunk decoding (stored blocks cut apart, zero planes skipped) gives h5py's values for every
    layout: bf16 in both compressions, an all-zero bf16 tensor (other zero planes), float32, int64 ids, and
    a last chunk cut at the dataset's edge."""
    from dsv4debug.h5chunks import _inflate, from_storage
    g = torch.Generator().manual_seed(5)
    rows = (T, 50_000)                                  # 200 KB a stored row: chunks of 5 rows, the last of 2
    tensors = {"bf16": torch.randn(T, 2, 25_000, generator=g).bfloat16(), "zeros": torch.zeros(rows).bfloat16(),
               "f32": torch.randn(rows, generator=g), "ids": torch.randint(0, 384, (T, 25_000), generator=g)}
    for compression in ("fast", "small"):
        path = tmp_path / f"{compression}.h5"
        with CaptureWriter(path, meta(), "full", compression=compression) as w:
            for i, (name, t) in enumerate(tensors.items()):
                w.record("reference", f"layers.{i}.{name}", t, layer=i)
        with CaptureReader(path) as r:
            for i, (name, t) in enumerate(tensors.items()):
                site = f"layers.{i}.{name}"
                dset = r.dataset("reference", site)
                assert dset.chunks[0] < t.shape[0] and t.shape[0] % dset.chunks[0], (site, dset.chunks)
                got = torch.cat([block for _, block in r.row_blocks("reference", site)])
                assert got.dtype == t.dtype and torch.equal(got, t), (compression, site)
                assert torch.equal(got, from_storage(dset[()], str(t.dtype).removeprefix("torch.")))
                _, raw = dset.id.read_direct_chunk((0,) * dset.ndim)
                zeros, _ = _inflate(raw, math.prod(dset.chunks) * dset.dtype.itemsize)
                assert (zeros > 0) == (name == "bf16" and compression == "fast"), (compression, site)  # fast path


def test_encoded_chunks_decode_with_zlib_and_unshuffle():
    import zlib
    chunk = np.random.default_rng(0).standard_normal((64, 100)).astype(np.float32)
    chunk[:, :50] = 0       # all-zero byte planes in part of the data
    ids = np.arange(300, dtype=np.int64).reshape(3, 100)          # zero high byte planes between data planes
    bf16_bits = torch.from_numpy(chunk).bfloat16().view(torch.int16).numpy().view(np.uint16)
    widened = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    cases = ((chunk, False, chunk), (bf16_bits, True, widened), (ids, False, ids))
    for compression in ("fast", "small"):
        for source, widen, expected in cases:
            data, zeros = shuffled(source, widen)
            stream = encode_shuffled(data, zeros, source.size, compression)
            raw = np.frombuffer(zlib.decompress(stream), dtype=np.uint8)
            unshuffled = raw.reshape(expected.itemsize, -1).T.copy().view(expected.dtype).reshape(expected.shape)
            assert np.array_equal(unshuffled, expected)


def test_encode_rows_builds_the_host_encoders_streams():
    """The GPU's chunk encoder (torch ops, run here on the CPU) gives the host encoder's bytes for chunks of
    whole rows: bf16 widened, float32, float64, an edge chunk padded, stored blocks cut mid-plane; its
    adler32 (sums, not zlib) holds where int64 sums are largest (every byte 0xFF, a whole 1 MiB chunk); and
    where a data plane is all zero (which the host encoder folds) it still decodes to the same chunk."""
    import zlib
    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(T, 50_000, generator=g).bfloat16(),           # chunks of 5, 5 and 2 rows
             torch.randn(T, 3, 7_001, generator=g).bfloat16(),
             torch.randn(T, 5_000, generator=g),
             torch.randn(77, 100, generator=g, dtype=torch.float64),
             torch.full((T, 65536), -1, dtype=torch.int32).view(torch.float32),   # NaN bits: all bytes 0xFF
             torch.zeros(T, 1000).bfloat16()]                           # its data planes are zero too
    for t in cases:
        arr, dtype, widen = source_array(t)
        chunk = chunk_shape(arr.shape, dtype.itemsize)
        assert row_chunk(t.dtype, t.shape, "fast") == chunk[0] and row_chunk(t.dtype, t.shape, "small") is None
        origins = [(i,) + (0,) * (t.dim() - 1) for i in range(0, t.shape[0], chunk[0])]
        host = encode_chunks(arr, origins, chunk, "fast", widen)
        rows = encode_rows(t, chunk[0])
        assert rows.shape[0] == len(host)
        for origin, want, got in zip(origins, host, rows.numpy()):
            region = chunk_at(arr, origin, chunk).reshape(-1)
            planes = np.frombuffer(zlib.decompress(got.tobytes()), dtype=np.uint8)   # checks the adler32
            expected = (region.astype(np.uint32) << 16).view(np.float32) if widen else region
            assert planes.reshape(dtype.itemsize, -1).T.tobytes() == expected.tobytes()     # NaN bits too
            if t.abs().sum() > 0:
                assert got.tobytes() == want.tobytes(), (t.dtype, t.shape, origin)
    assert row_chunk(torch.int64, (T, 8), "fast") is None and row_chunk(torch.float32, (2, 1 << 20), "fast") is None


def test_chunk_shape_bounds_chunk_bytes():
    assert chunk_shape((4096, 4, 7168), 4) == (9, 4, 7168)
    assert chunk_shape((10, 1 << 22), 4) == (1, 1 << 18)
    assert chunk_shape((3, 5), 8) == (3, 5)


def test_token_slice_policy(tmp_path):
    path = tmp_path / "c.h5"
    x = torch.randn(T, 16)
    with CaptureWriter(path, meta(), "tokens:2:5,sites:wq_a") as w:
        w.record("reference", "layers.0.attn.wq_a", x, layer=0)
        w.record("reference", "layers.0.ffn", x, layer=0)
        w.record("reference", "layers.0.attn.compressor", torch.randn(3, 16), layer=0)
    with CaptureReader(path) as r:
        assert torch.equal(r.tensor("reference", "layers.0.attn.wq_a"), x[2:5])
        assert r.site("reference", "layers.0.attn.wq_a")["tensor"]["token_slice"] == [2, 5]
        assert r.site("reference", "layers.0.attn.wq_a")["stats"]["shape"] == [T, 16]
        assert not r.site("reference", "layers.0.ffn")["stored"]
        with pytest.raises(BadInput, match="statistics only"):
            r.tensor("reference", "layers.0.ffn")


def test_metrics_floors_verdict_round_trip(tmp_path):
    path = tmp_path / "c.h5"
    with CaptureWriter(path, meta()) as w:
        w.record("reference", "embed", torch.ones(T, 4), layer=-1)
        w.write_metrics("candidate", {"embed": {"cosine": 0.5, "max_abs_index": [1, 2], "max_rel_index": None}})
        w.write_metrics("candidate", {"embed": {"rel_l2": math.inf}})
        w.write_floors({"embed": {"rel_l2": 0.002}}, source="reference vs reference.fp64")
        w.write_verdict({"status": "diverged", "gain": None})
    with CaptureReader(path) as r:
        assert r.metrics("candidate") == {"embed": {"cosine": 0.5, "max_abs_index": [1, 2], "max_rel_index": None,
                                                    "rel_l2": math.inf}}
        assert r.metrics_reference("candidate") == "reference"
        assert r.floors() == {"embed": {"rel_l2": 0.002}}
        assert r.verdict() == {"status": "diverged", "gain": None}


def test_record_twice_and_bad_names(tmp_path):
    with CaptureWriter(tmp_path / "c.h5", meta()) as w:
        w.record("reference", "embed", torch.ones(2), layer=-1)
        with pytest.raises(BadInput, match="twice"):
            w.record("reference", "embed", torch.ones(2), layer=-1)
        with pytest.raises(BadInput, match="no '/'"):
            w.record("reference", "a/b", torch.ones(2), layer=-1)


# ---------------------------------------------------------------------------------------------------------
# crash safety, overwrite, validation
# ---------------------------------------------------------------------------------------------------------
KILLED_WRITER = textwrap.dedent("""
    import sys, torch
    from dsv4debug import capture
    capture._StatsSlab.DEFER_BYTES = 3 * 64 * 2048 * 2        # GPU stats-only: batches of 3 sites within a layer,
    capture._StatsSlab.FLUSH_EACH_BATCH = True                # their rows in the table before the layer ends
    path, device, policy = sys.argv[1:]
    w = capture.CaptureWriter(path, {"token_ids": list(range(64))}, policy)
    layer = 0
    while True:
        for i in range(10):
            x = torch.randn(64, 2048, device=device).bfloat16()
            w.record("reference", f"layers.{layer}.site{i}", x, layer=layer)
        w.end_layer("reference", layer)
        print(layer, flush=True)
        layer += 1
""")


@pytest.mark.parametrize("device,policy", [
    ("cpu", "full"), ("cpu", "stats"),
    pytest.param("cuda", "stats", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="needs a CUDA GPU")])])
def test_kill_9_leaves_readable_file_with_finished_layers(device, policy, tmp_path):
    """kill -9 in the middle of a layer: the .tmp file opens, every layer listed as completed has all its
    rows (and tensors), and no site of an unfinished layer has a row, though a GPU stats-only capture writes
    its rows into the table a batch at a time during the layer."""
    path = tmp_path / "killed.h5"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), device, policy],
                            stdout=subprocess.PIPE, text=True)
    ended = [int(proc.stdout.readline()) for _ in range(3)]
    proc.send_signal(signal.SIGKILL)     # while it is writing layer 3
    proc.wait()
    assert not path.exists()
    with CaptureReader(f"{path}.tmp") as r:
        assert not r.complete
        assert r.meta["gpu_statistics"] == "not known: the capture was not closed"    # never a guess
        done = r.layers_completed("reference")
        assert done[:len(ended)] == ended
        assert r.sites("reference") == [f"layers.{layer}.site{i}" for layer in done for i in range(10)]
        for site in r.sites("reference"):
            assert r.stats("reference", site)["numel"] == 64 * 2048
            if policy == "full":
                assert r.tensor("reference", site).shape == (64, 2048)
    assert run_main("inspect", f"{path}.tmp") == 0


def test_overwrite_refused_without_force(tmp_path):
    path = tmp_path / "c.h5"
    with CaptureWriter(path, meta()) as w:
        w.record("reference", "embed", torch.ones(2), layer=-1)
    with pytest.raises(BadInput, match="exists"):
        CaptureWriter(path, meta())
    with CaptureWriter(path, meta(), force=True) as w:
        w.record("reference", "other", torch.ones(2), layer=-1)
    with CaptureReader(path) as r:
        assert r.sites("reference") == ["other"]


def test_exception_in_block_leaves_incomplete_tmp(tmp_path):
    path = tmp_path / "c.h5"
    with pytest.raises(RuntimeError), CaptureWriter(path, meta()) as w:
        w.record("reference", "embed", torch.ones(2), layer=-1)
        w.end_layer("reference", -1)
        raise RuntimeError("runner crashed")
    assert not path.exists()
    with CaptureReader(f"{path}.tmp") as r:
        assert not r.complete and r.sites("reference") == ["embed"]
        assert r.meta["gpu_statistics"] == "no GPU sites"                # stopped by abort(): what it used
    with pytest.raises(BadInput, match="unfinished"):
        CaptureWriter(path, meta())


def test_bad_files_are_bad_input_with_the_file_named(tmp_path):
    good = write_chain(tmp_path / "good.h5", policy="stats")
    not_hdf5 = tmp_path / "text.h5"
    not_hdf5.write_text("hello")
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[:2000])
    alien = tmp_path / "alien.h5"
    with h5py.File(alien, "w") as f:
        f["x"] = np.arange(3)
    future = tmp_path / "future.h5"
    future.write_bytes(good.read_bytes())
    with h5py.File(future, "r+") as f:
        f.attrs["format_version"] = 99
    cases = {not_hdf5: "not an HDF5 file", truncated: "truncated or corrupt", alien: "not a dsv4debug capture",
             future: "version 99", tmp_path / "missing.h5": "no such file"}
    for path, message in cases.items():
        with pytest.raises(BadInput, match=message) as err:
            CaptureReader(path)
        assert str(path) in str(err.value)
        assert run_main("inspect", path) == 2
        assert run_main("report", path) == 2


# ---------------------------------------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------------------------------------
def test_diff_identical_captures_is_clean(tmp_path):
    a = write_chain(tmp_path / "a.h5")
    b = write_chain(tmp_path / "b.h5")
    result = run_app("diff", a, b, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["clean"] and doc["counts"] == {"identical": 9}


def test_diff_finds_one_perturbed_element(tmp_path):
    a = write_chain(tmp_path / "a.h5")
    b = write_chain(tmp_path / "b.h5", perturb=("layers.1.attn.wq_a", (3, 2, 7)))
    result = run_app("diff", a, b, "--json")
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["first_failure"] == "layers.1.attn.wq_a"
    bad = next(s for s in doc["sites"] if s["site"] == "layers.1.attn.wq_a")
    assert bad["mode"] == "tensor" and bad["metrics"]["max_abs_index"] == [3, 2, 7]
    assert bad["metrics"]["mismatches"] == 1
    assert doc["counts"] == {"identical": 8, "exceeds": 1}
    text = run_app("diff", a, b)
    assert text.exit_code == 1 and "layers.1.attn.wq_a" in text.output and "[3, 2, 7]" in text.output
    assert run_main("diff", a, b) == 1 and run_main("diff", a, a) == 0


def test_diff_stats_fallback_missing_sites_and_rules(tmp_path):
    a = write_chain(tmp_path / "a.h5", policy="stats")
    b = write_chain(tmp_path / "b.h5", policy="stats", perturb=("layers.2.ffn", (0, 0, 0)))
    doc = json.loads(run_app("diff", a, b, "--json").output)
    bad = next(s for s in doc["sites"] if s["site"] == "layers.2.ffn")
    assert bad["mode"] == "stats" and bad["status"] == "exceeds"
    rules = tmp_path / "rules.toml"
    rules.write_text('[default]\nrel_l2_max = 0.5\n[[rule]]\nsites = "ffn$"\nignore = true\n')
    assert run_app("diff", a, b, "--rules", rules).exit_code == 0
    c = tmp_path / "c.h5"
    with CaptureWriter(c, meta()) as w:
        w.record("candidate", "layers.0.attn_norm", torch.ones(T, 4, 32), layer=0)
    doc = json.loads(run_app("diff", a, c, "--json").output)
    assert doc["counts"]["only_in_a"] == 8 and not doc["clean"]
    bad_rules = tmp_path / "bad.toml"
    bad_rules.write_text('[[rule]]\nsites = "x"\ncosine = 3\n')
    assert run_main("diff", a, b, "--rules", bad_rules) == 2


def test_inspect_and_report(tmp_path):
    path = write_chain(tmp_path / "a.h5")
    result = run_app("inspect", path, "--json")
    assert result.exit_code == 0
    info = json.loads(result.output)
    assert info["complete"] and [r["sites"] for r in info["runs"]] == [9, 9] and info["save_policy"] == "full"
    html_path = tmp_path / "r.html"
    result = run_app("report", path, "--html", html_path)
    assert result.exit_code == 0 and "verdict" in result.output
    page = html_path.read_text()
    assert "<svg" in page and "<script" not in page and "http" not in page.replace("http://www.w3.org", "")


def test_attribute_doc_lists_every_group():
    doc = attribute_doc()
    for needle in ("format_version", "layers_completed", "first_nonfinite", "token_slice", "/floors"):
        assert needle in doc


def test_readme_attribute_tables_match_the_code():
    from pathlib import Path
    readme = (Path(__file__).parents[1] / "captures" / "README.md").read_text()
    begin = "<!-- BEGIN GENERATED: python -m dsv4debug.capture --doc -->\n"
    generated = readme[readme.index(begin) + len(begin):readme.index("<!-- END GENERATED -->")]
    assert generated == attribute_doc() + "\n", "regenerate with python -m dsv4debug.capture --doc"


def test_report_with_metrics_experts_and_html(tmp_path):
    from dsv4debug.metrics import compare
    path = tmp_path / "experts.h5"
    g = torch.Generator().manual_seed(1)
    with CaptureWriter(path, meta(), "stats") as w:
        metrics, floors = {}, {}
        for layer in range(2):
            for expert in range(4):
                site = f"layers.{layer}.ffn.experts.{expert}"
                ref = torch.randn(5, 64, generator=g)
                cand = ref * (1.5 if (layer, expert) == (1, 3) else 1.0)     # one broken expert
                w.record("reference", site, ref, layer=layer, token_dim=False)
                w.record("candidate", site, cand, layer=layer, token_dim=False)
                metrics[site], floors[site] = compare(ref, cand), {"rel_l2": 0.002}
            w.end_layer("candidate", layer)
        w.write_metrics("candidate", metrics)
        w.write_floors(floors, "test")
    html_path = tmp_path / "r.html"
    result = run_app("report", path, "--json", "--html", html_path)
    assert result.exit_code == 1                                   # a divergence was found
    doc = json.loads(result.output)
    assert doc["verdict"]["first_divergence"]["site"] == "layers.1.ffn.experts.3"
    page = html_path.read_text()
    assert "layer 1 expert 3: 250" in page and page.count("<rect") >= 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
                                   torch.int64, torch.bool])
def test_device_and_host_statistics_agree(dtype, monkeypatch):
    """The statistics a GPU capture computes (torch, in the tensor's own dtype, chunk by chunk) equal those of
    a CPU capture (numpy blocks), NaN/Inf and the first non-finite element's coordinates included."""
    from dsv4debug import tensorstats as ts
    monkeypatch.setattr(ts, "DEVICE_CHUNK", 1000)                    # several device chunks
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, 613, generator=g) * 3
    if dtype.is_floating_point and dtype != torch.float8_e4m3fn:
        x[2, 5], x[4, 100], x[6, 7] = float("nan"), float("inf"), -float("inf")
    x = (x > 0) if dtype == torch.bool else x.to(dtype)
    host = ts.combine_blocks([ts.block_stats(b) for b in ts.host_blocks(x)], x.numel(), ts.HOST_BLOCK)
    device = ts.combine_blocks(list(ts.device_stats(x).numpy()), x.numel(), ts.DEVICE_CHUNK)
    exact = (0, 1, 2, 3, 6, 8)                                         # counts, min, max, absmax, first bad
    assert [host[i] for i in exact] == [device[i] for i in exact]
    # sums: float64 on both sides, except the host's bf16 blocks (float32 pairwise sums, ~1e-7 log2 n)
    rel = 1e-6 if dtype == torch.bfloat16 else 1e-12
    assert [device[i] for i in (4, 5, 7)] == pytest.approx([host[i] for i in (4, 5, 7)], rel=rel)


def test_std_past_float64_range_is_inf_without_a_warning():
    """A finite fp64 site whose sum of squares overflows float64 has std inf (not the NaN of inf - inf), and
    combining its statistics raises no numpy overflow warning."""
    import warnings

    from dsv4debug import tensorstats as ts
    x = np.array([1e200, -1e200, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = ts.combine_blocks([ts.block_stats(x)], x.size, x.size)
    stats = dict(zip(ts.STAT_VALUES, values))
    assert stats["std"] == math.inf and stats["absmax"] == 1e200 and stats["nan_count"] == 0


def test_combine_segments_equals_combine_blocks_site_by_site(monkeypatch):
    """A GPU capture combines a layer's statistics rows for all its sites at once (combine_segments): the same
    values as combine_blocks site by site, for sites of one or several blocks, of different block sizes, empty,
    all finite, with NaN/Inf in a later block (first index counted from the site's start), or nothing finite."""
    from dsv4debug import tensorstats as ts
    monkeypatch.setattr(ts, "DEVICE_CHUNK", 500)
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=g) for n in (7, 1200, 0, 500, 1001, 64)]
    tensors[1][777], tensors[1][1100] = float("nan"), float("inf")
    tensors[4][:] = float("-inf")
    tensors[4][3] = float("nan")
    parts = [ts.device_stats(t).numpy() for t in tensors]
    rows = np.concatenate([p for p in parts if len(p)])
    counts = np.array([len(p) for p in parts])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    numels = np.array([t.numel() for t in tensors])
    got = ts.combine_segments(rows, starts, counts, numels, np.full(len(tensors), ts.DEVICE_CHUNK))
    for i, (t, p) in enumerate(zip(tensors, parts)):
        want = ts.combine_blocks(list(p), t.numel(), ts.DEVICE_CHUNK)
        assert got[i].tolist() == pytest.approx(want, rel=1e-12, nan_ok=True), i
    assert got[1][8] == 777 and got[4][8] == 0 and got[2][8] == -1
    with pytest.raises(ValueError, match="consecutive"):
        ts.combine_segments(rows, starts[::-1], counts[::-1], numels, numels)


def test_site_rows_hold_each_sites_statistics():
    """The writer builds a batch's site-table rows column by column, the statistics' columns apart
    (stats_columns, once they are in): read back, each row holds the statistics stats_dict gives that site alone, for finite sites, NaN/Inf ones (first coordinates),
    sites with nothing finite (NaN extremes and moments, l2 0), empty and scalar sites."""
    from dsv4debug import capture as cap
    from dsv4debug import tensorstats as ts
    g = torch.Generator().manual_seed(5)
    sites = {"finite": torch.randn(3, 40, generator=g), "bad": torch.randn(2, 3, 50, generator=g).bfloat16(),
             "no_finite": torch.full((4, 8), float("nan")), "empty": torch.zeros(0, 5), "scalar": torch.tensor(2.5)}
    sites["bad"][1, 2, 7], sites["bad"][1, 2, 9] = float("inf"), float("nan")
    sites["no_finite"][3, 1] = -float("inf")
    jobs = []
    for i, (name, t) in enumerate(sites.items()):
        job = cap._SiteJob("r", {"site": name, "order": i, "layer": 0, "family": "f", "inputs": ["embed"],
                                 "attrs": {"k": i} if i else {}}, t.dtype, tuple(t.shape), None, None, 0)
        job.values = ts.combine_blocks([ts.block_stats(b) for b in ts.host_blocks(t)], t.numel(), ts.HOST_BLOCK)
        jobs.append(job)
    rows = cap._site_rows(jobs, stored=False)
    cap._set_statistics(rows, jobs)
    for i, (name, t) in enumerate(sites.items()):
        record = cap._site_record("r", rows[i])
        assert record["site"] == name and record["inputs"] == ["embed"] and not record["stored"]
        assert record["attrs"] == ({"k": i} if i else {})
        assert _same_stats(record["stats"], ts.stats_dict(jobs[i].values, t.dtype, tuple(t.shape))), name
        assert record["stats"]["nan_count"] == t.isnan().sum() and record["stats"]["numel"] == t.numel()
    assert cap._site_record("r", rows[1])["stats"]["first_nonfinite"] == [1, 2, 7]
    no_finite = cap._site_record("r", rows[2])["stats"]
    assert math.isnan(no_finite["min"]) and math.isnan(no_finite["std"]) and no_finite["l2"] == 0.0


def _same_stats(got: dict, want: dict) -> bool:
    """Site statistics equal, NaN equal to NaN; sums (mean, std, l2) to float64 rounding."""
    def same(k):
        a, b = got[k], want[k]
        if isinstance(a, float) and isinstance(b, float):
            return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12)
        return a == b
    return got.keys() == want.keys() and all(same(k) for k in got)


@pytest.mark.parametrize("flush_each_batch", [False, True])
def test_stats_slab_batches_sites_and_refuses_one_changed_before_its_launch(flush_each_batch, monkeypatch):
    """The rows slab of a GPU capture, run on CPU tensors with torch-op statistics: sites wait until
    DEFER_BYTES of them wait (then one launch for all, and with FLUSH_EACH_BATCH handed to the writer at once),
    the slab grows under waiting sites, every site gets tensor_stats' statistics, and a site changed in place
    before its batch is refused, naming it."""
    from dsv4debug import capture as cap
    from dsv4debug import tensorstats as ts
    monkeypatch.setattr(cap._StatsSlab, "FLUSH_EACH_BATCH", flush_each_batch)
    monkeypatch.setattr(cap._StatsSlab, "ROWS", 2)
    monkeypatch.setattr(cap._StatsSlab, "DEFER_BYTES", 3 * 4 * 5000)           # three [5000] fp32 sites
    batches = []
    fill = cap.fill_device_rows
    monkeypatch.setattr(cap, "fill_device_rows", lambda items, out: (batches.append(len(items)), fill(items, out)))
    g = torch.Generator().manual_seed(3)
    sites = {f"s{i}": torch.randn(5000 + 4_194_304 * (i == 4), generator=g) * (i + 1) for i in range(7)}
    sites["s2"][17] = float("nan")
    submitted: list = []
    slab = cap._StatsSlab(submitted.append)
    jobs = {}
    for name, t in sites.items():
        jobs[name] = cap._SiteJob("r", {"site": name}, t.dtype, tuple(t.shape), None, None, 0)
        slab.add(jobs[name], t, kernel=False)
    assert batches == [3, 2]                  # s0-s2 at the limit; s3 and the large s4 at once; s5, s6 wait
    handed = [[j.row["site"] for j in batch] for batch in submitted]
    assert handed == ([["s0", "s1", "s2"], ["s3", "s4"]] if flush_each_batch else [])
    slab.flush()
    assert batches == [3, 2, 2] and not slab.unlaunched and len(submitted) == (3 if flush_each_batch else 1)
    cap._combine_batch([job for batch in submitted for job in batch])
    for name, t in sites.items():
        want = ts.tensor_stats(t)
        got = ts.stats_dict(jobs[name].values, t.dtype, tuple(t.shape))
        assert _same_stats(got, want), name
    late = torch.ones(5000)
    slab.add(cap._SiteJob("r", {"site": "late"}, late.dtype, (5000,), None, None, 0), late, kernel=False)
    late.mul_(2)
    with pytest.raises(RuntimeError, match="'late' of run 'r' was modified in place"):
        slab.flush()


def test_slab_batch_rows_get_their_statistics_and_a_failed_batch_leaves_none(tmp_path, monkeypatch):
    """A slab batch's rows go into the site table before their statistics are in, then the statistics'
    columns (the writer's slab run on CPU tensors with torch-op statistics): read back, every row holds its
    site's statistics, a NaN site's first element included, in execution order across runs. A batch whose
    statistics fail leaves none of its rows: the table keeps the finished layer's only."""
    from dsv4debug import capture as cap
    from dsv4debug import tensorstats as ts
    g = torch.Generator().manual_seed(4)
    sites = {f"layers.0.s{i}": torch.randn(300 * (i + 1), generator=g) for i in range(5)}
    sites["layers.0.s3"][[41, 77]] = float("nan")
    writer = cap.CaptureWriter(tmp_path / "c.h5", {"token_ids": [1, 2, 3]}, "stats")

    def add(run, order, name, t):
        job = cap._SiteJob(run, {"site": name, "order": order, "layer": 0, "family": "f", "inputs": [],
                                 "attrs": {}}, t.dtype, tuple(t.shape), None, None, 0)
        writer._slab.add(job, t, kernel=False)
    for run in ("a", "b"):
        writer.begin_run(run)
    for i, (name, t) in enumerate(sites.items()):
        for run in ("a", "b"):
            add(run, i, name, t * (2 if run == "b" else 1))
    writer.end_layer("a", 0)
    monkeypatch.setattr(cap, "_combine_batch", lambda jobs: 1 / 0)
    add("a", 5, "layers.1.s0", torch.ones(8))
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        writer.end_layer("a", 1)
    with h5py.File(writer.abort()) as f:
        for run, scale in (("a", 1), ("b", 2)):
            table = f[f"runs/{run}/sites"][:]
            assert [r["site"].decode() for r in table] == list(sites)
            for row, (name, t) in zip(table, sites.items()):
                got = cap._site_record(run, row)["stats"]
                assert _same_stats(got, ts.tensor_stats(t * scale)), name
            assert cap._site_record(run, table[3])["stats"]["first_nonfinite"] == [41]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("max_sites", [None, 3], ids=["one-launch-a-dtype", "launches-of-3-sites"])
def test_site_stats_kernel_equals_eager_statistics(max_sites, monkeypatch):
    """The site_stats kernel, many tensors of every dtype in one call (as a capture batches its sites), gives
    each the eager device statistics: counts, extremes, absmax and the first non-finite element exactly,
    sums to float64 rounding; sizes of one partial CTA, several CTAs and a ragged last one; NaN/Inf anywhere,
    or none, or nothing finite; rows written at their offsets only. Also where a dtype's sites take more than
    one launch (a launch takes at most MAX_SITES, here 3 of 4)."""
    from dsv4_kernels import stats

    from dsv4debug import tensorstats as ts
    if max_sites:
        monkeypatch.setattr(stats, "MAX_SITES", max_sites)
    g = torch.Generator(device="cuda").manual_seed(5)
    tensors = []
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for n, bad in ((64, (3,)), (7 * 40960, (0, 9999, 286719)), (3 * 32768 + 8 * 300, ()), (4096, range(4096))):
            x = (torch.randn(n, device="cuda", generator=g, dtype=torch.float64) * 3).to(dtype)
            if dtype == torch.float64:
                x[1] = -1e300                           # finite in fp64, beyond fp32: not an Inf, and the min
            for i, v in zip(bad, [float("nan"), float("inf"), -float("inf")] * n):
                x[i] = v
            tensors.append(x)
    items, first = [], 1                                  # row 0 and the gaps stay untouched
    for x in tensors:
        rows, block, by = ts.device_rows(x, kernel=True)
        assert by == ts.KERNEL and block != ts.DEVICE_CHUNK     # the kernel runs, not the eager fallback
        items.append((x, first, rows, block))
        first += rows + 1
    out = torch.full((first, len(ts.PARTIALS)), 7.0, dtype=torch.float64, device="cuda")
    ts.fill_device_rows([(x, f, ts.KERNEL) for x, f, _, _ in items], out)
    host = out.cpu().numpy()
    for x, f, rows, block in items:
        got = ts.combine_blocks(list(host[f:f + rows]), x.numel(), block)
        want = ts.combine_blocks(list(ts.device_stats(x).cpu().numpy()), x.numel(), ts.DEVICE_CHUNK)
        exact = (0, 1, 2, 3, 6, 8)
        assert [got[i] for i in exact] == [want[i] for i in exact], (x.dtype, x.numel(), got, want)
        assert [got[i] for i in (4, 5, 7)] == pytest.approx([want[i] for i in (4, 5, 7)], rel=1e-12, nan_ok=True)
        assert (host[f - 1] == 7.0).all()                  # the row before each tensor's is not written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel,defer", [(False, True), (True, True), (True, False)],
                         ids=["eager", "site_stats", "site_stats-at-record"])
def test_gpu_capture_rows_slab_gives_every_site_its_own_statistics(kernel, defer, tmp_path, monkeypatch):
    """A GPU capture writes its sites' statistics rows into one device slab, launched a batch of sites at a
    time, flushed in one copy and combined a batch at a time: with a slab that grows and flushes within a
    layer (a site larger than its limit too), batches launched within it, stored sites among stats-only ones
    and a site's statistics asked for before the layer ends, every site still gets its own statistics, those
    of tensor_stats, and the site table keeps execution order. Launched at record() (defer_stats=False, as
    the hooks capture engines), the caller may then reuse its tensors at once."""
    from dsv4debug import capture as cap
    from dsv4debug import tensorstats as ts
    monkeypatch.setattr(cap._StatsSlab, "ROWS", 2)                  # grows within a layer
    monkeypatch.setattr(cap._StatsSlab, "MAX_ROWS", 3)              # and flushes within it
    monkeypatch.setattr(cap._StatsSlab, "DEFER_BYTES", 200_000)     # and launches a batch within it
    g = torch.Generator(device="cuda").manual_seed(1)
    sites = {}
    for i in range(12):
        x = torch.randn(64, 8 + 40960 * (i % 4 == 3), device="cuda", generator=g) * (i + 1)
        if i % 3 == 0:
            x.view(-1)[i * 7] = float("nan")
        sites[f"layers.0.s{i}"] = x.to((torch.float32, torch.bfloat16, torch.float64, torch.bfloat16)[i % 4])
    want = {site: ts.tensor_stats(x) for site, x in sites.items()}
    path = tmp_path / "slab.h5"
    with CaptureWriter(path, {"token_ids": list(range(64))}, "sites:s5$", stats_kernel=kernel,
                       defer_stats=defer) as w:
        pending = {site: w.record("r", site, x, layer=0) for site, x in sites.items()}
        assert _same_stats(pending["layers.0.s4"].stats(), want["layers.0.s4"])
        if not defer:
            for x in sites.values():
                x.fill_(1.0)                 # the writer took what it needs before record() returned
        w.end_layer("r", 0)
    with CaptureReader(path) as r:
        assert r.sites("r") == list(sites)
        for site in sites:
            assert _same_stats(r.stats("r", site), want[site]), site
        assert r.tensor("r", "layers.0.s5").eq(1.0).sum() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_capture_refuses_a_site_changed_in_place_before_its_statistics(tmp_path):
    """A deferred site's tensor changed in place before its batch is launched would get the statistics of
    other values: the launch fails naming the site, and the capture does not close as if it were fine."""
    path = tmp_path / "inplace.h5"
    w = CaptureWriter(path, {"token_ids": list(range(4))}, "stats")
    x = torch.ones(4, 64, device="cuda", dtype=torch.bfloat16)
    w.record("r", "layers.0.a", x, layer=0)
    w.record("r", "layers.0.b", x * 2, layer=0)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="'layers.0.a' of run 'r' was modified in place"):
        w.end_layer("r", 0)
    w.abort()
    assert not path.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_full_capture_encodes_on_the_gpu_what_the_host_writes(tmp_path, monkeypatch):
    """Stored GPU sites of row-chunked float dtypes get their chunk streams from the GPU (encode_rows, in
    slices of whole chunks), and the file holds the same chunk bytes, hashes and values as a capture of the
    same tensors on the CPU (host encoder); int64 ids, which the host encodes, too."""
    from dsv4debug import capture as cap
    monkeypatch.setattr(cap, "ENCODE_BYTES", 300_000)              # several encode_rows calls a site
    calls = []
    monkeypatch.setattr(cap, "encode_rows", lambda t, rows: calls.append(t.shape) or encode_rows(t, rows))
    g = torch.Generator().manual_seed(4)
    sites = {"layers.0.bf16": torch.randn(T, 50_000, generator=g).bfloat16(),
             "layers.0.f32": torch.randn(T, 3, 700, generator=g),
             "layers.0.f64": torch.randn(T, 64, generator=g, dtype=torch.float64),
             "layers.0.ids": torch.randint(0, 384, (T, 6), generator=g)}
    paths = {}
    for device in ("cpu", "cuda"):
        paths[device] = tmp_path / f"{device}.h5"
        with CaptureWriter(paths[device], meta(), "full") as w:
            for site, x in sites.items():
                w.record("r", site, x.to(device), layer=0)
            w.end_layer("r", 0)
    assert len(calls) > 3 and all(shape[0] < T for shape in calls[:3])
    with CaptureReader(paths["cpu"]) as host, CaptureReader(paths["cuda"]) as gpu:
        for site, x in sites.items():
            assert torch.equal(gpu.tensor("r", site), x) and gpu.hash("r", site) == host.hash("r", site), site
            a, b = host.dataset("r", site), gpu.dataset("r", site)
            for origin in range(0, T, a.chunks[0]):
                key = (origin,) + (0,) * (a.ndim - 1)
                assert a.id.read_direct_chunk(key) == b.id.read_direct_chunk(key), (site, origin)
