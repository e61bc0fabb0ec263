"""Model hyper-parameters parsed once from GGUF metadata.

Keys are ``<arch>.<name>`` as written by llama.cpp's converter. Every fallback
below is the one llama.cpp applies when the key is absent.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_file import GGUFError, GGUFFile

SUPPORTED_ARCHITECTURES = ("llama", "gemma3", "qwen2", "qwen3", "phi3")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a model of one of the supported architectures.

    Shapes follow ggml: ``n_embd`` = model width, ``head_dim`` = per-head
    width of Q and K (``attention.key_length``), ``head_dim_v`` of V.
    ``swa_layers[il]`` is True for sliding-window (local) layers.
    """

    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_base_swa: float
    rope_dim: int
    rope_scale: float           # multiply positions by this (1 / linear scaling factor)
    rope_yarn: bool             # rope.scaling.type yarn: YaRN's ramp between scaled and not
    rope_ctx_orig: int          # rope.scaling.original_context_length (YaRN's correction dims)
    rope_attn_factor: float     # rope.scaling.attn_factor: multiplies cos and sin
    has_rope_freqs: bool        # rope_freqs.weight divides the frequencies (Llama 3.x; phi3's
                                # rope_factors_long / _short are chosen by context: ModelWeights)
    sliding_window: int         # 0 = no sliding-window layers
    swa_layers: tuple           # per layer: is it a sliding-window layer
    final_softcap: float        # 0 = none
    tied_output: bool           # no output.weight: logits use token_embd
    bos_id: int
    eos_id: int
    file_type: int

    @property
    def n_gqa(self) -> int:
        """Query heads per kv head (G)."""
        return self.n_head // self.n_head_kv

    def is_swa(self, il: int) -> bool:
        return self.swa_layers[il]

    def layer_window(self, il: int) -> int:
        """Layer il's attention window: the sliding window on a sliding-window layer, 0 (the
        whole context) on a global one."""
        return self.sliding_window if self.swa_layers[il] else 0

    @property
    def windows(self) -> tuple:
        """Every layer's :meth:`layer_window`."""
        return tuple(self.layer_window(il) for il in range(self.n_layer))

    def layer_rope_base(self, il: int) -> float:
        return self.rope_base_swa if self.swa_layers[il] else self.rope_base

    def layer_rope_scale(self, il: int) -> float:
        # local (sliding-window) layers are never scaled
        return 1.0 if self.swa_layers[il] else self.rope_scale

    def layer_rope(self, il: int) -> dict:
        """Layer il's RoPE arguments of :func:`pyimp.ops.rope_cache` (besides positions, the
        dims and the frequency factors), as llama.cpp's context resolves them: YaRN's attention
        factor 1 + 0.1 ln(scale) is divided out there and multiplied back by ggml's rope."""
        scale = self.layer_rope_scale(il)
        yarn = self.rope_yarn and scale != 1.0
        attn = np.float32(self.rope_attn_factor)
        if yarn:
            f = np.float32(1.0) / np.float32(scale)
            m = np.float32(0.1) * np.float32(np.log(f)) + np.float32(1.0)
            attn = m * (np.float32(1.0) / (np.float32(1.0) + np.float32(0.1) * np.float32(np.log(f)))) * attn
        return dict(base=self.layer_rope_base(il), freq_scale=scale, ext_factor=1.0 if yarn else 0.0,
                    n_ctx_orig=self.rope_ctx_orig, attn_factor=float(attn))


def _uint(f: GGUFFile, key: str, default: int | None = None) -> int:
    v = f.get(key, default)
    if v is None:
        raise GGUFError(f.path, f"metadata key {key!r} is missing")
    if isinstance(v, np.ndarray):
        # per-layer arrays: pyimp supports only uniform values
        if v.size == 0 or not np.all(v == v.flat[0]):
            raise GGUFError(f.path, f"metadata key {key!r}: per-layer values {v.tolist()} "
                                    f"are not supported")
        v = int(v.flat[0])
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise GGUFError(f.path, f"metadata key {key!r} has an invalid value {v!r}")
    return v


def _float(f: GGUFFile, key: str, default: float | None = None) -> float:
    v = f.get(key, default)
    if v is None:
        raise GGUFError(f.path, f"metadata key {key!r} is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        raise GGUFError(f.path, f"metadata key {key!r} has an invalid value {v!r}")
    return float(v)


def _positive(f: GGUFFile, key: str, v: int) -> int:
    if v <= 0:
        raise GGUFError(f.path, f"metadata key {key!r} must be positive, got {v}")
    return v


def read_config(f: GGUFFile) -> ModelConfig:
    """Parse and validate the hyper-parameters of an opened GGUF model file."""
    arch = f.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f.path, f"metadata key 'general.architecture': unsupported architecture "
                                f"{arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    p = arch + "."
    n_layer = _positive(f, p + "block_count", _uint(f, p + "block_count"))
    n_embd = _positive(f, p + "embedding_length", _uint(f, p + "embedding_length"))
    n_head = _positive(f, p + "attention.head_count", _uint(f, p + "attention.head_count"))
    n_head_kv = _positive(f, p + "attention.head_count_kv",
                          _uint(f, p + "attention.head_count_kv", n_head))
    if n_head % n_head_kv:
        raise GGUFError(f.path, f"metadata key {p}attention.head_count_kv: {n_head_kv} does not "
                                f"divide head_count {n_head}")
    if f.get(p + "attention.key_length") is None and n_embd % n_head:
        raise GGUFError(f.path, f"metadata key {p}attention.key_length is missing and "
                                f"embedding_length {n_embd} is not a multiple of head_count {n_head}")
    head_dim = _positive(f, p + "attention.key_length",
                         _uint(f, p + "attention.key_length", n_embd // n_head))
    head_dim_v = _positive(f, p + "attention.value_length",
                           _uint(f, p + "attention.value_length", head_dim))
    if head_dim_v != head_dim:
        raise GGUFError(f.path, f"metadata key {p}attention.value_length: {head_dim_v} differs from "
                                f"key_length {head_dim}; not supported")
    n_ff = _positive(f, p + "feed_forward_length", _uint(f, p + "feed_forward_length"))
    n_ctx_train = _uint(f, p + "context_length", 2048)

    rms_eps = _float(f, p + "attention.layer_norm_rms_epsilon",
                     1e-6 if arch == "gemma3" else None)
    rope_base = _float(f, p + "rope.freq_base", 10000.0)
    rope_dim = _uint(f, p + "rope.dimension_count", head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise GGUFError(f.path, f"metadata key {p}rope.dimension_count: {rope_dim} is invalid "
                                f"for head dim {head_dim}")
    if rope_dim != head_dim and arch in ("llama", "qwen2", "qwen3"):
        # llama.cpp refuses these too: only phi3 (and gemma3) rotate part of a head
        raise GGUFError(f.path, f"metadata key {p}rope.dimension_count: {rope_dim} differs from "
                                f"head dim {head_dim}; {arch} rotates whole heads")
    scaling_type = f.get(p + "rope.scaling.type", "none")
    factor = f.get(p + "rope.scaling.factor")
    if factor is None:
        factor = f.get(p + "rope.scale_linear")  # older converters
        if factor is not None:
            scaling_type = "linear"
    rope_scale = 1.0
    if scaling_type not in ("none", "linear", "yarn"):
        raise GGUFError(f.path, f"metadata key {p}rope.scaling.type: {scaling_type!r} is not "
                                f"supported (none, linear, yarn)")
    if factor is not None and scaling_type in ("linear", "yarn"):
        factor = _float(f, p + "rope.scaling.factor", factor)
        if factor <= 0:
            raise GGUFError(f.path, f"metadata key {p}rope.scaling.factor must be positive")
        rope_scale = 1.0 / factor

    rope_ctx_orig = _uint(f, p + "rope.scaling.original_context_length", n_ctx_train)
    rope_attn_factor = _float(f, p + "rope.scaling.attn_factor", 1.0)

    # sliding window: gemma3 only (llama.cpp's llama architecture does not read one)
    sliding_window = 0
    swa = [False] * n_layer
    rope_base_swa = rope_base
    if arch == "gemma3":
        sliding_window = _uint(f, p + "attention.sliding_window", 0)
        if sliding_window > 0:
            rope_base_swa = _float(f, p + "rope.freq_base_swa", 10000.0)
            pattern = f.get(p + "attention.sliding_window_pattern", 6)
            if isinstance(pattern, np.ndarray):
                if pattern.shape != (n_layer,):
                    raise GGUFError(f.path, f"metadata key {p}attention.sliding_window_pattern: "
                                            f"{pattern.size} entries for {n_layer} layers")
                swa = [bool(x) for x in pattern]
            else:
                n_pattern = _uint(f, p + "attention.sliding_window_pattern", 6)
                swa = [n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer)]
    final_softcap = _float(f, p + "final_logit_softcapping", 0.0) if arch == "gemma3" else 0.0

    tokens = f.get("tokenizer.ggml.tokens")
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f.path, "tensor 'token_embd.weight' is missing")
    n_vocab = embd.shape[1] if len(embd.shape) > 1 else 0
    if isinstance(tokens, list) and len(tokens) != n_vocab:
        raise GGUFError(f.path, f"tensor 'token_embd.weight' has {n_vocab} rows but "
                                f"'tokenizer.ggml.tokens' has {len(tokens)} entries")

    def token_id(key: str, default: int) -> int:
        v = f.get(key, default)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_vocab else -1

    return ModelConfig(
        arch=arch,
        name=str(f.get("general.name", "")),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_ff=n_ff,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        rms_eps=rms_eps,
        rope_base=rope_base,
        rope_base_swa=rope_base_swa,
        rope_dim=rope_dim,
        rope_scale=rope_scale,
        rope_yarn=scaling_type == "yarn",
        rope_ctx_orig=rope_ctx_orig,
        rope_attn_factor=rope_attn_factor,
        has_rope_freqs=f.has_tensor("rope_freqs.weight"),
        sliding_window=sliding_window,
        swa_layers=tuple(swa),
        final_softcap=final_softcap,
        tied_output=not f.has_tensor("output.weight"),
        bos_id=token_id("tokenizer.ggml.bos_token_id", -1),
        eos_id=token_id("tokenizer.ggml.eos_token_id", -1),
        file_type=int(f.get("general.file_type", -1)) if isinstance(f.get("general.file_type"), int) else -1,
    )
