"""The GPU path without a GPU: the simulator suite (tests/cuda, in its own process) and a
compilation of every kernel for real hardware (sm_90) with the argument types the host code
launches it with. Under CI=true a missing numba-cuda or NVVM fails instead of skipping."""
import os
import subprocess
import sys

import pytest
from conftest import ROOT, in_ci


def _need(what: str, why: str):
    if in_ci():
        pytest.fail(f"CI=true and {what} is missing: {why}")
    pytest.skip(f"{what} unavailable: {why}")


def _numba_cuda():
    try:
        from numba import cuda
    except ImportError as e:
        _need("numba-cuda", f"{e} (pip install 'pyimp[test]')")
    return cuda


# a guard against a hung simulator, not a speed check: the simulator runs every CUDA thread
# as a Python thread, and on a slow 2-vCPU VM phase the folder took over 900 s (the whole clean-clone
# suite 39 min there, against 24 min on the same kind of VM another day)
SIMULATOR_TIMEOUT_S = 3600


class SimulatorRun:
    """The simulator suite (tests/cuda) in a pytest process of its own, started when the
    session collects test_simulator_suite (tests/conftest.py) so that it runs beside the rest
    of the suite, and read by that test. Its output goes to a temporary file."""

    def __init__(self):
        import tempfile
        self.log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             os.path.join(ROOT, "tests", "cuda")], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def result(self, timeout: float = SIMULATOR_TIMEOUT_S) -> tuple[int, str]:
        """(exit status, output) once the process ends; killed after ``timeout`` seconds."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = f"killed after {timeout} s"
        self.log.seek(0)
        return rc, self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


_RUN: SimulatorRun | None = None


def start_simulator() -> None:
    """Start the simulator suite in the background (once), where numba-cuda is installed."""
    global _RUN
    if _RUN is None:
        try:
            from numba import cuda  # noqa: F401
        except ImportError:
            return                     # test_simulator_suite reports it
        _RUN = SimulatorRun()


def stop_simulator() -> None:
    global _RUN
    if _RUN is not None:
        _RUN.stop()
        _RUN = None


def test_simulator_suite():
    """Every CUDA kernel against its NumPy reference on numba-cuda's simulator. A failure is
    a failure: nothing is rerun (a race that shows once in a while must fail the run)."""
    _numba_cuda()
    start_simulator()                  # when the session did not start it at collection
    rc, out = _RUN.result()
    assert rc == 0, f"simulator suite failed (exit {rc}):\n{out[-9000:]}"


@pytest.fixture(scope="module")
def ptx():
    """compile_only mode of pyimp.cuda.device, or a skip (a failure in CI) without NVVM."""
    cuda = _numba_cuda()
    try:
        cuda.compile_ptx(lambda a: None, "(float32[:],)", cc=(9, 0))
    except Exception as e:
        _need("NVVM (numba-cuda[cu12])", str(e).splitlines()[0])
    from pyimp.cuda import device
    return device


def test_reductions_compile(ptx):
    import numpy as np
    from numba import cuda, float32

    @cuda.jit
    def k(x, out):
        red = cuda.shared.array(256, float32)
        v = x[cuda.threadIdx.x]
        w = cuda.local.array(2, float32)
        w[0] = v
        w[1] = v
        ptx.block_max_n(w, 2, red)
        ptx.block_sum_n(w, 2, red)
        ptx.lane_sums(w, 2, red)
        out[0] = ptx.block_sum(v, red) + w[0] + w[1]

    with ptx.compile_only((9, 0)):
        ptx.launch(k, 1, 64, np.zeros(64, np.float32), np.zeros(1, np.float32))


def test_launch_configurations_are_made_once_without_the_occupancy_warning():
    """device._configured: one configuration object per (kernel, grid, block, shared), made
    without numba-cuda's "low occupancy" warning (pyimp's small grids are deliberate), which
    stays on for anyone else's kernel[...] (made here without a GPU: configuring launches
    nothing)."""
    import warnings

    cuda = _numba_cuda()
    from pyimp.cuda import device

    @cuda.jit
    def k(a):
        a[0] = 1

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a = device._configured(k, 1, 32, 0)
        b = device._configured(k, 1, 32, 0)
        c = device._configured(k, 2, 32, 0)
        assert a is b and c is not a
        assert not [w for w in seen if "occupancy" in str(w.message)], seen
        k[3, 32, 0, 0]                       # outside pyimp's launches the warning stands
    assert [w for w in seen if "occupancy" in str(w.message)]
    assert device._performance_warnings()


def test_device_cuda_without_gpu_is_one_error_line(tmp_path):
    """--device cuda on a machine without a GPU: exit 1 and one line naming what is missing."""
    _numba_cuda()
    from tools.write_synthetic_gguf import SynthSpec, write
    path = write(tmp_path / "m.gguf", SynthSpec(weight_type="Q8_0", random_blocks=True))
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-m", "pyimp.cli.run", path, "--device", "cuda", "-p", "hi",
                        "-n", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    from numba import cuda
    if cuda.is_available():
        pytest.skip("this machine has a GPU")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("pyimp-run: error: device cuda:") and "GPU" in lines[0]


def test_a_numba_cuda_that_cannot_compile_under_this_numpy_is_named():
    """_check_compiler: numba-cuda's array typing failing to import (numba-cuda 0.30.4 under
    NumPy 2.5: np.row_stack is gone) is one DeviceUnavailable naming both versions and the
    fix; a numba-cuda without that module is left alone; this machine's passes."""
    _numba_cuda()
    from pyimp import cuda as pc

    def broken(name):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    def other_layout(name):
        raise ModuleNotFoundError(name)

    with pytest.raises(pc.DeviceUnavailable, match=r"numba-cuda .* NumPy .*row_stack.*numpy<2.5"):
        pc._check_compiler(broken)
    pc._check_compiler(other_layout)
    pc._check_compiler()


def test_prompt_cache_on_the_device_is_refused(tmp_path):
    """Prompt-cache files need the cache on the host: one error line before anything loads."""
    r = subprocess.run([sys.executable, "-m", "pyimp.cli.run", str(tmp_path / "absent.gguf"),
                        "--device", "cuda", "--prompt-cache", str(tmp_path / "s.bin"), "-p", "hi"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "--device cpu" in lines[0], r.stderr
