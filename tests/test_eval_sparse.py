"""tools.eval_sparse on a tiny synthetic gemma3 model: sane, falsifiable harness outputs."""
from __future__ import annotations

import numpy as np
import pytest

from tools import eval_sparse as ev
from tools.write_synthetic_gguf import SynthSpec, write

B = 8          # block_len
CTX = 192      # 24 full blocks prefilled
STEPS = 6
N_VOCAB = 512


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 6 layers, sliding-window pattern 6: layers 0-4 local (window 16), layer 5 global (sparse)
    spec = SynthSpec(arch="gemma3", n_layer=6, n_embd=64, n_head=4, n_head_kv=1, head_dim=16, n_ff=128,
                     vocab_size=N_VOCAB, sliding_window=16, rope_base=1e6, rope_base_swa=1e4,
                     rms_eps=1e-6, n_ctx=1024, seed=3)
    return write(tmp_path_factory.mktemp("evs") / "g3.gguf", spec)


@pytest.fixture(scope="module")
def ids():
    rng = np.random.default_rng(7)
    return [1] + rng.integers(3, N_VOCAB, CTX + STEPS - 1).tolist()


# covers every block; dense_fallback=False: the block-sparse kernels run over every block
FULL = ev.SparseConfig("quest", topk=10_000, dense_fallback=False)
CONFIGS = [FULL] + [ev.SparseConfig(a, topk=k) for a in ("quest", "block_mean") for k in (2, 6, 18)]


@pytest.fixture(scope="module")
def rows(model, ids):
    return ev.decode_quality(model, ids, CTX, STEPS, CONFIGS, block_len=B)


def test_one_row_per_config(rows):
    assert [(r.anchor, r.topk) for r in rows] == [(c.anchor, c.topk) for c in CONFIGS]
    table = ev.format_decode_table(rows).splitlines()
    assert len(table) == 2 + len(CONFIGS)
    assert all(r.steps == STEPS for r in rows)


def test_full_budget_is_lossless(rows):
    r = rows[0]
    # every step ran the block-sparse kernels (selection = every block), not the dense fallback
    assert r.sparse_steps == STEPS and r.recall_sparse_only is not None
    # sparse attention over every block equals dense attention up to float32 summation order
    # (~1e-6 relative on one layer's output), so the logits differ by ~1e-5 at most and the KL
    # by its square: 1e-6 nats is loose for that and far below every sparse config's KL here
    # (>1e-4, checked below)
    assert r.max_kl <= 1e-6
    assert r.top1 == 1.0
    # recall = exp(lse_sparse - lse_dense): two float32 log-sum-exps of the same scores in a
    # different order, |difference| ~1e-7 relative to |lse| <~ 10, so 1e-5 bounds it
    assert r.recall == pytest.approx(1.0, abs=1e-5)
    assert r.attended == 1.0          # every real token of the context, counted exactly


def test_sparse_steps_are_what_the_engine_ran(model, ids):
    """sparse_steps counts the steps on which the engine took the block-sparse path, as its
    observers saw them: with the dense fallback on, a budget covering every block runs none
    of them (recall and attended then count the dense steps as 1)."""
    fallback = ev.SparseConfig("quest", topk=10_000)          # dense_fallback on
    [r] = ev.decode_quality(model, ids, CTX, 3, [fallback], block_len=B, oracle=False)
    assert r.sparse_steps == 0 and r.steps == 3
    assert r.recall == 1.0 and r.attended == 1.0 and r.max_kl == 0.0


def test_small_budget_recall_in_unit_interval(rows):
    for r in rows[1:]:
        # 24-25 full blocks > 1 + 18 + 2, so every config here takes the sparse path every step
        assert r.sparse_steps == STEPS
        assert r.recall_sparse_only is not None
        assert 0.0 <= r.recall < 1.0
        assert 0.0 < r.attended < 1.0
        assert 0.0 <= r.top1 <= 1.0
        assert 0.0 < r.mean_kl <= r.max_kl and np.isfinite(r.max_kl)
    small = [r for r in rows[1:] if r.topk == 2]
    # (1 + 2 + 2) blocks + the partial tail of 193..198 tokens: at most 6 * 8 / 193
    assert all(r.attended <= 6 * B / CTX for r in small)


def test_oracle_bounds_recall(rows):
    # every block: the float64 softmax mass of every position, 1 up to float64 rounding
    assert rows[0].oracle == pytest.approx(1.0, abs=1e-12)
    for r in rows[1:]:
        # the oracle picks the blocks with the most dense mass under the same block counts, so per
        # step it captures at least what the anchors' choice captures; 1e-6: the engine's float32
        # recall against the oracle's float64 sums over the same fp16 keys
        assert r.oracle is not None and r.recall <= r.oracle + 1e-6 and r.oracle <= 1.0 + 1e-12


def test_oracle_recall_uniform_attention():
    # q = 0: every position gets 1/n, so the oracle captures (attended tokens) / n exactly
    rng = np.random.default_rng(1)
    n, Bl = 83, 8                                   # 10 full blocks + a 3-token tail
    keys = rng.standard_normal((2, n, 4)).astype(np.float32)
    q = np.zeros((4, 4), np.float32)
    got = ev.oracle_recall(q, keys, 0.5, Bl, 1, 3, 2, "kvhead")
    assert got == pytest.approx((1 + 3 + 2) * Bl / n + 3 / n, abs=1e-12)
    assert ev.oracle_recall(q, keys, 0.5, Bl, 1, 7, 2, "qhead") == pytest.approx(1.0, abs=1e-12)


def test_oracle_recall_finds_the_hot_block():
    # one key far along q in block 5: the oracle (topk 1) must hold nearly all mass, and for the
    # heads of the other kv head (which sees no such key) only its uniform share
    n, Bl, D = 96, 8, 4
    keys = np.zeros((2, n, D), np.float32)
    keys[0, 5 * Bl + 3] = [20.0, 0, 0, 0]
    q = np.tile(np.array([[1.0, 0, 0, 0]], np.float32), (4, 1))
    got = ev.oracle_recall(q, keys, 1.0, Bl, 1, 1, 2, "kvhead")
    e = np.exp(20.0)
    hot = (e + (4 * Bl - 1)) / (e + n - 1)          # heads 0-1: sink + hot block + 2 local blocks
    cold = 4 * Bl / n                               # heads 2-3: 4 of 12 blocks, uniform
    assert got == pytest.approx((hot + cold) / 2, rel=1e-9)


def test_recall_grows_with_topk(rows):
    # layer 5 is the first sparse layer: its queries and keys come from dense layers only, so they
    # are the same for every config, and for a non-DYNAMIC anchor a larger pick set is a superset of
    # the smaller one; its recall (dense mass inside the selection) can only grow. 1e-6: float32
    # rounding of the per-step recall sums.
    for anchor in ("quest", "block_mean"):
        rs = sorted((r for r in rows[1:] if r.anchor == anchor), key=lambda r: r.topk)
        rec = [r.layer_recall["5"] for r in rs]
        assert all(b >= a - 1e-6 for a, b in zip(rec, rec[1:])), rec
        assert rec[-1] > rec[0]
        # and the KL shrinks overall from the smallest to the largest budget
        assert rs[-1].mean_kl < rs[0].mean_kl


def test_shared_prefix_equals_fresh_prefill(model, ids, rows):
    # rewinding one prefilled engine must give what a fresh sparse engine gives, bit for bit
    cfg = [CONFIGS[1], ev.SparseConfig("dynamic", topk=6)]
    fresh = ev.decode_quality(model, ids, CTX, STEPS, cfg, block_len=B, fresh_prefill=True)
    shared = ev.decode_quality(model, ids, CTX, STEPS, cfg, block_len=B)
    assert fresh[0].mean_kl == rows[1].mean_kl
    for f, s in zip(fresh, shared):
        assert (f.mean_kl, f.max_kl, f.top1, f.recall, f.attended) == \
               (s.mean_kl, s.max_kl, s.top1, s.recall, s.attended)


def test_budget_arithmetic():
    # (1 + topk + 2) * 32 = budget * 4096
    assert [ev.topk_for_budget(b, 4096, 32) for b in ev.BUDGETS] == [5, 13, 29]
    assert ev.topk_for_budget(1 / 1024, 4096, 32) == 0
    assert ev.parse_budget("1/8") == 0.125 and ev.parse_budget("0.25") == 0.25
    with pytest.raises(ValueError):
        ev.parse_budget("2")
    cfgs = ev.make_configs(["quest", "fixed"], [1 / 16, 1 / 4], 4096, 32)
    assert [(c.anchor, c.topk) for c in cfgs] == [("quest", 5), ("quest", 29), ("fixed", 5), ("fixed", 29)]


def test_kl_helpers():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 50)).astype(np.float32)
    la = ev.log_softmax(a)
    assert np.allclose(np.exp(la).sum(-1), 1.0, atol=1e-12)
    assert np.all(ev.kl_divergence(la, la) == 0.0)
    lb = ev.log_softmax(a + rng.standard_normal((3, 50)).astype(np.float32))
    assert np.all(ev.kl_divergence(la, lb) > 0.0)


def test_passkey_prompt_and_eval(model):
    # the synthetic vocabulary is nearly byte-level: about one token per character
    runner = ev.PrefixRunner(model, 1024, block_len=B)
    tok = runner.engine.tokenize
    n = 900
    for depth in (0.0, 0.5, 1.0):
        hay, q = ev.passkey_prompt(tok, n, depth, 12345)
        total = len(hay) + len(q)
        unit = len(tok(ev.FILLER, add_bos=False))
        # fits, and misses the target by less than two filler units (one unit is cut per retry)
        assert n - 2 * unit < total <= n
        # (this vocabulary's pieces keep SentencePiece's word-start mark; BOS is rendered)
        text = runner.engine.detokenize(hay[1:]).replace("\u2581", " ")
        at = text.index("The pass key is 12345")
        fill = text[len(ev.HEADER):].replace("The pass key is 12345. Remember it. 12345 is the pass key. ", "")
        # the needle sits at ``depth`` of the filler, to within one filler sentence group
        assert abs((at - len(ev.HEADER)) - depth * len(fill)) <= len(ev.FILLER) + 1
        # (lstrip: this SPM vocabulary also adds a dummy-prefix space; Gemma's does not)
        assert runner.engine.detokenize(q).replace("\u2581", " ").lstrip(" ") == ev.QUESTION
    with pytest.raises(ValueError):
        ev.passkey_prompt(tok, 100, 0.5, 12345)
    samples = ev.passkey_eval(runner, [600], [0.5], 2, ["quest"], [1 / 4], seed=1)
    assert len(samples) == 2 and samples[0].key != samples[1].key
    for s in samples:
        assert set(s.correct) == {"dense", "quest"} and s.target == 600 and s.length <= 600
        assert all(v == (str(s.key) in s.answers[k]) for k, v in s.correct.items())
    table = ev.format_passkey_table(samples).splitlines()
    assert [ln.split()[0] for ln in table[2:]] == ["dense", "quest"]


def test_recall_target_row(model, ids):
    """A --recall-target configuration runs through the harness: labelled, no oracle (it has
    no fixed block count). On this random-weight model the blocks' estimated masses are nearly flat, so
    a target of 0.5 takes about half the context and 0.99 nearly all of it."""
    rows = ev.decode_quality(model, ids, CTX, STEPS,
                             [ev.SparseConfig("quest", 0, recall_target=t) for t in (0.5, 0.99)],
                             block_len=B)
    assert [r.anchor for r in rows] == ["quest@rt0.5", "quest@rt0.99"]
    assert all(r.oracle is None and r.sparse_steps == STEPS for r in rows)
    assert 0 < rows[0].attended < rows[1].attended <= 1
    assert rows[0].recall <= rows[1].recall + 1e-6
