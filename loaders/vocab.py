"""Tokenizer vocabulary as stored in a GGUF file's ``tokenizer.ggml.*`` keys."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# llama.cpp token attribute types (tokenizer.ggml.token_type)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6


@dataclass(frozen=True)
class Vocab:
    """Everything a tokenizer needs, read once from GGUF metadata.

    tokens       list[str], one per id (``tokenizer.ggml.tokens``)
    scores       float32[n_vocab] (zeros when the key is absent)
    token_types  int32[n_vocab] (TOKEN_NORMAL when the key is absent)
    merges       list[str] "left right" (BPE only; empty otherwise)
    model        ``tokenizer.ggml.model``: "llama" (SPM), "gpt2" (BPE), ...
    pre          ``tokenizer.ggml.pre`` ("default" when absent)
    special      special token ids by name: bos, eos, unk, sep, pad, eot, ... (-1 when absent)
    flags        add_bos_token, add_eos_token, add_space_prefix, ... (only the keys present)
    """

    tokens: list
    scores: np.ndarray
    token_types: np.ndarray
    merges: list
    model: str
    pre: str
    special: dict = field(default_factory=dict)
    flags: dict = field(default_factory=dict)

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)
