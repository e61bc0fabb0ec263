"""The engine's compiled kernels under Numba's bounds checking (NUMBA_BOUNDSCHECK=1): every
array index of every njit kernel a prefill and decode steps run is checked, and an index out
of bounds raises IndexError instead of reading or writing past a buffer. (Loads and stores
through the kernels' LLVM intrinsics are raw pointers, outside this check: their own tests
hold them to NumPy references.)"""
import os
import subprocess
import sys

import pytest

from conftest import numba_cache_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# configurations whose forward passes run different kernels: the fp32 and ggml matvecs and
# matmuls, fp16 and quantized KV stores, block-sparse decode with its anchors and importance,
# and an eviction policy's scoring and compaction
CONFIGS = {
    "dense fp32": {},
    "ggml numerics": {"numerics": "ggml"},
    "q4_0 KV": {"kv_type": "q4_0"},
    "block-sparse quest": {"sparse": "quest"},
    "h2o eviction": {"kv_policy": "h2o", "kv_budget": 96},
}

_RUN = r"""
import sys
sys.path.insert(0, {root!r})
from numba.core import config
assert config.BOUNDSCHECK, "NUMBA_BOUNDSCHECK did not reach Numba"
from pyimp.engine import Engine, EngineOptions
from pyimp.sparse.policy import SparseOptions
kw = dict({kw!r})
anchor = kw.pop("sparse", None)
if anchor:
    kw["sparse"] = SparseOptions(enabled=True, anchor=anchor, topk=2)
prompt = [1] + [(7 * i) % 250 + 3 for i in range(150)]
with Engine({model!r}, EngineOptions(n_ctx=256, block_len=16, **kw)) as eng:
    eng.eval(prompt, all_logits=False)
    for t in (5, 9, 200, 17):
        eng.eval([t], all_logits=False)
    if anchor:        # the decode steps attended a selection of blocks, not the whole context
        st = eng.sparse.stats
        assert st.context and sum(st.attended.values()) < sum(st.context.values()), st
print("RAN")
"""


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernels_stay_in_bounds(tmp_path_factory, name):
    from tools.write_synthetic_gguf import SynthSpec, write
    d = tmp_path_factory.getbasetemp() / "boundscheck"
    d.mkdir(exist_ok=True)
    model = d / "m.gguf"
    if not model.exists():
        write(model, SynthSpec(arch="gemma3", n_layer=2, n_embd=256, n_head=4, n_head_kv=1,
                               head_dim=64, n_ff=512, vocab_size=256, weight_type="Q4_K",
                               embd_type="Q5_0", seed=5))
    # a cache of its own: kernels compiled without the checks must not be loaded here
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=numba_cache_for("boundscheck"))
    r = subprocess.run([sys.executable, "-c", _RUN.format(root=ROOT, model=str(model),
                                                          kw=CONFIGS[name])],
                       capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0 and "RAN" in r.stdout, r.stderr[-3000:]
