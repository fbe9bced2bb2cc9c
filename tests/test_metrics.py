"""metrics: hand-computed ULP, SQNR, cosine and rel L2; NaN/Inf robustness; chunking; tie-aware index agreement."""
from __future__ import annotations

import math

import pytest
import torch

from dsv4debug.metrics import MIN_FLOORS, bf16_ulp, compare, floor_ratio, index_agreement


def test_bf16_ulp_at_reference_values():
    ref = torch.tensor([1.0, 1.9921875, 2.0, -3.0, 0.0, 2.0 ** -126, 2.0 ** -130], dtype=torch.float64)
    expected = [2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -6, 2.0 ** -133, 2.0 ** -133, 2.0 ** -133]
    assert bf16_ulp(ref).tolist() == expected


def test_hand_computed_case():
    # errors: 1 ULP at 1.0 (2^-7), none at 2.0, 2 ULP at 4.0 (2 * 2^-5), none at 8.0
    ref = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.bfloat16)
    cand = torch.tensor([1.0078125, 2.0, 4.0625, 8.0], dtype=torch.bfloat16)
    m = compare(ref, cand)
    err_sq = 2.0 ** -14 + 2.0 ** -8
    ref_sq = 1 + 4 + 16 + 64
    assert m["sqnr_db"] == pytest.approx(10 * math.log10(ref_sq / err_sq), rel=1e-12)
    assert m["rel_l2"] == pytest.approx(math.sqrt(err_sq / ref_sq), rel=1e-12)
    dot = 1.0078125 + 4 + 4 * 4.0625 + 64
    cand_sq = 1.0078125 ** 2 + 4 + 4.0625 ** 2 + 64
    assert m["cosine"] == pytest.approx(dot / math.sqrt(ref_sq * cand_sq), rel=1e-12)
    assert (m["max_ulp"], m["max_ulp_index"]) == (2.0, [2])
    assert (m["ulp_within_1"], m["ulp_within_2"], m["ulp_within_4"]) == (0.75, 1.0, 1.0)
    assert (m["max_abs"], m["max_abs_index"], m["max_abs_ref"], m["max_abs_cand"]) == (0.0625, [2], 4.0, 4.0625)
    assert m["max_rel"] == pytest.approx(2.0 ** -6) and m["max_rel_index"] == [2]   # 2^-4/4 > 2^-7/1
    assert m["mismatches"] == 2 and m["first_mismatch_index"] == [0]


def test_identical_tensors():
    x = torch.randn(3, 5)
    m = compare(x, x)
    assert m["cosine"] == pytest.approx(1.0) and m["rel_l2"] == 0.0 and m["sqnr_db"] == math.inf
    assert m["max_abs_index"] is None and m["mismatches"] == 0 and m["first_mismatch_index"] is None


def test_mismatch_counts_and_first_index_past_the_probe():
    """mismatches (counted from the ULP histogram) and the first mismatch where the first differing element
    lies beyond the first 4096 (the short probe finds none, so the whole chunk is searched)."""
    ref = torch.linspace(-3, 3, 20_000, dtype=torch.float64).bfloat16()
    cand = ref.clone()
    cand[[10_001, 10_002, 19_999]] += torch.tensor([2.0 ** -5, -(2.0 ** -5), 1.0]).bfloat16()
    m = compare(ref, cand)
    assert m["mismatches"] == 3 and m["first_mismatch_index"] == [10_001]
    assert m["mismatches"] == int((ref != cand).sum())


def test_nan_and_inf_are_counted_not_fatal():
    ref = torch.tensor([[1.0, float("nan")], [float("inf"), 0.5]])
    cand = torch.tensor([[1.0, float("nan")], [float("-inf"), float("nan")]])
    m = compare(ref, cand)
    assert (m["ref_nan"], m["ref_inf"], m["cand_nan"], m["cand_inf"]) == (1, 1, 2, 1)
    assert m["nonfinite_mismatch"] == 2 and m["first_mismatch_index"] == [1, 0]   # both NaN is not a mismatch
    assert m["compared"] == 1 and m["rel_l2"] == 0.0


def test_chunked_equals_whole_and_coordinates_are_global():
    ref = torch.randn(50, 37, dtype=torch.float64)
    cand = ref + 1e-3 * torch.randn(50, 37, dtype=torch.float64)
    cand[41, 3] += 1.0
    whole = compare(ref, cand)
    chunked = compare(ref, cand, chunk_elems=100)
    assert chunked["max_abs_index"] == [41, 3] == whole["max_abs_index"]
    for key in ("cosine", "rel_l2", "sqnr_db", "max_abs", "max_ulp", "ulp_within_4"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-12)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shapes differ"):
        compare(torch.zeros(2, 3), torch.zeros(3, 2))


def test_zero_reference():
    m = compare(torch.zeros(4), torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert m["rel_l2"] == math.inf and m["sqnr_db"] == -math.inf and m["cosine"] == 0.0


def test_index_agreement_with_ties():
    ref = torch.tensor([[0, 1, 2], [3, 4, -1], [5, 6, 7]])
    cand = torch.tensor([[0, 1, 5], [3, 4, -1], [5, 0, 1]])
    scores = torch.zeros(3, 8)
    scores[0] = torch.tensor([9, 8, 7, 0, 0, 6.99, 0, 0])       # 2 (7.0) vs 5 (6.99): gap 0.01, a tie
    scores[2] = torch.tensor([1, 1, 0, 0, 0, 9, 8, 7])          # 6,7 dropped for 0,1: gaps 7-1, 8-1
    m = index_agreement(ref, cand, scores, tie_margin=0.05)
    assert m["flips"] == 3 and m["ties"] == 1 and m["hard_flips"] == 2
    assert m["agreement_mean"] == pytest.approx((2 / 3 + 1 + 1 / 3) / 3)
    assert m["agreement_min"] == pytest.approx(1 / 3) and m["agreement_min_token"] == 2
    assert m["flip_rate"] == pytest.approx(2 / 8)           # 8 reference selections (one padding)
    assert m["first_untied_flip_token"] == 2 and m["tokens_with_untied_flips"] == 1
    strict = index_agreement(ref, cand, scores, tie_margin=0.0)
    assert strict["ties"] == 0 and strict["hard_flips"] == 3
    no_scores = index_agreement(ref, cand)
    assert no_scores["flips"] == 3 and no_scores["ties"] == 0


def test_index_agreement_order_and_padding_do_not_matter():
    ref = torch.tensor([[1, 2, 3, -1]])
    cand = torch.tensor([[3, -1, 1, 2]])
    m = index_agreement(ref, cand)
    assert m["agreement_mean"] == 1.0 and m["flips"] == 0 and m["exact_tokens"] == 1.0


def test_index_agreement_chunks_rows():
    ref = torch.stack([torch.randperm(100)[:5] for _ in range(64)])
    cand = ref.clone()
    cand[37, 0] = (ref[37, 0] + 1) % 100 if (ref[37] == (ref[37, 0] + 1) % 100).sum() == 0 else 99
    assert index_agreement(ref, cand, chunk_elems=256)["first_untied_flip_token"] == 37


def test_floor_ratio():
    assert floor_ratio(0.01, 0.002, MIN_FLOORS["rel_l2"]) == pytest.approx(5.0)
    assert floor_ratio(0.01, 0.0, 2.0 ** -9) == pytest.approx(0.01 * 512)     # zero floor raised to the minimum
    assert floor_ratio(math.nan, 0.002, 2.0 ** -9) == math.inf
    assert floor_ratio(0.01, None, 0.001) == pytest.approx(10.0)


def test_compare_fast_equals_compare_on_identical_and_different_tensors():
    from dsv4debug.metrics import compare_fast
    a = torch.randn(64, 48).bfloat16()
    assert compare_fast(a, a.clone()) == compare(a, a.clone())
    b = a.clone()
    b[3, 7] = b[3, 7] * 2 + 1
    assert compare_fast(a, b) == compare(a, b)


def test_free_tie_margin_covers_both_scores_moving():
    """Scores off by up to d each can swap two ids whose reference gap is below 2d: a tie, not a hard flip
    (a clean sim run on 32 tokens was flagged for such a flip)."""
    from dsv4debug.runner import pair_tie_margin
    ref_scores = torch.tensor([[1.0, 0.98, 0.1]])
    ref_ids, cand_ids = torch.tensor([[0]]), torch.tensor([[1]])      # cand scores 0.985 / 0.995: each off 0.015
    err = 0.015
    assert index_agreement(ref_ids, cand_ids, ref_scores, tie_margin=err)["hard_flips"] == 1
    m = index_agreement(ref_ids, cand_ids, ref_scores, tie_margin=pair_tie_margin(err))
    assert (m["flips"], m["ties"], m["hard_flips"]) == (1, 1, 0)


def test_finite_fast_path_equals_the_general_path():
    """The host fast path (chunks without NaN/Inf) gives the general path's counts, indices and maxima
    exactly and its sums to float64 rounding; a chunk with NaN or Inf takes the general path."""
    from dsv4debug.metrics import _SUMS, _finite_chunk_values, _general_chunk_values
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(50_000, generator=g).bfloat16()
    cand = (ref.float() + 0.01 * torch.randn(50_000, generator=g)).bfloat16()
    cand[::7] = ref[::7]                                     # exact matches
    ref[5::11] = 0                                           # zeros in the reference (relative error 0)
    ref[3] = 2.0 ** -130                                     # a subnormal: the ULP floor
    fast = _finite_chunk_values(ref.double(), cand.double())
    slow = _general_chunk_values(ref.double(), cand.double())
    sums = {"dot", "ref_sq", "cand_sq", "err_sq"}
    for i, (a, b) in enumerate(zip(fast.tolist(), slow.tolist())):
        if i < len(_SUMS) and _SUMS[i] in sums:
            assert a == pytest.approx(b, rel=1e-12), _SUMS[i]
        else:
            assert a == b, i
    cand[10] = float("nan")
    assert torch.equal(_finite_chunk_values(ref.double(), cand.double()),
                       _general_chunk_values(ref.double(), cand.double()))
