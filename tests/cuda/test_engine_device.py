"""End to end on the simulator: tiny synthetic models with device="cuda" against the CPU engine,
prefill + decode steps, dense and sparse. Logits agree to float32 accumulation order (tolerance
below); importance_ to one fp16 ulp."""
import numpy as np
import pytest

import pyimp
from pyimp.sparse.anchors import AnchorType, compute_anchors
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
        # head dim 32: quantized K needs a multiple of 32
        "llama-hd32": write(d / "l32.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4,
                                                      n_head_kv=2, head_dim=32, n_ff=128,
                                                      vocab_size=260, weight_type="Q8_0")),
        "gemma3-q5_0": write(d / "g.gguf", SynthSpec(arch="gemma3", n_layer=2, n_embd=64, n_head=4,
                                                     n_head_kv=1, head_dim=16, n_ff=128,
                                                     vocab_size=260, sliding_window=6,
                                                     swa_pattern=2, final_softcap=30.0,
                                                     weight_type="Q5_0", embd_type="Q8_0",
                                                     random_blocks=True)),
        # qwen2: q/k/v biases (added on the device after each projection), NEOX RoPE
        "qwen2-q8_0": write(d / "q2.gguf", SynthSpec(arch="qwen2", n_layer=2, n_embd=64, n_head=4,
                                                     n_head_kv=2, n_ff=128, vocab_size=260,
                                                     weight_type="Q8_0", tied_output=False)),
        # qwen3: per-head q/k norms without gemma3's post-norms
        "qwen3-q8_0": write(d / "q3.gguf", SynthSpec(arch="qwen3", n_layer=2, n_embd=64, n_head=4,
                                                     n_head_kv=2, head_dim=32, n_ff=128,
                                                     vocab_size=260, weight_type="Q8_0")),
        # phi3: fused attn_qkv and gate+up (row parts), 8 of 16 dims rotated, long RoPE factors
        # and an attention factor, q scaled before attention
        "phi3-q8_0": write(d / "p3.gguf", SynthSpec(arch="phi3", n_layer=2, n_embd=64, n_head=4,
                                                    n_head_kv=4, head_dim=16, n_ff=128,
                                                    vocab_size=260, weight_type="Q8_0",
                                                    tied_output=False, rope_dim=8,
                                                    rope_factors=True, rope_ctx_orig=32,
                                                    rope_attn_factor=1.1)),
    }


def _run(path, device, n_prompt=9, steps=3, **kw):
    """Logits of a prompt and ``steps`` greedy decode steps, importance_, the engine; on the
    device, ``eng.step_counts`` holds what each decode step asked of the device
    (:func:`pyimp.cuda.device.counting`)."""
    eng = pyimp.load(path, n_ctx=64, block_len=4, device=device, **kw)
    ids = prompt_ids(n_prompt, n_vocab=260)
    rows = [eng.eval(ids)[-1]]
    eng.step_counts = []
    for t in range(steps):
        tok = int(np.argmax(rows[-1]))
        if device == "cuda":
            from pyimp.cuda import device as dev
            with dev.counting() as c:
                rows.append(eng.eval([tok])[-1])
            eng.step_counts.append(c)
        else:
            rows.append(eng.eval([tok])[-1])
    imp = eng.sparse.importance_ if eng.sparse is not None else None
    return np.array(rows), imp, eng


def _check_fused_counts(eng, n_prompt, block_len=4):
    """A dense decode step of the fused path (pyimp.cuda.decode): 6 launches a layer + embed +
    head; no device allocation; to the device only the token id, the step record on the first
    step after the prompt, and a block-table entry when the token opens a block."""
    L = eng.cfg.n_layer
    for t, c in enumerate(eng.step_counts):
        pos = n_prompt + t
        assert c.launches == 6 * L + 2, (t, c.as_dict())
        assert c.allocations == 0, (t, c.as_dict())
        assert c.h2d == 1 + (t == 0) + (pos % block_len == 0), (t, c.as_dict())
        assert c.d2h == 1, (t, c.as_dict())                # the logits row


@pytest.mark.parametrize("name", ["llama-q8_0", "llama-q4_0", "gemma3-q5_0", "qwen2-q8_0",
                                  "qwen3-q8_0", "phi3-q8_0"])
def test_dense_matches_cpu(models, name):
    cpu, _, _ = _run(models[name], "cpu")
    gpu, _, eng = _run(models[name], "cuda")
    assert eng.cache.k_cache_fp16_.shape[0] == 2       # [L][Hkv][NB][B*D], on the device
    np.testing.assert_allclose(gpu, cpu, atol=LOGIT_RTOL * np.abs(cpu).max(), rtol=0)
    _check_fused_counts(eng, n_prompt=9)


@pytest.mark.parametrize("n_prompt", [9, 17])
def test_fused_importance_matches_cpu(models, n_prompt):
    """A sparse engine with no observer: its dense decode steps (9-token prompt: the context
    within the block budget) and its block-sparse ones (17 tokens: a retrieval per layer each
    step) run the fused attention launch, which adds the step's importance_."""
    kw = dict(sparse=True, anchor="quest", topk=2 if n_prompt == 9 else 1, init_blocks=1,
              local_blocks=1)
    # llama: gemma3's sliding-window layers drop blocks on the CPU (not on the device), so
    # its importance_ rows sit in other physical blocks there
    cpu, imp_cpu, ceng = _run(models["llama-q8_0"], "cpu", n_prompt=n_prompt, **kw)
    gpu, imp_gpu, eng = _run(models["llama-q8_0"], "cuda", n_prompt=n_prompt, **kw)
    # the fused K store keeps the anchors of the block its key joined fresh: every block's
    # anchors (the partial tail's included) are the CPU anchor code's over the device's own
    # keys, bit for bit (its keys differ from the CPU engine's by float32 rounding)
    n = n_prompt + 3
    n_lb = -(-n // 4)
    assert eng.sparse.anchor_.layers
    for il in eng.sparse.anchor_.layers:
        blocks = eng.cache.table(il)[:n_lb]
        got = eng.sparse.anchor_.storage(il).copy_to_host()
        want = np.zeros_like(got)
        compute_anchors(AnchorType.QUEST, eng.cache.k_layer(il).copy_to_host(), blocks,
                        np.minimum(4, n - 4 * np.arange(n_lb)), want, backend="numpy")
        np.testing.assert_array_equal(got[blocks], want[blocks])
    np.testing.assert_allclose(gpu, cpu, atol=LOGIT_RTOL * np.abs(cpu).max(), rtol=0)
    g, c = imp_gpu.astype(np.float32), imp_cpu.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(c)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - c) <= ulp)
    bt = eng.cache.table(0)
    for p in range(n_prompt, n_prompt + 3):   # decoded tokens' mass comes from decode steps only
        assert (g[:, bt[p // 4], p % 4, :] > 0).all(), p
    if n_prompt == 9:
        _check_fused_counts(eng, n_prompt=9)
        return
    L = eng.cfg.n_layer
    for t, c in enumerate(eng.step_counts):
        # per layer: the 6 fused launches (the K store refreshes its block's anchors) + the
        # retrieval (scores and selection in one launch)
        assert c.launches == 7 * L + 2, (t, c.as_dict())
        if t == 0:  # the retrieval's buffers are made (zero-filled) at its first use
            continue
        assert c.allocations == 0, (t, c.as_dict())
        # the token id and a new block's table entry: no anchor block ids
        assert c.h2d == 1 + ((n_prompt + t) % 4 == 0), (t, c.as_dict())


@pytest.mark.parametrize("kw", [{}, dict(sparse=True, anchor="quest", topk=2, init_blocks=1,
                                          local_blocks=1)], ids=["plain", "importance"])
def test_graph_replay_matches_eager(models, monkeypatch, kw):
    """The decode step replayed from one capture (the simulator's emulation: the launches
    recorded once with their arguments, run again each token) gives the eager step's logits
    and importance_ bit for bit over 6 tokens that cross a block boundary: nothing a step
    launches depends on a value the host passes per token."""
    eager, imp_e, _ = _run(models["gemma3-q5_0"], "cuda", steps=6, **kw)
    monkeypatch.setenv("PYIMP_CUDA_GRAPHS", "sim")
    graph, imp_g, eng = _run(models["gemma3-q5_0"], "cuda", steps=6, **kw)
    plan = eng._backend.plan
    # step 1 eager (compiles), step 2 captured and replayed, steps 3-6 replayed
    assert plan.graph_error is None and plan.replays == 5
    np.testing.assert_array_equal(graph, eager)
    if kw:
        np.testing.assert_array_equal(imp_g, imp_e)


def test_sparse_matches_cpu(models):
    kw = dict(sparse=True, anchor="quest", topk=1, init_blocks=1, local_blocks=1, track=True)
    cpu, imp_cpu, _ = _run(models["llama-q8_0"], "cpu", n_prompt=17, steps=3, **kw)
    gpu, imp_gpu, eng = _run(models["llama-q8_0"], "cuda", n_prompt=17, steps=3, **kw)
    np.testing.assert_allclose(gpu, cpu, atol=LOGIT_RTOL * np.abs(cpu).max(), rtol=0)
    g, c = imp_gpu.astype(np.float32), imp_cpu.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(c)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - c) <= ulp)
    assert eng.sparse.stats.steps == 3 and eng.sparse.report()["mode"] == "sparse"


# Quantized KV: both engines quantize their own float32 K/V, which differ in the last bits
# (the same math in another order). A value within those last bits of a rounding boundary of
# the quantizer is stored at neighbouring levels by the two engines (a level flip; or a block's
# scale d = amax / 127 rounds to the other fp16 neighbour: every element of the block moves by
# one ulp of d). Where that happens depends on the host's arithmetic on the CPU side (one q8_0
# V block of layer 1 on every run on one AMD EPYC znver4 host; one event in the sparse q4_0 K /
# q8_0 V case on another AMD EPYC host with AVX-512), and one q4_0 level of a layer-0 key,
# injected on the CPU, moves the logits by up to 0.11 of the largest |logit| and up to 107
# importance_ entries by more than an fp16 ulp: no tolerance on the logits separates such an
# event from a wrong kernel. So the device engine is checked twice:
# - its stored K/V against the CPU engine's own (_flips: rounding events; at most 3);
# - everything it computes against a CPU engine that stores, for each row it writes, the value
#   the device stored in that forward (_Adopting: the quantizer's bytes are the same for the
#   same input, kvblocks), so the two differ in float32 arithmetic only. Measured on the
#   simulator over the cases below (q8_0, q4_0, prefix reuse, sparse q4_0 K / q8_0 V): logits
#   at most 4.9e-7 of the largest |logit| apart, importance_ equal, the same selections;
#   QUANT_RTOL leaves 10x of margin. Without rounding events the CPU engine's own run is held
#   to the same bound (measured 4.6e-7).
QUANT_RTOL = 5e-6


def _flips(cpu, gpu):
    """Rounding events between the two engines' caches (dequantized K and V, every layer): the
    elements stored more than float noise apart (1e-5 of the layer's largest |value|; a
    quantization level is 1/127 of a block's largest |value| at q8_0), where a quantization
    block (32 consecutive elements of a head's token row) whose differing elements are all
    one common multiple of the other engine's (its scale rounded the other way) counts once."""
    n = 0
    for il in range(cpu.cfg.n_layer):
        for a, b in zip(cpu.cache.gather(il), gpu.cache.gather(il)):
            far = np.abs(a - b) > 1e-5 * np.abs(a).max()          # [Hkv, T, D]
            for blk in zip(*np.nonzero(far.reshape(*far.shape[:-1], -1, 32).any(axis=-1))):
                h, t, j = (int(i) for i in blk)
                fa, fb = a[h, t, 32 * j:32 * j + 32], b[h, t, 32 * j:32 * j + 32]
                moved = far[h, t, 32 * j:32 * j + 32]
                ratio = fa[moved] / np.where(fb[moved] == 0, np.nan, fb[moved])
                scale_flip = moved.sum() > 1 and np.allclose(ratio, ratio[0], rtol=1e-5, atol=0)
                n += 1 if scale_flip else int(moved.sum())
    return n


def _stored(eng):
    """What every layer stores: [(K, V)] float32 [Hkv, n, D] (quantized rows dequantized)."""
    return [eng.cache.gather(il) for il in range(eng.cfg.n_layer)]


class _Adopting:
    """A CPU engine whose cache writes, for the rows of each forward, the values the device
    engine stored in its forward of the same index (``stored[i]``, :func:`_stored` after it):
    dequantized values quantize back to the same bytes, rows in the float tail are copied."""

    def __init__(self, path, stored, **kw):
        self.eng = pyimp.load(path, n_ctx=64, block_len=4, device="cpu", **kw)
        self.stored, self.i = stored, 0
        write = self.eng.cache.write

        def write_stored(layer, k, v, pos0, seq=0):
            K, V = self.stored[self.i][layer]
            rows = slice(pos0, pos0 + k.shape[0])
            write(layer, K[:, rows].transpose(1, 0, 2), V[:, rows].transpose(1, 0, 2), pos0, seq)
        self.eng.cache.write = write_stored

    def forward(self, call, *args):
        """One forward (an eval or a prime: one chunk each here); then its cache holds what the
        device engine's held after the same forward, bit for bit."""
        out = call(*args)[-1]
        for (k, v), (K, V) in zip(_stored(self.eng), self.stored[self.i]):
            np.testing.assert_array_equal(k, K)
            np.testing.assert_array_equal(v, V)
        self.i += 1
        return out


def _device_run(path, ids, steps, **kw):
    """The device engine: prefill ids, greedy decode; (rows, what it stored after each forward,
    its engine)."""
    eng = pyimp.load(path, n_ctx=64, block_len=4, device="cuda", **kw)
    rows, stored = [eng.eval(ids)[-1]], []
    stored.append(_stored(eng))
    for _ in range(steps):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
        stored.append(_stored(eng))
    return np.array(rows), stored, eng


@pytest.fixture
def selections(monkeypatch):
    """Every sparse step's selection, per engine run: (layer, n_ctx, each set's blocks)."""
    from pyimp.sparse.policy import DecodeStats
    seen = []
    add = DecodeStats.add

    def record(self, il, n_ctx, block_len, sel, cnt, recall, est=None):
        seen.append((il, n_ctx, [sel[s, :cnt[s]].tolist() for s in range(sel.shape[0])]))
        return add(self, il, n_ctx, block_len, sel, cnt, recall, est)
    monkeypatch.setattr(DecodeStats, "add", record)
    return seen


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=QUANT_RTOL * np.abs(want).max())


def _importance_close(g, c):
    """importance_: one fp16 ulp (sums of the same attention weights in another order)."""
    g, c = g.astype(np.float32), c.astype(np.float32)
    ulp = np.spacing(np.maximum(np.abs(g), np.abs(c)).astype(np.float16)).astype(np.float32)
    assert np.all(np.abs(g - c) <= ulp)


def _prime_ids(ids):
    """A prefix of 7 tokens (inside block 1, quantized by now: the kept tokens are dequantized
    into the tail), then 3 new tokens."""
    return list(ids[:7]) + [11, 12, 13]


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_quantized_kv_matches_cpu(models, kv):
    """Dense prefill + decode with quantized K and V on the device (quantized there, read by the
    kernels), then a prefix reuse that rewinds into a quantized block: the stored K/V against
    the CPU engine's, the logits against the CPU engine that stores the device's rows."""
    path, ids = models["llama-hd32"], prompt_ids(9, n_vocab=260)
    gpu, stored, ge = _device_run(path, ids, 3, kv_type=kv)
    assert getattr(ge.cache, f"k_cache_{kv}_").dtype == np.uint8 and ge.cache.quantized
    cpu, _, ce = _run(path, "cpu", kv_type=kv)
    flips = _flips(ce, ge)
    assert flips <= 3, f"{flips} cache rounding events: more than rounding boundaries explain"
    primed_gpu, primed_cpu = ge.prime(_prime_ids(ids))[-1], ce.prime(_prime_ids(ids))[-1]
    assert ge.timings.extra["prefix_reused"] == 7
    stored.append(_stored(ge))
    flips_primed = _flips(ce, ge)
    assert flips_primed <= 3, f"{flips_primed} cache rounding events after the prefix reuse"
    if flips == 0:
        _close(gpu, cpu)
    if flips_primed == 0:
        _close(primed_gpu, primed_cpu)
    ref = _Adopting(path, stored, kv_type=kv)
    rows = [ref.forward(ref.eng.eval, ids)]
    rows += [ref.forward(ref.eng.eval, [int(np.argmax(r))]) for r in gpu[:-1]]
    _close(gpu, np.array(rows))
    primed = ref.forward(ref.eng.prime, _prime_ids(ids))
    assert ref.eng.timings.extra["prefix_reused"] == 7
    _close(primed_gpu, primed)


def test_quantized_sparse_matches_cpu(models, selections):
    """Block-sparse decode over a q4_0 K / q8_0 V cache: anchors of the dequantized keys,
    retrieval, sparse attention, importance and the recall diagnostic (a dense decode) on the
    device. Against the CPU engine that stores the device's rows: the same selections in every
    step, layer and set, logits, importance_ and recall; against the CPU engine's own run: the
    stored K/V (rounding events counted), and everything else where none happened."""
    kw = dict(cache_type_k="q4_0", cache_type_v="q8_0", sparse=True, anchor="quest", topk=1,
              init_blocks=1, local_blocks=1, track=True, report=True)
    path, ids = models["llama-hd32"], prompt_ids(17, n_vocab=260)
    gpu, stored, ge = _device_run(path, ids, 3, **kw)
    sel_gpu = list(selections)
    selections.clear()
    ref = _Adopting(path, stored, **kw)
    rows = [ref.forward(ref.eng.eval, ids)]
    rows += [ref.forward(ref.eng.eval, [int(np.argmax(r))]) for r in gpu[:-1]]
    sel_ref = list(selections)
    selections.clear()
    # 3 steps x 2 layers x 2 sets (kvhead retrieval), each a real choice (topk 1 of 2 or 3)
    assert len(sel_gpu) == 6 and sel_ref == sel_gpu
    _close(gpu, np.array(rows))
    _importance_close(ge.sparse.importance_, ref.eng.sparse.importance_)
    sr, sg = ref.eng.sparse.stats, ge.sparse.stats
    assert sr.attended == sg.attended and sorted(sr.recall_n) == sorted(sg.recall_n)
    assert sr.recall_n, "no recall measured"
    for il in sr.recall_n:          # exp(lse_sparse - lse_dense): float32 noise
        np.testing.assert_allclose(sg.recall_sum[il], sr.recall_sum[il], rtol=1e-5)
    cpu, imp_cpu, ce = _run(path, "cpu", n_prompt=17, steps=3, **kw)
    flips = _flips(ce, ge)
    assert flips <= 3, f"{flips} cache rounding events: more than rounding boundaries explain"
    if flips == 0:
        assert list(selections) == sel_gpu
        _close(gpu, cpu)
        _importance_close(ge.sparse.importance_, imp_cpu)
    assert ge.sparse.stats.steps == 3 and ge.sparse.report()["mode"] == "sparse"


def test_device_refuses_quantized_v_by_channel(models):
    with pytest.raises(ValueError, match="v_layout='channel'"):
        pyimp.load(models["llama-hd32"], n_ctx=64, block_len=32, device="cuda",
                   cache_type_v="q8_0", v_layout="channel")


def test_a_bad_graph_flag_fails_the_load(models, monkeypatch):
    """PYIMP_CUDA_GRAPHS takes 0, 1 or sim: another value is one error at load naming it."""
    monkeypatch.setenv("PYIMP_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="PYIMP_CUDA_GRAPHS='yes'"):
        pyimp.load(models["llama-q8_0"], n_ctx=64, block_len=4, device="cuda")
