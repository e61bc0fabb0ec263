"""Results that do not depend on the run: for a given model, options and thread count the
logits are bit-identical whatever the timings chose (serial or parallel kernels), and whether
the kernels were compiled in this process or loaded from Numba's cache."""
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
# 8 a split) differently for 1 thread and for 2 (pyimp.attention.kernels.default_splits)
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
from pyimp.runtime.process import configure_process
configure_process()
from test_determinism import run_configs
out = {{}}
for name, block_len in {cases!r}:
    out[f"{{name}}-{{block_len}}"] = run_configs({model!r}, (name,), 300, block_len, 6)[name]
np.savez({out!r}, **out)
"""

# (configuration, block length): blocks of 8 take the folded decode kernel (the quantized
# caches' kernel too), fp16 blocks of 16 the grouped one, here with block-sparse decode and its
# retrieval kernels (each case's kernels compile twice, in two processes: most of the test)
COLD_WARM_CASES = (("fp32", 8), ("sparse", 16))


# A first run compiles every kernel; a later run loads them from Numba's cache. Their sums
# agree only when no kernel lets LLVM reassociate: a parallel kernel's body exists twice
# (compiled standalone, and linked into the kernel's module where LLVM optimizes it again),
# and under reassociation the two copies may sum in different orders (measured before the
# fixed-order reductions of loaders.half: up to 1.2e-5 on logits of magnitude ~5).
def test_a_cold_first_run_gives_the_bits_of_a_warm_one(model, tmp_path):
    """A first run in a fresh Numba cache (every kernel compiled) and a second run that loads
    them give bit-identical logits (300 prompt tokens, 6 decode steps)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    runs = []
    for name in ("cold", "warm"):
        out = str(tmp_path / f"{name}.npz")
        code = _CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), out=out, model=model,
                             cases=COLD_WARM_CASES)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(dict(np.load(out)))
    assert os.listdir(tmp_path / "numba-cache")            # the second run had a cache to load
    cold, warm = runs
    names = [f"{n}-{b}" for n, b in COLD_WARM_CASES]
    assert sorted(cold) == sorted(names)
    for name in names:
        assert np.array_equal(cold[name], warm[name]), \
            f"{name}: largest difference by step {np.abs(cold[name] - warm[name]).max(axis=1)}"
