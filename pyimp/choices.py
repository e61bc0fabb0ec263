"""The values the engine's options choose from, each list written once: numerics, KV cache
types, anchor types, retrieval granularities, block-selection modes, eviction policies.

The modules that implement them import their names from here (:mod:`pyimp.kv.cache`,
:mod:`pyimp.sparse.anchors`, :mod:`pyimp.sparse.retrieval`, :mod:`pyimp.sparse.select_modes`,
:mod:`pyimp.kv.policy`), and so do the options (:mod:`pyimp.options`), the commands' flags and
the tools. This module imports nothing of the project's, nor NumPy or Numba: ``pyimp-run
--help`` lists the choices without loading a kernel. The devices are the keys of
:data:`pyimp.capabilities.CAPABILITIES`.
"""
from __future__ import annotations

import enum

# fp32: exact weights, fp32 activations; ggml: activations quantized as ggml's CPU does
NUMERICS = ("fp32", "ggml")

# KV cache types: float types stored as such, block-quantized types as ggml's blocks
FLOAT_KV_TYPES = ("f32", "f16")
QUANT_KV_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
KV_TYPES = FLOAT_KV_TYPES + QUANT_KV_TYPES


class AnchorType(enum.Enum):
    """How a block's keys are summarized for scoring (:mod:`pyimp.sparse.anchors`)."""

    FIXED = "fixed"
    DYNAMIC = "dynamic"
    QUEST = "quest"
    BLOCK_MEAN = "block_mean"
    BLOCK_MAX = "block_max"
    CUBOID_MEAN = "cuboid_mean"


class RetrievalType(enum.Enum):
    """Selection granularity: one block set per layer, per kv head or per query head
    (:mod:`pyimp.sparse.retrieval`)."""

    LAYER = "layer"
    KVHEAD = "kvhead"
    QHEAD = "qhead"


ANCHOR_TYPES = tuple(a.value for a in AnchorType)
RETRIEVAL_TYPES = tuple(r.value for r in RetrievalType)

# block scoring of the sparse path (:mod:`pyimp.sparse.select_modes`)
SELECT_MODES = ("anchors", "lowrank", "lsh", "sink_window", "strided")

# eviction policies (:mod:`pyimp.kv.policy`)
KV_POLICIES = ("full", "streaming", "h2o", "snapkv", "pyramidkv")
