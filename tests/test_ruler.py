"""RULER's synthetic tasks (tools.ruler): deterministic from the seed, fitted to the length asked,
the references where RULER puts them, RULER's scoring; tools.eval_ruler's table."""
from __future__ import annotations

import re

import pytest

from tools import ruler
from tools.eval_ruler import format_markdown, summarize


def tokenize(text: str) -> list:
    """A stand-in tokenizer: one token per 4 bytes (the real ones are slower to run here)."""
    return list(range(-(-len(text.encode()) // 4)))


@pytest.mark.parametrize("task", ruler.TASKS)
def test_a_seed_gives_the_same_case_and_another_seed_another(task):
    a = ruler.make_case(task, 1000, 3, 2048, tokenize)
    assert a == ruler.make_case(task, 1000, 3, 2048, tokenize)
    assert a.prompt != ruler.make_case(task, 1001, 3, 2048, tokenize).prompt
    assert a.prompt != ruler.make_case(task, 1000, 4, 2048, tokenize).prompt
    assert a.max_new_tokens == ruler.GENERATE[task]


@pytest.mark.parametrize("task", ruler.TASKS)
@pytest.mark.parametrize("n", [2048, 8192])
def test_cases_fill_the_length_asked(task, n):
    """At most n tokens, and within one haystack unit of it (a noise sentence, an essay word,
    a needle line, a list entry: at most 40 tokens of the stand-in tokenizer)."""
    c = ruler.make_case(task, 7, 0, n, tokenize)
    assert c.n_tokens == len(tokenize(c.prompt)) and n - 40 <= c.n_tokens <= n


@pytest.mark.parametrize("task", list(ruler.NIAH))
def test_niah_needles_hold_the_answers_for_the_keys_asked(task):
    c = ruler.make_case(task, 1000, 1, 4096, tokenize)
    hay, _, v_kind, n_keys, n_values, n_queries = ruler.NIAH[task]
    query = c.prompt.rsplit("What are all the special magic", 1)[1]
    found = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", c.prompt)
    held = {}
    for k, v in found:
        held.setdefault(k, []).append(v)
    asked = [k for k in held if k in query]
    assert len(asked) == n_queries
    assert sorted(c.answers) == sorted(v for k in asked for v in held[k])
    assert len(c.answers) == n_queries * n_values
    if hay != "needle":
        assert len(found) == n_keys * n_values               # distractor keys for multikey
    else:
        assert len(found) > 50                               # the haystack is needles
    pattern = {"numbers": r"\d{7}", "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-"}[v_kind]
    assert all(re.match(pattern, a) for a in c.answers)


def test_variable_tracking_chain_in_order():
    c = ruler.make_case("vt", 1000, 0, 2048, tokenize)
    value = re.search(r"assigned the value (\d+) in the text", c.prompt).group(1)
    lines = re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", c.prompt)
    assert lines[0] == (c.answers[0], value)
    for (prev, _), (name, src) in zip(lines, lines[1:]):
        assert src == f"VAR {prev}"
    assert [n for n, _ in lines] == list(c.answers)


def test_common_words_are_the_ten_that_repeat_thirty_times():
    c = ruler.make_case("cwe", 1000, 0, 4096, tokenize)
    words = re.findall(r"\d+\. (\w+)", c.prompt.split("\nQuestion:")[0])
    counts = {w: words.count(w) for w in set(words)}
    assert {w for w, n in counts.items() if n == ruler.CWE_FREQ} == set(c.answers)
    assert max(n for w, n in counts.items() if w not in c.answers) == ruler.CWE_RARE_FREQ


def test_frequent_words_are_the_three_most_frequent():
    c = ruler.make_case("fwe", 1000, 0, 4096, tokenize)
    body = c.prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    words = body.split(" .... ")
    counts = sorted(((words.count(w), w) for w in set(words)), reverse=True)
    assert {w for _, w in counts[:3]} == set(c.answers)
    assert counts[2][0] > counts[3][0]                       # no tie for third place here


def test_rulers_scoring():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert ruler.string_match_all("only 123", ["123", "456"]) == 0.5
    assert ruler.string_match_all("UUID ABC-def", ["abc-DEF"]) == 1.0
    assert ruler.string_match_part("only 123", ["123", "456"]) == 1.0
    assert ruler.string_match_part("nothing", ["123", "456"]) == 0.0


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="unknown RULER task 'qa_1'"):
        ruler.make_case("qa_1", 0, 0, 1024, tokenize)
    with pytest.raises(ValueError, match="needs more than 10 tokens"):
        ruler.make_case("niah_single_1", 0, 0, 10, tokenize)


def test_the_table_averages_tasks_with_case_counts():
    rows = [{"policy": "full", "kv": "f16", "fraction": 1.0, "task": t, "score": s,
             "kv_bytes": 4e6, "budget_tokens": 0}
            for t, scores in (("a", (1.0, 1.0, 0.0)), ("b", (0.5, 0.5, 0.5))) for s in scores]
    rows += [{"policy": "h2o", "kv": "f16", "fraction": 0.25, "task": "a", "score": 0.0,
              "kv_bytes": 1e6, "budget_tokens": b} for b in (1000, 1000, 1030)]
    table = format_markdown(summarize(rows), ["a", "b"])
    full = next(line for line in table.splitlines() if line.startswith("| full"))
    assert "66.7 [" in full and "| 50.0 [50, 50] |" in full
    assert full.endswith("| 58.3 | 0 | 4.0 (100 %) | 3 |")
    h2o = next(line for line in table.splitlines() if line.startswith("| h2o"))
    assert "| - |" in h2o and h2o.endswith("| 0.0 | 1010 | 1.0 (25 %) | 3 |")
    assert "Left out" not in table


def test_the_averages_leave_out_what_full_attention_cannot_do():
    """A task full attention (f16) scores 0 on is left out of every configuration's average
    and named under the table; the niah average covers the niah tasks only."""
    rows = [{"policy": p, "kv": "f16", "fraction": f, "task": t, "score": s, "kv_bytes": 2e6}
            for p, f, scores in (("full", 1.0, (1.0, 0.5, 0.0)), ("h2o", 0.5, (0.5, 0.0, 1.0)))
            for t, s in zip(("niah_single_1", "cwe", "vt"), scores)]
    table = format_markdown(summarize(rows), ["niah_single_1", "cwe", "vt"])
    h2o = next(line for line in table.splitlines() if line.startswith("| h2o"))
    # vt (full attention 0) is out: average (50 + 0) / 2, niah average 50; h2o's 100 on vt
    # would have raised its average to 50
    assert h2o.endswith("| 25.0 | 50.0 | - | 2.0 (100 %) | 1 |")       # no budget column given
    assert table.splitlines()[-1] == ("Left out of the averages (full attention, f16, scores 0 "
                                      "on them): vt.")


def _synthetic_case(tmp_path, task: str, n: int, max_new: int) -> tuple:
    """(model path, case, context ids, [(question ids, answers)], case fields) of seed 1000's
    first ``task`` case at ``n`` tokens on a small synthetic llama model."""
    import pyimp
    from tools.write_synthetic_gguf import SynthSpec, write
    path = write(tmp_path / "m.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4,
                                                n_head_kv=2, n_ff=128, vocab_size=512))
    eng = pyimp.load(path, n_ctx=16)
    c = ruler.make_case(task, 1000, 0, n, eng.tokenize)
    qs = [(eng.tokenize(q, add_bos=False), a) for q, a in c.questions]
    case = {"task": c.task, "seed": c.seed, "index": c.index, "max_new_tokens": max_new}
    return path, c, eng.tokenize(c.context), qs, case


def test_a_case_runs_under_full_attention_and_a_policy(tmp_path):
    """tools.eval_ruler.run_case on a small synthetic model: the row names its configuration,
    the budget in tokens per layer, and holds fewer KV bytes under h2o than under full."""
    from tools.eval_ruler import run_case
    path, c, ctx, qs, case = _synthetic_case(tmp_path, "niah_multikey_1", 1200, 4)
    full = run_case(path, 1400, ctx, qs, case, "full", "f16", 0.25)
    h2o = run_case(path, 1400, ctx, qs, case, "h2o", "f16", 0.25)
    once = run_case(path, 1400, ctx, qs, case, "h2o", "f16", 0.25, "once", str(tmp_path))
    assert len(full) == len(h2o) == len(once) == len(c.questions) == 4
    assert (full[0]["policy"], full[0]["fraction"], full[0]["budget_tokens"]) == ("full", 1.0, 0)
    assert (h2o[0]["policy"], h2o[0]["fraction"], h2o[0]["mode"]) == ("h2o", 0.25, "aware")
    assert h2o[0]["budget_tokens"] == once[0]["budget_tokens"] == max(64, round(0.25 * len(ctx)))
    assert 0 < h2o[0]["kv_bytes"] < full[0]["kv_bytes"] and 0 < once[0]["kv_bytes"] < full[0]["kv_bytes"]
    assert [r["answers"] for r in once] == ["|".join(a) for _, a in c.questions]
    assert all(r["score"] in (0.0, 1.0) for r in full + h2o + once)
    assert list(tmp_path.glob("*.pkv")) == []                # the saved context is removed
    nbr = run_case(path, 1400, ctx, qs[:1], case, "h2o+nbr2", "f16", 0.25)   # eval_kv's suffixes
    assert (nbr[0]["policy"], nbr[0]["budget_tokens"]) == ("h2o+nbr2", h2o[0]["budget_tokens"])


def test_block_sparse_configurations_parse_and_run(tmp_path):
    """sparse:MODE runs block-sparse decode at a block budget of fraction x the context; it
    holds the whole cache (the same KV bytes as full attention); bad names are refused."""
    from tools import eval_kv
    from tools.eval_ruler import _config, parse_sparse, run_case
    assert parse_sparse("sparse:quest@rt0.9") == dict(sparse=True, anchor="quest",
                                                      select="anchors", recall_target=0.9)
    assert parse_sparse("sparse:lowrank") == dict(sparse=True, select="lowrank")
    for bad, what in (("sparse:nope", "an anchor type"), ("sparse:quest@rt2", "recall target"),
                      ("sparse:lsh@rt0.5", "an anchor type")):
        with pytest.raises(ValueError, match=what):
            parse_sparse(bad)
    base, budget, opts = _config("sparse:quest", "f16", 0.25, 1200)
    # 0.25 x 1200 tokens = 9.4 blocks of 32: 9 blocks, init 1 + local 2 + 6 picked
    assert (base, opts["topk"], budget) == ("sparse", 6, 9 * 32)
    path, c, ctx, qs, case = _synthetic_case(tmp_path, "niah_single_1", 1200, 4)
    full = run_case(path, 1400, ctx, qs, case, "full", "f16", 1.0)
    sp = run_case(path, 1400, ctx, qs, case, "sparse:quest", "f16", 0.25)
    _, budget, opts = _config("sparse:quest", "f16", 0.25, len(ctx))
    assert (sp[0]["policy"], sp[0]["fraction"], sp[0]["budget_tokens"]) == ("sparse:quest", 0.25,
                                                                            budget)
    assert sp[0]["kv_bytes"] == full[0]["kv_bytes"]
    engines = [e for e in eval_kv._ENGINES.values() if e.sparse is not None
               and e.sparse.opts.topk == opts["topk"]]
    e = engines[-1] if engines else None
    assert e is not None and e.sparse.step > 0          # it decoded with a sparse state ...
    n = len(ctx) + len(qs[0][0])
    assert any(e.sparse.is_sparse_step(il, n) for il in range(e.cfg.n_layer))   # ... sparsely


def test_the_plot_has_a_panel_per_task(tmp_path):
    pytest.importorskip("matplotlib")
    from tools.eval_ruler import plot
    rows = [{"policy": p, "kv": "f16", "fraction": f, "task": t, "mean": m}
            for t in ("a", "b", "c") for p, f, m in (("full", 1.0, 0.5), ("h2o", 0.25, 0.1),
                                                     ("h2o", 0.5, 0.3))]
    plot(rows, ["a", "b", "c"], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_shared_prefills_give_the_direct_paths_rows(tmp_path, monkeypatch, arch):
    """tools.eval_ruler.run_case_shared (one full-attention prefill per prompt, tracking both
    importance windows, loaded and evicted by each configuration) gives run_case's rows (its
    own prefill per configuration and question), and each answer starts from the same state: bit-equal
    first logits, the same positions held in every layer (gemma3: sliding-window layers
    trimmed) and the same importance_ on them."""
    import pyimp
    from tools import eval_ruler as er
    from tools.write_synthetic_gguf import SynthSpec, write
    spec = (SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                      vocab_size=512) if arch == "llama" else
            SynthSpec(arch="gemma3", n_layer=4, n_embd=64, n_head=4, n_head_kv=1, head_dim=16,
                      n_ff=128, vocab_size=512, sliding_window=96, swa_pattern=2,
                      rope_base=1e6, rope_base_swa=1e4, seed=3))
    path = write(tmp_path / "m.gguf", spec)
    eng = pyimp.load(path, n_ctx=16)
    c = ruler.make_case("niah_multikey_1", 1000, 0, 640, eng.tokenize)
    ctx = eng.tokenize(c.context)
    qs = [(eng.tokenize(q, add_bos=False), a) for q, a in c.questions[:2]]
    case = {"task": c.task, "seed": c.seed, "index": c.index, "max_new_tokens": 3}
    starts = []
    answer = er.greedy_answer

    def recording(e, logits, n):
        blocks = [e.cache.slots(0, e.cache.slot_count(il), layer=il) for il in range(e.cfg.n_layer)]
        # streaming reads no importance (its engine tracks the default 128 rows, the shared
        # state every row), full attention tracks none when it prefills itself: compared where
        # a policy ranks by it
        imp = () if e.policy.opts.policy in ("streaming", "full") else tuple(
            e.sparse.importance_[il, b, r].tobytes() for il, (b, r) in enumerate(blocks))
        starts.append((repr(e.policy.opts), tuple(e.tokens), logits.tobytes(),
                       tuple(e.cache.positions(il).tobytes() for il in range(e.cfg.n_layer)),
                       imp))
        return answer(e, logits, n)

    monkeypatch.setattr(er, "greedy_answer", recording)
    policies = ["streaming", "h2o+nbr2+depth2", "snapkv", "pyramidkv+follow4"]
    assert all(er.shares_prefill(p) for p in policies + ["full"])
    assert not any(er.shares_prefill(p) for p in ("h2o+obs1", "snapkv+merge0.9", "full+merge0.9",
                                                  "sparse:quest"))
    # full attention decodes from the every-row prefill's engine, which tracks importance
    configs = [("full", 1.0, "aware")] + [(p, 0.25, m) for p in policies
                                          for m in ("aware", "once")]
    direct = [r for p, f, m in configs
              for r in er.run_case(path, 720, ctx, qs, case, p, "f16", f, m, str(tmp_path))]
    direct_starts, starts[:] = sorted(starts), []
    prefills = []
    ev = pyimp.Engine.eval

    def counting(self, tokens, *a, **kw):
        if len(tokens) >= len(ctx):
            prefills.append(len(tokens))
        return ev(self, tokens, *a, **kw)

    monkeypatch.setattr(pyimp.Engine, "eval", counting)
    shared = er.run_case_shared(path, 720, ctx, qs, case, configs, "f16", str(tmp_path))
    # one prefill per prompt serves both importance windows (every row, the observation
    # window): each question's prompt and, for "once", the context alone
    assert sorted(prefills) == sorted([len(ctx)] + [len(ctx) + len(q) for q, _ in qs])

    def key(r):
        return {k: v for k, v in r.items() if k not in ("seconds", "shared_s")}
    assert len(direct) == len(shared) == len(configs) * len(qs)
    assert sorted(map(repr, map(key, direct))) == sorted(map(repr, map(key, shared)))
    assert sorted(starts) == direct_starts and len(starts) == len(direct)
    assert len({s[3] for s in starts}) > len(policies)       # the policies kept different tokens
    assert sum(r["policy"] == "full" for r in shared) == len(qs)
    assert list(tmp_path.glob("*.pkv")) == []                # the shared states are removed


def test_rows_count_what_decoding_evicts(tmp_path):
    """h2o keeps evicting as the answer grows (a block of 32 slots at a time), snapkv only at the
    prefill's end; full attention never: the rows say how many tokens each generated and
    evicted meanwhile, and the KV bytes held at the answer's end."""
    from tools.eval_ruler import run_case
    path, c, ctx, qs, case = _synthetic_case(tmp_path, "vt", 600, 70)
    rows = {p: run_case(path, 720, ctx, qs, case, p, "f16", 0.25)[0]
            for p in ("full", "h2o", "snapkv")}
    assert all(r["generated"] == 70 for r in rows.values())      # no end of generation here
    assert rows["full"]["evicted_decoding"] == rows["snapkv"]["evicted_decoding"] == 0
    assert rows["h2o"]["evicted_decoding"] >= 2 * 32           # 70 steps: two whole blocks
    assert rows["h2o"]["kv_bytes_end"] <= rows["h2o"]["kv_bytes"] < rows["snapkv"]["kv_bytes_end"]


def test_also_adds_one_configuration_and_names_what_is_wrong(capsys):
    """--also POLICY,KV,FRACTION: one configuration outside the cross product (a KV type at
    one budget); a bad part is named in one line, before any model is loaded."""
    from tools.eval_ruler import main, parse_also
    assert parse_also("snapkv+follow8,q8_0/q4_0,0.25") == ("snapkv+follow8", "q8_0/q4_0", 0.25)
    assert parse_also("full,q8_0,0.5") == ("full", "q8_0", 1.0)     # full attention: no budget
    for bad, what in (("snapkv", "expected POLICY,KV,FRACTION"), ("snapkv,q9,0.5", "'q9'"),
                      ("snapkv,f16,0", "'0' must be a number in (0, 1]"),
                      ("snapkv+zz,f16,0.5", "+zz")):
        assert main(["--also", bad, "--out", "/nonexistent/x"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("eval_ruler: ") and what in err and err.count("\n") == 1, err


def test_from_csv_rebuilds_the_table_and_names_a_bad_file(tmp_path, capsys):
    """--from-csv: an earlier run's CSV gives the same table as its rows did, without running
    anything; a file that is no such CSV gets one line naming it."""
    import csv
    from tools.eval_ruler import main
    rows = [{"task": t, "policy": p, "kv": "f16", "fraction": f, "score": sc, "kv_bytes": b,
             "budget_tokens": bt}
            for t in ("niah_single_1", "cwe")
            for p, f, sc, b, bt in (("full", 1.0, 1.0, 4e6, 0), ("h2o", 0.25, 0.5, 2e6, 1024))]
    path = tmp_path / "eval_ruler.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert main(["--from-csv", str(path), "--out", str(tmp_path / "o")]) == 0
    md = (tmp_path / "o" / "eval_ruler.md").read_text()
    want = format_markdown(summarize(rows), ["niah_single_1", "cwe"])     # the task order kept
    assert md.endswith(want + "\n") and "| h2o | f16 | 0.25 | 50.0" in md
    capsys.readouterr()
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    for bad in (tmp_path / "bad.csv", tmp_path / "none.csv"):
        assert main(["--from-csv", str(bad), "--out", str(tmp_path / "o2")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"eval_ruler: --from-csv {bad}: ") and err.count("\n") == 1, err


def test_the_grid_writes_its_rows_as_they_finish(tmp_path, capsys):
    """main on a LocalCluster of one worker: the CSV holds a row per case and configuration
    (written as each Dask task finished, with a progress line each), the table and the plot
    come from them, and --from-csv rebuilds the same table."""
    import csv
    from tools.eval_ruler import main
    from tools.write_synthetic_gguf import SynthSpec, write
    path = write(tmp_path / "m.gguf", SynthSpec(arch="llama", n_layer=2, n_embd=64, n_head=4,
                                                n_head_kv=2, n_ff=128, vocab_size=512))
    out = tmp_path / "o"
    assert main([str(path), "--ctx", "600", "--cases", "2", "--tasks", "niah_single_1,vt",
                 "--policies", "full,h2o", "--fractions", "0.5", "--workers", "1",
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "eval_ruler.csv")))
    assert sorted((r["task"], r["index"], r["policy"]) for r in rows) == sorted(
        (t, str(i), p) for t in ("niah_single_1", "vt") for i in (0, 1) for p in ("full", "h2o"))
    err = capsys.readouterr().err
    assert "eval_ruler: 4 of 4 tasks (4 cases), 8 runs" in err        # one shared task a case
    md = (out / "eval_ruler.md").read_text()
    assert (out / "eval_ruler.png").exists() and "| h2o | f16 | 0.5 |" in md
    assert main(["--from-csv", str(out / "eval_ruler.csv"), "--tasks", "niah_single_1,vt",
                 "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "eval_ruler.md").read_text().split("\n\n", 1)[1] == \
        md.split("\n\n", 1)[1]
