"""Generation: the iterator behind :meth:`pyimp.engine.Engine.generate`."""
from __future__ import annotations

from typing import Iterator

from . import ops


def tokens(engine, ids: list, max_tokens: int, sampler, stop, progress,
           reuse_prefix: bool) -> Iterator[tuple[int, float]]:
    """Yield (token id, log-probability) continuing ``ids`` on ``engine`` (arguments checked by
    Engine.generate). The iterator holds the engine from its first step to its end, and between
    tokens belongs to no thread (any thread may advance it)."""
    engine._seq.take("generate")
    try:
        if not reuse_prefix:
            engine.reset()
            engine.check_tokens(ids)
        if max_tokens > 0 and len(ids) + max_tokens > engine.n_ctx:
            max_tokens = engine.n_ctx - len(ids)
        if reuse_prefix:
            logits = engine.prime(ids, progress=progress)[-1]
        else:
            logits = engine.eval(ids, all_logits=False, progress=progress)[-1]
        eog = engine.eog_ids()
        decoder = engine.tokenizer.incremental_decoder(continuation=True) if stop else None
        text = ""
        n = 0
        while max_tokens < 0 or n < max_tokens:
            tok = sampler.sample(logits, engine.tokens)
            logp = ops.token_logprob(logits, tok)
            n += 1
            engine._seq.suspend()
            yield tok, logp
            engine._seq.resume()
            if tok in eog:
                return
            if stop:
                text += decoder.feed(tok)
                if any(s in text for s in stop):
                    return
            if len(engine.tokens) >= engine.n_ctx or n == max_tokens:
                return
            logits = engine.decode_one(tok)[-1]
    finally:
        engine._seq.give_back()

