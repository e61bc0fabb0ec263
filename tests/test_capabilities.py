"""The backends' capability table (pyimp.capabilities) is what decides "CPU only": every option
a device's backend does not run is refused when the options are validated, in one line naming
the option, and accepted on a device that runs it."""
from __future__ import annotations

import pytest

from pyimp.capabilities import CAPABILITIES, DEVICES, devices_with, refusal
from pyimp.engine import EngineOptions
from pyimp.sparse.policy import SparseOptions

# option values that need one capability each: (capability, options, the flag the error names)
ASKS = [
    ("numerics", dict(numerics="ggml"), "--numerics ggml"),
    ("kv_rotate", dict(kv_rotate=True), "--kv-rotate"),
    ("kv_policies", dict(kv_policy="h2o", kv_budget=64), "kv policy h2o"),
    ("kv_merge", dict(kv_merge=0.9), "--kv-merge"),
    ("recall_target", dict(sparse=SparseOptions(enabled=True, recall_target=0.9)),
     "--recall-target"),
    ("select_modes", dict(sparse=SparseOptions(enabled=True, select="lowrank")),
     "--select lowrank"),
]


def _has(device, capability, opts) -> bool:
    v = getattr(CAPABILITIES[device], capability)
    if capability == "numerics":
        return opts["numerics"] in v
    if capability == "kv_policies":
        return v is None or opts["kv_policy"] in v
    if capability == "select_modes":
        return v is None or opts["sparse"].select in v
    return bool(v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("capability, opts, flag", ASKS)
def test_validation_follows_the_table(device, capability, opts, flag):
    o = EngineOptions(device=device, **opts)
    if _has(device, capability, opts):
        o.validate()
    else:
        with pytest.raises(ValueError, match=flag) as e:
            o.validate()
        assert "\n" not in str(e.value)


def test_the_device_path_is_refused_what_it_lacks():
    """The table's content for the device: fp32 only, no eviction, merging, rotation, recall
    target, other selection modes, prompt caches or traces."""
    c = CAPABILITIES["cuda"]
    assert c.numerics == ("fp32",) and c.kv_policies == ("full",) and c.select_modes == ("anchors",)
    assert not (c.kv_rotate or c.kv_merge or c.recall_target or c.prompt_cache or c.trace)
    assert devices_with("trace") == ("cpu",)
    assert refusal("--prompt-cache", "prompt_cache") == "--prompt-cache runs on the CPU only (--device cpu)"


def test_an_unknown_device_is_named():
    with pytest.raises(ValueError, match="device must be one of cpu, cuda, got 'tpu'"):
        EngineOptions(device="tpu").validate()
