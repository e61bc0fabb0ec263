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
    policies = ["full", "streaming", "h2o", "snapkv", "full+merge0.5"]
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1,
                            dashboard_address=None) as client:
        pre, rows = ev.run_grid(client, model, CTX, prompts, policies, [0.3, 0.6], 32,
                                str(tmp_path), log=lambda s: None)
    assert len(pre) == 3 and len(rows) == 3 * (2 + 3 * 2)
    for r in rows:
        if r["policy"] == "full+merge0.5":       # merging only: never more than the baseline
            assert 0 < r["memory_fraction"] <= 1.0 + 1e-9 and r["fraction"] == 1.0
        elif r["policy"] == "full":
            assert r["memory_fraction"] == pytest.approx(1.0)
            if r["kind"] == "text":
                # the full row reloads the state the reference continued from: same logits
                assert r["kl"] == 0.0 and r["top1"] == 1.0
            else:
                assert r["passkey_ok"] == r["full_passkey_ok"]
        else:
            # whole blocks of 32 and the floors of small budgets: within a block per layer
            assert r["memory_fraction"] < r["fraction"] + 0.35
            assert r["bytes_held"] > 0
        if r["kind"] == "text":
            assert r["kl"] >= 0.0 and 0.0 <= r["top1"] <= 1.0
    s = ev.summarize(rows)
    assert {(x["policy"], x["fraction"]) for x in s} == \
        {("full", 1.0), ("full+merge0.5", 1.0)} | {(p, f) for p in policies[1:4] for f in (0.3, 0.6)}
    assert "mean KL" in ev.format_table(s)
    ev.plot(s, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_split_policy():
    assert ev.split_policy("h2o") == ("h2o", 0.0)
    assert ev.split_policy("snapkv+merge0.9") == ("snapkv", 0.9)
    for bad, msg in (("lru", "unknown policy"), ("h2o+merge", "merge threshold"),
                     ("h2o+merge1.5", "merge threshold"), ("h2o+mergex", "merge threshold")):
        with pytest.raises(ValueError, match=msg):
            ev.split_policy(bad)
