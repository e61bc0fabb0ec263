"""The engine's options, written once: :class:`EngineOptions` (construction) and
:class:`SparseOptions` (the block-sparse path), their validation, and the capability check of
the device they name (:mod:`pyimp.capabilities`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import capabilities
from .kv_merge import MergeOptions
from .kv_policy import PolicyOptions
from .sparse import AnchorType, RetrievalType
from .sparse.anchors import min_anchor_num
from .sparse.select_modes import MODES

NUMERICS = ("fp32", "ggml")
DEVICES = capabilities.DEVICES
# tokens per KV block; paged caches use 16-128, and the cache is allocated in whole blocks
MAX_BLOCK_LEN = 4096


@dataclass(frozen=True)
class SparseOptions:
    """Options of the sparse path (the CLI flags of the same names).

    Every selection attends the block holding the query's own token besides
    ``init_blocks + topk + local_blocks`` others, so
    ``init_blocks = topk = local_blocks = 0`` attends that one block only.
    """

    enabled: bool = False           # block-sparse decode attention on eligible layers
    anchor: str = "quest"           # fixed, dynamic, quest, block_mean, block_max, cuboid_mean
    anchor_num: int = 0             # 0 = the type's minimum (2 for quest / cuboid_mean, else 1)
    retrieval: str = "kvhead"       # layer, kvhead, qhead
    topk: int = 8                   # pick_block_num: best-scoring blocks besides sinks and locals
    init_blocks: int = 1            # attention-sink blocks always attended
    local_blocks: int = 2           # most recent full blocks always attended
    importance_window: int = 128    # prefill rows that add importance; 0 = all rows
    token_step: int = 1             # reuse a selection for this many decode steps
    layer_step: int = 1             # reuse a lead layer's selection for this many sparse layers
    dense_layers: tuple = ()        # layers kept dense besides the sliding-window ones
    decay: float = 1.0              # importance <- decay * importance + new
    select: str = "anchors"         # block scoring: anchors, lowrank, lsh, sink_window, strided
    rank: int = 0                   # lowrank: principal directions kept (0: head_dim / 4)
    lsh_tables: int = 16            # lsh: hash tables
    lsh_bits: int = 8               # lsh: hyperplanes (bits) per table
    lsh_min_hits: int = 2           # lsh: agreeing tables that make a token a candidate
    stride: int = 4                 # strided: every stride-th block back from the newest
    recall_target: float = 0.0      # > 0: blocks heaviest first until the estimated recall reaches it
    recall_max_blocks: int = 0      # ceiling of the blocks picked for the recall target (0: none)
    report: bool = False            # measure attention recall (runs dense attention too)
    track: bool = False             # keep importance_ (and selections) even when not sparse

    def validate(self, n_layer: int) -> None:
        try:
            atype = AnchorType(self.anchor)
        except ValueError:
            raise ValueError(f"anchor type {self.anchor!r} is not one of "
                             f"{', '.join(a.value for a in AnchorType)}") from None
        try:
            RetrievalType(self.retrieval)
        except ValueError:
            raise ValueError(f"retrieval type {self.retrieval!r} is not one of "
                             f"{', '.join(r.value for r in RetrievalType)}") from None
        if self.anchor_num and self.anchor_num < min_anchor_num(atype):
            raise ValueError(f"{self.anchor} anchors need anchor_num >= {min_anchor_num(atype)}")
        for name in ("topk", "init_blocks", "local_blocks", "importance_window", "anchor_num"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("token_step", "layer_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 0.0 <= self.recall_target <= 1.0:
            raise ValueError(f"recall target must be in (0, 1] (0: off), got {self.recall_target}")
        if self.select not in MODES:
            raise ValueError(f"selection mode {self.select!r} is not one of {', '.join(MODES)}")
        if not 1 <= self.lsh_tables <= 256 or not 1 <= self.lsh_bits <= 32:
            raise ValueError(f"lsh needs 1..256 tables of 1..32 bits, got {self.lsh_tables} of "
                             f"{self.lsh_bits}")
        if not 1 <= self.lsh_min_hits <= self.lsh_tables:
            raise ValueError(f"lsh_min_hits must be in 1..{self.lsh_tables}, got {self.lsh_min_hits}")
        if self.rank < 0 or self.stride < 1:
            raise ValueError(f"rank must be >= 0 and stride >= 1, got {self.rank}, {self.stride}")
        if self.recall_target > 0 and self.select != "anchors":
            raise ValueError("the recall target estimates mass from the anchors: use it with "
                             "select='anchors'")
        if self.recall_max_blocks < 0:
            raise ValueError(f"recall_max_blocks must be >= 0, got {self.recall_max_blocks}")
        bad = [il for il in self.dense_layers if not 0 <= il < n_layer]
        if bad:
            raise ValueError(f"dense layer {bad[0]} does not exist (the model has {n_layer} layers)")

    @property
    def active(self) -> bool:
        return self.enabled or self.report or self.track



@dataclass
class EngineOptions:
    """Construction options (the same names as the CLI flags)."""

    n_ctx: int = 4096              # 0 = the model's training context
    block_len: int = 32
    batch_size: int = 512          # prefill chunk
    n_threads: int = 0             # Numba threads in the engine's calls; 0 = the caller's setting
    numerics: str = "fp32"
    kv_type: str = "f16"            # K and V cache type (llama.cpp's -ctk / -ctv for both)
    cache_type_k: str | None = None  # K cache type (None: kv_type)
    cache_type_v: str | None = None  # V cache type (None: kv_type)
    v_layout: str = "token"          # quantized V rows: "token" (along head_dim) or "channel"
    kv_rotate: bool = False          # Hadamard rotation of q, k, v along head_dim (see _rotation)
    device: str = "cpu"              # "cuda": weights, KV cache, importance_ and anchors on the GPU
    sparse: SparseOptions = field(default_factory=SparseOptions)
    kv_policy: str = "full"          # eviction: full, streaming, h2o, snapkv, pyramidkv
    kv_budget: int = 0               # tokens per layer an eviction policy keeps
    keep: int = 4                    # sink tokens (the first positions) every policy keeps
    kv_recent: int = 0               # h2o / streaming recent window (0: half the budget)
    kv_obs_window: int = 32          # snapkv / pyramidkv observation window
    kv_pool: int = 5                 # snapkv / pyramidkv pooling kernel
    kv_depth_ratio: float = 1.0      # first / last evicting layer's budget (see kv_policy)
    kv_obs_weight: float = 0.0       # h2o: weight of the prompt's last rows' attention
    kv_neighbours: int = 0           # h2o / snapkv / pyramidkv: a kept token keeps those within R
    swa_full: bool = False           # sliding-window layers keep every token (llama.cpp --swa-full)
    kv_merge: float = 0.0            # merge near-duplicate tokens at this cosine similarity (0: off)
    kv_merge_bits: int = 12          # SimHash bits per kv head proposing merge candidates

    def validate(self) -> None:
        if self.device not in capabilities.DEVICES:
            raise ValueError(f"device must be one of {', '.join(capabilities.DEVICES)}, got "
                             f"{self.device!r}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")
        if self.n_ctx < 0:
            raise ValueError(f"context size must be >= 0, got {self.n_ctx}")
        if not 0 < self.block_len <= MAX_BLOCK_LEN:
            raise ValueError(f"block length must be in 1..{MAX_BLOCK_LEN}, got {self.block_len}")
        if self.sparse.anchor_num > self.block_len:
            raise ValueError(f"anchor count {self.sparse.anchor_num} exceeds the block length "
                             f"{self.block_len}: an anchor slot summarizes at least one token")
        if self.batch_size <= 0:
            raise ValueError(f"batch size must be positive, got {self.batch_size}")
        if self.n_threads < 0:
            raise ValueError(f"thread count must be >= 0, got {self.n_threads}")
        self.policy.validate()
        if self.policy.evicts and self.v_layout == "channel" and self.type_v != "f16" \
                and self.type_v != "f32":
            raise ValueError(f"kv policy {self.kv_policy} drops single tokens, which V quantized "
                             f"by channel (v_layout='channel') cannot: use v_layout='token'")
        self.merge.validate()
        if self.merge.enabled and self.kv_obs_weight:
            raise ValueError("--kv-merge and --kv-obs-weight do not combine (merging would move "
                             "tokens without their observation-window scores)")
        if self.merge.enabled and self.v_layout == "channel" and self.type_v not in ("f16", "f32"):
            raise ValueError("--kv-merge rewrites single tokens, which V quantized by channel "
                             "(v_layout='channel') cannot: use v_layout='token'")
        capabilities.check(self)        # what the device's backend runs

    @property
    def merge(self) -> MergeOptions:
        return MergeOptions(self.kv_merge, self.kv_merge_bits)

    @property
    def policy(self) -> PolicyOptions:
        return PolicyOptions(self.kv_policy, self.kv_budget, self.keep, self.kv_recent,
                             self.kv_obs_window, self.kv_pool, self.kv_depth_ratio,
                             self.kv_obs_weight, self.kv_neighbours)

    def sparse_options(self) -> SparseOptions:
        """The sparse state's options: the given ones, or importance tracking where the eviction
        policy scores tokens by importance_ (h2o: every prompt row adds; snapkv / pyramidkv:
        the observation window)."""
        pol = self.kv_policy
        if self.sparse.active or pol not in ("h2o", "snapkv", "pyramidkv"):
            return self.sparse
        return dataclasses.replace(self.sparse, track=True,
                                   importance_window=0 if pol == "h2o" else self.kv_obs_window)

    @property
    def type_k(self) -> str:
        return self.cache_type_k or self.kv_type

    @property
    def type_v(self) -> str:
        return self.cache_type_v or self.kv_type
