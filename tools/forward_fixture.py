"""Logits of the forward pass under each configuration the engine runs, as a regression fixture:
a change to the engine's structure must leave them bit for bit as they were.

Two small synthetic models (a llama with grouped queries, a gemma3 with q/k norms, sliding-window
layers and a soft cap), a 200-token prompt and 6 greedy decode steps per configuration: fp32
and ggml numerics, block-sparse decode (quest and cuboid_mean anchors, top-k and recall-target
selection), a q8_0/q4_0 cache with rotation, an eviction policy, and the device path (run under
the numba-cuda simulator). The fixture records the machine signature it was written on: the
same kernels on another instruction set or BLAS may round differently.

    python -m tools.forward_fixture write tests/fixtures/forward_logits.npz
    python -m tools.forward_fixture write-device tests/fixtures/forward_logits_device.npz
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

import numpy as np

N_PROMPT, N_DECODE, N_CTX = 200, 6, 512

MODELS = {
    "llama": dict(arch="llama", n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                  vocab_size=300, weight_type="Q8_0", seed=41),
    "gemma3": dict(arch="gemma3", n_layer=2, n_embd=128, n_head=4, n_head_kv=1, head_dim=32,
                   n_ff=256, vocab_size=300, sliding_window=48, swa_pattern=2,
                   final_softcap=30.0, weight_type="Q5_0", embd_type="Q8_0", seed=42),
    # the device configurations' model: the simulator runs each kernel thread in Python
    "llama-small": dict(arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128,
                        vocab_size=260, weight_type="Q8_0", seed=43),
}

# name -> (model, engine options)
CONFIGS = {
    "llama-fp32": ("llama", dict(block_len=16)),
    "llama-ggml": ("llama", dict(block_len=16, numerics="ggml")),
    "gemma3-fp32": ("gemma3", dict(block_len=16)),
    "gemma3-ggml": ("gemma3", dict(block_len=16, numerics="ggml")),
    "sparse-quest-topk": ("llama", dict(block_len=16, sparse=True, anchor="quest", topk=2)),
    "sparse-cuboid-topk": ("llama", dict(block_len=16, sparse=True, anchor="cuboid_mean",
                                         topk=2)),
    "sparse-quest-recall": ("llama", dict(block_len=16, sparse=True, anchor="quest",
                                          recall_target=0.9)),
    "gemma3-sparse": ("gemma3", dict(block_len=16, sparse=True, topk=2)),
    "q8_0-q4_0-rot": ("llama", dict(block_len=32, cache_type_k="q8_0", cache_type_v="q4_0",
                                    kv_rotate=True)),
    "h2o": ("gemma3", dict(block_len=16, kv_policy="h2o", kv_budget=96, kv_recent=16)),
}

# the device path under the simulator, where every kernel thread runs in Python: a smaller
# model, a shorter prompt, blocks of 4
# (block-sparse decode: its prefill and first layer's decode are dense)
DEVICE_CONFIGS = {
    "llama-cuda-sparse": ("llama-small", dict(block_len=4, device="cuda", sparse=True, topk=1,
                                              dense_layers=(0,))),
}
DEVICE_PROMPT, DEVICE_DECODE = 13, 2


def machine_signature() -> str:
    """What the fixture's bits depend on besides the code: the CPU features Numba compiles for
    and NumPy's BLAS (the fp32 prefill's products)."""
    from loaders import jit
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    except Exception:                       # noqa: BLE001 (older NumPy: no dict mode)
        blas = "unknown"
    return f"{platform.machine()} {','.join(sorted(jit.target_features()))} blas={blas}"


# On another machine the same kernels take other SIMD paths (the quantized matvecs' AVX2 or
# AVX-512 steps) and another BLAS: float32 rounding in another order, 2 layers deep. 1e-4 of the
# logit scale is a few hundred times float32's epsilon; a wrong head, block or position moves
# logits by a sizeable fraction of the scale.
OTHER_MACHINE_RTOL = 1e-4


def assert_matches(saved: np.ndarray, got: np.ndarray, signature: str) -> None:
    """AssertionError unless ``got`` is ``saved``: bit for bit on the machine signature the
    fixture was written on, within OTHER_MACHINE_RTOL of the logit scale elsewhere."""
    if signature == machine_signature():
        assert np.array_equal(got, saved), \
            f"largest difference by step: {np.abs(got - saved).max(axis=1)}"
    else:
        np.testing.assert_allclose(got, saved, rtol=0,
                                   atol=OTHER_MACHINE_RTOL * np.abs(saved).max())


def write_models(directory: str, names=tuple(MODELS)) -> dict:
    from tools.write_synthetic_gguf import SynthSpec, write
    return {name: write(os.path.join(directory, f"{name}.gguf"), SynthSpec(**MODELS[name]))
            for name in names}


def models_of(configs: dict) -> tuple:
    return tuple(sorted({model for model, _ in configs.values()}))


def run(path: str, options: dict, n_prompt: int = N_PROMPT, n_decode: int = N_DECODE,
        n_vocab: int = 300) -> np.ndarray:
    """float32 [n_decode + 1, V]: the prompt's last row, then each greedy decode step's."""
    import pyimp
    from tools.write_synthetic_gguf import prompt_ids
    eng = pyimp.load(path, n_ctx=N_CTX, batch_size=64, **options)
    try:
        rows = [eng.eval(prompt_ids(n_prompt, seed=7, n_vocab=n_vocab))[-1]]
        for _ in range(n_decode):
            rows.append(eng.eval([int(np.argmax(rows[-1]))])[-1])
    finally:
        eng.close()
    return np.array(rows, np.float32)


def compute(configs: dict, models: dict, **kw) -> dict:
    return {name: run(models[model], opts, n_vocab=MODELS[model]["vocab_size"], **kw)
            for name, (model, opts) in configs.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["write", "write-device"])
    ap.add_argument("out")
    a = ap.parse_args(argv)
    if a.what == "write-device" and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        print("write-device runs on the simulator: set NUMBA_ENABLE_CUDASIM=1", file=sys.stderr)
        return 2
    folder = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        print(f"{a.out}: the folder {folder} does not exist or is not writable", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        if a.what == "write":
            out = compute(CONFIGS, write_models(d, models_of(CONFIGS)))
        else:
            out = compute(DEVICE_CONFIGS, write_models(d, models_of(DEVICE_CONFIGS)),
                          n_prompt=DEVICE_PROMPT, n_decode=DEVICE_DECODE)
    np.savez_compressed(a.out, signature=np.array(machine_signature()), **out)
    print(f"{a.out}: {', '.join(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
