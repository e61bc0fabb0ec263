"""Tokenizers that give llama.cpp's token ids for a GGUF vocabulary.

Two vocabulary kinds are supported, chosen by ``tokenizer.ggml.model``:

* ``llama`` (SPM): special tokens are cut out of the text first (see
  ``_partition``), each remaining piece gets llama.cpp's optional space prefix
  and has ' ' replaced by U+2581, then pieces are merged by score, highest
  first (ties to the left), with ``<0xXX>`` byte fallback. The merging runs in
  ``sentencepiece`` from a model built in memory from the GGUF vocabulary (same
  algorithm: BPE by piece score); a pure-Python port of the same algorithm
  handles the rare pieces ``sentencepiece`` would treat differently (invalid
  UTF-8, literal ``<0xXX>``/unknown-token text) and is the test reference.
* ``gpt2`` (BPE) and ``gemma4``: special tokens are cut out, a pre-tokenizer
  (regular expressions chosen by ``tokenizer.ggml.pre``) splits the text into
  words, each word is mapped through the GPT-2 byte-to-unicode table and merged
  by merge rank (lowest first, ties to the left).

Decoding follows llama.cpp's ``token_to_piece``/``detokenize``: special
tokens render as their text or as nothing, byte tokens as their byte, the
leading space of SPM text is dropped, and BPE vocabularies apply llama.cpp's
``clean_spaces`` rules. Text is bytes until the very end; :class:`IncrementalDecoder`
turns a token stream into text that is always whole UTF-8 characters.

Input text that is not valid UTF-8 (``bytes`` input, or ``str`` with lone
surrogates, which are encoded with ``surrogatepass``) is handled the way
llama.cpp handles the same bytes: SPM splits it by lead byte and falls back to
byte tokens; BPE decodes it leniently (each bad byte becomes U+FFFD; UTF-8-shaped
surrogates are kept). Unicode categories for the BPE pre-tokenizer come from
Python's ``unicodedata``; llama.cpp's own table is Unicode 15.1, so characters
assigned or re-categorized after Python's Unicode version may split differently.
"""
from __future__ import annotations

import codecs
import heapq
import os
import re
import unicodedata
from typing import Iterable

import numpy as np

from .vocab import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED,
                    TOKEN_USER_DEFINED, Vocab)

__all__ = ["Tokenizer", "IncrementalDecoder", "TokenizerError"]


class TokenizerError(ValueError):
    """The vocabulary cannot be used, or ids/arguments are invalid; the message says why."""


# llama_token_attr bits
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8

_TYPE_TO_ATTR = {
    TOKEN_NORMAL: ATTR_NORMAL, TOKEN_UNKNOWN: ATTR_UNKNOWN, TOKEN_CONTROL: ATTR_CONTROL,
    TOKEN_USER_DEFINED: ATTR_USER_DEFINED, TOKEN_UNUSED: ATTR_UNUSED, TOKEN_BYTE: ATTR_BYTE,
}
_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN  # cut out before tokenizing
_HIDDEN_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN                       # rendered only with special=True

_SPACE_ESC = "\u2581"
_SPACE_ESC_B = _SPACE_ESC.encode()
_C_SPACE = b" \t\n\v\f\r"  # C isspace() in the "C" locale
# UTF-8 sequence length by the high nibble of the lead byte (continuation bytes count as 1)
_UTF8_LEN = (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4)


# ---------------------------------------------------------------------------
# GPT-2 byte <-> unicode table: printable latin-1 bytes map to themselves, the
# other 68 bytes to U+0100.. in byte order.

def _gpt2_byte_chars() -> list[str]:
    keep = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    out, n = [""] * 256, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_TO_CHAR = _gpt2_byte_chars()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_TO_CHAR)}
_BYTE_TRANSLATE = {b: c for b, c in enumerate(_BYTE_TO_CHAR)}


# ---------------------------------------------------------------------------
# Pre-tokenizer. llama.cpp runs each expression of a pre-tokenizer in turn;
# every expression splits each current piece into its matches and the text
# between them. Expressions that use Unicode categories run on a "collapsed"
# copy of the text where every non-ASCII character is replaced by one
# representative of its category (whitespace by \v); the others run on the
# text with non-ASCII whitespace replaced by \v. Both copies keep one
# character per code point, so offsets carry over to the original text.

# White_Space code points (llama.cpp's unicode_set_whitespace)
_WHITESPACE = frozenset([0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
                         *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
_REP = {"N": 0xD1, "L": 0xD2, "P": 0xD3, "M": 0xD4, "S": 0xD5}  # other categories: 0xD0
# class members for \p{X} on collapsed text: the representative and the ASCII members
_CAT_MEMBERS = {
    "N": r"\xd10-9",
    "L": r"\xd2A-Za-z",
    "P": r"\xd3!-#%-*,-/:;?@\[-\]_{}",
    "M": r"\xd4",
    "S": r"\xd5\$\+<->\^`\|~",
}
for _c in ("Lu", "Ll", "Lt", "Lm", "Lo"):
    _CAT_MEMBERS[_c] = _CAT_MEMBERS["L"]


class _CollapseTable(dict):
    """str.translate table: code point -> category representative (filled lazily)."""

    def __missing__(self, cp: int) -> int:
        if cp < 128:
            v = cp
        elif cp in _WHITESPACE:
            v = 0x0B
        else:
            v = _REP.get(unicodedata.category(chr(cp))[0], 0xD0)
        self[cp] = v
        return v


_COLLAPSE = _CollapseTable((i, i) for i in range(128))
_PLAIN = {cp: 0x0B for cp in _WHITESPACE if cp >= 128}

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RX_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RX_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RX_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RX_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp runs these four with hand-written splitters that behave like the
# expression followed by "\s+" and then "any single character"
_CUSTOM = frozenset([_RX_GPT2, _RX_LLAMA3, _RX_QWEN2, _RX_QWEN35])
_RX_NEWLINES = r"[^\n]+|[\n]+"
_RX_STARCODER = [r"\p{N}", _RX_GPT2]
_RX_BLOOM = [r" ?[^(\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"]
_CJK = "\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff"
_RX_DEEPSEEK_LLM = [
    r"[\r\n]",
    r"\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    r"\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    r"\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    r"\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    r"\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4"
    r"\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    r"\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    r"\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    r"\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    r"\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    r"\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[" + _CJK + "]+",
    r"\p{N}+",
]
_RX_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_RX_TEKKEN_LIKE = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+<C>"
                   r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*<C>"
                   r"|<N>| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# regex sets by llama.cpp pre-tokenizer type
_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _RX_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "llama3": [_RX_LLAMA3],
    "jais2": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              + "".join(r"|\s{%d}(?!\S)" % k for k in (512, 256, 128, 64, 32, 16, 8, 4))
              + r"|\s{1,2}(?!\S)|\s{1}"],
    "deepseek-llm": _RX_DEEPSEEK_LLM,
    "deepseek3": _RX_DEEPSEEK3,
    "spark2_5": [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                 r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                 r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[" + _CJK + "]+", r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _RX_GPT2, r"[0-9][0-9][0-9]"],
    "starcoder": _RX_STARCODER,
    "gpt2": [_RX_GPT2],
    "qwen2": [_RX_QWEN2],
    "qwen35": [_RX_QWEN35],
    "bloom": _RX_BLOOM,
    "viking": _RX_BLOOM + [r"\p{N}"],
    "tekken": [_RX_TEKKEN_LIKE.replace("<C>", "").replace("<N>", r"\p{N}")],
    "gpt4o": [_RX_TEKKEN_LIKE.replace("<C>", _CONTRACTIONS + "?").replace("<N>", r"\p{N}{1,3}")],
    "chameleon": [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                  r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _RX_GPT2],
    "bailingmoe": [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
    "seed-coder": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                   r"|\s+(?!\S)|\s+"],
    "ufakzeka": [r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "laguna": [_RX_NEWLINES, _RX_QWEN2],
    "exaone-moe": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"],
    "minicpm5": [r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "gemma4": [_RX_NEWLINES],
}

# tokenizer.ggml.pre -> (regex set, overrides of llama.cpp's BPE defaults)
_NO_CLEAN = {"clean_spaces": False}
_PRE_TYPES: dict[str, tuple[str, dict]] = {"default": ("default", {})}
for _names, _set, _opts in [
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     "llama3", {"ignore_merges": True, "add_bos": True}),
    (("deepseek-llm",), "deepseek-llm", _NO_CLEAN),
    (("deepseek-coder",), "deepseek-coder", _NO_CLEAN),
    (("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"), "deepseek3", _NO_CLEAN),
    (("spark2_5",), "spark2_5", _NO_CLEAN),
    (("falcon",), "falcon", {}),
    (("mpt", "olmo", "jais", "exaone4", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
      "jina-v2-de", "a.x-4.0", "mellum", "modern-bert"), "gpt2", {}),
    (("jina-v1-en", "jina-v2-code", "roberta-bpe"), "gpt2", {"add_sep": True}),
    (("trillion", "granite-docling"), "gpt2", _NO_CLEAN),
    (("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"), "starcoder", {}),
    (("command-r", "smollm"), "starcoder", _NO_CLEAN),
    (("jais-2",), "jais2", {}),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"), "qwen2", _NO_CLEAN),
    (("stablelm2", "megrez"), "qwen2", {}),
    (("qwen35",), "qwen35", _NO_CLEAN),
    (("dbrx", "smaug-bpe"), "llama3", {}),
    (("poro-chat",), "bloom", _NO_CLEAN),
    (("bloom", "gpt3-finnish"), "bloom", {}),
    (("chatglm-bpe",), "llama3", {"bos": -1}),
    (("glm4", "glm5"), "llama3", {"bos": -1, "ignore_merges": True}),
    (("viking",), "viking", _NO_CLEAN),
    (("tekken",), "tekken", {"clean_spaces": False, "ignore_merges": True, "add_bos": True}),
    (("gpt-4o", "llama4", "kanana2", "talkie"), "gpt4o", _NO_CLEAN),
    (("chameleon",), "chameleon", {"add_bos": True, "clean_spaces": False}),
    (("bailingmoe", "bailingmoe2", "llada-moe"), "bailingmoe", _NO_CLEAN),
    (("seed-coder",), "seed-coder", _NO_CLEAN),
    (("ufakzeka",), "ufakzeka", _NO_CLEAN),
    (("laguna",), "laguna", _NO_CLEAN),
    (("exaone-moe",), "exaone-moe", {}),
    (("minicpm5",), "minicpm5", {"ignore_merges": True}),
    (("gemma4", "granite-embed-multi-311m"), "gemma4", {"escape_whitespaces": True, "byte_encode": False}),
]:
    for _n in _names:
        _PRE_TYPES[_n] = (_set, _opts)


def _translate_regex(rx: str) -> tuple[re.Pattern, bool]:
    """llama.cpp expression -> (Python pattern for the working copy, uses collapsed text)."""
    collapsed = "\\p{" in rx
    out, i, inside = [], 0, False
    while i < len(rx):
        c = rx[i]
        if c == "\\":
            if rx.startswith("\\p{", i):
                j = rx.index("}", i)
                name = rx[i + 3:j]
                if name not in _CAT_MEMBERS:
                    raise TokenizerError(f"pre-tokenizer expression uses unsupported class \\p{{{name}}}")
                m = _CAT_MEMBERS[name]
                out.append(m if inside else "[" + m + "]")
                i = j + 1
                continue
            out.append(rx[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"  # ECMAScript '$' matches only at the very end
        out.append(c)
        i += 1
    pat = "".join(out)
    if rx in _CUSTOM:
        pat += r"|\s+|[\s\S]"  # every position matches: the words tile the text
    return re.compile(pat, re.ASCII), collapsed


def _lenient_utf8(data: bytes) -> str:
    """llama.cpp's UTF-8 reader: bad bytes become U+FFFD one by one; surrogates and overlong forms pass."""
    out, i, n = [], 0, len(data)
    while i < n:
        b0 = data[i]
        cp, size = 0xFFFD, 1
        if b0 < 0x80:
            cp = b0
        elif b0 & 0x40:
            if not b0 & 0x20:
                if i + 1 < n and data[i + 1] & 0xC0 == 0x80:
                    cp, size = ((b0 & 0x1F) << 6) | (data[i + 1] & 0x3F), 2
            elif not b0 & 0x10:
                if i + 2 < n and data[i + 1] & 0xC0 == 0x80 and data[i + 2] & 0xC0 == 0x80:
                    cp, size = ((b0 & 0x0F) << 12) | ((data[i + 1] & 0x3F) << 6) | (data[i + 2] & 0x3F), 3
            elif not b0 & 0x08:
                if i + 3 < n and all(data[i + k] & 0xC0 == 0x80 for k in (1, 2, 3)):
                    cp = (((b0 & 0x07) << 18) | ((data[i + 1] & 0x3F) << 12) | ((data[i + 2] & 0x3F) << 6)
                          | (data[i + 3] & 0x3F))
                    size = 4
                    if cp > 0x10FFFF:  # llama.cpp cannot write these back out; keep the replacement
                        cp = 0xFFFD
        out.append(chr(cp))
        i += size
    return "".join(out)


def _utf8_bytes(s: str) -> bytes:
    return s.encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------
# In-memory sentencepiece model (protobuf wire format, written directly).

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_VARINT_SMALL = [_varint(i) for i in range(1 << 14)]
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def _spm_model_proto(texts: list[str], scores: np.ndarray, byte_ids: set, unk_id: int) -> bytes:
    """ModelProto: every token a NORMAL piece with its score, except BYTE pieces and one UNKNOWN.

    Model type BPE with byte fallback; identity normalizer, no dummy prefix, no
    whitespace handling (the caller escapes spaces itself).
    """
    vs = _VARINT_SMALL
    sc = np.ascontiguousarray(scores, dtype="<f4").tobytes()
    parts = []
    for i, t in enumerate(texts):
        b = t.encode("utf-8")
        ty = 6 if i in byte_ids else (2 if i == unk_id else 1)
        body = b"".join((b"\x0a", vs[len(b)] if len(b) < 16384 else _varint(len(b)), b,
                         b"\x15", sc[4 * i:4 * i + 4], b"\x18", vs[ty]))
        parts.append(b"\x0a" + (vs[len(body)] if len(body) < 16384 else _varint(len(body))) + body)
    # TrainerSpec: model_type=BPE(3), byte_fallback(35), unk_id(40), bos/eos/pad ids -1 (41-43)
    trainer = (b"\x18\x02" + _varint(35 << 3) + b"\x01" + _varint(40 << 3) + _varint(unk_id)
               + _varint(41 << 3) + _varint(-1) + _varint(42 << 3) + _varint(-1) + _varint(43 << 3) + _varint(-1))
    # NormalizerSpec: name "identity", add_dummy_prefix/remove_extra_whitespaces/escape_whitespaces false
    norm = b"\x0a\x08identity\x18\x00\x20\x00\x28\x00"
    parts.append(b"\x12" + _varint(len(trainer)) + trainer)
    parts.append(b"\x1a" + _varint(len(norm)) + norm)
    return b"".join(parts)


# ---------------------------------------------------------------------------

class Tokenizer:
    """llama.cpp-exact tokenizer for one GGUF vocabulary (SPM ``llama``, BPE ``gpt2``/``gemma4``)."""

    def __init__(self, vocab: Vocab, model_name: str = "", architecture: str = ""):
        self.vocab = vocab
        model = vocab.model
        n = vocab.n_vocab
        if n == 0:
            raise TokenizerError("vocabulary is empty")
        if model == "llama":
            self.kind = "spm"
        elif model in ("gpt2", "gemma4"):
            self.kind = "bpe"
        else:
            raise TokenizerError(f"tokenizer model {model!r} is not supported (supported: llama, gpt2, gemma4)")

        texts = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(vocab.tokens)]
        self._texts = texts
        self._tok2id = {t: i for i, t in enumerate(texts)}
        if len(self._tok2id) != n:
            raise TokenizerError("vocabulary holds the same token text twice")
        types = np.asarray(vocab.token_types)
        self._attr = [_TYPE_TO_ATTR.get(int(t), 0) for t in types.tolist()]

        # defaults per model type, as in llama.cpp
        sp = {"bos": 1, "eos": 2, "unk": 0} if self.kind == "spm" else ({"bos": 11, "eos": 11, "unk": -1}
                                                                          if model == "gpt2" else {})
        opts = {"add_bos": self.kind == "spm", "add_eos": False, "add_sep": False,
                "add_space_prefix": self.kind == "spm", "clean_spaces": self.kind == "bpe",
                "ignore_merges": False, "escape_whitespaces": self.kind == "spm", "byte_encode": True}
        self.pre = vocab.pre or "default"
        regex_set = None
        if self.kind == "bpe":
            pre = "gemma4" if model == "gemma4" else self.pre
            if pre not in _PRE_TYPES:
                raise TokenizerError(f"pre-tokenizer {pre!r} is not supported")
            regex_set, extra = _PRE_TYPES[pre]
            extra = dict(extra)
            if "bos" in extra:
                sp["bos"] = extra.pop("bos")
            opts.update(extra)
        special = {k: v for k, v in sp.items() if 0 <= v < n}
        for k, v in vocab.special.items():
            if 0 <= v < n:
                special[k] = v
        for old, new in (("prefix", "fim_pre"), ("suffix", "fim_suf"), ("middle", "fim_mid")):
            if special.get(old, -1) >= 0:
                special[new] = special[old]
        fl = vocab.flags
        for key, name in (("add_bos_token", "add_bos"), ("add_eos_token", "add_eos"),
                          ("add_sep_token", "add_sep"), ("add_space_prefix", "add_space_prefix")):
            if key in fl:
                opts[name] = bool(fl[key])
        if regex_set == "gemma4":
            opts["add_bos"] = True
        self._opts = opts
        self._special = special
        self._detect_special_tokens()

        # special tokens to cut out, longest first (ties by id)
        cache = [i for i in range(n) if self._attr[i] & _SPECIAL_ATTRS]
        cache.sort(key=lambda i: -len(_utf8_bytes(texts[i])))
        self._special_cache = cache
        self._piece_cache: dict[int, bytes] = {}
        for i in cache:  # pieces are fixed before the strip attributes below, as in llama.cpp
            self._piece(i)
        self._apply_strip_attrs(model_name, architecture)
        self._special_bytes = [(_utf8_bytes(texts[i]), i) for i in cache]
        self._cut_all = [True] * len(cache)
        self._cut_plain = [not self._attr[i] & _HIDDEN_ATTRS for i in cache]
        self._special_index = None

        if self.kind == "spm":
            self._scores = np.asarray(vocab.scores, dtype=np.float32)
            self._score_list = None
            self._bytes2id = None
            self._sp = None
            self._sp_failed = False
        else:
            self._byte_encode = opts["byte_encode"]
            ranks: dict[str, int] = {}
            for r, m in enumerate(vocab.merges):
                if m.find(" ", 1) >= 1:
                    ranks.setdefault(m, r)
            self._ranks = ranks
            self._patterns = [_translate_regex(rx) for rx in _REGEXES[regex_set]]
            self._word_cache: dict[str, tuple] = {}
            self._newline_words = regex_set == "gemma4"

    # -- construction helpers --------------------------------------------------

    @classmethod
    def from_vocab(cls, vocab: Vocab, model_name: str = "", architecture: str = "") -> "Tokenizer":
        """Tokenizer for ``vocab``; ``model_name``/``architecture`` (general.name/.architecture)
        select llama.cpp's per-model token attributes (phi-3 right-strips around special tokens)."""
        return cls(vocab, model_name, architecture)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Tokenizer from a GGUF file (model or vocab-only); raises ``GGUFError`` for bad files."""
        from .gguf_file import GGUFFile
        with GGUFFile(path) as f:
            vocab = f.vocab()
            name = f.get("general.name", "")
            arch = f.get("general.architecture", "")
        return cls(vocab, name if isinstance(name, str) else "", arch if isinstance(arch, str) else "")

    def _detect_special_tokens(self) -> None:
        """llama.cpp's text-based detection of EOT/EOM/FIM/EOG tokens and its attribute fix-ups."""
        sp, attr, ids = self._special, self._attr, self._tok2id

        def mark_control(i):
            attr[i] |= ATTR_CONTROL

        by_text = [
            ("eot", ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
                     "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>")),
            ("eom", ("<|eom_id|>",)),
            ("fim_pre", ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>", "<PRE>",
                         "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>")),
            ("fim_suf", ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>",
                         "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>")),
            ("fim_mid", ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>",
                         "\u2581<MID>", "<|code_middle|>", "<|middle|>")),
            ("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
            ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
            ("fim_sep", ("<|file_sep|>",)),
        ]
        for name, cands in by_text:
            if sp.get(name, -1) >= 0:
                continue
            found = sorted(ids[t] for t in cands if t in ids)  # llama.cpp takes one in hash order
            if found:
                sp[name] = found[0]
                mark_control(found[0])
        for i, t in enumerate(self._texts):
            if attr[i] & ATTR_CONTROL and "unused" in t:
                attr[i] |= ATTR_UNUSED
        eog = {sp[k] for k in ("fim_pad", "fim_rep", "fim_sep") if sp.get(k, -1) >= 0}
        for t in ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
                  "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
                  "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
                  "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["):
            if t in ids:
                eog.add(ids[t])
                mark_control(ids[t])
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if t in ids:
                attr[ids[t]] = ATTR_USER_DEFINED
        for k in ("eos", "eot", "eom"):
            if sp.get(k, -1) >= 0:
                eog.add(sp[k])
        eog_texts = {self._texts[i]: i for i in eog}
        if "<|end|>" in eog_texts and (("<|return|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))
                                       or (("<|call|>" in eog_texts or "<|calls|>" in eog_texts)
                                           and "<|flush|>" in eog_texts)):
            end = eog_texts["<|end|>"]
            eog.discard(end)
            attr[end] = ATTR_USER_DEFINED
        if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
            s = eog_texts["</s>"]
            eog.discard(s)
            attr[s] = ATTR_NORMAL
        self._eog = frozenset(eog)

    def _apply_strip_attrs(self, model_name: str, architecture: str) -> None:
        attr, ids = self._attr, self._tok2id
        name = (model_name or "").lower()
        pre = self.vocab.pre or ""
        if (any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
                or any(s in (architecture or "") for s in ("nomic-bert-moe", "jina-bert-v3"))):
            if "<mask>" in ids:
                attr[ids["<mask>"]] |= ATTR_LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in self._special_cache:
                attr[i] |= ATTR_RSTRIP
            if "</s>" in ids:
                attr[ids["</s>"]] |= ATTR_RSTRIP
            for t in ("<unk>", "<s>", "<|endoftext|>"):
                if t in ids:
                    attr[ids[t]] &= ~ATTR_RSTRIP
        elif "modern-bert" in name and "[MASK]" in ids:
            attr[ids["[MASK]"]] |= ATTR_LSTRIP

    # -- properties ----------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos(self) -> int:
        """BOS id, -1 when the vocabulary has none."""
        return self._special.get("bos", -1)

    @property
    def eos(self) -> int:
        """EOS id, -1 when the vocabulary has none."""
        return self._special.get("eos", -1)

    @property
    def eot(self) -> int:
        """End-of-turn id (e.g. gemma's ``<end_of_turn>``), -1 when none."""
        return self._special.get("eot", -1)

    @property
    def add_bos(self) -> bool:
        return bool(self._opts["add_bos"])

    @property
    def add_eos(self) -> bool:
        return bool(self._opts["add_eos"])

    @property
    def eog_ids(self) -> frozenset:
        """Ids that end generation (eos, eot, eom and llama.cpp's end-of-generation texts)."""
        return self._eog

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog

    def special_id(self, name: str) -> int:
        """Special token id by name ("bos", "eos", "eot", "unk", "pad", "fim_pre", ...), -1 when none."""
        return self._special.get(name, -1)

    # -- encoding --------------------------------------------------------------------

    def encode(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` as llama.cpp's ``llama_tokenize`` gives them.

        add_special: add BOS/EOS where the vocabulary asks for them.
        parse_special: also cut out control-token text (``<start_of_turn>``, ...) as those tokens;
        user-defined tokens are always cut out.
        """
        raw = text if isinstance(text, (bytes, bytearray, memoryview)) else _utf8_bytes(text)
        raw = bytes(raw)
        frags = self._partition(raw, parse_special) if raw else []
        out: list[int] = []
        if add_special and self._opts["add_bos"]:
            if self.bos < 0:
                raise TokenizerError("the vocabulary asks for a BOS token but has none")
            out.append(self.bos)
        if self.kind == "spm":
            self._encode_spm(raw, frags, out)
        else:
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                else:
                    self._encode_bpe(raw[f[0]:f[1]], out)
        if add_special and self._opts["add_eos"]:
            if self.eos < 0:
                raise TokenizerError("the vocabulary asks for an EOS token but has none")
            out.append(self.eos)
        return out

    # special-token partition -------------------------------------------------------

    def _present_specials(self, raw: bytes, parse_special: bool) -> list[tuple[bytes, int]]:
        """Special tokens (in cut order) that occur in ``raw`` as substrings."""
        idx = self._special_index
        if idx is None:
            idx = self._special_index = self._build_special_index()
        prefix_map, codes, starts = idx
        allowed = self._cut_all if parse_special else self._cut_plain
        if len(raw) < 4096:
            # candidates: tokens starting with a byte pair (or, for 1-byte tokens, a byte) of the text
            keys = {raw[j:j + 2] for j in range(len(raw) - 1)}
            keys.update(raw[j:j + 1] for j in range(len(raw)))
            ks = sorted(k for key in keys if key in prefix_map for k in prefix_map[key])
        else:
            # long text: rule out tokens holding a byte pair the text does not contain
            a = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
            present = np.zeros((1 << 16) + 256, dtype=bool)
            present[(a[:-1] << 8) | a[1:]] = True
            present[(1 << 16) + a] = True
            ks = np.nonzero(np.logical_and.reduceat(present[codes], starts))[0].tolist()
        sb = self._special_bytes
        return [sb[k] for k in ks if allowed[k] and sb[k][0] in raw]

    def _build_special_index(self):
        prefix_map: dict[bytes, list[int]] = {}
        codes, starts = [], []
        for k, (t, _) in enumerate(self._special_bytes):
            prefix_map.setdefault(t[:2], []).append(k)
            starts.append(len(codes))
            if len(t) >= 2:
                codes.extend(t[j] << 8 | t[j + 1] for j in range(len(t) - 1))
            else:
                codes.append(1 << 16 | t[0])
        return prefix_map, np.asarray(codes, dtype=np.int64), np.asarray(starts, dtype=np.int64)

    def _partition(self, raw: bytes, parse_special: bool) -> list:
        """llama.cpp's tokenizer_st_partition: list of token ids and (start, end) raw byte ranges.

        Each special token, longest first, is cut out of every raw range that
        holds it, left to right; LSTRIP/RSTRIP tokens also drop the whitespace
        next to them.
        """
        present = self._present_specials(raw, parse_special)
        if not present:
            return [(0, len(raw))]
        n = len(raw)
        blocked = bytearray(n)  # 1 where a byte is taken by a token or stripped
        cuts: dict[int, tuple[int, int]] = {}
        attr = self._attr
        for t, tid in present:
            L = len(t)
            lstrip, rstrip = attr[tid] & ATTR_LSTRIP, attr[tid] & ATTR_RSTRIP
            cursor = 0
            pos = raw.find(t)
            while pos >= 0:
                if pos >= cursor and blocked.find(1, pos, pos + L) < 0:
                    end = pos + L
                    blocked[pos:end] = b"\x01" * L
                    cuts[pos] = (tid, end)
                    if lstrip:
                        k = pos
                        while k > 0 and not blocked[k - 1] and raw[k - 1] in _C_SPACE:
                            k -= 1
                        blocked[k:pos] = b"\x01" * (pos - k)
                    if rstrip:
                        e = end
                        while e < n and not blocked[e] and raw[e] in _C_SPACE:
                            e += 1
                        blocked[end:e] = b"\x01" * (e - end)
                        end = e
                    cursor = end
                    pos = raw.find(t, end)
                else:
                    b = blocked.find(1, pos, pos + L)
                    if b < 0:  # inside the previous match of this token
                        pos = raw.find(t, pos + 1)
                        continue
                    nb = blocked.find(0, b)  # skip the whole taken run
                    pos = raw.find(t, nb) if nb >= 0 else -1
        out: list = []
        i = 0
        for start in sorted(cuts):
            tid, end = cuts[start]
            a = blocked.find(0, i, start)
            if a >= 0:
                out.append((a, blocked.rfind(0, i, start) + 1))
            out.append(tid)
            i = end
        a = blocked.find(0, i, n)
        if a >= 0:
            out.append((a, blocked.rfind(0, i, n) + 1))
        return out

    # SPM ----------------------------------------------------------------------------

    def _spm_processor(self):
        """sentencepiece processor over this vocabulary, or None where it cannot reproduce llama.cpp."""
        if self._sp is not None or self._sp_failed:
            return self._sp
        texts = self._texts
        byte_ids = set()
        for b in range(256):
            i = self._tok2id.get(f"<0x{b:02X}>")
            if i is None:
                break
            byte_ids.add(i)
        unk = self._special.get("unk", -1)
        if len(byte_ids) < 256 or not 0 <= unk < len(texts) or unk in byte_ids:
            self._sp_failed = True  # no full byte fallback or no unknown piece: use the Python path
            return None
        try:
            import sentencepiece
            proc = sentencepiece.SentencePieceProcessor()
            proc.LoadFromSerializedProto(_spm_model_proto(texts, self._scores, byte_ids, unk))
        except Exception:  # sentencepiece rejected the vocabulary: the Python path is exact too
            self._sp_failed = True
            return None
        self._sp = proc
        self._unk_text = texts[unk]
        return proc

    def _encode_spm(self, raw: bytes, frags: list, out: list) -> None:
        prefix = self._opts["add_space_prefix"]
        proc = self._spm_processor()
        jobs: list = []       # per fragment: token id, list of ids, or index into batch
        batch: list[str] = []
        prev_special = True
        for f in frags:
            if isinstance(f, int):
                jobs.append(f)
                prev_special = True
                continue
            piece = raw[f[0]:f[1]]
            if prefix and prev_special:
                piece = b" " + piece
            prev_special = False
            piece = piece.replace(b" ", _SPACE_ESC_B)
            s = None
            if proc is not None and b"<0x" not in piece:
                try:
                    s = piece.decode("utf-8")
                except UnicodeDecodeError:
                    s = None
                if s is not None and self._unk_text in s:
                    s = None
            if s is None:
                jobs.append(self._spm_merge(piece))
            else:
                jobs.append(len(batch))
                batch.append(s)
        done = proc.encode(batch) if batch else []
        for f, j in zip(frags, jobs):
            if isinstance(f, int):
                out.append(f)
            elif isinstance(j, list):
                out.extend(j)
            else:
                out.extend(done[j])

    def _spm_merge(self, text: bytes) -> list[int]:
        """Reference SPM merge (llama.cpp's llm_tokenizer_spm_session) on escaped UTF-8 bytes."""
        if self._bytes2id is None:
            self._bytes2id = {_utf8_bytes(t): i for i, t in enumerate(self._texts)}
            self._score_list = self._scores.tolist()
        tok, score = self._bytes2id, self._score_list
        n = len(text)
        start, size = [], []
        i = 0
        while i < n:
            L = min(_UTF8_LEN[text[i] >> 4], n - i)
            start.append(i)
            size.append(L)
            i += L
        m = len(start)
        if m == 0:
            return []
        nxt = list(range(1, m + 1))
        nxt[-1] = -1
        prv = list(range(-1, m - 1))
        heap: list = []
        rev: dict[bytes, tuple[int, int]] = {}

        def add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            t = text[start[left]:start[left] + size[left] + size[right]]
            tid = tok.get(t)
            if tid is None:
                return
            heapq.heappush(heap, (-score[tid], left, right, len(t)))
            rev[t] = (left, right)

        for k in range(1, m):
            add(k - 1, k)
        while heap:
            _, left, right, sz = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != sz:
                continue
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            add(prv[left], left)
            add(left, nxt[left])

        out: list[int] = []

        def reseg(k: int) -> None:
            t = text[start[k]:start[k] + size[k]]
            tid = tok.get(t)
            if tid is not None:
                out.append(tid)
                return
            p = rev.get(t)
            if p is None:
                for b in t:
                    out.append(self._spm_byte_token(b))
                return
            reseg(p[0])
            reseg(p[1])

        k = 0
        while k != -1:
            reseg(k)
            k = nxt[k]
        return out

    def _spm_byte_token(self, b: int) -> int:
        tid = self._tok2id.get(f"<0x{b:02X}>")
        if tid is None and b:
            tid = self._bytes2id.get(bytes([b]))
        if tid is None:
            raise TokenizerError(f"the vocabulary has no token for byte 0x{b:02X}")
        return tid

    # BPE ----------------------------------------------------------------------------

    def _words(self, text: str) -> list[str]:
        """Pre-tokenizer: split ``text`` into words (llama.cpp's unicode_regex_split)."""
        plain = coll = None
        if text.isascii():
            plain = coll = text
        spans = [(0, len(text))]
        for pat, collapsed in self._patterns:
            if collapsed:
                if coll is None:
                    coll = text.translate(_COLLAPSE)
                w = coll
            else:
                if plain is None:
                    plain = text.translate(_PLAIN)
                w = plain
            new = []
            for a, b in spans:
                last = a
                for m in pat.finditer(w, a, b):
                    s, e = m.span()
                    if s == e:
                        continue
                    if s > last:
                        new.append((last, s))
                    new.append((s, e))
                    last = e
                if last < b:
                    new.append((last, b))
            spans = new
        return [text[a:b] for a, b in spans]

    def _encode_bpe(self, frag: bytes, out: list) -> None:
        try:
            text = frag.decode("utf-8")
        except UnicodeDecodeError:
            text = _lenient_utf8(frag)
        if self._opts["escape_whitespaces"]:
            text = text.replace(" ", _SPACE_ESC)
        cache = self._word_cache
        if len(self._patterns) == 1 and text.isascii() and self._patterns[0][0].pattern.endswith(r"|[\s\S]"):
            words = self._patterns[0][0].findall(text)  # tiling expression on ASCII: matches are the words
        else:
            words = self._words(text)
        for w in words:
            ids = cache.get(w)
            if ids is None:
                ids = self._bpe_word(w)
                if len(cache) > 200_000:
                    cache.clear()
                cache[w] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple:
        """Merge one pre-tokenized word (llama.cpp's llm_tokenizer_bpe_session)."""
        tok = self._tok2id
        if self._byte_encode:
            mapped = _utf8_bytes(word).decode("latin-1").translate(_BYTE_TRANSLATE)
        else:
            mapped = word
        if self._opts["ignore_merges"] and mapped in tok:
            return (tok[mapped],)
        if self._newline_words and mapped and mapped.strip("\n") == "" and mapped in tok:
            return (tok[mapped],)
        syms = self._merge(list(mapped))
        out = []
        for s in syms:
            tid = tok.get(s)
            if tid is not None:
                out.append(tid)
                continue
            for b in _utf8_bytes(s):
                if self._byte_encode:
                    t = tok.get(chr(b)) if b < 0x80 else None  # a lone non-ASCII byte is never a token text
                else:
                    t = tok.get(f"<0x{b:02X}>")
                if t is not None:
                    out.append(t)
        return tuple(out)

    def _merge(self, syms: list[str]) -> list[str]:
        """Apply merges by rank (lowest first, leftmost on ties) until none applies."""
        ranks = self._ranks
        n = len(syms)
        if n < 2:
            return syms
        if n <= 48:
            while True:
                best, at = None, -1
                for i in range(len(syms) - 1):
                    r = ranks.get(syms[i] + " " + syms[i + 1])
                    if r is not None and (best is None or r < best):
                        best, at = r, i
                if best is None:
                    return syms
                syms[at:at + 2] = [syms[at] + syms[at + 1]]
        # long words: priority queue with lazy invalidation
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []

        def add(a: int, b: int) -> None:
            if a < 0 or b < 0:
                return
            r = ranks.get(syms[a] + " " + syms[b])
            if r is not None:
                heapq.heappush(heap, (r, a, b, syms[a] + syms[b]))

        for i in range(n - 1):
            add(i, i + 1)
        while heap:
            _, a, b, text = heapq.heappop(heap)
            if not syms[a] or not syms[b] or syms[a] + syms[b] != text:
                continue
            syms[a] = text
            syms[b] = ""
            nxt[a] = nxt[b]
            if nxt[b] >= 0:
                prv[nxt[b]] = a
            add(prv[a], a)
            add(a, nxt[a])
        return [s for s in syms if s]

    # -- decoding ----------------------------------------------------------------------

    def _piece(self, tid: int) -> bytes:
        """token_to_piece with special=True (cached)."""
        p = self._piece_cache.get(tid)
        if p is not None:
            return p
        if not 0 <= tid < len(self._texts):
            raise TokenizerError(f"token id {tid} is out of range [0, {len(self._texts)})")
        a, text = self._attr[tid], self._texts[tid]
        if a & (_HIDDEN_ATTRS | ATTR_USER_DEFINED):
            p = _utf8_bytes(text)
        elif a & ATTR_NORMAL:
            if self._opts["escape_whitespaces"]:
                p = _utf8_bytes(text.replace(_SPACE_ESC, " "))
            else:
                p = self._gpt2_decode(text)
        elif a & ATTR_BYTE:
            try:
                p = bytes([int(text[3:5], 16)])
            except ValueError:  # llama.cpp's strtol gives 0 for a malformed byte token
                p = b"\x00"
        else:
            p = b""
        self._piece_cache[tid] = p
        return p

    @staticmethod
    def _gpt2_decode(text: str) -> bytes:
        out = bytearray()
        for c in text:
            b = _CHAR_TO_BYTE.get(c)
            if b is None:
                out += b"[UNK_BYTE_0x" + _utf8_bytes(c).hex().encode() + _utf8_bytes(text) + b"]"
            else:
                out.append(b)
        return bytes(out)

    def token_to_bytes(self, token_id: int, special: bool = True) -> bytes:
        """Bytes of one token (llama.cpp's token_to_piece, no lstrip); control/unknown
        tokens give b"" unless ``special``."""
        p = self._piece(token_id)
        if not special and self._attr[token_id] & _HIDDEN_ATTRS:
            return b""
        return p

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False,
                     continuation: bool = False) -> bytes:
        """llama.cpp's detokenize(remove_special=skip_special, unparse_special=not skip_special).

        ``continuation``: the ids follow earlier text (generated tokens after a prompt), so
        the space an SPM vocabulary put in front of the text's first word is not removed.
        """
        ids = [int(i) for i in ids]
        remove_space = self._opts["add_space_prefix"] and not continuation
        if skip_special and self._opts["add_bos"] and ids and ids[0] == self.bos:
            remove_space = False
            ids = ids[1:]
        if skip_special and self._opts["add_eos"] and ids and ids[-1] == self.eos:
            ids = ids[:-1]
        parts = [self.token_to_bytes(i, not skip_special) for i in ids]
        if remove_space and parts and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        text = b"".join(parts)
        if self._opts["clean_spaces"]:
            text = _clean_spaces(text)
        return text

    def decode(self, ids: Iterable[int], skip_special: bool = False, continuation: bool = False) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special, continuation).decode("utf-8", "replace")

    def incremental_decoder(self, skip_special: bool = False,
                            continuation: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special, continuation)


_CLEAN1 = re.compile(rb" (?=[?!.,])")
_CLEAN2 = re.compile(rb" ' ")
_CLEAN3 = re.compile(rb" '(?=[sm]|re|ve)")


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_spaces passes: " ?" -> "?", " ' " -> "'", " 's" -> "'s" (and 'm, 're, 've)."""
    if b" " not in text:
        return text
    text = _CLEAN1.sub(b"", text)
    text = _CLEAN2.sub(b"'", text)
    return _CLEAN3.sub(b"'", text)


class IncrementalDecoder:
    """Streams text from token ids: ``feed`` returns only whole UTF-8 characters, ``flush`` the rest.

    The concatenation of every ``feed`` result and ``flush()`` equals
    ``tokenizer.decode(all_ids, skip_special, continuation)``.
    """

    _HOLD = 8  # bytes of cleaned text that a later token may still change (clean_spaces looks 3 ahead)

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, continuation: bool = False):
        self.tok = tokenizer
        self.skip_special = skip_special
        self.continuation = continuation
        self.reset()

    def reset(self) -> None:
        self._first = True
        self._remove_space = self.tok._opts["add_space_prefix"] and not self.continuation
        self._pending_eos = False
        self._raw = b""   # bytes after the last point where clean_spaces can no longer reach back
        self._done = 0    # bytes of _clean_spaces(_raw) already passed to the UTF-8 decoder
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def _emit(self, piece: bytes) -> str:
        if not self.tok._opts["clean_spaces"]:
            return self._utf8.decode(piece)
        self._raw += piece
        full = _clean_spaces(self._raw)
        tail = self._raw[-3:]
        if len(self._raw) >= 3 and b" " not in tail and b"'" not in tail:
            # no space or apostrophe in the last 3 bytes: cleaning of what follows is independent
            out = full[self._done:]
            self._raw, self._done = b"", 0
        else:
            stop = max(self._done, len(full) - self._HOLD)
            out = full[self._done:stop]
            self._done = stop
        return self._utf8.decode(out)

    def feed(self, ids: int | Iterable[int]) -> str:
        """Decode more ids; returns the newly completed text (possibly "")."""
        if isinstance(ids, (int, np.integer)):
            ids = (ids,)
        tok, out = self.tok, []
        for tid in ids:
            tid = int(tid)
            if self._first:
                self._first = False
                if self.skip_special and tok._opts["add_bos"] and tid == tok.bos:
                    self._remove_space = False
                    continue
            if self._pending_eos:
                self._pending_eos = False
                out.append(self._piece(tok.eos))
            if self.skip_special and tok._opts["add_eos"] and tid == tok.eos:
                self._pending_eos = True  # dropped if it turns out to be the last token
                continue
            out.append(self._piece(tid))
        return "".join(out)

    def _piece(self, tid: int) -> str:
        p = self.tok.token_to_bytes(tid, not self.skip_special)
        if self._remove_space:
            self._remove_space = False
            if p[:1] == b" ":
                p = p[1:]
        return self._emit(p)

    def flush(self) -> str:
        """Everything still held back; the decoder is reset afterwards."""
        tail = b""
        if self.tok._opts["clean_spaces"]:
            tail = _clean_spaces(self._raw)[self._done:]
        out = self._utf8.decode(tail, final=True)
        self.reset()
        return out
