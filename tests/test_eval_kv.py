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
    prompts = ev.make_prompts(model, CTX, 1, 6, 2, [0.3, 0.7])
    assert [p.kind for p in prompts] == ["text", "passkey", "passkey"]
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
    for r in rows:
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
    assert "mean KL" in table and "h2o+depth2+obs1@q8_0/q4_0+rot" in table
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
                     ("snapkv+obs1", "applies to h2o")):
        with pytest.raises(ValueError, match=msg):
            ev.parse_policy(bad)
    assert ev.parse_policy("h2o+obs1.5") == ("h2o", {"kv_obs_weight": 1.5})
    assert ev.parse_kv("f16") == ("f16", "f16", False)
    assert ev.parse_kv("q8_0/q4_0+rot") == ("q8_0", "q4_0", True)
    for bad, msg in (("q3_0", "not one of"), ("q8_0/x", "not one of"), ("q8_0+r", "only suffix")):
        with pytest.raises(ValueError, match=msg):
            ev.parse_kv(bad)


def test_reuse_prefill_and_bounded_engines(model, tmp_path):
    """--reuse-prefill takes an earlier run's stage 1 (same prompts and types) and gives the
    same rows; a changed prompt is prefilled again. A worker keeps at most MAX_ENGINES."""
    prompts = ev.make_prompts(model, CTX, 1, 6, 0, [0.5])
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
                        "--windows", "1", "--steps", "4", "--passkeys", "1", "--policies",
                        "full,h2o", "--kv-types", "f16", "--fractions", "0.5", "--workers", "1",
                        "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "mean KL" in r.stdout
    with open(out / "eval_kv.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4                                   # 2 prompts x (full, h2o@0.5)
    # one prefill engine, then one per configuration (full, h2o): 3 loads for 6 tasks
    assert max(int(r["engines_loaded"]) for r in rows) == 3


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "pyramidkv", "h2o+recent256",
                                    "h2o+depth3+obs1+recent256", "snapkv+depth5",
                                    "streaming+depth2+recent40"])
def test_budget_floor_is_a_budget_the_policy_accepts(policy):
    """The grid's smallest budget passes the engine's check in every layer (a small fraction
    once asked h2o+recent256 for 138 tokens and stopped the whole grid)."""
    from pyimp.kv_policy import PolicyOptions
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
    prompts = ev.make_prompts(model, CTX, 1, 6, 0, [0.5])
    said = []
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1,
                            dashboard_address=None) as client:
        _, rows = ev.run_grid(client, model, CTX, prompts, ["h2o+recent200"], [0.05, 0.9], 32,
                              str(tmp_path), log=said.append)
    assert [r["fraction"] for r in rows] == [0.9]
    assert any(s.startswith("skipped h2o+recent200 at 0.05") for s in said)
