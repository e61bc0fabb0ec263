"""RULER's synthetic tasks (:mod:`tools.ruler`) over KV policies on Dask: scores against memory.

    python -m tools.eval_ruler [MODEL] --ctx 4096 --cases 8 --seed 1000 [--tasks niah_single_1,vt]
        [--policies full,h2o,snapkv] [--fractions 0.25,0.5] [--kv-types f16] [--out DIR]
        [--modes aware,once] [--all-questions]     # policies take tools.eval_kv's suffixes: h2o+nbr4
        [--also snapkv+follow8,q8_0/q4_0,0.25]
    python -m tools.eval_ruler --scheduler tcp://host:8786 ...      # an existing Dask cluster
    python -m tools.eval_ruler --from-csv DIR/eval_ruler.csv --out DIR2   # table and plot again

The grid is task x case x policy x KV type x memory fraction. Besides the eviction policies,
``--policies`` takes block-sparse decode configurations, ``sparse:ANCHOR[@rtR]`` (an anchor type,
optionally with a recall target) or ``sparse:lowrank`` / ``lsh`` / ``sink_window`` /
``strided``: they keep the whole cache and attend, per step, blocks worth the fraction of the
context (their rows hold full attention's KV bytes). A case is RULER's prompt for
its task, fitted to ``--ctx`` tokens (answer prefix included), drawn by ``--seed``: seeds in
``DEV_SEEDS`` are for tuning, every other seed is held out, and a figure is only quoted from
held-out seeds. A policy keeps ``fraction`` x the context's tokens per layer (at least 64).
In mode ``aware`` (RULER's setting, and SCBench's question-aware compression) a task prefills
the context with the question after it and the policy evicts once both are in; in mode
``once`` (compress once, ask many) the context alone is prefilled and compressed (the
observation window is the context's end), saved as a prompt-cache file, and each question is
appended to the loaded state. ``--all-questions`` asks every question a context has (the
other keys of the multi-key needle tasks), so one compressed context answers several. Each
question's answer is decoded greedily (RULER's tokens to generate, stopping at the end of
generation) and scored with RULER's ``string_match_all``.

Output: ``DIR/eval_ruler.png`` (score against the budget, a panel per task),
``DIR/eval_ruler.csv`` (appended to as each Dask task finishes; one row per question run:
prediction, references, score, budget in tokens per layer, KV bytes held after the
compression and at the answer's end, the tokens generated and those evicted while generating
them: h2o and streaming keep evicting as an answer grows, seconds) and a markdown table per
policy and fraction of each task's mean score with its 95 % t interval over the cases, the
case count, and the average over the tasks (on stdout and in ``DIR/eval_ruler.md``).

Shared prefills: every policy evicts once, at the end of its one-chunk prefill, from the
importance that prefill accumulated, so the policies of a prompt need not prefill it each:
a Dask task per case prefills each of its prompts once, with a full-attention engine that
tracks importance under both windows the policies read (every row for h2o and streaming, the
observation window for snapkv and pyramidkv: ``second_window``), saves a state per window
(raw: a work file read back at once), and each configuration loads its window's state, evicts
and decodes (:func:`run_case_shared`); full attention decodes from the prefill's own engine
(tracking importance changes no attention output). The rows are the ones each
configuration's own prefill gives (tests/test_ruler.py checks them, the logits and the kept
positions and importance against :func:`run_case`); ``+merge`` and ``+obs`` run their own
prefills, and ``--direct`` runs every configuration that way.

The table's averages leave out the tasks full attention (f16) scores 0 on (the model's limits,
not the policies'), and its ``KV MB`` column gives the KV held after the compression with its
share of full attention's f16 KV, beside the budget in tokens per layer.
``--also POLICY,KV,FRACTION`` adds one configuration outside the cross product (a KV type at
one budget).

Dask: a ``LocalCluster`` of ``--workers`` single-threaded processes by default, or
``--scheduler``; workers keep an engine per configuration (``tools.eval_kv``'s cache).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import numpy as np

from loaders.gguf_file import GGUFError
from tools import ruler
from pyimp.kv.policy import PolicyOptions
from tools.eval_kv import (dask_client, greedy_answer, kv_options, mean_interval, parse_kv,
                           parse_policy, worker_engine)

DEV_SEEDS = range(0, 100)          # tuning; figures come from the other seeds
SPARSE_PREFIX = "sparse:"          # block-sparse decode configurations (see parse_sparse)
SPARSE_BLOCK = 32                  # their block length (the engine's default)


def parse_sparse(name: str) -> dict:
    """``"sparse:quest"`` -> the engine's block-sparse options without the budget: ``sparse:``
    and an anchor type (``quest``, ``cuboid_mean``, ...), optionally ``@rtR`` (a recall target
    R in (0, 1)), or a selection mode other than the anchors (``lowrank``, ``lsh``,
    ``sink_window``, ``strided``). Such a configuration keeps the whole KV cache and attends,
    per decode step, the blocks its selection picks: its fraction is the share of the context
    a step reads, not the memory held. ValueError naming the part that is wrong."""
    from pyimp.choices import ANCHOR_TYPES, SELECT_MODES
    mode = name[len(SPARSE_PREFIX):]
    rt = 0.0
    if "@rt" in mode:
        mode, _, r = mode.partition("@rt")
        try:
            rt = float(r)
        except ValueError:
            rt = -1.0
        if not 0.0 < rt < 1.0:
            raise ValueError(f"policy {name!r}: the recall target after @rt must be in (0, 1)")
    selects = [m for m in SELECT_MODES if m != "anchors"]
    if mode in ANCHOR_TYPES:
        return dict(sparse=True, anchor=mode, select="anchors", recall_target=rt)
    if mode in selects and not rt:
        return dict(sparse=True, select=mode)
    raise ValueError(f"policy {name!r}: after {SPARSE_PREFIX} an anchor type "
                     f"({', '.join(ANCHOR_TYPES)}, optionally @rtR) or a selection mode "
                     f"({', '.join(selects)})")


# suffixes that only change which tokens a policy keeps, not the prefill it keeps them from
DECISION_SUFFIXES = {"kv_depth_ratio", "kv_recent", "kv_neighbours", "kv_follow"}


def _config(policy: str, kv: str, fraction: float, n_context: int) -> tuple[str, int, dict]:
    """(base name, budget in tokens, engine options) of one configuration over a context of
    n_context tokens: an eviction policy keeps ``fraction`` x n_context tokens per layer (at
    least 64; 0 under full attention); a block-sparse one (``sparse:...``, base "sparse")
    attends blocks worth that many tokens per step (init + picked + local blocks of
    SPARSE_BLOCK tokens)."""
    if policy.startswith(SPARSE_PREFIX):
        from tools.eval_sparse import topk_for_budget
        opts = {**kv_options(kv), **parse_sparse(policy), "block_len": SPARSE_BLOCK,
                "init_blocks": 1, "local_blocks": 2,
                "topk": topk_for_budget(fraction, n_context, SPARSE_BLOCK, 1, 2)}
        return "sparse", (opts["topk"] + 3) * SPARSE_BLOCK, opts
    base, extra = parse_policy(policy)       # e.g. "h2o+nbr4": tools.eval_kv's suffixes
    extra.pop("batch_size", None)
    opts = {**kv_options(kv), **extra}
    budget = 0
    if base != "full":
        budget = max(64, int(round(fraction * n_context)))
        opts.update(kv_policy=base, kv_budget=budget)
    return base, budget, opts


def _answer(eng, logits, n: int) -> tuple[str, dict]:
    """The greedy answer (up to n tokens) and what decoding it did to the cache: the tokens
    generated, the tokens the policy evicted meanwhile (h2o and streaming keep evicting as the
    answer grows; snapkv and pyramidkv only at a prefill's end), the KV bytes held at the
    end."""
    n0, ev0 = len(eng.tokens), eng.policy.evicted
    pred = greedy_answer(eng, logits, n)
    return pred, {"generated": len(eng.tokens) - n0,
                  "evicted_decoding": eng.policy.evicted - ev0,
                  "kv_bytes_end": int(eng.cache.bytes_held())}


def _row(case: dict, qi: int, mode: str, policy: str, kv: str, fraction: float, base: str,
         budget: int, n_tokens: int, pred: tuple, answers, held: int, seconds: float,
         shared_s: float = 0.0) -> dict:
    text, decoding = pred
    return {"task": case["task"], "seed": case["seed"], "index": case["index"],
            "question": qi, "mode": mode, "policy": policy, "kv": kv,
            "fraction": fraction if base != "full" else 1.0, "budget_tokens": budget,
            "n_tokens": n_tokens, "score": ruler.string_match_all(text, answers),
            "prediction": text, "answers": "|".join(answers), "kv_bytes": held, **decoding,
            "seconds": round(seconds, 3), "shared_s": round(shared_s, 3)}


def run_case(model: str, n_ctx: int, ctx_ids: list, questions: list, case: dict, policy: str,
             kv: str, fraction: float, mode: str = "aware", workdir: str = "") -> list:
    """Every question of one context under one configuration (on a Dask worker or here): a row
    per question. ``mode`` "aware": the context and the question prefilled together, the policy
    evicting once they are in; "once": the context alone prefilled and compressed (the
    observation window over the context's end), saved as a prompt-cache file, then each
    question appended to the loaded state. The budget is ``fraction`` x the context's tokens
    per layer in both."""
    base, budget, opts = _config(policy, kv, fraction, len(ctx_ids))
    eng = worker_engine(model, n_ctx, batch_size=n_ctx, track=base not in ("full", "sparse"),
                        **opts)
    rows = []
    state = None
    if mode == "once":
        eng.reset()
        eng.eval(ctx_ids)
        state = os.path.join(workdir, f"{os.getpid()}-{case['task']}-{case['seed']}-"
                                      f"{case['index']}.pkv")
        eng.save_state(state)
    held = int(eng.cache.bytes_held())
    for qi, (q_ids, answers) in enumerate(questions):
        t0 = time.perf_counter()
        if mode == "once":
            eng.load_state(state)
            logits = eng.eval(q_ids)[-1]
        else:
            eng.reset()
            logits = eng.eval(list(ctx_ids) + list(q_ids))[-1]
            held = int(eng.cache.bytes_held())
        pred = _answer(eng, logits, min(case["max_new_tokens"],
                                        n_ctx - len(ctx_ids) - len(q_ids) - 1))
        rows.append(_row(case, qi, mode, policy, kv, fraction, base, budget,
                         len(ctx_ids) + len(q_ids), pred, answers, held,
                         time.perf_counter() - t0))
    if state is not None:
        os.remove(state)
    return rows


def shares_prefill(policy: str) -> bool:
    """Can this policy's runs start from a shared full-attention prefill? Every policy evicts
    once at the end of the one-chunk prefill (the policy engines' batch is the context), from
    the importance that prefill accumulated; what differs is only the decision, unless the
    policy merges tokens during the prefill (+merge) or runs its observation window as a chunk
    of its own (+obs). Full attention decodes from the shared prefill's own engine (tracking
    importance changes no attention output: tests/test_ruler.py checks its rows)."""
    if policy.startswith(SPARSE_PREFIX):
        return False                    # block-sparse decoding: its own (dense) prefill
    base, extra = parse_policy(policy)
    extra.pop("batch_size", None)
    return not extra if base == "full" else set(extra) <= DECISION_SUFFIXES


def importance_rows(base: str) -> int:
    """The importance window a policy's engine prefills with (pyimp.options'
    sparse_options): every row for h2o (and streaming, which reads none), the observation
    window for snapkv / pyramidkv; full attention decodes from the shared prefill."""
    return 0 if base in ("h2o", "streaming", "full") else PolicyOptions().obs_window


def save_second_window(eng, path: str) -> None:
    """Save ``eng``'s state as a prefill with its second window would have left it: its
    ``importance2_`` in place of ``importance_`` (nothing else a tracking engine saves depends
    on the window: it keeps no anchors)."""
    sp = eng.sparse
    if sp.importance2_ is None or sp.anchor_.layers:
        raise ValueError("save_second_window needs a tracking engine with a second window and "
                         "no anchors")
    kept = sp.importance_.copy()
    sp.importance_[...] = sp.importance2_
    try:
        eng.save_state(path, level=0)
    finally:
        sp.importance_[...] = kept


def run_case_shared(model: str, n_ctx: int, ctx_ids: list, questions: list, case: dict,
                    configs: list, kv: str, workdir: str) -> list:
    """The rows :func:`run_case` gives for each (policy, fraction, mode) of ``configs`` (all
    :func:`shares_prefill`, one KV type), from shared prefills: each prompt (mode "aware":
    context and question; "once": the context) is prefilled once by a full-attention engine
    tracking importance under the windows the policies need (at most two: the second in
    importance2_), and saved per window; each configuration loads its window's state into its
    own engine, evicts (:meth:`Engine.evict`: what
    the end of its own prefill does) and decodes from the prefill's last logits. The rows are
    those of the direct path (tests/test_ruler.py checks them against it); ``shared_s`` gives
    the prefill time each row started from, ``seconds`` the row's own time."""
    rows = []
    windows = sorted({importance_rows(parse_policy(p)[0]) for p, _, _ in configs})
    tag = os.path.join(workdir, f"{os.getpid()}-{case['task']}-{case['seed']}-{case['index']}-"
                                f"{kv.replace('/', '-')}")
    kv_opts = kv_options(kv)
    full = [(p, f) for p, f, m in configs if is_full(p)]

    def prefill(ids: list, answer=None) -> dict:
        """The prefill of ``ids`` for each importance window, saved raw (a work file, read back
        at once): one forward serves both windows (the second accumulated in importance2_,
        see SparseOptions.second_window); with ``answer`` (question index, answers, tokens to
        generate) full attention's rows are then decoded from that engine."""
        w, second = windows[0], (windows[1] if len(windows) > 1 else None)
        eng = worker_engine(model, n_ctx, batch_size=n_ctx, track=True, importance_window=w,
                            second_window=second, **kv_opts)
        eng.reset()
        t0 = time.perf_counter()
        logits = np.array(eng.eval(ids)[-1])            # a copy: the engine may be reused
        paths = {w: f"{tag}-w{w}.pkv"}
        eng.save_state(paths[w], level=0)
        if second is not None:
            paths[second] = f"{tag}-w{second}.pkv"
            save_second_window(eng, paths[second])
        dt = time.perf_counter() - t0
        if answer is not None:
            qi, answers, n_new = answer
            for policy, fraction in full:
                t1 = time.perf_counter()
                held = int(eng.cache.bytes_held())
                pred = _answer(eng, logits, n_new)
                rows.append(_row(case, qi, "aware", policy, kv, fraction, "full", 0,
                                 len(ids), pred, answers, held, time.perf_counter() - t1, dt))
        return {k: (path, logits, dt) for k, path in paths.items()}

    def policy_engine(policy: str, fraction: float):
        base, budget, opts = _config(policy, kv, fraction, len(ctx_ids))
        eng = worker_engine(model, n_ctx, batch_size=n_ctx, track=True, **opts)
        return eng, base, budget

    aware = [(p, f) for p, f, m in configs if m == "aware" and (p, f) not in full]
    once = [(p, f) for p, f, m in configs if m == "once"]
    for qi, (q_ids, answers) in enumerate(questions if aware or full else []):
        n_new = min(case["max_new_tokens"], n_ctx - len(ctx_ids) - len(q_ids) - 1)
        shared = prefill(list(ctx_ids) + list(q_ids), (qi, answers, n_new))
        for policy, fraction in aware:
            eng, base, budget = policy_engine(policy, fraction)
            path, logits, dt = shared[importance_rows(base)]
            t0 = time.perf_counter()
            eng.load_state(path)
            eng.evict()
            held = int(eng.cache.bytes_held())
            pred = _answer(eng, logits, n_new)
            rows.append(_row(case, qi, "aware", policy, kv, fraction, base, budget,
                             len(ctx_ids) + len(q_ids), pred, answers, held,
                             time.perf_counter() - t0, dt))
        for path, _, _ in shared.values():
            os.remove(path)
    if once:
        shared = prefill(list(ctx_ids))
        for policy, fraction in once:
            eng, base, budget = policy_engine(policy, fraction)
            path, _, dt = shared[importance_rows(base)]
            eng.load_state(path)
            eng.evict()
            held = int(eng.cache.bytes_held())
            state = f"{tag}-once.pkv"
            eng.save_state(state, level=0)
            for qi, (q_ids, answers) in enumerate(questions):
                t0 = time.perf_counter()
                eng.load_state(state)
                logits = eng.eval(q_ids)[-1]
                pred = _answer(eng, logits, min(case["max_new_tokens"],
                                                      n_ctx - len(ctx_ids) - len(q_ids) - 1))
                rows.append(_row(case, qi, "once", policy, kv, fraction, base, budget,
                                 len(ctx_ids) + len(q_ids), pred, answers, held,
                                 time.perf_counter() - t0, dt))
            os.remove(state)
        for path, _, _ in shared.values():
            os.remove(path)
    return rows


def make_cases(model: str, tasks: list, n_cases: int, seed: int, ctx: int,
               all_questions: bool = False) -> list:
    """(context ids, [(question ids, answers)], case fields) of every case, tokenized by the
    model's own vocabulary; RULER's question only unless ``all_questions``."""
    import pyimp
    eng = pyimp.load(model, n_ctx=16)          # its tokenizer only
    out = []
    for task in tasks:
        for i in range(n_cases):
            try:
                c = ruler.make_case(task, seed, i, ctx, eng.tokenize)
            except ValueError as e:
                raise ValueError(f"--ctx {ctx}, task {task}: {e}") from None
            qs = c.questions if all_questions else c.questions[:1]
            out.append((eng.tokenize(c.context),
                        [(eng.tokenize(q, add_bos=False), a) for q, a in qs],
                        {"task": task, "seed": seed, "index": i,
                         "max_new_tokens": c.max_new_tokens}))
    eng.close()
    return out


def summarize(rows: list) -> list:
    """Per (policy, kv, fraction, task): mean score, its 95 % t interval, the case count, and the
    means of the KV bytes held after the compression and of the budget in tokens per layer."""
    groups: dict = {}
    for r in rows:
        label = r["policy"] + ("" if r.get("mode", "aware") == "aware" else f" ({r['mode']})")
        groups.setdefault((label, r["kv"], float(r["fraction"]), r["task"]), []).append(
            (float(r["score"]), float(r.get("kv_bytes", "nan")),
             float(r.get("budget_tokens", "nan"))))
    out = []
    for (policy, kv, fraction, task), runs in sorted(groups.items()):
        scores = [sc for sc, _, _ in runs]
        m, lo, hi = mean_interval(scores)          # scores lie in [0, 1]: so does the interval
        out.append({"policy": policy, "kv": kv, "fraction": fraction, "task": task, "mean": m,
                    "lo": max(0.0, lo), "hi": min(1.0, hi), "cases": len(scores),
                    "kv_bytes": float(np.mean([b for _, b, _ in runs])),
                    "budget_tokens": float(np.mean([t for _, _, t in runs]))})
    return out


FULL = ("full", "f16", 1.0)        # the reference configuration: full attention, f16 KV


def format_markdown(summary: list, tasks: list) -> str:
    """One row per configuration, one column per task (mean score x 100 with its 95 %
    interval), the average over the tasks and over the niah tasks, the budget in tokens per
    layer (0: full attention), the KV held (MB, and the share of full attention's f16 KV when
    the grid has it) and the case count. Tasks full attention (f16) scores 0 on are the
    model's limits, not the policies': they are left out of the averages, and a line under the
    table names them."""
    configs = sorted({(s["policy"], s["kv"], s["fraction"]) for s in summary},
                     key=lambda c: (-c[2], c[0], c[1]))
    by = {(s["policy"], s["kv"], s["fraction"], s["task"]): s for s in summary}
    left_out = [t for t in tasks if FULL + (t,) in by and by[FULL + (t,)]["mean"] == 0.0]
    niah = [t for t in tasks if t.startswith("niah") and t not in left_out]

    def mean(c, field: str) -> float:          # over the tasks that have it; nan: none
        vals = [s[field] for t in tasks if (s := by.get(c + (t,))) and not np.isnan(s[field])]
        return float(np.mean(vals)) if vals else float("nan")

    full_bytes = mean(FULL, "kv_bytes")        # nan when the grid has no full f16 row
    cols = tasks + ["average"] + (["niah average"] if niah else []) + [
        "tokens per layer", "KV MB", "cases per task"]
    lines = ["| policy | KV | fraction | " + " | ".join(cols) + " |", "|---" * (len(cols) + 3) + "|"]
    for c in configs:
        cells, n = [], 0
        for t in tasks:
            s = by.get(c + (t,))
            if s is None:
                cells.append("-")
                continue
            n = s["cases"]
            ci = "" if np.isnan(s["lo"]) else f" [{100 * s['lo']:.0f}, {100 * s['hi']:.0f}]"
            cells.append(f"{100 * s['mean']:.1f}{ci}")
        for group in [[t for t in tasks if t not in left_out]] + ([niah] if niah else []):
            means = [by[c + (t,)]["mean"] for t in group if c + (t,) in by]
            cells.append(f"{100 * np.mean(means):.1f}" if means else "-")
        tok = mean(c, "budget_tokens")
        cells.append("-" if np.isnan(tok) else f"{tok:.0f}")
        b = mean(c, "kv_bytes")
        share = "" if np.isnan(full_bytes) or np.isnan(b) else f" ({100 * b / full_bytes:.0f} %)"
        cells.append("-" if np.isnan(b) else f"{b / 1e6:.1f}{share}")
        lines.append(f"| {c[0]} | {c[1]} | {c[2]:g} | " + " | ".join(cells) + f" | {n} |")
    if left_out:
        lines.append(f"\nLeft out of the averages (full attention, f16, scores 0 on them): "
                     f"{', '.join(left_out)}.")
    return "\n".join(lines)


def plot(summary: list, tasks: list, path: str) -> None:
    """Score against the budget, one panel per task: a line per configuration (policy and KV
    type) over its fractions, full attention as a dashed level."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    cols = min(4, len(tasks))
    rows = -(-len(tasks) // cols)
    fig = Figure(figsize=(3.2 * cols, 2.6 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    labels = list(dict.fromkeys((r["policy"], r["kv"]) for r in summary))
    for ax, task in zip(axes, tasks):
        for pol, kv in labels:
            pts = sorted((r["fraction"], r["mean"]) for r in summary
                         if (r["policy"], r["kv"], r["task"]) == (pol, kv, task))
            if not pts:
                continue
            name = pol if kv == "f16" else f"{pol} {kv}"
            if pol == "full":
                ax.axhline(100 * pts[0][1], ls="--", color="k", label=name)
            else:
                ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], "o-", label=name)
        ax.set_title(task, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-5, 105)
        ax.set_xlabel("budget / context", fontsize=8)
        ax.set_ylabel("score", fontsize=8)
    for ax in axes[len(tasks):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_also(spec: str) -> tuple[str, str, float]:
    """``"snapkv+follow8,q8_0/q4_0,0.25"`` -> (policy, KV type, fraction), each checked as
    --policies, --kv-types and --fractions check theirs (full attention's fraction is 1);
    ValueError naming the part that is wrong."""
    parts = spec.split(",")
    if len(parts) != 3:
        raise ValueError(f"--also {spec!r}: expected POLICY,KV,FRACTION")
    policy, kv, frac = parts
    check_policy(policy)
    parse_kv(kv)
    f = fraction(frac)
    if f is None:
        raise ValueError(f"--also {spec!r}: the fraction {frac!r} must be a number in (0, 1]")
    return policy, kv, 1.0 if is_full(policy) else f


def check_policy(name: str) -> None:
    """ValueError naming what is wrong in a --policies entry (an eviction policy with its
    suffixes, or a block-sparse configuration)."""
    parse_sparse(name) if name.startswith(SPARSE_PREFIX) else parse_policy(name)


def fraction(text: str) -> float | None:
    """A budget fraction in (0, 1], or None when ``text`` is not one."""
    try:
        f = float(text)
    except ValueError:
        return None
    return f if 0 < f <= 1 else None


def is_full(policy: str) -> bool:
    """Full attention (with or without suffixes): no budget, asked with the question only."""
    return not policy.startswith(SPARSE_PREFIX) and parse_policy(policy)[0] == "full"


def collect(futures: list, path: str, n_cases: int, t0: float) -> list:
    """The rows of ``futures`` as they finish: each task's rows are appended to the CSV at
    ``path`` at once (a grid stopped part way keeps what it ran: ``--from-csv`` reports it),
    with a progress line on stderr. Returns every row, in the order they finished."""
    from dask.distributed import as_completed
    rows: list = []
    writer = None
    with open(path, "w", newline="") as f:
        for i, fut in enumerate(as_completed(futures), 1):
            part = fut.result()
            if part and writer is None:
                writer = csv.DictWriter(f, fieldnames=list(part[0]))
                writer.writeheader()
            if part:
                writer.writerows(part)
                f.flush()
            rows += part
            print(f"eval_ruler: {i} of {len(futures)} tasks ({n_cases} cases), {len(rows)} "
                  f"runs, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


def write_report(rows: list, tasks: list, out: str, heading: str) -> None:
    """The markdown table (stdout and ``out/eval_ruler.md`` under ``heading``) and the plot
    (``out/eval_ruler.png``) of a run's rows."""
    summary = summarize(rows)
    table = format_markdown(summary, tasks)
    try:
        plot(summary, tasks, os.path.join(out, "eval_ruler.png"))
    except ImportError:
        print("eval_ruler: no matplotlib, no plot (pip install 'pyimp[eval]')", file=sys.stderr)
    with open(os.path.join(out, "eval_ruler.md"), "w") as f:
        f.write(f"{heading}\n\n{table}\n")
    print(table)


def report_from_csv(path: str, tasks: list, out: str) -> int:
    """--from-csv: the table and plot of an earlier run's CSV (the tasks of ``tasks`` it has)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        missing = {"policy", "kv", "fraction", "task", "score"} - set(rows[0] if rows else ())
        if missing:
            raise ValueError(f"no {', '.join(sorted(missing))} column" if rows else "no rows")
        os.makedirs(out, exist_ok=True)
        have = {r["task"] for r in rows}
        write_report(rows, [t for t in tasks if t in have], out,
                     f"{len(rows)} runs from {os.path.abspath(path)}")
    except (OSError, ValueError, csv.Error) as e:
        print(f"eval_ruler: --from-csv {path}: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.eval_ruler",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="GGUF model (default: the embedded Gemma 3 270M)")
    ap.add_argument("--ctx", type=int, default=4096, help="prompt tokens per case")
    ap.add_argument("--cases", type=int, default=4, help="cases per task")
    ap.add_argument("--seed", type=int, default=1000,
                    help=f"case seed (development: {DEV_SEEDS.start}-{DEV_SEEDS.stop - 1})")
    ap.add_argument("--tasks", default=",".join(ruler.TASKS))
    ap.add_argument("--policies", default="full",
                    help="eviction policies (tools.eval_kv's, with its +suffixes) and block-sparse "
                         "decode configurations: sparse:ANCHOR[@rtR] or sparse:lowrank, "
                         "sparse:lsh, sparse:sink_window, sparse:strided")
    ap.add_argument("--fractions", default="0.25", help="eviction budgets, share of the prompt")
    ap.add_argument("--kv-types", default="f16")
    ap.add_argument("--also", action="append", default=[], metavar="POLICY,KV,FRACTION",
                    help="one more configuration outside the cross product (repeatable), e.g. "
                         "snapkv+follow8,q8_0/q4_0,0.25: a KV type at one budget")
    ap.add_argument("--modes", default="aware",
                    help="aware: compress with the question in the prompt; once: compress the "
                         "context alone, save it, append each question to the loaded state")
    ap.add_argument("--all-questions", action="store_true",
                    help="ask every question a context has (needle tasks' other keys), not only "
                         "RULER's")
    ap.add_argument("--direct", action="store_true",
                    help="prefill every configuration's prompt itself instead of sharing one "
                         "full-attention prefill per prompt among the policies (the same rows, "
                         "slower)")
    ap.add_argument("--from-csv", metavar="CSV",
                    help="run nothing: write the table and the plot of an earlier run's "
                         "eval_ruler.csv into --out")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--scheduler", help="address of an existing Dask scheduler")
    ap.add_argument("--out", default="eval_ruler_out")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    policies = [p for p in args.policies.split(",") if p]
    try:
        for t in tasks:
            if t not in ruler.TASKS:
                raise ValueError(f"--tasks: unknown task {t!r} (tasks: {', '.join(ruler.TASKS)})")
        for p in policies:
            check_policy(p)
        fractions = [fraction(x) for x in args.fractions.split(",") if x]
        if not fractions or None in fractions:
            raise ValueError(f"--fractions {args.fractions!r}: each must be a number in (0, 1]")
        kvs = [k for k in args.kv_types.split(",") if k]
        if not kvs:
            raise ValueError("--kv-types needs at least one entry")
        for k in kvs:
            parse_kv(k)
        also = [parse_also(a) for a in args.also]
        modes = [m for m in args.modes.split(",") if m]
        if not modes or any(m not in ("aware", "once") for m in modes):
            raise ValueError(f"--modes {args.modes!r}: each must be aware or once")
        if args.workers < 1:
            raise ValueError(f"--workers {args.workers}: at least 1")
        if args.cases < 1 or args.ctx < 256:
            raise ValueError("--cases must be >= 1 and --ctx >= 256")
    except ValueError as e:
        print(f"eval_ruler: {e}", file=sys.stderr)
        return 2
    if args.from_csv:
        return report_from_csv(args.from_csv, tasks, args.out)
    from pyimp.runtime.default_model import default_model_path
    model = os.path.abspath(args.model or default_model_path())
    n_ctx = args.ctx + max(ruler.GENERATE.values()) + 8
    t0 = time.perf_counter()
    try:
        cases = make_cases(model, tasks, args.cases, args.seed, args.ctx, args.all_questions)
    except (ValueError, GGUFError) as e:
        print(f"eval_ruler: {e}", file=sys.stderr)
        return 2
    workdir = os.path.abspath(os.path.join(args.out, "work"))
    os.makedirs(workdir, exist_ok=True)
    print(f"seed {args.seed} ({'development' if args.seed in DEV_SEEDS else 'held out'}): "
          f"{len(tasks)} tasks x {args.cases} cases at {args.ctx} tokens", flush=True)
    configs = [(p, kv, f, m) for p in policies for kv in kvs
               for f in ([1.0] if is_full(p) else fractions)
               for m in (["aware"] if is_full(p) else modes)]
    configs += [c + (m,) for c in also for m in (["aware"] if is_full(c[0]) else modes)
                if c + (m,) not in configs]
    shared = [] if args.direct else [c for c in configs if shares_prefill(c[0])]
    direct = [c for c in configs if c not in shared]
    with dask_client(args.scheduler, args.workers) as client:
        # a configuration's tasks one after another: a worker reuses its engine
        futures = [client.submit(run_case, model, n_ctx, ctx_ids, qs, case, p, kv, f, m,
                                 workdir, pure=False)
                   for (p, kv, f, m) in direct for ctx_ids, qs, case in cases]
        # a case's shared prefills serve every configuration that shares them
        futures += [client.submit(run_case_shared, model, n_ctx, ctx_ids, qs, case,
                                  [(p, f, m) for (p, k, f, m) in shared if k == kv], kv,
                                  workdir, pure=False)
                    for kv in dict.fromkeys(k for _, k, _, _ in shared)
                    for ctx_ids, qs, case in cases]
        rows = collect(futures, os.path.join(args.out, "eval_ruler.csv"), len(cases), t0)
    write_report(rows, tasks, args.out,
                 f"{args.ctx} tokens, seed {args.seed}, {args.cases} cases per task, "
                 f"{time.perf_counter() - t0:.0f} s, {len(shared)} of {len(configs)} "
                 f"configurations from shared prefills")
    print(f"{len(rows)} runs in {time.perf_counter() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
