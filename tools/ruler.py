"""RULER's synthetic long-context tasks, generated offline and deterministically from a seed.

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024; NVIDIA/RULER, ``scripts/data/synthetic``) defines thirteen synthetic tasks; the
ten without a QA corpus are built here, each as RULER's configuration names it:

- ``niah_single_1/2/3``: one needle ``One of the special magic {numbers|uuids} for {key} is:
  {value}.`` in a haystack of repeated noise sentences (1) or of essay text (2, 3); keys are
  words, values 7-digit numbers (1, 2) or UUIDs (3).
- ``niah_multikey_1/2/3``: four needles with different keys, one asked; the haystack is essay
  text (1), or made of needles itself: every line a needle with another key (2: word keys,
  number values; 3: UUID keys and values).
- ``niah_multivalue``: four values under the asked key, all four wanted.
- ``niah_multiquery``: four keys asked at once, each one's value wanted.
- ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... of five
  variables hidden in noise; all variables holding the value are wanted.
- ``cwe`` (common word extraction): a numbered list where ten words appear 30 times and the
  others 3 times; the ten most common are wanted.
- ``fwe`` (frequent word extraction): coded words drawn from a Zipf law (alpha 2); the three
  most frequent are wanted.

RULER's essays (Paul Graham's) are replaced by Python's own documentation (``pydoc_data``'s
topics, shipped with every Python), its word lists (wonderwords) by adjective-noun pairs of
words taken from that text: nothing is downloaded. Each task's template, answer prefix and
tokens to generate are RULER's. Scoring is RULER's: ``string_match_all`` (the share of
reference strings found, case-insensitive, in the prediction) for every task here;
``string_match_part`` (any reference found) is RULER's QA metric, given for completeness.

A case is made to fit ``n_tokens`` of the model's tokenizer (prompt and answer prefix; the
answer is generated after them) by bisecting the haystack's size. The same (task, seed,
index, n_tokens, tokenizer) gives the same prompt, byte for byte.

    from tools.ruler import TASKS, make_case
    case = make_case("niah_single_2", seed=1000, index=0, n_tokens=4096, tokenize=eng.tokenize)
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to "
                 "memorize it. I will quiz you about the {type_v} afterwards.\n{context}\nWhat are "
                 "all the special magic {type_v} for {query} mentioned in the provided text?")
NIAH_ANSWER = " The special magic {type_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following "
               "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
               "{query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, "
             "{num_v} variables are assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than "
                "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are "
                "the 10 most common words in the above list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find "
                "the three most frequently appeared coded words. {context}\nQuestion: Do not "
                "provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
FWE_ANSWER = (" Answer: According to the coded text above, the three most frequently appeared "
              "words are:")

# RULER's synthetic.yaml: haystack, key kind, value kind, keys, values per key, keys asked
NIAH = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}
TASKS = tuple(NIAH) + ("vt", "cwe", "fwe")
# RULER's tokens_to_generate per task
GENERATE = {**{t: 128 for t in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}
DEPTHS = np.linspace(0, 100, 40)          # RULER's needle depths, percent of the haystack
VT_HOPS = 4                               # one chain of 5 variables
CWE_COMMON, CWE_FREQ, CWE_RARE_FREQ = 10, 30, 3
FWE_ALPHA, FWE_VOCAB = 2.0, 1000


@dataclass(frozen=True)
class Case:
    """One generated case: ``prompt`` (the input with its answer prefix appended, as RULER feeds
    it), the reference strings ``answers`` and the tokens to generate.

    ``prompt`` is ``context + questions[0][0]``: the context (instructions and haystack) and
    RULER's question with its answer prefix. ``questions`` holds (question text, answers)
    pairs that can follow the same context: RULER's first, then, for needle tasks with other
    keys, a single-key question for each key not asked alone (compress-once-ask-many)."""

    task: str
    seed: int
    index: int
    prompt: str
    answers: tuple
    max_new_tokens: int
    n_tokens: int                   # the prompt's length in the model's tokens
    context: str = ""
    questions: tuple = ()


def _split(task: str, prompt: str, answers: tuple, extra: tuple = ()) -> dict:
    """The context / questions fields of a case whose prompt asks at its last question mark."""
    cut = prompt.rfind("\nWhat are all the special magic" if task in NIAH else "\nQuestion:")
    return {"context": prompt[:cut], "questions": ((prompt[cut:], answers),) + extra}


@lru_cache(maxsize=1)
def essay_text() -> str:
    """The essay haystack: Python's pydoc topics in key order, whitespace runs collapsed."""
    import pydoc_data.topics as topics
    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    return re.sub(r"\s+", " ", text).strip()


@lru_cache(maxsize=1)
def word_list() -> tuple:
    """The lowercase words of 4-10 letters that :func:`essay_text` uses at least 3 times, each
    once, sorted (whole words only: no identifiers' fragments)."""
    counts: dict = {}
    for w in re.findall(r"\b[a-z]{4,10}\b", essay_text()):
        counts[w] = counts.get(w, 0) + 1
    return tuple(sorted(w for w, c in counts.items() if c >= 3))


def _rng(task: str, seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, TASKS.index(task), index])


def _word_key(rng) -> str:
    """An adjective-noun style key, as RULER's wonderwords pairs: two words joined by '-'."""
    w = word_list()
    a, b = rng.choice(len(w), 2, replace=False)
    return f"{w[a]}-{w[b]}"


def _uuid(rng) -> str:
    return str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4))


def _number(rng) -> str:
    return str(int(rng.integers(10 ** 6, 10 ** 7)))


def _make(kind: str, rng) -> str:
    return {"words": _word_key, "numbers": _number, "uuids": _uuid}[kind](rng)


def _fit(build: Callable[[int], str], tokenize, n_tokens: int, hi: int) -> tuple[str, int]:
    """The prompt build(k) of the largest k in 0..hi whose length fits n_tokens, and its length."""
    def length(k):
        return len(tokenize(build(k)))
    lo = 0
    if length(0) > n_tokens:
        raise ValueError(f"a prompt of this task needs more than {n_tokens} tokens")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length(mid) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return build(lo), length(lo)


def _niah(task: str, seed: int, index: int, n_tokens: int, tokenize) -> Case:
    hay, k_kind, v_kind, n_keys, n_values, n_queries = NIAH[task]
    rng = _rng(task, seed, index)
    type_v = {"numbers": "numbers", "uuids": "uuids", "words": "words"}[v_kind]
    keys = []
    while len(keys) < n_keys:
        k = _make(k_kind, rng)
        if k not in keys:
            keys.append(k)
    values = [[_make(v_kind, rng) for _ in range(n_values)] for _ in keys]
    needles = [NEEDLE.format(type_v=type_v, key=k, value=v) for k, vs in zip(keys, values)
               for v in vs]
    order = rng.permutation(len(needles))
    needles = [needles[i] for i in order]
    asked = keys[:n_queries]
    query = asked[0] if n_queries == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    answers = tuple(v for i in range(n_queries) for v in values[i])
    if hay == "noise":
        units = [NOISE] * 4096
        sep = " "
    elif hay == "essay":
        units = essay_text().split(" ")
        sep = " "
    else:                         # a haystack of needles with other keys and values
        units = []
        taken = set(keys)
        while len(units) < 2048:
            k = _make(k_kind, rng)
            if k not in taken:
                taken.add(k)
                units.append(NEEDLE.format(type_v=type_v, key=k, value=_make(v_kind, rng)))
        sep = "\n"
    # each needle at one of RULER's depths, as a share of the haystack whatever its size
    depths = np.random.default_rng([seed, TASKS.index(task), index, 1]).choice(
        DEPTHS, len(needles), replace=False) / 100

    def build(k: int) -> str:
        parts = list(units[:k])
        for f, needle in sorted(zip(depths.tolist(), needles), key=lambda p: -p[0]):
            parts.insert(int(round(f * k)), needle)
        context = sep.join(parts)
        return (NIAH_TEMPLATE.format(type_v=type_v, context=context, query=query)
                + NIAH_ANSWER.format(type_v=type_v, query=query))
    prompt, n = _fit(build, tokenize, n_tokens, len(units))
    alone = [] if n_queries > 1 else [keys[0]]
    extra = tuple(("\n" + NIAH_TEMPLATE.split("\n")[-1].format(type_v=type_v, query=k)
                   + NIAH_ANSWER.format(type_v=type_v, query=k), tuple(vs))
                  for k, vs in zip(keys, values) if k not in alone)
    return Case(task, seed, index, prompt, answers, GENERATE[task], n,
                **_split(task, prompt, answers, extra))


def _vt(seed: int, index: int, n_tokens: int, tokenize) -> Case:
    rng = _rng("vt", seed, index)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = []
    while len(names) < VT_HOPS + 1:
        v = "".join(letters[i] for i in rng.integers(0, 26, 5))
        if v not in names:
            names.append(v)
    value = str(int(rng.integers(10000, 100000)))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}"
                                               for i in range(VT_HOPS)]
    fr = sorted(float(x) for x in rng.uniform(0, 1, len(chain)))

    def build(k: int) -> str:
        parts = [NOISE] * k
        for f, line in sorted(zip(fr, chain), key=lambda p: -p[0]):
            parts.insert(int(round(f * k)), line + ".")
        return (VT_TEMPLATE.format(context=" ".join(parts), query=value)
                + VT_ANSWER.format(num_v=len(names), query=value))
    prompt, n = _fit(build, tokenize, n_tokens, 4096)
    return Case("vt", seed, index, prompt, tuple(names), GENERATE["vt"], n,
                **_split("vt", prompt, tuple(names)))


def _cwe(seed: int, index: int, n_tokens: int, tokenize) -> Case:
    rng = _rng("cwe", seed, index)
    w = word_list()
    pick = rng.permutation(len(w))
    common = [w[i] for i in pick[:CWE_COMMON]]
    rare = [w[i] for i in pick[CWE_COMMON:]]

    def build(k: int) -> str:
        words = common * CWE_FREQ + rare[:k] * CWE_RARE_FREQ
        order = np.random.default_rng([seed, TASKS.index("cwe"), index, k]).permutation(len(words))
        context = " ".join(f"{i + 1}. {words[j]}" for i, j in enumerate(order))
        return CWE_TEMPLATE.format(context=context) + CWE_ANSWER
    prompt, n = _fit(build, tokenize, n_tokens, len(rare))
    return Case("cwe", seed, index, prompt, tuple(common), GENERATE["cwe"], n,
                **_split("cwe", prompt, tuple(common)))


def _fwe(seed: int, index: int, n_tokens: int, tokenize) -> Case:
    rng = _rng("fwe", seed, index)
    vocab = []
    while len(vocab) < FWE_VOCAB:
        v = "".join(chr(97 + i) for i in rng.integers(0, 26, int(rng.integers(3, 7))))
        if v not in vocab:
            vocab.append(v)
    draws = np.random.default_rng([seed, TASKS.index("fwe"), index, 1]).zipf(FWE_ALPHA, 200000)
    stream = [vocab[d - 1] for d in draws if d <= FWE_VOCAB]

    def build(k: int) -> str:
        return FWE_TEMPLATE.format(context=" .... ".join(stream[:k])) + FWE_ANSWER

    prompt, n = _fit(build, tokenize, n_tokens, len(stream))
    used = prompt[len(FWE_TEMPLATE.split("{context}")[0]):].split("\nQuestion:")[0]
    counts: dict = {}
    for word in used.split(" .... "):
        counts[word] = counts.get(word, 0) + 1
    rank = {v: i for i, v in enumerate(vocab)}
    top = sorted(counts, key=lambda x: (-counts[x], rank[x]))[:3]
    return Case("fwe", seed, index, prompt, tuple(top), GENERATE["fwe"], n,
                **_split("fwe", prompt, tuple(top)))


def make_case(task: str, seed: int, index: int, n_tokens: int,
              tokenize: Callable[[str], list]) -> Case:
    """Case ``index`` of ``task`` for ``seed``, fitted to ``n_tokens`` of ``tokenize`` (text ->
    ids, the model's BOS included if it adds one)."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r} (tasks: {', '.join(TASKS)})")
    if task in NIAH:
        return _niah(task, seed, index, n_tokens, tokenize)
    return {"vt": _vt, "cwe": _cwe, "fwe": _fwe}[task](seed, index, n_tokens, tokenize)


def string_match_all(prediction: str, answers) -> float:
    """RULER's metric for these tasks: the share of ``answers`` found in ``prediction``,
    case-insensitive (1.0 when every reference string appears)."""
    p = prediction.lower()
    return sum(a.lower() in p for a in answers) / len(answers)


def string_match_part(prediction: str, answers) -> float:
    """RULER's QA metric: 1.0 when any of ``answers`` appears in ``prediction``."""
    p = prediction.lower()
    return float(max(a.lower() in p for a in answers))
