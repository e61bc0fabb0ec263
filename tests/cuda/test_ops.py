"""The element-wise and normalization kernels (pyimp.cuda.ops) against pyimp.ops' references."""
import numpy as np
import pytest

from pyimp import ops as ref_ops
from pyimp.cuda import device, ops

EPS32 = 2.0 ** -23        # float32 machine epsilon (1 ulp of 1.0)
U32 = 2.0 ** -24          # unit roundoff
TINY = np.float32(2.0 ** -149)


def run(fn, *arrays, **kw):
    """fn on device copies of arrays; the host copies of the arrays afterwards."""
    d = [device.to_device(a) for a in arrays]
    fn(*d, **kw)
    return [device.to_host(a) for a in d]


def act_inputs(rng) -> np.ndarray:
    """float32[4, 50]: normal values, wide values, and special points."""
    x = np.concatenate([rng.standard_normal(120) * 3, rng.uniform(-30, 30, 72),
                        [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 80.0, -80.0]]).astype(np.float32)
    return x.reshape(4, 50)


# ---------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("rows,n", [(3, 48), (6, 16)])
def test_rms_norm(rows, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.01, 100, (rows, 1))).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    out = np.full_like(x, np.nan)
    _, _, got = run(lambda a, b, c: ops.rms_norm(a, b, 1e-6, c), x, w, out)
    ref = ref_ops.rms_norm_ref(x, w, 1e-6)
    # the sum of squares is float32 here (float64 in the reference): relative error
    # <= gamma_n, halved by the square root; then sqrt, divide and the two products
    # round as in the reference: 4 more units
    tol = (n / 2 + 4) * U32 * np.abs(ref)
    assert np.all(np.abs(got - ref) <= tol)


def test_rms_norm_in_place():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 32)).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    dx = device.to_device(x)
    ops.rms_norm(dx, device.to_device(w), 1e-5, dx)
    ref = ref_ops.rms_norm_ref(x, w, 1e-5)
    assert np.all(np.abs(device.to_host(dx) - ref) <= (16 + 4) * U32 * np.abs(ref))


# ---------------------------------------------------------------- rope

@pytest.mark.parametrize("neox", [True, False], ids=["neox", "norm"])
@pytest.mark.parametrize("n_rot", [16, 8])
def test_rope(neox, n_rot):
    rng = np.random.default_rng(n_rot + neox)
    T, H, D = 3, 2, 16
    x = rng.standard_normal((T, H, D)).astype(np.float32)
    cos, sin = ref_ops.rope_cache(np.array([0, 7, 1000]), n_rot, 10000.0, 1.0)
    (got, _, _) = run(lambda a, c, s: ops.rope(a, c, s, neox), x, cos, sin)
    ref = ref_ops.rope_ref(x.copy(), cos, sin, neox)
    # the reference rounds x0*c - fl(x1*s) once from float64 (exact x0*c), the GPU with one
    # fused multiply-add: the same value up to the reference's second rounding, <= 1 ulp
    assert np.all(np.abs(got - ref) <= np.spacing(np.abs(ref)))
    np.testing.assert_array_equal(got[..., n_rot:], x[..., n_rot:])    # not rotated


# ---------------------------------------------------------------- activations

def test_silu():
    x = act_inputs(np.random.default_rng(2))
    (_, got) = run(lambda a, o: ops.silu(a, o), x, np.zeros_like(x))
    ref = ref_ops.silu(x)
    # libdevice expf <= 2 ulp, 1 + e (no cancellation, e > 0) and the division round
    # once each: <= 4 ulp of the result
    assert np.all(np.abs(got - ref) <= 4 * np.spacing(np.abs(ref)) + TINY)


def test_gelu_tanh_in_place():
    x = act_inputs(np.random.default_rng(3))
    (got,) = run(lambda a: ops.gelu_tanh(a), x)
    ref = ref_ops.gelu_tanh(x)
    # tanh <= 2 ulp (<= eps for |t| < 1), its argument's roundings (FMA or not) move it by
    # <= 0.45 * 4u, and 1 + t rounds once: |d(1 + t)| <= 2.5 eps, times 0.5 |x|; then the
    # products round: <= 2 ulp of the result. 1 + t cancels for x << 0, hence the |x| term
    tol = EPS32 * (2 * np.abs(x) + 4 * np.abs(ref)) + TINY
    assert np.all(np.abs(got - ref) <= tol)


def test_softcap():
    x = act_inputs(np.random.default_rng(4)) * np.float32(3)
    (_, got) = run(lambda a, o: ops.softcap(a, 30.0, o), x, np.zeros_like(x))
    ref = ref_ops.softcap(x, 30.0)
    # same float32 x * (1/cap); libdevice tanhf <= 2 ulp; times cap rounds as in the reference
    assert np.all(np.abs(got - ref) <= 4 * EPS32 * np.abs(ref) + TINY)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu(act):
    rng = np.random.default_rng(5)
    g = act_inputs(rng)
    u = rng.standard_normal(g.shape).astype(np.float32)
    (_, _, got) = run(lambda a, b, o: ops.glu(a, b, o, act), g, u, np.zeros_like(g))
    a = ref_ops.silu(g) if act == "silu" else ref_ops.gelu_tanh(g)
    ref = a * u
    # the activation's bound (see test_silu / test_gelu_tanh_in_place) times |u|, plus
    # the product's rounding
    if act == "silu":
        tol = 4 * np.spacing(np.abs(a)) * np.abs(u) + np.spacing(np.abs(ref))
    else:
        tol = EPS32 * (2 * np.abs(g) + 4 * np.abs(a)) * np.abs(u) + np.spacing(np.abs(ref))
    assert np.all(np.abs(got - ref) <= tol + TINY)


def test_add_and_scale_exact():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 70)).astype(np.float32)
    y = rng.standard_normal((3, 70)).astype(np.float32)
    (got, _) = run(ops.add, x, y)
    np.testing.assert_array_equal(got, x + y)                  # one float32 rounding each
    (got,) = run(lambda a: ops.scale(a, 0.125), x)
    np.testing.assert_array_equal(got, x * np.float32(0.125))


# ---------------------------------------------------------------- launcher checks

def test_add_rows_is_numpys_broadcast_add():
    """A projection's bias added to every row: one float32 add per element, exact."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 24)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    got, _ = run(ops.add_rows, x, b)
    np.testing.assert_array_equal(got, x + b)
    with pytest.raises(ValueError, match="b"):
        ops.add_rows(device.zeros((2, 8), np.float32), device.zeros(7, np.float32))


def test_bad_arguments_are_named():
    x = device.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="w"):
        ops.rms_norm(x, device.zeros(7, np.float32), 1e-6, x)
    with pytest.raises(ValueError, match="out"):
        ops.rms_norm(x, device.zeros(8, np.float32), 1e-6, device.zeros((2, 8), np.float64))
    with pytest.raises(ValueError, match="cos"):
        ops.rope(device.zeros((2, 1, 8), np.float32), device.zeros((2, 5), np.float32),
                 device.zeros((2, 5), np.float32), True)
    with pytest.raises(ValueError, match="sin"):
        ops.rope(device.zeros((2, 1, 8), np.float32), device.zeros((2, 4), np.float32),
                 device.zeros((2, 3), np.float32), True)
    with pytest.raises(ValueError, match="act"):
        ops.glu(x, x, x, "relu")
    with pytest.raises(ValueError, match="u"):
        ops.glu(x, device.zeros((2, 9), np.float32), x, "silu")
    with pytest.raises(ValueError, match="y"):
        ops.add(x, device.zeros(16, np.float32))
    with pytest.raises(ValueError, match="x"):
        ops.silu(device.zeros(4, np.float64))
    with pytest.raises(ValueError, match="cap"):
        ops.softcap(x, 0.0)
