"""Sampler against an independent formulation of the distribution it must draw from.

``target_distribution`` states llama.cpp's chain (repetition penalty -> top-k ->
top-p -> min-p -> temperature) with set definitions instead of a sorted
candidate list:

* rank(i)  = #{j : z_j > z_i, or z_j == z_i and j < i}  (ties: lower id first)
* top-k    = {i : rank(i) < k}
* top-p    = {i in top-k : mass of the top-k softmax strictly ahead of i < p}, plus rank 0
* min-p    = {i : z_i - max z >= log(min_p)}  (p_i / p_max >= min_p at temperature 1)
* draw     ~ exp(z_i / T) on what is left, zero elsewhere.

Three kinds of checks: greedy is exact; the distribution the sampler hands to
its RNG equals the target (support exactly, probabilities to float64 rounding);
and frequencies of real draws at fixed seeds pass exact binomial tests with a
stated false-failure probability.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pyimp.ops import log_softmax, token_logprob
from pyimp.sampling import Sampler, SamplingParams


# ----------------------------------------------------------------------------- the target

def penalized(logits: np.ndarray, p: SamplingParams, history) -> np.ndarray:
    """Logits after the repetition penalty: each distinct token among the last
    ``repeat_last_n`` ids once, positive logits divided, others multiplied."""
    z = logits.astype(np.float64).copy()
    if p.repeat_penalty != 1.0 and p.repeat_last_n > 0:
        for t in set(list(history)[-p.repeat_last_n:]):
            z[t] = z[t] / p.repeat_penalty if z[t] > 0 else z[t] * p.repeat_penalty
    return z


def target_sets(z: np.ndarray, p: SamplingParams):
    """(ahead, in_top_k, mass_ahead, kept) by the set definitions of the module docstring.

    ahead[i, j]: token j precedes token i; mass_ahead[i]: top-k softmax mass ahead of i.
    """
    ids = np.arange(z.size)
    ahead = (z[None, :] > z[:, None]) | ((z[None, :] == z[:, None]) & (ids[None, :] < ids[:, None]))
    rank = ahead.sum(axis=1)
    in_k = rank < p.top_k if 0 < p.top_k < z.size else np.ones(z.size, bool)
    w = np.where(in_k, np.exp(z - z.max()), 0.0)  # the maximum has rank 0: always in top-k
    pk = w / w.sum()
    mass_ahead = (ahead * pk[None, :]).sum(axis=1)
    kept = in_k.copy()
    if p.top_p < 1.0:
        kept &= (mass_ahead < p.top_p) | (rank == 0)
    if p.min_p > 0.0:
        kept &= z - z.max() >= math.log(p.min_p)
    return ahead, in_k, mass_ahead, kept


def target_distribution(logits: np.ndarray, p: SamplingParams, history=()) -> np.ndarray:
    """float64[V]: the probability of drawing each token (0 outside the kept set)."""
    z = penalized(logits, p, history)
    _, _, _, kept = target_sets(z, p)
    zk = np.where(kept, z / p.temperature, -np.inf)
    q = np.exp(zk - zk.max())
    return q / q.sum()


def clear_of_boundaries(logits, p: SamplingParams, history=(), margin=1e-9) -> bool:
    """No token sits within ``margin`` of a top-p or min-p threshold, where the sampler's
    sorted cumulative sums and this module's set sums may round to different sides."""
    z = penalized(logits, p, history)
    _, in_k, mass_ahead, _ = target_sets(z, p)
    ok = True
    if p.top_p < 1.0:
        ok &= bool(np.all(np.abs(mass_ahead[in_k] - p.top_p) > margin))
    if p.min_p > 0.0:
        ok &= bool(np.all(np.abs(z - z.max() - math.log(p.min_p)) > margin))
    return ok


# ----------------------------------------------------------------------------- reading the sampler

class _ProbeRNG:
    """Stands in for the sampler's generator: records the distribution passed to
    ``choice`` and returns a chosen index, so the sampler maps each index to its token."""

    def __init__(self, index: int):
        self.index = index
        self.seen = None

    def choice(self, n, p=None):
        self.seen = (int(n), np.asarray(p, np.float64).copy())
        return self.index if self.index < n else n - 1


def sampler_distribution(logits, p: SamplingParams, history=()) -> np.ndarray:
    """float64[V]: the distribution the sampler draws from, read through _ProbeRNG."""
    s = Sampler(p)
    s.rng = probe = _ProbeRNG(0)
    s.sample(logits, list(history))
    assert probe.seen is not None, "the sampler no longer draws through rng.choice(n, p=...)"
    n, probs = probe.seen
    out = np.zeros(logits.size)
    for i in range(n):
        s.rng = _ProbeRNG(i)
        tok = s.sample(logits, list(history))
        assert out[tok] == 0.0, f"token {tok} appears twice among the candidates"
        out[tok] = probs[i]
    return out


def assert_same_distribution(got: np.ndarray, want: np.ndarray) -> None:
    # support: exact set equality
    assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))
    # probabilities: two float64 softmaxes of the same <= V logits summed in different
    # orders; each differs from the exact value by a few ulps times V (V <= 2000 here)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- greedy (exact)

@settings(max_examples=200, deadline=None)
@given(data=st.data(), n=st.integers(1, 40), penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
       last_n=st.integers(0, 8), offset=st.sampled_from([0.0, -4.0]))
def test_greedy_is_lowest_id_among_the_penalized_maxima(data, n, penalty, last_n, offset):
    # quarter-integer logits make ties (and ties created by the penalty) common; the offset
    # makes every logit negative, where the penalty multiplies instead of dividing
    vals = data.draw(st.lists(st.integers(-12, 12), min_size=n, max_size=n))
    logits = np.array(vals, np.float32) / 4 + np.float32(offset)
    history = data.draw(st.lists(st.integers(0, n - 1), max_size=12))
    p = SamplingParams(temperature=0.0, repeat_penalty=penalty, repeat_last_n=last_n)
    z = penalized(logits, p, history)
    want = min(i for i in range(n) if z[i] == z.max())
    assert Sampler(p).sample(logits, history) == want
    # the filters do not matter to greedy
    p2 = SamplingParams(temperature=-1.0, top_k=1, top_p=0.1, min_p=0.9, repeat_penalty=penalty,
                        repeat_last_n=last_n)
    assert Sampler(p2).sample(logits, history) == want


def test_greedy_penalty_examples():
    logits = np.array([0.0, 5.0, 4.9, -3.0, 1.0], np.float32)
    assert Sampler(SamplingParams(temperature=0)).sample(logits, []) == 1
    # 5.0 / 1.5 < 4.9: the penalty on token 1 makes token 2 the greedy choice
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.5)).sample(logits, [1]) == 2
    # outside the last repeat_last_n ids the penalty does not apply
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=1)).sample(logits, [1, 4]) == 1
    # negative logits are multiplied (pushed down), not divided (pulled up)
    neg = np.array([-1.0, -1.2], np.float32)
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.5)).sample(neg, [0]) == 1


# ----------------------------------------------------------------------------- the distribution handed to the RNG

@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 300), top_k=st.integers(-1, 80),
       top_p=st.sampled_from([1.0, 0.99, 0.9, 0.6, 0.3, 0.0]), min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5]),
       temp=st.floats(0.2, 3.0), penalty=st.sampled_from([1.0, 1.1, 1.8]), ties=st.booleans())
def test_distribution_equals_the_set_definition(seed, n, top_k, top_p, min_p, temp, penalty, ties):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(n) * 3).astype(np.float32)
    if ties:
        logits = np.round(logits * 2) / 2  # many equal logits, also across the top-k boundary
    history = rng.integers(0, n, size=rng.integers(0, 20)).tolist()
    p = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=penalty,
                       repeat_last_n=16)
    assume(clear_of_boundaries(logits, p, history))
    assert_same_distribution(sampler_distribution(logits, p, history), target_distribution(logits, p, history))


def _large_vocab_with_tie():
    """2000 logits whose ranks 35..44 hold one value (ids 252, 433, ..., 1714)."""
    logits = (np.random.default_rng(4).standard_normal(2000) * 3).astype(np.float32)
    order = np.argsort(-logits, kind="stable")
    logits[order[35:45]] = logits[order[40]]
    return logits, np.flatnonzero(logits == logits[order[40]])


@pytest.mark.parametrize("k", [1, 35, 45, 60])
def test_partial_top_k_on_a_large_vocabulary(k):
    # the partial-sort path (top-k < V) on 2000 tokens; the tied block lies wholly in or out
    logits, _ = _large_vocab_with_tie()
    p = SamplingParams(temperature=0.9, top_k=k, top_p=1.0, min_p=0.0)
    assert_same_distribution(sampler_distribution(logits, p), target_distribution(logits, p))


@pytest.mark.parametrize("k", [36, 40, 41])
def test_top_k_tie_is_broken_by_id(k):
    logits, tied = _large_vocab_with_tie()
    p = SamplingParams(temperature=0.9, top_k=k, top_p=1.0, min_p=0.0)
    got = sampler_distribution(logits, p)
    chosen = tied[got[tied] > 0]
    assert chosen.tolist() == tied[:len(chosen)].tolist()  # the lowest ids win the tie
    assert_same_distribution(got, target_distribution(logits, p))


@pytest.mark.parametrize("p, support", [
    (SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0), {1, 2}),
    # softmax of [0, 5, 4.9, -3, 1]: p1 = 0.517, p2 = 0.468; top-p 0.5 keeps token 1 only
    (SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0), {1}),
    # ... top-p 0.6: mass ahead of token 2 is 0.517 < 0.6: kept; ahead of token 4 is 0.985
    (SamplingParams(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0), {1, 2}),
    (SamplingParams(temperature=1.0, top_k=0, top_p=0.99, min_p=0.0), {1, 2, 4}),
    # min-p 0.01: exp(1 - 5) = 0.018 keeps token 4, exp(0 - 5) = 0.0067 drops token 0
    (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.01), {1, 2, 4}),
    # min-p is applied before temperature: a hot temperature does not bring token 0 back
    (SamplingParams(temperature=5.0, top_k=0, top_p=1.0, min_p=0.01), {1, 2, 4}),
    (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), {0, 1, 2, 3, 4}),
])
def test_support_by_hand(p, support):
    logits = np.array([0.0, 5.0, 4.9, -3.0, 1.0], np.float32)
    got = sampler_distribution(logits, p)
    assert set(np.flatnonzero(got)) == support
    assert set(np.flatnonzero(target_distribution(logits, p))) == support


# ----------------------------------------------------------------------------- real draws

def binomial_two_sided_p(count: int, n: int, q: float) -> float:
    """Exact two-sided p-value 2 * min(P[X <= count], P[X >= count]) of X ~ Binomial(n, q)."""
    if q <= 0.0:
        return 1.0 if count == 0 else 0.0
    if q >= 1.0:
        return 1.0 if count == n else 0.0
    k = np.arange(n + 1)
    log_fact = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1)))])
    logpmf = log_fact[n] - log_fact[k] - log_fact[n - k] + k * math.log(q) + (n - k) * math.log1p(-q)
    pmf = np.exp(logpmf)
    return float(min(1.0, 2 * min(pmf[:count + 1].sum(), pmf[count:].sum())))


# Each case draws N tokens with one fixed seed and tests every token's count with an
# exact binomial test at level DELTA / V (Bonferroni over V tokens): a correct sampler
# fails a case with probability <= DELTA = 1e-6 over seeds. With N = 20000 a shift of
# about 0.02 in a token's probability is detected.
N_DRAWS = 20000
DELTA = 1e-6
DRAW_CASES = {
    "plain": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "defaults": SamplingParams(),
    "top_k_ties": SamplingParams(temperature=0.7, top_k=6, top_p=1.0, min_p=0.0),
    "top_p": SamplingParams(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0),
    "min_p_hot": SamplingParams(temperature=2.5, top_k=0, top_p=1.0, min_p=0.05),
    "penalty": SamplingParams(temperature=1.0, top_k=10, top_p=0.95, min_p=0.02, repeat_penalty=1.6,
                              repeat_last_n=4),
}


@pytest.mark.parametrize("name", list(DRAW_CASES))
def test_draw_frequencies(name):
    p = SamplingParams(**{**DRAW_CASES[name].__dict__, "seed": 1234})
    logits = (np.random.default_rng(77).standard_normal(30) * 1.5).astype(np.float32)
    logits[[3, 8, 21]] = logits.max()  # a three-way tie at the top
    history = [3, 3, 8, 12, 5]
    assert clear_of_boundaries(logits, p, history)
    q = target_distribution(logits, p, history)
    s = Sampler(p)
    counts = np.bincount([s.sample(logits, history) for _ in range(N_DRAWS)], minlength=q.size)
    assert np.all(counts[q == 0] == 0), "drew a token outside the kept set"
    pvals = [binomial_two_sided_p(int(c), N_DRAWS, float(qi)) for c, qi in zip(counts, q)]
    worst = int(np.argmin(pvals))
    assert pvals[worst] >= DELTA / q.size, \
        f"token {worst}: {counts[worst]} draws, expected {N_DRAWS * q[worst]:.1f} (p = {pvals[worst]:.3g})"


def test_binomial_test_has_power():
    # the bound the draw test uses rejects a 0.02 shift at N = 20000 and accepts the mean
    assert binomial_two_sided_p(int(0.30 * N_DRAWS), N_DRAWS, 0.32) < DELTA / 30
    assert binomial_two_sided_p(int(0.32 * N_DRAWS), N_DRAWS, 0.32) > 0.5


def test_same_seed_same_draws():
    logits = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=42)
    a, b = Sampler(p), Sampler(p)
    assert [a.sample(logits, []) for _ in range(50)] == [b.sample(logits, []) for _ in range(50)]


def test_invalid_params():
    for kw, match in [({"top_p": 1.5}, "top-p"), ({"min_p": -0.1}, "min-p"), ({"repeat_penalty": 0.0}, "penalty"),
                      ({"repeat_last_n": -1}, "repeat-last-n"), ({"temperature": float("nan")}, "temperature")]:
        with pytest.raises(ValueError, match=match):
            Sampler(SamplingParams(**kw))


def test_token_logprob_matches_log_softmax():
    x = np.random.default_rng(1).standard_normal(262144).astype(np.float32) * 8
    ref = log_softmax(x)
    for t in (0, 17, 262143, int(np.argmax(x))):
        # float32 exp of (x - max) with a float64 sum: within a few float32 ulps of the float64 value
        assert token_logprob(x, t) == pytest.approx(ref[t], abs=1e-5)
