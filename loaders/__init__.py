"""File formats for pyimp: GGUF, tokenizer vocabularies, ggml quant blocks.

This package never imports :mod:`pyimp`; the engine depends on it, not the
other way round.
"""
