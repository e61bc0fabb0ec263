"""fp16 <-> fp32 conversions of the kernels (loaders.half: the KV cache, attention, F16
weights): the hardware IR (fpext / fptrunc of half) and the integer IR that x86 targets
without F16C compile instead (a NUMBA_CPU_NAME=generic cache), both held to NumPy's
conversions; and the engine under targets below the host's (generic x86-64, AVX2 without
AVX-512) against this process."""
import os
import subprocess
import sys

import numpy as np
import pytest
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.extending import intrinsic

from loaders import half

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@intrinsic
def _soft_h2f(typingctx, h):
    sig = types.float32(types.uint16)
    return sig, lambda context, builder, signature, args: half._half_to_float_soft(builder, args[0])


@intrinsic
def _soft_f2h(typingctx, f):
    sig = types.uint16(types.float32)
    return sig, lambda context, builder, signature, args: half._float_to_half_soft(builder, args[0])


@intrinsic
def _soft_h2f_x8(typingctx, src, i, dst):
    """dst[i:i+8] = the 8 fp16 values of src[i:i+8], converted as one <8 x i16> vector."""
    sig = types.void(src, i, dst)

    def codegen(context, builder, signature, args):
        def ptr(k, vty):
            aryty = signature.args[k]
            ary = context.make_array(aryty)(context, builder, args[k])
            return builder.bitcast(builder.gep(ary.data, [args[1]]), vty.as_pointer())
        hv = builder.load(ptr(0, llvm_ir.VectorType(llvm_ir.IntType(16), 8)), align=2)
        builder.store(half._half_to_float_soft(builder, hv),
                      ptr(2, llvm_ir.VectorType(llvm_ir.FloatType(), 8)), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit
def _h2f_all(h, soft, vector):
    out = np.empty(h.shape[0], np.float32)
    if vector:
        for i in range(0, h.shape[0], 8):
            _soft_h2f_x8(h, i, out)
    else:
        for i in range(h.shape[0]):
            out[i] = _soft_h2f(h[i]) if soft else half.half_bits_to_f32(h[i])
    return out


@njit
def _f2h_all(f, soft):
    out = np.empty(f.shape[0], np.uint16)
    for i in range(f.shape[0]):
        out[i] = _soft_f2h(f[i]) if soft else half.f32_to_half_bits(f[i])
    return out


def _assert_same_floats(got, want):
    """Bit for bit, except NaN: any NaN for a NaN (payloads and the quiet bit are the
    conversion instruction's business, not NumPy's)."""
    gn, wn = np.isnan(got), np.isnan(want)
    np.testing.assert_array_equal(gn, wn)
    np.testing.assert_array_equal(got.view(np.uint32)[~wn], want.view(np.uint32)[~wn])


def _float_samples() -> np.ndarray:
    """float32 patterns around every place fp16 rounding can go wrong: each exponent, with
    mantissas at and beside the 13-bit rounding boundary (ties to even both ways), the top and
    bottom of the mantissa, random ones, both signs; and the fp16 range's edges."""
    rng = np.random.default_rng(0)
    mant = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2FFF, 0x3000, 0x3001,
                     0x7FE000, 0x7FEFFF, 0x7FF000, 0x7FF001, 0x7FFFFF], np.uint32)
    mant = np.concatenate([mant, rng.integers(0, 1 << 23, 48, dtype=np.uint32)])
    exp = np.arange(256, dtype=np.uint32) << 23
    bits = (exp[:, None] | mant[None, :]).ravel()
    edges = np.array([65504.0, 65519.99, 65520.0, 65536.0, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25,
                      3 * 2.0 ** -26, 2.0 ** -25 + 2.0 ** -40, 1.0, 0.1, 1e-30], np.float32)
    bits = np.concatenate([bits, edges.view(np.uint32),
                           rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)])
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)


ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("soft,vector", [(False, False), (True, False), (True, True)],
                         ids=["as compiled here", "integer IR", "integer IR, 8 lanes"])
def test_every_fp16_pattern_converts_as_numpy(soft, vector):
    """All 65536 fp16 patterns (subnormals, both zeros, inf, NaN) give NumPy's float32."""
    want = ALL_HALVES.view(np.float16).astype(np.float32)
    _assert_same_floats(_h2f_all(ALL_HALVES, soft, vector), want)


@pytest.mark.parametrize("soft", [False, True], ids=["as compiled here", "integer IR"])
def test_float_to_fp16_rounds_as_numpy(soft):
    """float32 -> fp16 bits as NumPy's astype(float16): round to nearest even, overflow to inf
    from 65520 on, fp16 subnormals, zeros with their sign; NaN to a NaN."""
    with np.errstate(over="ignore", invalid="ignore"):
        f = _float_samples()
        want = f.astype(np.float16)
    got = _f2h_all(f, soft)
    _assert_same_floats(got.view(np.float16).astype(np.float32), want.astype(np.float32))
    finite = ~np.isnan(f)
    np.testing.assert_array_equal(got[finite], want.view(np.uint16)[finite])


_TARGET_RUN = r"""
import json, sys
sys.path.insert(0, {root!r})
from loaders import half, quants_legacy
from tests.test_half_convert import _logits
print("RESULT" + json.dumps({{"hardware": half.HALF_IN_HARDWARE, "i8": quants_legacy.I8_DOT,
                              "wide": quants_legacy.WIDE_STEPS,
                              "vector_bits": quants_legacy._X86_VECTOR_BITS,
                              "logits": [{{n: _logits(m, n).tolist() for n in ("fp32", "ggml")}}
                                         for m in {models!r}]}}))
"""


def _logits(model: str, numerics: str) -> np.ndarray:
    """The last logits of an 8-token prefill and of one decode step after it."""
    from pyimp.engine import Engine, EngineOptions
    with Engine(model, EngineOptions(n_ctx=64, block_len=16, numerics=numerics)) as eng:
        pre = eng.eval([1, 17, 42, 99, 5, 250, 31, 77], all_logits=False)[-1]
        return np.stack([pre, eng.eval([3], all_logits=False)[-1]])


def _avx2_target() -> dict:
    """NUMBA_CPU_NAME / NUMBA_CPU_FEATURES of an AVX2 machine without AVX-512 (znver3's ISA,
    tools.bench.target_env), or {} where this host could not run its code."""
    from tools.bench import BenchError, target_env
    try:
        return target_env("znver3")
    except BenchError:
        return {}


# target -> (its environment, HALF_IN_HARDWARE, I8_DOT, WIDE_STEPS, x86 vector bits there)
_TARGETS = {"generic": (lambda: {"NUMBA_CPU_NAME": "generic"}, False, None, False, 128),
            "avx2": (_avx2_target, True, "avx2", False, 256)}


@pytest.mark.parametrize("target", sorted(_TARGETS))
def test_an_x86_target_below_the_hosts_runs_the_engine(tmp_path, target):
    """The engine under a Numba target with fewer features than this host, in both numerics,
    gives the logits this process gets (a prefill and a decode step, fp16 KV cache).

    ``generic`` (baseline x86-64: no AVX, no F16C): the kernels use neither the F16C
    conversions nor the AVX2 / VNNI integer dot products, and no 256-bit vector in an inline
    asm's register (LLVM aborted the process on the integer dot products, refused the asm, and
    the conversions crashed it on a KV write). Model: Q5_0 layer matrices, a Q4_0 embedding
    and output head.

    ``avx2`` (znver3's instruction set: AVX2, FMA, F16C, no AVX-512): what an AVX2 machine
    runs, which a host with AVX-512 never does: 256-bit block steps, the AVX2 integer dot
    products of the ggml numerics, F16C conversions. Models: the one above, and Q4_K layers
    with a Q6_K embedding and head (the default model's four types in all)."""
    import json
    import platform
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 targets are an x86 question")
    make_env, hardware, i8, wide, bits = _TARGETS[target]
    target_env = make_env()
    if not target_env:
        pytest.skip(f"this host lacks part of the {target} target's instruction set")
    from tools.write_synthetic_gguf import SynthSpec, write
    models = [str(write(tmp_path / "q5.gguf", SynthSpec(arch="gemma3", n_layer=2, n_embd=64, n_head=4,
                                                        n_head_kv=1, head_dim=32, n_ff=128,
                                                        vocab_size=256, weight_type="Q5_0",
                                                        embd_type="Q4_0", seed=3)))]
    if target == "avx2":
        models.append(str(write(tmp_path / "k.gguf", SynthSpec(
            arch="gemma3", n_layer=2, n_embd=256, n_head=4, n_head_kv=1, head_dim=64, n_ff=512,
            vocab_size=256, weight_type="Q4_K", embd_type="Q6_K", seed=4, random_blocks=True))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    from conftest import numba_cache_for     # here: the child process imports this module
    env.update(target_env, NUMBA_CACHE_DIR=numba_cache_for(f"target-{target}"))
    r = subprocess.run([sys.executable, "-c", _TARGET_RUN.format(root=ROOT, models=models)],
                       capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
    assert r.returncode == 0 and line, (r.returncode, r.stderr[-3000:])
    got = json.loads(line[0][len("RESULT"):])
    assert (got["hardware"], got["i8"], got["wide"], got["vector_bits"]) == (hardware, i8, wide, bits)
    for model, logits in zip(models, got["logits"]):
        for numerics in ("fp32", "ggml"):
            want = _logits(model, numerics)
            # the same operations in another order: another target's loops are vectorized
            # differently (sum order of the fp32 dot products), so the logits agree to float32
            # rounding of sums, not bit for bit (measured: fp32 2.1e-6 of logits up to 3.9,
            # ggml exact); a wrong conversion or dot product moves them by O(1)
            scale = max(float(np.abs(want).max()), 1.0)
            np.testing.assert_allclose(np.array(logits[numerics]), want, rtol=0, atol=2e-5 * scale,
                                       err_msg=f"{os.path.basename(model)} {numerics}")


def test_a_target_without_the_hosts_vector_features_is_named(tmp_path):
    """An Engine whose kernels Numba compiles for a CPU without AVX2 / FMA / F16C / AVX-512F
    that the host has warns once, naming them and the variables that do it: for ``generic``
    that the kernels run several times slower (a Gemma 3 270M decode 13 against 110 tok/s
    here); for an AVX2 target on an AVX-512 host, only that they run on 256-bit vectors (Gemma
    decoded as fast as llama.cpp built for AVX2 there). The host's own target does not warn."""
    from loaders import jit
    if not jit.host_features() & set(jit.SPEED_FEATURES):
        pytest.skip("this host has none of the features a target could leave out")
    from tools.write_synthetic_gguf import SynthSpec, write
    model = str(write(tmp_path / "m.gguf", SynthSpec(arch="llama", n_layer=1, n_embd=32, n_head=2,
                                                     n_head_kv=1, n_ff=64, vocab_size=64)))
    code = ("import warnings, sys\n"
            f"sys.path.insert(0, {ROOT!r})\n"
            "from pyimp.engine import Engine, EngineOptions\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            f"    Engine({model!r}, EngineOptions(n_ctx=32)).close()\n"
            "print('WARN' + '|'.join(str(x.message) for x in w if 'Numba compiles' in str(x.message)))\n")
    cases = [({"NUMBA_CPU_NAME": "generic"}, [f for f in jit.SPEED_FEATURES if f in jit.host_features()],
              "the kernels run several times slower"), ({}, [], "")]
    avx2 = _avx2_target()
    if avx2 and "avx512f" in jit.host_features():
        cases.append((avx2, ["avx512f"], "the kernels run on 256-bit vectors where this CPU has 512-bit ones"))
    for target, missing, cost in cases:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
        env.update(target)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=300, cwd=ROOT)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("WARN")]
        assert r.returncode == 0 and line, r.stderr[-2000:]
        msg = line[0][4:]
        if missing:
            assert msg == (f"Numba compiles for a CPU without {', '.join(missing)}, which this one has "
                           f"(NUMBA_CPU_NAME / NUMBA_CPU_FEATURES / NUMBA_ENABLE_AVX): {cost}"), msg
        else:
            assert msg == "", msg
