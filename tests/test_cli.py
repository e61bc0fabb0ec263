"""pyimp-run: output on the default model, and one-line errors for user mistakes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pyimp.cli import main
from tools.write_synthetic_gguf import SynthSpec, write


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code, err, needle):
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and needle in lines[0], err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write(tmp_path_factory.mktemp("cli") / "tiny.gguf",
                 SynthSpec(arch="llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, vocab_size=300))


def test_json_on_default_model(capsys, gemma_path):
    code, out, err = _run(["-p", "The capital of France is", "-n", "6", "--temp", "0", "--json"], capsys)
    assert code == 0, err
    obj = json.loads(out)
    assert obj["prompt_tokens"][0] == 2 and len(obj["prompt_tokens"]) == 6  # <bos> + 5 pieces
    assert len(obj["tokens"]) == 6 and len(obj["logprobs"]) == 6
    assert all(lp <= 0.0 for lp in obj["logprobs"])
    assert isinstance(obj["text"], str) and obj["text"]
    assert obj["timings"]["decode_tokens"] == 5 and obj["timings"]["prefill_tokens"] == 6


def test_streaming_text_and_stats(capsys, tiny):
    code, out, err = _run([tiny, "-p", "abc", "-n", "5", "--seed", "1", "--stats"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("llama 'synthetic llama'")            # the model summary first
    assert lines[1].startswith("abc")                                 # then the prompt + continuation
    assert lines[-1].startswith("load ") and "decode 4 tok" in lines[-1]  # timings last


def test_help_compiles_nothing():
    r = subprocess.run([sys.executable, "-c",
                        "import sys; from pyimp.cli import main\n"
                        "try: main(['--help'])\n"
                        "except SystemExit: pass\n"
                        "print('numba' in sys.modules)"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("False")


@pytest.mark.parametrize("argv,needle", [
    (["--top-p", "2", "-p", "x"], "--top-p must be in [0.0, 1.0]"),
    (["-n", "abc", "-p", "x"], "--n-predict must be an integer"),
    (["--numerics", "fast", "-p", "x"], "invalid choice: 'fast'"),
    (["--kv-type", "q4", "-p", "x"], "invalid choice: 'q4'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["-c", "-5", "-p", "x"], "--ctx-size must be >= 0"),
])
def test_flag_errors(capsys, argv, needle):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    _one_line_error(ei.value.code, capsys.readouterr().err, needle)


def test_file_errors(capsys, tmp_path, tiny):
    code, _, err = _run(["/nonexistent/model.gguf", "-p", "x"], capsys)
    _one_line_error(code, err, "/nonexistent/model.gguf: no such file")
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("hello")
    code, _, err = _run([str(notgguf), "-p", "x"], capsys)
    _one_line_error(code, err, "not a GGUF file")
    code, _, err = _run([tiny, "-f", str(tmp_path / "missing.txt")], capsys)
    _one_line_error(code, err, "missing.txt")
    code, _, err = _run([tiny, "-p", "abc " * 200, "-c", "16"], capsys)
    _one_line_error(code, err, "more than the context size 16")


def test_unsupported_architecture(capsys, tmp_path):
    import gguf
    p = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(p), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    code, _, err = _run([str(p), "-p", "x"], capsys)
    _one_line_error(code, err, "unsupported architecture 'bert'")


def test_console_script_runs(tiny):
    exe = os.path.join(os.path.dirname(sys.executable), "pyimp-run")
    if not os.path.exists(exe):
        pytest.skip("console script not installed (pip install -e .)")
    r = subprocess.run([exe, tiny, "-p", "ab", "-n", "2", "--temp", "0"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([exe, tiny + ".missing", "-p", "ab"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "no such file" in r.stderr
