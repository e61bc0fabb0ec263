"""Static cost of the fp32 matvec block steps on CPUs this machine is not: llvm-mca estimates.

The speed goals hold on slower cores than the one a change is measured on (a Sapphire Rapids
VM, znver3 VMs), where the quantized matvecs can be bound by their instructions, not by memory.
For each target, a subprocess compiles the kernels with ``NUMBA_CPU_NAME`` /
``NUMBA_CPU_FEATURES`` set to the target's ISA (not the host's) and an empty Numba cache, takes
each kernel's hot loop (the basic block with the most FMAs) from its assembly, and
``llvm-mca`` (LLVM's machine-code analyzer: Debian's ``llvm`` package) runs 200 iterations of
it on the target's scheduling model. The figures are cycles per weight block and weight bytes
per cycle (times the clock in GHz: GB/s of one core when the step, not memory, is the limit).

They are a model's estimates, not measurements: llvm-mca knows the ports, latencies and
dependency chains, not the caches, the prefetchers or the frequency. Where a step's fma takes
its scale as a broadcast load (the K types' sub-block scales, loaders.quants_k._emit_mac_sub16),
LLVM 14's models add the load's latency to the accumulator's chain, which a core does not: the
Q2_K / Q3_K / Q6_K rows then read slower than they run. LLVM 14's znver3 model gives a 256-bit
FMA a reciprocal throughput of 1 cycle (a vmulps 0.5; Zen 3 has two FMA pipes) and a
VPMOVZXBD from memory 1.5: the 4/5-bit types' 256-bit step, which takes two FMAs a weight and
two such loads a block, reads slower there than the step it replaced (Q5_0 11.6 -> 15.2
cycles a block) while it ran faster compiled for znver3 on a Zen 4 core (10.5 -> 9.1). The
Sapphire Rapids row uses the Ice Lake server model (the nearest LLVM 14 has), with Sapphire
Rapids' ISA.

    python -m tools.mca_steps [--targets znver3 sapphirerapids] [--mca PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_X86 = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,"
        "+pclmul,+popcnt,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave")
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512vnni", "avx512vbmi",
           "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq", "avx512ifma", "avx512bf16")
# target -> (Numba's CPU name, its features, llvm-mca's CPU model)
TARGETS = {
    "znver3": ("znver3", _X86 + "".join(f",-{f}" for f in _AVX512), "znver3"),
    "sapphirerapids": ("sapphirerapids", _X86 + "".join(f",+{f}" for f in _AVX512) + ",+avx512fp16",
                       "icelake-server"),
    "skylake-avx512": ("skylake-avx512", _X86 + ",+avx512f,+avx512bw,+avx512vl,+avx512dq,+avx512cd",
                       "skylake-avx512"),
}

# the kernels, named by type (and step: quants_legacy.u4_matvec's two)
KERNELS = tuple(f"{t} {step}" for t in ("Q4_0", "Q5_0", "Q4_1", "Q5_1")
                for step in ("256-bit", "512-bit pairs")) + ("Q4_K", "Q6_K")


def has_isa(target: str, kernel: str) -> bool:
    """Whether ``kernel`` compiles for ``target``: the 512-bit steps need AVX-512
    (loaders.quants_legacy.WIDE_STEPS)."""
    return not kernel.endswith("512-bit pairs") or "+avx512f" in TARGETS[target][1]


def block_shape(kernel: str) -> tuple[int, int]:
    """(weight bytes per block, weights per block) of a kernel's type (loaders.ggml_types)."""
    from loaders.ggml_types import QT, block_size, row_bytes
    qt = QT[kernel.split()[0]]
    return row_bytes(qt, block_size(qt)), block_size(qt)

# run in the target's subprocess: every kernel's assembly, as JSON
_COMPILE = r"""
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
from loaders import quants_legacy as L, quants_k as K
from loaders.ggml_types import QT, row_bytes
out = {{}}
for name in {names!r}:
    t = name.split()[0]
    qt = QT[t]
    n = 1024
    raw = np.zeros((8, row_bytes(qt, n)), np.uint8)
    x, y = np.ones(n, np.float32), np.empty(8, np.float32)
    if qt in (QT.Q4_K, QT.Q6_K):
        K.KERNELS[qt].matvec(raw, x, y)
        disp = getattr(K, "_matvec_" + t.lower())
    else:
        disp = L.u4_matvec(qt, name.endswith("pairs"))
        disp(raw, L.NO_ROWS, L.NO_ROWS, x, y, L.F16_TO_F32)
    out[name] = disp.inspect_asm(disp.signatures[0])
print("ASM" + json.dumps(out))
"""


def hot_loop(asm: str) -> tuple[list[str], int]:
    """The instructions of the basic block with the most FMAs (a kernel's innermost loop, as
    LLVM unrolled it) without directives, labels or inline-asm markers, and its FMA count."""
    blocks = re.split(r"\n(?=\.?L\w+:)", asm)
    best = max(blocks, key=lambda b: len(re.findall(r"\bvfn?madd", b)))
    ins = [ln.strip() for ln in best.splitlines()
           if ln.startswith("\t") and not ln.lstrip().startswith((".", "#")) and ln.strip()]
    return ins, len(re.findall(r"\bvfn?madd", best))


def fmas_per_weight(kernel: str) -> int:
    """FMA lanes a kernel's step takes per weight: two for the 4/5-bit types' 256-bit step (one
    makes the weight, d * q + c, loaders.quants_legacy.ir_u4_groups; one sums it), one for the
    others."""
    return 2 if kernel.endswith("256-bit") else 1


def blocks_per_iteration(ins: list[str], fmas: int, weights: int, per_weight: int = 1) -> float:
    """Weight blocks one pass of the loop computes: every weight takes ``per_weight`` FMA lanes
    (:func:`fmas_per_weight`), 16 lanes to a zmm FMA, 8 to a ymm one."""
    lanes = 16 if any("zmm" in i for i in ins if "madd" in i) else 8
    return fmas * lanes / (weights * per_weight)


def mca_cycles(mca: str, cpu: str, ins: list[str], iterations: int = 200) -> float:
    """llvm-mca's cycles per loop iteration (its Total Cycles over ``iterations``)."""
    p = subprocess.run([mca, f"-mcpu={cpu}", f"-iterations={iterations}"], input="\n".join(ins) + "\n",
                       capture_output=True, text=True)
    m = re.search(r"Total Cycles:\s+(\d+)", p.stdout)
    if p.returncode or not m:
        why = (p.stderr or p.stdout).strip()[:300] or f"exit status {p.returncode}, no output"
        raise RuntimeError(f"{mca} -mcpu={cpu} failed: {why}")
    return int(m.group(1)) / iterations


def compile_asm(target: str, names: list[str]) -> dict:
    """Each named kernel's assembly, compiled for ``target`` in a fresh process and cache."""
    cpu, features, _ = TARGETS[target]
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=cache)
        p = subprocess.run([sys.executable, "-c", _COMPILE.format(root=ROOT, names=names)], env=env,
                           capture_output=True, text=True)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("ASM")]
    if p.returncode or not line:
        raise RuntimeError(f"compiling for {target} failed:\n{p.stderr[-2000:]}")
    return json.loads(line[0][3:])


def find_mca(path: str | None) -> str:
    """The llvm-mca to run: ``path``, else llvm-mca or the newest llvm-mca-NN on PATH."""
    if path:
        if shutil.which(path) is None:
            raise SystemExit(f"error: --mca {path}: not found")
        return path
    found = shutil.which("llvm-mca")
    if found is None:
        dirs = os.environ.get("PATH", "").split(os.pathsep)
        versions = sorted({int(m.group(1)) for d in dirs if os.path.isdir(d) for f in os.listdir(d)
                           if (m := re.fullmatch(r"llvm-mca-(\d+)", f))}, reverse=True)
        found = next((shutil.which(f"llvm-mca-{v}") for v in versions), None)
    if found is None:
        raise SystemExit("error: llvm-mca not found (Debian: apt-get install llvm), or pass --mca PATH")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.mca_steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", nargs="+", default=["znver3", "sapphirerapids"], metavar="CPU",
                    help=f"target CPUs, of: {', '.join(TARGETS)}")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), metavar="NAME",
                    help="kernels, by name as the table prints them (default: all)")
    ap.add_argument("--mca", help="llvm-mca executable (default: llvm-mca or llvm-mca-NN on PATH)")
    args = ap.parse_args(argv)
    for t in args.targets:
        if t not in TARGETS:
            ap.error(f"--targets {t}: unknown target (known: {', '.join(TARGETS)})")
    for k in args.kernels:
        if k not in KERNELS:
            ap.error(f"--kernels {k!r}: unknown kernel (known: {', '.join(KERNELS)})")
    mca = find_mca(args.mca)
    try:
        _table(mca, args.targets, args.kernels)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    return 0


def _table(mca: str, targets: list[str], kernels: list[str]) -> None:
    """Print the table: each kernel compiled for each target, timed by llvm-mca."""
    print(f"llvm-mca: {mca}; cycles per weight block of each kernel's hot loop (model estimates)")
    print(f"{'kernel':<20s} {'target':<16s} {'mca model':<16s} {'instr/block':>11s} "
          f"{'cycles/block':>12s} {'bytes/cycle':>11s}")
    for target in targets:
        names = [k for k in kernels if has_isa(target, k)]
        asms = compile_asm(target, names) if names else {}
        for name in kernels:
            if name not in asms:
                print(f"{name:<20s} {target:<16s} (needs AVX-512: the 512-bit step uses its permutes)")
                continue
            nbytes, weights = block_shape(name)
            ins, fmas = hot_loop(asms[name])
            nblk = blocks_per_iteration(ins, fmas, weights, fmas_per_weight(name))
            if nblk <= 0:
                raise RuntimeError(f"{name} for {target}: no FMA loop found in its assembly")
            cyc = mca_cycles(mca, TARGETS[target][2], ins) / nblk
            print(f"{name:<20s} {target:<16s} {TARGETS[target][2]:<16s} {len(ins) / nblk:11.1f} "
                  f"{cyc:12.2f} {nbytes / cyc:11.2f}")


if __name__ == "__main__":
    sys.exit(main())
