"""bench_pro61.py's CPU path: a shrunk model (first layers on disk, the rest generated), every step."""
import importlib.util
import json
from pathlib import Path


def test_bench_pro61_tiny_smoke(tmp_path):
    path = Path(__file__).parents[1] / "benchmarks" / "bench_pro61.py"
    spec = importlib.util.spec_from_file_location("bench_pro61", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    res = bench.main(["--preset", "tiny", "--layers", "3", "--tokens", "16", "--device", "cpu",
                      "--planted", "nan@layers.2.ffn.shared_experts", "--out", str(out)])
    assert json.loads(out.read_text())["steps"].keys() == res["steps"].keys() == {
        "write_checkpoint", "forward_reference", "forward_sim", "run", "capture", "bisect"}
    assert res["steps"]["run"]["named_site"] == "layers.2.ffn.shared_experts"
    assert res["localised"] == {"planted_layer": 2, "run": True, "bisect": True}
    assert set(res["per_layer_s"]["sim"]) == {"embed", "layers.0", "layers.1", "layers.2", "head"}
