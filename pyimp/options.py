"""The engine's options, written once: :class:`EngineOptions` (construction) and
:class:`SparseOptions` (the block-sparse path), their validation, and the capability check of
the device they name (:mod:`pyimp.capabilities`).

A field that is also a command-line flag says so in its metadata (:func:`opt`): the flag, its
short form, help text, choices, bounds and metavar. ``pyimp-run`` and ``pyimp-dump`` add their
flags from it (:func:`pyimp.cli.common.add_option_flags`) and build the options back from the
parsed arguments (:func:`pyimp.cli.common.options_from_args`). The choices are the lists of
:mod:`pyimp.choices`. This module loads neither NumPy nor Numba when imported: ``--help`` reads
it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import TYPE_CHECKING

from . import capabilities
from .choices import (ANCHOR_TYPES, KV_POLICIES, KV_TYPES, NUMERICS, RETRIEVAL_TYPES, SELECT_MODES,
                      AnchorType, RetrievalType)

if TYPE_CHECKING:
    from .kv.merge import MergeOptions
    from .kv.policy import PolicyOptions

DEVICES = capabilities.DEVICES
# tokens per KV block; paged caches use 16-128, and the cache is allocated in whole blocks
MAX_BLOCK_LEN = 4096


def opt(default=MISSING, *, flag: str, help: str | None, short: str | None = None,
        choices: tuple | None = None, min: float | None = None, max: float | None = None,
        parse=None, metavar: str | None = None, group: str | None = None):
    """A dataclass field that is also a command-line flag, described in its metadata.

    ``flag``: the long flag (``--kv-type``); ``short``: its short form (``-ctk``); ``help``:
    the help text (the default is appended by the commands' help formatter). The value's
    type is the default's: bool (a switch), int, float or str. ``choices``: the values a
    str takes; ``min`` / ``max``: the bounds of an int or float (``max`` None: unbounded);
    ``parse``: a function of the flag's text for values with a syntax of their own (it
    raises ValueError with the rule, e.g. "must be comma-separated integers"); ``group``:
    the help section the flag is listed in (None: the command's main options).
    """
    meta = {"flag": flag, "help": help, "short": short, "choices": choices, "min": min,
            "max": max, "parse": parse, "metavar": metavar, "group": group}
    return field(default=default, metadata=meta)


def _window(s: str) -> int:
    """--importance-window: a positive integer, or 'all' (0)."""
    if s == "all":
        return 0
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise ValueError("must be a positive integer or 'all'")
    return v


def _int_list(s: str) -> tuple:
    """--dense-layers: comma-separated integers."""
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise ValueError("must be comma-separated integers") from None


@dataclass(frozen=True)
class SparseOptions:
    """Options of the sparse path (the CLI flags of the same names).

    Every selection attends the block holding the query's own token besides
    ``init_blocks + topk + local_blocks`` others, so
    ``init_blocks = topk = local_blocks = 0`` attends that one block only.
    """

    # block-sparse decode attention on eligible layers (global attention, not dense_layers)
    enabled: bool = opt(False, flag="--sparse",
                        help="block-sparse decode attention on global layers")
    anchor: str = opt("quest", flag="--anchor", choices=ANCHOR_TYPES,
                      help="anchor type used to score blocks")
    # 0: the type's minimum (2 for quest / cuboid_mean, else 1)
    anchor_num: int = opt(0, flag="--anchor-num", min=0,
                          help="anchors per block (0 = the type's minimum)")
    retrieval: str = opt("kvhead", flag="--retrieval", choices=RETRIEVAL_TYPES,
                         help="selection granularity")
    # pick_block_num: the best-scoring blocks besides sinks and locals
    topk: int = opt(8, flag="--topk", min=0, help="blocks picked by score")
    init_blocks: int = opt(1, flag="--init-blocks", min=0,
                           help="attention-sink blocks always attended")
    local_blocks: int = opt(2, flag="--local-blocks", min=0,
                            help="most recent full blocks always attended")
    # 0: every row (the flag's 'all')
    importance_window: int = opt(128, flag="--importance-window", parse=_window,
                                 help="prompt rows that add importance at prefill (an integer "
                                      "or 'all'); an eviction policy that scores by importance "
                                      "sets its own (h2o: all, snapkv / pyramidkv: "
                                      "--kv-obs-window)")
    token_step: int = opt(1, flag="--token-step", min=1,
                          help="reuse a block selection for this many decode steps")
    layer_step: int = opt(1, flag="--layer-step", min=1,
                          help="reuse a lead layer's selection for this many sparse layers")
    # besides the sliding-window layers, which are always dense
    dense_layers: tuple = opt((), flag="--dense-layers", parse=_int_list,
                              help="comma-separated layers kept dense")
    decay: float = 1.0              # importance <- decay * importance + new
    select: str = opt("anchors", flag="--select", choices=SELECT_MODES,
                      help="block scoring: the anchors (default), low-rank keys (Loki), SimHash "
                           "collisions (MagicPIG-style), or a fixed pattern")
    rank: int = opt(0, flag="--rank", min=0,
                    help="lowrank: principal directions (0: head dim / 4)")
    # lsh: hash tables, hyperplanes (bits) per table, agreeing tables that make a candidate
    lsh_tables: int = opt(16, flag="--lsh-tables", min=1, help=None)
    lsh_bits: int = opt(8, flag="--lsh-bits", min=1, help=None)
    lsh_min_hits: int = opt(2, flag="--lsh-min-hits", min=1, help=None)
    stride: int = opt(4, flag="--stride", min=1,
                      help="strided: every stride-th block back from the newest")
    recall_target: float = opt(0.0, flag="--recall-target", min=0.0, max=1.0,
                               help="pick blocks heaviest first until the captured softmax mass "
                                    "estimated from the anchors reaches this (e.g. 0.95; --topk "
                                    "is then the floor)")
    recall_max_blocks: int = opt(0, flag="--recall-max-blocks", min=0,
                                 help="ceiling on the blocks --recall-target picks (0: none)")
    # measures attention recall by running dense attention too
    report: bool = opt(False, flag="--report",
                       help="print attention recall, attended fraction and buffer sizes "
                            "(stderr; in --json too)")
    track: bool = False             # keep importance_ (and selections) even when not sparse
    # a second observation window, accumulated in SparseState.importance2_ by the same prefill
    # (None: none; 0: every row): what importance_window=second_window would have left, so one
    # prefill serves policies that score by two windows (prefill rows only: decode steps add
    # to importance_ alone)
    second_window: int | None = None

    def validate(self, n_layer: int) -> None:
        from .sparse.anchors import min_anchor_num     # the kernels' package: not for --help

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
        if self.second_window is not None and self.second_window < 0:
            raise ValueError(f"second_window must be >= 0 or None, got {self.second_window}")
        for name in ("token_step", "layer_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 0.0 <= self.recall_target <= 1.0:
            raise ValueError(f"recall target must be in (0, 1] (0: off), got {self.recall_target}")
        if self.select not in SELECT_MODES:
            raise ValueError(f"selection mode {self.select!r} is not one of "
                             f"{', '.join(SELECT_MODES)}")
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
        return self.enabled or self.report or self.track or self.second_window is not None



@dataclass
class EngineOptions:
    """Construction options (the CLI flags are in each field's metadata: :func:`opt`)."""

    # 0: the model's training context
    n_ctx: int = opt(4096, flag="--ctx-size", short="-c", min=0,
                     help="context size in tokens (0 = the model's)")
    block_len: int = opt(32, flag="--block-len", min=1, help="KV block length")
    batch_size: int = opt(512, flag="--batch-size", short="-b", min=1, help="prefill chunk size")
    # Numba threads in the engine's calls; 0: the caller's setting (pyimp-run: all cores)
    n_threads: int = opt(0, flag="--threads", short="-t", min=0, help="threads (0 = all cores)")
    numerics: str = opt("fp32", flag="--numerics", choices=NUMERICS,
                        help="fp32: exact weights, fp32 activations; ggml: activations quantized "
                             "as ggml's CPU does")
    kv_type: str = opt("f16", flag="--kv-type", choices=KV_TYPES,
                       help="KV cache type of K and V (shorthand for -ctk and -ctv)")
    cache_type_k: str | None = opt(None, flag="--cache-type-k", short="-ctk", choices=KV_TYPES,
                                   help="K cache type (default: --kv-type)")
    cache_type_v: str | None = opt(None, flag="--cache-type-v", short="-ctv", choices=KV_TYPES,
                                   help="V cache type (default: --kv-type)")
    device: str = opt("cpu", flag="--device", choices=DEVICES,
                      help="cuda: run on the GPU through numba-cuda (pip install 'pyimp[cuda]'); "
                           "weights, KV cache, importance and anchors stay on the device")
    v_layout: str = "token"          # quantized V rows: "token" (along head_dim) or "channel"
    # along head_dim (see pyimp.engine's _rotation)
    kv_rotate: bool = opt(False, flag="--kv-rotate",
                          help="Hadamard rotation of keys, values and queries along the head dim "
                               "before the cache (spreads outlier channels; meant for quantized "
                               "caches)")
    sparse: SparseOptions = field(default_factory=SparseOptions)
    kv_policy: str = opt("full", flag="--kv-policy", choices=KV_POLICIES, group="eviction",
                         help="full (default): keep every token of global layers; streaming: "
                              "sinks + recent; h2o: sinks + recent + heavy hitters by importance; "
                              "snapkv / pyramidkv: compress the prompt once by its last queries' "
                              "attention")
    swa_full: bool = opt(False, flag="--swa-full", group="eviction",
                         help="sliding-window layers keep every token (as llama.cpp's "
                              "--swa-full): more memory, but --prompt-cache can reuse any prefix "
                              "of a long prompt")
    kv_budget: int = opt(0, flag="--kv-budget", min=0, group="eviction",
                         help="tokens per layer an eviction policy keeps (held in whole blocks)")
    keep: int = opt(4, flag="--keep", min=0, group="eviction",
                    help="sink tokens (the first positions) every policy keeps, as llama.cpp's "
                         "n_keep")
    kv_recent: int = opt(0, flag="--kv-recent", min=0, group="eviction",
                         help="h2o / streaming recent window (0: half the budget)")
    kv_obs_window: int = opt(32, flag="--kv-obs-window", min=0, group="eviction",
                             help="snapkv / pyramidkv observation window (last prompt rows)")
    kv_pool: int = opt(5, flag="--kv-pool", min=1, group="eviction",
                       help="snapkv / pyramidkv pooling kernel (odd)")
    # the first / last evicting layer's budget (see pyimp.kv.policy)
    kv_depth_ratio: float = opt(1.0, flag="--kv-depth-ratio", min=1.0, metavar="R",
                                group="eviction",
                                help="streaming / h2o / snapkv: budgets shrink linearly with "
                                     "depth over the layers that evict (global attention), the "
                                     "first R times the last's, their mean --kv-budget (1: the "
                                     "same in every layer)")
    kv_obs_weight: float = opt(0.0, flag="--kv-obs-weight", min=0.0, metavar="W", group="eviction",
                               help="h2o: rank tokens by their accumulated attention plus W times "
                                    "the attention of the prompt's last --kv-obs-window rows "
                                    "(each normalized per layer); 0: accumulated attention only")
    kv_neighbours: int = opt(0, flag="--kv-neighbours", min=0, metavar="R", group="eviction",
                             help="h2o / snapkv / pyramidkv: rank a token by the largest score "
                                  "within R positions of it, so a kept token keeps its "
                                  "neighbours (a number's digits after the one attended to); "
                                  "0: off")
    kv_follow: int = opt(0, flag="--kv-follow", min=0, metavar="F", group="eviction",
                         help="h2o / snapkv / pyramidkv: rank a token by the largest score among "
                              "itself and the F positions before it, so a kept token keeps the F "
                              "tokens that follow it (the value after a key the question "
                              "attends to); 0: off")
    kv_merge: float = opt(0.0, flag="--kv-merge", min=0.0, max=1.0, metavar="COS",
                          group="eviction",
                          help="merge cached tokens whose keys share a SimHash signature and "
                               "have cosine similarity >= COS into one slot (importance-weighted "
                               "average; the slot's score gains log(count)); 0: off")
    kv_merge_bits: int = opt(12, flag="--kv-merge-bits", min=1, group="eviction",
                             help="SimHash bits per kv head proposing --kv-merge candidates")

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
        if self.sparse.second_window is not None and self.kv_merge:
            raise ValueError("second_window cannot be used with --kv-merge: merging sums "
                             "importance_ alone")
        if self.merge.enabled and self.kv_obs_weight:
            raise ValueError("--kv-merge and --kv-obs-weight do not combine (merging would move "
                             "tokens without their observation-window scores)")
        if self.merge.enabled and self.v_layout == "channel" and self.type_v not in ("f16", "f32"):
            raise ValueError("--kv-merge rewrites single tokens, which V quantized by channel "
                             "(v_layout='channel') cannot: use v_layout='token'")
        capabilities.check(self)        # what the device's backend runs

    @property
    def merge(self) -> MergeOptions:
        """The merge options (:class:`pyimp.kv.merge.MergeOptions`)."""
        from .kv.merge import MergeOptions
        return MergeOptions(self.kv_merge, self.kv_merge_bits)

    @property
    def policy(self) -> PolicyOptions:
        """The eviction policy's options (:class:`pyimp.kv.policy.PolicyOptions`)."""
        from .kv.policy import PolicyOptions
        return PolicyOptions(self.kv_policy, self.kv_budget, self.keep, self.kv_recent,
                             self.kv_obs_window, self.kv_pool, self.kv_depth_ratio,
                             self.kv_obs_weight, self.kv_neighbours, self.kv_follow)

    def sparse_options(self) -> SparseOptions:
        """The sparse state's options: the given ones, with importance tracking and the
        policy's prompt rows where the eviction policy scores tokens by importance_ (h2o: every
        prompt row adds; snapkv / pyramidkv: the observation window, ``kv_obs_window``). The
        policy's rows replace ``importance_window`` also when tracking, a report or sparse
        attention was asked for: a snapkv that scored by the last 128 rows (the tracking
        default) instead of its observation window would rank by the haystack's end more than
        by the question, and an h2o that scored by them would not be H2O."""
        pol = self.kv_policy
        if pol not in ("h2o", "snapkv", "pyramidkv"):
            return self.sparse
        return dataclasses.replace(self.sparse, track=True,
                                   importance_window=0 if pol == "h2o" else self.kv_obs_window)

    @property
    def type_k(self) -> str:
        return self.cache_type_k or self.kv_type

    @property
    def type_v(self) -> str:
        return self.cache_type_v or self.kv_type
