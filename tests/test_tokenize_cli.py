"""pyimp-tokenize as llama-tokenize users expect: default model, -m, special tokens parsed by default."""
from __future__ import annotations

import pytest

from pyimp.cli.tokenize import main


def test_default_model_and_model_flag(gemma_path, capsys):
    assert main(["-p", "Hello world", "--ids"]) == 0          # no model given: the default one
    assert capsys.readouterr().out == "[2, 9259, 1902]\n"
    assert main(["-m", gemma_path, "-p", "Hello world", "--ids"]) == 0
    assert capsys.readouterr().out == "[2, 9259, 1902]\n"
    with pytest.raises(SystemExit) as e:
        main(["-m", gemma_path, gemma_path + ".other", "-p", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "two models given" in err


def test_special_tokens_parsed_by_default(gemma_path, capsys):
    assert main([gemma_path, "-p", "<start_of_turn>user", "--ids", "--no-bos"]) == 0
    assert capsys.readouterr().out == "[105, 2364]\n"             # <start_of_turn> user
    assert main([gemma_path, "-p", "<start_of_turn>user", "--ids", "--no-bos", "--no-parse-special"]) == 0
    plain = capsys.readouterr().out
    assert "105" not in plain and plain.count(",") >= 3          # the markup spelled out in pieces
    assert main([gemma_path, "-p", "<start_of_turn>user", "--ids", "--no-bos", "--parse-special"]) == 0
    assert capsys.readouterr().out == "[105, 2364]\n"             # the old flag still works


def test_input_beyond_the_limit_is_one_error(gemma_path, capsys, monkeypatch, tmp_path):
    """-f and --stdin read at most MAX_PROMPT_BYTES + 1 bytes: an endless input (/dev/zero)
    is one line naming it and the limit."""
    import io

    import pyimp.cli.common as cli_common
    monkeypatch.setattr(cli_common, "MAX_PROMPT_BYTES", 1024)
    with pytest.raises(SystemExit) as e:
        main([gemma_path, "-f", "/dev/zero", "--ids"])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and out == "" and err.count("\n") == 1, err
    assert "/dev/zero: more than the 1.0 KiB" in err and "Traceback" not in err
    with open("/dev/zero", "rb") as zero:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(zero))
        with pytest.raises(SystemExit) as e:
            main([gemma_path, "--stdin", "--ids"])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and out == "" and err.count("\n") == 1, err
    assert "standard input: more than the 1.0 KiB" in err
    f = tmp_path / "t.txt"
    f.write_bytes(b"Hello world" + b" " * 1013)            # exactly the limit
    assert main([gemma_path, "-f", str(f), "--ids"]) == 0
