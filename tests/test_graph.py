"""--graph: the candidate's ops eagerly against torch.compile (CPU) and CUDA-graph capture and replay (GPU)."""
import json

import pytest
import torch

import dsv4debug.api as dd
from dsv4debug.backends import registry
from dsv4debug.backends.reference import ReferenceBackend
from dsv4debug.cli import main
from dsv4debug.errors import BadInput
from dsv4debug.runner import graph_check

# aot_eager: traced by dynamo, run by the eager kernels, so bitwise equality is expected (and fast to compile)
COMPILE = "compile:aot_eager"


class CompileSensitive(ReferenceBackend):
    """A kernel that takes another path when traced (as a fused fast path or a stale workspace would)."""
    name = "compile-sensitive"

    def rope(self, x, freqs, *, inverse=False):
        y = super().rope(x, freqs, inverse=inverse)
        if torch.compiler.is_compiling() and not inverse and x.dim() == 2:      # kv_rope only
            y = y.clone()
            y[3, 5] += 4.0
        return y


class CompileRounding(CompileSensitive):
    """... and a compiled linear that rounds differently (as inductor's fusions do): noise, not a bug."""
    name = "compile-rounding"

    def linear(self, x, w):
        y = super().linear(x, w)
        return (y.float() * (1 + 2 ** -7)).to(y.dtype) if torch.compiler.is_compiling() else y


class FrozenCounter(ReferenceBackend):
    """A scale read from a Python-side step counter: a graph replays the value its capture saw, not the
    eager call's."""
    name = "frozen-counter"
    step = 0

    def head_rms_norm(self, q, *, eps):
        FrozenCounter.step += 1
        return super().head_rms_norm(q, eps=eps) * (1 + 0.01 * FrozenCounter.step)


@pytest.fixture(scope="module", autouse=True)
def plugins():
    registry.register("compile-sensitive", CompileSensitive)
    registry.register("compile-rounding", CompileRounding)
    registry.register("frozen-counter", FrozenCounter)


@pytest.fixture(scope="module")
def tokens(tiny):
    return dd.make_tokens(tiny, seq_len=16, seed=5)


def test_a_clean_candidate_compiles_bitwise(tiny, tokens):
    [report] = graph_check(tiny, tokens, "reference", COMPILE, layers=range(1))
    assert report["graph"] == COMPILE and report["bitwise_expected"]
    assert report["agrees"] and report["first_difference"] is None
    assert report["sites_compared"] == report["sites_bitwise"] > 30


def test_an_op_that_differs_when_compiled_is_named(tiny, tokens):
    [report] = graph_check(tiny, tokens, "compile-sensitive", COMPILE, layers=range(1, 2))
    f = report["first_failure"]
    assert not report["agrees"] and f is report["first_difference"]
    assert (f["site"], f["layer"], f["op"]) == ("layers.1.attn.kv_rope", 1, "rope")
    assert f["mismatches"] == 1 and f["coord"] == [3, 5] and f["max_abs"] == pytest.approx(4.0, abs=0.07)


def test_noise_floor_mode_tolerates_rounding_and_names_real_errors(tiny, tokens):
    [report] = graph_check(tiny, tokens, "compile-rounding", COMPILE, layers=range(1), bitwise=False)
    d, f = report["first_difference"], report["first_failure"]
    assert not report["bitwise_expected"] and not report["agrees"]
    assert d["site"] == "layers.0.attn.wq_a" and 0 < d["x_floor"] < report["budget"]
    assert f["site"] == "layers.0.attn.kv_rope" and f["x_floor"] > report["budget"] and f["floor"] > 0


def test_cli_graph_json_and_exit_codes(tiny_dir, capsys):
    args = ["run", str(tiny_dir), "--seq-len", "16", "--layers", "0:1", "--mode", "forced", "--json"]
    for candidate, rc in (("reference", 0), ("compile-sensitive", 1)):
        with pytest.raises(SystemExit) as e:
            main(args + ["--candidate", candidate, "--graph", COMPILE])
        assert e.value.code == rc
        [g] = json.loads(capsys.readouterr().out)["graph"]
        assert g["agrees"] == (rc == 0)
    assert g["first_failure"]["site"] == "layers.0.attn.kv_rope"


def test_cli_graph_bad_values_exit_2(tiny_dir, capsys):
    for value in ("jit", "compile:nope", "cuda:x") + (() if torch.cuda.is_available() else ("cuda", "all")):
        with pytest.raises(SystemExit) as e:
            main(["run", str(tiny_dir), "--seq-len", "8", "--layers", "0:1", "--mode", "forced",
                  "--graph", value])
        assert e.value.code == 2, value
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and "--graph" in err
    with pytest.raises(BadInput, match="CUDA graphs need"):
        graph_check(None, torch.arange(4), "reference", "cuda", device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_bitwise_and_catch_frozen_host_state(tiny, tokens):
    [clean] = graph_check(tiny, tokens, "reference", "cuda", device="cuda", layers=range(1))
    assert clean["agrees"] and clean["bitwise_expected"] and clean["sites_bitwise"] == clean["sites_compared"]
    # ops with weights are captured (their weights moved to the GPU first), not run eagerly
    assert not {"linear", "expert", "grouped_linear"} & set(clean["not_captured"]), clean["not_captured"]
    [frozen] = graph_check(tiny, tokens, "frozen-counter", "cuda", device="cuda", layers=range(1))
    assert frozen["first_failure"]["site"] == "layers.0.attn.q_head_norm"
