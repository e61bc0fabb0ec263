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
    from pyimp import cpu_forward
    from pyimp import model as model_mod
    from tools.bench import _profiled
    # _profiled wraps these in place: set to themselves, so that they are restored afterwards
    monkeypatch.setattr(model_mod.Linear, "_matvec", model_mod.Linear._matvec)
    monkeypatch.setattr(cpu_forward, "decode_over_blocks", cpu_forward.decode_over_blocks)
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


def _row(model, ctx, pf, dec, peer_pf=100.0, peer_dec=10.0, sparse_dec=None, rss=500.0,
         limit=600.0, compiled=False):
    run = lambda p, d: {"prefill_tok_s": p, "decode_tok_s": d, "peak_rss_mb": rss,  # noqa: E731
                        "compiled": compiled}
    return {"model": model, "ctx": ctx, "pyimp": run(pf, dec), "peer": run(peer_pf, peer_dec),
            "sparse": None if sparse_dec is None else run(0.0, sparse_dec), "rss_limit_mb": limit}


def _goal(vs, start):
    hits = [v for v in vs if v[0].startswith(start)]
    assert len(hits) == 1, (start, vs)
    return hits[0]


def test_verdicts_hold_every_row_to_its_goal():
    """--goals says a goal is met only when every row it names reaches the threshold of
    tools.bench.GOALS (ratios against llama.cpp in the same row), not met when one row falls
    short, and not measured (not met) when no row measured it."""
    from tools.bench import GOALS, verdicts
    g = GOALS["gemma_decode"]
    rows = [_row("gemma", 128, 90.0, 10.0 * g), _row("gemma", 1024, 59.0, 10.0 * g + 1),
            _row("gemma", 16384, 100.0, 10.0 * GOALS["long_dense_decode"],
                 sparse_dec=10.0 * GOALS["long_sparse_decode"] - 0.01),
            _row("tinyllama", 128, 100.0 * GOALS["tinyllama_prefill"], 10.0),
            _row("gemma", 8192, 1.0, 0.1, sparse_dec=0.1)]     # measured, in no goal
    vs = verdicts(rows, startup_s=(GOALS["cold_start_s"] + 0.1, GOALS["warm_start_s"]),
                  shares={"Q8_0": 1.2, "Q5_0": GOALS["matvec_share"]})
    assert _goal(vs, "Gemma decode")[2] is True          # exactly at the threshold counts as met
    pf = _goal(vs, "Gemma prefill")
    assert pf[2] is False and pf[1] == "0.90x at 128, 0.59x at 1024"
    assert _goal(vs, "Gemma long-context dense")[1:] == ("0.80x at 16384", True)
    assert _goal(vs, "Gemma long-context block-sparse")[2] is False
    assert _goal(vs, "TinyLlama-shape prefill")[2] is True
    assert _goal(vs, "warm start")[2] is True and _goal(vs, "cold first run")[2] is False
    assert _goal(vs, "every type's matvec")[2] is True
    assert _goal(vs, "peak RSS")[2] is True


def test_verdicts_name_the_runs_over_the_rss_limit_and_what_was_not_measured():
    from tools.bench import verdicts
    rows = [_row("gemma", 128, 100.0, 10.0, rss=700.0, limit=650.0, compiled=True),
            _row("gemma", 4096, 100.0, 10.0, rss=600.0, limit=650.0)]
    vs = verdicts(rows)
    rss = _goal(vs, "peak RSS")
    assert rss[2] is False and "gemma 128: 700 > 650 MB (compiled kernels)" in rss[1]
    assert "4096" not in rss[1]
    for start in ("Gemma long-context dense", "Gemma long-context block-sparse",
                  "TinyLlama-shape decode", "warm start", "cold first run", "every type's matvec"):
        assert _goal(vs, start)[1:] == ("not measured", None)
    # a long row measured without block-sparse leaves that goal unmeasured, not met
    vs = verdicts([_row("gemma", 32000, 100.0, 10.0)])
    assert _goal(vs, "Gemma long-context block-sparse")[1:] == ("not measured", None)
    assert _goal(vs, "Gemma long-context dense")[2] is True


def test_goals_refuses_its_own_grid_overridden(capsys):
    from tools.bench import main
    for extra in (["--ctx", "128"], ["--numerics", "ggml"]):
        with pytest.raises(SystemExit):
            main(["--goals"] + extra)
        assert "--goals runs the goals' own rows" in capsys.readouterr().err


def test_a_failing_measurement_is_one_line_naming_it(tmp_path):
    """A measurement subprocess that fails (here pyimp-run on a file that is not there) ends
    the bench with one line carrying the subprocess's own last line, not a traceback."""
    from tools.bench import BenchError, startup
    missing = str(tmp_path / "absent.gguf")
    with pytest.raises(BenchError, match=r"pyimp-run \(warm cache\) failed: .*absent\.gguf"):
        startup(missing, 1, cold=False)


def test_the_bench_ends_with_that_line(monkeypatch, capsys):
    from tools import bench

    def fail(*a, **k):
        raise bench.BenchError("pyimp-run (empty cache) failed: x")
    monkeypatch.setattr(bench, "startup", fail)
    monkeypatch.setattr(bench, "read_bandwidth", lambda: 1.0)
    assert bench.cli(["--startup", "--models", "gemma", "--ctx", "128"]) == 1
    assert capsys.readouterr().err == "tools.bench: error: pyimp-run (empty cache) failed: x\n"


def _host_runs(target: str) -> bool:
    from tools.bench import BenchError, target_env
    try:
        return bool(target_env(target))
    except BenchError:
        return False


@pytest.mark.skipif(not _host_runs("znver3"), reason="this host cannot run znver3's instruction set")
def test_target_names_numbas_target_and_wants_its_llama_cpp_build(tmp_path, monkeypatch, capsys):
    """--target CPU: the header says what Numba compiles for (the host's speed features it
    leaves out named), and without tools.build_peer's build for CPU the bench ends with one
    line that says how to make it, before the environment is changed."""
    from tools import bench
    code = "from tools.bench import numba_target; print(numba_target())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                       check=True)
    assert r.stdout.strip() == "Numba compiles for this host"
    env.update(bench.target_env("znver3"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                       check=True)
    from loaders import jit
    wanted = "Numba compiles for znver3 with NUMBA_CPU_FEATURES"
    if "avx512f" in jit.host_features():
        wanted += ", without the host's avx512f"
    assert r.stdout.strip() == wanted
    monkeypatch.setenv("PYIMP_CACHE", str(tmp_path))
    monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)
    assert bench.cli(["--target", "znver3", "--models", "gemma", "--ctx", "128"]) == 1
    assert capsys.readouterr().err == (f"tools.bench: error: --target znver3: no llama.cpp build for "
                                       f"it in {tmp_path / 'peer-znver3'}; make one with python -m "
                                       f"tools.build_peer --target znver3\n")
    assert "NUMBA_CPU_NAME" not in os.environ and bench._PEER_DIR is None


@pytest.mark.skipif(_host_runs("sapphirerapids"), reason="this host runs Sapphire Rapids' instruction set")
def test_a_target_this_host_cannot_run_is_one_line(capsys):
    """Sapphire Rapids' AVX512-FP16 on a host without it: its kernels could not run here."""
    from tools import bench
    assert bench.cli(["--target", "sapphirerapids", "--models", "gemma", "--ctx", "128"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tools.bench: error: --target sapphirerapids: this CPU lacks ")
    assert "avx512fp16" in err and err.count("\n") == 1


def test_kernel_timing_runs_for_its_count_and_its_time_floor():
    """tools.bench_kernels.time_call: a fast call repeats until the time floor has passed, a
    slow one until its count is reached; best and median are of the timed calls."""
    import time

    from tools.bench_kernels import time_call
    calls = []

    def fast():
        calls.append(time.perf_counter())

    t0 = time.perf_counter()
    best, med = time_call(fast, reps=3, min_seconds=0.05)
    assert time.perf_counter() - t0 >= 0.05
    assert len(calls) > 3 + 1          # the warm-up call, then far more than 3 timed calls
    assert 0 <= best <= med

    calls.clear()
    time_call(lambda: (calls.append(0), time.sleep(0.002)), reps=5, min_seconds=0.0)
    assert len(calls) == 1 + 5          # warm-up + exactly the count when the floor is zero
    # two slow calls meet the count; the floor keeps it going, and the fast calls after
    # them set the best (the slow stretch a best of reps alone would have reported)
    import itertools
    delays = itertools.chain([0.0, 0.02, 0.02], itertools.repeat(0.0))
    best, med = time_call(lambda: time.sleep(next(delays)), reps=2, min_seconds=0.1)
    assert best < 0.005


@pytest.mark.parametrize("flag", ["--reps", "--threads"])
def test_kernel_bench_refuses_a_count_below_one_in_one_line(flag, capsys):
    from tools import bench_kernels
    with pytest.raises(SystemExit) as e:
        bench_kernels.main([flag, "0", "--no-real", "--no-compile"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag} 0: must be at least 1" in err and "Traceback" not in err
