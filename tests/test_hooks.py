"""dsv4debug.hooks: capture foreign PyTorch models into the capture format and diff them against ours.

The transformers tests build transformers' DeepseekV4ForCausalLM with the tiny preset's config, load our
synthetic checkpoint into it (dequantised, renamed to transformers' names), capture it through hooks and
diff it against our reference run (qat=False) under captures/rules/hf.toml. The vLLM map is checked on a
stand-in module tree with vLLM's module names and call conventions (vLLM itself needs a GPU build).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv4debug.api as dd
from dsv4debug.capture import CaptureReader
from dsv4debug.errors import BadInput
from dsv4debug.hooks import capture, start_capture

RULES = Path(__file__).resolve().parents[1] / "captures" / "rules" / "hf.toml"
SEQ = 192                       # one HCA entry (ratio 128), 48 CSA entries of which the indexer keeps 16
# sites of our flow that transformers computes inside functions (no module boundary), see name_maps.HF
NOT_IN_HF = re.compile(r"\.attn\.(q_rope|kv_rope|kv_cache|sparse_attn)$|\.attn\.indexer\.(q|compressor)$"
                       r"|\.ffn\.experts\.\d+$")


def _transformers():
    pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install transformers)")
    try:
        from transformers import AutoModelForCausalLM  # noqa: F401
        from transformers.models.deepseek_v4 import modeling_deepseek_v4  # noqa: F401
    except ImportError:
        pytest.skip("this transformers has no DeepseekV4 (transformers >= 5.24 has)")


@pytest.fixture(scope="module")
def hf_model(tiny):
    _transformers()
    from transformers import AutoModelForCausalLM

    from dsv4debug.name_maps import hf_config, hf_state_dict
    model = AutoModelForCausalLM.from_config(hf_config(tiny.config), dtype=torch.bfloat16).eval()
    model.load_state_dict(hf_state_dict(tiny), strict=True)      # every HF tensor filled, none left over
    return model


@pytest.fixture(scope="module")
def tokens(tiny):
    return dd.make_tokens(tiny, seq_len=SEQ, seed=3)


@pytest.fixture(scope="module")
def ref_capture(tiny, tokens, tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "ref.h5"
    dd.run(tiny, tokens, candidate="reference", capture=path, save="full", qat=False, mode="free")
    return path


def _hf_capture(model, tokens, path, save="full", **kw):
    with capture(model, path, mapping="hf", save=save, **kw) as cap, torch.no_grad():
        logits = model(input_ids=tokens[None]).logits
    return cap, logits


# ---------------------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------------------
def test_hf_sites_line_up_with_ours(hf_model, tiny, tokens, tmp_path):
    from dsv4debug.runner import site_table
    cap, _ = _hf_capture(hf_model, tokens, tmp_path / "hf.h5", save="stats")
    assert cap.unmapped == [] and cap.error is None
    ours = {row["site"]: row for row in site_table(tiny.config, SEQ)}
    with CaptureReader(tmp_path / "hf.h5") as r:
        assert r.complete and r.runs() == ["hf"]
        assert r.meta["token_ids"] == tokens.tolist() and r.meta["engine"] == "transformers"
        assert r.meta["model_config"]["compress_ratios"][:6] == tiny.config.compress_ratios[:6]
        assert r.layers_completed("hf") == [-1, 0, 1, 2, 3, 4, 5, 6]
        sites = r.sites("hf")
        extra = {s for s in sites if r.site("hf", s)["attrs"].get("extra")}
        for site in sites:
            if site in extra:
                continue
            assert site in ours, f"{site} is not a site of our flow"
            if not re.search(r"\.ffn\.experts\.\d+$", site):
                assert r.stats("hf", site)["shape"] == list(ours[site]["shape"]), site
        # every site of ours is captured, except those HF has no module boundary for
        missing = [s for s in ours if s not in sites]
        assert missing and all(NOT_IN_HF.search(s) for s in missing), missing
        assert {re.sub(r"layers\.\d+\.", "", s) for s in extra} == {
            "attn.compressor.wkv", "attn.compressor.wgate", "attn.compressor.norm", "attn.indexer.compressor.wkv",
            "attn.indexer.compressor.wgate", "attn.indexer.compressor.norm", "ffn.experts",
            "ffn.shared_experts.w1", "ffn.shared_experts.w3"}
        wo_a = r.site("hf", "layers.2.attn.wo_a")
        assert wo_a["attrs"]["module"] == "model.layers.2.self_attn.o_a_proj" and "G*R" in wo_a["attrs"]["note"]
        assert r.site("hf", "layers.2.attn.o_rope")["attrs"]["from"] == "input"


def test_hooks_do_not_change_the_forward(hf_model, tokens, tmp_path):
    with torch.no_grad():
        plain = hf_model(input_ids=tokens[None]).logits
    _, captured = _hf_capture(hf_model, tokens, tmp_path / "hf.h5", save="stats")
    with torch.no_grad():
        after = hf_model(input_ids=tokens[None]).logits              # and the hooks are gone
    assert torch.equal(plain, captured) and torch.equal(plain, after)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in hf_model.modules())


def _cli_diff(a, b, capsys) -> tuple[int, dict]:
    """`dsv4debug diff A B --run-a reference --run-b hf --rules hf.toml --json`: (exit code, result)."""
    from dsv4debug.cli import main
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["diff", str(a), str(b), "--run-a", "reference", "--run-b", "hf", "--rules", str(RULES), "--json"])
    return done.value.code or 0, json.loads(capsys.readouterr().out)


def test_hf_diff_is_clean_under_the_rules(hf_model, tokens, ref_capture, tmp_path, capsys):
    _hf_capture(hf_model, tokens, tmp_path / "hf.h5")
    code, result = _cli_diff(ref_capture, tmp_path / "hf.h5", capsys)
    bad = [(s["site"], s["violations"]) for s in result["sites"] if s["violations"] and s["status"] != "ignored"]
    assert code == 0 and result["clean"], bad
    statuses = {s["site"]: s["status"] for s in result["sites"]}
    assert statuses["embed"] == "identical" and statuses["layers.0.attn.wq_a"] == "identical"
    assert statuses["layers.2.attn.compressor"] == "ok" and statuses["layers.2.attn.indexer.scores"] == "ok"
    assert statuses["layers.5.ffn.gate.topk_ids"] in ("identical", "ok")
    assert result["counts"]["ignored"] > 0 and "only_in_a" not in result["counts"]


def _scale_weight(model, name, factor):
    p = model.get_parameter(name)
    saved = p.detach().clone()
    with torch.no_grad():
        p.mul_(factor)
    return lambda: p.data.copy_(saved)


def _scale_output(model, name, factor):
    handle = model.get_submodule(name).register_forward_hook(lambda m, a, out: out * factor)
    return handle.remove


@pytest.mark.parametrize("plant, target, site", [
    (_scale_weight, "model.layers.1.self_attn.o_b_proj.weight", "layers.1.attn.wo_b"),
    (_scale_output, "model.layers.3.mlp.shared_experts", "layers.3.ffn.shared_experts"),
    (_scale_output, "model.layers.4.self_attn.compressor.indexer.q_b_proj", "layers.4.attn.indexer.wq_b"),
])
def test_planted_fault_is_named_by_diff(hf_model, tokens, ref_capture, tmp_path, plant, target, site, capsys):
    undo = plant(hf_model, target, 1.5)          # the fault's hook is installed before the capture's
    try:
        _hf_capture(hf_model, tokens, tmp_path / "bad.h5")
    finally:
        undo()
    code, result = _cli_diff(ref_capture, tmp_path / "bad.h5", capsys)
    assert code == 1 and not result["clean"] and result["first_failure"] == site
    first = next(s for s in result["sites"] if s["site"] == site)
    assert first["status"] == "exceeds" and first["metrics"]["rel_l2"] > 0.3


def test_hf_generate_records_prefill_then_steps(hf_model, tokens, tmp_path):
    ids = tokens[None, :16]
    with capture(hf_model, tmp_path / "gen.h5", mapping="hf", forwards=2, flush="forward") as cap, \
            torch.no_grad():
        hf_model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert cap.forwards_seen == 3
    with CaptureReader(tmp_path / "gen.h5") as r:
        assert r.runs() == ["hf", "hf.step1"] and r.meta["token_ids"] == ids[0].tolist()
        assert r.stats("hf", "layers.0.attn.wq_a")["shape"] == [16, 128]
        assert r.stats("hf.step1", "layers.0.attn.wq_a")["shape"] == [1, 128]


# ---------------------------------------------------------------------------------------------------------
# generic modules, user maps, failure handling
# ---------------------------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.proj(x))


class _Toy(nn.Module):
    def __init__(self, vocab=32, d=8, n=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([_Block(d) for _ in range(n)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_unmapped_modules_keep_their_names(tmp_path):
    torch.manual_seed(0)
    toy, ids = _Toy(), torch.arange(6)[None]
    with capture(toy, tmp_path / "t.h5", mapping=None, save="full") as cap:
        toy(ids)
    with CaptureReader(tmp_path / "t.h5") as r:
        assert r.runs() == ["torch"]
        assert r.sites("torch") == ["embed", "layers.0.proj", "layers.0.norm", "layers.0", "layers.1.proj",
                                    "layers.1.norm", "layers.1", "head", "output"]
        assert r.tensor("torch", "head").shape == (6, 32)             # batch dim of 1 dropped
        assert r.layers_completed("torch") == [-1, 0, 1]
    assert "layers.0.proj" in cap.unmapped


def test_user_maps_dict_callable_skip_and_exclude(tmp_path):
    torch.manual_seed(0)
    toy, ids = _Toy(), torch.arange(5)
    with capture(toy, tmp_path / "d.h5", mapping={"embed": "embed", "head": "logits", "layers.1": None},
                 unmapped="skip", run="mine") as cap:
        toy(ids)
    with CaptureReader(tmp_path / "d.h5") as r:
        assert r.sites("mine") == ["embed", "logits"]
    assert cap.unmapped == []
    with capture(toy, tmp_path / "c.h5", exclude=r"norm$",
                 mapping=lambda name, m: f"x.{name}" if isinstance(m, nn.Linear) else None):
        toy(ids)
    with CaptureReader(tmp_path / "c.h5") as r:
        assert r.sites("custom") == ["x.layers.0.proj", "x.layers.1.proj", "x.head"]


def test_capture_failures_never_break_the_model(tmp_path):
    torch.manual_seed(0)
    toy = _Toy()
    cap = start_capture(toy, tmp_path / "b.h5", mapping=None)
    with pytest.warns(RuntimeWarning, match="batch of 2"):
        out = toy(torch.zeros(2, 4, dtype=torch.long))               # batch > 1: refused by the capture
    assert out.shape == (2, 4, 32)
    with pytest.raises(BadInput, match="batch of 2"):
        cap.close()
    with pytest.raises(BadInput, match="mapping 'nope'"):
        start_capture(toy, tmp_path / "x.h5", mapping="nope")
    (tmp_path / "e.h5").write_bytes(b"")
    with pytest.raises(BadInput, match="exists"):
        start_capture(toy, tmp_path / "e.h5", mapping=None)


def test_crash_inside_the_block_keeps_finished_layers(tmp_path):
    torch.manual_seed(0)
    toy = _Toy(n=3)

    def boom(module, args, output):
        raise RuntimeError("kernel crashed")
    toy.layers[2].norm.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="kernel crashed"), capture(toy, tmp_path / "k.h5", mapping=None):
        toy(torch.arange(4))
    assert not (tmp_path / "k.h5").exists()
    with CaptureReader(tmp_path / "k.h5.tmp") as r:
        assert not r.complete and r.layers_completed("torch") == [-1, 0, 1]
        assert "layers.1" in r.sites("torch")


# ---------------------------------------------------------------------------------------------------------
# vLLM's DeepSeek-V4 module tree (names and call conventions of vllm/model_executor/models/deepseek_v4.py)
# ---------------------------------------------------------------------------------------------------------
D, HC, Q, H, PAD, HD, G, R, E, IDX_H, IDX_D = 16, 4, 8, 2, 4, 8, 2, 4, 4, 2, 8


class _Lin(nn.Module):                          # vLLM linears: (output, bias) unless return_bias=False
    def __init__(self, i, o, return_bias=True, output_sizes=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) / i ** 0.5)
        self.return_bias = return_bias
        if output_sizes:
            self.output_sizes = output_sizes

    def forward(self, input_):
        y = input_ @ self.weight.T
        return (y, None) if self.return_bias else y


class _RMS(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _pre(residual, fn):
    mix = F.linear(residual.flatten(1), fn)                          # [N, 24]
    post = 2 * torch.sigmoid(mix[:, HC:2 * HC]).unsqueeze(-1)        # [N, 4, 1] as the tilelang kernel
    comb = mix[:, 2 * HC:].view(-1, HC, HC).softmax(-1)
    return post, comb, (torch.sigmoid(mix[:, :HC]).unsqueeze(-1) * residual).sum(1)


def _post(x, residual, post, comb):
    return post * x.unsqueeze(1) + comb.transpose(1, 2) @ residual


class MHCPreOp(nn.Module):
    def forward(self, residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps,
                hc_post_mult_value, sinkhorn_repeat):
        return _pre(residual, fn)


class MHCPostOp(nn.Module):
    def forward(self, x, residual, post_layer_mix, comb_res_mix):
        return _post(x, residual, post_layer_mix, comb_res_mix)


class MHCFusedPostPreOp(nn.Module):
    def forward(self, x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, *rest):
        residual = _post(x, residual, post_layer_mix, comb_res_mix)
        return (residual, *_pre(residual, fn))


class DeepseekCompressor(nn.Module):
    def forward(self, kv_score, positions, rotary_emb):
        return None                              # writes the paged cache in vLLM


class DeepseekV4Indexer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq_b = _Lin(Q, IDX_H * IDX_D)
        self.weights_proj = _Lin(D, IDX_H)
        self.compressor = DeepseekCompressor()

    def forward(self, hidden_states, qr, compressed_kv_score, indexer_weights, positions, rotary_emb):
        q, _ = self.wq_b(qr)
        self.compressor(compressed_kv_score, positions, rotary_emb)
        return (q.view(-1, IDX_H, IDX_D).sum(-1) > 0).int()


class DeepseekV4MLAAttention(nn.Module):
    num_heads = H

    def forward(self, q, kv, positions, output):
        output.copy_(q * kv.unsqueeze(1).mean(-1, keepdim=True))


class _Wrapper(nn.Module):                      # DeepseekV4MultiHeadLatentAttentionWrapper
    def __init__(self, fused, wq_b, indexer, ratio):
        super().__init__()
        self.fused_wqa_wkv, self.wq_b, self.indexer = fused, wq_b, indexer
        self.wo_b = _Lin(G * R, D, return_bias=False)
        self.wo_a = nn.Parameter(torch.randn(G * R, H * HD // G))
        self.mla_attn = DeepseekV4MLAAttention()
        self.compressor = DeepseekCompressor() if ratio > 1 else None

    def forward(self, positions, x):
        n = x.shape[0]
        qr_kv, _ = self.fused_wqa_wkv(x)
        qr, kv = qr_kv.split([Q, HD], -1)
        qr = qr * torch.rsqrt(qr.pow(2).mean(-1, keepdim=True))        # fused_q_kv_rmsnorm
        q = self.wq_b(qr).view(n, H, HD)
        if self.compressor is not None:
            self.compressor(torch.randn(n, 4 * HD), positions, None)
        if self.indexer is not None:
            self.indexer(x, qr, torch.randn(n, 4 * IDX_D), self.indexer.weights_proj(x)[0], positions, None)
        out = torch.empty(n, PAD, HD)
        self.mla_attn(F.pad(q * 2, (0, 0, 0, PAD - H)), kv, positions, output=out)
        z = torch.einsum("ngd,rd->ngr", out[:, :H].reshape(n, G, -1), self.wo_a[:R])
        return self.wo_b(z.flatten(1))


class DeepseekV4Attention(nn.Module):
    def __init__(self, ratio):
        super().__init__()
        self.fused_wqa_wkv = _Lin(D, Q + HD, output_sizes=[Q, HD])
        self.wq_b = _Lin(Q, H * HD, return_bias=False)
        self.indexer = DeepseekV4Indexer() if ratio == 4 else None
        self.mla_attn = _Wrapper(self.fused_wqa_wkv, self.wq_b, self.indexer, ratio)

    def forward(self, positions, hidden_states, llama_4_scaling):
        return self.mla_attn(positions, hidden_states)


class NormGateLinear(nn.Module):
    def __init__(self, score_routing):
        super().__init__()
        self.norm, self.gate = _RMS(D), _Lin(D, E)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E)) if score_routing else None

    def forward(self, x):
        normed = self.norm(x)
        return normed, self.gate(normed)[0].float()


class DeepseekV4MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = _Lin(D, 2 * 8), _Lin(8, D)

    def forward(self, x):
        gate_up, _ = self.gate_up_proj(x)
        g, u = gate_up.chunk(2, -1)
        return self.down_proj(F.silu(g) * u)[0]


class FusedMoE(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared_experts = shared

    def forward(self, hidden_states, router_logits, input_ids):
        return hidden_states * router_logits.softmax(-1)[:, :1] + self.shared_experts(hidden_states)


class DeepseekV4MoE(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.norm_gate = NormGateLinear(layer >= 1)
        self.shared_experts = DeepseekV4MLP()
        self.experts = FusedMoE(self.shared_experts)

    def forward(self, hidden_states, input_ids=None):
        normed, logits = self.norm_gate(hidden_states)
        return self.experts(hidden_states=normed, router_logits=logits, input_ids=input_ids)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, layer, ratio):
        super().__init__()
        self.attn, self.ffn, self.attn_norm = DeepseekV4Attention(ratio), DeepseekV4MoE(layer), _RMS(D)
        self.hc_attn_fn = nn.Parameter(torch.randn(24, HC * D) / 8)
        self.hc_ffn_fn = nn.Parameter(torch.randn(24, HC * D) / 8)
        self.hc_attn_scale = self.hc_ffn_scale = self.hc_attn_base = self.hc_ffn_base = None
        self.mhc_pre, self.mhc_post, self.mhc_fused_post_pre = MHCPreOp(), MHCPostOp(), MHCFusedPostPreOp()

    def hc_post(self, x, residual, post, comb):
        return self.mhc_post(x, residual, post, comb)

    def forward(self, x, positions, input_ids, post_mix=None, res_mix=None, residual=None):
        if residual is None:
            residual = x
            post_mix, res_mix, x = self.mhc_pre(residual=x, fn=self.hc_attn_fn, hc_scale=None, hc_base=None,
                                                rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6,
                                                hc_post_mult_value=2.0, sinkhorn_repeat=20)
        else:
            residual, post_mix, res_mix, x = self.mhc_fused_post_pre(
                x, residual, post_mix, res_mix, self.hc_attn_fn, None, None, 1e-6, 1e-6, 1e-6, 2.0, 20)
        x = self.attn(positions, self.attn_norm(x), None)
        residual, post_mix, res_mix, x = self.mhc_fused_post_pre(
            x, residual, post_mix, res_mix, self.hc_ffn_fn, None, None, 1e-6, 1e-6, 1e-6, 2.0, 20)
        return self.ffn(x, input_ids), residual, post_mix, res_mix


class HCHeadOp(nn.Module):
    def forward(self, hidden_states, hc_fn, hc_scale, hc_base, rms_norm_eps, hc_eps):
        return hidden_states.sum(1)


class DeepseekV4Model(nn.Module):
    def __init__(self, ratios):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, D)
        self.layers = nn.ModuleList([DeepseekV4DecoderLayer(i, r) for i, r in enumerate(ratios)])
        self.norm, self.hc_head_op = _RMS(D), HCHeadOp()

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        h = self.embed_tokens(input_ids).unsqueeze(-2).repeat(1, HC, 1)
        residual = post_mix = res_mix = None
        for layer in self.layers:
            h, residual, post_mix, res_mix = layer(h, positions, input_ids, post_mix, res_mix, residual)
        h = layer.hc_post(h, residual, post_mix, res_mix)
        return self.norm(self.hc_head_op(h, None, None, None, 1e-6, 1e-6))


class LogitsProcessor(nn.Module):
    def forward(self, lm_head, hidden_states):
        return hidden_states[-1:] @ lm_head.weight.T


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, ratios=(0, 4, 128)):
        super().__init__()
        self.model = DeepseekV4Model(ratios)
        self.lm_head = nn.Linear(D, 50, bias=False)
        self.logits_processor = LogitsProcessor()

    def compute_logits(self, hidden_states):
        return self.logits_processor(self.lm_head, hidden_states)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)


def test_vllm_map_on_vllm_module_tree(tmp_path):
    torch.manual_seed(0)
    model, n = DeepseekV4ForCausalLM(), 5
    ids, positions = torch.arange(n), torch.arange(n)
    with torch.no_grad():
        expected = model(ids, positions)
    with capture(model, tmp_path / "v.h5", mapping="vllm", save="full") as cap, torch.no_grad():
        hidden = model(ids, positions)
        model.compute_logits(hidden)
    assert torch.equal(hidden, expected) and cap.unmapped == []
    with CaptureReader(tmp_path / "v.h5") as r:
        sites = r.sites("vllm")
        layer0 = [s[len("layers.0."):] for s in sites if s.startswith("layers.0.")]
        assert layer0 == [
            "hc_attn.pre", "hc_attn.pre.post", "hc_attn.pre.comb", "attn_norm", "attn.wq_a", "attn.wkv",
            "attn.q_norm", "attn.wq_b", "attn.q_rope", "attn.kv_norm", "attn.sparse_attn", "attn.wo_a",
            "attn.wo_b", "hc_attn.post", "hc_ffn.pre", "hc_ffn.pre.post", "hc_ffn.pre.comb", "ffn_norm",
            "ffn.gate.scores", "ffn.shared_experts.w1", "ffn.shared_experts.w3", "ffn.shared_experts", "ffn",
            "hc_ffn.post"]
        # layer 0's last site comes from layer 1's fused post+pre op; the last layer's from mhc_post
        assert sites.index("layers.0.hc_ffn.post") == sites.index("layers.1.hc_attn.pre") - 1
        assert r.site("vllm", "layers.2.hc_ffn.post")["attrs"]["module"] == "model.layers.2.mhc_post"
        assert r.site("vllm", "layers.0.hc_ffn.post")["attrs"]["module"] == "model.layers.1.mhc_fused_post_pre"
        assert r.layers_completed("vllm") == [-1, 0, 1, 2, 3]
        shapes = {s: r.stats("vllm", s)["shape"] for s in sites}
        assert shapes["layers.0.attn.wq_a"] == [n, Q] and shapes["layers.0.attn.wkv"] == [n, HD]
        assert shapes["layers.0.attn.q_rope"] == [n, H, HD] and shapes["layers.0.attn.sparse_attn"] == [n, H, HD]
        assert shapes["layers.0.hc_attn.pre.post"] == [n, HC] and shapes["layers.0.hc_attn.pre.comb"] == [n, HC, HC]
        assert shapes["layers.0.hc_ffn.post"] == [n, HC, D] and shapes["logits"] == [1, 50]
        assert "layers.1.attn.indexer.topk" in sites and "layers.1.attn.indexer.wq_b" in sites
        assert "layers.2.attn.compressor.wkv" in sites and "layers.0.attn.compressor.wkv" not in sites
        assert r.site("vllm", "layers.0.attn.wq_a")["attrs"]["covers"] == ["attn.wq_a", "attn.wkv"]
        # values: the split halves of fused_wqa_wkv, and the gate scores are sqrt(softplus(logits)) + bias
        x = r.tensor("vllm", "layers.0.attn_norm")
        w = model.model.layers[0].attn.fused_wqa_wkv.weight
        torch.testing.assert_close(r.tensor("vllm", "layers.0.attn.wkv"), x @ w[Q:].T)
        assert torch.equal(r.tensor("vllm", "layers.0.attn.sparse_attn"),
                           r.tensor("vllm", "layers.0.attn.q_rope")
                           * r.tensor("vllm", "layers.0.attn.kv_norm").unsqueeze(1).mean(-1, keepdim=True))
