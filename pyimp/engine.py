"""The inference engine: forward pass over the paged KV cache, eval and generation.

``Engine.forward`` reads top to bottom like the model: embeddings, then per
layer attention (norm, projections, RoPE, cache write, paged attention,
output projection) and feed-forward, then the output head. Architecture
choices come from :class:`pyimp.model.ArchSpec`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from loaders.config import ModelConfig, read_config
from loaders.gguf_file import GGUFFile

from . import buffers, capabilities, generation, inputs, ops
from .runtime import warmup
from .cpu_forward import CPUForward, no_tap as _no_tap
from .forward import forward, make_step
from .kv.merge import KVMerger
from .kv.policy import KVPolicy
from .kv.cache import KVCache
from .model import ModelWeights
from .sampling import Sampler, SamplingParams
from .options import DEVICES, MAX_BLOCK_LEN, NUMERICS, EngineOptions, SparseOptions  # noqa: F401
from .sequence import EngineBusyError, SequenceLock, exclusive  # noqa: F401
from .sparse.policy import SparseState

@dataclass
class Timings:
    load_s: float = 0.0
    compile_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        def rate(n, s):
            return n / s if s > 0 else 0.0
        return {"load_s": self.load_s, "compile_s": self.compile_s,
                "prefill_tokens": self.prefill_tokens, "prefill_s": self.prefill_s,
                "prefill_tok_s": rate(self.prefill_tokens, self.prefill_s),
                "decode_tokens": self.decode_tokens, "decode_s": self.decode_s,
                "decode_tok_s": rate(self.decode_tokens, self.decode_s)}


def _closed() -> RuntimeError:
    return RuntimeError("the engine is closed")


class Engine:
    """A loaded model with its KV cache: one sequence. Calls that run or change it take the
    engine for their duration (a generate iterator until it ends); a call from another thread
    meanwhile raises :class:`EngineBusyError`."""

    def __init__(self, path: str | os.PathLike, options: EngineOptions | None = None):
        t0 = time.perf_counter()
        self._seq = SequenceLock()          # who holds the engine's sequence
        warmup.check_numba()
        self.options = opts = options or EngineOptions()
        opts.validate()
        self.path = os.fspath(path)
        self.file = GGUFFile(self.path)
        self.cfg: ModelConfig = read_config(self.file)
        opts.sparse.validate(self.cfg.n_layer)
        self.n_ctx = opts.n_ctx or self.cfg.n_ctx_train
        self.weights = ModelWeights(self.file, self.cfg, self.n_ctx)
        self.buffer_bytes = buffers.check_memory(opts, self.cfg, self.n_ctx)
        if self.n_ctx > self.cfg.n_ctx_train:
            warnings.warn(f"context size {self.n_ctx} exceeds the model's training context "
                          f"{self.cfg.n_ctx_train}; quality may degrade past it", RuntimeWarning, stacklevel=2)
        self._gpu = None
        if opts.device == "cuda":     # cache, importance_, anchors and weights on the GPU
            from .cuda.forward import build
            self.cache, self.sparse, self._gpu = build(self)
        else:
            self.cache = KVCache(self.cfg.n_layer, self.cfg.n_head_kv, self.cfg.head_dim, self.n_ctx,
                                 block_len=opts.block_len, type_k=opts.type_k, type_v=opts.type_v,
                                 v_layout=opts.v_layout, max_slots=buffers.max_slots(opts, self.cfg, self.n_ctx))
            # importance_ / anchor_ and the block-sparse decode path (None: plain dense attention)
            sp = opts.sparse_options()
            self.sparse = SparseState(sp, self.cfg, self.cache) if sp.active else None
        # what each layer keeps (None on the device: there every layer keeps every token)
        self.merger = (KVMerger(opts.merge, self.cfg, self.cache, self.sparse, opts.keep)
                       if opts.merge.enabled and self._gpu is None else None)
        self.policy = (None if self._gpu is not None else
                       KVPolicy(opts.policy, self.cfg, self.cache, self.sparse,
                                trim_windows=not opts.swa_full, merger=self.merger))
        self._tokenizer = None
        self._vocab = None
        self.tokens: list[int] = []          # what the cache holds, in order
        self._tap = _no_tap                  # the forward's tap (a recorder while trace() runs)
        # one-token forwards run the small ops between the matvecs as fused kernels, and the
        # matvecs that read the same x (q, k, v; gate, up) as one call where their types match
        # (the same bits: tests compare both ways); False: every op on its own, as a traced
        # forward runs
        self.fused_ops = True
        # the forward's steps: on the device (pyimp.cuda.forward.build) or on the host
        self._backend = self._gpu if self._gpu is not None else CPUForward(self)
        self.timings = Timings(load_s=time.perf_counter() - t0)

    @property
    def device(self) -> str:
        return self.options.device

    @contextlib.contextmanager
    def _threads(self):
        """Numba's thread count for this thread set to n_threads inside, the caller's restored after."""
        n = self.options.n_threads
        if not n:
            yield
            return
        import numba
        prev = numba.get_num_threads()
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        try:
            yield
        finally:
            numba.set_num_threads(prev)

    def close(self) -> None:
        """Release the model's memory map and the cache buffers; the engine cannot run afterwards.

        Arrays obtained from the engine earlier (weights, vocabulary views) keep the map alive
        until they are collected. An unfinished generate iterator of this thread does not stop
        it (its next token raises "the engine is closed"); a call running in another thread
        does (EngineBusyError)."""
        try:
            with self._seq.hold("close"):
                self._close()
        except EngineBusyError:
            if not self._seq.suspended_here():
                raise
            self._close()

    def _close(self) -> None:
        if self.file is None:
            return
        self.weights = self._vocab = self._tokenizer = None
        self.cache = self.sparse = self._gpu = self._backend = None
        f, self.file = self.file, None
        if not f.close():
            import gc
            gc.collect()   # the tokenizer's objects may sit in reference cycles
            f.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ tokenizer
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            if self.file is None:
                raise _closed()
            from loaders.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_vocab(self.vocab, model_name=self.cfg.name,
                                                   architecture=self.cfg.arch)
        return self._tokenizer

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens))

    # -------------------------------------------------------------- forward
    @exclusive
    def forward(self, tokens: np.ndarray, all_logits: bool = False, prompt_end: int | None = None,
                logits: bool = True) -> np.ndarray | None:
        """Run ``tokens`` through the model (see :meth:`_forward`) with the engine's thread count."""
        if self.file is None:
            raise _closed()
        # overflow / invalid-value warnings are replaced by the engine's own non-finite checks
        with self._threads(), np.errstate(over="ignore", invalid="ignore"):
            return self._forward(tokens, all_logits, prompt_end, logits)

    def _forward(self, tokens: np.ndarray, all_logits: bool = False, prompt_end: int | None = None,
                 logits: bool = True, ckpt=None) -> np.ndarray | None:
        """Run ``tokens`` (appended after the cached ones) through the model
        (:func:`pyimp.forward.forward` over this engine's backend).

        Returns float32[T, n_vocab] logits when ``all_logits`` else float32[1, n_vocab]
        for the last token, or None when ``logits`` is False (the output head is skipped).
        The cache grows by T tokens. ``prompt_end``: absolute end of the prompt this chunk
        belongs to (sets the importance observation window); ``ckpt``: the cache's checkpoint
        at the current position when the caller has one.
        """
        T = len(tokens)
        pos0 = int(self.cache.cache_seqlens[0])
        ckpt = self.cache.checkpoint() if ckpt is None else ckpt
        self.cache.reserve(T)
        sp = self.sparse
        # decode step or prefill chunk (a lone token that ends a chunked prompt is a prefill chunk;
        # the sparse state also applies the importance decay once per prefill here)
        decode = T == 1 if sp is None else not sp.begin_forward(pos0, T, prompt_end)
        end = pos0 + T if prompt_end is None else prompt_end
        obs = 0 if sp is None else sp.obs_start(end)
        step = make_step(self.cfg, self.weights.arch, tokens, pos0, decode, obs, prompt_end,
                         all_logits, logits, fused=self.fused_ops and self._tap is _no_tap,
                         sparse_state=sp, cache=self.cache,
                         obs_start2=-1 if sp is None else sp.obs_start2(end))
        out = forward(self.cfg.n_layer, self._backend, step)
        self.cache.commit(T)
        self.tokens.extend(int(t) for t in tokens)
        if out is not None and not ops.all_finite(out):
            # every layer's keys and values were finite (KVCache.write checks them): the last
            # layer's attention or feed-forward, or the output head, produced the NaN / inf
            self._truncate(pos0, ckpt)
            raise ops.NonFiniteError(
                "NaN or inf in the logits computed on the device (a layer's hidden state "
                "overflowed, or corrupted weights)" if self._gpu is not None else
                f"layer {self.cfg.n_layer - 1}: NaN or inf in the logits after the last layer "
                f"(its attention or feed-forward, or the output head; corrupted weights?)")
        self._end_forward(pos0 + T, decode, prompt_end)
        return out

    def _end_forward(self, n: int, decode: bool, prompt_end: int | None) -> None:
        """After a forward that succeeded: the eviction policy and the sliding-window trim drop
        what the layers no longer keep, then the sparse state's step bookkeeping (anchors once a
        prefill is complete)."""
        if self.policy is not None:
            self.policy.after_forward(n, not decode and (prompt_end is None or n >= prompt_end))
        if self.sparse is not None:
            self.sparse.end_forward(n)

    def _truncate(self, n: int, checkpoint=None) -> bool:
        """Forget cached tokens from position n on (their blocks stay reserved); ``checkpoint``:
        the cache's :meth:`KVCache.checkpoint` from when it held n tokens (exact rewind).

        Where a layer dropped tokens the rewind needs (an eviction policy, or a sliding-window
        layer trimmed past what position n sees) the cache is emptied instead, as llama.cpp
        re-processes a prompt it cannot restore from an SWA cache; returns False then."""
        if not self.cache.rewinds_exactly(n, list(self.cfg.windows)):
            self.reset()
            return False
        self.cache.truncate(n, checkpoint=checkpoint)
        del self.tokens[n:]
        if self.sparse is not None:
            self.sparse.truncate(n)
        return True

    # ----------------------------------------------------------------- API
    def check_tokens(self, tokens) -> np.ndarray:
        arr = inputs.token_ids(tokens, self.cfg.n_vocab)
        room = self.n_ctx - len(self.tokens)
        if arr.size > room:
            raise ValueError(f"{arr.size} tokens do not fit: {len(self.tokens)} cached, context size "
                             f"{self.n_ctx} (use a larger -c/--ctx-size)")
        return arr

    @exclusive
    def eval(self, tokens, all_logits: bool = False, progress=None) -> np.ndarray:
        """Append ``tokens`` to the cache in prefill chunks.

        Returns the logits of the last token, float32[1, n_vocab], or with ``all_logits``
        those of every token, float32[T, n_vocab]. On NaN / inf (:class:`ops.NonFiniteError`,
        naming the layer) the cache is left as it was before the call.
        """
        if self.file is None:
            raise _closed()
        arr = self.check_tokens(tokens)
        if arr.size == 0:
            raise ValueError("no tokens to evaluate")
        bs = self.options.batch_size
        spans = [(s, min(s + bs, arr.size)) for s in range(0, arr.size, bs)]
        obs_at = -1
        if self.policy is not None and self.policy.observes and arr.size > 1:
            # the prompt's last obs_window rows run as chunks of their own (kv_policy: h2o's
            # observation window accumulates apart from the rest)
            obs_at = max(0, arr.size - self.options.kv_obs_window)
            spans = ([(s, min(s + bs, obs_at)) for s in range(0, obs_at, bs)] +
                     [(s, min(s + bs, arr.size)) for s in range(obs_at, arr.size, bs)])
        return self._run(arr, spans, obs_at, all_logits, progress)

    @exclusive
    def decode_one(self, token) -> np.ndarray:
        """One decode step: append ``token`` and return its logits, float32[1, n_vocab] (what
        ``eval([token])`` returns, without the prefill chunk planner)."""
        if self.file is None:
            raise _closed()
        return self._run(self.check_tokens([token]), [(0, 1)], -1, False, None)

    def _run(self, arr, spans, obs_at: int, all_logits: bool, progress) -> np.ndarray:
        """Forward ``arr`` chunk by chunk (``spans``; the policy's observation window from
        ``obs_at``, -1: none); on NaN / inf the cache goes back to where it was."""
        outs = []
        t0 = time.perf_counter()
        start = len(self.tokens)
        end = start + arr.size
        ckpt = self.cache.checkpoint()
        with self._threads(), np.errstate(over="ignore", invalid="ignore"):
            for s, e in spans:
                last = e >= arr.size
                if s == obs_at:
                    self.policy.observe_start()
                # chunks before the last only fill the cache unless every row's logits are wanted
                try:
                    out = self._forward(arr[s:e], all_logits=all_logits, prompt_end=end,
                                        logits=all_logits or last, ckpt=ckpt if s == 0 else None)
                except ops.NonFiniteError as err:
                    if obs_at >= 0:
                        self.policy.cancel_observation()
                    if not self._truncate(start, ckpt):
                        raise ops.NonFiniteError(f"{err} (the KV cache was emptied: tokens before "
                                                 f"this call had been dropped by the eviction "
                                                 f"policy or the sliding-window trim)") from None
                    raise
                if out is not None:
                    outs.append(out)
                if progress is not None:
                    progress(e, arr.size)
        dt = time.perf_counter() - t0
        if arr.size > 1:
            self.timings.prefill_tokens += int(arr.size)
            self.timings.prefill_s += dt
        else:
            self.timings.decode_tokens += 1
            self.timings.decode_s += dt
        return np.concatenate(outs, axis=0) if all_logits else outs[-1]

    @exclusive
    def trace(self, prompt, steps: int = 0, keep=None, add_bos: bool = True):
        """Run ``prompt`` (text or token ids) as one prefill forward and ``steps`` greedy decode
        steps, recording every named intermediate tensor under llama.cpp's graph names; returns
        a :class:`pyimp.trace.record.Trace` (``.write(path)``: the GGUF tensor dump). ``keep(name)``
        selects what is copied (None: everything). The cache is reset first and holds the run
        afterwards. CPU only (device="cuda" raises ValueError). Names, order and format:
        :mod:`pyimp.trace.dump`."""
        if not capabilities.CAPABILITIES[self.device].trace:
            raise ValueError(f"{capabilities.refusal('a trace', 'trace')}: the {self.device} "
                             f"backend records no tensors")
        from .trace.record import run_trace
        return run_trace(self, prompt, steps, keep, add_bos)

    @exclusive
    def reset(self) -> None:
        """Empty the KV cache (and the importance matrix and anchors)."""
        if self.file is None:
            raise _closed()
        self.cache.reset()
        self.tokens = []
        if self.sparse is not None:
            self.sparse.reset()
        if self.policy is not None:
            self.policy.forget()

    @exclusive
    def prime(self, tokens, progress=None) -> np.ndarray:
        """Make the cache hold exactly ``tokens`` and return the last token's logits, reusing
        the longest prefix already cached (as llama.cpp reuses a prompt cache): the cache is cut
        back to that prefix, at least one token is evaluated (for its logits), the rest runs
        as a prefill. The reused tokens keep their KV, importance_ and anchors."""
        arr = inputs.token_ids(tokens, self.cfg.n_vocab)
        if arr.size == 0:
            raise ValueError("no tokens to evaluate")
        cached = np.asarray(self.tokens, dtype=np.int64)
        m = min(cached.size, arr.size - 1)
        same = np.flatnonzero(cached[:m] != arr[:m])
        keep = int(same[0]) if same.size else m
        restarted = keep < cached.size and not self._truncate(keep)
        if restarted:
            keep = 0                       # tokens the prefix needs were dropped: start over
        self.timings.extra["prefix_reused"] = keep
        self.timings.extra["prefix_restarted"] = restarted
        return self.eval(arr[keep:], progress=progress)

    @exclusive
    def evict(self) -> None:
        """Apply the eviction policy now, as at the end of a prefill (snapkv / pyramidkv compress
        the cache here; a state loaded with :meth:`load_state` is compressed as if its prompt had
        just been evaluated)."""
        if self.file is None:
            raise _closed()
        if self.policy is not None and self.tokens:
            self.policy.after_forward(len(self.tokens), True)

    @exclusive
    def save_state(self, path: str | os.PathLike, level: int | None = None) -> dict:
        """Save the cached tokens, KV, importance_ and anchors to ``path`` (see :mod:`pyimp.kv.state`);
        returns the writer's statistics. ``level``: the zstd level (None: the format's default;
        0 stores every section raw, for a short-lived file written and read at memory speed)."""
        if self.file is None:
            raise _closed()
        self._host_only("saving a state")
        from .kv import state
        return state.save(self, path, level)

    @exclusive
    def load_state(self, path: str | os.PathLike) -> int:
        """Replace the cache by a state saved with :meth:`save_state`; returns the tokens loaded.
        A file that does not fit this engine raises :class:`pyimp.kv.statefile.StateFileError`
        naming the file and the reason, and leaves the engine as it was."""
        if self.file is None:
            raise _closed()
        self._host_only("loading a state")
        from .kv import state
        return state.load(self, path)

    def _host_only(self, what: str) -> None:
        if not capabilities.CAPABILITIES[self.device].prompt_cache:
            raise ValueError(f"{what} (--prompt-cache) needs the cache on the host: run with "
                             f"--device cpu")

    @exclusive
    def compile_decode_attention(self) -> None:
        """Compile (or load) the decode attention kernels of this cache's types: one call over a
        zero token in layer 0, then the cache is empty again (:func:`pyimp.runtime.warmup.compile_decode_attention`)."""
        warmup.compile_decode_attention(self)

    @exclusive
    def warmup(self, compile_helper: bool = False) -> float:
        """Compile (or load from cache) every kernel of prefill and decode; returns seconds.
        With ``compile_helper``, on a first run a second process shares the compiling
        (:func:`pyimp.runtime.warmup.run`)."""
        return warmup.run(self, compile_helper)

    def generate(self, prompt: str | list, max_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: list | None = None, add_bos: bool = True, progress=None,
                 reuse_prefix: bool = False) -> Iterator[tuple[int, float]]:
        """Yield (token id, log-probability) pairs, continuing ``prompt`` (text or ids).

        Stops at end-of-generation tokens, after ``max_tokens`` (an integer >= -1, as
        ``-n/--n-predict``: -1 = no limit, 0 = none), at a full context, or when the
        generated text contains one of ``stop`` (the stop string itself is
        yielded as part of the tokens that produced it). The cache is reset first, or with
        ``reuse_prefix`` cut back to the longest prefix it shares with the prompt (:meth:`prime`).
        Arguments are checked here; the iterator holds the engine from its first token until it
        ends or is closed (meanwhile another thread's calls raise :class:`EngineBusyError`).
        """
        max_tokens = inputs.max_tokens(max_tokens)
        sampler = Sampler(sampling or SamplingParams())
        ids = self.tokenize(prompt, add_bos=add_bos) if isinstance(prompt, str) else prompt
        ids = [int(t) for t in inputs.token_ids(ids, self.cfg.n_vocab)]
        if not ids:
            raise ValueError("the prompt is empty")
        return generation.tokens(self, ids, max_tokens, sampler, stop, progress, reuse_prefix)

    @property
    def vocab(self):
        if self._vocab is None:
            if self.file is None:
                raise _closed()
            self._vocab = self.file.vocab()
        return self._vocab

    def eog_ids(self) -> set:
        """End-of-generation token ids, as llama.cpp's vocabulary marks them."""
        return set(self.tokenizer.eog_ids) | ({self.cfg.eos_id} - {-1})


def load(path: str | os.PathLike | None = None, **options) -> Engine:
    """Load a GGUF model (``None`` = the embedded default model) into an :class:`Engine`.

    Options are the fields of :class:`EngineOptions` and of :class:`SparseOptions`
    (:mod:`pyimp.options`; a field that is also a CLI flag carries its help in its metadata,
    as ``pyimp-run --help`` shows). ``sparse`` is a bool (``enabled``) or a whole
    :class:`SparseOptions`; sparse keywords given beside a SparseOptions override its fields
    of the same names.
    """
    if path is None:
        from .runtime.default_model import default_model_path
        path = default_model_path()
    sparse_fields = set(SparseOptions.__dataclass_fields__) - {"enabled"}
    sp = {k: options.pop(k) for k in list(options) if k in sparse_fields}
    given = options.pop("sparse", None)
    if isinstance(given, SparseOptions):
        options["sparse"] = dataclasses.replace(given, **sp)
    else:
        if given is not None:
            if not isinstance(given, (bool, np.bool_)):
                raise TypeError(f"sparse must be a bool or a SparseOptions, got {type(given).__name__}")
            sp["enabled"] = bool(given)
        if sp:
            options["sparse"] = SparseOptions(**sp)
    unknown = set(options) - set(EngineOptions.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown option {sorted(unknown)[0]!r}")
    return Engine(path, EngineOptions(**options))
