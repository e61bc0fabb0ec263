"""Results that do not depend on the run: for a given model, options and thread count the
logits are bit-identical whatever the timings chose (serial or parallel kernels); a first run
that compiles the kernels against one that loads them from Numba's cache is a known defect
(the strict xfail below)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numba
import numpy as np
import pytest

import pyimp
from conftest import ROOT
from loaders import quants
from tools.write_synthetic_gguf import SynthSpec, write
from tools.write_synthetic_gguf import prompt_ids as _ids

# the configurations whose arithmetic a timing could reach: dense fp32 and ggml numerics,
# block-sparse decode, a quantized cache, eviction
CONFIGS = {
    "fp32": dict(),
    "ggml": dict(numerics="ggml"),
    "sparse": dict(sparse=True, topk=4, anchor="quest"),
    "q8_0-q4_0": dict(cache_type_k="q8_0", cache_type_v="q4_0"),
    "h2o": dict(kv_policy="h2o", kv_budget=96, kv_recent=16),
}
# 160 tokens in blocks of 4: 40 blocks, so the decode attention splits its blocks (at least
# 8 a split) differently for 1 thread and for 2 (pyimp.attn_kernels.default_splits)
N_PROMPT, BLOCK_LEN, N_DECODE = 160, 4, 4


def _spec():
    return SynthSpec(arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                     vocab_size=300, seed=31)


def run_configs(path: str, names=tuple(CONFIGS), n_prompt=N_PROMPT, block_len=BLOCK_LEN,
                n_decode=N_DECODE) -> dict:
    """Prefill an n_prompt-token prompt and greedy-decode n_decode tokens in each of CONFIGS
    named: name -> logits float32[n_decode + 1, V]."""
    out = {}
    for name in names:
        opts = CONFIGS[name]
        eng = pyimp.load(path, n_ctx=512, block_len=block_len, batch_size=64, **opts)
        rows = [eng.eval(_ids(n_prompt, seed=4))[-1]]
        for _ in range(n_decode):
            rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
        out[name] = np.array(rows)
        eng.close()
    return out


@contextlib.contextmanager
def decided(parallel: bool):
    """Every ThreadChoice runs its calls ``parallel`` or serially, as decided at once (no timed
    trials): what a run on an idle machine or on a loaded one might choose."""
    run = quants.ThreadChoice.run

    def forced(self, fn, *args):
        self._n, self.parallel, self._calls, self._next = quants.thread_count(), parallel, 0, 1 << 62
        return run(self, fn, *args)

    quants.ThreadChoice.run = forced
    try:
        yield
    finally:
        quants.ThreadChoice.run = run


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write(tmp_path_factory.mktemp("det") / "m.gguf", _spec())


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads to tell serial from parallel")
def test_serial_or_parallel_kernels_give_the_same_bits(model):
    """Every kernel call a ThreadChoice runs serially computes what its parallel run computes,
    bit for bit: decode attention splits its blocks for the thread count the choice was made
    under (quants.work_threads), not for the one thread it runs on."""
    with decided(parallel=False):
        serial = run_configs(model)
    with decided(parallel=True):
        parallel = run_configs(model)
    for name in CONFIGS:
        assert np.array_equal(serial[name], parallel[name]), name


def test_work_threads_inside_a_serial_run():
    """work_threads: Numba's count outside, the chosen-under count inside a serial run (the
    thread count itself is 1 there), restored after."""
    n = quants.thread_count()
    assert quants.work_threads() == n
    with quants._serial_run(n):
        assert quants.thread_count() == 1 and quants.work_threads() == n
    assert quants.work_threads() == n and quants.thread_count() == n


_CHILD = """
import sys
import numpy as np
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from pyimp.runtime import configure_process
configure_process()
from test_determinism import run_configs
np.savez({out!r}, **run_configs({model!r}, {names!r}, 300, 8, 6))
"""


# Known defect, kept as a strict xfail so that its fix is noticed: a first run (Numba compiles
# the kernels) and a later run (Numba loads them from its cache) differ in the last bits, in the
# decode attention (and the prefill's kernel path). The kernels use fast-math reassociation
# (pyimp.attn_kernels.FM); a parallel kernel's loop body and its non-inlined helpers exist
# twice, compiled standalone and linked into the kernel's module where LLVM optimizes them
# again, and under reassociation the two copies may sum in other orders. Which copy a call
# reaches depends on whether the standalone one was compiled in the same process. Measured on
# this test: cold and warm logits differ by up to 1.2e-5 (logits of magnitude ~5); cold runs agree with each
# other bit for bit, and so do warm runs; without "reassoc" in FM cold and warm agree, but the
# decode attention is several times slower. The fix is reductions written in a fixed order
# that LLVM vectorizes without reassociation (explicit lane accumulators).
@pytest.mark.xfail(strict=True, reason="first-run and cached kernels differ under fast-math "
                   "reassociation (see the comment above)")
def test_a_cold_first_run_gives_the_bits_of_a_warm_one(model, tmp_path):
    """A first run in a fresh Numba cache (every kernel compiled) and a second run that loads
    them give bit-identical logits (300 prompt tokens in blocks of 8, 6 decode steps: shapes
    where the difference shows)."""
    names = ("fp32",)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    runs = []
    for name in ("cold", "warm"):
        out = str(tmp_path / f"{name}.npz")
        code = _CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), out=out, model=model,
                             names=names)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(dict(np.load(out)))
    assert os.listdir(tmp_path / "numba-cache")            # the second run had a cache to load
    cold, warm = runs
    assert sorted(cold) == sorted(names)
    for name in names:
        assert np.array_equal(cold[name], warm[name]), \
            f"{name}: largest difference by step {np.abs(cold[name] - warm[name]).max(axis=1)}"
