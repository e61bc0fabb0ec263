"""tools.bench's own measurements (the speed figures themselves live in the benchmark)."""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux)")
def test_worker_peak_rss_is_its_own_not_the_parents():
    """A bench worker's peak RSS counts its own address space: with this process holding
    400 MB, a child started from it reports far less (getrusage's ru_maxrss would report at
    least the parent's 400 MB: Linux keeps the high-water mark across fork and exec)."""
    big = np.ones(400 << 20, np.uint8)           # touched: resident in this process
    code = "from tools.bench import peak_rss_mb; print(peak_rss_mb())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       check=True)
    child = float(r.stdout.split()[-1])
    assert big[-1] == 1
    # a Python that imports NumPy is ~30-60 MB resident; 200 MB is half the parent's array
    assert 1 < child < 200, child


def test_header_names_the_kernel_sets_and_an_environment_override():
    """The bench header says what each engine's kernels are built for: LLVM's host CPU, and the
    OpenBLAS kernel set in a fresh process, naming OPENBLAS_CORETYPE when the environment forces
    one (it overrides OpenBLAS's own choice, which changes prefill's speed several-fold)."""
    from llvmlite import binding as llb
    code = "from tools.bench import host_kernels; print(host_kernels())"
    for env_core in (None, "Haswell"):
        env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
        if env_core:
            env["OPENBLAS_CORETYPE"] = env_core
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                           env=env, check=True)
        line = r.stdout.strip()
        assert line.startswith(f"LLVM host {llb.get_host_cpu_name()}; NumPy's OpenBLAS ")
        assert ("OPENBLAS_CORETYPE=Haswell in the environment" in line) == (env_core is not None)
        if env_core and "unknown kernels" not in line:
            assert "OpenBLAS Haswell kernels" in line
        assert line.endswith("fp32 prefill products: loaders.gemm (512-bit)") or line.endswith(
            "fp32 prefill products: BLAS")


def test_decode_profile_counts_grouped_matvecs_as_layer_matvecs(monkeypatch):
    """The decode profile times every layer matvec, grouped calls (q/k/v, gate/up as one
    LinearGroup) included, by weight type; none of it lands in "everything else"."""
    from pyimp import engine as engine_mod
    from pyimp import model as model_mod
    from tools.bench import _profiled
    # _profiled wraps these in place: set to themselves, so that they are restored afterwards
    monkeypatch.setattr(model_mod.Linear, "_matvec", model_mod.Linear._matvec)
    monkeypatch.setattr(engine_mod, "decode_over_blocks", engine_mod.decode_over_blocks)
    monkeypatch.setattr(model_mod.LinearGroup, "__call__", model_mod.LinearGroup.__call__)

    class Lin:
        def __init__(self, name):
            self.name, self.qtype = name, type("T", (), {"name": "Q5_0"})

    group = model_mod.LinearGroup.__new__(model_mod.LinearGroup)
    group.linears = (Lin("blk.0.attn_q.weight"), Lin("blk.0.attn_k.weight"))
    calls = []
    monkeypatch.setattr(model_mod.LinearGroup, "__call__", lambda self, x: calls.append(x) or [x])

    class Eng:
        sparse = None

    spent, on = _profiled(Eng())
    on["active"] = True
    assert model_mod.LinearGroup.__call__(group, 7) == [7] and calls == [7]
    assert set(spent) == {"layer matvecs Q5_0"}


def test_startup_wrapper_reports_the_cli_process_peak_rss():
    """--startup runs pyimp-run inside a wrapper that prints the process's own peak RSS as it
    exits, also when the CLI leaves by SystemExit (here --help)."""
    from tools.bench import _RUN_CLI
    r = subprocess.run([sys.executable, "-c", _RUN_CLI, "--help"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "pyimp-run" in r.stdout
    peak = [float(ln.split()[1]) for ln in r.stderr.splitlines() if ln.startswith("PEAK_RSS_MB ")]
    # a Python that imports NumPy and the CLI is tens of MB resident; far below 2 GB
    assert len(peak) == 1 and 10 < peak[0] < 2000, r.stderr
