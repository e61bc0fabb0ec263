"""Eviction policies and the compacted (slot-space) KV cache: decisions, compaction, attention
over kept tokens, budgets and memory, and the engine end to end."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import count_sparse_steps, prefill_path

import pyimp
from pyimp.attention import attend as attention
from pyimp.kv.policy import (PolicyOptions, h2o_keep, pool1d, snapkv_keep, streaming_keep,
                             target_size, window_keep)
from pyimp.kv.cache import KVCache
from pyimp.kv.statefile import StateFileError
from tools.write_synthetic_gguf import SynthSpec, write
from tools.write_synthetic_gguf import prompt_ids as _ids

# --------------------------------------------------------------------------
# decisions
# --------------------------------------------------------------------------


def _check_common(keep, n, m, pos, sinks, recent, B):
    assert keep.size == m
    assert np.all(np.diff(keep) > 0) and (keep.size == 0 or (keep[0] >= 0 and keep[-1] < n))
    assert (n - m) % B == 0                                   # whole blocks leave
    kept = set(keep.tolist())
    assert all(s in kept for s in np.flatnonzero(pos < sinks))   # sinks
    assert all(s in kept for s in range(max(0, n - max(recent, n % B)), n))  # recent, partial block
    assert n - 1 in kept or n == 0                            # the current token


policy_case = st.tuples(st.integers(1, 300), st.integers(1, 8), st.integers(0, 6),
                        st.integers(0, 40), st.integers(0, 2**31 - 1))


@settings(deadline=None, max_examples=150)
@given(policy_case, st.integers(1, 200))
def test_h2o_and_streaming_decisions(case, budget_extra):
    n, B, sinks, recent, seed = case
    rng = np.random.default_rng(seed)
    budget = sinks + max(recent, B) + budget_extra
    pos = np.sort(rng.choice(3 * n + 5, n, replace=False)).astype(np.int32)
    m = target_size(n, budget, B)
    assert m == n if n <= budget else budget <= m < budget + B
    score = rng.integers(0, 5, n).astype(np.float64)         # many ties
    keep = h2o_keep(pos, score, sinks, recent, m, B)
    _check_common(keep, n, m, pos, sinks, recent, B)
    if m == n:
        assert np.array_equal(keep, np.arange(n))             # within budget: everything
    forced = (pos < sinks)
    forced[max(0, n - max(recent, n % B, 1)):] = True
    free_kept = np.setdiff1d(keep, np.flatnonzero(forced))
    dropped = np.setdiff1d(np.arange(n), keep)
    if free_kept.size and dropped.size:                     # heavy hitters beat the dropped
        assert score[free_kept].min() >= score[dropped].max()
    skeep = streaming_keep(pos, sinks, m, B)
    _check_common(skeep, n, m, pos, sinks, 0, B)
    others = np.setdiff1d(skeep, np.flatnonzero(pos < sinks))
    if others.size:                                         # the most recent of the rest
        assert np.array_equal(others, np.arange(n - others.size, n))


@settings(deadline=None, max_examples=100)
@given(policy_case, st.integers(1, 200), st.sampled_from([1, 3, 5, 7]))
def test_snapkv_decision_keeps_the_window_and_the_pooled_top(case, budget_extra, kernel):
    n, B, sinks, window, seed = case
    rng = np.random.default_rng(seed)
    budget = sinks + max(window, B) + budget_extra
    pos = np.arange(n, dtype=np.int32)
    m = target_size(n, budget, B)
    score = rng.uniform(0, 1, n)
    keep = snapkv_keep(pos, score, sinks, window, kernel, m, B)
    _check_common(keep, n, m, pos, sinks, window, B)
    pooled = pool1d(score, kernel)
    forced = pos < sinks
    forced[max(0, n - max(window, n % B, 1)):] = True
    free_kept = np.setdiff1d(keep, np.flatnonzero(forced))
    dropped = np.setdiff1d(np.arange(n), keep)
    if free_kept.size and dropped.size:
        assert pooled[free_kept].min() >= pooled[dropped].max()


def test_pool1d_is_a_centred_mean():
    s = np.array([1.0, 2, 3, 4, 5])
    np.testing.assert_allclose(pool1d(s, 3), [1.5, 2, 3, 4, 4.5])
    np.testing.assert_array_equal(pool1d(s, 1), s)


@settings(deadline=None, max_examples=100)
@given(st.integers(1, 200), st.integers(1, 64), st.integers(1, 8), st.integers(0, 50))
def test_window_trim_drops_only_unseen_whole_leading_blocks(n, W, B, gap):
    pos = np.arange(n, dtype=np.int32) + gap
    nxt = int(pos[-1]) + 1
    keep = window_keep(pos, nxt, W, B)
    assert keep.size == 0 or keep[-1] == n - 1
    assert (n - keep.size) % B == 0
    seen = pos >= nxt - W + 1                                # what the next query sees
    assert set(np.flatnonzero(seen)) <= set(keep.tolist())
    assert n - keep.size + B > int((~seen).sum()) or keep.size == n  # fewer than B stale kept


def test_layer_budgets():
    o = PolicyOptions("pyramidkv", budget=200, keep=4, obs_window=32)
    b = o.layer_budgets(6)
    assert np.all(np.diff(b) <= 0) and b[0] > b[-1]
    assert abs(b.mean() - 200) <= 1                         # the mean is the budget (rounding)
    assert np.array_equal(PolicyOptions("h2o", budget=100).layer_budgets(3), [100, 100, 100])


@settings(deadline=None, max_examples=200)
@given(st.lists(st.booleans(), min_size=1, max_size=30), st.integers(40, 5000),
       st.floats(1.0, 50.0), st.sampled_from(["h2o", "streaming", "snapkv"]))
def test_depth_ratio_budgets(profiled, budget, ratio, policy):
    """--kv-depth-ratio: the profiled layers' budgets fall linearly with depth from
    2R/(1+R) to 2/(1+R) of the budget, their mean is the budget (to rounding, half a token
    per layer), every other layer keeps the budget."""
    o = PolicyOptions(policy, budget=budget, depth_ratio=ratio)
    o.validate()
    b = o.layer_budgets(len(profiled), profiled)
    idx = np.flatnonzero(profiled)
    others = np.flatnonzero(~np.asarray(profiled))
    assert np.all(b[others] == budget)
    if idx.size < 2:
        assert np.all(b == budget)
        return
    p = b[idx]
    assert np.all(np.diff(p) <= 0)
    assert abs(p.mean() - budget) <= 0.5
    assert p[0] == round(budget * 2 * ratio / (1 + ratio))
    assert p[-1] == round(budget * 2 / (1 + ratio))
    # ratio 1 is the uniform budget exactly
    assert np.all(PolicyOptions(policy, budget=budget).layer_budgets(len(profiled), profiled)
                  == budget)


@pytest.mark.parametrize("kw, msg", [
    ({"policy": "h2o", "budget": 100, "depth_ratio": 0.5}, "depth ratio must be >= 1"),
    ({"policy": "h2o", "budget": 100, "depth_ratio": float("nan")}, "depth ratio must be >= 1"),
    ({"policy": "pyramidkv", "budget": 100, "depth_ratio": 2.0}, "own depth schedule"),
    ({"policy": "h2o", "budget": 100, "obs_weight": -1.0}, "observation weight must be"),
    ({"policy": "h2o", "budget": 100, "obs_weight": float("inf")}, "observation weight must be"),
    ({"policy": "snapkv", "budget": 100, "obs_weight": 1.0}, "applies to h2o"),
    ({"policy": "h2o", "budget": 100, "obs_weight": 1.0, "obs_window": 0}, "needs an observation"),
    ({"policy": "lru"}, "not one of"),
    ({"policy": "h2o"}, "needs a budget"),
    ({"policy": "streaming", "budget": 10, "keep": 4, "recent": 6}, "must exceed"),
    ({"policy": "snapkv", "budget": 100, "pool": 4}, "odd"),
])
def test_policy_options_refusals(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PolicyOptions(**kw).validate()


# --------------------------------------------------------------------------
# compaction: attention over the compacted cache == over the kept tokens
# --------------------------------------------------------------------------


def _filled(kv_type, n, B, Hkv, D, seed, n_ctx=None):
    rng = np.random.default_rng(seed)
    c = KVCache(1, Hkv, D, n_ctx or n + 64, block_len=B, kv_type=kv_type)
    for f in c._free:                                        # non-identity physical order
        rng.shuffle(f)
    k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
    done = 0
    while done < n:
        t = min(n - done, int(rng.integers(1, 2 * B + 1)))
        c.reserve(t)
        c.write(0, k[done:done + t], v[done:done + t], done)
        c.commit(t)
        done += t
    return c, rng


def _keep_rule(rng, n, B, quantized):
    """Random slots to keep, at least one: for quantized caches a multiple of B leaves and the
    tail stays (without a tail at least one block's worth stays)."""
    if not quantized:
        m = int(rng.integers(1, n + 1))
        return np.sort(rng.choice(n, m, replace=False))
    tail = n % B
    full = n - tail
    drop_blocks = int(rng.integers(0, full // B + (1 if tail else 0)))
    body = np.sort(rng.choice(full, full - drop_blocks * B, replace=False))
    return np.concatenate([body, np.arange(full, n)]).astype(np.int64)


@settings(deadline=None, max_examples=60)
@given(st.sampled_from(["f16", "f32", "q8_0", "q4_1"]), st.integers(2, 120),
       st.sampled_from([4, 8, 32]), st.integers(1, 2), st.integers(1, 3), st.integers(0, 40),
       st.integers(0, 2**31 - 1))
def test_attention_over_compacted_cache_equals_attention_over_kept_tokens(
        kv_type, n, B, Hkv, G, window, seed):
    """Decode and prefill over the compacted cache (slot space, positions map) equal the
    NumPy reference over the uncompacted cache with the dropped tokens masked out."""
    D = 32
    quant = kv_type.startswith("q")
    c, rng = _filled(kv_type, n, B, Hkv, D, seed)
    K0, V0 = c.gather(0)                                   # [Hkv, n, D] before compaction
    keep = _keep_rule(rng, n, B, quant)
    if keep[-1] != n - 1 and not quant:
        keep = np.union1d(keep, [n - 1])
    assert keep.size > 0
    imp = np.zeros((c.max_blocks, B, Hkv * G), np.float16)
    blocks, rows = c.slots(0, n)
    marks = rng.uniform(0, 100, (n, Hkv * G)).astype(np.float16)
    imp[blocks, rows] = marks
    held_before = int((c.table(0) >= 0).sum())
    c.compact(0, keep, extra=(imp,))
    m = keep.size
    assert c.slot_count(0) == m and np.array_equal(c.positions(0), keep.astype(np.int32))
    # memory: the layer holds ceil(m / B) blocks, the rest went back to its pool
    held = int((c.table(0) >= 0).sum())
    assert held == -(-m // B) and len(c._free[0]) == c.max_blocks - held <= c.max_blocks
    assert held <= held_before
    K1, V1 = c.gather(0)
    np.testing.assert_array_equal(K1, K0[:, keep])         # data moved exactly
    np.testing.assert_array_equal(V1, V0[:, keep])
    b1, r1 = c.slots(0, m)
    np.testing.assert_array_equal(imp[b1, r1], marks[keep])  # importance moved with its tokens
    # decode: the query is the token in the last kept slot (position keep[-1])
    Hq = Hkv * G
    q = rng.standard_normal((Hq, D)).astype(np.float32)
    scale = 0.3
    pos = c.positions(0)
    w = attention.slot_window(pos, m, window)
    out = np.empty((Hq, D), np.float32)
    attention.attention_decode(q, c.k_layer(0), c.v_layer(0), c.table(0), m, scale, w, out)
    pq = int(pos[-1])
    vis = (keep <= pq) & ((window <= 0) | (pq - keep < window))
    ref = np.empty((Hq, D), np.float32)
    for h in range(Hq):
        s = (K0[h // G, keep[vis]] @ q[h]) * np.float32(scale)
        p = np.exp(s - s.max())
        ref[h] = (p / p.sum()) @ V0[h // G, keep[vis]]
    # float32 softmax over <= 120 keys in a different order: 1e-5 of |V| (O(1))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    # prefill: the last T kept slots as query rows (consecutive positions only: a chunk)
    T = 1
    while T < m and keep[m - T - 1] == keep[m - T] - 1:
        T += 1
    qs = rng.standard_normal((T, Hq, D)).astype(np.float32)
    o_k = np.empty((T, Hq, D), np.float32)
    o_r = np.empty((T, Hq, D), np.float32)
    path = "tiled" if rng.random() < 0.5 else "kernel"     # both Numba prefill paths
    with prefill_path(path):
        attention.attention_prefill(qs, c.k_layer(0), c.v_layer(0), c.table(0), m - T, scale,
                                    window, o_k, positions=pos)
    attention.attention_prefill(qs, c.k_layer(0), c.v_layer(0), c.table(0), m - T, scale, window,
                                o_r, positions=pos, backend="numpy")
    np.testing.assert_allclose(o_k, o_r, atol=1e-5, rtol=1e-5)
    for i in range(T):                          # and the reference itself masks by position
        pq = int(pos[m - T + i])
        vis = (keep <= pq) & ((window <= 0) | (pq - keep < window))
        for h in range(Hq):
            s = (K0[h // G, keep[vis]] @ qs[i, h]) * np.float32(scale)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(o_r[i, h], (p / p.sum()) @ V0[h // G, keep[vis]],
                                       atol=1e-5, rtol=1e-5)


def test_quantized_compaction_refuses_what_the_tail_rule_forbids():
    c, _ = _filled("q8_0", 70, 32, 1, 32, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        c.compact(0, np.arange(1, 70))
    with pytest.raises(ValueError, match="increasing"):
        c.compact(0, np.array([5, 3]))


def test_whole_leading_blocks_leave_without_moving_data():
    c, _ = _filled("f16", 70, 16, 2, 32, 3)
    row = c.table(0).copy()
    K0, _ = c.gather(0)
    c.compact(0, np.arange(32, 70))
    assert np.array_equal(c.table(0)[:3], row[2:5])          # the table rotated
    assert set(row[:2].tolist()) <= set(c._free[0])                  # back in the pool
    np.testing.assert_array_equal(c.gather(0)[0], K0[:, 32:])
    assert c.max_evicted[0, 0] == 31


# --------------------------------------------------------------------------
# engine
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write(tmp_path_factory.mktemp("pol") / "llama.gguf",
                 SynthSpec(arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                           vocab_size=300, seed=5))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return write(tmp_path_factory.mktemp("pol") / "gemma.gguf",
                 SynthSpec(arch="gemma3", n_layer=4, n_embd=128, n_head=4, n_head_kv=1,
                           head_dim=32, n_ff=256, vocab_size=300, sliding_window=24,
                           swa_pattern=4, rope_base=1e6, rope_base_swa=1e4, seed=6))


def _run(path, ids, n_decode, sparse_ran=None, **opts):
    """Prefill ids, greedy-decode n_decode tokens: (engine, logits [n_decode + 1, V]). With a
    list ``sparse_ran`` the sparse decode never falls back to the dense kernel and the list
    collects its sparse steps (conftest.count_sparse_steps)."""
    eng = pyimp.load(path, n_ctx=256, block_len=8, batch_size=16, **opts)
    ran = count_sparse_steps(eng) if sparse_ran is not None else None
    rows = [eng.eval(ids)[-1]]
    for _ in range(n_decode):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
    if ran is not None:
        sparse_ran.extend(ran)
    return eng, np.array(rows)


@pytest.mark.parametrize("policy", ["h2o", "streaming", "snapkv", "pyramidkv"])
def test_budget_over_the_context_is_full_attention_exactly(llama, policy):
    """A budget no layer reaches drops nothing: logits bit-identical to the full policy with
    the same importance tracking (track=True runs the same kernels)."""
    ids = _ids(60)
    _, full = _run(llama, ids, 6, track=True)
    budget = 2000 if policy == "pyramidkv" else 200     # pyramidkv's last layer gets ~1/20 of it
    eng, got = _run(llama, ids, 6, track=True, kv_policy=policy, kv_budget=budget)
    assert eng.policy.budgets.min() > 66
    assert np.array_equal(full, got)
    assert eng.policy.evicted == 0


@pytest.mark.parametrize("policy, kv", [("streaming", "f16"), ("h2o", "f16"), ("h2o", "q8_0"),
                                        ("snapkv", "f32"), ("pyramidkv", "f16")])
def test_policies_hold_the_budget_and_keep_sinks_and_the_current_token(llama, policy, kv):
    budget, B = 40, 8
    eng = pyimp.load(llama, n_ctx=256, block_len=B, batch_size=16, kv_policy=policy,
                     kv_budget=budget, keep=4, kv_type=kv)
    budgets = eng.policy.budgets
    ids = _ids(100)
    logits = eng.eval(ids)[-1]
    c = eng.cache
    for step in range(20):
        tok = int(np.argmax(logits))
        logits = eng.eval([tok])[-1]
        assert np.isfinite(logits).all()
        n = len(eng.tokens)
        for il in range(c.n_layer):
            pos = c.positions(il)
            if policy in ("streaming", "h2o"):
                assert pos.size < budgets[il] + B                   # re-decided every step
            assert set(range(4)) <= set(pos.tolist())                # sinks
            assert pos[-1] == n - 1                                  # the current token
            assert int((c.table(il) >= 0).sum()) == -(-pos.size // B)   # blocks follow slots
    if policy in ("snapkv", "pyramidkv"):
        # evicted once at the end of the prefill: the prompt down to the budget, decode appends
        for il in range(c.n_layer):
            assert c.slot_count(il) < budgets[il] + B + 20
    assert eng.policy.evicted > 0
    assert c.bytes_held() < 100 * c.layer_token_bytes() * c.n_layer


def _record_evictions(eng) -> list:
    """Wrap ``eng``'s policy so that every forward appends (n_ctx, prefill_done, before, held):
    before[il] = (positions, scores) layer il held before the forward's eviction (scores:
    importance_ summed over the query heads, None without importance), held[il] the positions
    it holds after."""
    c, sp, pol = eng.cache, eng.sparse, eng.policy
    seen = []
    after_forward = pol.after_forward

    def record(n_ctx, prefill_done):
        before = []
        for il in range(c.n_layer):
            b, r = c.slots(0, c.slot_count(il), layer=il)
            score = None if sp is None else sp.importance_[il, b, r].astype(np.float64).sum(-1)
            before.append((c.positions(il).copy(), score))
        after_forward(n_ctx, prefill_done)
        seen.append((n_ctx, prefill_done, before,
                     [c.positions(il).copy() for il in range(c.n_layer)]))

    pol.after_forward = record
    return seen


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "pyramidkv"])
def test_engine_keeps_what_the_keep_function_decides(llama, policy):
    """After every forward of a chunked prefill and 20 decode steps, each layer holds the
    positions the policy's keep function picks from what the layer held before the
    forward's eviction, with the scores the layer had then (importance_ summed over its query
    heads); streaming: the sinks and the most recent tokens. snapkv / pyramidkv decide at the
    prefill's end only; decode steps keep everything."""
    B, budget, keep, window, pool = 8, 40, 4, 16, 5
    opts = PolicyOptions(policy, budget=budget, keep=keep, obs_window=window, pool=pool)
    budgets = opts.layer_budgets(2)
    eng = pyimp.load(llama, n_ctx=256, block_len=B, batch_size=16, kv_policy=policy,
                     kv_budget=budget, keep=keep, kv_obs_window=window, kv_pool=pool)
    assert (eng.sparse is None) == (policy == "streaming")   # scoring policies track importance_
    seen = _record_evictions(eng)
    rows = [eng.eval(_ids(100))[-1]]
    for _ in range(20):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
    # 7 prefill chunks of 16 rows, the last one ends the prefill; then the decode steps
    assert [(n, d) for n, d, _, _ in seen] == ([(min(16 * i, 100), i == 7) for i in range(1, 8)]
                                               + [(n, False) for n in range(101, 121)])
    evictions = np.zeros(2, int)
    scored = 0                               # decisions the scores changed (vs. recency)
    for n_ctx, prefill_done, before, held in seen:
        for il in range(2):
            pos, score = before[il]
            n, m = pos.size, target_size(pos.size, int(budgets[il]), B)
            decide = policy in ("streaming", "h2o") or prefill_done
            if not decide or m == n:
                assert np.array_equal(held[il], pos)
                continue
            recent = opts.window_for(int(budgets[il]))
            if policy == "streaming":
                k = streaming_keep(pos, keep, m, B)
                # the sinks, then the m - keep newest positions
                assert np.array_equal(pos[k], np.r_[0:keep, n_ctx - (m - keep):n_ctx])
            elif policy == "h2o":
                k = h2o_keep(pos, score, keep, recent, m, B)
            else:
                k = snapkv_keep(pos, score, keep, window, pool, m, B)
            assert np.array_equal(held[il], pos[k]), (n_ctx, il)
            evictions[il] += 1
            scored += not np.array_equal(k, streaming_keep(pos, keep, m, B))
    if policy in ("streaming", "h2o"):
        assert np.all(evictions > 2)         # in the prefill's chunks and during decode
    else:
        assert np.all(evictions == 1) and list(budgets) == ([40, 40] if policy == "snapkv"
                                                             else [63, 21])
    assert scored > 0 or policy == "streaming"
    assert np.isfinite(np.array(rows)).all()


def test_sliding_window_layers_keep_their_window_only(gemma):
    """full policy: sliding-window layers hold < window + B tokens; the logits equal an engine
    that keeps everything (trim switched off) to float32 reassociation."""
    ids = _ids(90)
    eng, got = _run(gemma, ids, 10)
    ref_eng = pyimp.load(gemma, n_ctx=256, block_len=8, batch_size=16)
    ref_eng.policy.windows = [0] * ref_eng.cfg.n_layer        # no trim
    rows = [ref_eng.eval(ids)[-1]]
    for _ in range(10):
        rows.append(ref_eng.eval([int(np.argmax(rows[-1]))])[-1])
    ref = np.array(rows)
    # different block arrangements change the decode split and so the float32 summation order;
    # measured differences are ~1e-6 of the largest logit
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()
    cfg = eng.cfg
    for il in range(cfg.n_layer):
        if cfg.is_swa(il):
            assert eng.cache.slot_count(il) < cfg.sliding_window + 8
            assert ref_eng.cache.slot_count(il) == len(ids) + 10
        else:
            assert eng.cache.slot_count(il) == len(ids) + 10
    assert eng.cache.bytes_held() < ref_eng.cache.bytes_held()


def test_prefix_reuse_starts_over_when_the_trim_dropped_what_it_needs(gemma):
    ids = _ids(90)
    eng = pyimp.load(gemma, n_ctx=256, block_len=8, batch_size=16)
    eng.eval(ids)
    # a prefix of 70: the sliding-window layers dropped positions 70 - 24 would still see
    got = eng.prime(ids[:70] + [5, 6])
    assert eng.timings.extra["prefix_reused"] == 0
    fresh = pyimp.load(gemma, n_ctx=256, block_len=8, batch_size=16).eval(ids[:70] + [5, 6])
    np.testing.assert_array_equal(got, fresh)
    # a prefix the trim has not touched is reused
    got = eng.prime(ids[:70] + [5, 6, 7])
    assert eng.timings.extra["prefix_reused"] == 72


def test_state_round_trip_of_a_compacted_cache(llama, tmp_path):
    ids = _ids(100)
    kw = {"n_ctx": 256, "block_len": 8, "batch_size": 16, "kv_policy": "h2o", "kv_budget": 40}
    a = pyimp.load(llama, **kw)
    a.eval(ids)
    a.save_state(tmp_path / "s.bin")
    b = pyimp.load(llama, **kw)
    b.load_state(tmp_path / "s.bin")
    for il in range(a.cfg.n_layer):
        np.testing.assert_array_equal(a.cache.positions(il), b.cache.positions(il))
    ra, rb = a.eval([7])[-1], b.eval([7])[-1]
    np.testing.assert_array_equal(ra, rb)
    small = pyimp.load(llama, **{**kw, "kv_budget": 16, "batch_size": 8})
    with pytest.raises(StateFileError, match="layers hold at most 32"):
        small.load_state(tmp_path / "s.bin")


def test_engine_refusals(llama):
    with pytest.raises(ValueError, match="needs a budget"):
        pyimp.load(llama, n_ctx=256, kv_policy="h2o")
    with pytest.raises(ValueError, match="block length"):
        pyimp.load(llama, n_ctx=256, kv_policy="h2o", kv_budget=12, keep=4, kv_recent=2,
                   block_len=8)
    with pytest.raises(ValueError, match="v_layout"):
        pyimp.load(llama, n_ctx=256, kv_policy="h2o", kv_budget=64, kv_type="q8_0",
                   v_layout="channel")


def test_depth_ratio_in_the_engine(tmp_path):
    """h2o with --kv-depth-ratio 3 on a gemma3 whose layers alternate sliding / global: the
    sliding layers keep their window, the global ones hold their own budgets (the first three
    times the last, the same total as a uniform budget), sinks and the current token stay."""
    path = write(tmp_path / "g.gguf",
                 SynthSpec(arch="gemma3", n_layer=4, n_embd=128, n_head=4, n_head_kv=1,
                           head_dim=32, n_ff=256, vocab_size=300, sliding_window=24,
                           swa_pattern=2, rope_base=1e6, rope_base_swa=1e4, seed=7))
    B, budget = 8, 40
    eng, rows = _run(path, _ids(100), 20, kv_policy="h2o", kv_budget=budget, kv_depth_ratio=3.0,
                     keep=4)
    assert np.isfinite(rows).all()
    cfg, c = eng.cfg, eng.cache
    glob = [il for il in range(cfg.n_layer) if not cfg.is_swa(il)]
    assert len(glob) == 2
    assert [int(eng.policy.budgets[il]) for il in glob] == [60, 20]
    assert eng.policy.recent == [int(x) // 2 for x in eng.policy.budgets]
    n = len(eng.tokens)
    for il in range(cfg.n_layer):
        pos = c.positions(il)
        assert pos[-1] == n - 1
        if cfg.is_swa(il):
            assert c.slot_count(il) < cfg.sliding_window + B
        else:
            assert c.slot_count(il) < eng.policy.budgets[il] + B
            assert set(range(4)) <= set(pos.tolist())
    assert c.slot_count(glob[0]) > c.slot_count(glob[1])
    with pytest.raises(ValueError, match="layer 1's"):          # 40 * 2 / 10 = 8 tokens
        pyimp.load(llama_path(tmp_path), n_ctx=256, block_len=B, kv_policy="h2o",
                   kv_budget=budget, kv_depth_ratio=9.0)


def _obs_engine(path, budget, weight, **kw):
    return pyimp.load(path, n_ctx=256, block_len=8, batch_size=128, kv_policy="h2o",
                      kv_budget=budget, kv_recent=8, keep=4, kv_obs_window=16,
                      kv_obs_weight=weight, **kw)


def test_observation_window_buffer_and_ranking(llama):
    """--kv-obs-weight: the window's buffer is exactly the importance the prompt's last 16 rows
    add (an engine that runs them after zeroing importance_ gets the same), importance_ still
    holds every row's, and the tokens kept at the prefill's end are h2o's choice by
    acc / sum(acc) + W obs / sum(obs)."""
    ids = _ids(100)
    # a budget over the prompt: nothing dropped, the buffers to compare against
    ref = _obs_engine(llama, 200, 2.0)
    ref.eval(ids)
    head = pyimp.load(llama, n_ctx=256, block_len=8, batch_size=128, track=True)
    head.eval(ids[:-16])
    acc_head = head.sparse.importance_.astype(np.float32)
    head.sparse.importance_[:] = 0
    head.eval(ids[-16:])
    obs = ref.policy.obs
    assert obs is not None and obs.dtype == ref.sparse.importance_.dtype
    n = len(ids)
    for il in range(ref.cfg.n_layer):
        b, r = ref.cache.slots(0, n, layer=il)
        hb, hr = head.cache.slots(0, n, layer=il)
        assert np.array_equal(obs[il, b, r], head.sparse.importance_[il, hb, hr])
        # acc = fp16(head's + window's): one fp16 rounding of the sum
        want = acc_head[il, hb, hr] + head.sparse.importance_[il, hb, hr].astype(np.float32)
        got = ref.sparse.importance_[il, b, r].astype(np.float32)
        assert np.allclose(got, want, rtol=2 ** -10, atol=0)
    # budget 90 of 100: the head (84 rows) fits, the prefill's end drops whole blocks
    eng = _obs_engine(llama, 90, 2.0)
    eng.eval(ids)
    assert eng.policy.evicted > 0
    for il in range(eng.cfg.n_layer):
        b, r = ref.cache.slots(0, n, layer=il)
        acc = ref.sparse.importance_[il, b, r].astype(np.float64).sum(-1)
        ob = obs[il, b, r].astype(np.float64).sum(-1)
        score = acc / acc.sum() + 2.0 * ob / ob.sum()
        pos = np.arange(n, dtype=np.int32)
        m = target_size(n, 90, 8)
        want = h2o_keep(pos, score, 4, 8, m, 8)
        assert np.array_equal(eng.cache.positions(il), pos[want])
        # the window's buffer moved with the kept tokens
        kb, kr = eng.cache.slots(0, m, layer=il)
        assert np.array_equal(eng.policy.obs[il, kb, kr], obs[il, b[want], r[want]])
    eng.reset()
    assert eng.policy.obs is None
    with pytest.raises(ValueError, match="do not combine"):
        _obs_engine(llama, 90, 1.0, kv_merge=0.9)


def test_a_failed_window_chunk_gives_importance_back(llama):
    """The window's rows fail (an f16 overflow in their chunk): the call is undone and the
    importance set aside comes back (the head chunk's rows may have added theirs, as without
    the window: a failed call does not roll importance back), nothing stays set aside."""
    from pyimp import ops
    eng = pyimp.load(llama, n_ctx=256, block_len=8, batch_size=64, kv_policy="h2o", kv_budget=200,
                     kv_recent=8, keep=4, kv_obs_window=8, kv_obs_weight=1.0)
    eng.eval(_ids(20))
    before = eng.sparse.importance_.copy()
    lin = eng.weights.layers[1].attn_v
    calls = []

    def v_then_overflow(h, num):                 # the head chunk passes, the window's overflows
        calls.append(h.shape[0])
        out = lin(h, num)
        return out if len(calls) == 1 else np.full_like(out, 1e5)

    eng.weights.layers[1].attn_v = v_then_overflow
    with pytest.raises(ops.NonFiniteError, match="does not fit the f16 KV cache"):
        eng.eval(_ids(12, 1))
    assert calls == [4, 8]                        # 12 rows: 4, then the window's 8
    assert len(eng.tokens) == 20 and eng.policy._saved is None
    n = 20
    for il in range(eng.cfg.n_layer):
        b, r = eng.cache.slots(0, n, layer=il)
        got = eng.sparse.importance_[il, b, r].astype(np.float32)
        # never below what it held (one fp16 rounding of the sum); left zeroed it would be
        assert np.all(got >= before[il, b, r].astype(np.float32) * (1 - 2 ** -10))


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_depth_and_observation_with_sparse_attention(llama, kv):
    """h2o with depth budgets and the observation window under block-sparse decode: with every
    block selected the sparse run equals the dense one (float32 summation order: the paged
    sparse kernel visits blocks in selection order); budgets held."""
    ids = _ids(120)
    kw = dict(kv_policy="h2o", kv_budget=48, kv_recent=8, keep=4, kv_obs_window=16,
              kv_obs_weight=1.0, kv_depth_ratio=2.0, kv_type=kv, track=True)
    _, dense = _run(llama, ids, 12, **kw)
    ran = []
    eng, sparse = _run(llama, ids, 12, sparse=True, topk=64, local_blocks=1, sparse_ran=ran, **kw)
    # every decode step took the sparse kernels in each lead layer (their slot counts differ
    # under depth budgets, so steps are counted per layer)
    per_layer = collections.Counter(il for il, _ in ran)
    assert per_layer and set(per_layer.values()) == {12}
    np.testing.assert_allclose(sparse, dense, rtol=0, atol=1e-4 * np.abs(dense).max())
    assert eng.policy.evicted > 0 and list(eng.policy.budgets) == [64, 32]
    for il in range(eng.cfg.n_layer):
        assert eng.cache.slot_count(il) < eng.policy.budgets[il] + 8


def test_observation_split_keeps_full_attention(llama):
    """With a budget over the context the observation window's chunk changes nothing but the
    chunking: the logits match the full policy's to float32 reassociation (prefill chunks of
    84 + 16 rows instead of 100 change the summation order; measured ~1e-6 of the largest)."""
    ids = _ids(100)
    _, full = _run(llama, ids, 4, track=True)
    eng = _obs_engine(llama, 500, 1.0)
    rows = [eng.eval(ids)[-1]]
    for _ in range(4):
        rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
    got = np.array(rows)
    assert eng.policy.evicted == 0
    assert np.abs(got - full).max() <= 1e-4 * np.abs(full).max()


def llama_path(tmp_path):
    return write(tmp_path / "l.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=128, n_head=4,
                                                n_head_kv=2, n_ff=256, vocab_size=300, seed=5))


def test_swa_full_keeps_every_token_and_any_prefix(gemma):
    ids = _ids(90)
    eng = pyimp.load(gemma, n_ctx=256, block_len=8, batch_size=16, swa_full=True)
    eng.eval(ids)
    assert all(eng.cache.slot_count(il) == 90 for il in range(eng.cfg.n_layer))
    eng.prime(ids[:70] + [5, 6])
    assert eng.timings.extra["prefix_reused"] == 70


# --------------------------------------------------------------------------
# neighbour keeping (--kv-neighbours): ranking by the score max-pooled over positions
# --------------------------------------------------------------------------


def test_neighbours_keep_the_tokens_beside_a_heavy_one():
    """One heavy token (a key's first digit) among filler heavy hitters: plain h2o keeps it and
    the filler's; with 2 neighbours the free slots go to the positions within 2 of it first,
    then the next centres (own score first, later slot first)."""
    from pyimp.kv.policy import h2o_keep
    pos = np.arange(64)
    score = np.zeros(64)
    score[30] = 10.0                            # the attended digit
    score[31:35] = 0.1                          # the digits that continue it
    score[[5, 12, 50]] = 5.0
    score[40] = 4.0
    B = 32                                      # n % B == 0: the last slot is the only forced one
    plain = h2o_keep(pos, score, 0, 0, 6, B)
    assert plain.tolist() == [5, 12, 30, 40, 50, 63]
    nbr = h2o_keep(pos, score, 0, 0, 6, B, neighbours=2)
    assert nbr.tolist() == [28, 29, 30, 31, 32, 63]
    nbr = h2o_keep(pos, score, 0, 0, 8, B, neighbours=2)
    assert nbr.tolist() == [12, 28, 29, 30, 31, 32, 50, 63]
    nbr = h2o_keep(pos, score, 0, 0, 6, B, neighbours=4)   # the whole five-digit run
    assert set(range(30, 35)) <= set(nbr.tolist())
    # snapkv: its average-pooled score, max-pooled the same way
    s = snapkv_keep(pos, score, 0, 1, 1, 6, B, neighbours=2)
    assert s.tolist() == [28, 29, 30, 31, 32, 63]


def test_maxpool_neighbours_are_positions_not_slots():
    from pyimp.kv.policy import maxpool1d
    s = np.array([0.0, 5.0, 0.0, 0.0, 1.0])
    assert maxpool1d(s, 1).tolist() == [5.0, 5.0, 5.0, 1.0, 1.0]
    assert maxpool1d(s, 0).tolist() == s.tolist()
    # slots 1 and 2 hold positions 10 and 20: not within 1 of each other
    assert maxpool1d(s, 1, np.array([9, 10, 20, 21, 22])).tolist() == [5.0, 5.0, 0.0, 1.0, 1.0]


@settings(deadline=None, max_examples=150)
@given(policy_case, st.integers(1, 200), st.integers(1, 5))
def test_neighbour_keeping_property(case, budget_extra, radius):
    """maxpool1d equals the brute-force max over held positions within R; every dropped free
    slot ranks no higher than any kept one; a kept free slot whose own score beats every
    dropped slot's pooled score has all its held neighbours (within R positions) kept."""
    from pyimp.kv.policy import h2o_keep, maxpool1d
    n, B, sinks, recent, seed = case
    rng = np.random.default_rng(seed)
    budget = sinks + max(recent, B) + budget_extra
    pos = np.sort(rng.choice(3 * n + 5, n, replace=False)).astype(np.int32)
    m = target_size(n, budget, B)
    score = rng.integers(0, 6, n).astype(np.float64) * rng.random(n)
    pooled = maxpool1d(score, radius, pos)
    ref = np.array([score[np.abs(pos - pos[i]) <= radius].max() for i in range(n)])
    assert np.array_equal(pooled, ref)
    keep = h2o_keep(pos, score, sinks, recent, m, B, neighbours=radius)
    _check_common(keep, n, m, pos, sinks, recent, B)
    forced = pos < sinks
    forced[max(0, n - max(recent, n % B, 1)):] = True
    kept = np.zeros(n, bool)
    kept[keep] = True
    free_kept = np.flatnonzero(kept & ~forced)
    dropped = np.flatnonzero(~kept)
    if free_kept.size and dropped.size:
        assert pooled[dropped].max() <= pooled[free_kept].min()
        cut = pooled[dropped].max()
        for i in free_kept[score[free_kept] > cut]:
            assert kept[np.abs(pos - pos[i]) <= radius].all()


def test_neighbour_option_refusals_and_engine_wiring(llama):
    with pytest.raises(ValueError, match="applies to h2o, snapkv and pyramidkv"):
        PolicyOptions("streaming", budget=100, neighbours=2).validate()
    with pytest.raises(ValueError, match="neighbours must be >= 0"):
        PolicyOptions("h2o", budget=100, neighbours=-1).validate()
    eng = pyimp.load(llama, n_ctx=256, block_len=8, batch_size=16, kv_policy="h2o",
                     kv_budget=40, kv_neighbours=3)
    assert eng.policy.opts.neighbours == 3


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_engine_keeps_what_the_neighbour_keep_function_decides(llama, policy):
    """Each eviction of a prefill and 12 decode steps keeps the positions the keep function
    with neighbours picks from what the layer held and its scores then, and at least one
    decision differs from the one without neighbours."""
    B, budget, keep, window, pool, R = 8, 40, 4, 16, 5, 2
    opts = PolicyOptions(policy, budget=budget, keep=keep, obs_window=window, pool=pool,
                         neighbours=R)
    budgets = opts.layer_budgets(2)
    eng = pyimp.load(llama, n_ctx=256, block_len=B, batch_size=16, kv_policy=policy,
                     kv_budget=budget, keep=keep, kv_obs_window=window, kv_pool=pool,
                     kv_neighbours=R)
    seen = _record_evictions(eng)
    logits = eng.eval(_ids(100))[-1]
    for _ in range(12):
        logits = eng.eval([int(np.argmax(logits))])[-1]
    decided = differs = 0
    for _, prefill_done, before, held in seen:
        for il in range(2):
            pos, score = before[il]
            m = target_size(pos.size, int(budgets[il]), B)
            if m == pos.size or not (policy == "h2o" or prefill_done):
                assert np.array_equal(held[il], pos)
                continue
            if policy == "h2o":
                recent = opts.window_for(int(budgets[il]))
                k = h2o_keep(pos, score, keep, recent, m, B, neighbours=R)
                k0 = h2o_keep(pos, score, keep, recent, m, B)
            else:
                k = snapkv_keep(pos, score, keep, window, pool, m, B, neighbours=R)
                k0 = snapkv_keep(pos, score, keep, window, pool, m, B)
            assert np.array_equal(held[il], pos[k])
            decided += 1
            differs += not np.array_equal(k, k0)
    assert decided > 0 and differs > 0


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "pyramidkv"])
def test_tracking_keeps_the_policys_importance_rows(llama, policy):
    """Asking for importance tracking (track=True, as the evaluation tools do) must not change
    which prompt rows score the tokens: h2o every row, snapkv / pyramidkv the last
    kv_obs_window. Tracking's own default (the last 128 rows) made snapkv rank by 128 rows
    instead of its 16-row window here: other positions were kept, other logits came out."""
    ids = _ids(200)                          # more rows than the tracking default's 128
    kw = dict(kv_policy=policy, kv_budget=64 if policy != "pyramidkv" else 96, kv_obs_window=16)
    plain, want = _run(llama, ids, 4, **kw)
    tracked, got = _run(llama, ids, 4, track=True, **kw)
    assert tracked.sparse.opts.importance_window == (0 if policy == "h2o" else 16)
    assert plain.sparse.opts.importance_window == tracked.sparse.opts.importance_window
    for il in range(plain.cache.n_layer):
        assert np.array_equal(plain.cache.positions(il), tracked.cache.positions(il))
    assert plain.policy.evicted > 0 and np.array_equal(want, got)


# --------------------------------------------------------------------------
# keeping what follows a kept token (--kv-follow)
# --------------------------------------------------------------------------


def test_follow_keeps_the_value_after_the_attended_key():
    """The question attends to a key's last token (slot 20); the value's digits (21-27) score
    nothing. Plain snapkv (no pooling) and 2 neighbours keep at most 2 of them; following 7
    keeps all 7 and nothing before the key beyond what its own score earns."""
    pos = np.arange(64)
    score = np.zeros(64)
    score[20] = 9.0                              # "... for named-executing is"
    score[[2, 6, 10, 14, 30, 34, 37, 39]] = 1.0  # filler heavy hitters elsewhere
    score[40:60] = 0.5
    B = 32                                       # n % B == 0: only the last slot is forced
    value = set(range(21, 28))
    plain = snapkv_keep(pos, score, 0, 1, 1, 9, B)
    nbr = snapkv_keep(pos, score, 0, 1, 1, 9, B, neighbours=2)
    fol = snapkv_keep(pos, score, 0, 1, 1, 9, B, follow=7)
    assert len(value & set(plain.tolist())) == 0 and len(value & set(nbr.tolist())) == 2
    assert fol.tolist() == list(range(20, 28)) + [63]
    # h2o ranks the same way; the neighbours' look-ahead still applies beside follow
    assert h2o_keep(pos, score, 0, 0, 9, B, follow=7).tolist() == fol.tolist()
    both = h2o_keep(pos, score, 0, 0, 11, B, neighbours=2, follow=7)
    assert set(range(18, 28)) <= set(both.tolist())


@settings(deadline=None, max_examples=100)
@given(st.integers(1, 60), st.integers(0, 6), st.integers(0, 9), st.integers(0, 2 ** 31))
def test_maxpool_behind_and_ahead_is_the_windowed_max(n, ahead, behind, seed):
    """maxpool1d(score, ahead, pos, behind) is the brute-force max over the held positions from
    ``behind`` before to ``ahead`` after each slot's (compacted: positions with gaps)."""
    from pyimp.kv.policy import maxpool1d
    rng = np.random.default_rng(seed)
    pos = np.sort(rng.choice(3 * n + 5, n, replace=False))
    score = rng.random(n) * (rng.random(n) < 0.3)
    ref = [score[(pos >= pos[i] - behind) & (pos <= pos[i] + ahead)].max() for i in range(n)]
    assert np.array_equal(maxpool1d(score, ahead, pos, behind=behind), ref)


def test_follow_option_refusals_and_engine_wiring(llama):
    with pytest.raises(ValueError, match="applies to h2o, snapkv and pyramidkv"):
        PolicyOptions("streaming", budget=100, follow=2).validate()
    with pytest.raises(ValueError, match="follow must be >= 0"):
        PolicyOptions("snapkv", budget=100, follow=-1).validate()
    from tools import eval_kv as ev
    assert ev.parse_policy("snapkv+follow8+nbr2") == ("snapkv", {"kv_follow": 8,
                                                                 "kv_neighbours": 2})
    for bad, msg in (("snapkv+follow0", "kept after a kept one"),
                     ("streaming+follow4", "\\+follow applies to h2o")):
        with pytest.raises(ValueError, match=msg):
            ev.parse_policy(bad)
    B, budget = 8, 40
    kw = dict(n_ctx=256, block_len=B, batch_size=16, kv_policy="snapkv", kv_budget=budget,
              kv_obs_window=16)
    eng = pyimp.load(llama, kv_follow=6, **kw)
    assert eng.policy.opts.follow == 6
    seen = _record_evictions(eng)
    eng.eval(_ids(100))
    (n_ctx, done, before, held), = [s for s in seen if s[1]]     # the prefill's end
    for il in range(2):
        pos, score = before[il]
        m = target_size(pos.size, budget, B)
        k = snapkv_keep(pos, score, 4, 16, 5, m, B, follow=6)
        assert np.array_equal(held[il], pos[k])
        assert not np.array_equal(k, snapkv_keep(pos, score, 4, 16, 5, m, B))


# --------------------------------------------------------------------------
# a second observation window from the same prefill (second_window, importance2_)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arch,policy", [("llama", "full"), ("gemma", "full"),
                                         ("llama", "streaming")])
@pytest.mark.parametrize("W", [0, 5, 16])
def test_second_window_equals_a_prefill_with_that_window(llama, gemma, arch, policy, W):
    """One prefill with importance_window=0 and second_window=W leaves in importance_ exactly
    what a prefill with importance_window=0 leaves, and in importance2_ exactly what one with
    importance_window=W leaves in its importance_ (the same kernel sums over the same rows,
    so the bits agree): over chunked prompts (batch 16), a second prompt continuing the first,
    gemma's sliding-window layers (their trim drops leading blocks) and streaming eviction
    after every chunk, whose compaction moves both buffers with their slots."""
    path = llama if arch == "llama" else gemma
    first, second = _ids(70), _ids(23)[3:]
    evict = dict(kv_policy="streaming", kv_budget=40, keep=4) if policy == "streaming" else {}

    def run(**kw):
        eng = pyimp.load(path, n_ctx=256, block_len=8, batch_size=16, track=True, **evict,
                         **kw)
        logits = [eng.eval(first)[-1], eng.eval(second)[-1]]
        return eng, np.array(logits)

    both, got = run(importance_window=0, second_window=W)
    every, want = run(importance_window=0)
    window, _ = run(importance_window=W)
    assert np.array_equal(got, want)                     # the forward is unchanged
    assert both.sparse.importance2_ is not None and every.sparse.importance2_ is None
    for il in range(both.cache.n_layer):
        pos = both.cache.positions(il)
        assert np.array_equal(pos, every.cache.positions(il))
        assert np.array_equal(pos, window.cache.positions(il))
        blocks, rows = both.cache.slots(0, pos.size, layer=il)
        a = both.sparse.importance_[il, blocks, rows]
        assert np.array_equal(a, every.sparse.importance_[il, blocks, rows])
        b = both.sparse.importance2_[il, blocks, rows]
        assert np.array_equal(b, window.sparse.importance_[il, blocks, rows])
        if W:                    # a real second window: it sums fewer rows than every row
            assert b.astype(np.float64).sum() < a.astype(np.float64).sum()
    if arch == "gemma":          # the trim ran: a sliding-window layer holds fewer slots
        assert min(both.cache.slot_count(il) for il in range(both.cache.n_layer)) < 70 + 20
    if policy == "streaming":    # slots moved: the middle of the context left
        assert both.policy.evicted > 0 and both.cache.compacted(0)
    both.reset()
    assert not both.sparse.importance2_.any()


def test_second_window_decays_with_importance(llama):
    """With decay < 1 a continued prompt scales what the first left, in both buffers: the
    second window's buffer still equals importance_ of a prefill with that window."""
    first, second = _ids(70), _ids(23)[3:]
    engines = []
    for kw in (dict(importance_window=0, second_window=16), dict(importance_window=16)):
        eng = pyimp.load(llama, n_ctx=256, block_len=8, batch_size=16, track=True, decay=0.5,
                         **kw)
        eng.eval(first)
        before = (eng.sparse.importance2_ if "second_window" in kw else
                  eng.sparse.importance_).copy()
        eng.eval(second)
        engines.append((eng, before))
    (both, b0), (window, w0) = engines
    assert np.array_equal(b0, w0)
    for il in range(both.cache.n_layer):
        blocks, rows = both.cache.slots(0, len(first), layer=il)
        got = both.sparse.importance2_[il, blocks, rows]
        assert np.array_equal(got, window.sparse.importance_[il, blocks, rows])
    # each prompt's 16 window rows add 16 per query head (4) and layer (2); the first's were
    # halved: 1.5 x 128 (each entry rounded to fp16, 2**-11 relative: far within 1 %)
    assert both.sparse.importance2_.astype(np.float64).sum() == pytest.approx(192, rel=1e-2)


def test_second_window_refusals(llama):
    with pytest.raises(ValueError, match="second_window must be >= 0"):
        pyimp.load(llama, n_ctx=256, second_window=-1)
    with pytest.raises(ValueError, match="second_window cannot be used with --kv-merge"):
        pyimp.load(llama, n_ctx=256, second_window=8, kv_merge=0.9)
    with pytest.raises(ValueError, match="second_window runs on the CPU only"):
        pyimp.load(llama, n_ctx=256, second_window=8, device="cuda")
