"""The forward pass against logits saved before the engine's restructuring
(tools/forward_fixture.py): on the machine signature the fixture was written on, bit for bit;
elsewhere (another instruction set or BLAS rounds differently) within a tolerance."""
from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import ROOT
from tools import forward_fixture as ff

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "forward_logits.npz")
compare = ff.assert_matches      # bit for bit on the fixture's machine signature, see there


@pytest.fixture(scope="module")
def saved():
    return dict(np.load(FIXTURE))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return ff.write_models(str(tmp_path_factory.mktemp("ff")), ff.models_of(ff.CONFIGS))


def test_the_fixture_covers_every_configuration(saved):
    assert sorted(k for k in saved if k != "signature") == sorted(ff.CONFIGS)
    for name in ff.CONFIGS:
        assert saved[name].shape[0] == ff.N_DECODE + 1 and np.isfinite(saved[name]).all()


@pytest.mark.parametrize("name", list(ff.CONFIGS))
def test_logits_are_the_saved_ones(saved, models, name):
    model, options = ff.CONFIGS[name]
    got = ff.run(models[model], options, n_vocab=ff.MODELS[model]["vocab_size"])
    compare(saved[name], got, str(saved["signature"]))


def test_a_changed_configuration_is_noticed(saved, models):
    """The comparison can fail: another top-k gives other logits than the saved ones."""
    model, options = ff.CONFIGS["sparse-quest-topk"]
    got = ff.run(models[model], dict(options, topk=1), n_vocab=ff.MODELS[model]["vocab_size"])
    with pytest.raises(AssertionError):
        compare(saved["sparse-quest-topk"], got, str(saved["signature"]))
