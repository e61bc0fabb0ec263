"""tools/device_check.py on a machine where pyimp's CUDA path cannot run (here: numba-cuda made
unimportable): it exits with status 1 and still writes its results, the ``require`` step
failed with the reason, so a GPU run that could not start leaves more than a log line."""
import json
import os
import subprocess
import sys

from conftest import ROOT


def test_requirement_failure_is_written(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["numba.cuda"] = None\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tools.device_check", str(out), "--dry"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "needs numba-cuda" in r.stderr
    data = json.loads((out / "device_check.json").read_text())
    assert list(data["steps"]) == ["require"]
    req = data["steps"]["require"]
    assert req["status"] == "failed" and "DeviceUnavailable" in req["error"], req
    assert "needs numba-cuda" in req["error"]
    md = (out / "device_check.md").read_text()
    assert "| require | failed |" in md
