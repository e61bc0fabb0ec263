"""tools/device_check.py executed end to end at tiny shapes (--dry) on the simulator, so the
script that will meet a GPU has run: every step must finish with status ok (the quantized-KV
agreement included)."""
import json

from tools import device_check


def test_device_check_dry(tmp_path):
    rc = device_check.main([str(tmp_path), "--dry"])
    data = json.loads((tmp_path / "device_check.json").read_text())
    bad = {k: v for k, v in data["steps"].items() if v["status"] != "ok"}
    assert rc == 0 and not bad, bad
    assert data["steps"]["agreement"]["mean_kl"] < 1e-3
    assert data["steps"]["agreement_qkv"]["q8_0"]["mean_kl"] < 1e-3      # quantized KV
    cost = data["steps"]["launch_cost"]
    assert cost["launches_timed"] > 0 and cost["us_per_launch_8_arrays_4_scalars"] > 0
    assert (tmp_path / "device_check.md").read_text().startswith("# device_check")
