"""The synthetic writer's "q4_k_m" type mix against the default model's own file: the
Gemma-shaped model that tools.device_check writes for the GPU-vs-CPU agreement has, tensor by
tensor, the weight types the real Gemma 3 270M Q4_K_M file has."""
import collections

import pytest

from loaders.ggml_types import QT
from loaders.gguf_file import GGUFFile
from tools.write_synthetic_gguf import PRESETS, SynthSpec, mix_type, write


def _types(path) -> dict:
    """tensor name -> ggml type name, for every 2-D weight."""
    f = GGUFFile(path)
    ts = f.tensors.values() if hasattr(f.tensors, "values") else f.tensors
    return {t.name: QT(int(t.qtype)).name for t in ts if len(t.shape) == 2}


def test_q4_k_m_mix_is_the_default_models(gemma_path):
    real = _types(gemma_path)
    p = PRESETS["gemma3-270m"]
    E, Hq, D, F = p["n_embd"], p["n_head"], p["head_dim"], p["n_ff"]
    n_in = {"attn_q": E, "attn_k": E, "attn_v": E, "attn_output": Hq * D, "ffn_gate": E,
            "ffn_up": E, "ffn_down": F}
    got = {f"blk.{il}.{name}.weight": mix_type("q4_k_m", name, il, p["n_layer"], n, QT.F32).name
           for il in range(p["n_layer"]) for name, n in n_in.items()}
    want = {k: v for k, v in real.items() if k.startswith("blk.")}
    assert got == want
    # the mix has every type the file has (the device path decodes each of them)
    assert set(collections.Counter(got.values())) == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}


def test_mix_written_and_refused(tmp_path):
    """A small model takes the mix where its rows allow K blocks; an unknown mix is named."""
    path = write(tmp_path / "m.gguf", SynthSpec(arch="llama", n_layer=8, n_embd=256, n_head=4,
                                                n_head_kv=2, n_ff=512, vocab_size=260,
                                                random_blocks=True, type_mix="q4_k_m"))
    types = _types(path)
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.2.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_v.weight"] == "Q8_0" and types["blk.2.attn_v.weight"] == "Q5_0"
    assert types["blk.3.attn_output.weight"] == "Q4_K"
    with pytest.raises(ValueError, match="type_mix 'q9'"):
        write(tmp_path / "x.gguf", SynthSpec(type_mix="q9"))
