"""Synthetic checkpoints through the reader: round trip, laziness, validation, verify, CLI exit codes."""
import dataclasses
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from dsv4debug import synth
from dsv4debug.checkpoint import Checkpoint, default_checkpoint, make_checkpoint, synth_module
from dsv4debug.cli import main as cli_main
from dsv4debug.config import preset
from dsv4debug.errors import BadInput
from dsv4debug.safetensors_io import safetensors_writer
from dsv4debug.schema import all_modules, block_modules, tensor_inventory

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def mx(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "mxfp4", preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def nv(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "nvfp4", preset("tiny"), seed=0,
                           experts_format="nvfp4")


@pytest.fixture(params=["mxfp4", "nvfp4"])
def made(request) -> Path:
    return request.getfixturevalue({"mxfp4": "mx", "nvfp4": "nv"}[request.param])


@pytest.fixture
def copy(mx, tmp_path) -> Path:
    """A private copy of the MXFP4 checkpoint to damage."""
    return Path(shutil.copytree(mx, tmp_path / "ck"))


@pytest.fixture
def nv_copy(nv, tmp_path) -> Path:
    return Path(shutil.copytree(nv, tmp_path / "nv"))


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1)
    return t if t.dtype == torch.int64 else t.view(torch.uint8)


def shard_of(ckpt_dir: Path, tensor: str) -> Path:
    return ckpt_dir / json.loads((ckpt_dir / INDEX).read_text())["weight_map"][tensor]


def rewrite(path: Path, mutate) -> None:
    """Rewrite a shard's header (and optionally data) with mutate(header_dict, data_bytes) -> data or None."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    data = mutate(header, data) or data
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def poke(ckpt_dir: Path, tensor: str, index: int, value: bytes) -> Path:
    """Overwrite bytes of a tensor's data in place (headers untouched)."""
    path = shard_of(ckpt_dir, tensor)
    ckpt = Checkpoint.open(ckpt_dir)
    with open(path, "r+b") as f:
        f.seek(ckpt.entries[tensor].start + index)
        f.write(value)
    return path


def bad_input(fn, *fragments: str) -> str:
    with pytest.raises(BadInput) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ---- writing and reading back ------------------------------------------------------------------------------------

def test_inventory_is_exactly_the_schema(made):
    ckpt = Checkpoint.open(made)
    expected = tensor_inventory(ckpt.config)
    got = {name: (e.dtype, e.shape) for name, e in ckpt.entries.items()}
    assert got == {name: (dtype, tuple(shape)) for name, (dtype, shape) in expected.items()}
    assert ckpt.warnings == []
    assert sorted(p.name for p in made.iterdir()) == ["config.json", *(f"model-0000{i}-of-00004.safetensors"
                                                                        for i in range(1, 5)), INDEX]


def test_every_module_round_trips_bit_for_bit(made):
    ckpt = Checkpoint.open(made)
    fmt = made.name
    assert ckpt.config.expert_format == fmt and ckpt.identity["expert_format"] == fmt
    for name, spec in ckpt.specs.items():
        got, want = ckpt.module(name), synth_module(ckpt.config, spec, seed=0)
        assert got.fmt == want.fmt == spec.fmt and got.tensors.keys() == want.tensors.keys(), name
        for suffix in got.tensors:
            assert torch.equal(raw_bits(got.tensors[suffix]), raw_bits(want.tensors[suffix])), (name, suffix)
        assert got.shape == spec.shape


def test_nvfp4_checkpoint_is_the_lossless_cast_of_the_mxfp4_one(mx, nv):
    nv = Checkpoint.open(nv)
    ref = Checkpoint.open(mx)
    experts = [n for n in nv.specs if ".ffn.experts." in n]
    assert {nv.specs[n].fmt for n in experts if n.startswith("layers.")} == {"nvfp4"}
    assert {nv.specs[n].fmt for n in experts if n.startswith("mtp.")} == {"mxfp4"}      # ModelOpt skips mtp.*
    for name in experts:
        assert torch.equal(nv.module(name).dequantize(), ref.module(name).dequantize()), name
    w1, w3 = (nv.tensor(f"layers.2.ffn.experts.5.{w}.weight_scale_2") for w in ("w1", "w3"))
    assert torch.equal(w1, w3)


def test_same_seed_same_bytes_other_seed_other_values(mx, tmp_path):
    again = make_checkpoint(tmp_path / "again", preset("tiny"), seed=0)
    other = make_checkpoint(tmp_path / "other", preset("tiny", layers=2), seed=1)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in mx.iterdir()}
    assert digest == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in again.iterdir()}
    a, b = Checkpoint.open(mx), Checkpoint.open(other)
    assert not torch.equal(a.tensor("layers.1.attn.wq_a.weight").view(torch.uint8),
                           b.tensor("layers.1.attn.wq_a.weight").view(torch.uint8))
    assert a.identity["sha256"] != b.identity["sha256"]


def test_module_values_depend_on_seed_and_name_only():
    small, big = preset("tiny", layers=2), preset("tiny")
    spec = next(s for s in block_modules(small, 1) if s.name == "layers.1.attn.wq_a")
    assert torch.equal(synth_module(small, spec, 7).tensors["weight"].view(torch.uint8),
                       synth_module(big, spec, 7).tensors["weight"].view(torch.uint8))


def test_synthetic_statistics_are_realistic(mx):
    ckpt = Checkpoint.open(mx)
    wq = ckpt.module("layers.2.attn.wq_a").dequantize()
    assert abs(wq.std().item() * 256 ** 0.5 - 1) < 0.05                      # N(0, 1/fan_in)
    wo_b = ckpt.module("layers.2.attn.wo_b").dequantize()
    assert wo_b.std().item() < 0.5 * wq.std().item()                          # output projections scaled down
    assert abs(ckpt.module("layers.0.attn_norm.weight").dequantize().mean().item() - 1) < 0.02
    base = ckpt.module("layers.3.hc_ffn_base").dequantize()
    comb = base[8:].view(4, 4)
    assert (comb.diagonal() - 3).abs().max() < 0.1 and (comb - torch.diag(comb.diagonal())).abs().max() < 0.1
    assert base[:8].abs().max() < 0.1
    ids = ckpt.module("layers.1.ffn.gate.tid2eid").tensors[""]
    assert ids.dtype == torch.int64 and ids.shape == (2048, 2)
    assert (ids[:, 0] != ids[:, 1]).all() and ids.min() >= 0 and ids.max() < 8
    assert len(torch.unique(ids)) == 8


def test_reading_one_layer_touches_only_its_bytes(mx, tmp_path):
    ckpt_dir = Path(shutil.copytree(mx, tmp_path / "ck"))
    reference = Checkpoint.open(mx)
    keep = {t for n in reference.layer_module_names(3) for t in reference.specs[n].tensors()}
    for path in ckpt_dir.glob("*.safetensors"):          # fill every other tensor's bytes with 0xFF (NaN)
        data = bytearray(path.read_bytes())
        for e in reference.entries.values():
            if e.path.name == path.name and e.name not in keep:
                data[e.start:e.start + e.nbytes] = b"\xff" * e.nbytes
        path.write_bytes(bytes(data))
    damaged = Checkpoint.open(ckpt_dir)                   # headers are intact: opening reads no tensor data
    for name in damaged.layer_module_names(3):
        assert torch.equal(damaged.module(name).dequantize(), reference.module(name).dequantize()), name
    assert torch.isnan(damaged.module("layers.2.attn.wq_a").dequantize()).all()
    bad_input(damaged.verify, "in ", ".safetensors")      # verify reads everything and notices


def test_single_file_checkpoint_and_inference_style_config(mx, tmp_path):
    src = Checkpoint.open(mx)
    out = tmp_path / "single"
    out.mkdir()
    planned = {n: (e.dtype, e.shape) for n, e in src.entries.items()}
    with safetensors_writer(out / "model.safetensors", planned) as write:
        for name in planned:
            write(name, src.tensor(name))
    keys = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_hash_layers", "n_heads", "n_routed_experts",
            "n_activated_experts", "route_scale", "q_lora_rank", "o_groups", "o_lora_rank", "index_n_heads",
            "index_topk", "compress_ratios", "dtype", "scale_fmt", "expert_dtype")
    cfg = dataclasses.asdict(src.config)
    (out / "config.json").write_text(json.dumps({k: cfg[k] for k in keys}))
    for path in (out, out / "model.safetensors"):
        single = Checkpoint.open(path)
        assert single.identity["sha256_of"] == "model.safetensors header"
        assert torch.equal(single.module("layers.4.ffn.experts.7.w2").dequantize(),
                           src.module("layers.4.ffn.experts.7.w2").dequantize())


def test_layer_names_info_and_identity(mx):
    ckpt = Checkpoint.open(mx)
    assert "mtp.0.e_proj" in ckpt.layer_module_names(6) and "layers.5.ffn.gate.bias" in ckpt.layer_module_names(5)
    bad_input(lambda: ckpt.layer_module_names(7), "layer 7")
    bad_input(lambda: ckpt.module("layers.0.nope"), "layers.0.nope")
    info = ckpt.info()
    assert [r["type"] for r in info["layers"]] == ["SWA", "HCA", "CSA", "HCA", "CSA", "SWA", "SWA"]
    assert [r["routing"] for r in info["layers"]] == ["hash"] * 3 + ["score"] * 4
    assert sum(r["bytes"] for r in info["layers"]) + info["globals"]["bytes"] == sum(
        r["bytes"] for r in info["dtypes"].values())
    ident = ckpt.identity
    assert ident["sha256"] == hashlib.sha256((mx / INDEX).read_bytes()).hexdigest()
    assert ident["total_bytes"] == sum(p.stat().st_size for p in mx.glob("*.safetensors"))
    json.dumps(info)


# ---- validation at open ----------------------------------------------------------------------------------------

def test_missing_tensor(copy):
    index = json.loads((copy / INDEX).read_text())
    del index["weight_map"]["layers.3.attn.wkv.scale"]
    (copy / INDEX).write_text(json.dumps(index))
    bad_input(lambda: Checkpoint.open(copy), "'layers.3.attn.wkv.scale'", "missing", INDEX)


def test_wrong_dtype(copy):
    path = shard_of(copy, "layers.2.attn.wq_b.weight")
    rewrite(path, lambda h, d: h["layers.2.attn.wq_b.weight"].update(dtype="I8"))
    bad_input(lambda: Checkpoint.open(copy), "'layers.2.attn.wq_b.weight'", path.name, "I8", "F8_E4M3")


def test_wrong_shape(copy):
    path = shard_of(copy, "layers.2.attn.wq_a.weight")
    rewrite(path, lambda h, d: h["layers.2.attn.wq_a.weight"].update(shape=[256, 128]))
    bad_input(lambda: Checkpoint.open(copy), "'layers.2.attn.wq_a.weight'", path.name, "[256, 128]",
              "[128, 256]", "q_lora_rank=128")


def _add_tensor(copy: Path, name: str) -> Path:
    path = shard_of(copy, "layers.0.attn_norm.weight")

    def add(header, data):
        header[name] = {"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + 8]}
        return data + bytes(8)
    rewrite(path, add)
    index = json.loads((copy / INDEX).read_text())
    index["weight_map"][name] = path.name
    (copy / INDEX).write_text(json.dumps(index))
    return path


def test_unknown_extra_tensor_is_a_warning(copy):
    path = _add_tensor(copy, "layers.0.attn.rotary_emb.inv_freq")
    ckpt = Checkpoint.open(copy)
    assert len(ckpt.warnings) == 1 and "'layers.0.attn.rotary_emb.inv_freq'" in ckpt.warnings[0]
    assert path.name in ckpt.warnings[0]


def test_extra_expert_contradicts_config(copy):
    path = _add_tensor(copy, "layers.1.ffn.experts.8.w1.weight")
    bad_input(lambda: Checkpoint.open(copy), "'layers.1.ffn.experts.8.w1.weight'", path.name,
              "n_routed_experts=8")


def test_shard_listed_but_absent(copy):
    (copy / "model-00003-of-00004.safetensors").unlink()
    bad_input(lambda: Checkpoint.open(copy), "model-00003-of-00004.safetensors", "missing", "layers.")


def test_truncated_shard(copy):
    path = copy / "model-00002-of-00004.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    bad_input(lambda: Checkpoint.open(copy), path.name, "beyond the file", "truncated")


def test_header_length_beyond_file(copy):
    path = copy / "model-00002-of-00004.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    bad_input(lambda: Checkpoint.open(copy), path.name, "header length")


def test_tiny_file(copy):
    path = copy / "model-00002-of-00004.safetensors"
    path.write_bytes(b"\x01\x02")
    bad_input(lambda: Checkpoint.open(copy), path.name, "truncated")


def test_json_garbage_header(copy):
    path = copy / "model-00001-of-00004.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:40] = b"\x00garbage!" * 3 + b"\x00" * 5
    path.write_bytes(bytes(raw))
    bad_input(lambda: Checkpoint.open(copy), path.name, "JSON")


def test_data_offsets_beyond_file(copy):
    path = shard_of(copy, "layers.3.attn.wq_a.weight")

    def shift(header, data):
        begin, end = header["layers.3.attn.wq_a.weight"]["data_offsets"]
        header["layers.3.attn.wq_a.weight"]["data_offsets"] = [begin + len(data), end + len(data)]
    rewrite(path, shift)
    bad_input(lambda: Checkpoint.open(copy), "'layers.3.attn.wq_a.weight'", path.name, "beyond the file")


def test_index_garbage(copy):
    (copy / INDEX).write_text("{not json")
    bad_input(lambda: Checkpoint.open(copy), INDEX, "JSON")


def test_config_hidden_size_contradicts_embed(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["hidden_size"] = 512
    (copy / "config.json").write_text(json.dumps(cfg))
    bad_input(lambda: Checkpoint.open(copy), "'embed.weight'", "model-00001-of-00004.safetensors",
              "hidden_size=512")


def test_config_expert_count_contradicts_tensors(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["n_routed_experts"] = 16
    (copy / "config.json").write_text(json.dumps(cfg))
    bad_input(lambda: Checkpoint.open(copy), "'layers.0.ffn.gate.weight'", "n_routed_experts=16")


def test_config_layer_count_contradicts_tensors(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["num_hidden_layers"] = 5                        # compress_ratios[5] = 0 then serves mtp.0
    (copy / "config.json").write_text(json.dumps(cfg))
    bad_input(lambda: Checkpoint.open(copy), "'layers.5.", "num_hidden_layers=5", ".safetensors")


def test_mixed_expert_formats(copy, nv):
    # graft one NVFP4 expert into the MXFP4 checkpoint
    name = "layers.4.ffn.experts.2.w1"
    src = Checkpoint.open(nv)
    extra = {f"{name}.{s}": src.tensor(f"{name}.{s}") for s in ("weight", "weight_scale", "weight_scale_2",
                                                                  "input_scale")}
    graft = copy / "graft.safetensors"
    with safetensors_writer(graft, {n: (t.dtype, tuple(t.shape)) for n, t in extra.items()}) as write:
        for n, t in extra.items():
            write(n, t)
    index = json.loads((copy / INDEX).read_text())
    for s in ("weight", "scale"):
        del index["weight_map"][f"{name}.{s}"]
    index["weight_map"].update({n: graft.name for n in extra})
    (copy / INDEX).write_text(json.dumps(index))
    bad_input(lambda: Checkpoint.open(copy), f"'{name}.weight'", "graft.safetensors", "nvfp4", "mxfp4")


def test_not_a_checkpoint(tmp_path):
    bad_input(lambda: Checkpoint.open(tmp_path / "nowhere"), "nowhere")
    bad_input(lambda: Checkpoint.open(tmp_path), "not a checkpoint")


# ---- verify (reads data) ---------------------------------------------------------------------------------------

def test_verify_clean(made):
    report = Checkpoint.open(made).verify()
    assert report["ok"] and report["warnings"] == [] and report["tensors"] == len(Checkpoint.open(made).entries)


@pytest.mark.parametrize("tensor, index, value, fragments", [
    ("layers.2.attn.wkv.scale", 1, b"\xff", ["e8m0", "255"]),
    ("layers.3.ffn.experts.1.w2.scale", 7, b"\xff", ["e8m0", "NaN"]),
    ("layers.1.attn.wo_b.weight", 130, b"\x7f", ["e4m3 NaN"]),
    ("layers.0.ffn_norm.weight", 2, b"\xc0\x7f", ["non-finite"]),             # bf16 NaN
    ("hc_head_fn", 4, struct.pack("<f", float("inf")), ["non-finite"]),
    ("layers.1.ffn.gate.tid2eid", 16, struct.pack("<q", 8), ["expert id 8", "0..7"]),
    ("layers.1.ffn.gate.tid2eid", 8, b"\xff" * 8, ["expert id -1"]),
])
def test_verify_finds_bad_values(copy, tensor, index, value, fragments):
    path = poke(copy, tensor, index, value)
    ckpt = Checkpoint.open(copy)                           # headers are fine
    bad_input(ckpt.verify, f"'{tensor}'", path.name, *fragments)


def test_verify_finds_repeated_expert_in_a_hash_row(copy):
    ckpt = Checkpoint.open(copy)
    row = ckpt.tensor("layers.0.ffn.gate.tid2eid")[3]
    path = poke(copy, "layers.0.ffn.gate.tid2eid", 3 * 16 + 8, struct.pack("<q", int(row[0])))
    bad_input(Checkpoint.open(copy).verify, "'layers.0.ffn.gate.tid2eid'", path.name, "row 3", "repeats")


@pytest.mark.parametrize("value, fragment", [(0.0, "0.0"), (float("nan"), "nan"), (-1.0, "-1.0")])
def test_verify_nvfp4_global_scale(nv_copy, value, fragment):
    tensor = "layers.5.ffn.experts.0.w2.weight_scale_2"
    path = poke(nv_copy, tensor, 0, struct.pack("<f", value))
    bad_input(Checkpoint.open(nv_copy).verify, f"'{tensor}'", path.name, "global scale", fragment)


def test_verify_nvfp4_negative_block_scale_and_unshared_scale_2(nv_copy):
    nv = nv_copy
    poke(nv, "layers.1.ffn.experts.0.w3.weight_scale_2", 0, struct.pack("<f", 0.5))
    report = Checkpoint.open(nv).verify()
    assert len(report["warnings"]) == 1 and "layers.1.ffn.experts.0.w1" in report["warnings"][0]
    path = poke(nv, "layers.1.ffn.experts.0.w1.weight_scale", 3, b"\xb8")    # -1.0 in e4m3
    bad_input(Checkpoint.open(nv).verify, "weight_scale'", path.name, "negative block scale")


# ---- writing safely ----------------------------------------------------------------------------------------------

def test_make_refuses_non_empty_and_non_checkpoint_dirs(mx, tmp_path):
    bad_input(lambda: make_checkpoint(mx, preset("tiny")), str(mx), "--force")
    other = tmp_path / "stuff"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    bad_input(lambda: make_checkpoint(other, preset("tiny"), force=True), "not a checkpoint")
    assert (other / "notes.txt").exists()


def test_make_force_replaces_and_failure_leaves_nothing(mx, tmp_path, monkeypatch):
    out = Path(shutil.copytree(mx, tmp_path / "ck"))
    make_checkpoint(out, preset("tiny", layers=1, experts=2), seed=2, force=True)
    assert json.loads((out / INDEX).read_text())["metadata"]["seed"] == 2

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")
    monkeypatch.setattr(synth, "_synth_group", boom)
    with pytest.raises(RuntimeError):
        make_checkpoint(tmp_path / "fresh", preset("tiny"))
    with pytest.raises(RuntimeError):
        make_checkpoint(out, preset("tiny"), seed=3, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]                 # no temp dirs, no partial OUT
    assert json.loads((out / INDEX).read_text())["metadata"]["seed"] == 2        # old one intact


def test_make_does_not_replace_a_checkpoint_that_appeared_meanwhile(tmp_path, monkeypatch):
    out = tmp_path / "ck"
    write_all = synth._write_all

    def racing(*args, **kwargs):
        write_all(*args, **kwargs)
        out.mkdir()
        (out / "config.json").write_text("{}")        # someone else finished first
    monkeypatch.setattr(synth, "_write_all", racing)
    bad_input(lambda: make_checkpoint(out, preset("tiny", layers=1, experts=2)), str(out), "--force")
    assert (out / "config.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_default_checkpoint_is_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4DEBUG_CACHE", str(tmp_path / "cache"))
    path = default_checkpoint()
    assert path == tmp_path / "cache" / "tiny-seed0"
    stamp = (path / INDEX).stat().st_mtime_ns
    assert default_checkpoint() == path and (path / INDEX).stat().st_mtime_ns == stamp
    assert Checkpoint.open(path).config.name == "tiny-seed0"


# ---- command line ------------------------------------------------------------------------------------------------

def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        cli_main(list(args))
    out, err = capsys.readouterr()
    return info.value.code, out, "".join(err.split())          # rich wraps long lines: compare without spaces


def test_cli_make_info_verify(tmp_path, capsys):
    out = tmp_path / "cli"
    code, text, _ = run_cli(capsys, "checkpoint", "make", str(out), "--preset", "tiny", "--experts-format", "nvfp4",
                            "--layers", "3", "--experts", "4", "--seed", "3")
    assert code == 0 and "nvfp4" in text
    code, text, _ = run_cli(capsys, "checkpoint", "info", str(out), "--json")
    assert code == 0 and json.loads(text)["identity"]["expert_format"] == "nvfp4"
    code, text, _ = run_cli(capsys, "checkpoint", "info", str(out))
    assert code == 0 and "CSA" in text and "hash" in text
    code, text, _ = run_cli(capsys, "checkpoint", "verify", str(out), "--json")
    assert code == 0 and json.loads(text)["ok"] is True


def test_cli_bad_input_exits_2_naming_tensor_and_file(copy, capsys):
    path = shard_of(copy, "layers.2.attn.wq_b.weight")
    rewrite(path, lambda h, d: h["layers.2.attn.wq_b.weight"].update(dtype="U8"))
    code, _, err = run_cli(capsys, "checkpoint", "info", str(copy))
    assert code == 2 and "'layers.2.attn.wq_b.weight'" in err and str(path).replace(" ", "") in err


def test_cli_verify_exits_2_on_bad_values(copy, capsys):
    path = poke(copy, "layers.4.attn.wq_a.scale", 0, b"\xff")
    code, out, err = run_cli(capsys, "checkpoint", "verify", str(copy), "--json")
    assert code == 2 and json.loads(out)["ok"] is False
    assert "'layers.4.attn.wq_a.scale'" in err and path.name in err


def test_cli_make_refuses_existing_and_bad_options(mx, tmp_path, capsys):
    assert run_cli(capsys, "checkpoint", "make", str(mx))[0] == 2
    assert run_cli(capsys, "checkpoint", "make", str(tmp_path / "x"), "--preset", "huge")[0] == 2
    assert run_cli(capsys, "checkpoint", "make", str(tmp_path / "x"), "--experts-format", "int4")[0] == 2


def _assert_same_module(a, b, name):
    assert a.tensors.keys() == b.tensors.keys(), name
    for suffix in a.tensors:
        x, y = a.tensors[suffix], b.tensors[suffix].cpu()
        assert (x.dtype, x.shape) == (y.dtype, y.shape) and torch.equal(raw_bits(x), raw_bits(y)), (name, suffix)


def test_fused_generation_is_bit_identical_to_eager():
    """The torch.compile'd generator (hash, normals, encoding in one graph) writes the eager path's bytes, in
    every stored format; layer 1 (a CSA layer with its indexer) and the global modules."""
    for fmt in ("mxfp4", "nvfp4", "fp8"):
        cfg = preset("tiny", expert_format=fmt)
        for spec in [s for s in all_modules(cfg) if s.name.startswith("layers.1.") or "layers." not in s.name]:
            _assert_same_module(synth_module(cfg, spec, 3), synth_module(cfg, spec, 3, fused=True), spec.name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_synth_module_on_gpu_is_bit_identical_to_cpu():
    for fmt in ("mxfp4", "nvfp4"):
        cfg = preset("tiny", expert_format=fmt)
        for spec in all_modules(cfg):
            cpu = synth_module(cfg, spec, 5)
            for fused in (False, True):
                _assert_same_module(cpu, synth_module(cfg, spec, 5, device="cuda", fused=fused), spec.name)


def test_synthetic_model_generates_what_make_checkpoint_wrote(tiny):
    from dsv4debug.synth import SyntheticModel
    model = SyntheticModel(tiny.config, seed=0)
    for name in ("layers.2.attn.wq_b", "layers.3.ffn.experts.1.w2", "hc_head_fn", "layers.0.ffn.gate.tid2eid"):
        stored, generated = tiny.module(name), model.module(name)
        assert stored.tensors.keys() == generated.tensors.keys()
        assert all(torch.equal(stored.tensors[k], generated.tensors[k]) for k in stored.tensors), name
