"""The real Gemma 3 270M Q4_K_M model against llama.cpp."""
from __future__ import annotations

import numpy as np
import pytest

from pyimp.engine import Engine, EngineOptions
from tools import llamacpp_peer
from tests.test_engine import kl

pytestmark = pytest.mark.skipif(not llamacpp_peer.available(), reason="llama-cpp-python is not installed")

PROMPTS = [
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city "
    "of Rome and ending, in the West, with the deposition of the last emperor in 476. During this "
    "long period the empire expanded across the Mediterranean world and",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number using an iterative loop.\"\"\"\n"
    "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "def factorial(n):\n    \"\"\"Return n! for a non-negative integer n.\"\"\"\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy. In the chloroplasts, chlorophyll absorbs sunlight, and water and "
    "carbon dioxide are turned into glucose and oxygen. This reaction powers nearly every food chain on "
    "Earth, and the oxygen it releases into the atmosphere is the oxygen we breathe",
]


@pytest.fixture(scope="module")
def engine(gemma_path):
    return Engine(gemma_path, EngineOptions(n_ctx=512, numerics="ggml", kv_type="f16"))


@pytest.mark.parametrize("prompt", PROMPTS, ids=["history", "code", "science"])
def test_prompt_logits_close_to_llamacpp(engine, gemma_path, prompt):
    toks = engine.tokenize(prompt)
    assert len(toks) >= 50
    engine.reset()
    ours = engine.eval(toks, all_logits=True)
    ref = llamacpp_peer.logits(gemma_path, toks, n_batch=512, kv_type="f16")
    d = kl(ref, ours)
    top1 = np.mean(np.argmax(ours, -1) == np.argmax(ref, -1))
    # llama.cpp disagrees with itself by mean KL 3.5e-3 / top-1 98% when only its batch size
    # changes (MODEL_NOTES.md); the bar is ~2x that variation
    assert d.mean() <= 1e-2, f"mean KL {d.mean():.3g}, max {d.max():.3g}"
    assert top1 >= 0.90, f"top-1 agreement {top1:.3f}"


def test_greedy_continuation_matches_llamacpp(engine, gemma_path):
    # This model has many near-ties: llama.cpp's own greedy text changes after 2-11 tokens on
    # several factual prompts when only its batch size changes (e.g. "The capital of France
    # is": 11 tokens). A prompt is a fair oracle only where llama.cpp agrees with itself, so
    # that is checked first, then pyimp must reproduce 16 tokens exactly.
    toks = engine.tokenize("Water boils at a temperature of")
    from pyimp.sampling import SamplingParams
    ref = llamacpp_peer.greedy(gemma_path, toks, 16, n_batch=512, kv_type="f16")
    assert llamacpp_peer.greedy(gemma_path, toks, 16, n_batch=1, kv_type="f16") == ref
    ours = [t for t, _ in engine.generate(toks, max_tokens=16, sampling=SamplingParams(temperature=0))]
    assert ours == ref, (engine.detokenize(ours), engine.detokenize(ref))
