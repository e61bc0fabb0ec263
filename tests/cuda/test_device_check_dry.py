"""tools/device_check.py executed end to end at tiny shapes (--dry) on the simulator, as the GPU
machine runs it: in a process of its own where ``gguf`` and ``yaml`` cannot be imported (that
machine's image has neither). Every step must finish with status ok (the quantized-KV
agreement included) and report its figures, the decode step its per-token counts."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))

# started before anything else in the run: gguf and yaml unimportable; the simulator's faster
# barrier scheduler of this folder (fastsim.py), as the tests here have it
_SITE = f"""import sys
sys.modules["gguf"] = None
sys.modules["yaml"] = None
sys.path.insert(0, {HERE!r})
from fastsim import install
install()
"""

# a guard against a hung run, not a speed check (the dry run took about 40 s on a 2-core VM)
TIMEOUT_S = 1800


def test_device_check_dry_without_gguf(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITE)
    out = tmp_path / "out"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([str(site), ROOT]))
    r = subprocess.run([sys.executable, "-m", "tools.device_check", str(out), "--dry"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    data = json.loads((out / "device_check.json").read_text())
    bad = {k: v for k, v in data["steps"].items() if v["status"] != "ok"}
    assert r.returncode == 0 and not bad, (bad, r.stdout[-3000:], r.stderr[-3000:])
    steps = data["steps"]
    # every step ran, in order: the device requirement and the machine first, the kernel tests
    # last
    assert list(steps) == ["require", "machine", "agreement", "agreement_qkv", "launch_cost",
                           "attention", "decode", "prefill", "tinyllama", "kernel_tests"]
    assert data["machine"]["ggml_constants"] == "pyimp's own tables"       # gguf was blocked
    assert steps["agreement"]["mean_kl"] < 1e-3
    assert steps["agreement_qkv"]["q8_0"]["mean_kl"] < 1e-3      # quantized KV
    cost = steps["launch_cost"]
    assert cost["launches_timed"] > 0 and cost["us_per_launch_8_arrays_4_scalars"] > 0
    att = steps["attention"]
    assert att["gemma"]["dense_us"] > 0 and att["tinyllama"]["sparse_us"] > 0
    assert att["gemma"]["fused_dense_us"] > 0 and att["tinyllama"]["fused_sparse_us"] > 0
    assert att["timer"].startswith("host (simulator")
    for where in (steps["decode"]["64"], steps["tinyllama"]):
        for mode in ("dense", "sparse"):
            row = where[mode]
            assert row["tok_s"] > 0 and row["host_us_per_token"] > 0
            # a decode token launches kernels and copies its token id in; counts per token
            assert row["launches_per_token"] >= 1 and row["h2d_per_token"] >= 1
            for k in ("allocations_per_token", "d2h_per_token", "h2d_bytes_per_token",
                      "d2h_bytes_per_token"):
                assert row[k] >= 0, k
        # the fused dense step (2 layers): 6 launches a layer + embed + head, nothing allocated,
        # the token id in (and a block-table entry when the token opens a block); no CUDA
        # graph on the simulator
        dense = where["dense"]
        assert dense["launches_per_token"] == 14 and dense["allocations_per_token"] == 0
        assert 1 <= dense["h2d_per_token"] <= 2 and dense["graph_replays_per_token"] == 0
        assert where["dense_eager"]["launches_per_token"] == 14
    # the prefill attention kernel over the long prompt, its query rows tiled to a work item
    pa = steps["prefill"]["attention"]
    for name in ("gemma", "tinyllama"):
        assert pa[name]["rows_per_item"] > 1 and pa[name]["seconds"] > 0
        assert pa[name]["short_seconds_one_row"] > 0
    assert (out / "device_check.md").read_text().startswith("# device_check")
