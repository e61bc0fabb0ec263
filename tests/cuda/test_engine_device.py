"""End to end on the simulator: tiny synthetic models with device="cuda" against the CPU engine,
prefill + decode steps, dense and sparse. Logits agree to float32 accumulation order (tolerance
below); importance_ to one fp16 ulp."""
import numpy as np
import pytest

import pyimp
from tools.write_synthetic_gguf import SynthSpec, prompt_ids, write

# Logits are sums over n_embd products after 2 layers of the same math in another order (and
# GPU expf / the simulator's exp in softmax and GELU): ~1e-6 relative per op, compounded over
# the layers; logits are O(1), so 2e-4 absolute separates order effects from a wrong kernel
# (a wrong block or head moves logits by >1e-2).
LOGIT_ATOL = 2e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    return {
        "llama-q8_0": write(d / "l8.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4,
                                                     n_head_kv=2, n_ff=128, vocab_size=260,
                                                     weight_type="Q8_0")),
        "llama-q4_0": write(d / "l4.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4,
                                                     n_head_kv=1, n_ff=128, vocab_size=260,
                                                     weight_type="Q4_0", embd_type="Q8_0")),
    }


def _run(path, device, n_prompt=9, steps=3, **kw):
    eng = pyimp.load(path, n_ctx=64, block_len=4, device=device, **kw)
    ids = prompt_ids(n_prompt, n_vocab=260)
    rows = [eng.eval(ids)[-1]]
    for t in range(steps):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
    imp = eng.sparse.importance_ if eng.sparse is not None else None
    return np.array(rows), imp, eng


@pytest.mark.parametrize("name", ["llama-q8_0", "llama-q4_0"])
def test_dense_matches_cpu(models, name):
    cpu, _, _ = _run(models[name], "cpu")
    gpu, _, eng = _run(models[name], "cuda")
    assert eng.cache.k_cache_fp16_.shape[0] == 2
    np.testing.assert_allclose(gpu, cpu, atol=LOGIT_ATOL, rtol=0)


def test_sparse_matches_cpu(models):
    kw = dict(sparse=True, anchor="quest", topk=1, init_blocks=1, local_blocks=1, track=True)
    cpu, imp_cpu, _ = _run(models["llama-q8_0"], "cpu", n_prompt=17, steps=3, **kw)
    gpu, imp_gpu, eng = _run(models["llama-q8_0"], "cuda", n_prompt=17, steps=3, **kw)
    np.testing.assert_allclose(gpu, cpu, atol=LOGIT_ATOL, rtol=0)
    g, c = imp_gpu.astype(np.float32), imp_cpu.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(c)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - c) <= ulp)
    assert eng.sparse.stats.steps == 3 and eng.sparse.report()["mode"] == "sparse"
