"""`dsv4debug gate`: per-site budgets against a baseline capture, rules, JUnit XML, markdown, --update, goldens.

Three captures of layers 2-3 of the tiny model (48 tokens; layers 0-1 run on the reference only) are shared
by the module: the sim candidate (the baseline), the sim with a 5 % scale planted at layers.3.attn.wkv (a
regression), and the reference as candidate (an improvement: every error goes to zero). Other cases are
copies edited with h5py.
"""
import json
import math
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import h5py
import numpy as np
import pytest

import dsv4debug.api as dd
from dsv4debug import cli
from dsv4debug.capture import CaptureReader
from dsv4debug.errors import BadInput
from dsv4debug.gate import (
    GOLDEN_SEED,
    GOLDEN_SEQ_LEN,
    GOLDENS,
    gate,
    junit_xml,
    load_gate_rules,
    markdown_summary,
    write_golden,
)

CAPTURES = Path(__file__).resolve().parent.parent / "captures"
FAULT_SITE = "layers.3.attn.wkv"


def run_main(*args) -> int:
    try:
        cli.main([str(a) for a in args])
    except SystemExit as e:
        return e.code
    return 0


@pytest.fixture(scope="module")
def caps(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("gate")
    tokens = dd.make_tokens(tiny, seq_len=48, seed=1)
    out = {}
    for name, kw in (("base", {"candidate": "sim"}),
                     ("regressed", {"candidate": "sim", "inject": [f"scale@{FAULT_SITE}:1.05"]}),
                     ("improved", {"candidate": "reference"})):
        out[name] = d / f"{name}.h5"
        dd.run(tiny, tokens, layers="2:4", capture=out[name], save="stats", **kw)
    return out


def edited(src: Path, dst: Path, drop: str | None = None, stats: dict | None = None,
           metrics: dict | None = None, attrs: dict | None = None) -> Path:
    """A copy of a capture with one site dropped from every table, or site-table / metric values changed."""
    shutil.copyfile(src, dst)
    with h5py.File(dst, "r+") as f:
        for name in [f"runs/{r}/sites" for r in f["runs"]] + [f"metrics/{r}" for r in f["metrics"]] + ["floors"]:
            rows = f[name][()]
            sites = np.array([s.decode() if isinstance(s, bytes) else s for s in rows["site"]])
            if drop is not None:
                rows = rows[sites != drop]
                sites = sites[sites != drop]
            for (run, site), values in (stats or {}).items():
                if name == f"runs/{run}/sites":
                    for key, value in values.items():
                        rows[key][sites == site] = value
            for (run, site), values in (metrics or {}).items():
                if name == f"metrics/{run}":
                    i = int(np.flatnonzero(sites == site)[0])
                    rows["values"][i] = json.dumps({**json.loads(rows["values"][i]), **values})
            dtype, ds_attrs = f[name].dtype, dict(f[name].attrs)
            del f[name]
            ds = f.create_dataset(name, data=rows.astype(dtype), maxshape=(None,), chunks=True)
            ds.attrs.update(ds_attrs)
        f.attrs.update(attrs or {})
    return dst


def entry(doc, site, run):
    return next(e for e in doc["entries"] if e["site"] == site and e["run"] == run)


# ---------------------------------------------------------------------------------------------------------
def test_same_capture_passes(caps):
    doc = gate(caps["base"], caps["base"])
    assert doc["status"] == "pass" and doc["runs"] == ["candidate", "candidate.forced"]
    assert doc["counts"]["ok"] == len(doc["entries"]) and doc["first_regression"] is None
    assert run_main("gate", caps["base"], "--baseline", caps["base"]) == 0


def test_planted_regression_fails_naming_the_site(caps, tmp_path, capsys):
    doc = gate(caps["regressed"], caps["base"])
    assert doc["status"] == "fail"
    first = doc["first_regression"]
    assert (first["site"], first["run"]) == (FAULT_SITE, "candidate.forced")
    assert "x floor" in first["reasons"][0]
    # teacher-forced, only the planted op moved: nothing else regressed in that run
    forced = [e["site"] for e in doc["entries"] if e["run"] == "candidate.forced" and e["status"] == "regressed"]
    assert forced == [FAULT_SITE]
    assert doc["worst"][0]["site"] == FAULT_SITE
    junit, summary = tmp_path / "gate.xml", tmp_path / "gate.md"
    rc = run_main("gate", caps["regressed"], "--baseline", caps["base"], "--junit", junit, "--summary", summary)
    assert rc == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and FAULT_SITE in out
    assert junit.exists() and FAULT_SITE in summary.read_text()


def test_improvement_passes(caps):
    doc = gate(caps["improved"], caps["base"])
    assert doc["status"] == "pass", doc["first_regression"]
    assert entry(doc, FAULT_SITE, "candidate.forced")["status"] == "improved"
    assert doc["counts"]["improved"] > 0 and doc["counts"]["regressed"] == 0
    # and the other way round, the sim against a reference-candidate baseline, is a regression
    assert gate(caps["base"], caps["improved"])["status"] == "fail"


def test_missing_site_fails_new_site_is_reported(caps, tmp_path):
    site = "layers.2.attn.wq_b"
    short = edited(caps["base"], tmp_path / "short.h5", drop=site)
    doc = gate(short, caps["base"])
    assert doc["status"] == "fail"
    assert {(m["site"], m["run"]) for m in doc["missing"]} == {(site, "candidate"), (site, "candidate.forced")}
    assert doc["first_regression"]["site"] == site and doc["first_regression"]["status"] == "missing"
    back = gate(caps["base"], short)                    # the site is new relative to that baseline
    assert back["status"] == "pass" and {n["site"] for n in back["new"]} == {site}


def test_missing_run_fails(caps, tmp_path):
    path = tmp_path / "free.h5"
    shutil.copyfile(caps["base"], path)
    with h5py.File(path, "r+") as f:
        del f["runs/candidate.forced"], f["metrics/candidate.forced"]
    doc = gate(path, caps["base"])
    assert doc["status"] == "fail" and doc["counts"]["missing"] == 80
    assert any("candidate.forced" in note for note in doc["notes"])
    assert gate(path, caps["base"], runs=["candidate"])["status"] == "pass"


def test_new_nan_and_untied_flips_fail(caps, tmp_path):
    nan = edited(caps["base"], tmp_path / "nan.h5",
                 stats={("candidate", "layers.3.ffn.experts.2"): {"nan_count": 3}})
    doc = gate(nan, caps["base"])
    assert doc["first_regression"]["site"] == "layers.3.ffn.experts.2"
    assert "new NaN/Inf" in doc["first_regression"]["reasons"][0]
    topk = "layers.3.ffn.gate.topk_ids"
    flips = edited(caps["base"], tmp_path / "flips.h5",
                   metrics={("candidate", topk): {"flip_rate": 0.02, "hard_flips": 2}})
    doc = gate(flips, caps["base"])
    assert doc["first_regression"]["site"] == topk and "flip_rate" in doc["first_regression"]["reasons"][0]
    # flips that are ties (flip_rate unchanged) are not a regression
    ties = edited(caps["base"], tmp_path / "ties.h5", metrics={("candidate", topk): {"ties": 7, "flips": 7}})
    assert gate(ties, caps["base"])["status"] == "pass"


def test_bf16_level_noise_does_not_flap(caps, tmp_path):
    """A site that was bitwise equal and is now half a noise floor off passes (slack); SQNR is capped."""
    site = "layers.2.attn_norm"
    doc0 = gate(caps["base"], caps["base"])
    assert entry(doc0, site, "candidate.forced")["baseline"]["error"] == 0
    floor = entry(doc0, site, "candidate.forced")["baseline"]["effective_floor"]
    noisy = edited(caps["base"], tmp_path / "noisy.h5", metrics={
        ("candidate.forced", site): {"rel_l2": 0.5 * floor, "sqnr_db": -20 * math.log10(0.5 * floor)}})
    assert gate(noisy, caps["base"])["status"] == "pass"
    worse = edited(caps["base"], tmp_path / "worse.h5", metrics={
        ("candidate.forced", site): {"rel_l2": 3 * floor, "sqnr_db": -20 * math.log10(3 * floor)}})
    assert gate(worse, caps["base"])["first_regression"]["site"] == site


def test_rules_ignore_and_budgets(caps, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text("# gate rules\n[default]\nsqnr_db = 1.0\n\n"
                     "[[rule]]\nsites = '\\.attn\\.wkv$'\nignore = true\n")
    doc = gate(caps["regressed"], caps["base"], load_gate_rules(rules))
    assert entry(doc, FAULT_SITE, "candidate.forced")["status"] == "ignored"
    assert entry(doc, FAULT_SITE, "candidate.forced")["rule"] == "rule 1 (line 5)"
    assert all(e["status"] == "ignored" for e in doc["entries"] if e["site"].endswith(".attn.wkv"))
    assert run_main("gate", caps["regressed"], "--baseline", caps["base"], "--rules", rules,
                    "--run", "candidate.forced") == 0
    # a larger budget for one run only
    rules.write_text("[[rule]]\nsites = 'wkv$'\nruns = ['candidate.forced']\nx_floor = 2.0\nsqnr_db = 10\n")
    doc = gate(caps["regressed"], caps["base"], load_gate_rules(rules), runs=["candidate.forced"])
    assert doc["status"] == "pass"
    doc = gate(caps["regressed"], caps["base"], load_gate_rules(rules), runs=["candidate"])
    assert doc["first_regression"]["site"] == FAULT_SITE
    # turning the SQNR check off leaves the x floor check
    rules.write_text("[default]\nsqnr_db = false\n")
    doc = gate(caps["regressed"], caps["base"], load_gate_rules(rules), runs=["candidate.forced"])
    assert [c["metric"] for c in entry(doc, FAULT_SITE, "candidate.forced")["checks"]] == ["nonfinite", "x_floor"]
    assert doc["status"] == "fail"


@pytest.mark.parametrize("text,expected", [
    ("[[rule]]\nsites = 'wkv'\nignore = true\nx_floor = \n", "line 4"),                  # TOML syntax
    ("[default]\nx_floor = 0.2\n\n[[rule]]\nsites = 'a'\n[[rule]]\nsites = 'b'\nx_flor = 1\n",
     "line 8: rule 2 (sites 'b'): unknown key 'x_flor'"),
    ("[[rule]]\nsites = 'layers.(3'\n", "line 2: rule 1 (sites 'layers.(3'): bad regular expression"),
    ("[[rule]]\nignore = true\n", "line 1: rule 1: needs sites"),
    ("[default]\nsqnr_db = -1\n", "line 2: table 'default': sqnr_db must be a finite number >= 0"),
    ("[default]\nignore = true\n", "line 2: table 'default': unknown key 'ignore'"),
    ("threshold = 3\n", "line 1: unknown top-level key 'threshold'"),
])
def test_malformed_rules_exit_2_with_the_line(caps, tmp_path, capsys, text, expected):
    rules = tmp_path / "bad.toml"
    rules.write_text(text)
    with pytest.raises(BadInput) as e:
        load_gate_rules(rules)
    assert expected in str(e.value)
    assert run_main("gate", caps["base"], "--baseline", caps["base"], "--rules", rules) == 2
    assert expected in capsys.readouterr().err.replace("\n", "")


def test_junit_one_testcase_per_site(caps, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text("[[rule]]\nsites = '^layers\\.2\\.ffn\\.experts\\.'\nignore = true\n")
    doc = gate(caps["regressed"], caps["base"], load_gate_rules(rules))
    root = ET.fromstring(junit_xml(doc))
    cases = root.findall(".//testcase")
    with CaptureReader(caps["base"]) as r:
        sites = r.sites("candidate")
    assert sorted(c.get("name") for c in cases) == sorted(sites)
    failed = [c for c in cases if c.find("failure") is not None]
    assert {c.get("name") for c in failed} >= {FAULT_SITE}
    wkv = next(c for c in failed if c.get("name") == FAULT_SITE)
    assert "[candidate.forced]" in wkv.find("failure").text and "x floor" in wkv.find("failure").get("message")
    skipped = {c.get("name") for c in cases if c.find("skipped") is not None}
    assert skipped == {s for s in sites if s.startswith("layers.2.ffn.experts.")}
    suite = root.find("testsuite")
    assert int(suite.get("tests")) == len(sites) and int(suite.get("failures")) == len(failed)


def test_markdown_lists_worst_sites_and_first_divergence(caps):
    doc = gate(caps["regressed"], caps["base"])
    md = markdown_summary(doc, top=5)
    assert md.startswith("### ") and "FAIL" in md
    assert f"**First regression:** `{FAULT_SITE}` (candidate.forced)" in md
    assert "**First divergence (capture's verdict):**" in md
    worst = md.split("#### Worst sites")[1]
    assert worst.count("\n| `") == 5 and f"`{FAULT_SITE}`" in worst
    assert "PASS" in markdown_summary(gate(caps["base"], caps["base"]))


def test_update_refreshes_only_when_asked(caps, tmp_path, capsys):
    golden = tmp_path / "golden.h5"
    assert run_main("gate", caps["regressed"], "--baseline", golden) == 2        # no baseline: never implicit
    assert not golden.exists()
    assert run_main("gate", caps["base"], "--baseline", golden, "--update") == 0
    assert "written" in capsys.readouterr().out and golden.read_bytes() == caps["base"].read_bytes()
    assert run_main("gate", caps["regressed"], "--baseline", golden) == 1
    assert golden.read_bytes() == caps["base"].read_bytes()                       # a failing gate changes nothing
    assert run_main("gate", caps["regressed"], "--baseline", golden, "--update") == 0
    out = capsys.readouterr().out
    assert "updated" in out and "regressed" in out and FAULT_SITE in out
    assert golden.read_bytes() == caps["regressed"].read_bytes()
    assert run_main("gate", caps["regressed"], "--baseline", golden) == 0
    not_a_capture = tmp_path / "notes.h5"
    not_a_capture.write_text("hello")
    assert run_main("gate", caps["base"], "--baseline", not_a_capture, "--update") == 2
    assert not_a_capture.read_text() == "hello"


def test_different_inputs_are_bad_input(caps, tmp_path):
    other = edited(caps["base"], tmp_path / "other.h5", attrs={"token_ids": np.arange(48, dtype=np.int64)})
    with pytest.raises(BadInput, match="different inputs"):
        gate(other, caps["base"])
    assert run_main("gate", other, "--baseline", caps["base"]) == 2
    assert run_main("gate", caps["base"], "--baseline", caps["base"], "--run", "nope") == 2


def test_json_output(caps, capsys):
    assert run_main("gate", caps["regressed"], "--baseline", caps["base"], "--json") == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "fail" and doc["first_regression"]["site"] == FAULT_SITE


# ---------------------------------------------------------------------------------------------------------
def test_committed_goldens_match_their_recipe():
    for name in GOLDENS:
        path = CAPTURES / f"{name}.h5"
        assert path.stat().st_size < 1 << 20
        with CaptureReader(path) as r:
            assert r.complete and r.meta["options"]["candidate"] == GOLDENS[name]["candidate"]
            assert len(r.meta["token_ids"]) == GOLDEN_SEQ_LEN
            assert r.verdict()["status"] == "clean"
        assert gate(path, path)["status"] == "pass"
    model = dd.open_model()
    tokens = dd.make_tokens(model, seq_len=GOLDEN_SEQ_LEN, seed=GOLDEN_SEED).tolist()
    with CaptureReader(CAPTURES / "tiny-sim.h5") as r:
        assert r.meta["token_ids"] == tokens


def test_regenerated_golden_passes_the_gate(tmp_path):
    """Determinism: the sim golden, regenerated now, passes against the committed one (as .ci/run checks)."""
    path = write_golden("tiny-sim", tmp_path)
    doc = gate(path, CAPTURES / "tiny-sim.h5")
    assert doc["status"] == "pass", doc["first_regression"]
    assert doc["counts"]["ok"] == len(doc["entries"])
