"""The device path against saved logits (tools/forward_fixture.py write-device): the simulator
computes in NumPy on the host, so on the fixture's machine signature bit for bit. Saved last when
the attention kernels took a key row per lane group (lanes over the channels, their partial dot
products summed after) and prefill tiled its query rows: the sums in that order moved the
prefill row by 5.7e-7 and the decode rows by at most 4.5e-7 of the logit scale (the greedy
tokens unchanged). Before that, fusing the decode step had moved the decode rows by at most
4.4e-7."""
import os

import numpy as np

from tools import forward_fixture as ff

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "forward_logits_device.npz")


def test_device_logits_are_the_saved_ones(tmp_path):
    saved = dict(np.load(FIXTURE))
    assert sorted(k for k in saved if k != "signature") == sorted(ff.DEVICE_CONFIGS)
    models = ff.write_models(str(tmp_path), ff.models_of(ff.DEVICE_CONFIGS))
    for name, (model, options) in ff.DEVICE_CONFIGS.items():
        got = ff.run(models[model], options, n_prompt=ff.DEVICE_PROMPT,
                     n_decode=ff.DEVICE_DECODE, n_vocab=ff.MODELS[model]["vocab_size"])
        ff.assert_matches(saved[name], got, str(saved["signature"]))
