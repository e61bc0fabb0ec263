"""pyimp-run: output on the default model, and one-line errors for user mistakes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyimp.cli.run import main
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
    # stdout holds only the prompt and its continuation (as llama-cli: `> out.txt` is the text)
    assert out.startswith("abc") and out.count("\n") == 1
    lines = [ln for ln in err.splitlines() if "warning: context size 4096" not in ln]  # tiny: 2048
    assert lines[0].startswith("llama 'synthetic llama'") and "KV cache" in lines[0]  # summary first
    assert lines[-1].startswith("load ") and "decode 4 tok" in lines[-1]               # timings last


def test_compile_notice_only_when_the_warmup_is_slow(capsys, tiny, monkeypatch):
    """A first run compiles for ~20 s: pyimp-run says so on stderr once the warmup outlasts
    COMPILE_NOTICE_S (here a warmup that compiles a kernel made 0.5 s slower, notice after
    0.05 s), and says nothing when the kernels come from the cache quickly."""
    import time

    import numba

    import pyimp.cli.run as cli
    from pyimp.engine import Engine
    fast = Engine.warmup

    def slow(self, **kw):
        numba.njit(lambda x: x + 1)(1)          # a kernel that is not in any cache: compiles
        time.sleep(0.5)
        return fast(self, **kw)

    monkeypatch.setattr(Engine, "warmup", slow)
    monkeypatch.setattr(cli, "COMPILE_NOTICE_S", 0.05)
    code, out, err = _run([tiny, "-p", "abc", "-n", "2", "--temp", "0"], capsys)
    assert code == 0, err
    assert "compiling kernels" in err and "kernels ready after" in err and out.startswith("abc")
    monkeypatch.setattr(Engine, "warmup", fast)
    monkeypatch.setattr(cli, "COMPILE_NOTICE_S", 60.0)
    code, out, err = _run([tiny, "-p", "abc", "-n", "2", "--temp", "0"], capsys)
    assert code == 0 and "compiling" not in err and "kernels ready" not in err


def test_help_compiles_nothing():
    r = subprocess.run([sys.executable, "-c",
                        "import sys; from pyimp.cli.run import main\n"
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
    (["--kv-depth-ratio", "0.5", "-p", "x"], "--kv-depth-ratio must be a finite number >= 1.0"),
    (["--kv-depth-ratio", "inf", "-p", "x"], "--kv-depth-ratio must be a finite number >= 1.0"),
    (["--kv-depth-ratio", "x", "-p", "x"], "--kv-depth-ratio must be a number"),
    (["--kv-obs-weight", "-1", "-p", "x"], "--kv-obs-weight must be a finite number >= 0.0"),
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


def test_entry_point_sets_the_thread_pool_spin(monkeypatch):
    from pyimp.runtime.process import SPIN_COUNT
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["GOMP_SPINCOUNT"] == SPIN_COUNT and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")    # the user's setting wins
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["OMP_WAIT_POLICY"] == "passive" and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "100")         # so does a spin count of their own
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["GOMP_SPINCOUNT"] == "100" and "OMP_WAIT_POLICY" not in os.environ


def test_entry_point_sets_the_blas_thread_timeout(monkeypatch):
    """pyimp's programs let OpenBLAS's workers sleep right after a call (they would hold a
    core through the next decode step); a timeout the user set is kept."""
    from pyimp.runtime.process import BLAS_THREAD_TIMEOUT
    for var in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["OPENBLAS_THREAD_TIMEOUT"] == BLAS_THREAD_TIMEOUT
    monkeypatch.setenv("OPENBLAS_THREAD_TIMEOUT", "20")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert os.environ["OPENBLAS_THREAD_TIMEOUT"] == "20"
    monkeypatch.delenv("OPENBLAS_THREAD_TIMEOUT")
    monkeypatch.setenv("GOTO_THREAD_TIMEOUT", "20")     # OpenBLAS's other name for it
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "OPENBLAS_THREAD_TIMEOUT" not in os.environ


def test_help_shows_defaults_and_version(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())       # unwrap argparse's line breaks
    assert ei.value.code == 0
    for needle in ("--temp TEMP temperature (0 = greedy) (default: 0.8)", "(default: 4096)",
                   "--topk TOPK blocks picked by score (default: 8)", "-m MODEL, --model MODEL",
                   "-r STRING, --reverse-prompt STRING, --stop STRING", "--parse-special"):
        assert needle in out
    assert "(default: None)" not in out and "(default: False)" not in out
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    import pyimp
    assert ei.value.code == 0 and capsys.readouterr().out.strip() == f"pyimp-run {pyimp.__version__}"


def test_model_flag(capsys, tiny):
    code, out, err = _run(["-m", tiny, "-p", "abc", "-n", "2", "--temp", "0", "--json"], capsys)
    assert code == 0, err
    code, out2, err = _run([tiny, "-p", "abc", "-n", "2", "--temp", "0", "--json"], capsys)
    assert json.loads(out)["tokens"] == json.loads(out2)["tokens"]
    code, _, err = _run(["-m", tiny, tiny + ".other", "-p", "abc"], capsys)
    _one_line_error(code, err, "two models given")


def test_stop_strings(capsys, gemma_path):
    base = ["-p", "The capital of France is", "-n", "12", "--temp", "0", "--json"]
    code, out, err = _run(base, capsys)
    full = json.loads(out)
    assert full["finish_reason"] == "length" and len(full["tokens"]) == 12
    text = full["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]    # three characters from the middle
    for flag in ("-r", "--stop"):
        code, out, err = _run(base + [flag, stop], capsys)
        obj = json.loads(out)
        assert code == 0 and obj["finish_reason"] == "stop", (stop, obj["text"])
        assert stop in obj["text"] and text.startswith(obj["text"])   # the same text, cut short
        assert len(obj["tokens"]) < 12
    # it stopped at the first token that completed the string: one token less lacks it
    n = len(obj["tokens"]) - 1
    code, out, err = _run(base[:2] + ["-n", str(n)] + base[4:], capsys)
    assert stop not in json.loads(out)["text"]


def test_empty_stop_string_is_refused(capsys, tiny):
    # "" is in every text: it would end generation after one token without saying why
    with pytest.raises(SystemExit) as ei:      # an argparse usage error, as for other bad flags
        main([tiny, "-p", "abc", "-r", ""])
    out, err = capsys.readouterr()
    assert ei.value.code == 2 and out == ""
    assert "an empty string would stop at once" in err and "Traceback" not in err


def test_parse_special(capsys, gemma_path):
    prompt = "<start_of_turn>user"
    code, out, _ = _run(["-p", prompt, "-n", "1", "--temp", "0", "--json"], capsys)
    plain = json.loads(out)["prompt_tokens"]
    code, out, _ = _run(["-p", prompt, "-n", "1", "--temp", "0", "--json", "--parse-special"], capsys)
    parsed = json.loads(out)["prompt_tokens"]
    assert parsed == [2, 105, 2364]                   # <bos> <start_of_turn> user
    assert len(plain) > 3 and 105 not in plain


def test_end_of_generation_token_is_not_printed(capsys, monkeypatch, gemma_path):
    from pyimp.engine import Engine

    def fake_generate(self, ids, **kw):
        self.eval(ids)
        yield 9259, -0.5                               # a word
        yield 1, -0.1                                  # <eos>
    monkeypatch.setattr(Engine, "generate", fake_generate)
    code, out, err = _run(["-p", "Hi", "-n", "5"], capsys)
    assert code == 0, err
    assert "<eos>" not in out and out.startswith("Hi") and len(out) > 3
    code, out, err = _run(["-p", "Hi", "-n", "5", "--json"], capsys)
    obj = json.loads(out)
    assert obj["tokens"] == [9259, 1] and "<eos>" not in obj["text"] and obj["finish_reason"] == "stop"
    code, out, err = _run(["-p", "Hi", "-n", "5", "--special"], capsys)
    assert out.rstrip("\n").endswith("<eos>")


def test_report_without_sparse_claims_no_sparse_layers(capsys, tiny):
    code, out, err = _run([tiny, "-p", "abc", "-n", "3", "--report"], capsys)
    assert code == 0, err
    assert "sparse layers" not in err and "--sparse is off" in err and "report" not in out


def test_heatmap_is_checked_before_the_run(capsys, tiny, tmp_path, monkeypatch):
    code, out, err = _run([tiny, "-p", "abc", "--heatmap", str(tmp_path / "no" / "h.png")], capsys)
    _one_line_error(code, err, "does not exist")
    assert out == ""                                   # refused before loading or generating
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import fails
    code, out, err = _run([tiny, "-p", "abc", "--heatmap", str(tmp_path / "h.png")], capsys)
    _one_line_error(code, err, "--heatmap needs matplotlib")
    assert out == ""


def test_memory_is_checked_before_allocating(capsys, tiny, monkeypatch):
    monkeypatch.setenv("PYIMP_MEMORY_LIMIT", "256M")
    code, out, err = _run([tiny, "-p", "abc", "-c", "10000000"], capsys)
    _one_line_error(code, err, "context 10000000")
    assert "more than the 256.0 MiB of memory available" in err
    # K/V of 3M tokens: 183 MiB, fits; with DYNAMIC anchors (32 slots per query head) it does not
    code, out, err = _run([tiny, "-p", "abc", "-c", "3000000", "--sparse", "--anchor", "dynamic",
                           "--anchor-num", "32"], capsys)
    _one_line_error(code, err, "importance and anchors")
    monkeypatch.setenv("PYIMP_MEMORY_LIMIT", "4M")      # one 4096-token block of tiny's K/V: 256 KiB
    code, out, err = _run([tiny, "-p", "abc", "-c", "100000", "--block-len", "4096"], capsys)
    _one_line_error(code, err, "block length 4096")


def test_block_length_and_anchor_count_limits(capsys, tiny):
    # a block longer than any paged cache uses, or more anchor slots than a block has tokens,
    # is a mistake, refused before anything is allocated
    code, out, err = _run([tiny, "-p", "abc", "--block-len", "100000"], capsys)
    _one_line_error(code, err, "block length must be in 1..4096, got 100000")
    code, out, err = _run([tiny, "-p", "abc", "--sparse", "--anchor-num", "100000"], capsys)
    _one_line_error(code, err, "anchor count 100000 exceeds the block length 32")


def test_context_beyond_training_warns(capsys, tiny):
    code, out, err = _run([tiny, "-p", "abc", "-n", "1", "-c", "4096"], capsys)
    assert code == 0
    assert "pyimp-run: warning: context size 4096 exceeds the model's training context 2048" in err
    assert "Warning" not in err


def test_invalid_utf8_prompt_under_strict_stdout(tmp_path, tiny):
    f = tmp_path / "p.txt"
    f.write_bytes(b"ab\xff\xfe cd")
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
    r = subprocess.run([sys.executable, "-m", "pyimp.cli.run", tiny, "-f", str(f), "-n", "2", "--temp", "0"],
                       capture_output=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.startswith(b"ab\xff\xfe cd")        # the prompt's bytes echoed as they came


def test_first_ctrl_c_makes_the_second_one_final(monkeypatch, capsys):
    import signal

    from pyimp.cli import run as cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "run", interrupted)
    prev = signal.getsignal(signal.SIGINT)
    try:
        assert main(["-p", "x"]) == 130
        # a second Ctrl-C during the interpreter's shutdown ends the process silently
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, prev)
    assert capsys.readouterr().err.strip() == "pyimp-run: interrupted"


def test_non_finite_weights_are_one_error(capsys, tmp_path, tiny):
    from loaders.gguf_file import GGUFFile
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(Path(tiny).read_bytes())
    with GGUFFile(tiny) as f:
        info = f.tensors["blk.0.ffn_down.weight"]
        assert info.type_name == "F32"
        off, n = info.offset, info.nbytes
    with open(bad, "r+b") as fh:
        fh.seek(off)
        fh.write(np.full(n // 4, np.nan, np.float32).tobytes())
    code, out, err = _run([str(bad), "-p", "abc", "-n", "3", "-c", "64"], capsys)
    # the summary line, then one error line (tiny has one layer: its FFN feeds the logits)
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 2, err
    assert err.strip().splitlines()[-1].startswith("pyimp-run: error: layer 0: NaN or inf in the logits")
    assert out == ""


def test_kv_policy_flags(capsys, tiny):
    """--kv-policy with a budget runs and reports what it held and evicted; a policy without a
    budget, or a budget too small for the sinks and the window, is one error line."""
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    code, out, err = _run([tiny, "-c", "256", "--block-len", "8", "-p", prompt, "-n", "8",
                           "--temp", "0", "--json", "--kv-policy", "h2o", "--kv-budget", "40"],
                          capsys)
    assert code == 0, err
    t = json.loads(out)["timings"]
    assert t["kv_evicted"] > 0 and 0 < t["kv_bytes_held"]
    code, out, err = _run([tiny, "-c", "256", "-p", "ab", "--kv-policy", "streaming"], capsys)
    _one_line_error(code, err, "needs a budget (--kv-budget")
    code, out, err = _run([tiny, "-c", "256", "-p", "ab", "--kv-policy", "h2o", "--kv-budget", "20"],
                          capsys)
    _one_line_error(code, err, "kv budget")
    code, out, err = _run([tiny, "-c", "256", "-p", "ab", "--kv-policy", "pyramidkv",
                           "--kv-budget", "64", "--kv-depth-ratio", "2"], capsys)
    _one_line_error(code, err, "own depth schedule")
    code, out, err = _run([tiny, "-c", "256", "-p", "ab", "--kv-policy", "snapkv",
                           "--kv-budget", "64", "--kv-obs-weight", "1"], capsys)
    _one_line_error(code, err, "applies to h2o")
    code, out, err = _run([tiny, "-c", "256", "--block-len", "8", "-p", "abcdefgh" * 8, "-n", "4",
                           "--temp", "0", "--json", "--kv-policy", "h2o", "--kv-budget", "40",
                           "--kv-obs-weight", "1", "--kv-obs-window", "8"], capsys)
    assert code == 0, err
    assert json.loads(out)["timings"]["kv_evicted"] > 0


def test_kv_policy_stats_line(capsys, tiny):
    code, out, err = _run([tiny, "-c", "256", "--block-len", "8", "-p", "abcdefgh" * 8, "-n", "4",
                           "--temp", "0", "--stats", "--kv-policy", "streaming", "--kv-budget",
                           "24", "--kv-recent", "8", "--kv-depth-ratio", "1.5"], capsys)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert lines[-2].startswith("kv cache: ") and "evicted by --kv-policy streaming" in lines[-2]
    assert lines[-1].startswith("load ")


@pytest.mark.parametrize("var,value,needle", [
    ("NUMBA_DISABLE_JIT", "1", "NUMBA_DISABLE_JIT=1 is set"),
    ("NUMBA_THREADING_LAYER", "bogus", "NUMBA_THREADING_LAYER=bogus: Numba cannot start"),
    ("NUMBA_NUM_THREADS", "0", "NUMBA_NUM_THREADS=0: Numba needs at least 1 thread"),
])
def test_numba_settings_that_cannot_run_are_one_error(tiny, var, value, needle):
    """Numba settings under which pyimp's kernels cannot run: one line naming the variable,
    not a traceback (from the first kernel: NUMBA_DISABLE_JIT, whose pure-Python mode has no
    form for the kernels' LLVM intrinsics, and a threading layer Numba cannot load; from
    ``import numba`` itself: NUMBA_NUM_THREADS below 1)."""
    env = dict(os.environ, **{var: value})
    r = subprocess.run([sys.executable, "-m", "pyimp.cli.run", str(tiny), "-p", "abc", "-n", "2"],
                       capture_output=True, text=True, env=env, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _one_line_error(r.returncode, r.stderr, needle)
    assert r.stdout == ""


def test_prompt_file_beyond_the_limit_is_one_error(capsys, tiny, tmp_path, monkeypatch):
    """-f reads at most MAX_PROMPT_BYTES + 1 bytes: /dev/zero (endless) and a regular file over
    the limit are one line naming the file and the limit, before the model is loaded."""
    import pyimp.cli.common as cli_common
    monkeypatch.setattr(cli_common, "MAX_PROMPT_BYTES", 1024)
    code, out, err = _run([tiny, "-f", "/dev/zero"], capsys)
    _one_line_error(code, err, "prompt file /dev/zero: more than the 1.0 KiB")
    assert code == 1 and out == ""
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * 1025)
    code, out, err = _run([tiny, "-f", str(big)], capsys)
    _one_line_error(code, err, f"prompt file {big}: more than the 1.0 KiB")
    assert out == ""
    ok = tmp_path / "ok.txt"
    ok.write_bytes(b"ab\r\ncd" + b"e" * 1018)            # exactly the limit: read as text
    code, out, err = _run([tiny, "-f", str(ok), "-n", "1", "--temp", "0", "--json"], capsys)
    assert code == 0, err
    assert cli_common.MAX_PROMPT_BYTES == 1024
    monkeypatch.undo()
    assert cli_common.MAX_PROMPT_BYTES == 64 << 20         # the documented limit


def test_prompt_file_keeps_its_newlines_translated(tmp_path):
    import argparse

    from pyimp.cli.run import read_prompt
    f = tmp_path / "p.txt"
    f.write_bytes(b"a\r\nb\rc\n\xff")
    assert read_prompt(argparse.Namespace(file=str(f), prompt=None)) == "a\nb\nc\n\udcff"


def test_compile_notice_only_when_something_compiles(capsys, tiny, monkeypatch):
    """A warmup that outlasts COMPILE_NOTICE_S while every kernel comes from the cache (a slow
    disk, a busy machine) compiles nothing: no notice."""
    import time

    import pyimp.cli.run as cli
    from pyimp.engine import Engine, EngineOptions
    fast = Engine.warmup
    fast(Engine(tiny, EngineOptions(n_ctx=256)))        # every kernel tiny needs is loaded now

    def slow(self, **kw):
        time.sleep(0.5)
        return fast(self, **kw)
    monkeypatch.setattr(Engine, "warmup", slow)
    monkeypatch.setattr(cli, "COMPILE_NOTICE_S", 0.05)
    code, out, err = _run([tiny, "-p", "abc", "-n", "2", "--temp", "0", "-c", "256"], capsys)
    assert code == 0, err
    assert "compiling" not in err and "kernels ready" not in err and out.startswith("abc")


@pytest.mark.parametrize("argv, needle", [
    (["--kv-budget", "64"], "--kv-budget 64: --kv-policy full keeps every token"),
    (["--topk", "4"], "--topk applies to --sparse"),
    (["--recall-target", "0.9"], "--recall-target applies to --sparse"),
    (["--recall-target", "0"], "--recall-target applies to --sparse"),
    (["--prompt-cache-ro"], "--prompt-cache-ro applies to --prompt-cache"),
])
def test_flags_that_would_be_ignored_are_usage_errors(capsys, tiny, monkeypatch, argv, needle):
    import pyimp.cli.run as cli
    ran = []
    monkeypatch.setattr(cli, "run", lambda args: ran.append(args) or 0)
    with pytest.raises(SystemExit) as ei:
        main([tiny, "-p", "x"] + argv)
    out, err = capsys.readouterr()
    assert ei.value.code == 2 and out == "" and not ran
    _one_line_error(ei.value.code, err, needle)
    assert err.startswith("pyimp-run: error: ")


@pytest.mark.parametrize("argv", [
    ["--kv-budget", "64", "--kv-policy", "h2o"], ["--kv-budget", "0"], ["--topk", "4", "--sparse"],
    ["--recall-target", "0.9", "--sparse"], ["--prompt-cache-ro", "--prompt-cache", "x.pkv"],
])
def test_flags_that_apply_are_accepted(tiny, monkeypatch, argv):
    import pyimp.cli.run as cli
    ran = []
    monkeypatch.setattr(cli, "run", lambda args: ran.append(args) or 0)
    assert main([tiny, "-p", "x"] + argv) == 0 and len(ran) == 1


def test_prompt_cache_is_checked_before_the_kernels_compile(capsys, tiny, tmp_path, monkeypatch):
    from pyimp.engine import Engine
    pc = str(tmp_path / "pc.pkv")
    base = [tiny, "-p", "abcdefgh", "-n", "2", "--temp", "0", "-c", "128", "--json",
            "--prompt-cache", pc]
    code, out, err = _run(base + ["-ctk", "f32"], capsys)
    assert code == 0 and os.path.exists(pc), err
    warmups = []
    real = Engine.warmup
    monkeypatch.setattr(Engine, "warmup", lambda self, **kw: warmups.append(1) or real(self, **kw))
    code, out, err = _run(base + ["-ctk", "f16"], capsys)
    _one_line_error(code, err, "type_k")
    assert code == 1 and pc in err and out == "" and warmups == []


def _unwritable_dir(tmp_path):
    """A folder where no file can be created: one without write permission, or for root (whom
    permissions do not stop) /sys, where the kernel refuses new files."""
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    for folder in (d, Path("/sys")):
        probe = folder / "pyimp-probe"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError:
            return folder
        os.unlink(probe)
    d.chmod(0o755)
    pytest.skip("no folder here refuses new files")


def test_prompt_cache_in_an_unwritable_folder_is_refused_before_loading(capsys, tiny, tmp_path,
                                                                       monkeypatch):
    from pyimp.engine import Engine
    d = _unwritable_dir(tmp_path)
    pc = d / "pc.pkv"
    generated = []
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate",
                        lambda self, *a, **kw: generated.append(1) or real(self, *a, **kw))
    try:
        code, out, err = _run([tiny, "-p", "abc", "-n", "2", "-c", "256", "--prompt-cache",
                               str(pc)], capsys)
    finally:
        if d != Path("/sys"):
            d.chmod(0o755)
    _one_line_error(code, err, f"prompt cache {pc}: cannot create a file in {d}")
    assert code == 1 and out == "" and generated == [] and not pc.exists()


def test_a_failed_prompt_cache_save_still_prints_the_output(capsys, tiny, tmp_path, monkeypatch):
    import errno

    from pyimp.engine import Engine

    def full(self, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(Engine, "save_state", full)
    pc = tmp_path / "pc.pkv"
    base = [tiny, "-p", "abc", "-n", "3", "--temp", "0", "-c", "256", "--prompt-cache", str(pc)]
    code, out, err = _run(base + ["--json"], capsys)
    _one_line_error(code, err, f"cannot write prompt cache {pc}: No space left on device")
    assert code == 1 and len(json.loads(out)["tokens"]) == 3
    code, out, err = _run(base, capsys)
    assert code == 1 and out.startswith("abc") and out.endswith("\n")
    assert err.strip().splitlines()[-1].startswith(f"pyimp-run: error: cannot write prompt cache")
    assert os.listdir(tmp_path) == []


def test_heatmap_format_is_checked_before_the_run(capsys, tiny, tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as ei:
        main([tiny, "-p", "abc", "-n", "2", "--heatmap", str(tmp_path / "out.xyz")])
    out, err = capsys.readouterr()
    _one_line_error(ei.value.code, err, f"--heatmap {tmp_path / 'out.xyz'}: matplotlib cannot "
                                        f"write '.xyz' files")
    assert ei.value.code == 2 and out == "" and "png" in err and os.listdir(tmp_path) == []


def test_heatmap_without_extension_is_a_png_at_that_path(capsys, tiny, tmp_path):
    pytest.importorskip("matplotlib")
    code, out, err = _run([tiny, "-p", "abc", "-n", "2", "-c", "256", "--heatmap",
                           str(tmp_path / "map"), "--json"], capsys)
    assert code == 0, err
    assert os.listdir(tmp_path) == ["map"]
    assert (tmp_path / "map").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = _run([tiny, "-p", "abc", "-n", "2", "-c", "256", "--heatmap",
                           str(tmp_path / "map.SVG"), "--json"], capsys)
    assert code == 0, err
    assert b"<svg" in (tmp_path / "map.SVG").read_bytes()[:2000]


def test_a_failed_heatmap_still_prints_the_json(capsys, tiny, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from pyimp.cli import plotting

    def broken(state, path, n_ctx):
        raise RuntimeError("the renderer failed")
    monkeypatch.setattr(plotting, "sparse_heatmap", broken)
    code, out, err = _run([tiny, "-p", "abc", "-n", "2", "-c", "256", "--heatmap",
                           str(tmp_path / "h.png"), "--json"], capsys)
    _one_line_error(code, err, f"cannot write heatmap {tmp_path / 'h.png'}: the renderer failed")
    assert code == 1 and len(json.loads(out)["tokens"]) == 2 and os.listdir(tmp_path) == []
