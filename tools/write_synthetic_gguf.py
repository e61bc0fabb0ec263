"""Write synthetic GGUF models (llama, gemma3, qwen2, qwen3, phi3) with random weights.

Any shape and weight type (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 through
:mod:`loaders.quantize`; K-quants through ggml's own quantizer from llama-cpp-python's
libggml, or as random blocks with ``random_blocks``). Files are written by
:mod:`loaders.gguf_writer`, so nothing here needs the ``gguf`` package. The vocabulary is
copied from a vocab-only GGUF (e.g. one of llama.cpp's tokenizer fixtures) or, without one,
a minimal byte-level SPM vocabulary is generated. llama.cpp loads these files, so they serve
both as test models and as benchmark stand-ins for real shapes.

    python -m tools.write_synthetic_gguf out.gguf --arch llama --layers 2 --embd 64 --type Q8_0
    python -m tools.write_synthetic_gguf tinyllama.gguf --preset tinyllama --type Q4_0
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import numpy as np

from loaders.ggml_types import FP16_FIELDS, GGML_QUANT_SIZES, QT, GGUFValueType
from loaders.gguf_writer import GGUFWriter
from loaders.quantize import CODES, f32_to_bf16, quantize_rows

PRESETS = {
    # TinyLlama-1.1B's shape
    "tinyllama": dict(arch="llama", n_layer=22, n_embd=2048, n_head=32, n_head_kv=4, n_ff=5632,
                      n_ctx=2048, vocab_size=32000),
    # Qwen2.5-0.5B's, Qwen3-0.6B's and Llama-3.2-1B's shapes
    "qwen2.5-0.5b": dict(arch="qwen2", n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864,
                         n_ctx=32768, rope_base=1e6, rms_eps=1e-6, vocab_size=151936),
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, head_dim=128,
                       n_ff=3072, n_ctx=40960, rope_base=1e6, rms_eps=1e-6, vocab_size=151936),
    "llama3.2-1b": dict(arch="llama", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192,
                        n_ctx=131072, rope_base=5e5, rope_freqs=True, vocab_size=128256),
    # Gemma 3 270M's shape
    "gemma3-270m": dict(arch="gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256,
                        n_ff=2048, n_ctx=32768, sliding_window=512, vocab_size=262144),
}


ARCHS = ("llama", "gemma3", "qwen2", "qwen3", "phi3")
TYPE_MIXES = ("", "q4_k_m")


def _more_bits(il: int, n_layer: int) -> bool:
    """The layers a Q4_K_M file gives its larger attn_v / ffn_down type: the first and last
    eighth and every third layer between (9 of Gemma 3 270M's 18, as its file has)."""
    return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2


def mix_type(mix: str, name: str, il: int, n_layer: int, n_in: int, default: QT) -> QT:
    """A matrix's type under a type mix. "q4_k_m", as the default model's file has them: Q4_K
    for attn_output and ffn_down (Q6_K on the more-bits layers), and for every other matrix,
    and for any whose rows are not a multiple of 256, Q5_0 (attn_v: Q8_0 on the more-bits
    layers)."""
    if not mix:
        return default
    if mix != "q4_k_m":
        raise ValueError(f"type_mix {mix!r} is not one of {', '.join(repr(m) for m in TYPE_MIXES)}")
    more = _more_bits(il, n_layer)
    if name == "attn_v":
        return QT.Q8_0 if more else QT.Q5_0
    if n_in % 256:
        return QT.Q5_0
    if name == "ffn_down":
        return QT.Q6_K if more else QT.Q4_K
    return QT.Q4_K if name == "attn_output" else QT.Q5_0
ROPE_SCALINGS = ("none", "linear", "yarn")   # SynthSpec.rope_scaling: what loaders.config reads


@dataclass
class SynthSpec:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 0            # 0 = n_embd / n_head
    n_ff: int = 128
    n_ctx: int = 2048
    weight_type: str = "F32"     # type of the 2-D weight matrices
    embd_type: str = ""          # token_embd type ("" = weight_type)
    tied_output: bool = True
    rope_base: float = 10000.0
    rope_base_swa: float = 10000.0
    rope_scale: float = 1.0      # scaling factor (1 = none)
    rope_scaling: str = "linear" # its type: linear or yarn
    rope_ctx_orig: int = 0       # rope.scaling.original_context_length (0: not written)
    rope_dim: int = 0            # rotary dims per head (0: the whole head; phi3 may rotate part)
    rope_factors: bool = False   # phi3: rope_factors_long / _short tensors
    rope_attn_factor: float = 0.0  # rope.scaling.attn_factor (0: not written)
    rope_freqs: bool = False     # add a rope_freqs.weight tensor (llama)
    biases: bool = False         # q/k/v/o biases (llama; qwen2 always has q/k/v biases)
    sliding_window: int = 0      # gemma3; llama (a declared window, as Mistral files have)
    swa_pattern: int = 6
    final_softcap: float = 0.0
    vocab_size: int = 0          # 0 = from the vocabulary source
    rms_eps: float = 1e-5
    seed: int = 0
    random_blocks: bool = False  # quantized matrices as random blocks (see _random_blocks): fast,
                                 # no quantizer or libggml needed
    type_mix: str = ""           # "q4_k_m": per-tensor types as in a Q4_K_M file (mix_type);
                                 # "": every matrix weight_type


# the spread of the quants each type's fp16 scale multiplies (offsets: loaders.ggml_types)
_SPREAD = {QT.Q4_0: 4.6, QT.Q4_1: 4.6, QT.Q5_0: 9.2, QT.Q5_1: 9.2, QT.Q8_0: 74.0, QT.Q2_K: 40.0,
           QT.Q3_K: 150.0, QT.Q4_K: 150.0, QT.Q5_K: 300.0, QT.Q6_K: 1200.0}


def _random_blocks(qtype: QT, n_out: int, n_in: int, std: float, rng) -> np.ndarray:
    """uint8[n_out, row_bytes] of random blocks whose fp16 scales are finite and positive, sized
    so that the weights spread about ``std`` (roughly: the quants are uniform random bytes)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n_in % bs:
        raise ValueError(f"{qtype.name} rows hold multiples of {bs} elements, not {n_in}")
    nb = n_out * (n_in // bs)
    blocks = rng.integers(0, 256, (nb, ts), dtype=np.uint8)
    offsets, spread = FP16_FIELDS[qtype], _SPREAD[qtype]
    for o in offsets:
        d = (std / spread * rng.uniform(0.5, 1.5, nb)).astype(np.float16)
        blocks[:, o:o + 2] = d.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n_out, n_in // bs * ts)


def _quantize(qtype: QT, x: np.ndarray) -> np.ndarray:
    """float32[rows, n] -> the stored array GGUFWriter.add_tensor takes: float32 (F32),
    float16 (F16), uint16 bit patterns (BF16) or uint8 blocks [rows, row bytes]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if qtype == QT.F32:
        return x
    if qtype == QT.F16:
        return x.astype(np.float16)
    if qtype == QT.BF16:
        return f32_to_bf16(x)
    if qtype in CODES:        # ggml's reference quantizers, byte for byte
        return quantize_rows(x, qtype)
    from tools import ggml_oracle
    if not ggml_oracle.available():
        raise RuntimeError(f"{qtype.name} weights need libggml from llama-cpp-python "
                           f"({ggml_oracle.unavailable_reason()}), or random_blocks")
    return ggml_oracle.quantize(int(qtype), x)


def _byte_vocab(n: int):
    """A minimal SPM vocabulary: <unk>, <s>, </s>, 256 byte tokens, then filler pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    seen = set(tokens)
    while len(tokens) < n:
        a, b = divmod(i, 26)
        piece = ("\u2581" if a % 2 else "") + letters[b] + letters[(a // 2) % 26] * (1 + a // 52)
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
        i += 1
    scores = [0.0] * 259 + [-float(k) for k in range(n - 259)]
    return dict(model="llama", pre="default", tokens=tokens[:n], scores=np.array(scores[:n], np.float32),
                types=np.array(types[:n], np.int32), merges=[], bos=1, eos=2, unk=0, flags={})


def _vocab_from(path: str):
    from loaders.gguf_file import GGUFFile
    with GGUFFile(path) as f:
        v = f.vocab()
        return dict(model=v.model, pre=v.pre, tokens=list(v.tokens), scores=np.array(v.scores),
                    types=np.array(v.token_types), merges=list(v.merges), bos=v.special["bos"],
                    eos=v.special["eos"], unk=v.special["unk"], flags=dict(v.flags))


def prompt_ids(n: int, seed: int = 0, n_vocab: int = 300) -> list[int]:
    """A prompt for a synthetic model: BOS (id 1), then n - 1 random ids from 3 up to n_vocab
    (past the special tokens of the byte vocabulary)."""
    return [1] + np.random.default_rng(seed).integers(3, n_vocab, n - 1).tolist()


def write(path: str | os.PathLike, spec: SynthSpec, vocab_path: str | None = None) -> str:
    """Write the model described by ``spec``; returns the path."""
    rng = np.random.default_rng(spec.seed)
    voc = _vocab_from(vocab_path) if vocab_path else _byte_vocab(spec.vocab_size or 512)
    if spec.arch == "phi3" and not vocab_path:
        # llama.cpp marks phi-3 vocabularies' special tokens by name and needs <|endoftext|>
        voc["tokens"][-1] = "<|endoftext|>"
        voc["types"][-1] = 3
    V = len(voc["tokens"])
    if spec.vocab_size and spec.vocab_size != V:
        # pad or cut a copied vocabulary to the requested size
        if spec.vocab_size < V:
            for k in ("tokens", "scores", "types"):
                voc[k] = voc[k][:spec.vocab_size]
        else:
            extra = spec.vocab_size - V
            voc["tokens"] = list(voc["tokens"]) + [f"<extra_{i}>" for i in range(extra)]
            voc["scores"] = np.concatenate([voc["scores"], np.zeros(extra, np.float32)])
            voc["types"] = np.concatenate([voc["types"], np.full(extra, 5, np.int32)])
        V = spec.vocab_size
    E, Hq, Hkv, F = spec.n_embd, spec.n_head, spec.n_head_kv, spec.n_ff
    D = spec.head_dim or E // Hq
    wtype = QT[spec.weight_type]
    etype = QT[spec.embd_type or spec.weight_type]

    w = GGUFWriter(path)
    arch = spec.arch
    w.add_string("general.architecture", arch)
    w.add_string("general.name", f"synthetic {arch}")
    for key, val in (("block_count", spec.n_layer), ("context_length", spec.n_ctx),
                     ("embedding_length", E), ("feed_forward_length", F),
                     ("attention.head_count", Hq), ("attention.head_count_kv", Hkv),
                     ("attention.key_length", D), ("attention.value_length", D)):
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", spec.rms_eps)
    w.add_float32(f"{arch}.rope.freq_base", spec.rope_base)
    n_rot = spec.rope_dim or D
    w.add_uint32(f"{arch}.rope.dimension_count", n_rot)
    if spec.rope_scale != 1.0:
        if spec.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling {spec.rope_scaling!r} is not one of "
                             f"{', '.join(ROPE_SCALINGS)}")
        w.add_string(f"{arch}.rope.scaling.type", spec.rope_scaling)
        w.add_float32(f"{arch}.rope.scaling.factor", spec.rope_scale)
    if spec.rope_ctx_orig:
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", spec.rope_ctx_orig)
    if spec.rope_attn_factor:
        w.add_float32(f"{arch}.rope.scaling.attn_factor", spec.rope_attn_factor)
    if arch in ("llama", "phi3") and spec.sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", spec.sliding_window)
    if arch == "gemma3":
        if spec.sliding_window:
            w.add_uint32(f"{arch}.attention.sliding_window", spec.sliding_window)
            w.add_uint32(f"{arch}.attention.sliding_window_pattern", spec.swa_pattern)
            w.add_float32(f"{arch}.rope.freq_base_swa", spec.rope_base_swa)
        if spec.final_softcap:
            w.add_float32(f"{arch}.final_logit_softcapping", spec.final_softcap)
    # llama.cpp's file type: 0 all F32, 1 mostly F16, else 7 ("mostly Q8_0", for every
    # quantized type: readers take each tensor's own type)
    w.add_uint32("general.file_type", int(wtype) if wtype in (QT.F32, QT.F16) else 7)
    # vocabulary (empty strings and lists are left out)
    for key in ("model", "pre"):
        if voc[key]:
            w.add_string(f"tokenizer.ggml.{key}", voc[key])
    w.add_array("tokenizer.ggml.tokens", voc["tokens"], GGUFValueType.STRING)
    w.add_array("tokenizer.ggml.scores", np.asarray(voc["scores"], np.float32),
                GGUFValueType.FLOAT32)
    w.add_array("tokenizer.ggml.token_type", np.asarray(voc["types"], np.int64),
                GGUFValueType.INT32)
    if voc["merges"]:
        w.add_array("tokenizer.ggml.merges", voc["merges"], GGUFValueType.STRING)
    for key, val in (("bos", voc["bos"]), ("eos", voc["eos"]), ("unknown", voc["unk"])):
        if 0 <= val < V:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", int(val))
    for key, val in voc["flags"].items():
        w.add_bool(f"tokenizer.ggml.{key}", bool(val))

    def mat(name: str, n_in: int, n_out: int, qtype: QT = wtype, std: float | None = None) -> None:
        s = (1.0 / np.sqrt(n_in)) if std is None else std
        if spec.random_blocks and qtype in _SPREAD:
            w.add_tensor(name, _random_blocks(qtype, n_out, n_in, s, rng), qtype)
            return
        x = rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(s)
        w.add_tensor(name, _quantize(qtype, x), qtype)

    def vec(name: str, n: int, center: float, spread: float) -> None:
        w.add_tensor(name, (center + spread * rng.standard_normal(n)).astype(np.float32))

    # embeddings sized so that (tied) logits have a standard deviation of a few units
    mat("token_embd.weight", E, V, etype, std=(3.0 if spec.arch == "llama" else 1.0) / np.sqrt(E))
    vec("output_norm.weight", E, 1.0, 0.1)
    if not spec.tied_output:
        mat("output.weight", E, V)
    if spec.rope_freqs:
        w.add_tensor("rope_freqs.weight", (1.0 + 3.0 * rng.random(n_rot // 2)).astype(np.float32))
    if spec.rope_factors:
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            w.add_tensor(name, (1.0 + 3.0 * rng.random(n_rot // 2)).astype(np.float32))
    for il in range(spec.n_layer):
        p = f"blk.{il}."

        def lmat(name: str, n_in: int, n_out: int) -> None:
            mat(p + name + ".weight", n_in, n_out,
                mix_type(spec.type_mix, name, il, spec.n_layer, n_in, wtype))
        vec(p + "attn_norm.weight", E, 1.0, 0.1)
        if spec.arch == "phi3":                     # fused q, k, v rows and gate, up rows
            lmat("attn_qkv", E, (Hq + 2 * Hkv) * D)
        else:
            lmat("attn_q", E, Hq * D)
            lmat("attn_k", E, Hkv * D)
            lmat("attn_v", E, Hkv * D)
        lmat("attn_output", Hq * D, E)
        vec(p + "ffn_norm.weight", E, 1.0, 0.1)
        if spec.arch == "phi3":
            lmat("ffn_up", E, 2 * F)
        else:
            lmat("ffn_gate", E, F)
            lmat("ffn_up", E, F)
        lmat("ffn_down", F, E)
        biased = (("attn_q", Hq * D), ("attn_k", Hkv * D), ("attn_v", Hkv * D))
        if spec.biases or spec.arch == "qwen2":
            for name, n in biased + ((("attn_output", E),) if spec.biases else ()):
                vec(p + name + ".bias", n, 0.0, 0.05)
        if spec.arch in ("gemma3", "qwen3"):
            vec(p + "attn_q_norm.weight", D, 1.0, 0.1)
            vec(p + "attn_k_norm.weight", D, 1.0, 0.1)
        if spec.arch == "gemma3":
            vec(p + "post_attention_norm.weight", E, 1.0, 0.1)
            vec(p + "post_ffw_norm.weight", E, 1.0, 0.1)
    return w.write()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", choices=sorted(PRESETS))
    ap.add_argument("--arch", choices=ARCHS)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--embd", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--ff", type=int)
    ap.add_argument("--ctx", type=int)
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--type", default="F32", help="weight type (F32, F16, Q8_0, Q4_0, Q4_K, ...)")
    ap.add_argument("--embd-type", default="")
    ap.add_argument("--untied", action="store_true")
    ap.add_argument("--vocab", help="copy the vocabulary from this GGUF")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    kw = dict(PRESETS[a.preset]) if a.preset else {}
    for field_name, val in (("arch", a.arch), ("n_layer", a.layers), ("n_embd", a.embd), ("n_head", a.heads),
                            ("n_head_kv", a.kv_heads), ("head_dim", a.head_dim), ("n_ff", a.ff),
                            ("n_ctx", a.ctx), ("vocab_size", a.vocab_size)):
        if val is not None:
            kw[field_name] = val
    try:
        QT[a.type]
    except KeyError:
        ap.error(f"unknown weight type {a.type!r}")
    spec = SynthSpec(weight_type=a.type, embd_type=a.embd_type, tied_output=not a.untied, seed=a.seed, **kw)
    print(write(a.out, spec, a.vocab))
    return 0


if __name__ == "__main__":
    sys.exit(main())
