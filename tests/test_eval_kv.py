"""tools.eval_kv on a tiny synthetic gemma3 model and an in-process Dask cluster."""
from __future__ import annotations

import numpy as np
import pytest

from tools import eval_kv as ev
from tools.write_synthetic_gguf import SynthSpec, write

distributed = pytest.importorskip("dask.distributed")

CTX = 900        # the byte-level vocabulary spends a token per character


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    spec = SynthSpec(arch="gemma3", n_layer=6, n_embd=64, n_head=4, n_head_kv=1, head_dim=32,
                     n_ff=128, vocab_size=400, sliding_window=48, rope_base=1e6,
                     rope_base_swa=1e4, rms_eps=1e-6, n_ctx=1024, seed=4)
    return write(tmp_path_factory.mktemp("evkv") / "g3.gguf", spec)


def test_budget_for_matches_the_fraction():
    held = [40, 40, 40, 300]
    n = ev.budget_for(0.5, held, 1)
    assert abs(np.minimum(n, held).sum() - 0.5 * sum(held)) <= 3
    assert ev.budget_for(1.0, held, 1) == 300
    assert ev.budget_for(0.01, held, 50) == 50


def test_grid_rows(model, tmp_path):
    prompts = ev.make_prompts(model, CTX, 1, 6, 2, lengths=(780, 890), depths=(0.3, 0.7))
    assert [p.kind for p in prompts] == ["text", "passkey", "passkey"]
    assert len({len(p.prefix) for p in prompts}) >= 2            # the lengths differ
    assert all(len(p.prefix) + len(p.tail) <= CTX for p in prompts)
    policies = ["full", "streaming", "h2o+depth2+obs1", "snapkv", "full+merge0.5"]
    kvs = ("f16", "q8_0/q4_0+rot")
    q = (34 + 18) / (2 * 2 * 32)            # q8_0 K + q4_0 V bytes per f16 byte
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1,
                            dashboard_address=None) as client:
        pre, rows = ev.run_grid(client, model, CTX, prompts, policies, [0.3, 0.6], 32,
                                str(tmp_path), kvs, log=lambda s: None)
    assert len(pre) == 3 * 2 and len(rows) == 2 * 3 * (2 + 3 * 2)
    assert {r["kv"] for r in pre} == set(kvs)
    # the reference answers come from the f16 prefill only
    assert all(("answer" in r) == (r["kv"] == "f16") for r in pre if r["name"].startswith("passkey"))
    budgets = {}
    ref = {r["name"]: r for r in pre if r["kv"] == "f16"}
    got = {(r["name"], r["kv"]): r for r in pre}
    for r in rows:
        if r["policy"] not in ("full", "full+merge0.5"):
            # each prompt's budget from its own baseline (the passkeys' lengths differ)
            p = got[(r["prompt"], r["kv"])]
            share = min(r["fraction"] / (p["baseline_bytes"] / p["f16_bytes"]), 1.0)
            assert r["budget"] == ev.budget_for(share, ref[r["prompt"]]["held"],
                                                ev.budget_floor(r["policy"], 32))
        quant = r["kv"] != "f16"
        if r["policy"] == "full+merge0.5":       # merging only: never more than the baseline
            assert 0 < r["memory_fraction"] <= (q if quant else 1.0) + 1e-9
            assert r["fraction"] == 1.0
        elif r["policy"] == "full":
            # the same blocks as the baseline, at q8_0/q4_0's share of f16's bytes
            assert r["memory_fraction"] == pytest.approx(q if quant else 1.0)
            if r["kind"] == "text" and not quant:
                # the full row reloads the state the reference continued from: same logits
                assert r["kl"] == 0.0 and r["top1"] == 1.0
            elif not quant:
                assert r["passkey_ok"] == r["full_passkey_ok"]
        else:
            # whole blocks of 32 and the floors of small budgets: within a block per layer
            assert r["memory_fraction"] < r["fraction"] + 0.35
            assert r["bytes_held"] > 0
            if quant and r["fraction"] >= q:     # fits without evicting: nothing dropped
                assert r["memory_fraction"] == pytest.approx(q)
            budgets[(r["policy"], r["kv"], r["fraction"])] = r["budget"]
        if r["kind"] == "text":
            assert r["kl"] >= 0.0 and 0.0 <= r["top1"] <= 1.0
    # at equal memory the smaller cache type holds more tokens
    assert budgets[("h2o+depth2+obs1", "q8_0/q4_0+rot", 0.3)] > \
        budgets[("h2o+depth2+obs1", "f16", 0.3)]
    s = ev.summarize(rows)
    assert {(x["policy"], x["kv"], x["fraction"]) for x in s} == \
        {("full", k, 1.0) for k in kvs} | {("full+merge0.5", k, 1.0) for k in kvs} | \
        {(p, k, f) for p in policies[1:4] for k in kvs for f in (0.3, 0.6)}
    table = ev.format_table(s)
    assert "mean KL" in table and "h2o+depth2+obs1@q8_0/q4_0+rot" in table and "95% CI" in table
    for x in s:
        k, n = (int(v) for v in x["passkeys"].split("/"))
        assert (x["pk_lo"], x["pk_hi"]) == ev.wilson(k, n) and x["windows"] == 1
    ev.plot(s, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_parse_policy_and_kv():
    assert ev.parse_policy("h2o") == ("h2o", {})
    assert ev.parse_policy("snapkv+merge0.9") == ("snapkv", {"kv_merge": 0.9})
    assert ev.parse_policy("h2o+depth3+recent64") == ("h2o", {"kv_depth_ratio": 3.0,
                                                             "kv_recent": 64})
    for bad, msg in (("lru", "unknown policy"), ("h2o+merge", "merge threshold"),
                     ("h2o+merge1.5", "merge threshold"), ("h2o+mergex", "merge threshold"),
                     ("h2o+depth0.5", "depth ratio"), ("h2o+depthnan", "depth ratio"),
                     ("h2o+recent0", "recent window"), ("h2o+depth2+depth3", "twice"),
                     ("h2o+lsh", "unknown suffix"), ("full+depth2", "only \\+merge"),
                     ("pyramidkv+depth2", "own depth schedule"), ("h2o+obs0", "observation"),
                     ("snapkv+obs1", "applies to h2o"), ("h2o+nbr0", "neighbour radius"),
                     ("h2o+nbr1.5", "neighbour radius"), ("streaming+nbr2", "applies to h2o, "),
                     ("full+nbr2", "applies to h2o, ")):
        with pytest.raises(ValueError, match=msg):
            ev.parse_policy(bad)
    assert ev.parse_policy("h2o+obs1.5") == ("h2o", {"kv_obs_weight": 1.5})
    assert ev.parse_policy("h2o+depth3+obs1+recent256+nbr4") == (
        "h2o", {"kv_depth_ratio": 3.0, "kv_obs_weight": 1.0, "kv_recent": 256,
                "kv_neighbours": 4})
    assert ev.parse_policy("snapkv+nbr2") == ("snapkv", {"kv_neighbours": 2})
    assert ev.parse_policy("h2o+chunk64") == ("h2o", {"batch_size": 64})
    with pytest.raises(ValueError, match="prefill chunk"):
        ev.parse_policy("h2o+chunk0")
    assert ev.parse_kv("f16") == ("f16", "f16", False)
    assert ev.parse_kv("q8_0/q4_0+rot") == ("q8_0", "q4_0", True)
    for bad, msg in (("q3_0", "not one of"), ("q8_0/x", "not one of"), ("q8_0+r", "only suffix")):
        with pytest.raises(ValueError, match=msg):
            ev.parse_kv(bad)


def test_reuse_prefill_and_bounded_engines(model, tmp_path):
    """--reuse-prefill takes an earlier run's stage 1 (same prompts and types) and gives the
    same rows; a changed prompt is prefilled again. A worker keeps at most MAX_ENGINES."""
    prompts = ev.make_prompts(model, CTX, 1, 6, 0)
    kw = dict(log=lambda s: None)
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1,
                            dashboard_address=None) as client:
        pre1, rows1 = ev.run_grid(client, model, CTX, prompts, ["full", "h2o"], [0.3, 0.6], 32,
                                  str(tmp_path), ("f16", "q8_0"), True, **kw)
        assert all(r["prefill_s"] > 0 for r in pre1)
        assert len(ev._ENGINES) <= ev.MAX_ENGINES        # 2 prefill + 6 policy configurations
        pre2, rows2 = ev.run_grid(client, model, CTX, prompts, ["full", "h2o"], [0.3, 0.6], 32,
                                  str(tmp_path), ("f16", "q8_0"), True, **kw)
        assert all(r["prefill_s"] == 0.0 for r in pre2)
        skip = ("decode_tok_s", "engines_loaded")              # timing and a worker counter
        assert [{k: v for k, v in r.items() if k not in skip} for r in rows1] == \
            [{k: v for k, v in r.items() if k not in skip} for r in rows2]
        other = [ev.Prompt(prompts[0].name, "text", prompts[0].prefix[1:],
                           prompts[0].tail)]                  # same name, another prompt
        pre3, _ = ev.run_grid(client, model, CTX, other, ["full"], [0.5], 32, str(tmp_path),
                              ("f16",), True, **kw)
        assert pre3[0]["prefill_s"] > 0


def test_command_line_run_reuses_engines(model, tmp_path):
    """``python -m tools.eval_kv`` on one worker process: the tasks of a configuration share
    its engine (run as __main__, the task functions reached the workers pickled by value with
    a fresh engine cache each, and every task loaded an engine: the workers ran out of
    memory). CSV and table written."""
    import csv
    import os
    import subprocess
    import sys
    out = tmp_path / "out"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "tools.eval_kv", str(model), "--ctx", str(CTX),
                        "--windows", "2", "--steps", "4", "--passkeys", "1", "--policies",
                        "full,h2o", "--kv-types", "f16", "--fractions", "0.5", "--workers", "1",
                        "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mean KL" in r.stdout
    with open(out / "eval_kv.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6                                   # 3 prompts x (full, h2o@0.5)
    # one prefill engine, then one per configuration (full; h2o at each budget: the windows
    # share theirs, the shorter passkey prompt has its own): 4 loads for 9 tasks
    assert len({r["budget"] for r in rows if r["policy"] == "h2o"}) == 2
    assert max(int(r["engines_loaded"]) for r in rows) == 4
    assert "seed 0 (development): 2 text windows, 1 passkey prompts" in r.stdout


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "pyramidkv", "h2o+recent256",
                                    "h2o+depth3+obs1+recent256", "snapkv+depth5",
                                    "streaming+depth2+recent40"])
def test_budget_floor_is_a_budget_the_policy_accepts(policy):
    """The grid's smallest budget passes the engine's check in every layer (a small fraction
    once asked h2o+recent256 for 138 tokens and stopped the whole grid)."""
    from pyimp.kv.policy import PolicyOptions
    base, opts = ev.parse_policy(policy)
    floor = ev.budget_floor(policy, 32)
    o = PolicyOptions(base, budget=floor, keep=4, recent=opts.get("kv_recent", 0), obs_window=32,
                      depth_ratio=opts.get("kv_depth_ratio", 1.0))
    o.validate()
    profiled = [il % 6 == 5 for il in range(18)]            # gemma3: every sixth layer global
    b = o.layer_budgets(18, profiled)
    assert all(int(x) > 4 + max(o.window_for(int(x)), 32) for x in b)


def test_fractions_below_a_policy_floor_are_skipped(model, tmp_path):
    """A fraction whose budget would fall under the policy's smallest one is skipped with a
    line, not reported under that fraction at the floor's memory."""
    prompts = ev.make_prompts(model, CTX, 1, 6, 0)
    said = []
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1,
                            dashboard_address=None) as client:
        _, rows = ev.run_grid(client, model, CTX, prompts, ["h2o+recent200"], [0.05, 0.9], 32,
                              str(tmp_path), log=said.append)
    assert [r["fraction"] for r in rows] == [0.9]
    assert any(s.startswith("skipped h2o+recent200 at 0.05") for s in said)


def test_passkey_cases_by_seed():
    """A seed gives the same cases every time (and its first n for any larger n); two seeds
    never share a key, development and held-out seeds included; lengths and depths within
    their ranges and spread over them."""
    from tools.eval_sparse import KEYS_PER_SEED, passkey_cases
    a = passkey_cases(ev.HELD_OUT_SEED, 40)
    assert a == passkey_cases(ev.HELD_OUT_SEED, 40)
    assert passkey_cases(ev.HELD_OUT_SEED, 5) == a[:5]
    assert len({c.key for c in a}) == 40
    assert all(10000 <= c.key < 100000 and 2048 <= c.length <= 4096 and 0.1 <= c.depth <= 0.9
               for c in a)
    assert max(c.length for c in a) - min(c.length for c in a) > 1000
    assert max(c.depth for c in a) - min(c.depth for c in a) > 0.4
    held = {c.key for c in passkey_cases(ev.HELD_OUT_SEED, KEYS_PER_SEED)}
    for s in list(ev.DEV_SEEDS) + [ev.HELD_OUT_SEED + 1]:
        other = passkey_cases(s, KEYS_PER_SEED)
        assert held.isdisjoint(c.key for c in other)
        assert [c.length for c in other[:40]] != [c.length for c in a]
    b = passkey_cases(3, 4, lengths=(700, 700), depths=(0.5, 0.5))
    assert {(c.length, c.depth) for c in b} == {(700, 0.5)}
    for bad in (dict(seed=90, n=1), dict(seed=-1, n=1), dict(seed=0, n=KEYS_PER_SEED + 1),
                dict(seed=0, n=1, lengths=(10, 5)), dict(seed=0, n=1, depths=(0.5, 1.5))):
        with pytest.raises(ValueError):
            passkey_cases(**bad)


def test_window_starts_split_development_and_held_out_text():
    ctx, n_ids = 4096, 112659
    dev = {s: ev.window_starts(n_ids, ctx, 8, s) for s in ev.DEV_SEEDS}
    held = ev.window_starts(n_ids, ctx, 8, ev.HELD_OUT_SEED)
    assert held == ev.window_starts(n_ids, ctx, 8, ev.HELD_OUT_SEED)
    assert all(a + ctx - 1 <= ev.DEV_TEXT_TOKENS for w in dev.values() for a in w)
    assert all(a >= ev.DEV_TEXT_TOKENS and a + ctx - 1 <= n_ids for a in held)
    assert all(b - a >= ctx - 1 for w in [held] + list(dev.values()) for a, b in zip(w, w[1:]))
    assert len({tuple(w) for w in dev.values()}) > 1          # the seed picks the windows
    assert set(ev.window_starts(n_ids, ctx, 3, ev.HELD_OUT_SEED)) <= set(held)
    with pytest.raises(ValueError, match="held-out text holds"):
        ev.window_starts(n_ids, ctx, 12, ev.HELD_OUT_SEED)


def test_prompts_by_seed_are_reproducible_and_disjoint(model):
    """The same seed gives the same prompts token for token; a development and a held-out
    seed share no key and no text."""
    kw = dict(lengths=(500, 880))
    dev = ev.make_prompts(model, CTX, 2, 6, 3, 0, **kw)
    assert dev == ev.make_prompts(model, CTX, 2, 6, 3, 0, **kw)
    held = ev.make_prompts(model, CTX, 2, 6, 3, ev.HELD_OUT_SEED, **kw)
    keys = lambda ps: {p.key for p in ps if p.kind == "passkey"}           # noqa: E731
    assert len(keys(held)) == 3 and keys(dev).isdisjoint(keys(held))
    starts = lambda ps: [int(p.name[4:]) for p in ps if p.kind == "text"]  # noqa: E731
    assert all(a + CTX - 1 <= ev.DEV_TEXT_TOKENS for a in starts(dev))
    assert all(a >= ev.DEV_TEXT_TOKENS for a in starts(held))
    assert {p.name for p in dev}.isdisjoint(p.name for p in held)
    # the passkey prompts ask for their case's length and hold its key once or twice
    from tools.eval_sparse import passkey_cases
    for p, c in zip([p for p in held if p.kind == "passkey"],
                    passkey_cases(ev.HELD_OUT_SEED, 3, (500, 880))):
        assert p.key == c.key and len(p.prefix) + 1 <= c.length
    with pytest.raises(ValueError, match="exceed --ctx"):
        ev.make_prompts(model, CTX, 0, 6, 1, 0, lengths=(500, CTX + 1))


def test_wilson_and_mean_intervals():
    lo, hi = ev.wilson(8, 16)
    assert (round(lo, 3), round(hi, 3)) == (0.280, 0.720)
    assert ev.wilson(16, 16)[1] == 1.0 and round(ev.wilson(16, 16)[0], 3) == 0.806
    assert ev.wilson(0, 16)[0] == 0.0 and round(ev.wilson(0, 16)[1], 3) == 0.194
    assert ev.wilson(0, 0) == (0.0, 1.0)
    m, lo, hi = ev.mean_interval([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and round(hi - m, 4) == round(3.182 * np.std([1, 2, 3, 4], ddof=1) / 2, 4)
    assert np.isnan(ev.mean_interval([1.0])[1])


def test_shorter_prompts_run_at_the_floor_and_are_marked(model, tmp_path):
    """A fraction that a policy's smallest budget meets on the long prompt but not on the
    short one: the short one runs at that budget, marked at_floor; --from-csv --drop-floor
    leaves that prompt out of every configuration."""
    import csv
    prompts = ev.make_prompts(model, CTX, 1, 6, 1, lengths=(450, 450))
    said = []
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1,
                            dashboard_address=None) as client:
        _, rows = ev.run_grid(client, model, CTX, prompts, ["streaming", "h2o+recent200"], [0.5],
                              32, str(tmp_path), log=said.append)
    marks = {(r["policy"], r["kind"]): r["at_floor"] for r in rows}
    assert marks == {("streaming", "text"): 0, ("streaming", "passkey"): 0,
                     ("h2o+recent200", "text"): 0, ("h2o+recent200", "passkey"): 1}
    assert any("h2o+recent200 at 0.5" in x and "on 1 of 2 prompts" in x for x in said)
    floor = next(r for r in rows if r["at_floor"])
    assert floor["memory_fraction"] > 0.5 * 1.05 and \
        floor["budget"] == ev.budget_floor("h2o+recent200", 32)
    assert {x["policy"]: x["at_floor"] for x in ev.summarize(rows)} == \
        {"streaming": 0, "h2o+recent200": 1}
    path = tmp_path / "rows.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    back = ev.read_rows([str(path)])
    assert ev.format_table(ev.summarize(back)) == ev.format_table(ev.summarize(rows))
    kept = ev.read_rows([str(path)], drop_floor=True)
    assert {r["kind"] for r in kept} == {"text"} and len(kept) == 2


def test_chunked_prefill_through_the_policy(model, tmp_path):
    """+chunkN prefills the prompt through the policy engine in chunks of N: a budget over the
    context is full attention (up to the chunking's float order), a smaller one evicts during
    the prefill and holds the memory."""
    prompts = ev.make_prompts(model, CTX, 1, 6, 1, lengths=(850, 890))
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1,
                            dashboard_address=None) as client:
        _, rows = ev.run_grid(client, model, CTX, prompts, ["h2o", "h2o+chunk64"], [0.3, 1.0],
                              32, str(tmp_path), log=lambda s: None)
    by = {(r["policy"], r["fraction"], r["kind"]): r for r in rows}
    # the chunked engines score as pyimp-run's: h2o's importance from every prompt row
    chunked = [e for k, e in ev._ENGINES.items() if k[2] == 64]
    assert chunked and all(e.sparse.opts.importance_window == 0 for e in chunked)
    full = by[("h2o+chunk64", 1.0, "text")]
    assert full["kl"] < 1e-6 and full["top1"] == 1.0
    small = by[("h2o+chunk64", 0.3, "text")]
    assert small["kl"] > 1e-4 and small["memory_fraction"] < 0.3 + 0.35
    assert small["kl"] != by[("h2o", 0.3, "text")]["kl"]
