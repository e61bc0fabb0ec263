"""Token sampling with llama.cpp's default chain.

Order: repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw.
``temperature <= 0`` is greedy (argmax of the penalized logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40            # <= 0: off
    top_p: float = 0.95        # >= 1: off
    min_p: float = 0.05        # <= 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64
    seed: int = -1             # < 0: random

    def validate(self) -> None:
        if not np.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top-p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min-p must be in [0, 1], got {self.min_p}")
        if not self.repeat_penalty > 0.0:
            raise ValueError(f"repeat penalty must be positive, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ValueError(f"repeat-last-n must be >= 0, got {self.repeat_last_n}")


class Sampler:
    """Stateful sampler: holds the RNG; call :meth:`sample` once per generated token."""

    def __init__(self, params: SamplingParams):
        params.validate()
        self.params = params
        self.rng = np.random.default_rng(None if params.seed < 0 else params.seed)

    def sample(self, logits: np.ndarray, history: list[int]) -> int:
        """Pick the next token id from float32[n_vocab] logits given the previous ids."""
        p = self.params
        z = logits.astype(np.float64).copy()
        total = z.sum()   # float64: finite float32 logits cannot overflow it; NaN / +inf show
        if np.isnan(total) or total == np.inf:
            raise ValueError("the logits contain NaN or +inf (corrupted weights?): nothing to sample from")
        if p.repeat_penalty != 1.0 and p.repeat_last_n > 0 and history:
            ids = np.unique(np.asarray(history[-p.repeat_last_n:], dtype=np.int64))
            v = z[ids]
            z[ids] = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
        if p.temperature <= 0.0:
            return int(np.argmax(z))
        # candidates sorted by logit, descending (stable: lower id first on ties); with top-k
        # only the k best are sorted (a full sort of a 262k vocabulary costs ~25 ms)
        if 0 < p.top_k < z.size:
            # the partition keeps an arbitrary subset of the tokens tied at rank k: keep every
            # token above the k-th logit, then the lowest ids among those equal to it
            kth = z[np.argpartition(-z, p.top_k - 1)[p.top_k - 1]]
            above = np.flatnonzero(z > kth)
            top = np.concatenate([above, np.flatnonzero(z == kth)[:p.top_k - above.size]])
            order = top[np.lexsort((top, -z[top]))]
        else:
            order = np.argsort(-z, kind="stable")
        cz = z[order]
        probs = np.exp(cz - cz[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            order, cz, probs = order[:keep], cz[:keep], probs[:keep]
            probs = probs / probs.sum()
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            order, cz = order[keep], cz[keep]
        cz = cz / p.temperature
        probs = np.exp(cz - cz.max())
        probs /= probs.sum()
        return int(order[self.rng.choice(len(order), p=probs)])
