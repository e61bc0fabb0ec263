"""What each backend runs: one table per device. The options are checked against it once, when
they are validated (:meth:`pyimp.engine.EngineOptions.validate`), with one error line naming
the option; pyimp-run, pyimp-dump and the engine's prompt-cache calls ask the table instead of
deciding "CPU only" themselves."""
from __future__ import annotations

from dataclasses import dataclass

from .choices import NUMERICS


@dataclass(frozen=True)
class Capabilities:
    """A device's backend: what it computes (None: every value the options accept)."""

    numerics: tuple          # --numerics
    kv_policies: tuple | None  # --kv-policy (eviction)
    select_modes: tuple | None  # --select (block scoring of the sparse path)
    kv_rotate: bool          # --kv-rotate
    kv_merge: bool           # --kv-merge
    recall_target: bool      # --recall-target
    prompt_cache: bool       # --prompt-cache, save_state / load_state
    trace: bool              # pyimp-dump, Engine.trace
    layer_biases: bool       # models with q / k / v / output biases
    second_window: bool      # SparseOptions.second_window (importance2_)


CAPABILITIES = {
    "cpu": Capabilities(numerics=NUMERICS, kv_policies=None, select_modes=None,
                        kv_rotate=True, kv_merge=True, recall_target=True, prompt_cache=True,
                        trace=True, layer_biases=True, second_window=True),
    # the device keeps every token, selects a fixed top-k by the anchors, and computes in fp32
    "cuda": Capabilities(numerics=("fp32",), kv_policies=("full",), select_modes=("anchors",),
                         kv_rotate=False, kv_merge=False, recall_target=False,
                         prompt_cache=False, trace=False, layer_biases=False,
                         second_window=False),
}
DEVICES = tuple(CAPABILITIES)


def devices_with(feature: str) -> tuple:
    """The devices whose backend has ``feature`` (a boolean field of :class:`Capabilities`)."""
    return tuple(d for d, c in CAPABILITIES.items() if getattr(c, feature))


def refusal(flag: str, feature: str) -> str:
    """The one error line for ``flag`` on a device without ``feature``."""
    where = devices_with(feature)
    if where == ("cpu",):
        return f"{flag} runs on the CPU only (--device cpu)"
    return f"{flag} runs with --device {' or '.join(where)} only"


def check(opts) -> None:
    """ValueError, one line naming the option, for what ``opts`` (EngineOptions) asks of a
    device whose backend does not run it."""
    dev = opts.device
    if dev not in CAPABILITIES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {dev!r}")
    c = CAPABILITIES[dev]
    if opts.numerics not in c.numerics:
        raise ValueError(f"--numerics {opts.numerics} runs on the CPU only (--device cpu): device "
                         f"{dev} computes with {' or '.join(c.numerics)} numerics")
    if opts.kv_rotate and not c.kv_rotate:
        raise ValueError(refusal("--kv-rotate", "kv_rotate"))
    if c.kv_policies is not None and opts.kv_policy not in c.kv_policies:
        raise ValueError(f"kv policy {opts.kv_policy} runs on the CPU only (--device cpu)"
                         if dev != "cpu" else f"kv policy {opts.kv_policy} is not available")
    if opts.kv_merge and not c.kv_merge:
        raise ValueError(refusal("--kv-merge", "kv_merge"))
    sp = opts.sparse
    if sp.second_window is not None and not c.second_window:
        raise ValueError(refusal("second_window", "second_window"))
    if sp.enabled:
        if sp.recall_target > 0 and not c.recall_target:
            raise ValueError(refusal("--recall-target", "recall_target")
                             + f": the {dev} path selects a fixed --topk")
        if c.select_modes is not None and sp.select not in c.select_modes:
            raise ValueError(f"--select {sp.select} runs on the CPU only (--device cpu): the {dev} "
                             f"path selects blocks by their anchors")
