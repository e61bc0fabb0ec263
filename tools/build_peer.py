"""Build llama-cpp-python, the comparison peer, for the CPU this machine really has.

    python -m tools.build_peer                    # build and install if needed, print the flags
    python -m tools.build_peer --print-cmake-args # only print the CMAKE_ARGS it would use

Why not a plain ``pip install llama-cpp-python``: that builds llama.cpp with
``-march=native``. On a VM whose CPU advertises AMX (Sapphire Rapids under a
hypervisor that does not enable AMX state) the native build executes AMX
instructions and the first comparison dies with "Illegal instruction". And pip
caches the wheel it built, keyed by the source file only, so a later build with
other flags would silently reuse the native one.

So this script builds with ``GGML_NATIVE=OFF`` and turns on exactly the SIMD
extensions listed in ``/proc/cpuinfo`` (SSE4.2, AVX, AVX2, BMI2, FMA, F16C,
AVX-VNNI, AVX-512 F/VBMI/VNNI/BF16), never AMX, with pip's cache off. The flags
it used are stamped next to the installed package; a second run with the same
flags and version does nothing. The wheel it builds is kept under pyimp's cache, keyed by
version and flags (:func:`wheel_dir`): a new environment on the same machine installs it
instead of building again; a fresh machine builds it.

The ggml numerics mode (``numerics="ggml"``) is bit-exact, kernel by kernel,
with the build this script makes on an AVX-512 machine (see docs/numerics.md).

    python -m tools.build_peer --target znver3    # a second build for another CPU's ISA

``--target`` builds for the instruction set of one of ``tools.mca_steps.TARGETS``
(the extensions above that the target has, and this host has too) into a folder
of its own under pyimp's cache (:func:`target_dir`), never over the installed
peer; ``tools.bench --target`` runs it beside pyimp's kernels compiled for the
same CPU.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"

# /proc/cpuinfo flag -> ggml CMake option (ggml/CMakeLists.txt of the vendored llama.cpp)
X86_FLAGS = [
    ("sse4_2", "GGML_SSE42"),
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("bmi2", "GGML_BMI2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
]
# advertised is not the same as enabled by the hypervisor: never build these in
ALWAYS_OFF = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]
STAMP = ".pyimp-build.json"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first processor in /proc/cpuinfo (empty when unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cmake_args(flags: set[str] | None = None, machine: str | None = None) -> str:
    """CMAKE_ARGS for a portable build that uses the SIMD extensions in ``flags``."""
    machine = (machine or platform.machine()).lower()
    args = ["-DGGML_NATIVE=OFF"]
    if machine in ("x86_64", "amd64"):
        flags = cpu_flags() if flags is None else flags
        args += [f"-D{opt}={'ON' if f in flags else 'OFF'}" for f, opt in X86_FLAGS]
        args += [f"-D{opt}=OFF" for opt in ALWAYS_OFF]
    return " ".join(args)


# LLVM's feature names (tools.mca_steps.TARGETS) -> /proc/cpuinfo's, where they differ
_LLVM_TO_CPUINFO = {"sse4.2": "sse4_2", "avxvnni": "avx_vnni", "avx512vnni": "avx512_vnni",
                    "avx512bf16": "avx512_bf16"}


def target_flags(name: str) -> set[str]:
    """The /proc/cpuinfo flags (as far as X86_FLAGS asks) of a tools.mca_steps target.
    Raises ValueError for a target whose code this host could not run."""
    from tools.mca_steps import TARGETS
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; known: {', '.join(sorted(TARGETS))}")
    llvm = {f[1:] for f in TARGETS[name][1].split(",") if f.startswith("+")}
    flags = {_LLVM_TO_CPUINFO.get(f, f) for f in llvm} & {f for f, _ in X86_FLAGS}
    lacking = sorted(flags - cpu_flags())
    if lacking:
        raise ValueError(f"target {name}: this CPU lacks {', '.join(lacking)}, so a build for it "
                         f"could not be run here")
    return flags


def target_dir(name: str) -> Path:
    """Where ``--target NAME`` installs its build: a folder to put first on PYTHONPATH."""
    from pyimp.runtime.default_model import cache_dir
    return cache_dir() / f"peer-{name}"


def installed_stamp(into: Path | None = None) -> dict | None:
    """The stamp of the installed peer, or of the build in ``into`` (None when absent or not
    built by this script)."""
    if into is not None:
        try:
            return json.loads((into / "llama_cpp" / STAMP).read_text())
        except (OSError, ValueError):
            return None
    code = ("import json, pathlib, llama_cpp; p = pathlib.Path(llama_cpp.__file__).parent / "
            f"{STAMP!r}; print(p.read_text() if p.exists() else 'null')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def wheel_dir(args: str) -> Path:
    """The folder under pyimp's cache that holds the wheel built with CMAKE_ARGS ``args``: one
    folder per version and flags, so a wheel is reused only for the build it came from."""
    from pyimp.runtime.default_model import cache_dir
    key = hashlib.sha256(f"{VERSION} {args}".encode()).hexdigest()[:16]
    return cache_dir() / "peer-wheels" / f"{VERSION}-{key}"


def built_wheel(args: str, env: dict) -> Path:
    """The wheel of this version built with ``args``: from :func:`wheel_dir` when an earlier
    build left it there (a fresh machine has none and builds it), else built now and kept."""
    folder = wheel_dir(args)
    found = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if found:
        print(f"installing the {PACKAGE} wheel built earlier with these flags: {found[0]}",
              file=sys.stderr)
        return found[0]
    print(f"building {PACKAGE} {VERSION} with CMAKE_ARGS={args!r} (a few minutes)", file=sys.stderr)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-cache-dir", "--no-deps",
                        "--no-binary", PACKAGE, "-w", str(tmp), f"{PACKAGE}=={VERSION}"],
                       env=env, check=True)
        try:
            os.replace(tmp, folder)            # whole or not at all: never a half-written wheel
        except OSError:                        # another build got there first: use its wheel
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(folder.glob("*.whl"))[0]


def build(args: str, into: Path | None = None) -> None:
    """Build and install with CMAKE_ARGS ``args``: over the installed peer, or, with ``into``,
    only the package itself into that folder (its dependencies are the environment's)."""
    env = dict(os.environ, CMAKE_ARGS=args, FORCE_CMAKE="1")
    cmd = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--force-reinstall",
           "--no-deps", "--no-binary", PACKAGE, f"{PACKAGE}=={VERSION}"]
    stamp = json.dumps({"version": VERSION, "cmake_args": args})
    if into is not None:
        print(f"building {PACKAGE} {VERSION} with CMAKE_ARGS={args!r} (a few minutes)", file=sys.stderr)
        tmp = into.with_name(into.name + ".part")
        if tmp.exists():
            shutil.rmtree(tmp)
        subprocess.run(cmd + ["--target", str(tmp)], env=env, check=True)
        (tmp / "llama_cpp" / STAMP).write_text(stamp)
        if into.exists():
            shutil.rmtree(into)
        os.replace(tmp, into)       # a half-built folder is never taken for a build
        return
    wheel = built_wheel(args, env)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-cache-dir", "--force-reinstall",
                    "--no-deps", str(wheel)], check=True)
    # its runtime dependencies (numpy, typing-extensions, diskcache, jinja2) from the cache as usual
    subprocess.run([sys.executable, "-m", "pip", "install", f"{PACKAGE}=={VERSION}"], check=True)
    code = ("import json, pathlib, sys, llama_cpp; p = pathlib.Path(llama_cpp.__file__).parent / "
            f"{STAMP!r}; p.write_text(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, stamp], check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.build_peer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--print-cmake-args", action="store_true", help="print CMAKE_ARGS and exit")
    ap.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    ap.add_argument("--target", metavar="CPU",
                    help="build for this CPU's instruction set (a tools.mca_steps target, e.g. "
                         "znver3) into its own folder under pyimp's cache, not over the installed peer")
    a = ap.parse_args(argv)
    into = None
    if a.target:
        try:
            args, into = cmake_args(target_flags(a.target)), target_dir(a.target)
        except ValueError as e:
            ap.error(str(e))
    else:
        args = cmake_args()
    if a.print_cmake_args:
        print(args)
        return 0
    if not a.force and installed_stamp(into) == {"version": VERSION, "cmake_args": args}:
        print(f"{PACKAGE} {VERSION} is already built with CMAKE_ARGS={args!r}"
              + (f" in {into}" if into else ""), file=sys.stderr)
        return 0
    try:
        build(args, into)
    except subprocess.CalledProcessError as e:
        print(f"build_peer: building {PACKAGE} {VERSION} failed (exit {e.returncode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
