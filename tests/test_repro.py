"""`dsv4debug repro`: one op's inputs and weights written out, replayed standalone."""
import json

import pytest

import dsv4debug.api as dd
from dsv4debug.cli import main


def _code(*args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code


@pytest.mark.parametrize("fault,site", [("swap_w13@layers.4.ffn.experts.2", "layers.4.ffn.experts.2"),
                                        ("scale@layers.1.attn.wkv:1.5", "layers.1.attn.wkv")])
def test_repro_of_a_planted_fault_reproduces_it_standalone(tiny, tmp_path, fault, site, capsys):
    tokens = dd.make_tokens(tiny, seq_len=48, seed=4)
    capture = tmp_path / "run.h5"
    result = dd.run(tiny, tokens, candidate="reference", inject=[fault], capture=capture)
    assert result.diverged
    out = tmp_path / "repro"
    assert _code("repro", capture, "--site", site, out) == 0
    meta = json.loads((out / "repro.json").read_text())
    assert meta["site"] == site and meta["command"].startswith("dsv4debug repro-run")
    capsys.readouterr()
    replay_args = meta["command"].split()[1:]
    assert _code(*replay_args, "--json") == 1                     # the recorded fault diverges ...
    assert json.loads(capsys.readouterr().out)["x_floor"] > 8
    assert _code("repro-run", out, "--candidate", "sim", "--clean-weights") == 0   # ... a healthy one does not


def test_repro_of_an_unknown_site_is_bad_input(tiny, tmp_path):
    capture = tmp_path / "run.h5"
    dd.run(tiny, dd.make_tokens(tiny, seq_len=16), candidate="reference", capture=capture)
    assert _code("repro", capture, "--site", "layers.2.attn.nothing", tmp_path / "r") == 2
    assert not (tmp_path / "r").exists()
