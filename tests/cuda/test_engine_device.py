"""End to end on the simulator: tiny synthetic models with device="cuda" against the CPU engine,
prefill + decode steps, dense and sparse. Logits agree to float32 accumulation order (tolerance
below); importance_ to one fp16 ulp."""
import numpy as np
import pytest

import pyimp
from tools.write_synthetic_gguf import SynthSpec, prompt_ids, write

# The same math in another order (matmul tiles, block-wide sums, split merges) and another exp:
# measured 2e-5 of the largest |logit| after 2 layers (dense and sparse). Storing K/V as f16
# instead of f32, a change the engine is expected to notice, moves them 4e-4 of it; a wrong
# block, head or kernel more. 5e-5 of the logit scale separates the two.
LOGIT_RTOL = 5e-5


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
        # gemma3: q/k norms, NEOX RoPE, GELU, post-norms, sliding-window layers, soft-cap. The
        # K-quant decoders are checked bit for bit in test_linear.py; end to end they would cost
        # the simulator ~30 s per matvec (each decoded element is a dozen Python calls there)
        "gemma3-q5_0": write(d / "g.gguf", SynthSpec(arch="gemma3", n_layer=2, n_embd=64, n_head=4,
                                                     n_head_kv=1, head_dim=16, n_ff=128,
                                                     vocab_size=260, sliding_window=6,
                                                     swa_pattern=2, final_softcap=30.0,
                                                     weight_type="Q5_0", embd_type="Q8_0",
                                                     random_blocks=True)),
    }


def _run(path, device, n_prompt=9, steps=3, **kw):
    eng = pyimp.load(path, n_ctx=64, block_len=4, device=device, **kw)
    ids = prompt_ids(n_prompt, n_vocab=260)
    rows = [eng.eval(ids)[-1]]
    for t in range(steps):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
    imp = eng.sparse.importance_ if eng.sparse is not None else None
    return np.array(rows), imp, eng


@pytest.mark.parametrize("name", ["llama-q8_0", "llama-q4_0", "gemma3-q5_0"])
def test_dense_matches_cpu(models, name):
    cpu, _, _ = _run(models[name], "cpu")
    gpu, _, eng = _run(models[name], "cuda")
    assert eng.cache.k_cache_fp16_.shape[0] == 2       # [L][Hkv][NB][B*D], on the device
    np.testing.assert_allclose(gpu, cpu, atol=LOGIT_RTOL * np.abs(cpu).max(), rtol=0)


def test_sparse_matches_cpu(models):
    kw = dict(sparse=True, anchor="quest", topk=1, init_blocks=1, local_blocks=1, track=True)
    cpu, imp_cpu, _ = _run(models["llama-q8_0"], "cpu", n_prompt=17, steps=3, **kw)
    gpu, imp_gpu, eng = _run(models["llama-q8_0"], "cuda", n_prompt=17, steps=3, **kw)
    np.testing.assert_allclose(gpu, cpu, atol=LOGIT_RTOL * np.abs(cpu).max(), rtol=0)
    g, c = imp_gpu.astype(np.float32), imp_cpu.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(c)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - c) <= ulp)
    assert eng.sparse.stats.steps == 3 and eng.sparse.report()["mode"] == "sparse"
