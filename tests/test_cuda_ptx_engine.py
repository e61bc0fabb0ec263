"""The whole device forward compiled for real hardware (sm_90): the engine runs with
``device="cuda"`` inside ``device.compile_only``, so every kernel a prefill and a decode step
launch (weights, norms, RoPE, KV stores, dense and block-sparse attention, importance, anchors,
retrieval) is compiled by NVVM with the argument types the host code gives it. Nothing runs
(logits are zeros); what the simulator cannot check (types, supported operations) is checked
here. Under CI=true a missing numba-cuda or NVVM fails."""
import numpy as np
import pytest
from test_cuda import ptx  # noqa: F401  (the fixture: compile_only mode, or a skip without NVVM)

import pyimp
from tools.write_synthetic_gguf import SynthSpec, prompt_ids, write

CC = (9, 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("ptx")
    return {
        "llama": write(d / "l.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4,
                                               n_head_kv=2, n_ff=128, vocab_size=260,
                                               weight_type="Q8_0", random_blocks=True)),
        "gemma3": write(d / "g.gguf", SynthSpec(arch="gemma3", n_layer=2, n_embd=64, n_head=4,
                                                n_head_kv=1, head_dim=16, n_ff=128, vocab_size=260,
                                                sliding_window=8, swa_pattern=2, final_softcap=30.0,
                                                weight_type="Q4_0", embd_type="Q8_0",
                                                random_blocks=True)),
        # head dim 32, the smallest quantized K takes
        "llama32": write(d / "l32.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4,
                                                   n_head_kv=2, head_dim=32, n_ff=128,
                                                   vocab_size=260, weight_type="Q8_0",
                                                   random_blocks=True)),
    }


def _drive(path, **kw):
    eng = pyimp.load(path, n_ctx=96, block_len=8, device="cuda", **kw)
    eng.eval(prompt_ids(40, n_vocab=260))
    for _ in range(2):
        eng.eval([5])
    return eng


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_dense_forward_compiles(ptx, tiny, arch, kv_type):  # noqa: F811
    with ptx.compile_only(CC):
        eng = _drive(tiny[arch], kv_type=kv_type)
    assert eng.cache.k_store.dtype == (np.float16 if kv_type == "f16" else np.float32)


@pytest.mark.parametrize("anchor,retrieval", [("quest", "kvhead"), ("dynamic", "qhead"),
                                              ("block_mean", "layer"), ("fixed", "kvhead"),
                                              ("block_max", "qhead"), ("cuboid_mean", "layer")])
def test_sparse_forward_compiles(ptx, tiny, anchor, retrieval):  # noqa: F811
    with ptx.compile_only(CC):
        eng = _drive(tiny["llama"], sparse=True, anchor=anchor, retrieval=retrieval, topk=1,
                     init_blocks=1, local_blocks=1, token_step=2, decay=0.9, report=True)
    assert eng.sparse.stats.steps == 2


@pytest.mark.parametrize("type_k,type_v", [("q8_0", "q4_0"), ("q4_1", "q5_0"), ("q5_1", "f16"),
                                           ("f32", "q8_0")])
def test_quantized_kv_forward_compiles(ptx, tiny, type_k, type_v):  # noqa: F811
    """Quantized K/V on the device: the quantizer, the tail store, the attention and prefill-
    importance kernels of each pair of formats, the anchors of quantized keys, the recall's
    dense decode, and the rewind that dequantizes a block into the tail (prime)."""
    with ptx.compile_only(CC):
        eng = _drive(tiny["llama32"], cache_type_k=type_k, cache_type_v=type_v, sparse=True,
                     anchor="quest", topk=1, init_blocks=1, local_blocks=1, report=True)
        eng.prime(list(prompt_ids(40, n_vocab=260)[:21]) + [7, 8])
    assert eng.sparse.stats.steps == 2 and eng.timings.extra["prefix_reused"] == 21
    assert getattr(eng.cache, f"k_cache_{'fp16' if type_k == 'f16' else type_k}_").dtype == (
        np.uint8 if type_k.startswith("q") else np.float32)
