"""Engine as a library: no side effects on the host process, eval's default, threads per call,
non-finite values, close(), memory checks before allocating."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import numba
import numpy as np
import pytest

import pyimp
from pyimp import ops
from pyimp.engine import Engine, EngineOptions
from pyimp.kv.cache import KVCache
from pyimp.runtime.memory import InsufficientMemoryError, parse_size
from pyimp.sparse.policy import SparseOptions, SparseState
from tools.write_synthetic_gguf import SynthSpec, write
from tools.write_synthetic_gguf import prompt_ids as _ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # n_ctx 64: the training context the warning test goes beyond
    return write(tmp_path_factory.mktemp("api") / "llama.gguf",
                 SynthSpec(arch="llama", n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                           n_ctx=64, vocab_size=300, seed=3))



def test_import_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    r = subprocess.run([sys.executable, "-c",
                        "import os, pyimp, pyimp.engine, loaders.quants\n"
                        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None None"


def test_eval_returns_the_last_row_by_default(llama):
    ids = _ids(20)
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8, batch_size=8))
    last = eng.eval(ids)
    assert last.shape == (1, 300)
    eng.reset()
    every = eng.eval(ids, all_logits=True)
    assert every.shape == (20, 300)
    # the last-row path runs the final FFN as a matvec instead of a matmul: float32 sums in
    # another order, relative differences of a few 1e-7 after 3 layers (bound: 10x that)
    np.testing.assert_allclose(last[0], every[-1], rtol=0, atol=1e-5 * np.abs(every[-1]).max())


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2 Numba threads to tell settings apart")
def test_n_threads_applies_per_call_and_restores_the_callers_setting(llama, monkeypatch):
    numba.set_num_threads(2)
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8, n_threads=1))
    assert numba.get_num_threads() == 2          # construction leaves the caller's setting alone
    seen = []
    real = ops.rms_norm

    def spy(*a, **k):
        seen.append(numba.get_num_threads())
        return real(*a, **k)
    monkeypatch.setattr(ops, "rms_norm", spy)
    eng.eval(_ids(12))
    eng.eval([5])                                 # decode: ThreadChoice trials nest inside
    assert seen and set(seen) == {1}
    assert numba.get_num_threads() == 2          # restored after the call
    # another thread (Numba's setting is per thread; its default there is all threads)
    seen.clear()
    t = threading.Thread(target=lambda: (eng.reset(), eng.eval(_ids(12))))
    t.start()
    t.join()
    assert seen and set(seen) == {1}


def _poison(eng, il: int, name: str, value: float):
    lw = eng.weights.layers[il]
    lin = getattr(lw, name)
    setattr(lw, name, lambda h, num: np.full((h.shape[0], lin.n_out), value, np.float32))


def test_f16_overflow_is_refused_naming_the_layer(llama):
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8, batch_size=8, kv_type="f16"))
    eng.eval(_ids(5))
    _poison(eng, 1, "attn_v", 1e5)              # finite in float32, inf in float16
    with pytest.raises(ops.NonFiniteError, match=r"^layer 1: .*does not fit the f16 KV cache"):
        eng.eval(_ids(12, 1))                    # two chunks: the first one succeeds
    # nothing of the failed call stays cached
    assert len(eng.tokens) == 5 and int(eng.cache.cache_seqlens[0]) == 5
    f32 = Engine(llama, EngineOptions(n_ctx=64, block_len=8, kv_type="f32"))
    _poison(f32, 1, "attn_v", 1e5)
    assert np.isfinite(f32.eval(_ids(12, 1))).all()   # an f32 cache holds it


def test_nan_weights_name_the_layer(llama):
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    _poison(eng, 0, "ffn_down", np.nan)          # layer 0's output: layer 1's keys go NaN
    with pytest.raises(ops.NonFiniteError, match=r"^layer 1: NaN or inf in the keys"):
        eng.eval(_ids(6))
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    _poison(eng, 2, "ffn_up", np.inf)            # the last layer: only the logits show it
    with pytest.raises(ops.NonFiniteError, match=r"^layer 2: NaN or inf in the logits"):
        eng.eval(_ids(6))
    assert eng.tokens == [] and int(eng.cache.cache_seqlens[0]) == 0


def test_close_releases_the_map(llama):
    with pyimp.load(llama, n_ctx=64, block_len=8) as eng:
        m = eng.file._mmap
        eng.tokenize("ab")                       # vocabulary arrays are views into the map
        assert eng.eval(_ids(4)).shape == (1, 300)
        assert not m.closed
    assert m.closed
    with pytest.raises(RuntimeError, match="the engine is closed"):
        eng.eval([1])
    eng.close()                                  # twice is fine


def test_buffer_sizes_are_computed_before_allocating(llama):
    c = KVCache(3, 2, 16, 100, block_len=8, kv_type="f16")
    assert KVCache.bytes_needed(3, 2, 16, 100, block_len=8, kv_type="f16") == \
        c.nbytes + c.book_nbytes
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8, sparse=SparseOptions(
        enabled=True, anchor="quest", anchor_num=4)))
    b = eng.sparse.report()["bytes"]
    assert SparseState.bytes_needed(eng.options.sparse, eng.cfg, eng.cache.max_blocks, 8) == \
        b["importance"] + b["anchors"]


def test_configuration_beyond_memory_is_one_error(llama, monkeypatch):
    monkeypatch.setenv("PYIMP_MEMORY_LIMIT", "1G")
    with pytest.raises(InsufficientMemoryError) as ei:
        Engine(llama, EngineOptions(n_ctx=10_000_000))
    msg = str(ei.value)
    assert "\n" not in msg and "context 10000000" in msg and "1.0 GiB" in msg and "PYIMP_MEMORY_LIMIT" in msg
    # K/V of 2M tokens: 732 MiB, fits; DYNAMIC anchors with a slot per token double it
    with pytest.raises(InsufficientMemoryError, match="importance and anchors"):
        Engine(llama, EngineOptions(n_ctx=2_000_000, sparse=SparseOptions(enabled=True, anchor="dynamic",
                                                                         anchor_num=32)))
    monkeypatch.setenv("PYIMP_MEMORY_LIMIT", "lots")
    with pytest.raises(ValueError, match="PYIMP_MEMORY_LIMIT='lots'"):
        Engine(llama, EngineOptions(n_ctx=64))
    assert parse_size("1.5K") == 1536 and parse_size("2GiB") == 2 << 30


def test_context_beyond_training_warns(llama):
    with pytest.warns(RuntimeWarning, match="exceeds the model's training context 64"):
        Engine(llama, EngineOptions(n_ctx=128))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_sampler_refuses_non_finite_logits(bad, temp):
    from pyimp.sampling import Sampler, SamplingParams
    logits = np.zeros(100, np.float32)
    logits[7] = bad
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        Sampler(SamplingParams(temperature=temp, seed=0)).sample(logits, [])
    logits[7] = -np.inf                          # a masked token is fine
    assert Sampler(SamplingParams(temperature=temp, seed=0)).sample(logits, []) != 7


def test_first_run_warmup_compiles_decode_kernels_in_a_helper(llama, monkeypatch):
    """On a first run (here forced: every kernel load counts as slow) warmup starts the compile
    helper, which runs the decode path of the same model, types and numerics in its own
    process and exits cleanly; the engine's results do not depend on it."""
    from pyimp.runtime import warmup as warmup_mod
    from pyimp.runtime import parallel_compile
    started = []
    real_start = parallel_compile.start

    def start(eng, claims):
        p = real_start(eng, claims)
        started.append((p, claims))
        return p

    monkeypatch.setattr(parallel_compile, "start", start)
    monkeypatch.setattr(warmup_mod, "first_run", lambda: True)
    opts = {"n_ctx": 64, "block_len": 8, "kv_type": "f32"}
    eng = Engine(llama, EngineOptions(**opts))
    eng.warmup(compile_helper=True)
    assert len(started) == 1 and started[0][0] is not None and started[0][0].returncode == 0
    assert not os.path.exists(started[0][1])           # the claim folder is gone
    got = eng.eval(_ids(12))
    plain = Engine(llama, EngineOptions(**opts))
    plain.warmup()
    np.testing.assert_array_equal(got, plain.eval(_ids(12)))
    monkeypatch.setattr(warmup_mod, "first_run", lambda: False)   # kernels cached: no helper
    Engine(llama, EngineOptions(**opts)).warmup(compile_helper=True)
    assert len(started) == 1


def test_first_run_without_a_temporary_folder_compiles_in_process(llama, monkeypatch):
    """Where no claim folder can be made (an unwritable TMPDIR), a first run's warmup starts no
    helper and compiles everything itself: no error, the same logits."""
    import tempfile

    from pyimp.runtime import warmup as warmup_mod
    from pyimp.runtime import parallel_compile

    def no_tmp(*a, **k):
        raise PermissionError("read-only temporary folder")

    started = []
    monkeypatch.setattr(warmup_mod, "first_run", lambda: True)
    monkeypatch.setattr(tempfile, "mkdtemp", no_tmp)
    monkeypatch.setattr(parallel_compile, "start", lambda *a: started.append(a))
    opts = {"n_ctx": 64, "block_len": 8, "kv_type": "f32"}
    eng = Engine(llama, EngineOptions(**opts))
    eng.warmup(compile_helper=True)
    assert started == []
    monkeypatch.undo()
    np.testing.assert_array_equal(eng.eval(_ids(12)), Engine(llama, EngineOptions(**opts)).eval(_ids(12)))


def test_first_run_is_read_from_numba_cache_index(tmp_path):
    """A first run is known before anything compiles: with an empty Numba cache the index has no
    rms_norm entry for this machine, after one rms_norm it has (in this process and the next).
    Where the index cannot be read, the timed kernel load (rope compiled, or loaded from the
    cache) decides the same way."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    check = ("import numpy as np; from pyimp import ops; from pyimp.runtime import warmup as e; "
             "a = e.numba_cache_has_kernels(); "
             "ops.rms_norm(np.ones((1, 8), np.float32), np.ones(8, np.float32), 1e-6); "
             "b = e.numba_cache_has_kernels(); e.numba_cache_has_kernels = lambda: None; "
             "print(a, b, e.first_run())")
    runs = [subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
            for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["False", "True", "True"], ["True", "True", "False"]], \
        [r.stderr[-2000:] for r in runs]


def test_claims_share_out_the_decode_matvecs(gemma_path, tmp_path, monkeypatch):
    """The helper and the engine each compile a weight type's decode matvec only if they claim
    it first; the helper takes types in the order a forward first reaches them (Gemma's file
    mixes four types), the engine from the back; wait returns once every claimed type is done."""
    from pyimp.runtime import parallel_compile as ch
    eng = Engine(gemma_path, EngineOptions(n_ctx=64, block_len=32))
    lins = ch.decode_linears(eng.weights)
    W = eng.weights
    order = [lin.qtype for lw in W.layers for lin in (lw.attn_q, lw.attn_k, lw.attn_v,
             lw.attn_output, lw.ffn_gate, lw.ffn_up, lw.ffn_down)] + [W.output.qtype]
    assert W.layers[0].linears()[3] is W.layers[0].attn_output
    assert [lin.qtype for lin in lins] == list(dict.fromkeys(order)) and len(lins) == 4
    compiled = []
    monkeypatch.setattr(type(lins[0]), "compile_decode",
                        lambda self, numerics: compiled.append((self.qtype, numerics)))
    helper, engine = ch.Claims(str(tmp_path)), ch.Claims(str(tmp_path))
    assert helper.take(lins[0]) and not engine.take(lins[0])      # the helper got there first
    engine.compile(lins[::-1], "fp32")
    assert compiled == [(lin.qtype, "fp32") for lin in lins[:0:-1]]
    helper.compile(lins, "fp32")          # everything is claimed now: nothing compiles twice
    assert len(compiled) == 3
    # wait's clock: a fake one that only its sleeps move (at most 1000 polls, so a wait that
    # never ends fails instead of hanging)
    clock = {"now": 100.0, "sleeps": [], "at": []}

    def sleep(dt):
        assert len(clock["sleeps"]) < 1000, "wait polls forever"
        clock["sleeps"].append(dt)
        clock["at"].append(clock["now"])
        clock["now"] += dt
    monkeypatch.setattr(ch, "time", types.SimpleNamespace(monotonic=lambda: clock["now"],
                                                          sleep=sleep))
    helper.wait(lins[1:])                 # done files follow the engine's compiles: no poll
    assert clock["sleeps"] == []
    helper.wait(lins[:1], timeout_s=0.3)  # claimed by take() alone, never done: the guard ends it
    assert clock["sleeps"] and set(clock["sleeps"]) == {0.05}      # polls every 50 ms
    # it polled while before the deadline and stopped at the first look past it
    assert max(clock["at"]) < 100.0 + 0.3 <= clock["now"]


@pytest.mark.parametrize("model,kv", [("llama", "f16"), ("llama", "f32"), ("gemma_path", "q8_0")])
def test_compile_decode_attention_leaves_the_engine_as_it_was(request, model, kv):
    """The compile helper's first step (one decode attention call over a zero token of layer
    0, for the cache's types) leaves an empty cache: the logits that follow are those of an
    engine that never ran it. A cache holding tokens is refused. (q8_0 needs head dims that
    are multiples of 32: Gemma's.)"""
    path = request.getfixturevalue(model)
    opts = {"n_ctx": 64, "block_len": 8 if model == "llama" else 32, "kv_type": kv}
    eng = Engine(path, EngineOptions(**opts))
    eng.compile_decode_attention()
    assert eng.tokens == [] and eng.cache.slot_count(0) == 0
    assert all((eng.cache.table(il) < 0).all() for il in range(eng.cfg.n_layer))
    got = eng.eval(_ids(12))
    np.testing.assert_array_equal(got, Engine(path, EngineOptions(**opts)).eval(_ids(12)))
    with pytest.raises(RuntimeError, match="empty cache"):
        eng.compile_decode_attention()


def test_compile_decode_leaves_the_thread_choice_untimed(llama):
    """Linear.compile_decode runs the type's decode kernel once outside the matrix's thread
    choice (shared by every matrix of its type and shape), so it adds no timed call."""
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    lin = eng.weights.layers[0].attn_q
    choices = [lin.thread_choice(num) for num in ("fp32", "ggml")]
    before = [(tc.parallel, tuple(map(len, tc._times))) for tc in choices]
    lin.compile_decode("fp32")
    lin.compile_decode("ggml")
    assert [(tc.parallel, tuple(map(len, tc._times))) for tc in choices] == before
    with pytest.raises(ValueError):
        lin.compile_decode("fp16")


# ------------------------------------------------------------ one sequence, one caller at a time
def _busy_error():
    assert issubclass(pyimp.EngineBusyError, RuntimeError)      # exported, and a RuntimeError
    return pyimp.EngineBusyError


def _block_worker_forward(eng, worker: dict, entered: threading.Event, release: threading.Event):
    """Make eng._forward (every model forward goes through it) wait on ``release`` inside the
    worker thread (after setting ``entered``); other threads run it as before."""
    real = eng._forward

    def forward(*a, **k):
        if threading.current_thread() is worker.get("thread"):
            entered.set()
            assert release.wait(30)
        return real(*a, **k)
    eng._forward = forward


def test_second_thread_gets_a_busy_error_while_generate_runs(llama, tmp_path):
    """A generate running in one thread holds the engine: every call of another thread that
    would touch the sequence raises one error naming the engine as in use by another thread,
    and the first thread's output is that of a run on its own."""
    from pyimp.sampling import SamplingParams
    greedy = SamplingParams(temperature=0)
    alone = [t for t, _ in Engine(llama, EngineOptions(n_ctx=64, block_len=8)).generate(
        _ids(10), max_tokens=6, sampling=greedy)]
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    eng.eval(_ids(4))
    eng.save_state(tmp_path / "s.kv")
    eng.reset()
    entered, release = threading.Event(), threading.Event()
    worker: dict = {}
    _block_worker_forward(eng, worker, entered, release)
    got = []

    def run():
        got.extend(t for t, _ in eng.generate(_ids(10), max_tokens=6, sampling=greedy))
    worker["thread"] = t = threading.Thread(target=run)
    t.start()
    try:
        assert entered.wait(30)
        calls = {"generate": lambda: list(eng.generate(_ids(5, 1), max_tokens=3, sampling=greedy)),
                 "eval": lambda: eng.eval(_ids(3)), "reset": eng.reset,
                 "prime": lambda: eng.prime(_ids(3)), "evict": eng.evict,
                 "save_state": lambda: eng.save_state(tmp_path / "t.kv"),
                 "load_state": lambda: eng.load_state(tmp_path / "s.kv"),
                 "trace": lambda: eng.trace(_ids(3)), "warmup": eng.warmup,
                 "compile_decode_attention": eng.compile_decode_attention, "close": eng.close,
                 "forward": lambda: eng.forward(np.array([3], np.int64)),
                 "decode_one": lambda: eng.decode_one(3)}
        for name, call in calls.items():
            with pytest.raises(_busy_error(), match="in use by another thread") as ei:
                call()
            assert isinstance(ei.value, RuntimeError) and "\n" not in str(ei.value), name
            assert name in str(ei.value), name
    finally:
        release.set()
        t.join(60)
    assert got == alone
    assert not (tmp_path / "t.kv").exists()
    eng.reset()                                   # free again once the generate has ended
    assert eng.eval(_ids(3)).shape == (1, 300)


def test_an_unfinished_generate_holds_the_engine(llama):
    """Between its tokens a generate iterator still holds the sequence: a call of another
    thread is refused, so is one of the thread that holds the iterator (it names the
    iterator); run to its end or closed, the engine is free. The iterator itself may be
    advanced from another thread (as a thread pool serving a stream does)."""
    from pyimp.sampling import SamplingParams
    greedy = SamplingParams(temperature=0)
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    alone = [t for t, _ in eng.generate(_ids(10), max_tokens=5, sampling=greedy)]
    g = eng.generate(_ids(10), max_tokens=5, sampling=greedy)
    seen = [next(g)[0]]
    err = []

    def other():
        try:
            eng.eval(_ids(3))
        except Exception as e:       # noqa: BLE001 - the test inspects it
            err.append(e)
    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert len(err) == 1 and isinstance(err[0], _busy_error()), err
    assert "in use by another thread" in str(err[0])
    with pytest.raises(_busy_error(), match=r"unfinished generate\(\)"):
        eng.reset()
    t = threading.Thread(target=lambda: seen.append(next(g)[0]))
    t.start()
    t.join(30)
    seen.extend(tok for tok, _ in g)
    assert seen == alone
    g = eng.generate(_ids(10), max_tokens=5, sampling=greedy)
    next(g)
    g.close()
    assert eng.eval(_ids(3)).shape == (1, 300)
    # closing the engine under this thread's unfinished iterator: its next token says so
    g = eng.generate(_ids(10), max_tokens=5, sampling=greedy)
    next(g)
    eng.close()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        next(g)


# ------------------------------------------------------------------------ token ids, max_tokens
@pytest.mark.parametrize("tokens,err,match", [
    ([2, 1.5], TypeError, "token ids must be integers.*1.5"),
    ([2, True], TypeError, "token ids must be integers.*bool"),
    (np.array([1, 0], dtype=bool), TypeError, "token ids must be integers.*bool"),
    (np.array([2.0, 3.0]), TypeError, "token ids must be integers.*float64"),
    (np.array([[1, 2], [3, 4]]), ValueError, r"1-D.*\(2, 2\)"),
    ([[1, 2], [3, 4]], TypeError, "token ids must be integers.*list"),
    (np.int64(5), ValueError, r"1-D.*\(\)"),
    ("abc", TypeError, "token ids must be integers.*str"),
    (np.array([2**63], dtype=np.uint64), ValueError, "token id 9223372036854775808 "),
    ([3, 2**70], ValueError, f"token id {2**70} "),
    ([3, -1], ValueError, "token id -1 "),
    (np.array([3, 300], dtype=np.int32), ValueError, "token id 300 "),
])
def test_eval_accepts_only_1d_integer_ids(llama, tokens, err, match):
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    calls = [eng.eval, eng.prime]
    if not isinstance(tokens, str):      # generate tokenizes text
        calls.append(lambda ids: eng.generate(ids, max_tokens=2))
    for call in calls:
        with pytest.raises(err, match=match):
            call(tokens)                   # generate: at the call, not at the first token
    assert eng.tokens == []
    ok = [np.array([3, 4], np.uint8), np.array([3, 4], np.uint64), [np.int16(3), 4], (3, 4)]
    for ids in ok:
        eng.reset()
        assert eng.eval(ids).shape == (1, 300) and eng.tokens == [3, 4]


@pytest.mark.parametrize("n,err,match", [
    (-5, ValueError, "max_tokens must be >= -1.*-5"),
    (-2, ValueError, "max_tokens must be >= -1.*-2"),
    (2.5, TypeError, "max_tokens must be an integer.*2.5"),
    (True, TypeError, "max_tokens must be an integer.*True"),
    ("3", TypeError, "max_tokens must be an integer.*'3'"),
])
def test_generate_checks_max_tokens_as_the_cli_checks_n_predict(llama, n, err, match):
    from pyimp.sampling import SamplingParams
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    with pytest.raises(err, match=match):
        eng.generate(_ids(5), max_tokens=n)
    greedy = SamplingParams(temperature=0)
    eos = eng.eog_ids()
    assert list(eng.generate(_ids(5), max_tokens=0, sampling=greedy)) == []
    out = list(eng.generate(_ids(5), max_tokens=np.int64(3), sampling=greedy))
    assert len(out) == 3 or out[-1][0] in eos
    out = list(eng.generate(_ids(5), max_tokens=-1, sampling=greedy))   # until eog or full
    assert out[-1][0] in eos or len(eng.tokens) == 64


def test_prompt_cache_of_a_model_differing_in_one_weight_byte_is_refused(llama, tmp_path):
    """A state saved from one model is refused by a model whose weights differ in one byte
    that is neither at the start, the middle nor the end of its tensor."""
    from loaders.gguf_file import GGUFFile
    from pyimp.kv.statefile import StateFileError
    with GGUFFile(llama) as f:
        t = f.tensors["blk.1.ffn_down.weight"]
        at = t.offset + t.nbytes // 4
    data = bytearray(open(llama, "rb").read())
    data[at] ^= 0x01
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(data))
    eng = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    eng.eval(_ids(6))
    eng.save_state(tmp_path / "s.kv")
    same = Engine(llama, EngineOptions(n_ctx=64, block_len=8))
    assert same.load_state(tmp_path / "s.kv") == 6
    changed = Engine(str(other), EngineOptions(n_ctx=64, block_len=8))
    with pytest.raises(StateFileError, match="saved from another model"):
        changed.load_state(tmp_path / "s.kv")


def test_decode_one_is_eval_of_one_token(llama):
    """decode_one (the decode entry point, no prefill chunk planner) gives the bits eval gives
    for the same token, dense and block-sparse, and counts as a decode step."""
    for opts in (dict(), dict(sparse=True, topk=1)):
        a = pyimp.load(llama, n_ctx=64, block_len=8, **opts)
        b = pyimp.load(llama, n_ctx=64, block_len=8, **opts)
        a.eval(_ids(20))
        b.eval(_ids(20))
        for tok in (5, 9, 3):
            x, y = a.eval([tok]), b.decode_one(tok)
            assert x.shape == y.shape == (1, a.cfg.n_vocab) and np.array_equal(x, y), opts
        assert b.timings.decode_tokens == 3 and b.tokens == a.tokens
        with pytest.raises(ValueError, match="outside the vocabulary"):
            b.decode_one(10 ** 6)
