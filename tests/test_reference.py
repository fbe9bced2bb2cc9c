"""The BF16 reference (references/ + the model flow): the model's invariants on the tiny preset."""
import math

import dsv4_references as ref
import pytest
import torch

import dsv4debug.api as dd
from dsv4debug.runner import site_table

S = 160          # > window (128) and >= one ratio-128 block: every attention path is exercised


@pytest.fixture(scope="module")
def tokens(tiny):
    return dd.make_tokens(tiny, seq_len=S, seed=1)


@pytest.fixture(scope="module")
def ref_run(tiny, tokens):
    return dd.reference(tiny, tokens, keep_sites="*")


def test_causality_changing_token_t_leaves_earlier_logits_bit_identical(tiny, tokens, ref_run):
    t = 137
    changed = tokens.clone()
    changed[t] = (changed[t] + 1) % tiny.config.vocab_size
    other = dd.reference(tiny, changed)
    assert torch.equal(other.logits[:t], ref_run.logits[:t])
    assert not torch.equal(other.logits[t], ref_run.logits[t])


def test_sinkhorn_comb_is_doubly_stochastic(ref_run):
    comb = ref_run.sites["layers.2.hc_attn.pre.comb"]          # [S, 4, 4]
    assert torch.allclose(comb.sum(-1), torch.ones(()), atol=1e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-5)   # columns are normalised last
    assert (comb > 0).all()


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressor_entry_depends_only_on_its_tokens(ratio):
    g = torch.Generator().manual_seed(0)
    D, d, n = 64, 128, 2 * ratio + 3
    c = 2 if ratio == 4 else 1
    x = torch.randn(n, D, generator=g).bfloat16()
    wkv, wgate = torch.randn(c * d, D, generator=g) / 8, torch.randn(c * d, D, generator=g) / 8
    ape, norm = torch.randn(ratio, c * d, generator=g) / 50, torch.ones(d)
    freqs = ref.rope_freqs(n, 64, 160000.0, 65536, 16.0)
    args = (wkv, wgate, ape, norm, freqs, ratio, 64, 1e-6, False)
    base = ref.compress(x, *args)
    for j in range(n):
        x2 = x.clone()
        x2[j] += 1
        changed = (ref.compress(x2, *args) != base).any(-1)
        w = torch.arange(base.size(0))
        # entry w summarises tokens <= (w+1)*ratio - 1 (ratio 4: also the previous block's first half)
        assert not changed[(w + 1) * ratio - 1 < j].any(), f"token {j} leaked into an earlier entry"


def test_indexer_never_selects_a_future_block(ref_run):
    top = ref_run.sites["layers.2.attn.indexer.topk"]        # [S, k]
    t = torch.arange(top.size(0))[:, None]
    assert ((top < 0) | (top < (t + 1) // 4)).all()
    assert (top >= 0).sum() > 0


def test_sink_takes_attention_mass():
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(5, 2, 8, generator=g), torch.randn(7, 8, generator=g)
    idx = torch.tensor([[0, 1, 2, -1]] * 5)
    sink = torch.tensor([0.0, 3.0])
    o = ref.sparse_attn(q, kv, sink, idx, 0.5)
    s = torch.einsum("shd,kd->shk", q, kv[:3]) * 0.5                   # keys 0..2, -1 skipped
    p = s.exp() / (s.exp().sum(-1, keepdim=True) + sink.exp().view(1, 2, 1))
    assert torch.allclose(o, torch.einsum("shk,kd->shd", p, kv[:3]), atol=1e-6)
    huge = ref.sparse_attn(q, kv, torch.tensor([60.0, 60.0]), idx, 0.5)
    assert huge.abs().max() < 1e-12                                      # the sink absorbs all mass


def test_hash_routing_follows_tid2eid(tiny, tokens, ref_run):
    table = tiny.module("layers.1.ffn.gate.tid2eid").tensors[""]
    assert torch.equal(ref_run.sites["layers.1.ffn.gate.topk_ids"], table[tokens])


def test_routing_weights_renormalised_and_scaled(tiny, ref_run):
    w = ref_run.sites["layers.4.ffn.gate"]
    assert torch.allclose(w.sum(-1), torch.full((), tiny.config.route_scale), rtol=1e-5)
    scores = ref_run.sites["layers.4.ffn.gate.scores"]              # biased selection scores
    ids = ref_run.sites["layers.4.ffn.gate.topk_ids"]
    assert torch.equal(ids.sort(-1).values, scores.topk(ids.size(1)).indices.sort(-1).values)


def test_rope_inverse_undoes_rope():
    x = torch.randn(9, 3, 512, dtype=torch.float64)
    f = ref.rope_freqs(9, 64, 160000.0, 65536, 16.0)
    y = ref.apply_rope(x, f)
    assert torch.equal(y[..., :448], x[..., :448]) and not torch.allclose(y, x)
    assert torch.allclose(ref.apply_rope(y, f, inverse=True), x, atol=1e-6)


def test_yarn_correction_range_of_the_compressed_layers():
    assert ref.rope.yarn_range(32, 1, 64, 160000.0, 65536) == (15, 25)


def test_layer_streaming_gives_bit_identical_logits(tiny, tokens, ref_run):
    assert torch.equal(dd.reference(tiny, tokens, stream=False).logits, ref_run.logits)


def test_fp64_minus_bf16_within_bf16_error_at_every_site(tiny, tokens):
    """Per-op: each site's bf16 output against the same op in fp64 on the same inputs."""
    res = dd.run(tiny, tokens[:64], candidate="reference", mode="forced")
    floors = {r.site: r.local_floor for r in res.sites if r.local_floor is not None}
    assert len(floors) > 150
    # one bf16 rounding is <= 2**-8 relative; reductions and GEMMs stay within a few of those; the QAT
    # steps (fp8 KV, fp4 indexer) may flip a rounding: up to one e2m1 step on a few elements
    qat = ("kv_cache", "compressor", "indexer.q", "indexer.scores")
    for site, floor in floors.items():
        bound = 0.06 if any(k in site for k in qat) else 4 * 2 ** -8
        assert floor <= bound, f"{site}: bf16 vs fp64 rel L2 {floor:.3g} > {bound:.3g}"


def test_site_list_covers_every_layer_type(tiny):
    names = {r["site"] for r in site_table(tiny.config, S)}
    cfg = tiny.config
    for layer, kind in enumerate(cfg.layer_types()):
        p = f"layers.{layer}.attn."
        assert (p + "compressor" in names) == (kind != "SWA"), layer
        assert (p + "indexer.topk" in names) == (kind == "CSA"), layer
        assert p + "sparse_attn" in names
        assert f"layers.{layer}.ffn.gate.topk_ids" in names
    assert {"embed", "hc_head", "norm", "logits"} <= names
    assert {"SWA", "CSA", "HCA"} == set(cfg.layer_types())
    assert any(cfg.is_hash_layer(i) for i in range(cfg.n_layers))
    assert not all(cfg.is_hash_layer(i) for i in range(cfg.n_layers))


def test_qat_switch_changes_only_qat_sites(tiny, tokens):
    on = dd.reference(tiny, tokens[:64], keep_sites="layers.0.attn.*")
    off = dd.reference(tiny, tokens[:64], qat=False, keep_sites="layers.0.attn.*")
    assert torch.equal(on.sites["layers.0.attn.kv_rope"], off.sites["layers.0.attn.kv_rope"])
    assert not torch.equal(on.sites["layers.0.attn.kv_cache"], off.sites["layers.0.attn.kv_cache"])


def test_fp8_sim_and_fp4_sim_match_hand_computed_values():
    x = torch.tensor([[448.0, -1.0, 0.3, 2.0 ** -10] + [0.0] * 60])
    y = ref.fp8_sim(x, 64)
    assert y[0, 0] == 448 and y[0, 1] == -1 and y[0, 2] == 0.3125           # e4m3: 0.3 -> 0.3125
    z = ref.fp4_sim(torch.tensor([[6.0, 0.25, 0.75, 2.5, 5.0, -3.2] + [0.0] * 26]), 32)
    assert z[0, :6].tolist() == [6.0, 0.0, 1.0, 2.0, 4.0, -3.0]               # ties to even codes
    h = ref.rotate_activation(torch.eye(4, dtype=torch.float64))
    assert torch.allclose(h @ h.T, torch.eye(4, dtype=torch.float64))
    assert math.isclose(float(h[0, 0]), 0.5)


def test_mtp_block_drafts_from_the_next_token_causally(tiny, tokens):
    out = dd.reference(tiny, tokens[:48], mtp=True, keep_sites="mtp.0.*")
    assert out.mtp_logits.shape == out.logits.shape and torch.isfinite(out.mtp_logits).all()
    assert {"mtp.0.e_proj", "mtp.0.h_proj", "mtp.0.attn.sparse_attn", "mtp.0.logits"} <= set(out.sites)
    j = 30
    changed = tokens[:48].clone()
    changed[j] = (changed[j] + 1) % tiny.config.vocab_size
    other = dd.reference(tiny, changed, mtp=True)
    assert torch.equal(other.mtp_logits[:j - 1], out.mtp_logits[:j - 1])     # position t reads token t+1
    assert not torch.equal(other.mtp_logits[j - 1], out.mtp_logits[j - 1])
