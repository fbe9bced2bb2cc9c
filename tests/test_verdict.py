"""verdict: NaN origin on a real chain of ops, first divergence over budget x floor, worst sites, summary."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4debug.metrics import compare
from dsv4debug.tensorstats import tensor_stats
from dsv4debug.verdict import first_divergence, nan_origin, summarize, worst_sites


def stats(t: torch.Tensor) -> dict:
    return tensor_stats(t)


def chain_records(poison: bool) -> list[dict]:
    """embed -> norm -> wq_a -> log (NaN from finite negative inputs when poisoned) -> wo -> head."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g)
    steps = [("embed", [], lambda: x)]
    outs: dict[str, torch.Tensor] = {}
    steps += [("layers.0.attn_norm", ["embed"], lambda: outs["embed"] / outs["embed"].norm(dim=-1, keepdim=True)),
              ("layers.0.attn.wq_a", ["layers.0.attn_norm"], lambda: outs["layers.0.attn_norm"] @ torch.eye(16)),
              ("layers.0.attn.scores", ["layers.0.attn.wq_a"],
               lambda: torch.log(outs["layers.0.attn.wq_a"]) if poison else outs["layers.0.attn.wq_a"].exp()),
              ("layers.0.attn.wo_a", ["layers.0.attn.scores"], lambda: outs["layers.0.attn.scores"] * 2),
              ("logits", ["layers.0.attn.wo_a"], lambda: outs["layers.0.attn.wo_a"].sum(-1))]
    records = []
    for site, inputs, op in steps:
        outs[site] = op()
        records.append({"site": site, "layer": -1 if site in ("embed", "logits") else 0, "family": "op",
                        "inputs": inputs, "stats": stats(outs[site])})
    return records, outs


def test_nan_origin_on_a_chain_of_ops():
    records, outs = chain_records(poison=True)
    origin = nan_origin(records)
    assert origin["site"] == "layers.0.attn.scores"
    first_negative = (outs["layers.0.attn.wq_a"] < 0).flatten().nonzero()[0].item()
    assert origin["first_nonfinite"] == [first_negative // 16, first_negative % 16]
    assert origin["nan_count"] == int(torch.isnan(outs["layers.0.attn.scores"]).sum())
    assert list(origin["inputs"]) == ["layers.0.attn.wq_a"]
    assert origin["inputs"]["layers.0.attn.wq_a"]["nan_count"] == 0 and origin["other_origins"] == []


def test_no_nan_no_origin_and_independent_origins():
    records, _ = chain_records(poison=False)
    assert nan_origin(records) is None
    nan_stats = {"nan_count": 3, "inf_count": 0}
    records = [{"site": "a", "inputs": [], "stats": {"nan_count": 0, "inf_count": 0}},
               {"site": "layers.1.ffn.experts.3", "inputs": ["a"], "stats": nan_stats},
               {"site": "layers.1.ffn.experts.9", "inputs": ["a"], "stats": nan_stats},
               {"site": "layers.1.ffn", "inputs": ["layers.1.ffn.experts.3"], "stats": nan_stats}]
    origin = nan_origin(records)
    assert origin["site"] == "layers.1.ffn.experts.3" and origin["other_origins"] == ["layers.1.ffn.experts.9"]


def metric_records(errors: list[float], floors: list[float | None]) -> list[dict]:
    ref = torch.randn(1000, dtype=torch.float64)
    records = []
    for i, (err, floor) in enumerate(zip(errors, floors)):
        cand = ref + err * ref.norm() / math.sqrt(1000) * torch.randn(1000, dtype=torch.float64)
        m = compare(ref, cand)
        m["rel_l2"] = err                  # exact value, independent of the random draw
        records.append({"site": f"layers.{i}.ffn", "layer": i, "family": "moe", "inputs": [],
                        "stats": stats(cand), "metrics": m, "floor": {"rel_l2": floor} if floor is not None else None})
    return records


def test_first_divergence_is_relative_to_each_floor():
    # site 0: 0.02 vs floor 0.01 = 2x; site 1: 0.03 vs floor 0.0025 = 12x (first over 8x); site 2: floor 0 is
    # raised to 2^-9, 0.01 * 512 = 5.1x: not over; site 3: 100x
    records = metric_records([0.02, 0.03, 0.01, 0.2], [0.01, 0.0025, 0.0, 0.002])
    first = first_divergence(records, budget=8.0)
    assert first["site"] == "layers.1.ffn"
    assert first["x_floor"] == pytest.approx(12.0) and first["tolerance"] == pytest.approx(0.02)
    assert [w["site"] for w in worst_sites(records, n=2)] == ["layers.3.ffn", "layers.1.ffn"]
    assert first_divergence(records, budget=200.0) is None


def test_nonfinite_mismatch_is_infinite_error():
    records = metric_records([0.0], [0.01])
    records[0]["metrics"]["nonfinite_mismatch"] = 1
    assert first_divergence(records)["x_floor"] == math.inf


def test_index_sites_are_judged_by_flip_rate():
    records = [{"site": "layers.0.ffn.gate.topk_ids", "layer": 0, "inputs": [], "stats": {},
                "metrics": {"flip_rate": 0.05, "flips": 9, "ties": 4}, "floor": {"flip_rate": 0.001}}]
    first = first_divergence(records)
    assert first["metric"] == "flip_rate" and first["x_floor"] == 50.0


def test_summary_names_bug_symptom_and_gain():
    free = metric_records([0.001, 0.05, 0.5], [0.002, 0.002, 0.002])      # symptom at layer 1 (25x)
    forced = metric_records([0.001, 0.04, 0.002], [0.002, 0.002, 0.002])  # bug at layer 1 (20x)
    verdict = summarize(free, forced, budget=8.0)
    assert verdict["status"] == "diverged"
    assert verdict["first_local_divergence"]["site"] == "layers.1.ffn"
    assert verdict["first_divergence"]["site"] == "layers.1.ffn"
    assert verdict["gain"] == 25.0 / 20.0
    assert verdict["worst"][0]["site"] == "layers.2.ffn" and "layers.1.ffn" in verdict["message"]
    clean = summarize(metric_records([0.001], [0.002]))
    assert clean["status"] == "clean" and clean["nan_origin"] is None
    records, _ = chain_records(poison=True)
    assert summarize(records)["status"] == "nan"
    assert summarize(chain_records(poison=False)[0])["status"] == "no-reference"


def test_logits_check_flags_garbage():
    def with_logits(std, nan=0):
        return [{"site": "logits", "layer": -1, "inputs": [], "stats": {"std": std, "nan_count": nan, "inf_count": 0}}]
    assert summarize(with_logits(3.0))["logits_check"]["ok"]
    assert not summarize(with_logits(0.01))["logits_check"]["ok"]
    assert not summarize(with_logits(3.0, nan=2))["logits_check"]["ok"]
    assert summarize([])["logits_check"] is None
    # garbage is never a success, even within every floor (a reference as broken as its candidate)
    flat = summarize([dict(with_logits(0.01)[0], metrics={"rel_l2": 0.001}, floor={"rel_l2": 0.002})])
    assert flat["status"] == "garbage-logits" and "std 0.01 outside" in flat["message"], flat["message"]
    assert summarize(with_logits(3.0, nan=2))["status"] == "nan"          # NaN outranks it
