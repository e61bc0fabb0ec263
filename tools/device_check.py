"""The GPU check: everything that needs a real GPU, in one command that needs no network.

    python -m tools.device_check OUT            # on a machine with a GPU (about 4 minutes)
    NUMBA_ENABLE_CUDASIM=1 python -m tools.device_check OUT --dry   # tiny shapes, simulator

Writes ``OUT/device_check.json`` and ``OUT/device_check.md``, and ``OUT/kernel_tests.log``
(the kernel tests' whole output). Both result files are rewritten when a step starts (the step
marked ``running``) and when it ends, and when the device requirement fails, so a run cut short
still leaves what it measured and where it stopped. ``--steps`` picks the steps and their
order. Needs numpy, numba and numba-cuda, not ``gguf`` (the GPU machine's image has none):
models are written by :mod:`tools.write_synthetic_gguf`. Steps (``require`` and ``machine``
always first):

1. ``agreement``: a Gemma-3-270M-shaped model written here (random quant blocks: the device
   has no libggml and the real file does not travel), ``device="cuda"`` vs the CPU engine
   with f32 KV: greedy tokens on a few prompts (identical or not) and the mean KL(cpu || gpu)
   of the next-token distributions along the CPU's greedy path. ``agreement_qkv``: the same
   with q8_0 and q4_0 KV caches, one prompt each (``--dry``: q8_0, head dim 32).
2. ``launch_cost``: host microseconds per launch of kernels that do nothing (1 argument, and
   8 arrays + 4 scalars as a decode kernel takes), through ``device.launch`` and directly.
   ``attention``: the decode attention kernel alone at long context, dense vs block-sparse at
   a 1/8 block budget (Gemma's and TinyLlama's head shapes), timed on the device with CUDA
   events: the step-by-step kernels (``attention.decode``: attend, merge, no importance) and
   the fused decode step's one launch (``decode.attend``: merge and importance inside).
3. ``decode``: end-to-end decode tok/s at 1k / 4k / 16k / 32k context, dense vs sparse (1/8
   budget), on a cache filled on the device with random keys and values; per token: host
   microseconds, kernel launches, device allocations, host-to-device and device-to-host copies
   (``pyimp.cuda.device.counting``); the time per token the importance update and the anchor
   upkeep take.
4. ``prefill``: prefill tok/s of a 1024-token prompt through the engine; the prefill
   attention kernel alone over a 32k-token prompt (Gemma's and TinyLlama's head shapes,
   event-timed), and on its first 4k tokens with query rows tiled against one row a work
   item.
5. ``tinyllama``: the TinyLlama-1.1B shape (22 global layers) at 32k, dense vs sparse.
6. ``kernel_tests``: the CUDA kernel tests of ``tests/cuda`` on the GPU (``PYIMP_CUDA_HW=1``:
   the warp-shuffle reductions included), last: they get whatever time is left. Skipped with
   ``--dry`` (CI runs them on the simulator in ``tests/test_cuda.py``).

``--dry`` runs every step at tiny shapes (on the simulator in CI) so that this script has been
executed end to end before it meets a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

# numba-cuda is imported by the steps (this script's kernels: tools.device_check_kernels),
# after the ``require`` step found it: a machine without it gets that step's error in the
# results. NUMBA_ENABLE_CUDASIM (the simulator) must be set before numba is imported.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Check:
    """Results of the steps, written when each one starts and ends."""

    def __init__(self, out: str, dry: bool, budget_s: float):
        self.out, self.dry, self.budget_s = out, dry, budget_s
        self.t0 = time.perf_counter()
        self.data: dict = {"dry": dry, "steps": {}}
        self.models: dict = {}          # synthetic models written so far: key -> path
        self.tmp = ""                   # their folder

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def step(self, name: str, fn, need_s: float = 0.0) -> bool:
        """Run fn(self) as step ``name``; its figures (or its error) go into the results.
        Returns whether it finished with status ok."""
        if self.left() < need_s:
            self.data["steps"][name] = {"status": "skipped", "why": f"under {need_s:.0f} s left"}
            self.write()
            return False
        t = time.perf_counter()
        self.data["steps"][name] = {"status": "running"}
        self.write()
        try:
            res = fn(self) or {}
            res = {"status": "ok", **res}
        except Exception as e:  # a failed step is a result; the next steps still run
            import traceback
            res = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                   "trace": traceback.format_exc()[-3000:]}
        except BaseException as e:      # interrupted (Ctrl-C, SIGTERM): say so, then stop
            self.data["steps"][name] = {"status": "interrupted", "error": type(e).__name__,
                                        "seconds": round(time.perf_counter() - t, 2)}
            self.write()
            raise
        res["seconds"] = round(time.perf_counter() - t, 2)
        self.data["steps"][name] = res
        self.write()
        print(f"[device_check] {name}: {res['status']} ({res['seconds']} s)", flush=True)
        return res["status"] == "ok"

    def write(self) -> None:
        """Both result files, each written beside itself and then renamed over the last one,
        so a run killed while writing leaves the previous whole file."""
        os.makedirs(self.out, exist_ok=True)
        for name, text in (("device_check.json", json.dumps(self.data, indent=1, default=float)),
                           ("device_check.md", markdown(self.data))):
            path = os.path.join(self.out, name)
            with open(path + ".part", "w") as f:
                f.write(text)
            os.replace(path + ".part", path)


def markdown(data: dict) -> str:
    lines = [f"# device_check{' (dry run, simulator)' if data.get('dry') else ''}", ""]
    m = data.get("machine", {})
    if m:
        lines += [f"GPU: {m.get('gpu')} (cc {m.get('cc')}), numba-cuda {m.get('numba_cuda')}, "
                  f"CPU cores {m.get('cpus')}", ""]
    lines += ["| step | status | s | figures |", "|---|---|---|---|"]
    for name, r in data["steps"].items():
        figs = {k: v for k, v in r.items() if k not in ("status", "seconds", "trace")}
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | "
                     f"{json.dumps(figs, default=float)[:4000]} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- helpers


def _sync():
    from numba import cuda
    cuda.synchronize()


def _timed(fn, n: int) -> float:
    """Host seconds per call of fn() (after one untimed call), synchronized."""
    fn()
    _sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _sync()
    return (time.perf_counter() - t) / n


def _device_timed(fn, n: int, warm: bool = True) -> tuple[float, str]:
    """(seconds per call of fn(), the timer): the device's time between a CUDA event recorded
    before n calls (after one untimed call, unless not ``warm``: fn's kernels compiled already)
    and one recorded after them. The simulator's events carry no time (``elapsed_time`` gives
    -1): there the host's time stands in, and the timer says so."""
    from numba import cuda
    if warm:
        fn()
    start, end = cuda.event(), cuda.event()
    start.record()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    host = time.perf_counter() - t
    ms = start.elapsed_time(end)
    if ms < 0:
        return host / n, "host (simulator: events carry no time)"
    return ms / 1e3 / n, "cuda events"


def _shapes(dry: bool) -> dict:
    from tools.write_synthetic_gguf import PRESETS
    if dry:
        gemma = dict(arch="gemma3", n_layer=2, n_embd=64, n_head=4, n_head_kv=1, head_dim=16,
                     n_ff=128, n_ctx=512, sliding_window=8, vocab_size=300)
        gemma["swa_pattern"] = 2
        tiny = dict(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                    n_ctx=512, vocab_size=300)
        # quantized K needs a head dim that is a multiple of 32
        return dict(gemma=gemma, gemma_qkv=dict(gemma, head_dim=32), tinyllama=tiny,
                    contexts=[64], long=64, prompt=12, steps=1, n_prompts=1, gen=3, block_len=8,
                    timed=1, qkv_types=["q8_0"])
    return dict(gemma=dict(PRESETS["gemma3-270m"]), gemma_qkv=dict(PRESETS["gemma3-270m"]),
                tinyllama=dict(PRESETS["tinyllama"]), contexts=[1024, 4096, 16384, 32768],
                long=32768,
                prompt=1024, steps=16, n_prompts=3, gen=32, block_len=32, timed=20,
                qkv_types=["q8_0", "q4_0"])


def _model(check: Check, key: str, weight_type: str, embd_type: str, type_mix: str = "") -> str:
    from tools.write_synthetic_gguf import SynthSpec, write
    cache = check.models
    name = key + (f"-{type_mix}" if type_mix else "")
    if name not in cache:
        spec = dict(_shapes(check.dry)[key])
        spec["n_ctx"] = max(spec.get("n_ctx", 0), 40000)
        path = os.path.join(check.tmp, f"{name}.gguf")
        write(path, SynthSpec(weight_type=weight_type, embd_type=embd_type, random_blocks=True,
                              type_mix=type_mix, **spec))
        cache[name] = path
    return cache[name]


def _fill(engine, n: int, seed: int = 0) -> None:
    """Make the device cache hold n tokens of random keys and values (and the anchors of a
    sparse engine), as if a prompt of n tokens had been evaluated."""
    from pyimp.cuda import device
    from tools import device_check_kernels as kernels
    c = engine.cache
    c.reserve(n)
    for store in (c.k_store, c.v_store):
        flat = store.reshape(store.size)
        nt = 8 if device.SIMULATOR else 256
        device.launch(kernels.fill, 1 if device.SIMULATOR else device.blocks_for(store.size, nt),
                      nt, flat, np.int64(seed))
    c.commit(n)
    engine.tokens = [0] * n
    if engine.sparse is not None:
        engine.sparse.after_prefill(n)
    _sync()


# --------------------------------------------------------------------------- steps


def require(check: Check) -> dict:
    """pyimp's CUDA path can run here (numba-cuda, a GPU or the simulator): what every other
    step needs."""
    from pyimp import cuda as pcuda
    pcuda.require()
    return {}


def machine(check: Check) -> dict:
    import numba
    from numba import cuda
    from loaders import ggml_types
    info = {"cpus": os.cpu_count(), "python": platform.python_version(),
            "numba": numba.__version__,
            "ggml_constants": "gguf" if ggml_types.FROM_GGUF else "pyimp's own tables"}
    try:
        from importlib.metadata import version
        info["numba_cuda"] = version("numba-cuda")
    except Exception:
        info["numba_cuda"] = "?"
    if numba.config.ENABLE_CUDASIM:
        info.update(gpu="simulator", cc="-")
    else:
        dev = cuda.get_current_device()
        info.update(gpu=dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name),
                    cc=".".join(map(str, dev.compute_capability)))
    check.data["machine"] = info
    return info


def kernel_tests(check: Check) -> dict:
    if check.dry:
        return {"status_note": "skipped in --dry: tests/test_cuda.py runs them on the simulator"}
    env = dict(os.environ, PYIMP_CUDA_HW="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    log = os.path.join(check.out, "kernel_tests.log")      # the whole output, tracebacks too
    os.makedirs(check.out, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-rfE",
           os.path.join(ROOT, "tests", "cuda")]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=max(30, check.left() - 10))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        with open(log, "w") as f:
            f.write(out)
        raise RuntimeError(f"kernel tests ran past {e.timeout:.0f} s (partial output in {log})")
    with open(log, "w") as f:
        f.write(r.stdout + r.stderr)
    lines = (r.stdout + r.stderr).strip().splitlines()
    if r.returncode:
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        raise RuntimeError(f"kernel tests failed ({lines[-1] if lines else ''}); "
                           + "\n".join(failed[:40]) + f"\nfull output: {log}")
    return {"summary": lines[-1] if lines else "", "log": log}


def agreement(check: Check) -> dict:
    """The Gemma-shaped model with the default model's type mix (Q8_0 embeddings; Q5_0,
    Q8_0, Q4_K and Q6_K matrices where their row lengths allow, as the real file has them)."""
    sh = _shapes(check.dry)
    path = _model(check, "gemma", "Q5_0", "Q8_0", type_mix="q4_k_m")
    return _agree(sh, path, sh["gemma"]["vocab_size"], sh["n_prompts"], kv_type="f32")


def agreement_qkv(check: Check) -> dict:
    """``agreement`` with quantized KV caches (each engine quantizes its own K/V: the device
    on the device): greedy tokens and mean KL per cache type (one prompt each)."""
    sh = _shapes(check.dry)
    key = "gemma" if sh["gemma_qkv"] == sh["gemma"] else "gemma_qkv"     # one model if it fits
    path = _model(check, key, "Q5_0", "Q8_0")
    res = {t: _agree(sh, path, sh["gemma_qkv"]["vocab_size"], 1, kv_type=t)
           for t in sh["qkv_types"]}
    res["mean_kl"] = float(max(r["mean_kl"] for r in res.values()))
    return res


def _agree(sh: dict, path: str, V: int, n_prompts: int, **cache) -> dict:
    """CPU vs device engines (cache options ``cache``) on n_prompts greedy runs: tokens
    identical or not, KL(cpu || gpu) up to the first disagreement."""
    import pyimp
    from tools.write_synthetic_gguf import prompt_ids
    kw = dict(n_ctx=sh["prompt"] + sh["gen"] + 8, block_len=sh["block_len"], **cache)
    cpu = pyimp.load(path, device="cpu", **kw)
    gpu = pyimp.load(path, device="cuda", **kw)
    same, kls = [], []
    for i in range(n_prompts):
        ids = prompt_ids(min(sh["prompt"], 64), seed=i, n_vocab=V)
        toks = {}
        for name, eng in (("cpu", cpu), ("gpu", gpu)):
            eng.reset()
            rows = [eng.eval(ids)[-1]]
            out = []
            for _ in range(sh["gen"]):
                out.append(int(np.argmax(rows[-1])))
                rows.append(eng.eval([out[-1]])[-1])
            toks[name] = (out, rows)
        same.append(toks["cpu"][0] == toks["gpu"][0])
        # KL along each engine's own path up to the first disagreement (then the contexts differ)
        n = next((j for j, (a, b) in enumerate(zip(*[toks[k][0] for k in ("cpu", "gpu")]))
                  if a != b), sh["gen"])
        for a, b in zip(toks["cpu"][1][:n + 1], toks["gpu"][1][:n + 1]):
            pa = _log_softmax(a)
            pb = _log_softmax(b)
            kls.append(float(np.sum(np.exp(pa) * (pa - pb))))
    return {"greedy_identical": same, "mean_kl": float(np.mean(kls)), "max_kl": float(np.max(kls)),
            "goal_mean_kl_le": 1e-3}


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


def attention_kernel(check: Check) -> dict:
    from pyimp.cuda import attention as CA
    from pyimp.cuda import device
    sh = _shapes(check.dry)
    n = sh["long"]
    B = sh["block_len"]
    res = {}
    for name, (Hq, Hkv, D) in (("gemma", (4, 1, 256 if not check.dry else 16)),
                               ("tinyllama", (32, 4, 64 if not check.dry else 16))):
        rng = np.random.default_rng(0)
        NB = n // B
        kc = device.to_device(rng.standard_normal((Hkv, NB, B * D)).astype(np.float16))
        vc = device.to_device(rng.standard_normal((Hkv, NB, D * B)).astype(np.float16))
        bt = device.to_device(np.arange(NB, dtype=np.int32))
        q = device.to_device(rng.standard_normal((1, Hq, D)).astype(np.float32))
        out = device.empty((1, Hq, D), np.float32)
        K = max(1, NB // 8)
        # KVHEAD sets of every 8th block (distinct, spread over the context)
        sel = device.to_device(np.tile((np.arange(K) * 8).astype(np.int32), (Hkv, 1)))
        cnt = device.to_device(np.full(Hkv, K, np.int32))
        scr = CA.Scratch()
        dense, timer = _device_timed(lambda: CA.decode(q, kc, vc, bt, n, 0.1, 0, out,
                                                       scratch=scr), sh["timed"])
        sparse, _ = _device_timed(lambda: CA.decode(q, kc, vc, bt, n, 0.1, 0, out, sel=sel,
                                                    cnt=cnt, scratch=scr), sh["timed"])
        # the fused decode step's launch (pyimp.cuda.decode.attend): merge and importance
        # update inside, the same split count for a selection as for every block
        from pyimp.cuda import decode as DD
        nsplit = 2 if device.SIMULATOR else max(1, min(NB, -(-264 // Hkv)))
        parts = (device.zeros((1, Hq, nsplit), np.float32),
                 device.zeros((1, Hq, nsplit), np.float32),
                 device.zeros((1, Hq, nsplit, D), np.float32), device.zeros((Hq,), np.int32),
                 device.zeros((Hq, NB, B), np.float32), device.zeros((Hq, NB), np.float32))
        imp = device.zeros((NB, B, Hq), np.float16)
        rec = device.to_device(np.array([n - 1, 0, 0, 0], np.int32))
        q2 = q.reshape(Hq, D)
        f_dense, _ = _device_timed(lambda: DD.attend(q2, kc, vc, bt, rec, 0.1, 0, out, nsplit,
                                                     parts, imp, True), sh["timed"])
        f_sparse, _ = _device_timed(lambda: DD.attend(q2, kc, vc, bt, rec, 0.1, 0, out, nsplit,
                                                      parts, imp, True, sel, cnt), sh["timed"])
        res[name] = {"context": n, "dense_us": dense * 1e6, "sparse_us": sparse * 1e6,
                     "speedup": dense / sparse, "goal_speedup_ge": 5.0,
                     "fused_dense_us": f_dense * 1e6, "fused_sparse_us": f_sparse * 1e6,
                     "fused_speedup": f_dense / f_sparse, "fused_splits": nsplit}
    res["timer"] = timer
    return res


def launch_cost(check: Check) -> dict:
    """Host time per launch of kernels that do nothing (one launch after another, synchronized
    at the end, so the GPU's own time overlaps): through pyimp's device.launch with 1 array
    argument and with 8 arrays and 4 scalars, and numba-cuda's kernel[...] directly. Said
    against the decode step's launches per token (step ``decode``), this tells how much of a
    token is launching."""
    from pyimp.cuda import device
    n = 20 if check.dry else 2000
    a = device.zeros(32, np.float32)
    arrs = [device.zeros(32, np.float32) for _ in range(8)]
    scal = (np.int32(1), np.int32(2), np.float32(0.5), np.float32(1.5))
    from tools.device_check_kernels import empty_1, empty_12
    one = _timed(lambda: device.launch(empty_1, 1, 32, a), n)
    twelve = _timed(lambda: device.launch(empty_12, 1, 32, *arrs, *scal), n)
    raw = _timed(lambda: empty_1[1, 32](a), n)
    return {"us_per_launch_1_array": one * 1e6, "us_per_launch_8_arrays_4_scalars": twelve * 1e6,
            "us_per_launch_numba_cuda_direct_1_array": raw * 1e6, "launches_timed": n}


def _decode_rate(engine, n_ctx: int, steps: int) -> dict:
    """Decode figures of ``engine`` at context n_ctx over ``steps`` tokens: tok/s, host
    microseconds per token (each token ends when its logits are on the host), and per token
    the kernel launches, device allocations, host-to-device and device-to-host copies and
    their bytes (``device.counting``; on a GPU its wrappers add about a microsecond per
    counted call, against milliseconds a token)."""
    from pyimp.cuda import device
    _fill(engine, n_ctx)
    tok = 5
    plan = engine._backend.plan
    for _ in range(2):                       # compile and warm; a CUDA graph is captured
        engine.eval([tok])
    replays = plan.replays
    with device.counting() as c:
        t = time.perf_counter()
        for _ in range(steps):
            engine.eval([tok])
        dt = time.perf_counter() - t
    per = {f"{k}_per_token": v / steps for k, v in c.as_dict().items()}
    # a replayed step launches its kernels inside one cuGraphLaunch, which the counts above
    # do not see: the graph's launches are the fused step's (launches_per_eager_token)
    return {"tok_s": steps / dt, "host_us_per_token": dt / steps * 1e6, **per,
            "graph_replays_per_token": (plan.replays - replays) / steps,
            "graph_error": plan.graph_error}


def _decode_eager(engine, steps: int) -> dict:
    """The same engine's decode with CUDA graphs off (PYIMP_CUDA_GRAPHS=0): eager launches."""
    from pyimp.cuda import device
    prev = os.environ.get("PYIMP_CUDA_GRAPHS")
    os.environ["PYIMP_CUDA_GRAPHS"] = "0"
    try:
        engine.eval([5])
        with device.counting() as c:
            t = time.perf_counter()
            for _ in range(steps):
                engine.eval([5])
            dt = time.perf_counter() - t
    finally:
        if prev is None:
            os.environ.pop("PYIMP_CUDA_GRAPHS", None)
        else:
            os.environ["PYIMP_CUDA_GRAPHS"] = prev
    return {"tok_s": steps / dt, "launches_per_token": c.launches / steps,
            "allocations_per_token": c.allocations / steps, "h2d_per_token": c.h2d / steps}


def _dense_vs_sparse(path: str, n: int, B: int, steps: int) -> dict:
    """Decode figures (:func:`_decode_rate`) at context n, dense and at a 1/8 block budget."""
    import pyimp
    row = {}
    for mode in ("dense", "sparse"):
        kw = {}
        if mode == "sparse":
            kw = dict(sparse=True, topk=max(1, n // B // 8 - 3), init_blocks=1, local_blocks=2)
        eng = pyimp.load(path, device="cuda", n_ctx=n + 2 * steps + 8, block_len=B, **kw)
        row[mode] = _decode_rate(eng, n, steps)
        if mode == "dense":
            row["dense_eager"] = _decode_eager(eng, steps)
        eng.close()
    return row


def decode(check: Check) -> dict:
    sh = _shapes(check.dry)
    path = _model(check, "gemma", "Q5_0", "Q8_0")
    B = sh["block_len"]
    res = {}
    for n in sh["contexts"]:
        if check.left() < 40 and not check.dry:
            res[str(n)] = "skipped: time budget"
            continue
        res[str(n)] = _dense_vs_sparse(path, n, B, sh["steps"])
    res["goal_tok_s_at_4k_ge"] = 300
    res["upkeep"] = upkeep(check, path)
    return res


def upkeep(check: Check, path: str) -> dict:
    """Per token: the importance update (decode with importance minus without, every layer) and
    the anchor upkeep (one block's anchors recomputed per sparse layer)."""
    import pyimp
    from pyimp.cuda import attention as CA
    from pyimp.cuda import device
    from pyimp.cuda import sparse as dsparse
    sh = _shapes(check.dry)
    n, B = sh["contexts"][0], sh["block_len"]
    eng = pyimp.load(path, device="cuda", n_ctx=n + 8, block_len=B, sparse=True,
                     topk=max(1, n // B // 8 - 3))
    _fill(eng, n)
    c, sp, cfg = eng.cache, eng.sparse, eng.cfg
    q = device.to_device(np.ones((1, cfg.n_head, cfg.head_dim), np.float32))
    out = device.empty((1, cfg.n_head, cfg.head_dim), np.float32)
    il = sp.sparse_layers[0]
    scr = CA.Scratch()
    with_imp = _timed(lambda: CA.decode(q, c.k_layer(il), c.v_layer(il), c.bt_dev, n, 0.1, 0, out,
                                        importance=sp.importance_dev[il], scratch=scr), sh["timed"])
    without = _timed(lambda: CA.decode(q, c.k_layer(il), c.v_layer(il), c.bt_dev, n, 0.1, 0, out,
                                       scratch=scr), sh["timed"])
    blocks = device.to_device(np.array([0], np.int32))
    nv = device.to_device(np.array([B], np.int32))
    anchor = _timed(lambda: dsparse.compute_anchors(sp.anchor_type, c.k_layer(il), blocks, nv,
                                                    sp.anchor_.storage(il), sp.importance_dev[il]),
                    sh["timed"])
    return {"importance_ms_per_token": max(0.0, with_imp - without) * 1e3 * cfg.n_layer,
            "anchor_ms_per_token": anchor * 1e3 * len(sp.anchor_.layers), "context": n}


def prefill(check: Check) -> dict:
    import pyimp
    from tools.write_synthetic_gguf import prompt_ids
    sh = _shapes(check.dry)
    path = _model(check, "gemma", "Q5_0", "Q8_0")
    eng = pyimp.load(path, device="cuda", n_ctx=sh["prompt"] + 8, block_len=sh["block_len"])
    ids = prompt_ids(sh["prompt"], n_vocab=sh["gemma"]["vocab_size"])
    eng.eval(ids[:8])
    eng.reset()
    t = time.perf_counter()
    eng.eval(ids)
    dt = time.perf_counter() - t
    return {"prompt_tokens": len(ids), "tok_s": len(ids) / dt,
            "attention": _prefill_attention(check)}


def _prefill_attention(check: Check) -> dict:
    """The prefill attention kernel over a whole long prompt (``long`` tokens, in chunks of
    512 rows as the engine feeds it), Gemma's and TinyLlama's head shapes, event-timed: query
    rows tiled to a work item (``attention.tile_rows``, each KV block read once for the tile)
    against one row a work item (the kernel before the tiling), the latter on the first
    ``short`` tokens only where the whole prompt would take too long."""
    from pyimp.cuda import attention as CA
    from pyimp.cuda import device
    sh = _shapes(check.dry)
    n, B = sh["long"], sh["block_len"]
    chunk = 8 if check.dry else 512
    short = min(n, 16 if check.dry else 4096)
    res = {"prompt_tokens": n, "chunk": chunk}
    for name, (Hq, Hkv, D) in (("gemma", (4, 1, 256 if not check.dry else 16)),
                               ("tinyllama", (32, 4, 64 if not check.dry else 16))):
        rng = np.random.default_rng(1)
        NB = -(-n // B)
        kc = device.to_device(rng.standard_normal((Hkv, NB, B * D)).astype(np.float16))
        vc = device.to_device(rng.standard_normal((Hkv, NB, D * B)).astype(np.float16))
        bt = device.to_device(np.arange(NB, dtype=np.int32))
        q = device.to_device(rng.standard_normal((chunk, Hq, D)).astype(np.float32))
        out = device.empty((chunk, Hq, D), np.float32)
        scr = CA.Scratch()

        def run(tokens, rows):
            for pos0 in range(0, tokens, chunk):
                CA.prefill(q, kc, vc, bt, pos0, 0.1, 0, out, scratch=scr, rows=rows)

        rt = CA.tile_rows(chunk, Hq // Hkv, D, B, CA.THREADS)
        tiled_short, _ = _device_timed(lambda: run(short, None), 1)   # compiles both
        rows1_short, _ = _device_timed(lambda: run(short, 1), 1)
        tiled, timer = _device_timed(lambda: run(n, None), 1, warm=False)
        res[name] = {"rows_per_item": rt, "seconds": tiled, "timer": timer,
                     "short_tokens": short, "short_seconds_tiled": tiled_short,
                     "short_seconds_one_row": rows1_short,
                     "tiling_speedup": rows1_short / tiled_short if tiled_short > 0 else None}
    return res


def tinyllama(check: Check) -> dict:
    sh = _shapes(check.dry)
    path = _model(check, "tinyllama", "Q4_0", "Q4_0")
    n, B = sh["long"], sh["block_len"]
    row = _dense_vs_sparse(path, n, B, sh["steps"])
    row["speedup"] = row["sparse"]["tok_s"] / row["dense"]["tok_s"]
    row["goal_speedup_ge"] = 2.0
    return {"context": n, **row}


# name: (step, seconds it needs left to start), in the default order; the kernel tests last,
# as they take whatever time is left
STEPS = {"agreement": (agreement, 40), "agreement_qkv": (agreement_qkv, 40),
         "launch_cost": (launch_cost, 10), "attention": (attention_kernel, 20),
         "decode": (decode, 40), "prefill": (prefill, 30), "tinyllama": (tinyllama, 40),
         "kernel_tests": (kernel_tests, 60)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for device_check.json and device_check.md")
    ap.add_argument("--dry", action="store_true", help="tiny shapes (for the simulator)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds after which the remaining long steps are skipped (default 225; "
                    "none with --dry, which exists to run every step)")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help="comma-separated steps to run, in this order (default: %(default)s)")
    a = ap.parse_args(argv)
    steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        what = f"unknown step {', '.join(unknown)}" if unknown else "no step given"
        ap.error(f"--steps: {what}; the steps are {', '.join(STEPS)}")
    if a.budget_s is None:
        a.budget_s = float("inf") if a.dry else 225.0
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    check = Check(a.out, a.dry, a.budget_s)
    if not check.step("require", require):     # written to the results too
        print(f"device_check: {check.data['steps']['require']['error']}", file=sys.stderr)
        return 1
    import numba
    if numba.config.ENABLE_CUDASIM:
        sys.setswitchinterval(1e-4)     # simulated barriers wait for every Python thread
    with tempfile.TemporaryDirectory() as tmp:
        check.tmp = tmp
        check.step("machine", machine)
        for name in steps:
            fn, need_s = STEPS[name]
            check.step(name, fn, need_s=need_s)
    failed = [k for k, v in check.data["steps"].items() if v["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    # a SIGTERM (a timeout's) ends the run through SystemExit, so the step it cut short is
    # written as interrupted
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main())
