"""tools/device_check.py leaves its results where a run does not get through: on a machine where
pyimp's CUDA path cannot run (here: numba-cuda made unimportable) it exits with status 1 and
writes the ``require`` step's failure and reason; a run stopped by SIGTERM (a timeout) writes
the step it cut short as interrupted."""
import json
import os
import signal
import subprocess
import sys
import time

from conftest import ROOT


def _site(tmp_path, code: str) -> dict:
    """The environment of a device_check run whose startup runs ``code`` first."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]))


def test_requirement_failure_is_written(tmp_path):
    env = _site(tmp_path, 'import sys\nsys.modules["numba.cuda"] = None\n')
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


def test_sigterm_writes_the_step_it_cut_short(tmp_path):
    """The simulator's agreement step (a model written, two engines compiled and run) is
    running when the SIGTERM comes: it is written as interrupted, the run ends with 143."""
    env = _site(tmp_path, "")
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "tools.device_check", str(out), "--dry",
                          "--steps", "agreement"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        steps = {}
        while time.monotonic() < deadline and p.poll() is None:
            try:
                steps = json.loads((out / "device_check.json").read_text())["steps"]
            except (OSError, ValueError):     # not written yet, or being written
                steps = {}
            if steps.get("agreement", {}).get("status") == "running":
                break
            time.sleep(0.05)
        assert steps.get("agreement", {}).get("status") == "running", steps
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert rc == 128 + signal.SIGTERM, p.stderr.read()
    data = json.loads((out / "device_check.json").read_text())
    assert data["steps"]["agreement"]["status"] == "interrupted"
    assert data["steps"]["agreement"]["error"] == "SystemExit"
    assert data["steps"]["machine"]["status"] == "ok"
