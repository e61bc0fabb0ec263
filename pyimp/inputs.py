"""The engine's checks of what a caller passes: token ids and generation lengths, each refused
with one TypeError or ValueError naming what was given."""
from __future__ import annotations

import numpy as np


def token_ids(tokens, n_vocab: int) -> np.ndarray:
    """``tokens`` as int64[T]: a 1-D integer array (not bool) or a sequence of Python /
    NumPy integers, each in [0, n_vocab); TypeError or ValueError naming what was given."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"token ids must be a 1-D sequence, got an array of shape "
                             f"{tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got an array of {tokens.dtype}")
        bad = tokens[(tokens < 0) | (tokens >= n_vocab)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} is outside the vocabulary (size {n_vocab})")
        return tokens.astype(np.int64)
    if isinstance(tokens, (np.generic, int, float)):
        raise ValueError(f"token ids must be a 1-D sequence, got a scalar of shape () "
                         f"({tokens!r})")
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"token ids must be integers, got a {type(tokens).__name__} "
                        f"(tokenize text first)")
    seq = list(tokens)
    for t in seq:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token ids must be integers, got {t!r} ({type(t).__name__})")
        if not 0 <= t < n_vocab:
            raise ValueError(f"token id {int(t)} is outside the vocabulary (size {n_vocab})")
    return np.array(seq, dtype=np.int64)


def max_tokens(n) -> int:
    """``max_tokens`` as ``-n/--n-predict`` takes it: an integer >= -1 (-1: no limit)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"max_tokens must be an integer (-1: until an end-of-generation token or "
                        f"a full context), got {n!r}")
    if n < -1:
        raise ValueError(f"max_tokens must be >= -1 (-1: until an end-of-generation token or a "
                         f"full context), got {int(n)}")
    return int(n)
