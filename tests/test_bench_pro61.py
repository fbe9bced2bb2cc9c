"""bench_pro61.py's CPU path: a shrunk model (first layers on disk, the rest generated), every step."""
import importlib.util
import json
from pathlib import Path


def _bench():
    path = Path(__file__).parents[1] / "benchmarks" / "bench_pro61.py"
    spec = importlib.util.spec_from_file_location("bench_pro61", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_pro61_tiny_smoke(tmp_path):
    bench = _bench()
    out = tmp_path / "r.json"
    res = bench.main(["--preset", "tiny", "--layers", "3", "--tokens", "16", "--device", "cpu",
                      "--planted", "nan@layers.2.ffn.shared_experts", "--bisect-axis", "layers,stages",
                      "--out", str(out)])
    assert json.loads(out.read_text())["steps"].keys() == res["steps"].keys() == {
        "write_checkpoint", "forward_reference", "forward_sim", "run", "capture", "bisect"}
    assert res["steps"]["run"]["named_site"] == "layers.2.ffn.shared_experts"
    assert res["localised"] == {"planted_layer": 2, "run": True, "bisect layers": True, "bisect stages": True}
    assert set(res["per_layer_s"]["sim"]) == {"embed", "layers.0", "layers.1", "layers.2", "head"}


def test_bench_pro61_each_fault_and_the_fault_free_case(tmp_path):
    """--each: the fault-free candidate first (nothing named), then each fault named by run and both axes."""
    bench = _bench()
    res = bench.main(["--preset", "tiny", "--layers", "3", "--tokens", "16", "--device", "cpu", "--steps", "none",
                      "--each", "--planted", "swap_experts@layers.1:2,6", "--bisect-axis", "layers,stages",
                      "--out", str(tmp_path / "r.json")])
    assert list(res["each"]) == ["none", "swap_experts@layers.1:2,6"]
    assert res["each"]["none"]["run_located"] and res["each"]["none"]["bisect_located"] == {
        "layers": True, "stages": True}
    fault = res["each"]["swap_experts@layers.1:2,6"]
    assert fault["run_named_site"] == "layers.1.ffn.experts.2" and fault["bisect"]["stages"]["culprit"] == "layers.1"
