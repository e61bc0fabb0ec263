"""SparseState in the engine: selections reused across steps, anchors fresh when read, prefill
decay and chunking, anchor storage, load() options, reports and heatmaps."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import pyimp
import pyimp.sparse.policy as policy
from pyimp.kv.cache import KVCache
from pyimp.sparse import AnchorType, compute_anchors
from pyimp.attention.importance import decay_importance
from pyimp.sparse.policy import SparseOptions, SparseState
from tools.write_synthetic_gguf import SynthSpec, prompt_ids, write

B = 4            # block length of every engine here
N_VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 3 global layers (all sparse-eligible), GQA with G = 2
    spec = SynthSpec(arch="llama", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128,
                     vocab_size=N_VOCAB, rope_base=10000.0, seed=5)
    return write(tmp_path_factory.mktemp("policy") / "llama.gguf", spec)


def _ids(n, seed=0):
    return prompt_ids(n, seed, N_VOCAB)


def _engine(model, n_ctx=128, batch_size=64, **sparse):
    return pyimp.load(model, n_ctx=n_ctx, block_len=B, batch_size=batch_size, kv_type="f32", **sparse)


# --------------------------------------------------------------------------
# item 1: token_step > 1 reuses a selection; newer blocks and the own token are always attended
# --------------------------------------------------------------------------


def test_reused_selection_attends_every_block_started_since(model):
    n0, steps = 41, 14                       # 10 full blocks + 1 token; decode crosses 3 blocks
    eng = _engine(model, sparse=True, anchor="quest", retrieval="layer", init_blocks=1, topk=1,
                  local_blocks=0, token_step=3, report=True)
    ids = _ids(n0 + steps)
    eng.eval(ids[:n0])
    sparse_layers = eng.sparse.sparse_layers
    assert sparse_layers == [0, 1, 2]
    made_at = {}                              # step -> logical blocks when its selection was made
    for i in range(steps):
        eng.eval([ids[n0 + i]])
        n_ctx = n0 + i + 1
        own_lb = (n_ctx - 1) // B
        bt = eng.cache.table(0)
        for il in sparse_layers:
            # the decoded token received attention mass on every sparse layer (its own row)
            assert eng.sparse.importance_[il, bt[own_lb], (n_ctx - 1) % B].astype(np.float32).sum() > 0
        made_at.setdefault(i - i % 3, -(-n_ctx // B))
    by_step = {}
    for step, il, blocks in eng.sparse.selections:
        by_step.setdefault(step, []).append((il, blocks))
    assert sorted(by_step) == list(range(steps))
    for step, recs in by_step.items():
        n_ctx = n0 + step + 1
        n_lb = -(-n_ctx // B)
        first = made_at[step - step % 3]      # blocks that existed when the selection was made
        for il, blocks in recs:
            assert n_lb - 1 in blocks                        # the query's own block
            assert set(range(first - 1, n_lb)) <= set(blocks)  # and every block started since
            assert max(blocks) < n_lb


# --------------------------------------------------------------------------
# items 2 and 4: the anchors retrieval reads equal a full recomputation at that moment
# --------------------------------------------------------------------------


@pytest.mark.parametrize("anchor,token_step,decay", [
    ("quest", 1, 1.0), ("block_mean", 2, 1.0), ("dynamic", 1, 1.0), ("dynamic", 3, 1.0),
    ("dynamic", 2, 0.9), ("fixed", 1, 0.9)])
def test_anchors_read_by_retrieval_are_fresh(model, monkeypatch, anchor, token_step, decay):
    """local_blocks = 0, so a block that fills during decode is a candidate the next time
    retrieval runs; a DYNAMIC block's anchor follows the importance its tokens gain."""
    n0, steps = 37, 13                       # the decode fills blocks 9, 10 and 11
    eng = _engine(model, sparse=True, anchor=anchor, anchor_num=2 if anchor != "quest" else 0,
                  retrieval="kvhead", init_blocks=1, topk=2, local_blocks=0,
                  token_step=token_step, layer_step=2, decay=decay)
    st = eng.sparse
    atype = AnchorType(anchor)
    current = {}
    inner_attn = st.decode_attention

    def decode_attention(il, q, n_ctx, scale, window, out, sparse=None):
        current["layer"], current["n_ctx"] = il, n_ctx
        inner_attn(il, q, n_ctx, scale, window, out, sparse)

    inner_retrieve = policy.retrieve_unchecked
    checked = []

    def retrieve_blocks(q, anchor_buf, bt, n_ctx, *args):
        il = current["layer"]
        assert n_ctx == current["n_ctx"]
        F, n_lb = n_ctx // B, -(-n_ctx // B)
        want = np.zeros_like(anchor_buf)
        lbs = np.arange(n_lb)
        compute_anchors(atype, eng.cache.k_layer(il), bt[lbs], np.minimum(B, n_ctx - lbs * B),
                        want, st.importance_[il])
        # bit for bit, every block: the candidates (full blocks; with local_blocks = 0 a block
        # that just filled is one unless it holds the query's own token) and the rest
        assert np.array_equal(anchor_buf[bt[:n_lb]], want[bt[:n_lb]]), (anchor, F, il)
        checked.append((il, n_ctx))
        return inner_retrieve(q, anchor_buf, bt, n_ctx, *args)

    monkeypatch.setattr(st, "decode_attention", decode_attention)
    monkeypatch.setattr(policy, "retrieve_unchecked", retrieve_blocks)
    ids = _ids(n0 + steps, seed=3)
    eng.eval(ids[:n0])
    for t in ids[n0:]:
        eng.eval([t])
    # retrieval ran on the lead layers (0 and 2 with layer_step 2) every token_step steps,
    # including the steps right after blocks 9, 10 and 11 filled
    runs = sorted({n for _, n in checked})
    assert {il for il, _ in checked} == {0, 2}
    assert runs == [n0 + 1 + s for s in range(0, steps, token_step)]


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_dynamic_refresh_recomputes_only_changed_blocks(model, monkeypatch, decay):
    """DYNAMIC, decay 1: a retrieval recomputes only the blocks attended since the last one
    (their importance changed) and the block of the newest token; decay != 1: every block."""
    n0, steps = 61, 6                         # 15 full blocks + 1 token
    eng = _engine(model, sparse=True, anchor="dynamic", retrieval="layer", init_blocks=1, topk=1,
                  local_blocks=1, decay=decay)
    ids = _ids(n0 + steps, seed=4)
    eng.eval(ids[:n0])
    sizes = []
    inner = policy.compute_anchors

    def compute_anchors(atype, kc, blocks, n_valid, anchor, imp=None):
        sizes.append(len(blocks))
        inner(atype, kc, blocks, n_valid, anchor, imp)

    monkeypatch.setattr(policy, "compute_anchors", compute_anchors)
    for t in ids[n0:]:
        eng.eval([t])
    n_layers = len(eng.sparse.anchor_.layers)
    assert len(sizes) == steps * n_layers     # one refresh per retrieval, before it
    if decay == 1.0:
        # the first step: the newest token's block only; later the previous step's sink, pick,
        # local block and tail, and the newest token's block (a new one once the tail filled)
        assert sizes[:n_layers] == [1] * n_layers
        assert max(sizes) <= 5 < -(-n0 // B)
    else:
        # after the first step (prefill left every anchor fresh) every block of the context
        assert sizes == [1] * n_layers + [-(-(n0 + i + 1) // B) for i in range(1, steps)
                                          for _ in range(n_layers)]


def test_uniform_decay_can_reorder_a_blocks_tokens():
    """Why a decay != 1 refreshes every DYNAMIC anchor: fp16(d*x) can tie fp16(d*y) for x > y,
    and ties go to the lower position, so an unattended block's hottest token can change."""
    d = np.float32(0.9)
    x = np.arange(1024, 4096, dtype=np.uint16).view(np.float16)      # fp16 values in [2**-14, 2**-12)
    dx = (d * x.astype(np.float32)).astype(np.float16)
    i = int(np.flatnonzero(dx[1:] == dx[:-1])[0])                     # x[i] < x[i+1], same image
    imp = np.zeros((1, 4, 1), np.float16)
    imp[0, 0, 0], imp[0, 1, 0] = x[i], x[i + 1]                       # the later token is hotter
    keys = np.zeros((1, 1, 4 * 2), np.float32)
    keys[0, 0, :2], keys[0, 0, 2:4] = [1, 0], [0, 1]                  # token 0 -> e0, token 1 -> e1
    anchor = np.zeros((1, 1, 1, 2), np.float16)
    compute_anchors(AnchorType.DYNAMIC, keys, [0], [2], anchor, imp)
    assert anchor[0, 0, 0].tolist() == [0, 1]                         # token 1 is the hottest
    decay_importance(imp, np.zeros(1, np.int32), 2, float(d))
    compute_anchors(AnchorType.DYNAMIC, keys, [0], [2], anchor, imp)
    assert anchor[0, 0, 0].tolist() == [1, 0]                         # now a tie: token 0 wins


# --------------------------------------------------------------------------
# item 5: anchor storage only where read, per kv head for the shared types
# --------------------------------------------------------------------------


def _cfg(L, Hq, Hkv, D, swa=()):
    return SimpleNamespace(n_layer=L, n_head=Hq, n_head_kv=Hkv, head_dim=D,
                           is_swa=lambda il: il in swa)


@pytest.mark.parametrize("anchor,layer_step,heads", [("quest", 1, "kv"), ("block_mean", 2, "kv"),
                                                     ("dynamic", 1, "q"), ("dynamic", 3, "q")])
def test_anchor_storage_and_view(anchor, layer_step, heads):
    L, Hq, Hkv, D, n_ctx = 7, 8, 2, 4, 50
    cfg = _cfg(L, Hq, Hkv, D, swa=(1, 4))
    cache = KVCache(L, Hkv, D, n_ctx, block_len=B)
    opts = SparseOptions(enabled=True, anchor=anchor, anchor_num=2, layer_step=layer_step,
                         dense_layers=(5,))
    st = SparseState(opts, cfg, cache)
    eligible = [0, 2, 3, 6]
    assert st.sparse_layers == eligible
    leads = eligible[::layer_step]
    assert st.anchor_.layers == leads
    NB = cache.max_blocks
    Ha = Hkv if heads == "kv" else Hq
    assert st.anchor_.nbytes == len(leads) * NB * 2 * Ha * D * 2
    assert SparseState.bytes_needed(opts, cfg, NB, B) == st.importance_.nbytes + st.anchor_.nbytes
    # importance_ stays on every layer
    assert st.importance_.shape == (L, NB, B, Hq)
    # tracking only: importance, no anchors at all
    track = SparseOptions(track=True, anchor=anchor, anchor_num=2)
    assert SparseState(track, cfg, cache).anchor_.nbytes == 0
    assert SparseState.bytes_needed(track, cfg, NB, B) == st.importance_.nbytes
    # the documented view: [L][NB][A][Hq][D]
    rng = np.random.default_rng(0)
    cache.reserve(n_ctx)
    for il in range(L):
        cache.write(il, rng.standard_normal((n_ctx, Hkv, D)).astype(np.float32),
                    rng.standard_normal((n_ctx, Hkv, D)).astype(np.float32), 0)
    cache.commit(n_ctx)
    st.importance_[:] = rng.uniform(0, 3, st.importance_.shape).astype(np.float16)
    st.after_prefill(n_ctx)
    assert st.anchor_.shape == (L, NB, 2, Hq, D)
    bt = cache.table(0)
    lbs = np.arange(-(-n_ctx // B))
    for il in range(L):
        view = st.anchor_[il]
        assert view.shape == (NB, 2, Hq, D) and view.dtype == np.float16
        assert not view.flags.writeable
        if il not in leads:
            assert not view.any()                    # never computed, no memory behind it
            continue
        want = np.zeros((NB, 2, Hq, D), np.float16)  # the per-query-head layout, computed directly
        compute_anchors(AnchorType(anchor), cache.k_layer(il), bt[lbs],
                        np.minimum(B, n_ctx - lbs * B), want, st.importance_[il])
        assert np.array_equal(view, want)
        assert np.array_equal(st.anchor_[il, 3, 1], want[3, 1])
        g = st.anchor_.grouped(il)
        assert g.shape == (NB, 2, Hkv, Hq // Hkv, D)
        assert np.array_equal(g.reshape(NB, 2, Hq, D), want)
    assert np.asarray(st.anchor_).shape == (L, NB, 2, Hq, D)


# --------------------------------------------------------------------------
# item 6
# --------------------------------------------------------------------------


def test_selection_history_is_bounded(model, monkeypatch):
    monkeypatch.setattr(policy, "SELECTION_HISTORY", 3)
    eng = _engine(model, sparse=True, topk=1, init_blocks=1, local_blocks=1, track=True)
    ids = _ids(30)
    eng.eval(ids[:20])
    for t in ids[20:]:
        eng.eval([t])
    sel = list(eng.sparse.selections)
    # the last 3 decode steps (7, 8, 9) of each of the 3 sparse layers
    assert len(sel) == 9 and sorted({s for s, _, _ in sel}) == [7, 8, 9]


def test_zero_budget_attends_the_own_block(model):
    eng = _engine(model, sparse=True, topk=0, init_blocks=0, local_blocks=0, report=True)
    ids = _ids(30)
    eng.eval(ids[:20])
    for t in ids[20:]:
        logits = eng.eval([t])
        assert np.isfinite(logits).all()
    for step, il, blocks in eng.sparse.selections:
        n_ctx = 21 + step
        assert blocks == [(n_ctx - 1) // B]       # exactly the block holding the query's token
    rep = eng.sparse.report()
    # attended real tokens: the own block's valid tokens, (n_ctx - 1) % B + 1 of n_ctx per step
    tokens = sum((n - 1) % B + 1 for n in range(21, 31))
    assert rep["layers"]["0"]["attended_fraction"] == round(tokens / sum(range(21, 31)), 6)
    for v in rep["layers"].values():
        assert 0.0 < v["recall"] <= 1.0 + 1e-6


def test_attended_fraction_counts_real_tokens(model):
    eng = _engine(model, sparse=True, retrieval="layer", topk=1, init_blocks=1, local_blocks=1,
                  report=True)
    ids = _ids(43)
    eng.eval(ids[:42])
    eng.eval([ids[42]])                       # 43 tokens: 10 full blocks + a 3-token tail
    rep = eng.sparse.report()
    # sink + 1 pick + 1 local full block (12 tokens) + the 3-token tail, of 43
    for il in ("0", "1", "2"):
        assert rep["layers"][il]["attended_fraction"] == round(15 / 43, 6)


def test_load_merges_sparse_options(model):
    eng = pyimp.load(model, n_ctx=64, block_len=B,
                     sparse=SparseOptions(enabled=True, anchor="block_mean", local_blocks=3), topk=4)
    o = eng.options.sparse
    assert (o.enabled, o.anchor, o.local_blocks, o.topk) == (True, "block_mean", 3, 4)
    assert eng.sparse is not None and eng.sparse.sparse_layers == [0, 1, 2]
    eng = pyimp.load(model, n_ctx=64, block_len=B, sparse=True, topk=5)
    assert (eng.options.sparse.enabled, eng.options.sparse.topk) == (True, 5)
    with pytest.raises(TypeError, match="sparse must be a bool or a SparseOptions"):
        pyimp.load(model, n_ctx=64, sparse="quest")


def test_prefill_decay_applied_once_per_prefill(model):
    """decay * (importance before the prompt) + the prompt's mass, for any batch size."""
    p1, p2 = _ids(23, seed=1), _ids(30, seed=2)[1:]
    base = _engine(model, track=True, batch_size=64)
    base.eval(p1)
    i1 = base.sparse.importance_.astype(np.float64)
    base.eval(p2)
    mass2 = base.sparse.importance_.astype(np.float64) - i1          # the second prompt's mass
    got = {}
    for bs in (64, 5, 1):
        eng = _engine(model, track=True, decay=0.5, batch_size=bs)
        eng.eval(p1)
        eng.eval(p2)
        got[bs] = eng.sparse.importance_.astype(np.float64)
        assert eng.sparse.report()["decode_steps"] == 0             # no chunk ran as a decode step
        want = 0.5 * i1 + mass2
        # every entry is a few fp16 roundings (relative 2**-11 each) of values <= its inputs,
        # plus float32 differences of the chunked softmax sums (~1e-6)
        tol = 4 * 2**-11 * (np.abs(i1) + np.abs(i1 + mass2)) + 1e-5
        assert (np.abs(got[bs] - want) <= tol).all(), bs
    # and the decay really bit: sinks hold more than the tolerance of mass from the first prompt
    assert np.abs(got[64] - (i1 + mass2)).max() > 0.5


def test_one_token_last_chunk_is_prefill(model):
    """A prompt whose last chunk is one token is still prefilled (dense, no decode step)."""
    ids = _ids(41)
    cfg = dict(sparse=True, topk=1, init_blocks=1, local_blocks=1, report=True)
    a = _engine(model, batch_size=64, **cfg)
    la = a.eval(ids)
    b = _engine(model, batch_size=40, **cfg)          # chunks of 40 + 1
    lb = b.eval(ids)
    assert b.sparse.report()["decode_steps"] == 0
    # both prefills are dense: the same logits up to float32 summation order of the chunks
    np.testing.assert_allclose(lb, la, rtol=0, atol=1e-4 * np.abs(la).max())
    # and the importance matches to fp16 rounding (relative 2**-11, twice)
    np.testing.assert_allclose(b.sparse.importance_.astype(np.float64),
                               a.sparse.importance_.astype(np.float64), rtol=2**-10, atol=1e-4)


def test_report_without_sparse_says_tracking_only(model):
    eng = _engine(model, report=True)
    ids = _ids(20)
    eng.eval(ids[:19])
    eng.eval([ids[19]])
    rep = eng.sparse.report()
    assert rep["sparse_layers"] == [] and rep["mode"].startswith("tracking only")
    assert rep["layers"] == {} and rep["mean_recall"] is None
    assert rep["bytes"]["anchors"] == 0
    json.dumps(rep)


def test_heatmap_leaves_the_backend_alone(model, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "h.png"
    code = f"""
import sys, matplotlib
matplotlib.use("svg")
import pyimp
eng = pyimp.load({str(model)!r}, n_ctx=64, block_len={B}, sparse=True, topk=1, track=True)
eng.eval(list(range(3, 30)))
eng.eval([5])
from pyimp.cli.plotting import sparse_heatmap
sparse_heatmap(eng.sparse, {str(out)!r}, len(eng.tokens))
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
assert "matplotlib.pyplot" not in sys.modules
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recall_target_attends_more_for_a_higher_target(model):
    """--recall-target: a higher target attends at least as much context; target 1 attends
    every block with nonzero estimated mass and matches dense decode; the report shows the
    estimate beside the measured recall."""
    ids = _ids(100)
    res = {}
    for target in (0.3, 0.9, 1.0):
        eng = _engine(model, sparse=True, topk=1, recall_target=target, report=True)
        logits = eng.eval(ids)[-1]
        for _ in range(4):
            logits = eng.eval([int(np.argmax(logits))])[-1]
        r = eng.sparse.report()
        assert r["mean_estimated_recall"] >= min(target, 1.0) - 1e-9
        res[target] = (r["mean_attended_fraction"], r["mean_recall"], logits)
    assert res[0.3][0] <= res[0.9][0] <= res[1.0][0]
    assert res[1.0][0] == pytest.approx(1.0) and res[1.0][1] == pytest.approx(1.0, abs=1e-5)
    dense = _engine(model)
    d = dense.eval(ids)[-1]
    for _ in range(4):
        d = dense.eval([int(np.argmax(d))])[-1]
    # every block attended: the block-sparse kernel equals dense to float32 reassociation
    np.testing.assert_allclose(res[1.0][2], d, atol=1e-4 * np.abs(d).max())


@pytest.mark.parametrize("kw,flag", [(dict(recall_target=0.9), "--recall-target"),
                                     (dict(select="lowrank"), "--select lowrank")])
def test_device_path_refuses_cpu_only_selection(kw, flag):
    """The device path selects a fixed top-k by the anchors: a recall target or another
    selection mode there would be silently ignored, so it is refused, naming the flag."""
    from pyimp.engine import EngineOptions
    from pyimp.sparse.policy import SparseOptions
    opts = EngineOptions(device="cuda", sparse=SparseOptions(enabled=True, **kw))
    with pytest.raises(ValueError, match=f"{flag} runs on the CPU only"):
        opts.validate()
    EngineOptions(device="cpu", sparse=SparseOptions(enabled=True, **kw)).validate()


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_decode_anchor_refresh_uses_the_warmed_specialization(model, monkeypatch, kv_type):
    """The compiled anchors (anchors._anchor_rows) see in a decode step only argument types that
    Engine.warmup already gave them: a new specialization would be compiled or loaded inside
    the first decode step after a prefill (5.7 ms at 16k when the block table's int32 ids
    reached it)."""
    import numba

    from pyimp.sparse import anchors
    seen = {"now": None, "warm": set(), "run": set()}
    inner = anchors._anchor_rows

    def recording(*args):
        seen[seen["now"]].add(tuple(numba.typeof(a) for a in args))
        return inner(*args)

    monkeypatch.setattr(anchors, "_anchor_rows", recording)
    eng = pyimp.load(model, n_ctx=128, block_len=B, kv_type=kv_type, sparse=True,
                     anchor="block_mean", init_blocks=1, topk=2, local_blocks=1)
    seen["now"] = "warm"
    eng.warmup()
    seen["now"] = "run"
    ids = _ids(60, seed=7)
    eng.eval(ids[:50])
    for t in ids[50:]:
        eng.eval([t])
    assert seen["run"] and seen["run"] <= seen["warm"], (seen["run"], seen["warm"])


def test_the_step_decides_each_layers_path_once(model):
    """A decode step's block-sparse-or-dense decision is made once, at the top of the forward
    (the engine's Step), and reaches the sparse state's decode attention as made: the same as
    is_sparse_step for the slots each layer holds, dense while every block fits the budget,
    sparse on the lead layers after."""
    eng = _engine(model, sparse=True, topk=1, init_blocks=1, local_blocks=1)
    st = eng.sparse
    seen = []
    inner = st.decode_attention

    def decode_attention(il, q, n_ctx, scale, window, out, sparse=None):
        assert sparse is not None                    # the engine passes its decision
        seen.append((il, n_ctx, sparse, st.is_sparse_step(il, n_ctx)))
        inner(il, q, n_ctx, scale, window, out, sparse)
    st.decode_attention = decode_attention
    ids = _ids(40, seed=5)
    eng.eval(ids[:2])
    for t in ids[2:]:
        eng.eval([t])
    assert seen and all(decided == own for _, _, decided, own in seen)
    assert {d for _, _, d, _ in seen} == {False, True}
