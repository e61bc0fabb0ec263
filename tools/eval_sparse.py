"""Quality of importance-guided sparse decode attention against dense attention.

Three measurements on one model (default: the embedded Gemma 3 270M):

1. Decode-mode (teacher-forced) quality: prefill the first ``--ctx`` tokens of
   a long local text (Python's ``pydoc_data.topics``), then feed the next
   ``--steps`` tokens one at a time, dense and sparse; per step
   KL(dense || sparse) of the next-token distribution and top-1 agreement,
   plus the engine's attention recall, the oracle recall (the most mass any
   choice of as many blocks could capture) and the attended fraction. One row
   per anchor type x budget (budget = fraction of the context attended).
2. Passkey retrieval: a five-digit key hidden in filler text at several
   depths; the haystack is prefilled (always dense), the question is fed as
   decode steps (sparse), then the answer is decoded greedily
   (``--question-in-prefill``: the question is prefilled too, so the first
   answer token comes from dense attention).
3. ``--plot``: mean recall and mean KL against budget, one line per anchor.

The prefix prefill is the same for every attention configuration (prefill is
always dense; only the anchors differ), so by default it runs once and each
configuration rewinds to it (see :class:`PrefixRunner`); ``--fresh-prefill``
loads and prefills a new engine per configuration instead (same numbers,
slower).

    python -m tools.eval_sparse                 # full run (long on 2 cores)
    python -m tools.eval_sparse --quick         # smoke run
    python -m tools.eval_sparse --anchors quest,cuboid_mean --budgets 1/8 --ctx 2048 --steps 32
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Callable, Sequence

import numpy as np

from pyimp.choices import ANCHOR_TYPES as ANCHORS
from pyimp.choices import RETRIEVAL_TYPES, SELECT_MODES
from pyimp.ops import log_softmax

BUDGETS = (1 / 16, 1 / 8, 1 / 4)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEADER = ("There is an important piece of information hidden inside a lot of irrelevant text. "
          "Find it and memorize it. I will quiz you about the important information there.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


# ---------------------------------------------------------------- configuration
@dataclass(frozen=True)
class SparseConfig:
    """One sparse-attention configuration (the SparseOptions fields that vary here)."""

    anchor: str
    topk: int
    budget: float | None = None     # the requested fraction of the context (None: topk given directly)
    init_blocks: int = 1
    local_blocks: int = 2
    retrieval: str = "kvhead"
    # False: steps whose selection is every block still run the block-sparse kernels (over every
    # block) instead of the engine's dense fallback, to measure them against dense attention
    dense_fallback: bool = True
    recall_target: float = 0.0      # > 0: --recall-target (topk is then the floor)
    select: str = "anchors"         # a selection mode other than the anchors (lowrank, lsh, ...)

    @property
    def label(self) -> str:
        if self.select != "anchors":
            return self.select
        return self.anchor + (f"@rt{self.recall_target:g}" if self.recall_target else "")

    def options(self, importance_window: int) -> dict:
        """Keyword options of ``pyimp.load`` for this configuration (recall measured)."""
        return dict(sparse=True, anchor=self.anchor, topk=self.topk, init_blocks=self.init_blocks,
                    local_blocks=self.local_blocks, retrieval=self.retrieval,
                    importance_window=importance_window, report=True,
                    recall_target=self.recall_target, select=self.select)


def topk_for_budget(budget: float, ctx: int, block_len: int, init_blocks: int = 1,
                    local_blocks: int = 2) -> int:
    """pick count so that (init + topk + local) * block_len is the nearest to budget * ctx (>= 0)."""
    total = int(round(budget * ctx / block_len))
    return max(0, total - init_blocks - local_blocks)


def make_configs(anchors: Sequence[str], budgets: Sequence[float], ctx: int, block_len: int,
                 init_blocks: int = 1, local_blocks: int = 2,
                 retrieval: str = "kvhead") -> list[SparseConfig]:
    """anchor x budget grid, anchors outermost."""
    return [SparseConfig(a, topk_for_budget(b, ctx, block_len, init_blocks, local_blocks), b,
                         init_blocks, local_blocks, retrieval)
            for a in anchors for b in budgets]


def parse_budget(text: str) -> float:
    """'1/8' or '0.125' -> 0.125 (must lie in (0, 1])."""
    try:
        val = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"budget {text!r} is not a fraction like 1/8 or 0.125") from None
    if not 0.0 < val <= 1.0:
        raise ValueError(f"budget {text!r} must lie in (0, 1]")
    return val


def budget_label(budget: float | None) -> str:
    if budget is None:
        return "-"
    f = Fraction(budget).limit_denominator(1024)
    return f"{f.numerator}/{f.denominator}" if f.numerator == 1 else f"{budget:.3g}"


# ------------------------------------------------------------------ measures
def kl_divergence(p_logp: np.ndarray, q_logp: np.ndarray) -> np.ndarray:
    """KL(p || q) in nats per row, from float64 log-probabilities [..., V]."""
    return np.sum(np.exp(p_logp) * (p_logp - q_logp), axis=-1)


def oracle_recall(q: np.ndarray, keys: np.ndarray, scale: float, block_len: int, init_blocks: int,
                  topk: int, local_blocks: int, retrieval: str = "kvhead") -> float:
    """Best attention recall any block choice of the same shape could reach for this query.

    q: float32 [Hq, D]; keys: float32 [Hkv, n, D] (positions 0..n-1, the
    query's own included). The sinks, the last ``local_blocks`` full blocks and
    the partial tail (with ``local_blocks = 0`` and no partial tail: the
    query's own block) are kept as the engine keeps them; the ``topk`` other
    blocks are those holding the most dense softmax mass, summed over the
    heads of each set (one set per layer / kv head / query head, as
    ``retrieval``). Returns the mean over query heads of the mass captured.
    """
    Hq, D = q.shape
    Hkv, n, _ = keys.shape
    G = Hq // Hkv
    s = np.einsum("hnd,hd->hn", keys[np.arange(Hq) // G].astype(np.float64), q.astype(np.float64))
    s *= scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)                                   # [Hq, n]
    nb = -(-n // block_len)
    pad = np.zeros((Hq, nb * block_len))
    pad[:, :n] = p
    mass = pad.reshape(Hq, nb, block_len).sum(axis=2)                   # [Hq, nb]
    F = n // block_len
    loc = local_blocks if local_blocks or n % block_len else 1     # the query's own block stays
    forced = sorted(set(range(min(init_blocks, nb))) | set(range(max(F - loc, 0), nb)))
    cand = np.arange(init_blocks, max(F - loc, init_blocks))
    nsets = {"layer": 1, "kvhead": Hkv, "qhead": Hq}[retrieval]
    hps = Hq // nsets
    got = np.empty(Hq)
    for si in range(nsets):
        hs = slice(si * hps, (si + 1) * hps)
        best = cand[np.argsort(-mass[hs][:, cand].sum(axis=0), kind="stable")[:topk]]
        got[hs] = mass[hs][:, np.r_[forced, best].astype(np.int64)].sum(axis=1)
    return float(got.mean())


def pydoc_text() -> str:
    """Python's own long local text: every pydoc topic, in key order."""
    import pydoc_data.topics as topics
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


# ------------------------------------------------------------------- engines
class PrefixRunner:
    """One engine whose prompt prefix is prefilled once and rewound to for each configuration.

    Rewinding is exact: decode only writes K/V rows after the prefix and adds
    importance, so the runner keeps the prefix length and a copy of
    ``importance_`` after the prefill, and each :meth:`use` truncates the
    cache to the prefix, installs a fresh ``SparseState`` for the new options
    with that importance, and recomputes its anchors (as a prefill ends).
    ``use(None)`` is plain dense attention (no sparse state at all).
    """

    def __init__(self, path, n_ctx: int, block_len: int = 32, importance_window: int = 128):
        import pyimp
        self.importance_window = importance_window
        # track: prefill fills importance_ exactly as a sparse engine's prefill does
        self.engine = pyimp.load(path, n_ctx=n_ctx, block_len=block_len, track=True,
                                 importance_window=importance_window)
        self.n_prefix = 0
        self._importance = None

    def warmup(self) -> float:
        """Compile dense and sparse kernels (empty cache needed); returns seconds."""
        from pyimp.sparse.policy import SparseOptions, SparseState
        t0 = time.perf_counter()
        eng = self.engine
        eng.warmup()
        SparseState(SparseOptions(enabled=True, report=True), eng.cfg, eng.cache).warmup()
        return time.perf_counter() - t0

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Reset, prefill ``ids`` with dense attention; returns float32[1, V] last-token logits."""
        from pyimp.sparse.policy import SparseOptions, SparseState
        eng = self.engine
        eng.reset()
        eng.policy = None        # no sliding-window trim: each config rewinds to the prefix
        if eng.sparse is None or eng.sparse.opts.enabled:
            eng.sparse = SparseState(SparseOptions(track=True, importance_window=self.importance_window),
                                     eng.cfg, eng.cache)
        logits = eng.eval(list(ids), all_logits=False)
        self.n_prefix = len(eng.tokens)
        self._importance = eng.sparse.importance_.copy()
        return logits

    def use(self, config: SparseConfig | None) -> None:
        """Rewind to the prefix and switch to ``config`` (None = dense)."""
        from pyimp.sparse.policy import SparseOptions, SparseState
        eng = self.engine
        eng.cache.truncate(self.n_prefix)
        del eng.tokens[self.n_prefix:]
        if config is None:
            eng.sparse = None
            return
        opts = SparseOptions(enabled=True, **{k: v for k, v in config.options(self.importance_window).items()
                                              if k != "sparse"})
        st = SparseState(opts, eng.cfg, eng.cache)
        st.dense_fallback = config.dense_fallback
        st.restore_prefix(self._importance, self.n_prefix)
        eng.sparse = st


def track_oracle(state, cache, config: SparseConfig, out: list) -> None:
    """Make ``state`` also append the oracle recall of each sparse layer-step to out."""
    def on_decode(il, q, n_ctx, scale, window, sparse):
        if sparse and window <= 0:
            keys, _ = cache.gather(il, n_ctx)
            out.append(oracle_recall(q, keys, scale, cache.block_len, config.init_blocks, config.topk,
                                     config.local_blocks, config.retrieval))

    state.observe(on_decode)


def _decode(eng, ids: Sequence[int], took_sparse: list | None = None) -> np.ndarray:
    """Feed ``ids`` one at a time; float32[len(ids), V] logits after each. With a list
    ``took_sparse``, one bool a step is appended to it: whether any layer of that step took
    the block-sparse path (as the engine reports it to its observers)."""
    out = np.empty((len(ids), eng.cfg.n_vocab), np.float32)
    hit: list = []
    if took_sparse is not None:
        eng.sparse.observe(lambda il, q, n_ctx, scale, window, sparse: sparse and hit.append(il))
    for i, t in enumerate(ids):
        hit.clear()
        out[i] = eng.eval([int(t)], all_logits=False)[-1]
        if took_sparse is not None:
            took_sparse.append(bool(hit))
    return out


# ------------------------------------------------------------ decode quality
@dataclass
class DecodeRow:
    anchor: str
    budget: float | None
    topk: int
    mean_kl: float
    median_kl: float
    max_kl: float
    top1: float                 # fraction of steps whose argmax equals dense's
    recall: float               # mean over decode steps and sparse layers (dense-fallback steps count 1)
    attended: float             # attended tokens / context tokens over the same steps
    sparse_steps: int           # steps that took the block-sparse path
    steps: int
    oracle: float | None = None  # best recall reachable with the same block counts (same steps)
    recall_sparse_only: float | None = None   # engine's report: mean over sparse steps only
    layer_recall: dict = field(default_factory=dict)   # layer -> recall over sparse steps
    seconds: float = 0.0
    kl_steps: list = field(default_factory=list)       # KL of each step, nats


def _summarize(config: SparseConfig, dense_logp: np.ndarray, logits: np.ndarray, report: dict,
               ctx: int, took_sparse: Sequence[bool], seconds: float,
               oracle: list | None = None) -> DecodeRow:
    """One config's row; ``took_sparse``: whether each step took the block-sparse path."""
    steps = len(logits)
    logp = log_softmax(logits)
    kl = np.maximum(kl_divergence(dense_logp, logp), 0.0)   # clip float64 rounding below 0
    top1 = float(np.mean(np.argmax(dense_logp, -1) == np.argmax(logp, -1)))
    n_at = ctx + 1 + np.arange(steps)                        # tokens cached at each decode step
    sparse = np.asarray(took_sparse, dtype=bool)
    if sparse.shape != (steps,):
        raise ValueError(f"{len(took_sparse)} sparse flags for {steps} steps")
    ns = int(sparse.sum())
    r_sp = report.get("mean_recall")
    a_sp = report.get("mean_attended_fraction")
    if ns and (r_sp is None or a_sp is None):
        raise RuntimeError(f"{config}: {ns} sparse steps expected but the engine reported no recall")
    # steps on the dense fallback attend everything with recall 1
    recall = ((r_sp or 0.0) * ns + (steps - ns)) / steps
    ctx_sparse = float(n_at[sparse].sum())
    attended = ((a_sp or 0.0) * ctx_sparse + float(n_at[~sparse].sum())) / float(n_at.sum())
    layers = {k: v["recall"] for k, v in report.get("layers", {}).items() if "recall" in v}
    orc = None
    if oracle is not None:
        n_layers = len(oracle) // ns if ns else 1
        orc = (float(np.sum(oracle)) / n_layers + (steps - ns)) / steps if ns else 1.0
    return DecodeRow(config.label, config.budget, config.topk, float(kl.mean()), float(np.median(kl)),
                     float(kl.max()), top1, float(recall), float(attended), ns, steps, orc, r_sp, layers,
                     seconds, [float(x) for x in kl])


def decode_quality(path, ids: Sequence[int], ctx: int, steps: int, configs: Sequence[SparseConfig],
                   block_len: int = 32, importance_window: int = 128, fresh_prefill: bool = False,
                   runner: PrefixRunner | None = None, oracle: bool = True,
                   log: Callable[[str], None] | None = None) -> list[DecodeRow]:
    """Teacher-forced decode quality of each config against dense attention.

    ids: at least ctx + steps token ids; the first ctx are prefilled, the next
    ``steps`` are decoded one by one (dense and sparse see the same tokens).
    oracle: also compute the oracle recall (:func:`oracle_recall`) per step.
    Returns one :class:`DecodeRow` per config, in order.
    """
    import pyimp
    if len(ids) < ctx + steps:
        raise ValueError(f"{len(ids)} tokens given, {ctx + steps} needed (ctx {ctx} + steps {steps})")
    if steps < 1:
        raise ValueError("steps must be >= 1")
    log = log or (lambda s: None)
    prefix, fed = list(ids[:ctx]), list(ids[ctx:ctx + steps])
    n_ctx = ctx + steps
    if not fresh_prefill and runner is None:
        runner = PrefixRunner(path, n_ctx, block_len, importance_window)
    t0 = time.perf_counter()
    if fresh_prefill:
        eng = pyimp.load(path, n_ctx=n_ctx, block_len=block_len)
        eng.eval(prefix, all_logits=False)
    else:
        runner.prefill(prefix)
        runner.use(None)
        eng = runner.engine
    log(f"dense prefill of {ctx} tokens: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    dense_logp = log_softmax(_decode(eng, fed))
    log(f"dense decode of {steps} tokens: {time.perf_counter() - t0:.1f} s")
    rows = []
    for c in configs:
        t0 = time.perf_counter()
        if fresh_prefill:
            eng = pyimp.load(path, n_ctx=n_ctx, block_len=block_len, **c.options(importance_window))
            eng.sparse.dense_fallback = c.dense_fallback
            eng.eval(prefix, all_logits=False)
        else:
            runner.use(c)
        orc = [] if oracle and not c.recall_target else None   # the oracle needs a fixed topk
        if orc is not None:
            track_oracle(eng.sparse, eng.cache, c, orc)
        took_sparse: list = []
        logits = _decode(eng, fed, took_sparse)
        row = _summarize(c, dense_logp, logits, eng.sparse.report(), ctx, took_sparse,
                         time.perf_counter() - t0, orc)
        rows.append(row)
        log(f"{c.label:>11} budget {budget_label(c.budget):>5} topk {c.topk:3d}: mean KL "
            f"{row.mean_kl:.2e} recall {row.recall:.4f} ({row.seconds:.1f} s)")
    return rows


def format_decode_table(rows: Sequence[DecodeRow]) -> str:
    head = (f"{'anchor':>11} {'budget':>6} {'topk':>4} {'mean KL':>9} {'median KL':>9} {'max KL':>9} "
            f"{'top-1':>6} {'recall':>7} {'oracle':>7} {'attended':>8} {'sparse':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        orc = f"{r.oracle:7.4f}" if r.oracle is not None else f"{'-':>7}"
        lines.append(f"{r.anchor:>11} {budget_label(r.budget):>6} {r.topk:4d} {r.mean_kl:9.2e} "
                     f"{r.median_kl:9.2e} {r.max_kl:9.2e} {r.top1:6.3f} {r.recall:7.4f} {orc} "
                     f"{r.attended:8.4f} {r.sparse_steps:3d}/{r.steps:<3d}")
    return "\n".join(lines)


def rank_by_recall(rows: Sequence[DecodeRow]) -> list[tuple[str, float, float | None]]:
    """(anchor, mean recall, mean recall / oracle) over the budgets run, best recall first."""
    by: dict = {}
    for r in rows:
        by.setdefault(r.anchor, []).append(r)
    out = []
    for a, rs in by.items():
        eff = [r.recall / r.oracle for r in rs if r.oracle]
        out.append((a, float(np.mean([r.recall for r in rs])), float(np.mean(eff)) if eff else None))
    return sorted(out, key=lambda x: -x[1])


# ------------------------------------------------------------------- passkey
@dataclass
class PasskeySample:
    target: int                 # requested prompt length
    length: int                 # prompt tokens (haystack + question)
    depth: float
    key: int
    answers: dict               # "dense" / anchor -> decoded answer text
    correct: dict               # same keys -> bool


def passkey_prompt(tokenize: Callable[..., list], n_tokens: int, depth: float,
                   key: int) -> tuple[list[int], list[int]]:
    """(haystack ids with BOS, question ids): about n_tokens in all, needle at ``depth`` of the filler."""
    unit = len(tokenize(FILLER * 16, add_bos=False)) / 16
    needle = NEEDLE.format(key=key)
    fixed = len(tokenize(HEADER + needle, add_bos=True)) + len(tokenize(QUESTION, add_bos=False))
    n_units = max(0, int((n_tokens - fixed) / unit))
    question = tokenize(QUESTION, add_bos=False)
    while True:
        at = int(round(depth * n_units))
        text = HEADER + FILLER * at + needle + FILLER * (n_units - at)
        hay = tokenize(text.rstrip(" "), add_bos=True)
        if len(hay) + len(question) <= n_tokens:
            return hay, question
        if n_units == 0:
            raise ValueError(f"a passkey prompt needs more than {n_tokens} tokens")
        n_units -= 1


KEY_RANGE = (10000, 100000)   # five-digit keys, [lo, hi)
KEYS_PER_SEED = 1000          # a seed's share of the keys: seeds 0..89, up to 1000 cases each
_KEY_ORDER_SEED = 20240229    # the one fixed shuffle of the key range the seeds share out


@dataclass(frozen=True)
class PasskeyCase:
    key: int
    length: int                 # prompt tokens asked of passkey_prompt
    depth: float                # the needle's depth in the filler


def passkey_cases(seed: int, n: int, lengths: tuple = (2048, 4096),
                  depths: tuple = (0.1, 0.9)) -> list[PasskeyCase]:
    """``n`` passkey cases drawn by ``seed``: the keys are slice ``seed`` of one fixed shuffle of
    the five-digit keys (two seeds never share a key; a seed's first n keys are the same for
    any larger n), the lengths uniform integers in ``lengths`` (both ends included) and the
    depths uniform in ``depths``, rounded to 1e-3. The same seed gives the same cases on any
    machine (NumPy's PCG64 stream)."""
    n_seeds = (KEY_RANGE[1] - KEY_RANGE[0]) // KEYS_PER_SEED
    if not 0 <= seed < n_seeds:
        raise ValueError(f"passkey seed {seed} is not in 0..{n_seeds - 1}")
    if not 0 <= n <= KEYS_PER_SEED:
        raise ValueError(f"a seed has {KEYS_PER_SEED} passkeys, {n} asked")
    lo, hi = lengths
    dlo, dhi = depths
    if not 0 < lo <= hi or not 0.0 <= dlo <= dhi <= 1.0:
        raise ValueError(f"passkey lengths {lengths} or depths {depths} out of range")
    order = np.random.default_rng(_KEY_ORDER_SEED).permutation(KEY_RANGE[1] - KEY_RANGE[0])
    keys = order[seed * KEYS_PER_SEED:seed * KEYS_PER_SEED + n] + KEY_RANGE[0]
    rng = np.random.default_rng([seed, 1])          # a stream of its own, apart from the keys'
    lens = rng.integers(lo, hi + 1, KEYS_PER_SEED)[:n]
    ds = rng.uniform(dlo, dhi, KEYS_PER_SEED)[:n]
    return [PasskeyCase(int(k), int(L), round(float(d), 3)) for k, L, d in zip(keys, lens, ds)]


def passkey_eval(runner: PrefixRunner, lengths: Sequence[int], depths: Sequence[float],
                 samples: int, anchors: Sequence[str], budgets: Sequence[float], init_blocks: int = 1,
                 local_blocks: int = 2, retrieval: str = "kvhead", seed: int = 0,
                 question_in_prefill: bool = False,
                 log: Callable[[str], None] | None = None) -> list[PasskeySample]:
    """Greedy passkey retrieval, dense and each anchor type x budget (fraction of the prompt).

    Answers are keyed "dense" and the anchor name (with "@budget" when several budgets run).
    """
    log = log or (lambda s: None)
    eng = runner.engine
    rng = np.random.default_rng(seed)
    eog = eng.eog_ids()
    B = eng.cache.block_len
    out = []
    for n in lengths:
        for d in depths:
            for _ in range(samples):
                key = int(rng.integers(10000, 100000))
                hay, question = passkey_prompt(eng.tokenize, n, d, key)
                n_new = len(str(key)) + 3
                if question_in_prefill:
                    hay, question = hay + question, []
                if len(hay) + len(question) + n_new > eng.n_ctx:
                    raise ValueError(f"passkey prompt of {len(hay) + len(question)} tokens + {n_new} "
                                     f"answer tokens exceeds the context {eng.n_ctx}")
                t0 = time.perf_counter()
                first = runner.prefill(hay)[-1]
                t_pre = time.perf_counter() - t0
                total = len(hay) + len(question)
                configs = [None] + [SparseConfig(a, topk_for_budget(b, total, B, init_blocks, local_blocks),
                                                 b, init_blocks, local_blocks, retrieval)
                                    for b in budgets for a in anchors]
                answers, correct = {}, {}
                for c in configs:
                    runner.use(c)
                    logits = _decode(eng, question)[-1] if question else first
                    toks = []
                    for _ in range(n_new):
                        t = int(np.argmax(logits))
                        if t in eog:
                            break
                        toks.append(t)
                        logits = eng.eval([t], all_logits=False)[-1]
                    name = "dense" if c is None else c.anchor
                    if c is not None and len(budgets) > 1:
                        name += "@" + budget_label(c.budget)
                    answers[name] = eng.detokenize(toks)
                    correct[name] = str(key) in answers[name]
                out.append(PasskeySample(n, total, d, key, answers, correct))
                log(f"passkey {total} tokens depth {d:.2f} key {key}: "
                    + ", ".join(f"{k}={'ok' if v else 'FAIL'} {answers[k]!r}" for k, v in correct.items())
                    + f" (prefill {t_pre:.1f} s, all {time.perf_counter() - t0:.1f} s)")
    return out


def format_passkey_table(samples: Sequence[PasskeySample]) -> str:
    """Correct / samples: one row per engine config, columns per requested length, per depth, all."""
    if not samples:
        return "(no passkey samples)"
    names = list(samples[0].correct)
    lengths = list(dict.fromkeys(s.target for s in samples))
    depths = sorted(set(s.depth for s in samples))
    cols = ([(f"{n}", lambda s, n=n: s.target == n) for n in lengths]
            + [(f"d={d:g}", lambda s, d=d: s.depth == d) for d in depths] + [("all", lambda s: True)])
    w = max(len(x) for x in names + ["engine"])
    head = f"{'engine':<{w}} " + " ".join(f"{c:>7}" for c, _ in cols)
    lines = [head, "-" * len(head)]
    for x in names:
        cells = []
        for _, pick in cols:
            g = [s for s in samples if pick(s)]
            cells.append(f"{f'{sum(s.correct[x] for s in g)}/{len(g)}':>7}")
        lines.append(f"{x:<{w}} " + " ".join(cells))
    return "\n".join(lines)


# ---------------------------------------------------------------------- plot
def plot_recall(rows: Sequence[DecodeRow], path: str, title: str = "") -> None:
    """PNG: mean recall (left) and mean KL (right) against budget, one line per anchor type.

    The dashed line is the oracle recall (mean over the anchor rows of each budget).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4.2))       # its own Agg canvas: the process's backend is untouched
    FigureCanvasAgg(fig)
    ax0, ax1 = fig.subplots(1, 2)
    by: dict = {}
    for r in rows:
        by.setdefault(r.anchor, []).append(r)
    for a, rs in by.items():
        rs = sorted(rs, key=lambda r: r.attended)
        x = [r.budget if r.budget is not None else r.attended for r in rs]
        ax0.plot(x, [r.recall for r in rs], marker="o", label=a)
        ax1.plot(x, [max(r.mean_kl, 1e-12) for r in rs], marker="o", label=a)
    budgets = sorted({r.budget for r in rows if r.budget is not None})
    orc = [(b, np.mean([r.oracle for r in rows if r.budget == b and r.oracle is not None]))
           for b in budgets if any(r.budget == b and r.oracle is not None for r in rows)]
    if orc:
        ax0.plot([b for b, _ in orc], [o for _, o in orc], "k--", marker="x",
                 label="oracle (best blocks)")
    for ax in (ax0, ax1):
        ax.set_xscale("log", base=2)
        if budgets:
            ax.set_xticks(budgets)
            ax.set_xticklabels([budget_label(b) for b in budgets])
        ax.set_xlabel("budget (fraction of the context attended)")
        ax.grid(True, alpha=0.3)
    ax0.set_ylabel("mean attention recall (global layers)")
    ax1.set_ylabel("mean KL(dense || sparse), nats")
    ax1.set_yscale("log")
    ax0.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------- CLI
def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.eval_sparse",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF path (default: the embedded Gemma 3 270M)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: ctx 1024, 8 steps, quest + cuboid_mean at 1/8, one 1024-token passkey")
    g = ap.add_argument_group("decode-mode KL")
    g.add_argument("--ctx", type=int, default=4096, help="prefilled context tokens (default 4096)")
    g.add_argument("--steps", type=int, default=64, help="teacher-forced decode steps (default 64)")
    g.add_argument("--anchors", default=",".join(ANCHORS), help="comma list of anchor types")
    g.add_argument("--budgets", default="1/16,1/8,1/4", help="comma list of context fractions")
    g.add_argument("--text-offset", type=int, default=0, help="first token of the text used")
    g.add_argument("--selects", default="",
                   help=f"comma list of selection modes "
                   f"({', '.join(m for m in SELECT_MODES if m != 'anchors')}) run at each budget "
                   f"beside the anchors")
    g.add_argument("--recall-targets", default="",
                   help="comma list of --recall-target values run per anchor type (topk floor 0)")
    g.add_argument("--no-oracle", action="store_true", help="skip the oracle recall column")
    g.add_argument("--skip-decode", action="store_true")
    g = ap.add_argument_group("passkey")
    g.add_argument("--passkey-lengths", default="2048,4096,8192", help="comma list of prompt tokens")
    g.add_argument("--passkey-depths", default="0.1,0.5,0.9", help="comma list of needle depths")
    g.add_argument("--passkey-samples", type=int, default=1, help="keys per length and depth")
    g.add_argument("--passkey-anchors", default="", help="anchor types (default: those of --anchors)")
    g.add_argument("--passkey-budgets", default="1/8", help="comma list of prompt fractions (default 1/8)")
    g.add_argument("--question-in-prefill", action="store_true",
                   help="prefill the question too (then only answer tokens after the first decode sparse)")
    g.add_argument("--skip-passkey", action="store_true")
    g = ap.add_argument_group("sparse options")
    g.add_argument("--block-len", type=int, default=32)
    g.add_argument("--init-blocks", type=int, default=1)
    g.add_argument("--local-blocks", type=int, default=2)
    g.add_argument("--retrieval", default="kvhead", choices=RETRIEVAL_TYPES)
    g.add_argument("--importance-window", type=int, default=128)
    g = ap.add_argument_group("output")
    g.add_argument("--plot", help="PNG path for recall / KL against budget")
    g.add_argument("--json", help="write all results as JSON here")
    g.add_argument("--fresh-prefill", action="store_true",
                   help="a fresh engine and prefill per configuration instead of rewinding a shared prefix")
    g.add_argument("--from-json", metavar="PATH", help="only print the tables (and --plot) of a saved run")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def _print_decode(results: dict, plot: str | None) -> None:
    d = results["decode"]
    rows = [DecodeRow(**r) for r in d["rows"]]
    print(f"\nDecode-mode quality vs dense: pydoc topics from token {d.get('text_offset', 0)}, ctx "
          f"{d['ctx']}, {d['steps']} teacher-forced steps, block_len {results['block_len']}, init "
          f"{results['init_blocks']} + topk + local {results['local_blocks']}, retrieval "
          f"{results['retrieval']}")
    print(format_decode_table(rows))
    print("\nanchor types by mean recall over the budgets run (recall / oracle in brackets):")
    for i, (an, r, eff) in enumerate(rank_by_recall(rows), 1):
        print(f"  {i}. {an:<11} {r:.4f}" + (f"  ({eff:.3f})" if eff is not None else ""))
    if plot:
        plot_recall(rows, plot, f"{results['model']}: ctx {d['ctx']}, {d['steps']} decode steps")
        print(f"plot: {plot}")


def _print_passkey(results: dict) -> None:
    p = results["passkey"]
    samples = [PasskeySample(**s) for s in p["samples"]]
    depths = sorted(set(s.depth for s in samples))
    print(f"\nPasskey retrieval (correct / samples), sparse budget "
          f"{', '.join(budget_label(b) for b in p['budgets'])} of the prompt, question "
          f"{'prefilled' if p['question_in_prefill'] else 'fed as decode steps'}, depths "
          f"{', '.join(f'{d:g}' for d in depths)}")
    print(format_passkey_table(samples))


def _replay(path: str, plot: str | None) -> int:
    """Print the tables (and plot) of a run saved with --json."""
    with open(path) as f:
        results = json.load(f)
    if "decode" in results:
        _print_decode(results, plot)
    if "passkey" in results:
        _print_passkey(results)
    return 0


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.quick:
        a.ctx, a.steps, a.anchors, a.budgets = 1024, 8, "quest,cuboid_mean", "1/8"
        a.passkey_lengths, a.passkey_depths, a.passkey_samples = "1024", "0.5", 1
        a.passkey_budgets = "1/8"
    try:
        anchors = _list(a.anchors)
        bad = [x for x in anchors if x not in ANCHORS]
        if bad:
            raise ValueError(f"unknown anchor type {bad[0]!r} (one of {', '.join(ANCHORS)})")
        budgets = [parse_budget(b) for b in _list(a.budgets)]
        pk_budgets = [parse_budget(b) for b in _list(a.passkey_budgets)]
        pk_lengths = [int(x) for x in _list(a.passkey_lengths)]
        pk_depths = [float(x) for x in _list(a.passkey_depths)]
        pk_anchors = _list(a.passkey_anchors) or anchors
        bad = [x for x in pk_anchors if x not in ANCHORS]
        if bad:
            raise ValueError(f"unknown anchor type {bad[0]!r} (one of {', '.join(ANCHORS)})")
        if any(not 0.0 <= d <= 1.0 for d in pk_depths):
            raise ValueError("passkey depths must lie in [0, 1]")
        if a.ctx < 1 or a.steps < 1 or a.passkey_samples < 0:
            raise ValueError("--ctx and --steps must be >= 1, --passkey-samples >= 0")
    except ValueError as e:
        ap.error(str(e))
    if a.from_json:
        return _replay(a.from_json, a.plot)
    log = (lambda s: None) if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    if a.model:
        path = a.model
    else:
        from pyimp.runtime.default_model import default_model_path
        path = str(default_model_path())

    n_ctx = a.ctx + a.steps
    if not a.skip_passkey:
        n_ctx = max(n_ctx, max(pk_lengths) + 16)
    t_start = time.perf_counter()
    runner = PrefixRunner(path, n_ctx, a.block_len, a.importance_window)
    t_warm = runner.warmup()
    log(f"model {os.path.basename(path)}, context {n_ctx}, block_len {a.block_len}; "
        f"compile/warm-up {t_warm:.1f} s")
    results: dict = {"model": os.path.basename(path), "block_len": a.block_len,
                     "init_blocks": a.init_blocks, "local_blocks": a.local_blocks,
                     "retrieval": a.retrieval, "importance_window": a.importance_window}

    rows = []
    if not a.skip_decode:
        ids = runner.engine.tokenize(pydoc_text())[a.text_offset:]
        if a.text_offset:
            ids = [max(runner.engine.cfg.bos_id, 0)] + ids
        if len(ids) < a.ctx + a.steps:
            ap.error(f"the text has {len(ids)} tokens from --text-offset {a.text_offset}, "
                     f"--ctx + --steps needs {a.ctx + a.steps}")
        configs = make_configs(anchors, budgets, a.ctx, a.block_len, a.init_blocks, a.local_blocks,
                               a.retrieval)
        configs += [SparseConfig(an, 0, None, a.init_blocks, a.local_blocks, a.retrieval,
                                 recall_target=float(t))
                    for an in anchors for t in _list(a.recall_targets)]
        configs += [dataclasses.replace(c, select=m) for m in _list(a.selects)
                    for c in make_configs(anchors[:1], budgets, a.ctx, a.block_len,
                                          a.init_blocks, a.local_blocks, a.retrieval)]
        rows = decode_quality(path, ids, a.ctx, a.steps, configs, a.block_len, a.importance_window,
                              fresh_prefill=a.fresh_prefill, runner=runner, oracle=not a.no_oracle,
                              log=log)
        results["decode"] = {"ctx": a.ctx, "steps": a.steps, "text_offset": a.text_offset,
                             "rows": [asdict(r) for r in rows]}
        _print_decode(results, a.plot)

    if not a.skip_passkey and a.passkey_samples > 0:
        samples = passkey_eval(runner, pk_lengths, pk_depths, a.passkey_samples, pk_anchors, pk_budgets,
                               a.init_blocks, a.local_blocks, a.retrieval, a.seed,
                               a.question_in_prefill, log=log)
        results["passkey"] = {"budgets": pk_budgets, "question_in_prefill": a.question_in_prefill,
                              "samples": [asdict(s) for s in samples]}
        _print_passkey(results)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"json: {a.json}")
    return 0


if __name__ == "__main__":
    from pyimp.runtime.process import configure_process
    configure_process()   # before the first parallel kernel starts OpenMP
    sys.exit(main())
