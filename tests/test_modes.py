"""Router pinning (routing error vs expert-kernel error) and --repeat (bitwise determinism)."""
import pytest

import dsv4debug.api as dd
from dsv4debug.backends import registry
from dsv4debug.backends.reference import ReferenceBackend
from dsv4debug.runner import repeat_check


class BiasedRouter(ReferenceBackend):
    """A router bug: selection scores of expert 0 boosted, so tokens go to the wrong experts."""
    name = "biased-router"

    def gate(self, x, w, bias, tid2eid, token_ids, *, topk, route_scale):
        weights, ids, scores = super().gate(x, w, bias, tid2eid, token_ids, topk=topk, route_scale=route_scale)
        if tid2eid is not None:                     # hash layers (and pinned routing) keep their table
            return weights, ids, scores
        boosted = scores.clone()
        boosted[:, 0] += 10.0
        ids = boosted.topk(topk, dim=-1).indices
        s = scores - (0 if bias is None else self.param(bias))
        w = s.gather(1, ids)
        return w / w.sum(-1, keepdim=True) * route_scale, ids, boosted


class NoisyEveryCall(ReferenceBackend):
    """Run-dependent noise in one op family (as a race or an uninitialised buffer would give)."""
    name = "noisy"
    calls = 0

    def rms_norm(self, x, w, *, eps):
        NoisyEveryCall.calls += 1
        y = super().rms_norm(x, w, eps=eps)
        return y + 1e-2 * NoisyEveryCall.calls * (y.abs() > 1.5)


@pytest.fixture(scope="module", autouse=True)
def plugins():
    registry.register("biased-router", BiasedRouter)
    registry.register("noisy", NoisyEveryCall)


@pytest.fixture(scope="module")
def tokens(tiny):
    return dd.make_tokens(tiny, seq_len=96, seed=3)


def _moe_free_failures(result):
    return [r.site for r in result.sites if r.free is not None and ".ffn" in r.site
            and not r.site.endswith(("topk_ids", "gate", "scores")) and r.judge("free", 8.0)["exceeds"]]


def test_pinning_the_router_removes_a_router_bug(tiny, tokens):
    free = dd.run(tiny, tokens, candidate="biased-router", mode="free")
    assert free.verdict["first_divergence"]["site"].startswith("layers.3.ffn")    # first score-routed layer
    pinned = dd.run(tiny, tokens, candidate="biased-router", mode="free", pin_router="ids")
    assert not pinned.diverged, pinned.verdict["message"]


def test_pinning_the_router_keeps_an_expert_bug(tiny, tokens):
    pinned = dd.run(tiny, tokens, candidate="reference", mode="free", pin_router="ids+weights",
                    inject=["swap_w13@layers.4.ffn.experts.3"])
    assert pinned.verdict["first_divergence"]["site"] == "layers.4.ffn.experts.3"
    assert "layers.4.ffn.experts.3" in _moe_free_failures(pinned)


def test_repeat_catches_run_dependent_noise(tiny, tokens):
    report = repeat_check(tiny, tokens[:32], "noisy")
    assert not report["deterministic"]
    assert report["first_difference"]["site"] == "layers.0.attn_norm"


def test_repeat_passes_a_deterministic_backend(tiny, tokens):
    report = repeat_check(tiny, tokens[:32], "sim")
    assert report["deterministic"] and report["sites_compared"] > 200


def test_moe_diagnostics_single_out_the_broken_expert(tiny, tokens):
    from dsv4debug.runner import moe_diagnostics
    result = dd.run(tiny, tokens[:64], candidate="reference", inject=["swap_w13@layers.3.ffn.experts.2"])
    diag = moe_diagnostics(result)
    assert set(diag) == set(range(tiny.config.n_layers))
    xf = diag[3]["expert_x_floor"]
    assert max(xf, key=xf.get) == 2 and xf[2] > 8
    assert all(x <= 1 for e, x in xf.items() if e != 2)
    assert sum(diag[3]["tokens_per_expert"].values()) == 64 * tiny.config.n_activated_experts
    assert diag[3]["routing"]["forced"]["hard_flips"] == 0
