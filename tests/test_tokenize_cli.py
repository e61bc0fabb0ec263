"""pyimp-tokenize as llama-tokenize users expect: default model, -m, special tokens parsed by default."""
from __future__ import annotations

import pytest

from pyimp.tokenize_cli import main


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
