"""The comparison peer's portable build flags and the crash-isolating probe."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools import build_peer, llamacpp_peer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPR_FLAGS = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512bw "
             "avx512vl avx512vbmi avx512_vnni avx512_bf16 avx_vnni amx_tile amx_int8 amx_bf16")


def test_cpuinfo_flags_parsed():
    info = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile\nbogomips\t: 1\nprocessor\t: 1\nflags\t\t: x\n"
    assert build_peer.cpu_flags(info) == {"fpu", "avx2", "amx_tile"}   # the first processor's


def test_cmake_args_follow_the_cpu_and_never_enable_amx():
    args = build_peer.cmake_args(set(SPR_FLAGS.split()), machine="x86_64").split()
    assert args[0] == "-DGGML_NATIVE=OFF"
    on = {a[2:-3] for a in args if a.endswith("=ON")}
    assert on == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C",
                  "GGML_AVX_VNNI", "GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI",
                  "GGML_AVX512_BF16"}
    # advertised AMX is not enabled AMX: it stays off even when /proc/cpuinfo lists it
    for amx in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"):
        assert f"-D{amx}=OFF" in args


def test_cmake_args_avx2_only_machine():
    args = build_peer.cmake_args({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}, machine="x86_64")
    assert "-DGGML_AVX2=ON" in args and "-DGGML_AVX512=OFF" in args and "-DGGML_AVX512_VNNI=OFF" in args


def test_cmake_args_other_architectures_are_just_portable():
    assert build_peer.cmake_args(set(), machine="aarch64") == "-DGGML_NATIVE=OFF"


def test_probe_reports_a_crashing_peer_instead_of_dying():
    # the probe child dies of SIGILL exactly as a peer built for the wrong CPU does
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]
    ok, why = llamacpp_peer.run_probe(crash)
    assert not ok
    assert "SIGILL" in why and "tools.build_peer" in why


def test_probe_reports_failure_and_timeout():
    ok, why = llamacpp_peer.run_probe([sys.executable, "-c", "raise SystemExit('no model')"])
    assert not ok and "no model" in why
    ok, why = llamacpp_peer.run_probe([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.5)
    assert not ok and "did not finish" in why
    ok, out = llamacpp_peer.run_probe([sys.executable, "-c", "print('AVX2 = 1')"])
    assert ok and out == "AVX2 = 1"


def test_installed_peer_has_the_flags_build_peer_chose(peer):
    # system_info lists the features the peer was compiled with ("AVX2 = 1 | AVX512 = 1 | ...")
    info = peer.run_probe([sys.executable, "-c", "from tools import llamacpp_peer as p; print(p.system_info())"])[1]
    args = build_peer.cmake_args()
    for opt, name in (("GGML_AVX2", "AVX2"), ("GGML_AVX512", "AVX512"), ("GGML_AVX512_VNNI", "AVX512_VNNI")):
        want = "1" if f"-D{opt}=ON" in args else None
        if want:
            assert f"{name} = 1" in info, info
        else:
            assert f"{name} = 1" not in info, info
    assert "AMX_INT8 = 1" not in info


def _pytest_peer_test(ci: bool):
    env = dict(os.environ, PYIMP_PEER="off")
    env.pop("CI", None)
    if ci:
        env["CI"] = "true"
    target = "tests/test_peer_setup.py::test_installed_peer_has_the_flags_build_peer_chose"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", target],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_missing_peer_skips_outside_ci_and_fails_under_ci():
    r = _pytest_peer_test(ci=False)
    assert r.returncode == 0 and "1 skipped" in r.stdout and "PYIMP_PEER=off" in r.stdout, r.stdout
    r = _pytest_peer_test(ci=True)
    assert r.returncode == 1, r.stdout
    assert "CI=true and the llama.cpp peer cannot run: turned off by PYIMP_PEER=off" in r.stdout + r.stderr


def test_a_target_build_takes_that_cpus_flags_and_only_ones_this_host_has(monkeypatch):
    """``--target znver3``: AVX2 / FMA / F16C / BMI2, no AVX-512 or VNNI, whatever the host has
    beyond it; a target this host could not run (it lacks one of its flags) is refused."""
    monkeypatch.setattr(build_peer, "cpu_flags", lambda cpuinfo=None: set(SPR_FLAGS.split()))
    assert build_peer.target_flags("znver3") == {"sse4_2", "avx", "avx2", "bmi2", "fma", "f16c"}
    args = build_peer.cmake_args(build_peer.target_flags("znver3"), machine="x86_64")
    assert "-DGGML_AVX2=ON" in args and "-DGGML_AVX512=OFF" in args and "-DGGML_AVX_VNNI=OFF" in args
    monkeypatch.setattr(build_peer, "cpu_flags", lambda cpuinfo=None: {"sse4_2", "avx", "avx2", "fma", "f16c"})
    with pytest.raises(ValueError, match="target znver3: this CPU lacks bmi2"):
        build_peer.target_flags("znver3")
    with pytest.raises(ValueError, match="unknown target 'zen9'"):
        build_peer.target_flags("zen9")


def test_a_target_build_goes_into_its_own_folder_whole_or_not_at_all(tmp_path, monkeypatch):
    """The build lands in target_dir (under PYIMP_CACHE), stamped with its flags, through a
    .part folder: a build that fails leaves no folder that passes for a build."""
    monkeypatch.setenv("PYIMP_CACHE", str(tmp_path))
    into = build_peer.target_dir("znver3")
    assert into == tmp_path / "peer-znver3"
    calls = []

    def fake_pip(cmd, env, check):
        calls.append(cmd)
        dest = cmd[cmd.index("--target") + 1]
        os.makedirs(os.path.join(dest, "llama_cpp"))
        if len(calls) == 2:
            raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(build_peer.subprocess, "run", fake_pip)
    build_peer.build("-DGGML_NATIVE=OFF", into)
    assert calls[0][-2:] == ["--target", str(into) + ".part"] and "--force-reinstall" in calls[0]
    assert build_peer.installed_stamp(into) == {"version": build_peer.VERSION, "cmake_args": "-DGGML_NATIVE=OFF"}
    with pytest.raises(subprocess.CalledProcessError):
        build_peer.build("-DGGML_AVX2=ON", into)
    # the failed rebuild left the first build in place, with its own stamp
    assert build_peer.installed_stamp(into)["cmake_args"] == "-DGGML_NATIVE=OFF"
    assert build_peer.installed_stamp(tmp_path / "elsewhere") is None


def test_peer_wheels_are_kept_by_version_and_flags(tmp_path, monkeypatch):
    """built_wheel: a build leaves its wheel in a folder keyed by version and CMAKE_ARGS; the
    same flags install that wheel without building, other flags build their own."""
    monkeypatch.setenv("PYIMP_CACHE", str(tmp_path))
    builds = []

    def fake_pip_wheel(cmd, env, check):
        assert cmd[3] == "wheel" and env["CMAKE_ARGS"] == env_args[0]
        out = Path(cmd[cmd.index("-w") + 1])
        (out / f"llama_cpp_python-{build_peer.VERSION}-cp311-linux_x86_64.whl").write_bytes(b"w")
        builds.append(env["CMAKE_ARGS"])

    monkeypatch.setattr(build_peer.subprocess, "run", fake_pip_wheel)
    env_args = ["-DGGML_NATIVE=OFF -DGGML_AVX2=ON"]
    first = build_peer.built_wheel(env_args[0], {"CMAKE_ARGS": env_args[0]})
    again = build_peer.built_wheel(env_args[0], {"CMAKE_ARGS": env_args[0]})
    assert first == again and builds == env_args                  # the second one built nothing
    assert first.parent == build_peer.wheel_dir(env_args[0]) and first.parent.parent == tmp_path / "peer-wheels"
    env_args[0] = "-DGGML_NATIVE=OFF -DGGML_AVX2=OFF"
    other = build_peer.built_wheel(env_args[0], {"CMAKE_ARGS": env_args[0]})
    assert other.parent != first.parent and len(builds) == 2
    # two folders, one wheel each, no temporary build folder left
    assert sorted(p.name for p in (tmp_path / "peer-wheels").iterdir()) == sorted(
        [first.parent.name, other.parent.name])


def test_peer_cache_types_are_checked_before_llama_cpp_runs():
    """A quantized V without flash attention (llama.cpp refuses it) and a type outside
    llama.cpp's set fail here, naming the value, before any model is opened."""
    with pytest.raises(ValueError, match=r"flash attention for a quantized V cache \(q4_0\)"):
        llamacpp_peer.open_model("absent.gguf", type_k="f16", type_v="q4_0", flash_attn=False)
    with pytest.raises(ValueError, match="peer cache type for K 'q3_k' is not one of"):
        llamacpp_peer.open_model("absent.gguf", type_k="q3_k", flash_attn=True)
    with pytest.raises(ValueError, match="peer cache type for V 'bf16'"):
        llamacpp_peer.logits("absent.gguf", [1, 2], type_k="f16", type_v="bf16")


def test_peer_rotation_switch_sets_and_restores_the_environment(monkeypatch):
    env = llamacpp_peer.ROT_DISABLE_ENV
    for before in ("0", None):
        if before is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, before)
        with llamacpp_peer._rotation(False):
            assert os.environ[env] == "1"
        assert os.environ.get(env) == before
        with llamacpp_peer._rotation(True):
            assert env not in os.environ
        assert os.environ.get(env) == before
        with llamacpp_peer._rotation(None):
            assert os.environ.get(env) == before


def test_peer_runs_each_cache_type_and_honours_the_rotation_switch(peer, tmp_path):
    """On a tiny llama with head dim 64 (llama.cpp rotates quantized K/V of such heads):
    every quantized type changes the logits, the rotation switch changes a quantized cache's
    logits and not an f16 one's, and ``last=`` returns the all-position logits' last rows."""
    from tools.write_synthetic_gguf import SynthSpec, write
    path = write(tmp_path / "l64.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=256, n_head=4,
                                                   n_head_kv=2, n_ff=512, vocab_size=300, seed=3))
    toks = list(range(5, 53))                    # 48 tokens: chunks of 16 in both evaluations
    ref = peer.logits(path, toks, n_batch=16, kv_type="f16", flash_attn=True)
    assert ref.shape == (48, 300) and np.isfinite(ref).all()
    # the same 16-token chunks, fewer output rows: the last rows as the all-position run's (the
    # output rows of a chunk go through the same kernels either way; bound: 1e-5 of the scale)
    tail = peer.logits(path, toks, n_batch=16, kv_type="f16", flash_attn=True, last=16)
    np.testing.assert_allclose(tail, ref[-16:], rtol=0, atol=1e-5 * np.abs(ref).max())
    assert np.array_equal(peer.logits(path, toks, n_batch=16, kv_type="f16", flash_attn=True,
                                      rotate=False), ref)
    for t in peer.QUANT_KV_TYPES:
        on = peer.logits(path, toks, n_batch=16, kv_type=t, rotate=True)
        off = peer.logits(path, toks, n_batch=16, kv_type=t, rotate=False)
        assert np.isfinite(on).all() and np.isfinite(off).all()
        assert not np.array_equal(on, ref) and not np.array_equal(off, ref), t
        assert not np.array_equal(on, off), t
    k_only = peer.logits(path, toks, n_batch=16, type_k="q8_0", type_v="f16", flash_attn=False)
    assert not np.array_equal(k_only, peer.logits(path, toks, n_batch=16, kv_type="f16"))
